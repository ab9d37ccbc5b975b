"""Rail outcomes, rail errors and rail latency: in-process counters (``RailMetrics``, pure
Python, for unit tests and any caller) and the same exported through Ray's metrics
(``ExportedRailMetrics``, in the guardrails replicas and for the output rails in the ingress);
and ``Deferred``, how every series of ours reaches Ray: recorded by a background thread."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from guardrails.verdict import Verdict

logger = logging.getLogger(__name__)

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
        self._verdicts = counter(
            "gateway_guardrail_verdicts",
            description="Guardrail verdicts by rail and outcome.",
            tag_keys=("rail", "outcome"),
        )
        self._errors = counter(
            "gateway_guardrail_errors", description="Exceptions raised inside guardrails.", tag_keys=("rail",)
        )
        self._latency = histogram(
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


class Deferred:
    """A Ray metric (``ray.serve.metrics`` / ``ray.util.metrics``) whose records are made by one
    background thread per process instead of the caller's.

    Ray's ``record`` releases the GIL. On the ingress's event loop every release lets a thread
    waiting for the GIL (an encoder's, finishing its ONNX run) take it, and the loop then waits
    until that thread lets go: in a profile of the rails-and-search path, 9% of the loop's busy
    samples were inside ``record``, mostly taking the GIL back. Here the caller only appends to a
    deque (no GIL release), and the recorder thread makes the records every
    ``Recorder.interval_s``, far inside Ray's export interval. The records and their tags are
    the same; only when they are made moves. Tags are taken as given: a Serve metric fills a
    missing ``route`` tag from the request context, which the recorder thread does not have,
    so a series with a ``route`` tag must be passed it (every one of ours is)."""

    __slots__ = ("_metric",)

    def __init__(self, metric: Any) -> None:
        self._metric = metric

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        RECORDER.put(self._metric.inc, value, tags)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        RECORDER.put(self._metric.observe, value, tags)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        RECORDER.put(self._metric.set, value, tags)


def counter(name: str, description: str, tag_keys: tuple[str, ...]) -> Deferred:
    """A ``ray.serve.metrics.Counter`` recorded through the recorder thread (``Deferred``):
    how every counter of ours is made. Create it inside a replica (Serve's tags)."""
    from ray.serve.metrics import Counter

    return Deferred(Counter(name, description=description, tag_keys=tag_keys))


def histogram(name: str, description: str, boundaries: list[float], tag_keys: tuple[str, ...]) -> Deferred:
    """A ``ray.serve.metrics.Histogram`` recorded through the recorder thread (``Deferred``)."""
    from ray.serve.metrics import Histogram

    return Deferred(Histogram(name, description=description, boundaries=boundaries, tag_keys=tag_keys))


class Recorder:
    """The queue of deferred records and the daemon thread that makes them. Bounded: past
    ``max_pending`` records (the thread starved for seconds) the oldest are dropped, counted in
    ``dropped`` and logged."""

    interval_s = 0.2

    def __init__(self, max_pending: int = 65536) -> None:
        self._pending: deque[tuple[Callable[..., None], float, dict[str, str] | None]] = deque(maxlen=max_pending)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        # A child forked after the first record has no recorder thread: it starts its own.
        os.register_at_fork(after_in_child=self._forget_thread)

    def put(self, call: Callable[..., None], value: float, tags: dict[str, str] | None) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10000 == 0:
                logger.warning("metrics: %d records dropped, the recorder thread is falling behind", self.dropped)
        self._pending.append((call, value, tags))
        if self._thread is None:
            self._start()

    def flush(self) -> None:
        """Make every queued record now (the thread's loop; tests call it to read at once)."""
        while True:
            try:
                call, value, tags = self._pending.popleft()
            except IndexError:
                return
            try:
                call(value, tags=tags)
            except Exception as exc:  # a bad record must not stop the others (tags, not text)
                name = getattr(getattr(call, "__self__", None), "_name", "?")
                logger.error("metrics: a record of %s failed: %r", name, exc)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="gateway-metrics-recorder", daemon=True)
                thread.start()
                self._thread = thread

    def _forget_thread(self) -> None:
        self._thread = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self.flush()


RECORDER = Recorder()
