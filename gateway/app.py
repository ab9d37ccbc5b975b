"""The gateway application's builder: ``gateway.app:build_app`` by import path (see
``gateway/deploy.py`` for the Serve config that names it, and the models' own applications)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from ray.serve.deployment import Application

from engines.config import ConfigError, format_validation_error
from gateway.config import GatewayConfig, LoadedConfig
from gateway.ingress import Gateway
from gateway.limiter import Limiter
from gateway.local_stage import LocalStage
from guardrails.deployment import Guardrails
from retrieval.config import EmbeddingModelConfig, RetrievalConfig
from retrieval.embedding_deployment import OMP_ENV, Embedder
from retrieval.service import Retriever

logger = logging.getLogger(__name__)

# The shipped artifact (guardrails/data), installed by `make models`; `make train-injection` retrains it.
INJECTION_CLASSIFIER = "injection_classifier.npz"


def build_gateway(config: LoadedConfig, user_config: dict[str, Any] | None = None) -> Application:
    """The gateway application: the stage deployments (embeddings, retrieval, guardrails) and
    our ingress, which gets them as handles. The models are not part of it: each is its own
    application, and the ingress learns them (and their policies) from its ``user_config``.
    """
    gw = config.gateway
    config.check_auth()
    embedder = retriever = guard = searcher = None
    # A full queue (max_queued_requests) refuses with 503 and this Retry-After, which the
    # refused handle call carries to the ingress (and Serve's proxy sends for the ingress).
    backpressure = {"status_code": 503, "retry_after_s": gw.retry_after_s}
    model_path = config.resolve(gw.embedding.path) if gw.embedding.path else config.models_dir / gw.embedding.embedded
    embedding_config = gw.embedding.model.model_copy(update={"model_path": model_path})
    if gw.embedding.enabled:
        embedder = Embedder.options(
            **_scaling(gw.embedding),
            max_queued_requests=gw.embedding.max_queued_requests,
            backpressure_config=backpressure,
            # Keep OMP_ENV: spinning torch threads collapse when the engine holds the other core.
            ray_actor_options=_actor(gw.embedding, runtime_env={"env_vars": OMP_ENV}),
        ).bind(embedding_config)
        if gw.retrieval.enabled:
            retrieval_config = RetrievalConfig(
                storage_dir=config.resolve(gw.retrieval.storage_dir),
                embedding=embedding_config,
                query_encoder=_local_encoder(embedding_config, gw.retrieval.query_backend)
                if gw.retrieval.query_embedding == "local"
                else None,
                index=gw.retrieval.index,
                chunking=gw.retrieval.chunking,
                ingest=gw.retrieval.ingest,
            )
            retriever = Retriever.options(
                # Several replicas share storage_dir (retrieval/shared_storage.py).
                **_scaling(gw.retrieval),
                max_queued_requests=gw.retrieval.max_queued_requests,
                backpressure_config=backpressure,
                ray_actor_options=_actor(gw.retrieval, runtime_env={"env_vars": OMP_ENV}),
            ).bind(embedder, retrieval_config)
            if gw.retrieval.search_placement == "ingress":
                # A read-only copy in each ingress replica for the chat path's searches; Serve
                # hands it the Embedder's handle in place of the bound application.
                searcher = LocalStage("retrieval.service:Retriever", embedder, retrieval_config)
    if gw.guardrails.enabled:
        classifier = (
            config.resolve(gw.guardrails.classifier_path)
            if gw.guardrails.classifier_path
            else config.models_dir / INJECTION_CLASSIFIER
        )
        local_encoder = (
            _local_encoder(embedding_config, gw.guardrails.local_backend)
            if gw.guardrails.embedding == "local"
            else None
        )
        if gw.guardrails.placement == "ingress":
            # Built in each ingress replica (gateway.local_stage), called like the handle.
            guard = LocalStage("guardrails.deployment:Guardrails", None, str(classifier), local_encoder)
        else:
            guard = Guardrails.options(
                **_scaling(gw.guardrails),
                max_queued_requests=gw.guardrails.max_queued_requests,
                backpressure_config=backpressure,
                ray_actor_options=_actor(gw.guardrails, runtime_env={"env_vars": OMP_ENV}),
            ).bind(embedder, str(classifier), local_encoder)
    # --- per-key limits: one shared Limiter for every ingress replica (gateway/limiter.py).
    # Always bound (a keys-file override can turn limits on while serving); idle it costs nothing.
    limiter = Limiter.options(ray_actor_options={"num_cpus": gw.limits.num_cpus}).bind(
        gw.limits.window_s, gw.limits.lease_ttl_s, str(config.resolve(gw.limits.budget_file))
    )
    # --- end of per-key limits
    ingress = gw.ingress
    options: dict[str, Any] = {}
    if user_config is not None:
        options["user_config"] = user_config
    return Gateway.options(
        num_replicas=ingress.num_replicas,
        max_ongoing_requests=ingress.max_ongoing_requests,
        # Past this, Serve's proxy answers 503 + Retry-After itself (a plain-text body).
        max_queued_requests=ingress.max_queued_requests,
        backpressure_config=backpressure,
        # The stages' encoders, when they run here, keep their threads from spinning (OMP_ENV).
        ray_actor_options=_actor(ingress, runtime_env={"env_vars": OMP_ENV})
        if isinstance(guard, LocalStage) or searcher is not None
        else _actor(ingress),
        **options,
    ).bind(
        settings=gw,
        guard=guard,
        retriever=retriever,
        searcher=searcher,
        embedder=embedder,
        keys_file=str(config.keys_file) if config.keys_file else None,
        limiter=limiter,
        # Stored responses beside the vector stores (see README "Responses API").
        responses_dir=str(config.resolve(gw.retrieval.storage_dir).parent / "responses"),
    )


def _scaling(stage) -> dict[str, Any]:
    """A stage's replicas: a fixed ``num_replicas``, or Serve's autoscaling on its own queue."""
    if stage.autoscaling is not None:
        return {"autoscaling_config": stage.autoscaling.model_dump()}
    return {"num_replicas": stage.num_replicas}


def _local_encoder(embedding: EmbeddingModelConfig, backend: str) -> EmbeddingModelConfig:
    """A stage's own copy of the embedding model (retrieval.embeddings.LocalEmbeddings). One
    thread: such a stage encodes a request's short texts one call at a time, and the engine
    holds the other core."""
    return embedding.model_copy(update={"backend": backend, "num_threads": 1})


def _actor(stage, **extra: Any) -> dict[str, Any]:
    """A stage's ``ray_actor_options``: its CPUs, and the custom resources that place it."""
    options: dict[str, Any] = {"num_cpus": stage.num_cpus, **extra}
    if stage.resources:
        options["resources"] = dict(stage.resources)
    return options


def build_app(args: dict[str, Any]) -> Application:
    """Serve builder: ``settings`` is gateway.yaml's content without its model list, ``base_dir``
    the folder its relative paths are relative to (``gateway.deploy.serve_config`` writes both)."""
    unknown = set(args) - {"settings", "base_dir"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; expected 'settings' and 'base_dir'")
    base = Path(args.get("base_dir") or ".").resolve()
    try:
        settings = GatewayConfig.model_validate(args["settings"])
    except ValidationError as exc:
        raise ConfigError(format_validation_error(base / "gateway.yaml", exc)) from None
    return build_gateway(LoadedConfig(path=base / "gateway.yaml", gateway=settings, models=(), model_files=()))
