"""The Serve application of one model: ``engines.app:build_engine_app`` by import path.

Its arguments are the model's ``EngineSpec`` (nothing of the gateway's policies), so Serve
replaces this model's replicas exactly when the engine part of its file changes.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ray.serve.deployment import Application

from engines.config import EngineSpec
from engines.deployments import build_engine_deployment
from engines.provision import default_models_dir

ARGS = {"engine", "models_dir", "deployment_name", "engine_cls"}


def build_engine_app(args: dict[str, Any]) -> Application:
    """``engine``: the model's engine spec; ``models_dir``: where embedded models are prepared
    (default: ``$GATEWAY_MODELS_DIR`` on the node); ``deployment_name``; ``engine_cls``
    ("module:Class") replaces vLLM (the fast test tier's scripted engine)."""
    unknown = set(args) - ARGS
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; expected {sorted(ARGS)}")
    spec = EngineSpec.model_validate(args["engine"])
    models_dir = Path(args["models_dir"]) if args.get("models_dir") else default_models_dir()
    engine_cls = _import(args["engine_cls"]) if args.get("engine_cls") else None
    return build_engine_deployment(spec, models_dir, engine_cls=engine_cls, name=args.get("deployment_name"))


def _import(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
