"""Output rails on the engine's answer: streamed chunk by chunk, or on the whole response.

Each choice gets its own ``StreamGuard`` (guardrails/output_rail.py), which holds back a
bounded window and releases only text no rail objects to. On a block the stream ends with
``finish_reason: "content_filter"`` and the relay cancels the engine call, so no more tokens
are computed. The guards run in the ingress: they are pure string checks costing
microseconds per chunk, where a hop to another deployment would cost milliseconds.
"""

from __future__ import annotations

from typing import Any

from guardrails.config import GuardrailPolicy
from guardrails.metrics import RailMetrics
from guardrails.output_rail import StreamGuard

CONTENT_FILTER = "content_filter"


def _chat_text(choice: dict[str, Any]) -> str | None:
    return (choice.get("delta") or {}).get("content")


def _completion_text(choice: dict[str, Any]) -> str | None:
    return choice.get("text")


class OutputRail:
    """Filters one response stream's events through per-choice StreamGuards."""

    def __init__(self, policy: GuardrailPolicy, metrics: RailMetrics, *, chat: bool):
        self._policy = policy
        self._metrics = metrics
        self._chat = chat
        self._guards: dict[int, StreamGuard] = {}
        self.stopped = False  # set once a rail blocked: the relay then cancels the engine

    def _guard(self, index: int) -> StreamGuard:
        guard = self._guards.get(index)
        if guard is None:
            guard = self._guards[index] = StreamGuard.from_policy(self._policy, metrics=self._metrics)
        return guard

    def _with_text(self, event: dict[str, Any], choice: dict[str, Any], text: str, finish: str | None) -> dict[str, Any]:
        new_choice = {k: v for k, v in choice.items() if k not in ("delta", "text", "finish_reason")}
        new_choice["finish_reason"] = finish
        if self._chat:
            delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "content"}
            delta["content"] = text
            new_choice["delta"] = delta
        else:
            new_choice["text"] = text
        return {**event, "choices": [new_choice]}

    def __call__(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        choices = event.get("choices") or []
        if self.stopped or not choices:
            return [] if self.stopped and choices else [event]
        out: list[dict[str, Any]] = []
        for choice in choices:
            guard = self._guard(choice.get("index", 0))
            text = (_chat_text if self._chat else _completion_text)(choice)
            step = guard.push(text) if text else None
            finish = choice.get("finish_reason")
            if finish is not None and (step is None or not step.verdict.blocked):
                done = guard.finish()
                released = (step.text if step else "") + done.text
                step = done if done.verdict.blocked else step
                if done.verdict.blocked:
                    finish = CONTENT_FILTER
                out.append(self._with_text(event, choice, released, finish))
                if finish == CONTENT_FILTER:
                    self.stopped = True
                continue
            if step is not None and step.verdict.blocked:
                out.append(self._with_text(event, choice, step.text, CONTENT_FILTER))
                self.stopped = True
                continue
            if step is None:
                out.append(event if len(choices) == 1 else {**event, "choices": [choice]})  # e.g. the role chunk
            elif step.text:
                out.append(self._with_text(event, choice, step.text, None))
        return out


def guard_response(body: dict[str, Any], policy: GuardrailPolicy, metrics: RailMetrics, *, chat: bool) -> dict[str, Any]:
    """The same rails on a non-streaming response: blocked text is cut at the violation."""
    for choice in body.get("choices", []):
        guard = StreamGuard.from_policy(policy, metrics=metrics)
        holder: dict[str, Any] = choice["message"] if chat else choice
        key = "content" if chat else "text"
        text = holder.get(key)
        if not text:
            continue
        first = guard.push(text)
        last = guard.finish() if not first.verdict.blocked else first
        holder[key] = first.text + (last.text if last is not first else "")
        if last.verdict.blocked:
            choice["finish_reason"] = CONTENT_FILTER
    return body
