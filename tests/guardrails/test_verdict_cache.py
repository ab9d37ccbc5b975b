"""The verdict cache (guardrails replica and ingress): bounded, per policy version, deterministic verdicts only."""

from __future__ import annotations

from guardrails.verdict import PolicyCode, Verdict, VerdictCache, combine


def test_bounded_lru():
    cache = VerdictCache(entries=3)
    keys = [VerdictCache.key("v1", f"text {i}") for i in range(4)]
    for k in keys[:3]:
        cache.put(k, Verdict.allow("pii"))
    assert cache.get(keys[0]) is not None  # now most recently used
    cache.put(keys[3], Verdict.allow("pii"))
    assert len(cache) == 3
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None


def test_a_new_policy_version_never_sees_old_verdicts():
    cache = VerdictCache()
    cache.put(VerdictCache.key("v1", "hello"), Verdict.allow("pii"))
    assert cache.get(VerdictCache.key("v1", "hello")) is not None
    assert cache.get(VerdictCache.key("v2", "hello")) is None
    assert cache.get(VerdictCache.key("v1", "hello!")) is None


def test_failures_are_not_remembered():
    cache = VerdictCache()
    for verdict in (
        Verdict.block("injection", PolicyCode.RAIL_ERROR, "rail failed"),
        Verdict.block("time_budget", PolicyCode.RAIL_ERROR, "out of time"),
        Verdict.allow_failed("time_budget"),
        Verdict.allow_failed("embedding"),
        Verdict.allow_failed("setup"),
        combine([Verdict.allow("pii"), Verdict.allow_failed("injection")]),
        combine([Verdict.redact("pii", "<EMAIL>", "email"), Verdict.allow_failed("injection")]),
    ):
        assert verdict.failed_open or verdict.code is PolicyCode.RAIL_ERROR
        key = VerdictCache.key("v1", verdict.rail + verdict.reason)
        cache.put(key, verdict)
        assert cache.get(key) is None
    blocked = Verdict.block("pii", PolicyCode.PII_BLOCKED, "detected credit_card")
    cache.put(VerdictCache.key("v1", "x"), blocked)
    assert cache.get(VerdictCache.key("v1", "x")) == blocked
