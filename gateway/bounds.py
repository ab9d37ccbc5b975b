"""Refusals that clients should retry: a stage that took too long, or a deployment whose queue
is full. Each is OpenAI's error body with a status the openai SDK retries (503 overloaded or
unavailable, 504 timed out); overload refusals carry ``Retry-After``, which the SDK honours.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi import Request
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentResponse
from starlette.responses import Response

from gateway.errors import UNAVAILABLE, APIError, error_response
from gateway.http import app

TIMEOUT = "timeout_error"


class RetryableError(APIError):
    """An ``APIError`` the client should retry later, optionally after ``retry_after_s``."""

    def __init__(
        self, status: int, message: str, *, code: str, type: str = UNAVAILABLE, retry_after_s: float | None = None
    ):
        super().__init__(status, message, type=type, code=code)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str] | None:
        if self.retry_after_s is None:
            return None
        return {"Retry-After": str(max(0, math.ceil(self.retry_after_s)))}


# Registered on the app itself, so the header leaves with the body from every route. Starlette
# picks the handler of the most specific class, so this one wins over APIError's.
@app.exception_handler(RetryableError)
async def _retryable(request: Request, exc: RetryableError) -> Response:
    return error_response(exc, exc.headers)


def overloaded(stage: str, retry_after_s: float | None) -> RetryableError:
    """The ``stage`` deployment's queue is full (Serve's ``max_queued_requests``)."""
    after = f" after {math.ceil(retry_after_s)} s" if retry_after_s is not None else ""
    return RetryableError(
        503, f"The {stage} is overloaded; retry{after}.", code=f"{stage}_overloaded", retry_after_s=retry_after_s
    )


def timed_out(stage: str, timeout_s: float) -> RetryableError:
    return RetryableError(
        504, f"The {stage} did not answer within {timeout_s:g} s.", code=f"{stage}_timeout", type=TIMEOUT
    )


def retry_after_of(exc: BaseException, default_s: float | None) -> float | None:
    """The deployment's own ``backpressure_config.retry_after_s`` if it set one, else ours."""
    own = getattr(exc, "retry_after_s", None) if isinstance(exc, BackPressureError) else None
    return own if own is not None else default_s


async def within(response: DeploymentResponse, timeout_s: float | None, stage: str) -> Any:
    """Await a deployment call for at most ``timeout_s``; past it, cancel the call and raise a
    504 naming ``stage``. ``None`` waits as long as the call takes."""
    if timeout_s is None:
        return await response
    awaited = asyncio.ensure_future(_awaited(response))
    # A call cancelled while it is awaited here (the request was refused or the client left)
    # ends in Serve's RequestCancelledError; nobody else will read it.
    awaited.add_done_callback(_retrieved)
    try:
        return await asyncio.wait_for(awaited, timeout_s)
    except asyncio.TimeoutError:
        response.cancel()
        raise timed_out(stage, timeout_s) from None


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def _awaited(response: DeploymentResponse) -> Any:
    # wait_for needs a coroutine or future; a DeploymentResponse is only awaitable.
    return await response
