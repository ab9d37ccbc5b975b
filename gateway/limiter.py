"""The shared limiter: one Serve deployment that holds every key's windows, concurrency slots and
budgets, so the counts hold however many ingress replicas there are.

Each request costs one awaited call (``admit``) and one call nobody waits for (``settle``, sent
when the answer ends). ``LimiterState`` is the logic, without Ray, so it is unit-testable;
``Limiter`` wraps it as a deployment and persists budgets.

Windows are sliding logs over ``window_s``: a request is admitted while fewer than the limit of
requests (or tokens) are in the last window. Tokens are charged from the engine's usage when a
request ends; while it runs, its estimate is reserved, so concurrent requests cannot all slip
under a token limit at once (see README "Limits" for the bound).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ray import serve

from retrieval.persistence import atomic_write

logger = logging.getLogger(__name__)

RATE_LIMITED = "rate_limit_exceeded"
INSUFFICIENT_QUOTA = "insufficient_quota"
# Retry hint when what blocks a request is held by requests in flight (a slot, reserved tokens).
IN_FLIGHT_RETRY_S = 1.0


@dataclass(frozen=True)
class ScopeAsk:
    """One scope's limits for this request: the key (``name`` = key) or the key on a model."""

    name: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    concurrent_requests: int | None


@dataclass(frozen=True)
class Ask:
    key: str
    scopes: tuple[ScopeAsk, ...]
    estimate: int  # tokens this request may use (reserved while it runs)
    budget_tokens: int | None = None
    budget_period: str = "day"
    open_ended: bool = False  # no max_tokens known: a budget reserves all that is left
    # The request cannot outlive this (its stages' timeouts): its lease expires then at the
    # latest, so a slot whose settlement never came is not held for the whole lease_ttl_s.
    lifetime_s: float | None = None


