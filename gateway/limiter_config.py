"""What limits a key: the ``limits`` section of ``gateway.yaml`` (defaults for every key) and a
principal's ``limits`` in the keys file (overrides, re-read with the keys file, no restart)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engines.config import StrictModel


class RateLimits(StrictModel):
    """Per-minute windows and concurrency, for a key or for a key on one model. ``null``: no limit."""

    requests_per_minute: int | None = Field(None, ge=1)
    # Prompt + completion tokens, charged from the engine's usage when a request ends.
    tokens_per_minute: int | None = Field(None, ge=1)
    concurrent_requests: int | None = Field(None, ge=1)

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.concurrent_requests))

    def over(self, base: RateLimits | None) -> RateLimits:
        """These limits where set, ``base``'s elsewhere (an explicit ``null`` removes a limit)."""
        if base is None:
            return self
        return base.model_copy(
            update={k: getattr(self, k) for k in self.model_fields_set if k in RateLimits.model_fields}
        )


class Budget(StrictModel):
    """Tokens (prompt + completion) a key may use per calendar day or month (UTC). Strict: the
    answer that reaches it is cut there, and later requests get 429 ``insufficient_quota``."""

    tokens: int = Field(..., ge=1)
    period: Literal["day", "month"] = "day"


class KeyLimits(RateLimits):
    """A key's limits: across all models, per model (``models: {model_id: {...}}``), and a budget."""

    budget: Budget | None = None
    models: dict[str, RateLimits] = Field(default_factory=dict)

    @property
    def active(self) -> bool:
        return super().active or self.budget is not None or any(m.active for m in self.models.values())

    def over(self, base: KeyLimits | None) -> KeyLimits:  # type: ignore[override]
        if base is None:
            return self
        update = {k: getattr(self, k) for k in self.model_fields_set if k != "models"}
        models = dict(base.models)
        for model_id, limits in self.models.items():
            models[model_id] = limits.over(base.models.get(model_id))
        return base.model_copy(update={**update, "models": models})


class LimitsSettings(StrictModel):
    """The ``limits`` section of gateway.yaml. Off unless some key has a limit."""

    default: KeyLimits = KeyLimits()
    # The rate windows' length: "per minute" is per `window_s` seconds (tests shrink it).
    window_s: float = Field(60.0, gt=0)
    # When the limiter cannot be reached in `limiter_timeout_s`: serve without limits ("open")
    # or refuse with 503 ("closed").
    on_limiter_failure: Literal["open", "closed"] = "open"
    limiter_timeout_s: float = Field(0.5, gt=0)
    # Budgets in use, persisted atomically (relative to gateway.yaml).
    budget_file: str = Field("../.data/limits/budgets.json", description="relative to this file")
    # A slot held by an ingress replica that died is freed after this long.
    lease_ttl_s: float = Field(3600.0, gt=0)
    # A request without max_tokens (and no model default) is assumed to generate this many
    # tokens while it is in flight (token windows reserve it; see README "Limits").
    completion_estimate_tokens: int = Field(1024, ge=1)
    num_cpus: float = Field(0.05, ge=0)
