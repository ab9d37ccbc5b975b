"""In-process counters for rail outcomes and rail errors; the deployment exports them to Prometheus."""

from __future__ import annotations

import threading
from collections import Counter

from guardrails.verdict import Verdict


class RailMetrics:
    """Thread-safe counters keyed by (rail, outcome). Outcome is a verdict action or ``error``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def record_verdict(self, verdict: Verdict) -> None:
        """Count one verdict under its rail and action."""
        with self._lock:
            self._counts[(verdict.rail, verdict.action.value)] += 1

    def record_error(self, rail: str) -> None:
        """Count one exception raised inside a rail."""
        with self._lock:
            self._counts[(rail, "error")] += 1

    def errors(self, rail: str | None = None) -> int:
        """Errors for one rail, or for all rails."""
        with self._lock:
            return sum(n for (r, outcome), n in self._counts.items() if outcome == "error" and rail in (None, r))

    def snapshot(self) -> dict[tuple[str, str], int]:
        """A copy of every counter, for an exporter to publish."""
        with self._lock:
            return dict(self._counts)
