"""Turn a model config into a Ray Serve LLM ``LLMServer`` deployment, on CPU or GPU.

This is the only place that knows Ray Serve LLM's ``LLMConfig`` fields. vLLM does the
batching (continuous batching inside the engine); Ray Serve does replicas, autoscaling,
routing and placement. We only translate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.serve.deployment import Application
from ray.serve.llm import LLMConfig, build_llm_deployment

from engines.config import EngineSpec
from engines.responses_server import ResponsesServer

# The LLMServer replica actor itself only relays requests to the engine process,
# which owns the real CPU or GPU bundle; reserving a whole core for the relay would
# leave nothing for the rest of the app on small machines.
REPLICA_ACTOR_CPUS = 0.0


def placement_group_config(model: EngineSpec) -> dict[str, Any]:
    """One bundle per engine worker (tensor x pipeline parallel ranks).

    Ray merges the replica actor's own resources into the first bundle, so the result
    is what the cluster must find free, on one node (STRICT_PACK) or across several.
    """
    p = model.placement
    bundle: dict[str, float] = {"CPU": p.cpus_per_worker}
    if p.accelerator == "gpu":
        bundle["GPU"] = 1
        if p.accelerator_type:
            # Ray's convention: a tiny request of the accelerator_type resource pins
            # the bundle to nodes of that type.
            bundle[f"accelerator_type:{p.accelerator_type}"] = 0.001
    bundle.update(p.resources)
    return {"bundles": [dict(bundle) for _ in range(p.world_size)], "strategy": p.strategy}


def deployment_config(model: EngineSpec) -> dict[str, Any]:
    scaling = model.deployment
    config: dict[str, Any] = {
        "max_ongoing_requests": scaling.max_ongoing_requests,
        "max_queued_requests": scaling.max_queued_requests,
        "ray_actor_options": {"num_cpus": REPLICA_ACTOR_CPUS},
    }
    if scaling.autoscaling is not None:
        config["autoscaling_config"] = scaling.autoscaling.model_dump(exclude_none=True)
    else:
        config["num_replicas"] = scaling.num_replicas
    return config


def llm_config(model: EngineSpec, models_dir: Path) -> LLMConfig:
    """The Ray Serve LLM config for one model."""
    p = model.placement
    engine_kwargs = dict(model.engine.kwargs)
    engine_kwargs.setdefault("tensor_parallel_size", p.tensor_parallel_size)
    engine_kwargs.setdefault("pipeline_parallel_size", p.pipeline_parallel_size)
    experimental: dict[str, Any] = {}
    if model.engine.stream_batching_interval_ms is not None:
        experimental["stream_batching_interval_ms"] = model.engine.stream_batching_interval_ms
    return LLMConfig(
        model_loading_config={
            "model_id": model.model_id,
            "model_source": model.source.resolve(models_dir),
        },
        engine_kwargs=engine_kwargs,
        accelerator_type=p.accelerator_type,
        accelerator_config={"kind": p.accelerator},
        placement_group_config=placement_group_config(model),
        deployment_config=deployment_config(model),
        runtime_env={"env_vars": dict(model.engine.env)} if model.engine.env else None,
        experimental_configs=experimental,
    )


def build_engine_deployment(
    model: EngineSpec, models_dir: Path, *, engine_cls: type | None = None, name: str | None = None
) -> Application:
    """A bound ``LLMServer`` deployment for ``model``, named ``name`` (default ``Engine:<model_id>``).

    ``engine_cls`` replaces vLLM with another ``LLMEngine`` (the deterministic test
    engine in the fast test tier); production leaves it unset.
    """
    bind_kwargs = {"engine_cls": engine_cls} if engine_cls is not None else None
    return build_llm_deployment(
        llm_config(model, models_dir),
        name_prefix="Engine:",
        bind_kwargs=bind_kwargs,
        # LLMServer plus `responses` (vLLM's Responses API), which Ray Serve LLM 2.60 lacks.
        deployment_cls=ResponsesServer,
        override_serve_options={"name": name} if name else None,
    )
