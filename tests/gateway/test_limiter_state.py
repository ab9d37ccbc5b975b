"""Per-key limits without Ray: the Limiter's state (sliding windows, token reservations,
budgets, leases, the keys file) and the ingress side's handling of a limiter that answers late.
The same limits through the real Serve app are in test_limits.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import yaml

# --- the limiter's logic, without Ray ----------------------------------------------------


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _state(window_s=60.0):
    from gateway.limiter import LimiterState

    clock = _Clock()
    return LimiterState(window_s, 3600, clock=clock), clock


def _ask(key="k", estimate=0, rpm=None, tpm=None, conc=None, budget=None, open_ended=False):
    from gateway.limiter import Ask, ScopeAsk

    return Ask(key, (ScopeAsk(key, rpm, tpm, conc),), estimate, budget, "day", open_ended)


def test_sliding_window_admits_exactly_the_limit_per_window():
    state, clock = _state()
    admitted = []
    for _ in range(180):  # two asks a second for 90 s, at 50 a minute
        v = state.admit(_ask(rpm=50))
        if v.allowed:
            admitted.append(clock.t)
        else:
            assert v.code == "rate_limit_exceeded" and 0 < v.retry_after_s <= 60
        clock.t += 0.5
    # The first 50 at once; then each slot again 60 s after it was taken.
    assert len(admitted) == 100
    assert max(sum(1 for t in admitted if start <= t < start + 60) for start in admitted) == 50


def test_token_reservations_bound_the_overshoot_to_one_request():
    from gateway.limiter import Settlement

    state, clock = _state()
    leases = []
    for _ in range(5):  # five concurrent requests, each estimated (and using) 40 tokens
        v = state.admit(_ask(estimate=40, tpm=100))
        if v.allowed:
            leases.append(v.lease)
    assert len(leases) == 3  # 0, 40, 80 reserved when admitted; 120 >= 100 refuses the rest
    for lease in leases:
        state.settle(Settlement(lease, "k", 40))
    assert state.admit(_ask(estimate=1, tpm=100)).limit == "tokens"
    assert 3 * 40 <= 100 + 40  # the limit, plus at most the last admitted request


def test_budget_allowance_and_refusals():
    from gateway.limiter import Settlement

    state, _ = _state()
    first = state.admit(_ask(estimate=30, budget=50))
    assert first.allowed and first.allowance == 30
    second = state.admit(_ask(estimate=30, budget=50))
    assert second.allowed and second.allowance == 20  # what is left unreserved
    held = state.admit(_ask(estimate=30, budget=50))
    assert not held.allowed and held.code == "rate_limit_exceeded"  # reserved by requests in flight
    state.settle(Settlement(first.lease, "k", 30, 30, first.period))
    state.settle(Settlement(second.lease, "k", 25, 20, second.period))
    spent = state.admit(_ask(estimate=1, budget=50))
    assert not spent.allowed and spent.code == "insufficient_quota"
    # A new day starts a new budget.
    assert state.admit(_ask(estimate=1, budget=50), wall=time.time() + 86400).allowed


def test_a_lease_never_settled_expires_when_its_request_must_be_over():
    """A slot whose settlement never arrives is freed after the request's longest life (its
    stages' timeouts), not after the limiter-wide lease_ttl_s (3600 s here)."""
    import dataclasses

    state, clock = _state()
    ask = dataclasses.replace(_ask(conc=1), lifetime_s=40.0)
    assert state.admit(ask).allowed  # and never settled
    clock.t += 39
    assert not state.admit(ask).allowed
    clock.t += 2
    assert state.admit(ask).allowed
    # Without a lifetime, lease_ttl_s applies.
    state, clock = _state()
    assert state.admit(_ask(conc=1)).allowed
    clock.t += 3599
    assert not state.admit(_ask(conc=1)).allowed


def test_the_lease_lifetime_covers_every_stage_of_a_request():
    from gateway.config import TimeoutSettings

    t = TimeoutSettings(guardrails_s=1, retrieval_s=2, first_token_s=3, stream_idle_s=4, total_s=5)
    assert t.longest_request_s == 2 * 1 + 2 + 5  # input rails, retrieval, passages' check, engine