@dataclass(frozen=True)
class Window:
    """What a response's ``x-ratelimit-*`` headers say about one kind (requests or tokens)."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    lease: str | None = None
    code: str | None = None  # rate_limit_exceeded | insufficient_quota when refused
    limit: str | None = None  # requests | tokens | concurrency | budget
    message: str = ""
    retry_after_s: float | None = None
    requests: Window | None = None
    tokens: Window | None = None
    allowance: int | None = None  # budget tokens this request may use
    period: str | None = None  # the budget period it is charged to


@dataclass(frozen=True)
class Settlement:
    lease: str
    key: str
    tokens: int  # prompt + completion, from the engine's usage
    budget_tokens: int = 0  # charged to the budget (never more than the allowance)
    period: str | None = None


class _Log:
    """(time, amount) entries within the window, and their sum."""

    __slots__ = ("entries", "total")

    def __init__(self) -> None:
        self.entries: deque[tuple[float, int]] = deque()
        self.total = 0

    def trim(self, since: float) -> None:
        entries = self.entries
        while entries and entries[0][0] <= since:
            self.total -= entries.popleft()[1]

    def add(self, t: float, amount: int) -> None:
        if amount > 0:
            self.entries.append((t, amount))
            self.total += amount

    def wait_until_at_most(self, level: int, now: float, window_s: float) -> float | None:
        """Seconds until the sum falls to ``level`` or below, or None if expiry alone never gets there."""
        total = self.total
        for t, amount in self.entries:
            if total <= level:
                break
            total -= amount
            if total <= level:
                return max(0.0, t + window_s - now)
        return 0.0 if total <= level else None


@dataclass
class _Scope:
    requests: _Log = field(default_factory=_Log)
    tokens: _Log = field(default_factory=_Log)
    inflight: int = 0
    reserved: int = 0  # token estimates of requests in flight


@dataclass
class _Lease:
    key: str
    scopes: tuple[str, ...]
    token_scopes: tuple[str, ...]
    estimate: int
    budget_reserved: int
    expires: float


def period_of(kind: str, wall: float) -> str:
    day = datetime.fromtimestamp(wall, timezone.utc)
    return day.strftime("%Y-%m-%d") if kind == "day" else day.strftime("%Y-%m")


def seconds_to_period_end(kind: str, wall: float) -> float:
    now = datetime.fromtimestamp(wall, timezone.utc)
    start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if kind == "day":
        end = start.timestamp() + 86400
    else:
        end = start.replace(day=1, month=start.month % 12 + 1, year=start.year + (start.month == 12)).timestamp()
    return max(1.0, end - wall)


class LimiterState:
    """Every key's windows, slots, reservations and budget use (no Ray, no I/O)."""

    def __init__(
        self, window_s: float, lease_ttl_s: float, budgets: dict[str, list] | None = None, *, clock=time.monotonic
    ):
        self.window_s = window_s
        self.lease_ttl_s = lease_ttl_s
        self.budgets: dict[str, list] = budgets or {}  # key -> [period, used]
        self._clock = clock
        self._scopes: dict[str, _Scope] = {}
        self._leases: dict[str, _Lease] = {}
        self._budget_reserved: dict[str, int] = {}
        self._next_sweep = 0.0

    def admit(self, ask: Ask, wall: float | None = None) -> Verdict:
        now = self._clock()
        self._sweep(now)
        since = now - self.window_s
        scopes = []
        for s in ask.scopes:
            st = self._scopes.get(s.name)
            if st is None:
                st = self._scopes[s.name] = _Scope()
            st.requests.trim(since)
            st.tokens.trim(since)
            scopes.append((s, st))
        for s, st in scopes:
            refusal = self._check(s, st, now)
            if refusal is not None:
                return self._refused(scopes, now, *refusal)
        allowance = period = None
        budget_reserved = 0
        if ask.budget_tokens is not None:
            wall = time.time() if wall is None else wall
            period = period_of(ask.budget_period, wall)
            used = self.used(ask.key, period)
            if used >= ask.budget_tokens:
                return self._refused(
                    scopes,
                    now,
                    "budget",
                    f"You exceeded your token budget ({ask.budget_tokens} tokens per {ask.budget_period}).",
                    seconds_to_period_end(ask.budget_period, wall),
                    INSUFFICIENT_QUOTA,
                )
            free = ask.budget_tokens - used - self._budget_reserved.get(ask.key, 0)
            if free <= 0:
                return self._refused(
                    scopes,
                    now,
                    "budget",
                    "The rest of this key's budget is held by requests in progress.",
                    IN_FLIGHT_RETRY_S,
                )
            allowance = free if ask.open_ended else min(free, ask.estimate)
            budget_reserved = allowance
            self._budget_reserved[ask.key] = self._budget_reserved.get(ask.key, 0) + allowance
        token_scopes = []
        for s, st in scopes:
            if s.requests_per_minute is not None:
                st.requests.add(now, 1)
            if s.tokens_per_minute is not None:
                st.reserved += ask.estimate
                token_scopes.append(s.name)
            st.inflight += 1
        lease = uuid.uuid4().hex
        self._leases[lease] = _Lease(
            ask.key,
            tuple(s.name for s, _ in scopes),
            tuple(token_scopes),
            ask.estimate,
            budget_reserved,
            now + min(self.lease_ttl_s, ask.lifetime_s or self.lease_ttl_s),
        )
        requests, tokens = self._headers(scopes, now)
        return Verdict(True, lease, requests=requests, tokens=tokens, allowance=allowance, period=period)

    def settle(self, s: Settlement) -> bool:
        """Free the lease's slot and reservations and charge its tokens; True if a budget changed."""
        now = self._clock()
        lease = self._leases.pop(s.lease, None)
        if lease is not None:
            self._release(lease)
            for name in lease.token_scopes:
                st = self._scopes.get(name)
                if st is not None:
                    st.tokens.add(now, s.tokens)
        # Charged even for a lease this limiter does not know (it restarted meanwhile): budgets
        # are what must survive.
        if s.budget_tokens > 0 and s.period is not None:
            entry = self.budgets.get(s.key)
            if entry is None or entry[0] != s.period:
                entry = self.budgets[s.key] = [s.period, 0]
            entry[1] += s.budget_tokens
            return True
        return False

    def used(self, key: str, period: str) -> int:
        entry = self.budgets.get(key)
        return entry[1] if entry is not None and entry[0] == period else 0

    # --- helpers ------------------------------------------------------------------

    def _check(self, s: ScopeAsk, st: _Scope, now: float) -> tuple | None:
        w = self.window_s
        if s.concurrent_requests is not None and st.inflight >= s.concurrent_requests:
            return ("concurrency", f"Too many concurrent requests (limit {s.concurrent_requests}).", IN_FLIGHT_RETRY_S)
        if s.requests_per_minute is not None and st.requests.total >= s.requests_per_minute:
            oldest = st.requests.entries[0][0]
            return ("requests", f"Rate limit reached: {s.requests_per_minute} requests per {w:g} s.", oldest + w - now)
        if s.tokens_per_minute is not None and st.tokens.total + st.reserved >= s.tokens_per_minute:
            level = s.tokens_per_minute - st.reserved - 1
            wait = st.tokens.wait_until_at_most(level, now, w) if level >= 0 else None
            return (
                "tokens",
                f"Rate limit reached: {s.tokens_per_minute} tokens per {w:g} s.",
                wait if wait is not None else IN_FLIGHT_RETRY_S,
            )
        return None

    def _refused(self, scopes, now, limit, message, retry_after_s, code=RATE_LIMITED) -> Verdict:
        requests, tokens = self._headers(scopes, now)
        return Verdict(
            False,
            code=code,
            limit=limit,
            message=message,
            retry_after_s=retry_after_s,
            requests=requests,
            tokens=tokens,
        )

    def _headers(self, scopes, now: float) -> tuple[Window | None, Window | None]:
        """The tightest scope's numbers, for requests and for tokens."""
        requests = tokens = None
        w = self.window_s
        for s, st in scopes:
            if s.requests_per_minute is not None:
                log = st.requests
                reset = log.entries[-1][0] + w - now if log.entries else 0.0
                win = Window(s.requests_per_minute, max(0, s.requests_per_minute - log.total), max(0.0, reset))
                if requests is None or win.remaining < requests.remaining:
                    requests = win
            if s.tokens_per_minute is not None:
                log = st.tokens
                reset = log.entries[-1][0] + w - now if log.entries else 0.0
                left = max(0, s.tokens_per_minute - log.total - st.reserved)
                win = Window(s.tokens_per_minute, left, max(0.0, reset))
                if tokens is None or win.remaining < tokens.remaining:
                    tokens = win
        return requests, tokens

    def _release(self, lease: _Lease) -> None:
        for name in lease.scopes:
            st = self._scopes.get(name)
            if st is None:
                continue
            st.inflight = max(0, st.inflight - 1)
            if name in lease.token_scopes:
                st.reserved = max(0, st.reserved - lease.estimate)
        if lease.budget_reserved:
            left = self._budget_reserved.get(lease.key, 0) - lease.budget_reserved
            if left > 0:
                self._budget_reserved[lease.key] = left
            else:
                self._budget_reserved.pop(lease.key, None)

    def _sweep(self, now: float) -> None:
        """Free leases of ingress replicas that died, and forget idle scopes (at most once a second)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        for lease_id in [k for k, v in self._leases.items() if v.expires <= now]:
            logger.warning("freeing a request slot whose ingress never settled it")
            self._release(self._leases.pop(lease_id))
        since = now - self.window_s
        for name in list(self._scopes):
            st = self._scopes[name]
            st.requests.trim(since)
            st.tokens.trim(since)
            if not st.inflight and not st.reserved and not st.requests.entries and not st.tokens.entries:
                del self._scopes[name]


# --- persistence ------------------------------------------------------------------


def read_budgets(path: Path) -> dict[str, list]:
    """The budget file: ``{key: [period, used]}``; a missing file is an empty one."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        # Refuse to start rather than hand every key a fresh budget.
        raise RuntimeError(f"{path}: cannot read the budgets file ({exc})") from None
    if not isinstance(data, dict):
        raise RuntimeError(f"{path}: the budgets file is not a JSON object")
    return {k: [str(v[0]), int(v[1])] for k, v in data.items()}


