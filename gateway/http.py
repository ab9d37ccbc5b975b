"""The FastAPI app every route hangs on, and the handlers that turn any failure into
OpenAI's error body."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.errors import NOT_FOUND, APIError, bad_request, error_response, internal_error

logger = logging.getLogger(__name__)

app = FastAPI(title="LLM gateway", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return error_response(exc, headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404:
        return error_response(APIError(404, f"Unknown request URL: {request.method} {request.url.path}.", type=NOT_FOUND, code="unknown_url"))
    if exc.status_code == 405:
        return error_response(APIError(405, f"Method {request.method} is not allowed for {request.url.path}.", code="method_not_allowed"))
    return error_response(APIError(exc.status_code, str(exc.detail)))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return error_response(bad_request(str(exc.errors()[0].get("msg", "invalid request"))))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path)
    return error_response(internal_error())
