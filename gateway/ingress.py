"""The gateway's HTTP ingress: OpenAI routes on FastAPI, deployed by Ray Serve.

A chat request follows one straight path, written out in ``chat_completions``:
parse -> resolve the model -> (stages) -> engine -> response. Each stage is a
collaborator handed to the constructor; the ingress calls them in order and the stages
never call each other.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from engines.config import ModelConfig
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.errors import (
    AUTHENTICATION,
    NOT_FOUND,
    APIError,
    JSONBytesResponse,
    bad_request,
    error_response,
    internal_error,
    model_not_found,
)
from gateway.protocol import parse_chat_request, parse_completion_request, read_json_body, split_extensions

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


@serve.deployment(name="Gateway")
@serve.ingress(app)
class Gateway:
    """OpenAI-compatible ingress in front of one ``LLMServer`` deployment per model."""

    def __init__(
        self,
        engines: dict[str, DeploymentHandle],
        models: list[ModelConfig],
        settings: GatewayConfig,
    ):
        self._settings = settings
        self._models = {m.model_id: m for m in models}
        self._engines = {
            model_id: EngineClient(handle, first_item_timeout_s=settings.request_timeout_s)
            for model_id, handle in engines.items()
        }
        # Keys are read here, in the replica, so they never travel through Serve's
        # deployment arguments (which the controller stores and shows in its state).
        api_keys = settings.auth.load_keys()
        self._api_keys = api_keys
        self._created = int(time.time())
        if not api_keys:
            logger.warning("no API keys configured (%s): the gateway accepts every request", settings.auth.api_keys_env)

    # --- the request path ---------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        data = await read_json_body(request, self._settings.max_request_bytes)
        split_extensions(data)  # stage options; the stages that read them come in later
        chat = parse_chat_request(data)
        engine = self._engine(chat.model)
        # Stages run here, in order: input rails, then retrieval, then the engine with
        # output rails on its stream.
        return await engine.respond("chat", chat)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        data = await read_json_body(request, self._settings.max_request_bytes)
        split_extensions(data)
        completion = parse_completion_request(data)
        return await self._engine(completion.model).respond("completions", completion)

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONBytesResponse({"object": "list", "data": [self._model_card(m) for m in self._models]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str, request: Request) -> Response:
        self._authorize(request)
        if model_id not in self._models:
            raise model_not_found(model_id)
        return JSONBytesResponse(self._model_card(model_id))

    @app.get("/health")
    async def health(self) -> Response:
        return JSONBytesResponse({"status": "ok", "models": sorted(self._models)})

    # --- helpers ------------------------------------------------------------------

    def _engine(self, model_id: str) -> EngineClient:
        engine = self._engines.get(model_id)
        if engine is None:
            raise model_not_found(model_id)
        return engine

    def _model_card(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self._created, "owned_by": "ray-llm-gateway"}

    def _authorize(self, request: Request) -> None:
        if not self._api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in self._api_keys:
            raise APIError(401, "Incorrect API key provided.", type=AUTHENTICATION, code="invalid_api_key")
