"""The gateway's HTTP ingress: OpenAI routes on FastAPI, deployed by Ray Serve.

A chat request follows one straight path, written out in ``chat_completions``:
parse -> resolve the model -> input rails, and the retrieval search beside them -> passage
check -> engine with output rails on its stream. Each stage is a deployment
handed to the constructor; the ingress calls them in order and they never call each other.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from fastapi import Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import Response

from gateway import chat_stages, metrics, request_policy
from gateway.auth import KeyRing, Principal
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient
from gateway.errors import JSONBytesResponse, bad_request, model_not_found
from gateway.http import app
from gateway.limits import RequestLimits, meter_of
from gateway.local_stage import LocalStage, started
from gateway.model_file import ModelPolicy
from gateway.output_stage import OutputRail, guard_response, refuse_unguardable
from gateway.policies import ModelRoute, Routes, build_routes
from gateway.protocol import parse_chat_request, parse_completion_request, read_json_body, split_extensions
from gateway.responses_routes import ResponsesRoutes
from gateway.responses_store import ResponseStore
from gateway.retrieval_routes import RetrievalRoutes, retrieval_caller
from guardrails.deployment import ExportedRailMetrics
from guardrails.verdict import VerdictCache

logger = logging.getLogger(__name__)

SOURCES_HEADER = "X-Retrieval-Sources"
# The version of the model config that produced a response (see ModelFile.policy).
CONFIG_VERSION_HEADER = "X-Config-Version"
LEASE_MARGIN_S = 30.0  # beyond a request's stage timeouts: the answer's sending, the limiter call


@serve.deployment(name="Gateway")
@serve.ingress(app)
class Gateway(RetrievalRoutes, ResponsesRoutes):
    """OpenAI-compatible ingress in front of one ``LLMServer`` deployment per model."""

    async def __init__(
        self,
        settings: GatewayConfig,
        guard: DeploymentHandle | LocalStage | None = None,
        retriever: DeploymentHandle | None = None,
        searcher: LocalStage | None = None,
        embedder: DeploymentHandle | None = None,
        keys_file: str | None = None,
        responses_dir: str | None = None,
        limiter: DeploymentHandle | None = None,
    ):
        self._settings = settings
        # Per-key limits: read by gateway.limits.enforce_limits, the app's dependency.
        self.limits = RequestLimits(
            settings.limits,
            limiter,
            self._limited_model,
            settings.max_request_bytes,
            # A slot whose settlement never came is freed once its request must be over (plus
            # time to send the answer), not only after lease_ttl_s.
            lifetime_s=settings.timeouts.longest_request_s + LEASE_MARGIN_S,
        )
        # Stored responses (/v1/responses), on disk and owned per principal.
        self._responses = ResponseStore(Path(responses_dir)) if responses_dir else None
        # The models and their policies arrive through `reconfigure` (Serve's user_config).
        self._routes = Routes()
        # The guardrails' handle, or their instance in this replica (placement: ingress).
        self._guard = await started(guard)
        self._retriever = retriever
        # The chat path's searches: the Retriever's handle, or a read-only copy of it built in
        # this replica (retrieval.search_placement: ingress), called the same way.
        self._searcher = await started(searcher) if searcher is not None else retriever
        self._embedder = embedder
        self._embedding_model = settings.embedding.model_id if embedder is not None else None
        self._output_metrics = ExportedRailMetrics()
        # Verdicts on retrieved passages, by policy version and text (chat_stages._checked_passages).
        self._passage_verdicts = VerdictCache()
        self.metrics = metrics.GatewayMetrics()  # published by gateway.metrics.ObservedRequests
        self._readiness = metrics.Readiness(
            lambda: metrics.readiness_checks(
                {m: r.engine for m, r in self._routes.models.items()},
                guardrails=self._guard,
                retrieval=retriever,
                embeddings=embedder,
            )
        )
        # Keys are read here, in the replica, so they never travel through Serve's
        # deployment arguments (which the controller stores and shows in its state).
        self.keys = KeyRing(
            Path(keys_file) if keys_file else None,
            settings.auth.api_keys_env,
            loopback_only=not settings.auth.allow_unauthenticated,
        )
        self._created = int(time.time())
        self.cors = settings.cors  # read by gateway.chat_page.ReplicaCORS
        if not self.keys.enabled:
            if not settings.loopback and not settings.auth.allow_unauthenticated:
                raise RuntimeError(
                    f"refusing to serve {settings.host} without API keys (see auth.allow_unauthenticated)"
                )
            logger.warning("AUTH IS OFF: no API keys configured; every request acts as the local operator")

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve pushes the models and their policies here (``gateway apply``), on every replica,
        without a restart. The new routes replace the old in one assignment: a request that has
        read its route keeps it to the end."""
        try:
            self._routes, changed = build_routes(user_config, self._routes, self._engine_client)
        except Exception:
            if not self._routes.models:
                raise  # nothing to keep serving
            logger.exception("keeping the last good model policies")
            return
        for model_id in changed:
            route = self._routes.models.get(model_id)
            logger.info("model %s: config %s applied", model_id, route.policy.version if route else "removed")

    def _engine_client(self, deployment: str, app: str) -> EngineClient:
        # Not checked against the controller: a model added in the same apply as this policy
        # has no deployment until its application is built (seconds later); the handle is lazy
        # and routes to the replicas once they exist. Checking would fail this reconfigure.
        handle = serve.get_deployment_handle(deployment, app_name=app, _check_exists=False)
        return EngineClient(handle, timeouts=self._settings.timeouts, retry_after_s=self._settings.retry_after_s)

    # --- the request path ---------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        data = await read_json_body(request, self._settings.max_request_bytes)
        extensions = split_extensions(data)
        engine, policy = self._route(data, principal)
        # 0. the model's request defaults and caps, before the request is read
        request_policy.apply(policy.requests, data, chat=True)
        chat = parse_chat_request(data)
        wanted = chat_stages.RetrievalRequest.parse(extensions.get("retrieval"), policy.retrieval)
        search = chat_stages.PendingSearch(
            self._searcher,
            chat.model,
            policy.retrieval,
            wanted,
            retrieval_caller(principal),
            timeout_s=self._settings.timeouts.retrieval_s,
            retry_after_s=self._settings.retry_after_s,
        )
        # 1. the input rails check every text the client wrote: they refuse (400 naming the
        #    policy) or redact before the engine sees the text. 2. The retrieval search of the
        #    last user message needs only the request too: it runs beside them, is cancelled if
        #    they refuse, and searched again if they redact the query.
        guarded = policy.guardrails.enabled and self._guard is not None
        texts = chat_stages.chat_texts(data) if guarded else []  # a part no rail can read is a 400
        search.submit(chat.messages)
        if guarded:
            try:
                rails = await chat_stages.input_rails(
                    self._guard, chat.model, policy.guardrails, texts, **self._rail_bounds()
                )
            except BaseException:
                search.cancel()
                raise
            if rails.redacted:
                chat = parse_chat_request(data)
                search.submit(chat.messages)
        # 3. the passages found, checked by the same rails, go into a leading system message
        passages = await chat_stages.retrieved_passages(
            search,
            self._guard,
            policy.guardrails,
            chat.messages,
            guardrails_timeout_s=self._settings.timeouts.guardrails_s,
            retry_after_s=self._settings.retry_after_s,
            known=self._passage_verdicts,
        )
        # Sources name documents: sent (as a header) only if the policy or the request asks,
        # and in the body (an extension field strict clients would not expect) only on request.
        show_sources = passages and (wanted.return_sources or policy.retrieval.return_sources)
        sources = [chat_stages.source_of(p) for p in passages] if show_sources else None
        # 4. the engine, with 5. output rails on its stream (or on the whole answer)
        rails = policy.guardrails if policy.guardrails.enabled and policy.guardrails.output.enabled else None
        if rails:
            refuse_unguardable(chat)  # token ids instead of text would pass the output rails unread
        return await engine.respond(
            "chat",
            chat,
            event_filter=OutputRail(rails, self._output_metrics, chat=True) if rails else None,
            body_filter=self._body_filter(rails, sources if wanted.return_sources else None, chat=True),
            meter=meter_of(request),
            headers={
                CONFIG_VERSION_HEADER: policy.version,
                # ASCII-only JSON: header values cannot carry raw UTF-8 filenames.
                **({SOURCES_HEADER: json.dumps(sources, separators=(",", ":"))} if sources else {}),
            },
        )

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        data = await read_json_body(request, self._settings.max_request_bytes)
        split_extensions(data)
        engine, policy = self._route(data, principal)
        request_policy.apply(policy.requests, data, chat=False)
        completion = parse_completion_request(data)
        guardrails = policy.guardrails
        if guardrails.enabled and self._guard is not None:
            slots = chat_stages.completion_texts(data)
            bounds = {"param": "prompt", **self._rail_bounds()}
            if (await chat_stages.input_rails(self._guard, completion.model, guardrails, slots, **bounds)).redacted:
                completion = parse_completion_request(data)
        rails = guardrails if guardrails.enabled and guardrails.output.enabled else None
        if rails:
            refuse_unguardable(completion)
        return await engine.respond(
            "completions",
            completion,
            event_filter=OutputRail(rails, self._output_metrics, chat=False) if rails else None,
            body_filter=self._body_filter(rails, None, chat=False),
            headers={CONFIG_VERSION_HEADER: policy.version},
            meter=meter_of(request),
        )

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        routes = self._routes
        ids = list(routes.models) + ([self._embedding_model] if self._embedding_model else [])
        cards = [self._model_card(routes, m) for m in ids if principal.may_use(m)]
        cards += [self._model_card(routes, alias) for alias, m in routes.aliases.items() if principal.may_use(m)]
        return JSONBytesResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str, request: Request) -> Response:
        routes = self._routes
        target = routes.aliases.get(model_id, model_id)
        known = target in routes.models or target == self._embedding_model
        if not known or not request.state.principal.may_use(target):
            raise model_not_found(model_id)
        return JSONBytesResponse(self._model_card(routes, model_id))

    @app.get("/v1/admin/config")
    async def effective_config(self, request: Request) -> Response:
        """The model configs this replica serves with, and when it applied each (admin only)."""
        request.state.principal.require("admin")
        context = serve.get_replica_context()
        return JSONBytesResponse(
            {"replica": context.replica_id.unique_id, "pid": os.getpid(), "models": self._routes.effective()}
        )

    @app.get("/health")
    async def health(self) -> Response:
        return JSONBytesResponse({"status": "ok", "models": sorted(self._routes.models)})

    @app.get("/ready")
    async def ready(self) -> Response:
        """Readiness (no key, for load balancers): 200 when each model's engine and each stage
        answers its health check, else 503 naming the parts that did not."""
        return await self._readiness.response()

    # --- helpers ------------------------------------------------------------------

    def _limited_model(self, name: str) -> tuple[str, int | None] | None:
        """For the limits: a model name's id and its default max_tokens (None: not served)."""
        route = self._routes.resolve(name)
        return (route.model_id, route.policy.requests.defaults.max_tokens) if route is not None else None

    def _rail_bounds(self) -> dict[str, float]:
        return {"timeout_s": self._settings.timeouts.guardrails_s, "retry_after_s": self._settings.retry_after_s}

    def _route(self, data: dict, principal: Principal) -> tuple[EngineClient, ModelPolicy]:
        """The engine and current policy for the request's `model` (an id or an alias, which
        is rewritten to the id). A model this key may not use looks like one that does not exist."""
        name = data.get("model")
        if not isinstance(name, str) or not name:
            raise bad_request("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
        route: ModelRoute | None = self._routes.resolve(name)
        if route is None or not principal.may_use(route.model_id):
            raise model_not_found(name)
        data["model"] = route.model_id
        metrics.note_model(route.model_id)
        return route.engine, route.policy

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

    def _model_card(self, routes: Routes, model_id: str) -> dict[str, Any]:
        card = {"id": model_id, "object": "model", "created": self._created, "owned_by": "ray-llm-gateway"}
        route = routes.resolve(model_id)
        if route is not None and route.max_model_len is not None:
            card["max_model_len"] = route.max_model_len  # as vLLM's own /v1/models
        return card