def write_budgets(path: Path, budgets: dict[str, list]) -> None:
    """Atomically: a new file, fsynced, renamed over the old one (a crash leaves either)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(budgets, separators=(",", ":")).encode())


@serve.deployment(name="Limiter", num_replicas=1, max_ongoing_requests=4096)
class Limiter:
    """The shared limiter. One replica: it is the single place the counts live (its calls cost
    microseconds; an ingress replica's call is one Serve hop). Budgets are written to
    ``budget_file`` after every charge, coalesced, so a restart keeps them."""

    def __init__(self, window_s: float, lease_ttl_s: float, budget_file: str):
        self._path = Path(budget_file)
        self._state = LimiterState(window_s, lease_ttl_s, read_budgets(self._path))
        self._dirty = False
        self._writer: asyncio.Task | None = None

    async def admit(self, ask: Ask) -> Verdict:
        return self._state.admit(ask)

    async def settle(self, settlement: Settlement) -> None:
        if self._state.settle(settlement):
            self._dirty = True
            if self._writer is None or self._writer.done():
                self._writer = asyncio.get_running_loop().create_task(self._write())

    async def budget_used(self, key: str, period: str) -> int:
        return self._state.used(key, period)

    async def _write(self) -> None:
        while self._dirty:
            self._dirty = False
            snapshot = {k: list(v) for k, v in self._state.budgets.items()}
            try:
                await asyncio.to_thread(write_budgets, self._path, snapshot)
            except OSError:
                logger.exception("could not persist budgets to %s", self._path)
