"""Per-key limits in the ingress: a dependency of the app itself (``enforce_limits``), so no route
can forget them, in front of the shared ``Limiter`` deployment (gateway/limiter.py).

A request asks the limiter once (requests, tokens and concurrency per key and per model, and
the key's budget). Refused: 429 with OpenAI's body and headers (``Retry-After``,
``x-ratelimit-*``), which the openai SDK's retries understand. Admitted: the answer carries the
same ``x-ratelimit-*`` headers, and a ``Meter`` follows it to count its tokens from the engine's
usage, to cut a stream where the key's budget ends (``finish_reason: "length"``; the relay then
cancels the engine call), and to settle with the limiter when the answer ends or the client
leaves (the slot is freed then).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import Request
from ray import serve
from ray.serve.handle import DeploymentHandle

from gateway import metrics
from gateway.auth import Principal
from gateway.errors import UNAVAILABLE, APIError
from gateway.limiter import INSUFFICIENT_QUOTA, Ask, ScopeAsk, Settlement, Verdict, Window
from gateway.limiter_config import KeyLimits, LimitsSettings
from guardrails.metrics import counter

logger = logging.getLogger(__name__)

# Routes whose body names a model (per-model limits) and whose usage is charged.
MODEL_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"})
HEADERS_STATE = "ratelimit_headers"
METER_STATE = "limit_meter"
LENGTH = "length"


class RateLimited(APIError):
    """429 as OpenAI sends it: ``type`` requests/tokens (or insufficient_quota), the code, and
    headers the SDK reads (``retry-after-ms``, ``Retry-After``; ``x-should-retry: false`` when
    retrying cannot help, i.e. a spent budget)."""

    def __init__(self, verdict: Verdict):
        quota = verdict.code == INSUFFICIENT_QUOTA
        kind = "insufficient_quota" if quota else ("tokens" if verdict.limit in ("tokens", "budget") else "requests")
        super().__init__(429, verdict.message, type=kind, code=verdict.code)
        self.headers = ratelimit_headers(verdict)
        if verdict.retry_after_s is not None:
            self.headers["Retry-After"] = str(max(1, math.ceil(verdict.retry_after_s)))
            self.headers["retry-after-ms"] = str(max(1, math.ceil(verdict.retry_after_s * 1000)))
        if quota:
            self.headers["x-should-retry"] = "false"


def duration(seconds: float) -> str:
    """OpenAI's reset format (Go's durations): ``20ms``, ``1.5s``, ``6m0s``."""
    ms = max(0, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{hours}h{minutes}m{secs}" if hours else (f"{minutes}m{secs}" if minutes else secs)


def ratelimit_headers(verdict: Verdict) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind, window in (("requests", verdict.requests), ("tokens", verdict.tokens)):
        if window is not None:
            headers.update(_window_headers(kind, window))
    return headers


def _window_headers(kind: str, w: Window) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(w.limit),
        f"x-ratelimit-remaining-{kind}": str(w.remaining),
        f"x-ratelimit-reset-{kind}": duration(w.reset_s),
    }


def limiter_unavailable() -> APIError:
    error = APIError(
        503, "The rate limiter is unavailable; retry shortly.", type=UNAVAILABLE, code="limiter_unavailable"
    )
    error.headers = {"Retry-After": "1"}  # read by gateway.http's APIError handler
    return error


async def enforce_limits(request: Request) -> AsyncIterator[None]:
    """The app-wide dependency (after ``authenticate``): admit or refuse, then settle when the
    response has been sent or the client went away."""
    principal: Principal | None = getattr(request.state, "principal", None)
    limits: RequestLimits | None = None
    if principal is not None:  # public paths carry no principal and no limits
        limits = getattr(serve.get_replica_context().servable_object, "limits", None)
    meter = await limits.admit(request, principal) if limits is not None else None
    try:
        yield
    finally:
        # A stream settles when its response ends (``Meter.close``, gateway/sse.py): this may
        # run as soon as the route has returned its response, before the body is sent.
        if meter is not None and not meter.streaming:
            meter.finish()


def meter_of(request: Request) -> Meter | None:
    """The request's meter, for the engine call (None when no limit applies to it)."""
    return getattr(request.state, METER_STATE, None)


