"""The FastAPI app every route hangs on, the checks in front of every route, and the
handlers that turn any failure into OpenAI's error body.

Authentication is a dependency of the app itself, so every route gets it, including routes
added later: a route is public only if its path is in ``PUBLIC_PATHS``. The built-in chat page
(``gateway/chat_page.py``) and the CORS policy for pages served elsewhere hang on it too.
"""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.chat_page import PAGE_PATHS, ReplicaCORS
from gateway.chat_page import router as chat_page_router
from gateway.errors import NOT_FOUND, APIError, JSONBytesResponse, bad_request, error_response, internal_error
from gateway.limits import RateLimitHeaders, enforce_limits
from gateway.metrics import ObservedRequests
from gateway.openapi import describe

logger = logging.getLogger(__name__)

# Liveness and readiness answer without a key (load balancers and Serve's probes carry none),
# and so do the chat page's static files (`/` redirects to it): the page sends the user's key itself.
PUBLIC_PATHS = frozenset({"/health", "/ready", *PAGE_PATHS})


async def authenticate(request: Request) -> None:
    """Put the caller's ``Principal`` on ``request.state.principal``, or refuse with 401.

    The keys live in the ingress replica (the servable object Serve routes this request to).
    """
    # The matched route's own path: the same under any route prefix Serve mounts the app at.
    if getattr(request.scope.get("route"), "path", request.url.path) in PUBLIC_PATHS:
        return
    gateway = serve.get_replica_context().servable_object
    peer = request.client.host if request.client else None
    request.state.principal = gateway.keys.authenticate(request.headers.get("authorization"), peer)


app = FastAPI(
    title="LLM gateway",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
    # Per-key limits after the key is known; they settle when the response has been sent.
    dependencies=[Depends(authenticate), Depends(enforce_limits, scope="request")],
)
app.add_middleware(ReplicaCORS)
app.add_middleware(RateLimitHeaders)  # x-ratelimit-* on admitted requests' responses
app.add_middleware(ObservedRequests)  # outermost: times every request, adds x-gateway-overhead-ms
app.include_router(chat_page_router)


@app.get("/openapi.json", include_in_schema=False)
async def openapi_description(request: Request) -> Response:
    """The OpenAPI description (with a key, like every non-public route; FastAPI's own would be public)."""
    served = request.app  # the replica's app, which carries the Gateway's routes (not this module's copy)
    if served.openapi_schema is None:
        served.openapi_schema = describe(served, PUBLIC_PATHS)
    return JSONBytesResponse(served.openapi_schema)


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> Response:
    # 401 asks for a bearer key; 429 and 503 carry Retry-After and x-ratelimit-* (gateway/limits.py).
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else getattr(exc, "headers", None)
    return error_response(exc, headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404:
        return error_response(
            APIError(
                404, f"Unknown request URL: {request.method} {request.url.path}.", type=NOT_FOUND, code="unknown_url"
            )
        )
    if exc.status_code == 405:
        return error_response(
            APIError(405, f"Method {request.method} is not allowed for {request.url.path}.", code="method_not_allowed")
        )
    return error_response(APIError(exc.status_code, str(exc.detail)))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return error_response(bad_request(str(exc.errors()[0].get("msg", "invalid request"))))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path)
    return error_response(internal_error())
