"""Per-model request defaults and caps: the `requests:` section of a model file.

Chat UIs send neither `max_tokens` nor `temperature`; without defaults a small model samples at
vLLM's temperature 1.0 until the context is full (minutes on a CPU, and nonsense). Defaults fill
what a request left out; caps refuse a request past them with a 400 naming the field, or clamp
it when the policy says so. Both work on the request body before it is parsed, so the same code
serves chat and completions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from gateway.errors import bad_request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestDefaults(_Strict):
    """Values for fields a request did not set (or set to null)."""

    max_tokens: PositiveInt | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # vLLM's (HF-style) penalty on tokens already in the prompt or the answer; small models
    # fall into loops ("la femme, la femme, ...") without it.
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)


class RequestCaps(_Strict):
    """Upper bounds on what a request may ask for. Unset: no cap beyond the engine's own."""

    max_tokens: PositiveInt | None = None
    n: PositiveInt | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    # Alternatives per position (chat `top_logprobs`, completions `logprobs`); 0 forbids logprobs.
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: int | None = Field(None, ge=0, le=64, description="stop strings per request")
    stop_chars: PositiveInt = Field(256, description="length of one stop string")


class RequestPolicy(_Strict):
    """The whole `requests:` section."""

    defaults: RequestDefaults = RequestDefaults()
    caps: RequestCaps = RequestCaps()
    # reject: a 400 naming the field; clamp: lower the value to the cap and serve.
    over_cap: Literal["reject", "clamp"] = "reject"


def apply(policy: RequestPolicy, data: dict[str, Any], *, chat: bool) -> None:
    """Fill defaults into and enforce caps on a request body, in place."""
    length_field = _length_field(data) if chat else "max_tokens"
    defaults = policy.defaults
    if defaults.max_tokens is not None and data.get(length_field) is None:
        data[length_field] = min(defaults.max_tokens, policy.caps.max_tokens or defaults.max_tokens)
    for name in ("temperature", "top_p", "repetition_penalty"):
        value = getattr(defaults, name)
        if value is not None and data.get(name) is None:
            data[name] = value
    caps = policy.caps
    _cap(policy, data, length_field, caps.max_tokens)
    _cap(policy, data, "n", caps.n)
    _cap(policy, data, "temperature", caps.temperature)
    logprobs_field = "top_logprobs" if chat else "logprobs"
    if caps.top_logprobs == 0 and data.get("logprobs") not in (None, False):
        raise bad_request("This model does not return logprobs.", param="logprobs", code="invalid_value")
    _cap(policy, data, logprobs_field, caps.top_logprobs)
    _check_stop(caps, data.get("stop"))


def _length_field(data: dict[str, Any]) -> str:
    # OpenAI's current name for chat is max_completion_tokens; max_tokens still works.
    return "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"


def _cap(policy: RequestPolicy, data: dict[str, Any], name: str, cap: float | None) -> None:
    value = data.get(name)
    if cap is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # absent, or a wrong type the request parser reports
    if value <= cap:
        return
    if policy.over_cap == "clamp":
        data[name] = type(value)(cap) if isinstance(value, int) else float(cap)
        return
    raise bad_request(f"'{name}' is {value}, above this model's limit of {cap:g}.", param=name, code="invalid_value")


def _check_stop(caps: RequestCaps, stop: Any) -> None:
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if caps.stop is not None and len(stops) > caps.stop:
        raise bad_request(
            f"'stop' may hold at most {caps.stop} strings for this model.", param="stop", code="invalid_value"
        )
    if any(isinstance(s, str) and len(s) > caps.stop_chars for s in stops):
        raise bad_request(
            f"Each 'stop' string may be at most {caps.stop_chars} characters.", param="stop", code="invalid_value"
        )
