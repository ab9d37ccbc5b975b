"""Application builders: the Serve YAML names ``gateway.app:build_app`` by import path."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ray._common.utils import import_attr
from ray.serve.deployment import Application

from engines.deployments import build_engine_deployment
from gateway.config import LoadedConfig, load_config
from gateway.ingress import Gateway
from guardrails.deployment import Guardrails
from retrieval.config import RetrievalConfig
from retrieval.embedding_deployment import OMP_ENV, Embedder
from retrieval.service import Retriever

logger = logging.getLogger(__name__)

# Trained by `make models` (guardrails/train_injection.py) from the labeled set in the repo.
INJECTION_CLASSIFIER = "injection_classifier.npz"


def build_gateway(config: LoadedConfig, *, engine_cls: type | None = None) -> Application:
    """The whole gateway: one ``LLMServer`` deployment per model, the stage deployments
    (embeddings, retrieval, guardrails) and our ingress, which gets them all as handles.

    ``engine_cls`` swaps vLLM for another ``LLMEngine`` (the test tier's scripted engine).
    """
    gw = config.gateway
    config.check_auth()
    engines = {
        model.model_id: build_engine_deployment(model.engine_spec(), config.models_dir, engine_cls=engine_cls)
        for model in config.models
    }
    embedder = retriever = guard = None
    model_path = config.resolve(gw.embedding.path) if gw.embedding.path else config.models_dir / gw.embedding.embedded
    embedding_config = gw.embedding.model.model_copy(update={"model_path": model_path})
    if gw.embedding.enabled:
        embedder = Embedder.options(
            num_replicas=gw.embedding.num_replicas,
            # Keep OMP_ENV: spinning torch threads collapse when the engine holds the other core.
            ray_actor_options={"num_cpus": gw.embedding.num_cpus, "runtime_env": {"env_vars": OMP_ENV}},
        ).bind(embedding_config)
        if gw.retrieval.enabled:
            retrieval_config = RetrievalConfig(
                storage_dir=config.resolve(gw.retrieval.storage_dir),
                embedding=embedding_config,
                index=gw.retrieval.index,
                chunking=gw.retrieval.chunking,
            )
            retriever = Retriever.options(ray_actor_options={"num_cpus": gw.retrieval.num_cpus}).bind(
                embedder, retrieval_config
            )
    if gw.guardrails.enabled:
        classifier = (
            config.resolve(gw.guardrails.classifier_path)
            if gw.guardrails.classifier_path
            else config.models_dir / INJECTION_CLASSIFIER
        )
        local_encoder = None
        if gw.guardrails.embedding == "local":
            # One thread: the guardrails encode one request's texts at a time, and the engine
            # holds the other core.
            local_encoder = embedding_config.model_copy(
                update={"backend": gw.guardrails.local_backend, "num_threads": 1}
            )
        guard = Guardrails.options(
            num_replicas=gw.guardrails.num_replicas,
            ray_actor_options={"num_cpus": gw.guardrails.num_cpus, "runtime_env": {"env_vars": OMP_ENV}},
        ).bind(embedder, str(classifier), local_encoder)
    ingress = gw.ingress
    return Gateway.options(
        num_replicas=ingress.num_replicas,
        max_ongoing_requests=ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": ingress.num_cpus},
    ).bind(
        engines=engines,
        models=list(zip(config.model_files, config.models)),
        settings=gw,
        guard=guard,
        retriever=retriever,
        embedder=embedder,
        keys_file=str(config.keys_file) if config.keys_file else None,
    )


def build_app(args: dict[str, Any]) -> Application:
    """Serve builder: ``args`` are ``config`` (path to gateway.yaml) and optionally
    ``engine_cls`` ("module:Class") to replace vLLM."""
    unknown = set(args) - {"config", "engine_cls"}
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; expected 'config' and optionally 'engine_cls'")
    config = load_config(Path(args.get("config", "configs/gateway.yaml")))
    engine_cls = import_attr(args["engine_cls"]) if args.get("engine_cls") else None
    return build_gateway(config, engine_cls=engine_cls)