def test_budgets_persist_atomically(tmp_path):
    from gateway.limiter import read_budgets, write_budgets

    path = tmp_path / "limits" / "budgets.json"
    assert read_budgets(path) == {}
    write_budgets(path, {"alice": ["2026-11-30", 12]})
    assert read_budgets(path) == {"alice": ["2026-11-30", 12]}
    assert [p.name for p in path.parent.iterdir()] == ["budgets.json"]
    path.write_text("{broken")
    with pytest.raises(RuntimeError, match="budgets"):
        read_budgets(path)


def test_reset_durations_as_openai_writes_them():
    from gateway.limits import duration

    assert [duration(s) for s in (0.02, 1, 1.5, 360, 3725)] == ["20ms", "1s", "1.5s", "6m0s", "1h2m5s"]


def test_key_limits_override_defaults_field_by_field():
    from gateway.limiter_config import KeyLimits

    default = KeyLimits(requests_per_minute=10, tokens_per_minute=1000, models={"a": {"requests_per_minute": 2}})
    own = KeyLimits.model_validate({"tokens_per_minute": None, "models": {"b": {"concurrent_requests": 1}}})
    merged = own.over(default)
    assert (merged.requests_per_minute, merged.tokens_per_minute) == (10, None)
    assert merged.models["a"].requests_per_minute == 2 and merged.models["b"].concurrent_requests == 1


def test_limits_in_files_are_strict(tmp_path):
    from gateway.auth import read_keys_file
    from gateway.config import GatewayConfig

    keys = tmp_path / "keys.yaml"
    keys.write_text(
        yaml.safe_dump({"principals": [{"name": "a", "key_sha256": "0" * 64, "limits": {"request_per_minute": 5}}]})
    )
    with pytest.raises(ValueError, match="request_per_minute"):
        read_keys_file(keys)
    keys.write_text(
        yaml.safe_dump({"principals": [{"name": "a", "key_sha256": "0" * 64, "limits": {"budget": {"tokens": 9}}}]})
    )
    assert read_keys_file(keys)["0" * 64].limits.budget.period == "day"
    with pytest.raises(ValueError):
        GatewayConfig.model_validate({"limits": {"on_limiter_failure": "maybe"}})


# --- the ingress side, with a stand-in limiter handle over the real LimiterState ----------


class _SlowLimiter:
    """A limiter handle whose ``admit`` answer arrives ``delay_s`` after the limiter decided
    (a loaded limiter replica, or a slow way back)."""

    def __init__(self, state, delay_s: float):
        import types

        async def admit(ask):
            verdict = state.admit(ask)  # the limiter has decided (and holds the slot) ...
            await asyncio.sleep(delay_s)  # ... but its answer is slow to come back
            return verdict

        async def settle(settlement):
            state.settle(settlement)

        async def budget_used(key, period):
            return state.used(key, period) if key else 0

        self.admit = types.SimpleNamespace(remote=admit)
        self.settle = types.SimpleNamespace(remote=settle)
        self.budget_used = types.SimpleNamespace(remote=budget_used)


@pytest.mark.parametrize("how", ["timed out", "client left"])
def test_a_lease_granted_after_its_request_stopped_waiting_is_given_back(how):
    """A limiter that answers after the ingress stopped waiting (its timeout, or the client
    went away) must not keep the slot it granted: it would stay held until lease_ttl_s."""
    from gateway.limiter_config import LimitsSettings
    from gateway.limits import RequestLimits

    state, _ = _state()
    ask = _ask(conc=1)

    async def scenario():
        settings = LimitsSettings(
            default={"concurrent_requests": 1},
            limiter_timeout_s=0.05 if how == "timed out" else 5,
            on_limiter_failure="open",
        )
        limits = RequestLimits(settings, _SlowLimiter(state, 0.3), lambda name: None, 1 << 16)

        async def fake_ask(*_):
            return ask

        limits._ask = fake_ask
        principal = type("P", (), {"name": "k", "limits": None})()
        request = type("R", (), {"state": type("S", (), {})()})()
        if how == "timed out":
            assert await limits.admit(request, principal) is None  # served without limits
        else:
            waiting = asyncio.ensure_future(limits.admit(request, principal))
            await asyncio.sleep(0.1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        await asyncio.sleep(0.6)  # the limiter has answered, and the late lease was settled

    asyncio.run(scenario())
    assert state.admit(ask).allowed, "the late lease still holds the key's only slot"
