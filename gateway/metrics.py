"""What the gateway itself costs, per request: Prometheus series through Ray's metrics export,
the ``x-gateway-overhead-ms`` response header, and the readiness probe.

One ``RequestStats`` follows each HTTP request (a context variable set by ``ObservedRequests``,
the outermost ASGI middleware). The route and the stages fill it in as the request passes
(model, time waiting for the engine, stage latencies, tokens, the stream's first token);
the middleware reads it when the response starts (the overhead header) and when it ends (the
series). Every series is a ``ray.serve.metrics`` metric, exported by Ray on each node's metrics
port as ``ray_gateway_*`` with Serve's ``deployment``/``replica``/``application`` tags; the
engine's own series (``ray_vllm_*``) and Serve's (``ray_serve_*``) are not repeated here.

Overhead, in milliseconds outside the engine:
- not streamed: the time from the request's arrival in the ingress to the response's start,
  minus the time spent waiting for the engine's answer (which includes Serve's hop to the
  ``LLMServer`` replica and back);
- streamed: the same up to the response's start, which is sent once the engine's first item
  arrived: the stages and parsing before the engine call, plus relaying that first item. The
  time the gateway spends on each later chunk (parsing the engine's SSE, output rails,
  serialising) is measured separately and exported per output token
  (``gateway_stream_overhead_per_token_ms``); a header cannot carry it, it is sent first.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from ray import serve

from gateway.errors import UNAVAILABLE, JSONBytesResponse
from guardrails.metrics import counter, histogram

logger = logging.getLogger(__name__)

OVERHEAD_HEADER = "x-gateway-overhead-ms"
_OVERHEAD_HEADER_BYTES = OVERHEAD_HEADER.encode()
# On every response unless a route set its own: bodies are never sniffed as another type (a
# model's answer is not HTML), and neither answers nor errors are kept by caches in between
# (the chat page's files set their own Cache-Control).
_SAFETY_HEADERS = ((b"x-content-type-options", b"nosniff"), (b"cache-control", b"no-store"))

_LATENCY_MS = [5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000]
_OVERHEAD_MS = [0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 250, 1000]
_PER_TOKEN_MS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10]
_TPOT_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
_STAGE_MS = [0.5, 1, 2, 5, 10, 20, 50, 100, 250, 500, 1000, 5000]


class GatewayMetrics:
    """The ingress's series (created inside the replica, so Serve's tags are filled in)."""

    def __init__(self) -> None:
        self.requests = counter(
            "gateway_requests",
            description="Requests by route, model, HTTP status and error code ('' when none).",
            tag_keys=("route", "model", "status", "code"),
        )
        self.latency = histogram(
            "gateway_request_latency_ms",
            description="End-to-end latency in the ingress, arrival to last byte sent.",
            boundaries=_LATENCY_MS,
            tag_keys=("route", "model", "stream"),
        )
        self.ttft = histogram(
            "gateway_time_to_first_token_ms",
            description="Streams: arrival to the first generated output sent to the client.",
            boundaries=_LATENCY_MS,
            tag_keys=("route", "model"),
        )
        self.tpot = histogram(
            "gateway_time_per_output_token_ms",
            description="Streams: (last output - first output) / (output tokens - 1), as the client sees it.",
            boundaries=_TPOT_MS,
            tag_keys=("route", "model"),
        )
        self.tokens = counter(
            "gateway_tokens",
            description="Tokens by model and direction (prompt, completion), from the engine's usage.",
            tag_keys=("model", "direction"),
        )
        self.streams_cut = counter(
            "gateway_streams_cut",
            description="Answers an output rail cut (finish_reason content_filter).",
            tag_keys=("route", "model"),
        )
        self.overhead = histogram(
            "gateway_overhead_ms",
            description="Milliseconds outside the engine until the response started (the x-gateway-overhead-ms header).",
            boundaries=_OVERHEAD_MS,
            tag_keys=("route", "model", "stream"),
        )
        self.stream_per_token = histogram(
            "gateway_stream_overhead_per_token_ms",
            description="Streams: the gateway's own time relaying the engine's chunks, per output token.",
            boundaries=_PER_TOKEN_MS,
            tag_keys=("model",),
        )
        self.holdback = histogram(
            "gateway_output_rail_holdback_ms",
            description="Streams with output rails: first generated output from the engine to its release.",
            boundaries=_STAGE_MS,
            tag_keys=("model",),
        )
        self.stage = histogram(
            "gateway_stage_latency_ms",
            description="Stages seen from the ingress (including Serve's hop): input_rails, retrieval_search, passage_check.",
            boundaries=_STAGE_MS,
            tag_keys=("stage", "model"),
        )

    def observe(self, stats: RequestStats, route: str, status: int, code: str) -> None:
        """Publish one finished request."""
        model, now = stats.model, time.perf_counter()
        stream = "true" if stats.stream else "false"
        self.requests.inc(tags={"route": route, "model": model, "status": str(status), "code": code})
        self.latency.observe((now - stats.started) * 1000, tags={"route": route, "model": model, "stream": stream})
        for name, seconds in stats.stages:
            self.stage.observe(seconds * 1000, tags={"stage": name, "model": model})
        if stats.engine_calls:
            self.overhead.observe(stats.overhead_ms, tags={"route": route, "model": model, "stream": stream})
        if stats.prompt_tokens:  # Ray's Counter.inc refuses 0
            self.tokens.inc(stats.prompt_tokens, tags={"model": model, "direction": "prompt"})
        if stats.completion_tokens:
            self.tokens.inc(stats.completion_tokens, tags={"model": model, "direction": "completion"})
        if not stats.stream:
            return
        if stats.cut:
            self.streams_cut.inc(tags={"route": route, "model": model})
        if stats.first_output is not None:
            self.ttft.observe((stats.first_output - stats.started) * 1000, tags={"route": route, "model": model})
            tokens = stats.completion_tokens or stats.output_events
            if tokens > 1 and stats.last_output is not None:
                per_token = (stats.last_output - stats.first_output) * 1000 / (tokens - 1)
                self.tpot.observe(per_token, tags={"route": route, "model": model})
            if tokens:
                self.stream_per_token.observe(stats.relay_s * 1000 / tokens, tags={"model": model})
        if stats.holdback_s is not None:
            self.holdback.observe(stats.holdback_s * 1000, tags={"model": model})


@dataclass(slots=True)
class RequestStats:
    """What one request did, filled in along its path (times from ``time.perf_counter``)."""

    started: float
    model: str = ""
    stream: bool = False
    engine_calls: int = 0
    engine_s: float = 0.0  # waiting for the engine's first item (non-streamed: its whole answer)
    overhead_ms: float = 0.0  # set when the response starts
    stages: list[tuple[str, float]] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    output_events: int = 0  # stream events carrying generated output (a token each, from vLLM)
    first_output: float | None = None
    last_output: float | None = None
    first_engine_output: float | None = None
    holdback_s: float | None = None
    relay_s: float = 0.0  # the relay's own time on the stream after the first item
    cut: bool = False
    error_code: str = ""


_current: contextvars.ContextVar[RequestStats | None] = contextvars.ContextVar("gateway_request_stats", default=None)


def current() -> RequestStats | None:
    """This request's stats, or None outside a request (tests calling helpers directly)."""
    return _current.get()