class RequestLimits:
    """The ingress side: which limits apply to a request, the one call to the limiter, and what
    happens when the limiter cannot answer. ``resolve(name)`` gives a model name's
    ``(model_id, default max_tokens)``, or None for a name that is not a served model."""

    def __init__(
        self,
        settings: LimitsSettings,
        limiter: DeploymentHandle | None,
        resolve: Callable[[str], tuple[str, int | None] | None],
        max_request_bytes: int,
        lifetime_s: float | None = None,
    ):
        """``lifetime_s``: the longest a request can last; its lease expires after that."""
        self._settings = settings
        self._lifetime_s = lifetime_s
        self._limiter = limiter
        self._resolve = resolve
        self._max_bytes = max_request_bytes
        self._pending: set[asyncio.Task] = set()
        self._refusals = counter(
            "gateway_limit_refusals",
            description="Requests refused by a per-key limit (429), by limit and key.",
            tag_keys=("limit", "principal"),
        )
        self._failures = counter(
            "gateway_limiter_failures",
            description="Limiter calls that failed or timed out, by what was done (open: served; closed: 503).",
            tag_keys=("outcome",),
        )
        self._last_failure_log = 0.0
        if limiter is not None:
            # The first call through a handle sets up its router: do it now, not on a request.
            task = asyncio.get_event_loop().create_task(self._warm_up())
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _warm_up(self) -> None:
        try:
            await asyncio.wait_for(self._limiter.budget_used.remote("", ""), 60)
        except Exception as exc:
            logger.warning("the rate limiter did not answer its first call: %s", type(exc).__name__)

    def limits_for(self, principal: Principal) -> KeyLimits:
        own = getattr(principal, "limits", None)
        return own.over(self._settings.default) if own is not None else self._settings.default

    async def admit(self, request: Request, principal: Principal) -> Meter | None:
        limits = self.limits_for(principal)
        if not limits.active or self._limiter is None:
            return None
        ask = await self._ask(request, principal.name, limits)
        if ask is None:
            return None
        call = asyncio.ensure_future(self._admit(ask))
        self._pending.add(call)
        call.add_done_callback(self._pending.discard)
        try:
            with metrics.stage("limiter"):
                verdict: Verdict = await asyncio.wait_for(asyncio.shield(call), self._settings.limiter_timeout_s)
        except BaseException as exc:
            # Timed out, or the client left meanwhile: the limiter may still admit the request
            # later, and that lease would hold its slot until lease_ttl_s. Give it back then.
            call.add_done_callback(lambda done: self._give_back(done, ask.key))
            if not isinstance(exc, Exception):
                raise
            outcome = self._settings.on_limiter_failure
            self._failures.inc(tags={"outcome": outcome})
            now = time.monotonic()
            if now - self._last_failure_log > 5:
                self._last_failure_log = now
                logger.error("rate limiter unavailable (%s); failing %s", type(exc).__name__, outcome)
            if outcome == "closed":
                raise limiter_unavailable() from None
            return None
        if not verdict.allowed:
            self._refusals.inc(tags={"limit": verdict.limit or "", "principal": principal.name})
            raise RateLimited(verdict)
        setattr(request.state, HEADERS_STATE, ratelimit_headers(verdict))
        meter = Meter(self, ask.key, verdict)
        setattr(request.state, METER_STATE, meter)
        return meter

    async def _admit(self, ask: Ask) -> Verdict:
        return await self._limiter.admit.remote(ask)

    def _give_back(self, call: asyncio.Future, key: str) -> None:
        """A lease granted after its request stopped waiting for it: settled at once, no tokens."""
        if call.cancelled() or call.exception() is not None:
            return
        verdict: Verdict = call.result()
        if verdict.allowed and verdict.lease is not None:
            self.settle(Settlement(verdict.lease, key, 0, 0, verdict.period))

    async def _ask(self, request: Request, key: str, limits: KeyLimits) -> Ask | None:
        model_id, estimate, open_ended = None, 0, False
        # The matched route's path (the URL's may carry the application's route prefix).
        path = getattr(request.scope.get("route"), "path", request.url.path)
        if request.method == "POST" and path in MODEL_PATHS:
            body = await _peek_body(request, self._max_bytes)
            data = _json_object(body)
            name = data.get("model") if data else None
            resolved = self._resolve(name) if isinstance(name, str) else None
            estimate = len(body or b"")
            if resolved is not None and path != "/v1/embeddings":
                model_id, default_max = resolved
                most = (
                    data.get("max_completion_tokens")
                    or data.get("max_tokens")
                    or data.get("max_output_tokens")  # /v1/responses
                    or default_max
                )
                n = data.get("n") if isinstance(data.get("n"), int) and data.get("n") > 0 else 1
                if not isinstance(most, int) or most <= 0:
                    most, open_ended = self._settings.completion_estimate_tokens, True
                estimate += n * most
        scopes = []
        if any(getattr(limits, k) is not None for k in _RATE_FIELDS):
            scopes.append(_scope(key, limits))
        per_model = limits.models.get(model_id) if model_id is not None else None
        if per_model is not None and per_model.active:
            scopes.append(_scope(f"{key}\x00{model_id}", per_model))
        budget = limits.budget
        if not scopes and budget is None:
            return None
        return Ask(
            key=key,
            scopes=tuple(scopes),
            estimate=estimate,
            budget_tokens=budget.tokens if budget else None,
            budget_period=budget.period if budget else "day",
            open_ended=open_ended,
            lifetime_s=self._lifetime_s,
        )

    def settle(self, settlement: Settlement) -> None:
        """Sent now, awaited by nobody on the request path."""
        if self._limiter is None:
            return
        task = asyncio.get_running_loop().create_task(self._send(settlement))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(self, settlement: Settlement) -> None:
        try:
            await asyncio.wait_for(self._limiter.settle.remote(settlement), 30)
        except Exception as exc:
            self._failures.inc(tags={"outcome": "settle_lost"})
            logger.error("could not settle a request with the limiter: %s", type(exc).__name__)


