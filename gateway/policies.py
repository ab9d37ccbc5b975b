"""The models the ingress serves and their policies, as Serve last pushed them.

``gateway deploy`` (gateway/deploy.py) puts every model's file into the ingress deployment's
``user_config``; Serve calls ``Gateway.reconfigure`` with it on every replica, on every node,
without a restart. Each call builds a new immutable ``Routes``; the ingress swaps it in
whole, so a request that has read its route keeps that policy to its end and the next request
sees the new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from engines.config import StrictModel
from gateway.model_file import ModelFile, ModelPolicy

logger = logging.getLogger(__name__)


class PushedModel(StrictModel):
    """One model in the ingress's ``user_config``."""

    app: str  # the model's Serve application
    deployment: str  # its LLMServer deployment
    source: str  # the file it was read from (shown to operators)
    file: ModelFile


class PushedConfig(StrictModel):
    models: list[PushedModel]


@dataclass(frozen=True)
class ModelRoute:
    """Everything the request path needs for one model, fixed for one request."""

    model_id: str
    engine: Any  # EngineClient
    policy: ModelPolicy
    max_model_len: int | None
    source: str
    app: str
    applied_at: float  # when this replica started using this version


@dataclass(frozen=True)
class Routes:
    models: dict[str, ModelRoute] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> model id

    def resolve(self, name: str) -> ModelRoute | None:
        return self.models.get(self.aliases.get(name, name))

    def effective(self) -> dict[str, Any]:
        """What an operator reads back (the admin route): per model, its version, when this
        replica applied it, where it came from, and its policy."""
        out = {}
        for model_id, r in self.models.items():
            p = r.policy
            out[model_id] = {
                "version": p.version,
                "applied_at": r.applied_at,
                "source": r.source,
                "application": r.app,
                "aliases": [a for a, m in self.aliases.items() if m == model_id],
                "max_model_len": r.max_model_len,
                "guardrails": p.guardrails.model_dump(mode="json"),
                "retrieval": p.retrieval.model_dump(mode="json"),
                "requests": p.requests.model_dump(mode="json"),
            }
        return out


def build_routes(
    user_config: dict[str, Any], previous: Routes, engine_client: Callable[[str, str], Any]
) -> tuple[Routes, list[str]]:
    """The routes for a pushed ``user_config``; engine clients of unchanged models are kept.
    Returns them and the ids of models whose config changed. Raises ValueError if invalid."""
    try:
        pushed = PushedConfig.model_validate(user_config)
    except ValidationError as exc:
        raise ValueError(f"invalid ingress user_config: {exc}") from None
    now = time.time()
    models: dict[str, ModelRoute] = {}
    aliases: dict[str, str] = {}
    changed = []
    for m in pushed.models:
        model_id = m.file.model_id
        policy = m.file.policy()
        old = previous.models.get(model_id)
        same_engine = old is not None and old.app == m.app
        engine = old.engine if same_engine else engine_client(m.deployment, m.app)
        same = old is not None and old.policy.version == policy.version
        if not same:
            changed.append(model_id)
        models[model_id] = ModelRoute(
            model_id=model_id,
            engine=engine,
            policy=policy,
            max_model_len=m.file.engine.kwargs.get("max_model_len"),
            source=m.source,
            app=m.app,
            applied_at=old.applied_at if same else now,
        )
        for alias in m.file.aliases:
            aliases[alias] = model_id
    names = list(models) + list(aliases)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"model names used twice: {duplicates}")
    changed += [m for m in previous.models if m not in models]
    return Routes(models, aliases), changed
