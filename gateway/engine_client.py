"""Calling a model's ``LLMServer`` deployment and turning what comes back into an HTTP
response: one JSON body, or an SSE stream that always ends cleanly."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import exceptions as ray_exceptions

# The class the engine's errors are instances of: the public ErrorResponse is its subclass, so
# an isinstance check against the public name misses what vLLM's engine returns.
from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse
from ray.serve import exceptions as serve_exceptions
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.responses import Response
from vllm.exceptions import VLLMClientError

from gateway import metrics, request_context, sse
from gateway.bounds import TIMEOUT, RetryableError, overloaded, retry_after_of, timed_out
from gateway.config import TimeoutSettings
from gateway.errors import APIError, JSONBytesResponse, engine_unavailable, error_event, internal_error
from gateway.protocol import client_error, prune_nulls, response_body

logger = logging.getLogger(__name__)

# Failures that mean "no engine could take this request", not "the request was bad".
_UNAVAILABLE = (
    ray_exceptions.ActorDiedError,
    ray_exceptions.ActorUnavailableError,
    ray_exceptions.RayActorError,
    serve_exceptions.BackPressureError,
    serve_exceptions.DeploymentUnavailableError,
)

# A hook that sees each parsed stream event and returns the events to send instead
# (the output rails use it). Setting its `stopped` attribute ends the stream and cancels
# the engine call. None means pass events through.
EventFilter = Callable[[dict[str, Any]], list[dict[str, Any]]]
# A hook that rewrites a whole non-streaming response body (output rails, sources).
BodyFilter = Callable[[dict[str, Any]], dict[str, Any]]


def error_from_engine(err: ErrorResponse) -> APIError:
    info = err.error
    status = info.code if isinstance(info.code, int) and 400 <= info.code < 600 else 500
    if status >= 500:
        logger.error("engine error %s: %s", status, info.type)
        return internal_error()
    return APIError(
        status, info.message, param=getattr(info, "param", None), code="invalid_value" if status == 400 else None
    )


# vLLM's names for fields that an API method calls otherwise.
_ENGINE_PARAMS = {"responses": {"max_tokens": "max_output_tokens"}}


def _first_error(item: Any) -> ErrorResponse | None:
    if isinstance(item, ErrorResponse):
        return item
    if isinstance(item, list) and item and isinstance(item[0], ErrorResponse):
        return item[0]
    return None


class EngineClient:
    """One model's ``LLMServer`` handle, called the way Ray Serve LLM expects."""

    def __init__(self, handle: DeploymentHandle, *, timeouts: TimeoutSettings, retry_after_s: float | None = 1):
        self._base = handle
        self._stream_handle: DeploymentHandle | None = None
        self._probe = handle  # for check_health, which is not a stream
        self._timeouts = timeouts
        self._retry_after_s = retry_after_s

    @property
    def _handle(self) -> DeploymentHandle:
        # LLMServer's methods are async generators: they must be called as streams. Made on first
        # use, inside the replica's event loop: `options()` binds the handle's router to the running
        # loop, and a sync `reconfigure` (which builds engine clients) runs in a worker thread.
        if self._stream_handle is None:
            self._stream_handle = self._base.options(stream=True)
        return self._stream_handle

    async def check_health(self) -> None:
        """``LLMServer.check_health`` on one replica (it asks vLLM); raises if the engine is down."""
        await self._probe.check_health.remote()

    async def call(self, method: str, request: Any) -> tuple[Any, DeploymentResponseGenerator]:
        """Start ``method`` and wait for its first item, mapping failures to API errors.
        A stream's first item may take ``first_token_s``; a whole answer ``total_s``."""
        request_context.stamp(request)  # vLLM's request id is the caller's X-Request-Id
        stats, started = metrics.current(), time.perf_counter()
        gen: DeploymentResponseGenerator = getattr(self._handle, method).remote(request, None)
        t = self._timeouts
        wait_s = min(t.first_token_s, t.total_s) if getattr(request, "stream", False) else t.total_s
        try:
            first = await asyncio.wait_for(gen.__anext__(), wait_s)
        except asyncio.TimeoutError:
            gen.cancel()
            logger.warning("engine %s: no first item within %.3g s", method, wait_s)
            raise timed_out("engine", wait_s) from None
        except StopAsyncIteration:
            logger.error("engine %s returned nothing", method)
            raise internal_error() from None
        except serve_exceptions.BackPressureError as exc:
            logger.warning("engine queue full for %s", method)
            raise overloaded("engine", retry_after_of(exc, self._retry_after_s)) from None
        except _UNAVAILABLE as exc:
            logger.warning("engine unavailable for %s: %s", method, type(exc).__name__)
            raise engine_unavailable() from None
        except VLLMClientError as exc:  # the engine refused a value of the request (Serve re-raises the cause)
            raise client_error(exc, _ENGINE_PARAMS.get(method)) from None
        except ray_exceptions.RayTaskError as exc:
            if isinstance(exc.cause, VLLMClientError):
                raise client_error(exc.cause, _ENGINE_PARAMS.get(method)) from None
            logger.error(
                "engine %s failed before its first item: %s", method, type(exc.cause).__name__ if exc.cause else exc
            )
            raise internal_error() from None
        finally:
            if stats is not None:  # the engine's share, which the overhead header leaves out
                stats.engine_calls += 1
                stats.engine_s += time.perf_counter() - started
        error = _first_error(first)
        if error is not None:
            gen.cancel()
            raise error_from_engine(error)
        if not isinstance(first, list):  # a whole answer: its call ends before it is sent
            await _finish_call(gen)
        return first, gen

    async def respond(
        self,
        method: str,
        request: Any,
        *,
        event_filter: EventFilter | None = None,
        body_filter: BodyFilter | None = None,
        headers: dict[str, str] | None = None,
        meter: Any = None,
    ) -> Response:
        """``meter`` (gateway/limits.py ``Meter``, when a key's limits apply) counts the tokens,
        bounds the answer by the key's budget and settles with the limiter."""
        if meter is not None:
            meter.prepare(request)  # before ask_for_usage: it reads what the client asked for
            event_filter = meter.wrap(event_filter)
        strip_usage = metrics.ask_for_usage(request)  # tokens are counted for every stream
        first, gen = await self.call(method, request)
        if not isinstance(first, list):  # non-streaming: a single response object
            body = response_body(first)
            metrics.note_usage(body.get("usage"))
            if meter is not None:
                meter.charge_body(body)
            return JSONBytesResponse(body_filter(body) if body_filter else body, headers=headers)
        stream = relay_stream(
            first,
            gen,
            event_filter,
            idle_s=self._timeouts.stream_idle_s,
            total_s=self._timeouts.total_s,
            observer=metrics.stream_observer(),
            strip_usage=strip_usage,
        )
        if meter is not None:
            meter.follow_stream()
        return sse.EventStream(stream, headers, on_close=meter.close if meter is not None else None)


