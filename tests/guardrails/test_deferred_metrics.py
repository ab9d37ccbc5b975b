"""``Deferred``: our Ray metric records are made by the recorder thread, never the caller's
(Ray's record releases the GIL, which costs the ingress's event loop its turn). The series
themselves, through Ray's export, are checked in ``tests/gateway/test_metrics.py``."""

from __future__ import annotations

import threading
import time

from guardrails.metrics import RECORDER, Deferred, Recorder


class _Metric:
    """Stands in for a Ray metric: remembers each record and the thread that made it."""

    def __init__(self, fail_on: float | None = None) -> None:
        self.records: list[tuple[str, float, dict | None, str]] = []
        self.fail_on = fail_on

    def _record(self, kind: str, value: float, tags: dict | None) -> None:
        if value == self.fail_on:
            raise ValueError("unrecognised tag")
        self.records.append((kind, value, tags, threading.current_thread().name))

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self._record("inc", value, tags)

    def observe(self, value: float, tags: dict | None = None) -> None:
        self._record("observe", value, tags)

    def set(self, value: float, tags: dict | None = None) -> None:
        self._record("set", value, tags)


def test_records_are_made_later_by_the_recorder_thread_with_the_same_values_and_tags():
    metric = _Metric()
    deferred = Deferred(metric)
    deferred.inc(tags={"rail": "pii", "outcome": "allow"})
    deferred.observe(2.5, tags={"rail": "injection"})
    deferred.set(7, tags=None)
    deadline = time.monotonic() + 10
    while len(metric.records) < 3:
        assert time.monotonic() < deadline, metric.records
        time.sleep(0.05)
    assert [r[:3] for r in metric.records] == [
        ("inc", 1.0, {"rail": "pii", "outcome": "allow"}),
        ("observe", 2.5, {"rail": "injection"}),
        ("set", 7, None),
    ]
    # made on the recorder's thread, never on the caller's
    assert {r[3] for r in metric.records} == {"gateway-metrics-recorder"}
    assert RECORDER.interval_s < 1  # far inside Ray's export interval (seconds)


def test_a_failing_record_does_not_stop_the_others():
    recorder, metric = Recorder(), _Metric(fail_on=2.0)
    for value in (1.0, 2.0, 3.0):
        recorder.put(metric.observe, value, None)
    recorder.flush()
    assert [r[1] for r in metric.records] == [1.0, 3.0]


def test_the_queue_is_bounded_and_counts_what_it_dropped():
    recorder, metric = Recorder(max_pending=4), _Metric()
    recorder._thread = threading.current_thread()  # no background thread: flush by hand
    for value in range(10):
        recorder.put(metric.inc, float(value), None)
    assert recorder.dropped == 6
    recorder.flush()
    assert [r[1] for r in metric.records] == [6.0, 7.0, 8.0, 9.0]  # the newest kept
