"""Gateway settings (``configs/gateway.yaml``) and the model files it lists."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from engines.config import ConfigError, ModelConfig, StrictModel, format_validation_error, load_model_config, read_yaml
from engines.provision import default_models_dir
from retrieval.config import ChunkingConfig, EmbeddingModelConfig, IndexConfig


class IngressSettings(StrictModel):
    """The FastAPI ingress deployment. It only awaits other deployments, so it needs
    little CPU; Serve's default max_ongoing_requests (5) would throttle it."""

    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(512, ge=1)
    num_cpus: float = Field(0.25, ge=0)


class AuthSettings(StrictModel):
    """Bearer keys come from the environment or a file, never from this YAML."""

    api_keys_env: str = "GATEWAY_API_KEYS"  # comma-separated keys
    api_keys_file: str | None = None  # one key per line

    def load_keys(self) -> frozenset[str]:
        keys = [k.strip() for k in os.environ.get(self.api_keys_env, "").split(",")]
        if self.api_keys_file:
            path = Path(os.path.expandvars(self.api_keys_file)).expanduser()
            keys += [line.strip() for line in path.read_text().splitlines()]
        return frozenset(k for k in keys if k and not k.startswith("#"))


class EmbeddingSettings(StrictModel):
    """The embedding deployment (``/v1/embeddings``, retrieval, guardrails that embed)."""

    enabled: bool = True
    model_id: str = "all-MiniLM-L6-v2"
    embedded: str | None = Field("all-MiniLM-L6-v2", description="prepared model under models_dir")
    path: str | None = Field(None, description="or: a sentence-transformers folder")
    model: EmbeddingModelConfig = EmbeddingModelConfig()
    num_replicas: int = Field(1, ge=1)
    # Ray's CPU accounting is for scheduling: on a 2-core box the engine takes one core,
    # and everything else shares what is left.
    num_cpus: float = Field(0.5, ge=0)


class RetrievalSettings(StrictModel):
    """Vector stores: where they live and how documents are indexed."""

    enabled: bool = True
    storage_dir: str = Field("../.data/retrieval", description="relative to this file")
    num_cpus: float = Field(0.1, ge=0)
    index: IndexConfig = IndexConfig()
    chunking: ChunkingConfig = ChunkingConfig()


class GuardrailSettings(StrictModel):
    """The guardrails deployment. What each model's rails do is in its model file."""

    enabled: bool = True
    classifier_path: str | None = Field(None, description="injection classifier; default: the one make models trains")
    # local: each guardrails replica encodes with its own copy of the embedding model (ONNX),
    # one Serve hop fewer; shared: through the embedding deployment (see guardrails/embeddings.py).
    embedding: Literal["local", "shared"] = "local"
    local_backend: Literal["onnx-int8", "onnx", "torch"] = Field("onnx-int8", description="the local encoder's runtime")
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.1, ge=0)


class GatewayConfig(StrictModel):
    """Top-level gateway settings."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    models: list[str] = Field(..., min_length=1, description="model YAML files, relative to this file")
    models_dir: str | None = Field(None, description="prepared models; default $GATEWAY_MODELS_DIR or .models")
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # Upper bound on one request's wall time, so a stuck engine cannot hold a client forever.
    request_timeout_s: float = Field(600.0, gt=0)
    # How often the ingress re-reads the model files for policy changes.
    policy_reload_interval_s: float = Field(2.0, gt=0)
    ingress: IngressSettings = IngressSettings()
    auth: AuthSettings = AuthSettings()
    embedding: EmbeddingSettings = EmbeddingSettings()
    retrieval: RetrievalSettings = RetrievalSettings()
    guardrails: GuardrailSettings = GuardrailSettings()

    @model_validator(mode="after")
    def _unique_files(self) -> "GatewayConfig":
        if len(set(self.models)) != len(self.models):
            raise ValueError("a model file is listed twice")
        return self


@dataclass(frozen=True)
class LoadedConfig:
    """A gateway config with its model files read and validated."""

    path: Path
    gateway: GatewayConfig
    models: tuple[ModelConfig, ...]
    model_files: tuple[Path, ...]  # the file each model was read from, in the same order

    @property
    def models_dir(self) -> Path:
        if self.gateway.models_dir:
            return self.resolve(self.gateway.models_dir)
        return default_models_dir().resolve()

    def resolve(self, relative: str) -> Path:
        """A path from this config, relative to the config file's folder."""
        return (self.path.parent / os.path.expandvars(relative)).expanduser().resolve()


def load_config(path: str | Path, **overrides) -> LoadedConfig:
    """Read ``gateway.yaml`` and every model file it lists. Errors name file, key, reason."""
    path = Path(path).resolve()
    data = read_yaml(path)
    data.update(overrides)
    try:
        gateway = GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc)) from None
    model_files = tuple((path.parent / f).resolve() for f in gateway.models)
    models = tuple(load_model_config(f) for f in model_files)
    ids = [m.model_id for m in models]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ConfigError(f"{path}: model_id {duplicates} is served by more than one model file")
    return LoadedConfig(path=path, gateway=gateway, models=models, model_files=model_files)
