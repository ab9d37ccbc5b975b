"""The schema of a model file (``configs/models/<model>.yaml``): the engine part, handed to
``engines`` as an ``EngineSpec``, and the policy part the gateway applies per request.

The two parts change differently: a policy edit (rails, retrieval, request defaults and caps,
aliases) applies to the next request without restarting anything; an engine edit replaces the
model's ``LLMServer`` replicas. ``ModelFile.engine_spec`` and ``ModelFile.policy`` are that split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, ValidationError, field_validator

from engines.config import ConfigError, EngineSpec, format_validation_error, read_yaml
from gateway.request_policy import RequestPolicy
from guardrails.config import GuardrailPolicy
from retrieval.config import RetrievalPolicy


@dataclass(frozen=True)
class ModelPolicy:
    """What the request path needs to know about one model, for one request. ``version``
    names this policy (a digest of the model file's contents), sent back to clients."""

    guardrails: GuardrailPolicy
    retrieval: RetrievalPolicy
    requests: RequestPolicy
    version: str


class ModelFile(EngineSpec):
    """One model file: the engine part (``EngineSpec``'s fields) and the model's policies."""

    # Other names clients may use for this model (e.g. `gpt-4o-mini`); listed by /v1/models.
    aliases: list[str] = Field(default_factory=list)
    # A file without a section gets the stage switched off (or no defaults and caps).
    guardrails: GuardrailPolicy = Field(default_factory=lambda: GuardrailPolicy(enabled=False))
    retrieval: RetrievalPolicy = Field(default_factory=RetrievalPolicy)
    requests: RequestPolicy = RequestPolicy()

    @field_validator("aliases")
    @classmethod
    def _distinct(cls, aliases: list[str]) -> list[str]:
        if len(set(aliases)) != len(aliases) or any(not a for a in aliases):
            raise ValueError("aliases must be distinct, non-empty names")
        return aliases

    def engine_spec(self) -> EngineSpec:
        return EngineSpec.model_validate(self.model_dump(include=set(EngineSpec.model_fields)))

    def engine_fingerprint(self) -> str:
        """What a change needs an engine restart for: everything but the policies."""
        return self.engine_spec().model_dump_json()

    def policy(self) -> ModelPolicy:
        digest = hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:12]
        return ModelPolicy(self.guardrails, self.retrieval, self.requests, digest)


def load_model_file(path: str | Path) -> ModelFile:
    """Read one model YAML file; raises ConfigError naming the file, key and reason."""
    path = Path(path)
    try:
        return ModelFile.model_validate(read_yaml(path))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc)) from None
