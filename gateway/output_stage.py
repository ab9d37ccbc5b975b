"""Output rails on the engine's answer: streamed chunk by chunk, or on the whole response.

Every field of every choice that carries generated text (content, reasoning, refusal, tool call
names and arguments, completion text, and the tokens and alternatives of logprobs) gets its own
``StreamGuard`` (guardrails/output_rail.py), which holds back only what could still become a match and releases
text no rail objects to; gateway/output_fields.py says how each field is guarded. On a block in
any choice the stream ends with ``finish_reason: "content_filter"`` and the relay cancels the
engine call, so no more tokens are computed. The guards run in the ingress: they are pure
string checks costing microseconds per chunk, where a hop to another deployment would cost
milliseconds.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import APIError
from gateway.output_fields import CONTENT_FILTER, ChoiceGuards
from guardrails.config import GuardrailPolicy
from guardrails.metrics import RailMetrics

__all__ = ["CONTENT_FILTER", "OutputRail", "guard_response", "refuse_unguardable"]

# Request fields that make the engine answer in token ids: generated text no rail can read.
UNGUARDABLE_FIELDS = ("return_tokens_as_token_ids", "return_token_ids")


class OutputRail:
    """Filters one response stream's events through per-choice guards (``ChoiceGuards``)."""

    def __init__(self, policy: GuardrailPolicy, metrics: RailMetrics, *, chat: bool):
        self._policy = policy
        self._metrics = metrics
        self._chat = chat
        self._choices: dict[int, ChoiceGuards] = {}
        self.stopped = False  # set once a rail blocked: the relay then cancels the engine

    def __call__(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        choices = event.get("choices") or []
        if self.stopped or not choices:
            return [] if self.stopped and choices else [event]
        out: list[dict[str, Any]] = []
        for choice in choices:
            index = choice.get("index", 0)
            guards = self._choices.get(index)
            if guards is None:
                guards = self._choices[index] = ChoiceGuards(self._policy, self._metrics, chat=self._chat)
            sent = guards.filter(choice)
            if sent is not None:
                out.append({**event, "choices": [sent]})
            if guards.blocked:
                # One choice blocked: the whole stream ends, and every other open choice with it.
                self.stopped = True
                out += [{**event, "choices": [self._ended(i)]} for i, g in self._choices.items() if not g.finished]
                break
        return out

    def _ended(self, index: int) -> dict[str, Any]:
        body: dict[str, Any] = {"delta": {}} if self._chat else {"text": ""}
        return {"index": index, **body, "logprobs": None, "finish_reason": CONTENT_FILTER}


def guard_response(
    body: dict[str, Any], policy: GuardrailPolicy, metrics: RailMetrics, *, chat: bool
) -> dict[str, Any]:
    """The same rails on a non-streaming response: blocked text is cut at the violation."""
    for choice in body.get("choices", []):
        ChoiceGuards(policy, metrics, chat=chat).guard_whole(choice)
    return body


def refuse_unguardable(request: Any) -> None:
    """400 when a request asks for generated text as token ids, on a model whose output rails
    are on: the rails read text, so ids would carry past them whatever the policy forbids."""
    for name in UNGUARDABLE_FIELDS:
        if getattr(request, name, None):
            raise APIError(
                400,
                f"'{name}' is not available on this model: its output rails check generated text, "
                "which token ids would carry past them.",
                param=name,
                code="unsupported_with_output_rails",
            )
