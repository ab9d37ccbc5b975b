"""What the engine layer needs to know about a model: where the weights come from, how vLLM
runs, where Ray places it, how many replicas. Nothing about policy.

A model file (``configs/models/*.yaml``) holds this and the model's policies; its schema lives
above this package (``gateway.model_file``), which hands ``EngineSpec`` down here. Every section
forbids unknown keys, so a typo fails at load time with the file, the key and the reason.
``engine.kwargs`` is the one open mapping: it is handed to vLLM untouched, and vLLM validates it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigError(ValueError):
    """A configuration file is missing, unreadable or invalid. The message names the
    file, the offending key and the reason."""


class ModelSource(StrictModel):
    """Where the weights come from: exactly one of the three."""

    embedded: str | None = Field(None, description="name of a model prepared by engines.provision")
    path: str | None = Field(None, description="local folder in Hugging Face layout")
    hf_repo: str | None = Field(None, description="hub repository id (clusters with network access)")

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        given = [k for k in ("embedded", "path", "hf_repo") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"set exactly one of embedded, path, hf_repo (got {given or 'none'})")
        return self

    def resolve(self, models_dir: Path) -> str:
        """The string vLLM loads: a local folder, or a hub id."""
        if self.embedded:
            return str(models_dir / self.embedded)
        if self.path:
            return str(Path(os.path.expandvars(self.path)).expanduser())
        return self.hf_repo  # type: ignore[return-value]


class EngineSettings(StrictModel):
    """vLLM engine settings. Changing any of these restarts this model's replicas."""

    kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments")
    env: dict[str, str] = Field(default_factory=dict, description="environment of the engine process")
    # Ray Serve LLM groups streamed chunks per interval; 0 forwards each token at once.
    stream_batching_interval_ms: int | None = Field(None, ge=0, le=1000)


class Placement(StrictModel):
    """Hardware placement. On GPU, one bundle per (tensor x pipeline) parallel worker."""

    accelerator: Literal["cpu", "gpu"] = "cpu"
    accelerator_type: str | None = Field(None, description="Ray accelerator type, e.g. A100-80G, L4 (gpu only)")
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    cpus_per_worker: float = Field(1.0, ge=0)
    # PACK lets a pipeline-parallel model span nodes when one node has too few GPUs;
    # STRICT_PACK keeps tensor-parallel shards on one node's NVLink.
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    # Ray custom resources added to every bundle, e.g. {"engine": 1} to keep engines on the
    # nodes started with that resource (`ray start --resources`; see README "Running on a Ray cluster").
    resources: dict[str, float] = Field(default_factory=dict)

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        return check_custom_resources(resources)

    @model_validator(mode="after")
    def _cpu_rules(self) -> Placement:
        if self.accelerator == "cpu":
            if self.accelerator_type:
                raise ValueError("accelerator_type only applies to accelerator: gpu")
            if self.tensor_parallel_size * self.pipeline_parallel_size != 1:
                raise ValueError("the CPU profile runs one engine worker per replica (parallel sizes must be 1)")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class Autoscaling(StrictModel):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16, gt=0)
    # How long Serve waits with the load past (below) the target before adding (removing) a
    # replica; None leaves Serve's defaults (30 s / 600 s). benchmarks/capacity.py recommends them.
    upscale_delay_s: float | None = Field(None, ge=0)
    downscale_delay_s: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class Scaling(StrictModel):
    """Replicas of this model's LLMServer deployment. Ray Serve does the routing."""

    num_replicas: int = Field(1, ge=1)
    autoscaling: Autoscaling | None = None
    # vLLM batches continuously; this only bounds what one replica accepts before
    # Serve routes elsewhere or queues. Serve's default of 5 starves the engine.
    max_ongoing_requests: int = Field(64, ge=1)
    # Requests waiting (per ingress replica) once every replica holds max_ongoing_requests;
    # past it the gateway answers 503 with Retry-After instead of waiting without bound.
    max_queued_requests: int = Field(64, ge=1)


class EngineSpec(StrictModel):
    """One served model as the engine layer sees it: its name, weights, engine, placement and
    replicas. A change to any of these replaces the model's ``LLMServer`` replicas."""

    model_id: str = Field(..., min_length=1, description="the name clients pass as `model`")
    source: ModelSource
    engine: EngineSettings = EngineSettings()
    placement: Placement = Placement()
    deployment: Scaling = Scaling()


def check_custom_resources(resources: dict[str, float]) -> dict[str, float]:
    """Ray custom resources: the predefined ones have their own settings."""
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory") or name.startswith("accelerator_type:"):
            raise ValueError(f"{name!r} is not a custom resource; use the placement's own settings")
        if amount < 0:
            raise ValueError(f"resource {name!r}: amount must not be negative")
    return resources


def format_validation_error(path: Path, exc: ValidationError) -> str:
    lines = [f"{path}: invalid configuration"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {key}: {err['msg']}")
    return "\n".join(lines)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data
