"""Gateway settings (``configs/gateway.yaml``) and the model files it lists."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator

from engines.config import ConfigError, StrictModel, check_custom_resources, format_validation_error, read_yaml
from engines.provision import default_models_dir
from gateway.limiter_config import LimitsSettings
from gateway.model_file import ModelFile, load_model_file
from retrieval.config import ChunkingConfig, EmbeddingModelConfig, IndexConfig, IngestLimits


class StageAutoscaling(StrictModel):
    """Serve autoscaling of a stage deployment on its own queue (ongoing requests per replica).
    Replaces ``num_replicas`` when set."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8, gt=0)
    upscale_delay_s: float = Field(10, ge=0)
    downscale_delay_s: float = Field(120, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> StageAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


# Ray custom resources a deployment's replicas need, e.g. {"stages": 0.01} to keep them on
# the nodes started with that resource (README "Running on a Ray cluster").
Resources = Annotated[dict[str, float], AfterValidator(check_custom_resources)]


class IngressSettings(StrictModel):
    """The FastAPI ingress deployment. It only awaits other deployments, so it needs
    little CPU; Serve's default max_ongoing_requests (5) would throttle it."""

    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(512, ge=1)
    # Requests waiting for a replica past max_ongoing_requests; beyond it Serve's HTTP proxy
    # answers 503 with Retry-After itself (a plain-text body; see README "Bounds and timeouts").
    max_queued_requests: int = Field(1024, ge=1)
    num_cpus: float = Field(0.25, ge=0)
    resources: Resources = Field(default_factory=dict)


class AuthSettings(StrictModel):
    """Who may call the gateway. Keys come from a keys file (SHA-256 digests, principals with
    scopes, re-read when it changes) or an environment variable, never from this YAML."""

    keys_file: str | None = Field(None, description="principals file (see README); relative to this file")
    api_keys_env: str | None = "GATEWAY_API_KEYS"  # comma-separated `name=key` or keys, every scope
    # Serving without any key is allowed on a loopback address only, unless this says otherwise.
    allow_unauthenticated: bool = False


class EmbeddingSettings(StrictModel):
    """The embedding deployment (``/v1/embeddings``, retrieval, guardrails that embed)."""

    enabled: bool = True
    model_id: str = "all-MiniLM-L6-v2"
    embedded: str | None = Field("all-MiniLM-L6-v2", description="prepared model under models_dir")
    path: str | None = Field(None, description="or: a sentence-transformers folder")
    model: EmbeddingModelConfig = EmbeddingModelConfig()
    num_replicas: int = Field(1, ge=1)
    # Calls waiting per caller (each 64 inputs of /v1/embeddings and each chunk being indexed is one);
    # past it callers get 503 with Retry-After.
    max_queued_requests: int = Field(4096, ge=1)
    # Ray's CPU accounting is for scheduling: on a 2-core box the engine takes one core,
    # and everything else shares what is left.
    num_cpus: float = Field(0.5, ge=0)
    autoscaling: StageAutoscaling | None = None
    resources: Resources = Field(default_factory=dict)


class RetrievalSettings(StrictModel):
    """Vector stores: where they live and how documents are indexed."""

    enabled: bool = True
    # On a cluster: a path every Retriever replica's node mounts (NFS, EFS, a ReadWriteMany
    # volume); replicas take turns writing (a lock file there) and reload after another's write.
    storage_dir: str = Field("../.data/retrieval", description="relative to this file")
    num_replicas: int = Field(1, ge=1)
    autoscaling: StageAutoscaling | None = None
    resources: Resources = Field(default_factory=dict)
    num_cpus: float = Field(0.1, ge=0)
    max_queued_requests: int = Field(256, ge=1)
    ingest: IngestLimits = IngestLimits()
    # local: each Retriever replica embeds search queries with its own copy of the embedding
    # model (ONNX), so a search makes no call to the embedding deployment; shared: it does.
    # Documents are always embedded by the embedding deployment.
    query_embedding: Literal["local", "shared"] = "local"
    query_backend: Literal["onnx-int8", "onnx", "torch"] = Field("onnx-int8", description="the local encoder's runtime")
    index: IndexConfig = IndexConfig()
    chunking: ChunkingConfig = ChunkingConfig()
    # Where a chat request's search runs (chat completions and responses; the files and vector
    # stores API always goes to the Retriever deployment). deployment: a Serve call to it.
    # ingress: a read-only copy of the Retriever in each ingress replica (gateway.local_stage),
    # which opens the same storage_dir, reloads after the deployment's writes as any replica
    # does, and embeds the query with its own encoder: no Serve hop, but each ingress replica
    # holds the stores' indexes in memory and its node must mount storage_dir.
    search_placement: Literal["deployment", "ingress"] = "deployment"

    @model_validator(mode="after")
    def _search_placed(self) -> RetrievalSettings:
        if self.search_placement == "ingress" and self.query_embedding != "local":
            raise ValueError("searches in the ingress (search_placement: ingress) need query_embedding: local")
        return self


class GuardrailSettings(StrictModel):
    """The guardrails stage. What each model's rails do is in its model file."""

    enabled: bool = True
    # deployment: a Serve deployment of its own, scaled apart from the ingress (num_replicas,
    # autoscaling, resources below). ingress: the same rails in each ingress replica, called
    # like a handle (gateway.local_stage): no Serve hop, measured on 2 cores at ~3 ms less CPU
    # per guarded request (README Benchmarks, "rails in the ingress or a deployment"), but the
    # rails scale with the ingress.
    placement: Literal["deployment", "ingress"] = "deployment"
    classifier_path: str | None = Field(None, description="injection classifier; default: the one make models trains")
    # local: each guardrails replica encodes with its own copy of the embedding model (ONNX),
    # one Serve hop fewer; shared: through the embedding deployment (see retrieval/embeddings.py).
    embedding: Literal["local", "shared"] = "local"
    local_backend: Literal["onnx-int8", "onnx", "torch"] = Field("onnx-int8", description="the local encoder's runtime")
    num_replicas: int = Field(1, ge=1)
    autoscaling: StageAutoscaling | None = None
    resources: Resources = Field(default_factory=dict)
    num_cpus: float = Field(0.1, ge=0)
    max_queued_requests: int = Field(512, ge=1)

    @model_validator(mode="after")
    def _placed(self) -> GuardrailSettings:
        if self.placement == "ingress" and self.embedding != "local":
            raise ValueError("guardrails in the ingress (placement: ingress) need embedding: local")
        return self


class TimeoutSettings(StrictModel):
    """How long each stage of a request may take. Each ends in an OpenAI error (504, or an error
    event and ``[DONE]`` once a stream has started), and the stage's call is cancelled."""

    guardrails_s: float = Field(10.0, gt=0, description="input rails, and the check of retrieved passages")
    retrieval_s: float = Field(10.0, gt=0, description="finding passages for a chat request")
    # Streaming: until the engine's first chunk. A non-streaming answer is bounded by total_s.
    first_token_s: float = Field(60.0, gt=0)
    stream_idle_s: float = Field(30.0, gt=0, description="longest gap between two chunks of a stream")
    total_s: float = Field(600.0, gt=0, description="the engine call, from the request to its last chunk")

    @property
    def longest_request_s(self) -> float:
        """The most a model request can last: input rails, retrieval, the passages' check and
        the engine call, each at its bound (a limiter lease expires after this at the latest)."""
        return 2 * self.guardrails_s + self.retrieval_s + self.total_s


# An origin is what browsers send in `Origin`: scheme, host and port, no path or trailing slash.
_ORIGIN = re.compile(r"^https?://[^/\s]+$")


class CorsSettings(StrictModel):
    """Which other web origins' pages may call the gateway from a browser (CORS).

    Off by default: no origin is allowed. The built-in chat page needs none of this, because
    the gateway serves it itself and a page calling its own origin is not cross-origin. Chat UIs
    with their own backend (Open WebUI, LibreChat) call the gateway from that backend and need
    none either; only pages that call the gateway straight from the browser do.
    """

    allow_origins: list[str] = Field(default_factory=list, description='e.g. ["http://localhost:3000"], or ["*"]')
    allow_methods: list[str] = Field(default_factory=lambda: ["GET", "POST", "DELETE"])
    allow_headers: list[str] = Field(default_factory=lambda: ["Authorization", "Content-Type"])
    # Response headers a cross-origin page may read (the sources of a retrieval answer, and
    # which model config produced it).
    expose_headers: list[str] = Field(default_factory=lambda: ["X-Retrieval-Sources", "X-Config-Version"])
    # Cookies and HTTP auth. The gateway authenticates with bearer keys, not cookies.
    allow_credentials: bool = False
    max_age_s: int = Field(600, ge=0, description="how long browsers may cache a preflight answer")

    @field_validator("allow_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            if origin != "*" and not _ORIGIN.match(origin):
                raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], no path or trailing slash)")
        return origins

    @model_validator(mode="after")
    def _no_wildcard_with_credentials(self) -> CorsSettings:
        # With credentials, Starlette answers "*" by echoing whatever the browser asked for:
        # every site on the web could then call the gateway with the user's cookies.
        wildcards = [k for k in ("allow_origins", "allow_methods", "allow_headers") if "*" in getattr(self, k)]
        if self.allow_credentials and wildcards:
            raise ValueError(
                f'"*" in {", ".join(wildcards)} cannot be combined with allow_credentials: true; list them'
            )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.allow_origins)


