"""The one error shape the gateway returns: OpenAI's ``{"error": {...}}`` body.

Every failure, from a malformed body to a dead engine, becomes an ``APIError`` and
leaves through ``error_response`` (or ``error_event`` mid-stream), so clients see the
same four fields whatever went wrong.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
SERVER = "server_error"
UNAVAILABLE = "service_unavailable_error"


class APIError(Exception):
    """An error to report to the client with an HTTP status and an OpenAI body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        type=INVALID_REQUEST,
        param="model",
        code="model_not_found",
    )


def engine_unavailable(detail: str = "The model's engine is unavailable; try again shortly.") -> APIError:
    return APIError(503, detail, type=UNAVAILABLE, code="engine_unavailable")


def internal_error() -> APIError:
    # Details go to the log, never to the client.
    return APIError(500, "The server had an error while processing your request.", type=SERVER, code="internal_error")


class JSONBytesResponse(Response):
    """A JSON response serialised with orjson (several times faster than json)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(error: APIError, headers: dict[str, str] | None = None) -> Response:
    return JSONBytesResponse(error.body(), status_code=error.status, headers=headers)


def error_event(error: APIError) -> str:
    """An SSE event carrying the error, sent when a stream fails after it started."""
    return "data: " + orjson.dumps(error.body()).decode() + "\n\n"