async def _finish_call(gen: DeploymentResponseGenerator, wait_s: float = 1.0) -> None:
    """Let a one-item engine call end before its answer is sent, so the replica's slot is free
    by the time the client can send its next request (else a client that sends requests one
    after another can meet its own finished request still counted against
    ``max_ongoing_requests``). Cancelled if it has not ended within ``wait_s``."""
    try:
        async with asyncio.timeout(wait_s):
            async for _ in gen:
                pass
    except TimeoutError:
        gen.cancel()
    except Exception as exc:  # the answer is already in hand; the call's end is not worth a 500
        logger.debug("engine call ended with %s after its answer", type(exc).__name__)


async def relay_stream(
    first: list[Any],
    gen: DeploymentResponseGenerator,
    event_filter: EventFilter | None = None,
    *,
    idle_s: float | None = None,
    total_s: float | None = None,
    observer: metrics.StreamObserver | None = None,
    strip_usage: bool = False,
) -> AsyncIterator[str]:
    """Forward an engine stream as OpenAI SSE, always ending with ``[DONE]``.

    If the client goes away, the engine call is cancelled so vLLM stops generating.
    If the engine fails mid-stream, or sends nothing for ``idle_s``, or the stream outlives
    ``total_s``, the client gets an error event and ``[DONE]`` (and the engine call is
    cancelled) instead of a hung or truncated connection.

    ``observer`` notes tokens, output times and the relay's own time (gateway/metrics.py);
    ``strip_usage`` drops the usage chunk the gateway asked for and the client did not.
    """
    finished = False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total_s if total_s is not None else None
    try:
        batch = first
        while True:
            if observer is not None:
                observer.busy()
            out = []
            for payload in sse.parse_events(p for p in batch if isinstance(p, str)):
                if payload is None:
                    continue  # we send our own single [DONE]
                if "error" in payload:
                    raise _StreamError(payload["error"])
                if observer is not None:
                    observer.engine_event(payload)
                    if strip_usage and not payload.get("choices"):
                        continue
                events = [payload] if event_filter is None else event_filter(payload)
                if observer is not None:
                    observer.sent(events, event_filter is not None)
                out.extend(sse.event(prune_nulls(e)) for e in events)
            if observer is not None:
                observer.idle()
            if getattr(event_filter, "stopped", False):
                # A rail ended the answer: stop the engine before telling the client.
                gen.cancel()
                finished = True
                if observer is not None:
                    observer.stats.cut = True
                yield "".join(out) + sse.DONE
                return
            if out:
                yield "".join(out)
            try:
                batch = await _next_within(gen, idle_s, deadline, loop)
            except StopAsyncIteration:
                break
            if _first_error(batch) is not None:
                raise _StreamError(_first_error(batch).error.model_dump())
        finished = True
        yield sse.DONE
    except _StreamError as exc:
        finished = True
        logger.error("engine reported an error mid-stream: %s", exc.info.get("type"))
        _note_error(observer, internal_error())
        yield error_event(internal_error()) + sse.DONE
    except _StreamTimeout as exc:
        # Stop the engine first: the client may read the error and leave at once.
        gen.cancel()
        finished = True
        logger.warning("stream ended: %s", exc.error.message)
        _note_error(observer, exc.error)
        yield error_event(exc.error) + sse.DONE
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:  # engine replica crashed or the engine raised mid-stream
        finished = True
        logger.error("stream failed mid-way: %s", type(exc).__name__)
        err = engine_unavailable() if isinstance(exc, _UNAVAILABLE) else internal_error()
        _note_error(observer, err)
        yield error_event(err) + sse.DONE
    finally:
        if not finished:
            # The client disconnected (or a filter stopped the stream): stop the engine.
            gen.cancel()


def _note_error(observer: metrics.StreamObserver | None, error: APIError) -> None:
    if observer is not None:  # the status was 200 already: the code tells the failure apart
        observer.stats.error_code = error.code or "error"


async def _next_within(
    gen: DeploymentResponseGenerator, idle_s: float | None, deadline: float | None, loop: asyncio.AbstractEventLoop
) -> Any:
    """The stream's next item, waiting at most ``idle_s`` and never past ``deadline``."""
    if idle_s is None and deadline is None:
        return await gen.__anext__()
    left = deadline - loop.time() if deadline is not None else None
    idle_first = left is None or (idle_s is not None and idle_s < left)
    try:
        return await asyncio.wait_for(gen.__anext__(), idle_s if idle_first else max(left, 0))
    except asyncio.TimeoutError:
        message = (
            f"The engine sent nothing for {idle_s:g} s; the answer was stopped."
            if idle_first
            else "The answer took longer than this server allows; it was stopped."
        )
        raise _StreamTimeout(RetryableError(504, message, code="engine_timeout", type=TIMEOUT)) from None


class _StreamTimeout(Exception):
    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


class _StreamError(Exception):
    def __init__(self, info: dict[str, Any]):
        super().__init__(info.get("message", "engine error"))
        self.info = info