class GatewayConfig(StrictModel):
    """Top-level gateway settings."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # Model YAML files, relative to this file. Not part of the gateway application's arguments:
    # each model is its own Serve application (gateway/deploy.py).
    models: list[str] = Field(default_factory=list, description="model YAML files, relative to this file")
    models_dir: str | None = Field(None, description="prepared models; default $GATEWAY_MODELS_DIR or .models")
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    timeouts: TimeoutSettings = TimeoutSettings()
    # Sent as Retry-After with every overload refusal (a deployment's queue is full).
    retry_after_s: int = Field(1, ge=0)
    ingress: IngressSettings = IngressSettings()
    auth: AuthSettings = AuthSettings()
    embedding: EmbeddingSettings = EmbeddingSettings()
    retrieval: RetrievalSettings = RetrievalSettings()
    guardrails: GuardrailSettings = GuardrailSettings()
    cors: CorsSettings = CorsSettings()
    limits: LimitsSettings = LimitsSettings()  # per-key rate limits and budgets (gateway/limits.py)

    @model_validator(mode="after")
    def _unique_files(self) -> GatewayConfig:
        if len(set(self.models)) != len(self.models):
            raise ValueError("a model file is listed twice")
        return self

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class LoadedConfig:
    """A gateway config with its model files read and validated."""

    path: Path
    gateway: GatewayConfig
    models: tuple[ModelFile, ...]
    model_files: tuple[Path, ...]  # the file each model was read from, in the same order

    @property
    def models_dir(self) -> Path:
        if self.gateway.models_dir:
            return self.resolve(self.gateway.models_dir)
        return default_models_dir().resolve()

    @property
    def keys_file(self) -> Path | None:
        return self.resolve(self.gateway.auth.keys_file) if self.gateway.auth.keys_file else None

    def check_auth(self) -> None:
        """Refuse to serve a non-loopback address with no keys unless the config says so.
        Reads the environment of the process that calls it (the CLI, and each ingress replica)."""
        from gateway.auth import env_principals

        auth = self.gateway.auth
        has_keys = self.keys_file is not None or bool(auth.api_keys_env and env_principals(auth.api_keys_env))
        if not has_keys and not self.gateway.loopback and not auth.allow_unauthenticated:
            raise ConfigError(
                f"{self.path}: host {self.gateway.host!r} is not a loopback address and no API keys are configured "
                "(auth.keys_file or the auth.api_keys_env variable); set auth.allow_unauthenticated: true "
                "to serve it without authentication anyway"
            )

    def resolve(self, relative: str) -> Path:
        """A path from this config, relative to the config file's folder."""
        return (self.path.parent / os.path.expandvars(relative)).expanduser().resolve()


def load_config(path: str | Path, **overrides) -> LoadedConfig:
    """Read ``gateway.yaml`` and every model file it lists. Errors name file, key, reason.
    ``overrides`` replace keys; a section given as a mapping is merged into the file's section."""
    path = Path(path).resolve()
    data = read_yaml(path)
    for key, value in overrides.items():
        section = data.get(key)
        data[key] = {**section, **value} if isinstance(section, dict) and isinstance(value, dict) else value
    try:
        gateway = GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc)) from None
    if not gateway.models:
        raise ConfigError(f"{path}: models: list at least one model file")
    model_files = tuple((path.parent / f).resolve() for f in gateway.models)
    models = tuple(load_model_file(f) for f in model_files)
    ids = [m.model_id for m in models]
    names = ids + [a for m in models for a in m.aliases] + [gateway.embedding.model_id]
    duplicates = sorted({i for i in names if names.count(i) > 1})
    if duplicates:
        raise ConfigError(
            f"{path}: model name {duplicates} is used by more than one model (ids and aliases must be unique)"
        )
    return LoadedConfig(path=path, gateway=gateway, models=models, model_files=model_files)