_RATE_FIELDS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests")


def _scope(name: str, limits) -> ScopeAsk:
    return ScopeAsk(name, limits.requests_per_minute, limits.tokens_per_minute, limits.concurrent_requests)


async def _peek_body(request: Request, max_bytes: int) -> bytes | None:
    """The body, read at most to ``max_bytes`` and replayed to whoever reads the request next
    (the route, through its own size-bounded reader). Past the limit the route answers 413."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            break
    data = bytes(body)
    original, replayed = request.receive, False

    async def replay() -> dict:
        nonlocal replayed
        if replayed:
            return await original()  # after the body: disconnect notices
        replayed = True
        return {"type": "http.request", "body": data, "more_body": False}

    # Starlette keeps no public way to put a read body back: this request replays it from
    # `_body`, and requests built over its `receive` (gateway.protocol.bounded) from `replay`.
    request._body = data
    request._receive = replay
    return data


def _json_object(body: bytes | None) -> dict[str, Any] | None:
    if not body:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


class Meter:
    """One admitted request's tokens, its budget allowance, and its settlement (sent once)."""

    def __init__(self, owner: RequestLimits, key: str, verdict: Verdict):
        self._owner = owner
        self._key = key
        self.lease = verdict.lease
        self.allowance = verdict.allowance
        self._period = verdict.period
        self.prompt = 0
        self.completion = 0
        self.exact = False  # the engine reported usage (otherwise output events are counted)
        self.usage_wanted = False
        self.continuous_wanted = False
        self.streaming = False
        self._tokens: Callable[[], tuple[int, int]] | None = None
        self._settled = False

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion

    def prepare(self, request: Any) -> None:
        """Before the engine call: streams report usage on every chunk (what the client did
        not ask for is removed again); a non-streamed answer is bounded by the budget."""
        if getattr(request, "stream", False):
            from vllm.entrypoints.generate.base.protocol import StreamOptions

            options = request.stream_options
            self.usage_wanted = bool(options and options.include_usage)
            self.continuous_wanted = self.usage_wanted and bool(options.continuous_usage_stats)
            request.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
        elif self.allowance is not None:
            fields = type(request).model_fields
            for name in ("max_completion_tokens", "max_tokens"):
                if name in fields:
                    current = getattr(request, name)
                    setattr(request, name, min(current, self.allowance) if current else self.allowance)

    def bound(self, body: dict[str, Any], field: str) -> None:
        """A JSON body's output cap (``max_output_tokens`` of /v1/responses), streamed or not,
        lowered to the budget's allowance: the engine stops there."""
        if self.allowance is not None:
            current = body.get(field)
            body[field] = min(current, self.allowance) if isinstance(current, int) and current > 0 else self.allowance

    def charge(self, prompt: int, completion: int) -> None:
        """The request's tokens, counted by the route (settled when it ends)."""
        self.prompt, self.completion, self.exact = prompt, completion, True

    def wrap(self, inner: Callable | None) -> MeteredStream:
        return MeteredStream(self, inner)

    def follow_stream(self, tokens: Callable[[], tuple[int, int]] | None = None) -> None:
        """The answer is a stream: it settles in ``close``, which the stream's response calls
        when it ends however it ends, not when the route returns (that is before the body is
        sent). ``tokens`` gives (prompt, completion) when the route counts them itself."""
        self.streaming = True
        self._tokens = tokens

    def close(self) -> None:
        if self._tokens is not None and not self._settled:
            self.charge(*self._tokens())
        self.finish()

    def charge_body(self, body: dict[str, Any]) -> None:
        usage = body.get("usage") or {}
        self.prompt = usage.get("prompt_tokens") or 0
        self.completion = usage.get("completion_tokens") or 0
        self.exact = bool(usage)
        self.finish()

    def finish(self) -> None:
        """Settle with the limiter: frees the slot, charges the tokens (idempotent)."""
        if self._settled:
            return
        self._settled = True
        tokens = self.tokens
        budget = min(tokens, self.allowance) if self.allowance is not None else 0
        self._owner.settle(Settlement(self.lease, self._key, tokens, budget, self._period))


