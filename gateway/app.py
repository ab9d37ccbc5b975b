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

logger = logging.getLogger(__name__)


def build_gateway(config: LoadedConfig, *, engine_cls: type | None = None) -> Application:
    """The whole gateway: one ``LLMServer`` deployment per model behind our ingress.

    ``engine_cls`` swaps vLLM for another ``LLMEngine`` (the test tier's scripted engine).
    """
    engines = {
        model.model_id: build_engine_deployment(model, config.models_dir, engine_cls=engine_cls)
        for model in config.models
    }
    ingress = config.gateway.ingress
    return Gateway.options(
        num_replicas=ingress.num_replicas,
        max_ongoing_requests=ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": ingress.num_cpus},
    ).bind(
        engines=engines,
        models=list(config.models),
        settings=config.gateway,
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
