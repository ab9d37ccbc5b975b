"""Calling a model's ``LLMServer`` deployment and turning what comes back into an HTTP
response: one JSON body, or an SSE stream that always ends cleanly."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import exceptions as ray_exceptions
from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse
from ray.serve import exceptions as serve_exceptions
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.responses import Response, StreamingResponse

from gateway import sse
from gateway.errors import APIError, JSONBytesResponse, engine_unavailable, error_event, internal_error
from gateway.protocol import prune_nulls, response_body

logger = logging.getLogger(__name__)

# Failures that mean "no engine could take this request", not "the request was bad".
_UNAVAILABLE = (
    ray_exceptions.ActorDiedError,
    ray_exceptions.ActorUnavailableError,
    ray_exceptions.RayActorError,
    serve_exceptions.BackPressureError,
    serve_exceptions.DeploymentUnavailableError,
)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

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


def _first_error(item: Any) -> ErrorResponse | None:
    if isinstance(item, ErrorResponse):
        return item
    if isinstance(item, list) and item and isinstance(item[0], ErrorResponse):
        return item[0]
    return None


class EngineClient:
    """One model's ``LLMServer`` handle, called the way Ray Serve LLM expects."""

    def __init__(self, handle: DeploymentHandle, *, first_item_timeout_s: float):
        # LLMServer's methods are async generators: they must be called as streams.
        self._handle = handle.options(stream=True)
        self._timeout_s = first_item_timeout_s

    async def call(self, method: str, request: Any) -> tuple[Any, DeploymentResponseGenerator]:
        """Start ``method`` and wait for its first item, mapping failures to API errors."""
        gen: DeploymentResponseGenerator = getattr(self._handle, method).remote(request, None)
        try:
            first = await asyncio.wait_for(gen.__anext__(), self._timeout_s)
        except asyncio.TimeoutError:
            gen.cancel()
            raise engine_unavailable("Timed out waiting for the model's engine.") from None
        except StopAsyncIteration:
            logger.error("engine %s returned nothing", method)
            raise internal_error() from None
        except _UNAVAILABLE as exc:
            logger.warning("engine unavailable for %s: %s", method, type(exc).__name__)
            raise engine_unavailable() from None
        except ray_exceptions.RayTaskError as exc:
            logger.error(
                "engine %s failed before its first item: %s", method, type(exc.cause).__name__ if exc.cause else exc
            )
            raise internal_error() from None
        error = _first_error(first)
        if error is not None:
            gen.cancel()
            raise error_from_engine(error)
        return first, gen

    async def respond(
        self,
        method: str,
        request: Any,
        *,
        event_filter: EventFilter | None = None,
        body_filter: BodyFilter | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        first, gen = await self.call(method, request)
        if not isinstance(first, list):  # non-streaming: a single response object
            body = response_body(first)
            return JSONBytesResponse(body_filter(body) if body_filter else body, headers=headers)
        return StreamingResponse(
            relay_stream(first, gen, event_filter),
            media_type="text/event-stream",
            headers={**STREAM_HEADERS, **(headers or {})},
        )


async def relay_stream(
    first: list[Any], gen: DeploymentResponseGenerator, event_filter: EventFilter | None = None
) -> AsyncIterator[str]:
    """Forward an engine stream as OpenAI SSE, always ending with ``[DONE]``.

    If the client goes away, the engine call is cancelled so vLLM stops generating.
    If the engine fails mid-stream, the client gets an error event and ``[DONE]``
    instead of a hung or truncated connection.
    """
    finished = False
    try:
        batch = first
        while True:
            out = []
            for payload in sse.parse_events(p for p in batch if isinstance(p, str)):
                if payload is None:
                    continue  # we send our own single [DONE]
                if "error" in payload:
                    raise _StreamError(payload["error"])
                events = [payload] if event_filter is None else event_filter(payload)
                out.extend(sse.event(prune_nulls(e)) for e in events)
            if getattr(event_filter, "stopped", False):
                # A rail ended the answer: stop the engine before telling the client.
                gen.cancel()
                finished = True
                yield "".join(out) + sse.DONE
                return
            if out:
                yield "".join(out)
            try:
                batch = await gen.__anext__()
            except StopAsyncIteration:
                break
            if _first_error(batch) is not None:
                raise _StreamError(_first_error(batch).error.model_dump())
        finished = True
        yield sse.DONE
    except _StreamError as exc:
        finished = True
        logger.error("engine reported an error mid-stream: %s", exc.info.get("type"))
        yield error_event(internal_error()) + sse.DONE
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:  # engine replica crashed or the engine raised mid-stream
        finished = True
        logger.error("stream failed mid-way: %s", type(exc).__name__)
        err = engine_unavailable() if isinstance(exc, _UNAVAILABLE) else internal_error()
        yield error_event(err) + sse.DONE
    finally:
        if not finished:
            # The client disconnected (or a filter stopped the stream): stop the engine.
            gen.cancel()


class _StreamError(Exception):
    def __init__(self, info: dict[str, Any]):
        super().__init__(info.get("message", "engine error"))
        self.info = info
