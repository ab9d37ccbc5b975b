"""Per-model stage policies, re-read from the model files while the gateway serves.

Operators edit ``configs/models/<model>.yaml``; within ``reload_interval_s`` the ingress
applies the new ``guardrails`` and ``retrieval`` sections to the next request, without
restarting anything. A file that no longer validates keeps the last good policy (and the
error is logged and counted) rather than leaving a model unguarded. Changes to engine
sections need the model's replicas restarted; they are reported, not applied, here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from engines.config import ConfigError, ModelConfig, load_model_config
from guardrails.config import GuardrailPolicy
from retrieval.config import RetrievalPolicy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPolicy:
    """What the chat stages need to know about one model, for one request."""

    guardrails: GuardrailPolicy
    retrieval: RetrievalPolicy


@dataclass
class _Watched:
    path: Path
    mtime_ns: int
    config: ModelConfig


@dataclass
class PolicyStore:
    """Current policy per model id, refreshed from the model files on demand."""

    files: dict[str, _Watched] = field(default_factory=dict)
    reload_errors: int = 0

    @classmethod
    def from_configs(cls, configs: dict[str, tuple[Path, ModelConfig]]) -> "PolicyStore":
        store = cls()
        for model_id, (path, config) in configs.items():
            store.files[model_id] = _Watched(path, _mtime(path), config)
        return store

    def get(self, model_id: str) -> ModelPolicy:
        config = self.files[model_id].config
        return ModelPolicy(guardrails=config.guardrails, retrieval=config.retrieval)

    def refresh(self) -> list[str]:
        """Re-read changed files; returns the model ids whose policy changed."""
        changed = []
        for model_id, watched in self.files.items():
            mtime = _mtime(watched.path)
            if mtime == watched.mtime_ns:
                continue
            watched.mtime_ns = mtime
            try:
                new = load_model_config(watched.path)
            except ConfigError as exc:
                self.reload_errors += 1
                logger.error("keeping the last good policy for %s: %s", model_id, exc)
                continue
            if new.model_id != model_id:
                self.reload_errors += 1
                logger.error("%s: model_id changed to %r; redeploy to rename a model", watched.path, new.model_id)
                continue
            if new.engine_fingerprint() != watched.config.engine_fingerprint():
                logger.warning("%s: engine settings changed; they apply when the model is redeployed", watched.path)
            old = watched.config
            watched.config = new
            if (new.guardrails, new.retrieval) != (old.guardrails, old.retrieval):
                logger.info("policy of %s reloaded from %s", model_id, watched.path)
                changed.append(model_id)
        return changed


def _mtime(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1