class MeteredStream:
    """An ``EventFilter`` in front of the route's own (the output rails): counts tokens from the
    engine's events, removes the usage the client did not ask for, and cuts the stream where
    the budget allowance ends. Its ``stopped`` makes the relay cancel the engine call."""

    def __init__(self, meter: Meter, inner: Callable | None):
        self._meter = meter
        self._inner = inner
        self._open: set[int] = set()
        self.cut = False

    @property
    def stopped(self) -> bool:
        return self.cut or bool(getattr(self._inner, "stopped", False))

    def __call__(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        m = self._meter
        if self.cut:
            return []
        usage = event.get("usage")
        choices = event.get("choices") or []
        if usage:
            m.exact = True
            m.prompt = usage.get("prompt_tokens") or m.prompt
            m.completion = usage.get("completion_tokens") or 0
        elif not m.exact and _carries_output(choices):
            m.completion += 1  # one event per token and choice (vLLM's streaming)
        for choice in choices:
            (self._open.discard if choice.get("finish_reason") else self._open.add)(choice.get("index", 0))
        events: list[dict[str, Any]] = [event]
        if usage is not None:
            if not choices:  # the engine's last word: the request's total
                events = [event] if m.usage_wanted else []
                m.finish()
            elif not m.continuous_wanted:
                events = [{k: v for k, v in event.items() if k != "usage"}]
        if m.allowance is not None and m.tokens >= m.allowance:
            events = self._cut(event, events)
        if self._inner is None:
            return events
        out: list[dict[str, Any]] = []
        for e in events:
            out.extend(self._inner(e))
        return out

    def _cut(self, event: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """End every open choice with ``length`` where the allowance ends."""
        m = self._meter
        self.cut = True
        if m.tokens > m.allowance and m.exact:
            events = []  # this event's tokens are past the budget: not sent, not charged
        m.completion = max(0, min(m.completion, m.allowance - m.prompt))
        chat = event.get("object") == "chat.completion.chunk"
        base = {k: event[k] for k in ("id", "object", "created", "model") if k in event}
        for index in sorted(self._open):
            end = {"delta": {}} if chat else {"text": ""}
            events.append({**base, "choices": [{"index": index, **end, "logprobs": None, "finish_reason": LENGTH}]})
        self._open.clear()
        if m.usage_wanted:
            usage = {"prompt_tokens": m.prompt, "completion_tokens": m.completion, "total_tokens": m.tokens}
            events.append({**base, "choices": [], "usage": usage})
        m.finish()
        return events


def _carries_output(choices: list[dict[str, Any]]) -> bool:
    for choice in choices:
        delta = choice.get("delta")
        if delta is not None:
            if any(v for k, v in delta.items() if k != "role"):
                return True
        elif choice.get("text"):
            return True
    return False


class RateLimitHeaders:
    """ASGI middleware: the ``x-ratelimit-*`` headers of an admitted request on its response."""

    def __init__(self, app: Callable):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                extra = (scope.get("state") or {}).get(HEADERS_STATE)
                if extra:
                    present = {k.lower() for k, _ in message.get("headers", ())}
                    added = [(k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in present]
                    message = {**message, "headers": [*message.get("headers", ()), *added]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
