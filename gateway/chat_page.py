"""The built-in chat page: three static files the gateway serves itself, and the CORS policy
for pages served anywhere else.

The page is public (it holds no data; the API calls it makes carry the user's key), so its
paths are listed one by one in ``PAGE_PATHS`` and ``gateway.http`` adds exactly those to the
routes that answer without a key. They are routes rather than a ``StaticFiles`` mount because
a mount escapes the app's dependencies and the route listing the auth test checks.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from ray import serve
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

STATIC_DIR = Path(__file__).resolve().parent / "static"
_FILES = {
    "/chat": ("chat.html", "text/html; charset=utf-8"),
    "/chat/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/chat/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset({"/", *_FILES})

# The page runs only its own script and talks only to its own origin: even a bug in its
# Markdown renderer could not run model-written script or send a key elsewhere.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter()


@router.get("/", include_in_schema=False)
async def _root() -> Response:
    # Relative, so the page also works when the app is served under a route prefix.
    return RedirectResponse("chat", status_code=307)


def _static_route(path: str, filename: str, media_type: str) -> None:
    async def serve_file() -> Response:
        return FileResponse(STATIC_DIR / filename, media_type=media_type, headers=_HEADERS)

    router.add_api_route(path, serve_file, methods=["GET"], include_in_schema=False, name=f"chat_page:{filename}")


for _path, (_filename, _media_type) in _FILES.items():
    _static_route(_path, _filename, _media_type)


class ReplicaCORS:
    """Starlette's ``CORSMiddleware`` with the CORS policy (``cors:`` in gateway.yaml) of the
    replica that serves the request.

    ``@serve.ingress(app)`` pickles the module-level app when ``gateway.ingress`` is imported,
    before any config is read, and each replica rebuilds it from that import; so the policy
    cannot be put on the app at build time. It comes from the ``Gateway`` object Serve routes
    the request to (its ``cors`` attribute), read once per replica on the first request, the way
    ``authenticate`` reads the keys. No origin allowed (the default) means no CORS headers at
    all; the built-in page is same-origin and needs none.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._handler: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._handler is None:
            self._handler = self._build()
        await self._handler(scope, receive, send)

    def _build(self) -> ASGIApp:
        cors = serve.get_replica_context().servable_object.cors
        if not cors.enabled:
            return self.app
        # A preflight from an allowed origin is answered here, before routing, so the auth
        # dependency (which a browser's preflight cannot satisfy: it carries no key) never runs.
        return CORSMiddleware(
            self.app,
            allow_origins=cors.allow_origins,
            allow_methods=cors.allow_methods,
            allow_headers=cors.allow_headers,
            expose_headers=cors.expose_headers,
            allow_credentials=cors.allow_credentials,
            max_age=cors.max_age_s,
        )
