"""The gateway's HTTP ingress: OpenAI routes on FastAPI, deployed by Ray Serve.

A chat request follows one straight path, written out in ``chat_completions``:
parse -> resolve the model -> input rails -> retrieval -> engine with output rails on
its stream. Each stage is a deployment handed to the constructor; the ingress calls
them in order and they never call each other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import Response

from engines.config import ModelConfig
from gateway import chat_stages
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.errors import AUTHENTICATION, APIError, JSONBytesResponse, model_not_found
from gateway.http import app
from gateway.output_stage import OutputRail, guard_response
from gateway.policies import PolicyStore
from gateway.protocol import parse_chat_request, parse_completion_request, read_json_body, split_extensions
from gateway.retrieval_routes import RetrievalRoutes
from guardrails.deployment import ExportedRailMetrics

logger = logging.getLogger(__name__)

SOURCES_HEADER = "X-Retrieval-Sources"


@serve.deployment(name="Gateway")
@serve.ingress(app)
class Gateway(RetrievalRoutes):
    """OpenAI-compatible ingress in front of one ``LLMServer`` deployment per model."""

    def __init__(
        self,
        engines: dict[str, DeploymentHandle],
        models: list[tuple[Path, ModelConfig]],
        settings: GatewayConfig,
        guard: DeploymentHandle | None = None,
        retriever: DeploymentHandle | None = None,
        embedder: DeploymentHandle | None = None,
    ):
        self._settings = settings
        self._engines = {
            model_id: EngineClient(handle, first_item_timeout_s=settings.request_timeout_s)
            for model_id, handle in engines.items()
        }
        self._policies = PolicyStore.from_configs({m.model_id: (path, m) for path, m in models})
        self._guard = guard
        self._retriever = retriever
        self._embedder = embedder
        self._embedding_model = settings.embedding.model_id if embedder is not None else None
        self._output_metrics = ExportedRailMetrics()
        # Keys are read here, in the replica, so they never travel through Serve's
        # deployment arguments (which the controller stores and shows in its state).
        self._api_keys = settings.auth.load_keys()
        self._created = int(time.time())
        if not self._api_keys:
            logger.warning("no API keys configured (%s): the gateway accepts every request", settings.auth.api_keys_env)
        self._reloader = asyncio.get_event_loop().create_task(self._reload_policies())

    # --- the request path ---------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        data = await read_json_body(request, self._settings.max_request_bytes)
        extensions = split_extensions(data)
        chat = parse_chat_request(data)
        engine = self._engine(chat.model)
        policy = self._policies.get(chat.model)
        # 1. input rails: refuse (400 naming the policy) or redact before anything else sees the text
        if policy.guardrails.enabled and self._guard is not None:
            await chat_stages.input_rails(self._guard, chat.model, policy.guardrails, chat.messages)
        # 2. retrieval: passages (checked by the same rails) go into a leading system message
        wanted = chat_stages.RetrievalRequest.parse(extensions.get("retrieval"), policy.retrieval)
        passages = []
        if self._retriever is not None:
            passages = await chat_stages.retrieval(
                self._retriever, self._guard, chat.model, policy.retrieval, policy.guardrails, wanted, chat.messages
            )
        sources = [chat_stages.source_of(p) for p in passages]
        # 3. the engine, with 4. output rails on its stream (or on the whole answer)
        rails = policy.guardrails if policy.guardrails.enabled and policy.guardrails.output.enabled else None
        return await engine.respond(
            "chat",
            chat,
            event_filter=OutputRail(rails, self._output_metrics, chat=True) if rails else None,
            body_filter=self._body_filter(rails, sources if wanted.return_sources else None, chat=True),
            # ASCII-only JSON: header values cannot carry raw UTF-8 filenames.
            headers={SOURCES_HEADER: json.dumps(sources, separators=(",", ":"))} if sources else None,
        )

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        data = await read_json_body(request, self._settings.max_request_bytes)
        split_extensions(data)
        completion = parse_completion_request(data)
        engine = self._engine(completion.model)
        guardrails = self._policies.get(completion.model).guardrails
        if guardrails.enabled and self._guard is not None:
            completion.prompt = await chat_stages.completion_input_rails(
                self._guard, completion.model, guardrails, completion.prompt
            )
        rails = guardrails if guardrails.enabled and guardrails.output.enabled else None
        return await engine.respond(
            "completions",
            completion,
            event_filter=OutputRail(rails, self._output_metrics, chat=False) if rails else None,
            body_filter=self._body_filter(rails, None, chat=False),
        )

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        self._authorize(request)
        ids = list(self._engines) + ([self._embedding_model] if self._embedding_model else [])
        return JSONBytesResponse({"object": "list", "data": [self._model_card(m) for m in ids]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str, request: Request) -> Response:
        self._authorize(request)
        if model_id not in self._engines and model_id != self._embedding_model:
            raise model_not_found(model_id)
        return JSONBytesResponse(self._model_card(model_id))

    @app.get("/health")
    async def health(self) -> Response:
        return JSONBytesResponse({"status": "ok", "models": sorted(self._engines)})

    # --- helpers ------------------------------------------------------------------

    def _engine(self, model_id: str) -> EngineClient:
        engine = self._engines.get(model_id)
        if engine is None:
            raise model_not_found(model_id)
        return engine

    def _body_filter(self, rails, sources: list[dict] | None, *, chat: bool):
        if rails is None and sources is None:
            return None

        def apply(body: dict[str, Any]) -> dict[str, Any]:
            if rails is not None:
                body = guard_response(body, rails, self._output_metrics, chat=chat)
            if sources is not None:
                body["sources"] = sources  # opt-in extension field
            return body

        return apply

    def _model_card(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self._created, "owned_by": "ray-llm-gateway"}

    def _authorize(self, request: Request) -> None:
        if not self._api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in self._api_keys:
            raise APIError(401, "Incorrect API key provided.", type=AUTHENTICATION, code="invalid_api_key")

    async def _reload_policies(self) -> None:
        while True:
            await asyncio.sleep(self._settings.policy_reload_interval_s)
            try:
                self._policies.refresh()
            except Exception:  # the reloader must outlive any one bad read
                logger.exception("policy reload failed")
