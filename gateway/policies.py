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

from engines.config import ConfigError
from gateway.model_file import ModelFile, ModelPolicy, load_model_file

logger = logging.getLogger(__name__)


@dataclass
class _Watched:
    path: Path
    mtime_ns: int
    config: ModelFile
    policy: ModelPolicy


@dataclass
class PolicyStore:
    """Current policy per model id, refreshed from the model files on demand."""

    files: dict[str, _Watched] = field(default_factory=dict)
    reload_errors: int = 0

    @classmethod
    def from_configs(cls, configs: dict[str, tuple[Path, ModelFile]]) -> PolicyStore:
        store = cls()
        for model_id, (path, config) in configs.items():
            store.files[model_id] = _Watched(path, _mtime(path), config, config.policy())
        return store

    def get(self, model_id: str) -> ModelPolicy:
        return self.files[model_id].policy

    def aliases(self) -> dict[str, str]:
        """Alias -> model id, for every model."""
        return {alias: model_id for model_id, w in self.files.items() for alias in w.config.aliases}

    def refresh(self) -> list[str]:
        """Re-read changed files; returns the model ids whose policy changed."""
        changed = []
        for model_id, watched in self.files.items():
            mtime = _mtime(watched.path)
            if mtime == watched.mtime_ns:
                continue
            watched.mtime_ns = mtime
            try:
                new = load_model_file(watched.path)
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
            old = watched.policy
            watched.config, watched.policy = new, new.policy()
            if watched.policy.version != old.version:
                logger.info("policy of %s reloaded from %s", model_id, watched.path)
                changed.append(model_id)
        return changed


def _mtime(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1