def note_model(model_id: str) -> None:
    stats = _current.get()
    if stats is not None:
        stats.model = model_id


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Time one stage of this request (exported as ``gateway_stage_latency_ms{stage=name}``)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        stats = _current.get()
        if stats is not None:
            stats.stages.append((name, time.perf_counter() - started))


def note_usage(usage: dict[str, Any] | None) -> None:
    """A non-streamed answer's ``usage``."""
    stats = _current.get()
    if stats is not None and usage:
        stats.prompt_tokens = usage.get("prompt_tokens")
        stats.completion_tokens = usage.get("completion_tokens")


def ask_for_usage(request: Any) -> bool:
    """Make a streamed request end with the engine's usage chunk, so tokens are counted for
    every stream. True when the client did not ask for it: the relay then drops that chunk."""
    options = getattr(request, "stream_options", None)
    if not getattr(request, "stream", False) or (options is not None and options.include_usage):
        return False
    from vllm.entrypoints.generate.base.protocol import StreamOptions

    request.stream_options = (
        StreamOptions(include_usage=True) if options is None else options.model_copy(update={"include_usage": True})
    )
    return True


def stream_observer() -> StreamObserver | None:
    stats = _current.get()
    return StreamObserver(stats) if stats is not None else None


def _carries_output(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:
            if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls") or delta.get("refusal"):
                return True
        elif choice.get("text"):
            return True
    return False


class StreamObserver:
    """The relay's notes on one stream: output timing, tokens, the rail's holdback, its own time."""

    __slots__ = ("stats", "_busy_since")

    def __init__(self, stats: RequestStats):
        self.stats = stats
        stats.stream = True
        self._busy_since = 0.0

    def busy(self) -> None:
        """A batch of engine events arrived: the gateway's own time starts."""
        self._busy_since = time.perf_counter()

    def idle(self) -> None:
        """Handing the batch to the server (or waiting for the engine): the gateway's time stops."""
        if self._busy_since:
            self.stats.relay_s += time.perf_counter() - self._busy_since
            self._busy_since = 0.0

    def engine_event(self, event: dict[str, Any]) -> None:
        stats = self.stats
        usage = event.get("usage")
        if usage and not event.get("choices"):
            stats.prompt_tokens = usage.get("prompt_tokens")
            stats.completion_tokens = usage.get("completion_tokens")
        elif stats.first_engine_output is None and _carries_output(event):
            stats.first_engine_output = time.perf_counter()

    def sent(self, events: list[dict[str, Any]], filtered: bool) -> None:
        stats = self.stats
        for event in events:
            if event.get("choices") and _carries_output(event):
                now = time.perf_counter()
                stats.output_events += 1
                stats.last_output = now
                if stats.first_output is None:
                    stats.first_output = now
                    if filtered and stats.first_engine_output is not None:
                        stats.holdback_s = now - stats.first_engine_output


class ObservedRequests:
    """Outermost ASGI middleware: times every request, adds the overhead header, and publishes
    the request's series when it ends. The metrics live on the ingress replica's Gateway
    (``metrics`` attribute); outside a replica nothing is published."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stats = RequestStats(started=time.perf_counter())
        token = _current.set(stats)
        status = 500
        error_body: list[bytes] | None = None

        async def observed_send(message: dict) -> None:
            nonlocal status, error_body
            if message["type"] == "http.response.start":
                status = message["status"]
                stats.overhead_ms = max(0.0, (time.perf_counter() - stats.started - stats.engine_s) * 1000)
                value = f"{stats.overhead_ms:.2f}".encode()
                headers = [*message.get("headers", ()), (_OVERHEAD_HEADER_BYTES, value)]
                present = {name.lower() for name, _ in headers}
                headers += [h for h in _SAFETY_HEADERS if h[0] not in present]
                message = {**message, "headers": headers}
                if status >= 400:
                    error_body = []
            elif error_body is not None and message["type"] == "http.response.body":
                error_body.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            _current.reset(token)
            try:
                _publish(scope, stats, status, error_body)
            except Exception:  # metrics must never fail a request
                logger.exception("could not record request metrics")


def _publish(scope: dict, stats: RequestStats, status: int, error_body: list[bytes] | None) -> None:
    gateway = serve.get_replica_context().servable_object
    metrics: GatewayMetrics | None = getattr(gateway, "metrics", None)
    if metrics is None:
        return
    route = getattr(scope.get("route"), "path", None) or "unmatched"
    code = stats.error_code
    if error_body is not None:
        try:
            code = orjson.loads(b"".join(error_body))["error"]["code"] or ""
        except Exception:
            code = "unknown"
    metrics.observe(stats, route, status, code)


def readiness_checks(engines: dict[str, Any], **stages: Any) -> dict[str, Callable[[], Awaitable[Any]]]:
    """The parts ``/ready`` checks: ``engine:<model>`` for each ``EngineClient``, and each stage
    deployment handle given (None for a stage that is off), by ``check_health``."""
    checks: dict[str, Callable[[], Awaitable[Any]]] = {f"engine:{m}": e.check_health for m, e in engines.items()}
    checks.update({name: handle.check_health.remote for name, handle in stages.items() if handle is not None})
    return checks


class Readiness:
    """Whether every part a request needs answers: each model's engine (``LLMServer``'s own
    ``check_health``, which asks vLLM), the guardrails, retrieval and embedding deployments.

    Each check is bounded by ``timeout_s``; results are reused for ``cache_s`` so that probes
    from several load balancers (the route needs no key) cost one round of checks."""

    def __init__(
        self,
        checks: Callable[[], dict[str, Callable[[], Awaitable[Any]]]],
        *,
        timeout_s: float = 2.0,
        cache_s: float = 1.0,
    ):
        self._checks = checks  # called per round: the models served may change
        self._timeout_s = timeout_s
        self._cache_s = cache_s
        self._last: tuple[float, dict[str, str]] | None = None
        self._running: asyncio.Future | None = None

    async def states(self) -> dict[str, str]:
        """``part -> "ok" | "timeout" | "unavailable"``."""
        if self._last is not None and time.monotonic() - self._last[0] < self._cache_s:
            return self._last[1]
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._check_all())
        # Shielded: a probe that gives up does not cancel the round others wait for.
        return await asyncio.shield(self._running)

    async def response(self) -> JSONBytesResponse:
        states = await self.states()
        failed = sorted(part for part, state in states.items() if state != "ok")
        if not failed:
            return JSONBytesResponse({"status": "ready", "checks": states})
        error = {
            "message": "Not ready: " + ", ".join(f"{part} {states[part]}" for part in failed) + ".",
            "type": UNAVAILABLE,
            "param": None,
            "code": "not_ready",
        }
        return JSONBytesResponse({"error": error, "status": "not_ready", "checks": states}, status_code=503)

    async def _check_all(self) -> dict[str, str]:
        checks = self._checks()
        results = await asyncio.gather(*(self._check(name, check) for name, check in checks.items()))
        states = dict(zip(checks, results))
        self._last = (time.monotonic(), states)
        return states

    async def _check(self, name: str, check: Callable[[], Awaitable[Any]]) -> str:
        try:
            await asyncio.wait_for(_awaited(check), self._timeout_s)
            return "ok"
        except asyncio.TimeoutError:
            logger.warning("readiness: %s did not answer within %.1fs", name, self._timeout_s)
            return "timeout"
        except Exception as exc:
            logger.warning("readiness: %s failed: %s", name, type(exc).__name__)
            return "unavailable"


async def _awaited(check: Callable[[], Awaitable[Any]]) -> Any:
    return await check()
