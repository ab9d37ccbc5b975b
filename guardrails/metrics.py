"""Rail outcomes, rail errors and rail latency: in-process counters (``RailMetrics``, pure
Python, for unit tests and any caller) and the same exported through Ray's metrics
(``ExportedRailMetrics``, in the guardrails replicas and for the output rails in the ingress)."""

from __future__ import annotations

import threading
import time
from collections import Counter

from guardrails.verdict import Verdict

# Rail latency buckets, in milliseconds: regex rails take microseconds, a classifier milliseconds.
_RAIL_MS = [0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000]


class RailMetrics:
    """Thread-safe counters keyed by (rail, outcome). Outcome is a verdict action or ``error``.

    Latency per rail is timed by laps: ``lap()`` marks the start of one text's rails in this
    thread; each verdict recorded after it is timed from the previous mark (the rails of one
    text run one after another, each ending with its verdict). Without a mark (the output
    rails), verdicts are counted but not timed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._seconds: Counter[str] = Counter()
        self._laps = threading.local()

    def lap(self) -> None:
        """Mark the start of a text's rails in the calling thread."""
        self._laps.mark = time.perf_counter()

    def record_verdict(self, verdict: Verdict) -> None:
        """Count one verdict under its rail and action (and time it, after a ``lap``)."""
        with self._lock:
            self._counts[(verdict.rail, verdict.action.value)] += 1
        mark = getattr(self._laps, "mark", None)
        if mark is not None:
            now = time.perf_counter()
            self._laps.mark = now
            self.record_latency(verdict.rail, now - mark)

    def record_error(self, rail: str) -> None:
        """Count one exception raised inside a rail."""
        with self._lock:
            self._counts[(rail, "error")] += 1

    def record_latency(self, rail: str, seconds: float) -> None:
        """Time spent in one rail (or ``embedding``: encoding the texts the rails need)."""
        with self._lock:
            self._seconds[rail] += seconds

    def errors(self, rail: str | None = None) -> int:
        """Errors for one rail, or for all rails."""
        with self._lock:
            return sum(n for (r, outcome), n in self._counts.items() if outcome == "error" and rail in (None, r))

    def snapshot(self) -> dict[tuple[str, str], int]:
        """A copy of every counter, for an exporter to publish."""
        with self._lock:
            return dict(self._counts)

    def seconds(self) -> dict[str, float]:
        """Total time per rail so far."""
        with self._lock:
            return dict(self._seconds)


class ExportedRailMetrics(RailMetrics):
    """RailMetrics that also feeds Ray's metrics export: ``ray_gateway_guardrail_verdicts_total
    {rail,outcome}``, ``ray_gateway_guardrail_errors_total{rail}`` and
    ``ray_gateway_rail_latency_ms{rail}``. Create it inside a Serve replica (Serve's tags)."""

    def __init__(self) -> None:
        super().__init__()
        from ray.serve.metrics import Counter, Histogram

        self._verdicts = Counter(
            "gateway_guardrail_verdicts",
            description="Guardrail verdicts by rail and outcome.",
            tag_keys=("rail", "outcome"),
        )
        self._errors = Counter(
            "gateway_guardrail_errors", description="Exceptions raised inside guardrails.", tag_keys=("rail",)
        )
        self._latency = Histogram(
            "gateway_rail_latency_ms",
            description="Time in each input rail per text (and 'embedding': encoding the texts).",
            boundaries=_RAIL_MS,
            tag_keys=("rail",),
        )

    def record_verdict(self, verdict: Verdict) -> None:
        super().record_verdict(verdict)
        self._verdicts.inc(tags={"rail": verdict.rail, "outcome": verdict.action.value})

    def record_error(self, rail: str) -> None:
        super().record_error(rail)
        self._errors.inc(tags={"rail": rail})

    def record_latency(self, rail: str, seconds: float) -> None:
        super().record_latency(rail, seconds)
        self._latency.observe(seconds * 1000, tags={"rail": rail})
