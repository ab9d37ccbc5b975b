"""The chat path's stages before the engine: input rails, then retrieval.

Each function takes the collaborator it calls (a deployment handle), the model's current
policy and the parsed request, and either raises an ``APIError`` (the request is refused)
or rewrites the request in place. ``Gateway.chat_completions`` calls them in order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from ray.serve.handle import DeploymentHandle

from gateway.errors import UNAVAILABLE, APIError, bad_request
from gateway.retrieval_routes import call
from guardrails.config import GuardrailPolicy
from retrieval.config import RetrievalPolicy
from retrieval.records import Passage

logger = logging.getLogger(__name__)

# Messages whose text comes from people or tools rather than from the operator.
CHECKED_ROLES = frozenset({"user", "tool", "function"})


@dataclass
class _TextSlot:
    """Where one piece of message text lives, so a redaction can be written back."""

    message: dict[str, Any]
    part: dict[str, Any] | None  # a content part, or None for string content
    role: str

    def get(self) -> str:
        return self.part["text"] if self.part is not None else self.message["content"]

    def set(self, text: str) -> None:
        if self.part is not None:
            self.part["text"] = text
        else:
            self.message["content"] = text


def _text_slots(messages: list[dict[str, Any]]) -> list[_TextSlot]:
    slots = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            slots.append(_TextSlot(message, None, message["role"]))
        elif isinstance(content, list):
            slots.extend(
                _TextSlot(message, part, message["role"])
                for part in content
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            )
    return slots


def blocked_error(verdict) -> APIError:
    code = verdict.code.value if verdict.code else "guardrail_blocked"
    return APIError(400, f"The request was blocked by the {verdict.rail} guardrail: {verdict.reason}.", param="messages", code=code)


async def input_rails(guard: DeploymentHandle, model_id: str, policy: GuardrailPolicy, messages: list[dict[str, Any]]) -> None:
    """Size limits over every message; PII, injection and denied topics over what users and
    tools wrote. Blocks with a 400 naming the policy, or rewrites redacted text in place."""
    slots = _text_slots(messages)
    checked = [s for s in slots if s.role in CHECKED_ROLES]
    try:
        decision = await guard.check_input.remote(model_id, policy, [s.get() for s in checked], [s.get() for s in slots])
    except Exception as exc:
        # The guardrails deployment itself failed: fail closed unless the policy says otherwise.
        logger.error("guardrails unavailable for %s: %s", model_id, type(exc).__name__)
        if policy.fail_open:
            return
        raise APIError(503, "The guardrails service is unavailable; try again shortly.", type=UNAVAILABLE, code="guardrails_unavailable") from None
    if decision.verdict.blocked:
        raise blocked_error(decision.verdict)
    if decision.verdict.redacted:
        for slot, text in zip(checked, decision.texts):
            slot.set(text)


async def completion_input_rails(guard: DeploymentHandle, model_id: str, policy: GuardrailPolicy, prompt: Any) -> Any:
    """The input rails for ``/v1/completions``: a prompt string or list of strings is checked
    like user messages. Token-id prompts cannot be read by the rails, so a guarded model
    refuses them rather than let them pass unchecked."""
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise bad_request(
            "This model's guardrails check text; send 'prompt' as a string or an array of strings.",
            param="prompt", code="invalid_value",
        )
    messages = [{"role": "user", "content": t} for t in texts]
    await input_rails(guard, model_id, policy, messages)
    checked = [m["content"] for m in messages]
    return checked[0] if isinstance(prompt, str) else checked


@dataclass(frozen=True)
class RetrievalRequest:
    """What a request may ask of retrieval through ``extra_body={"retrieval": {...}}``."""

    enabled: bool | None = None
    collections: list[str] | None = None
    top_k: int | None = None
    return_sources: bool = False

    @classmethod
    def parse(cls, raw: Any, policy: RetrievalPolicy) -> "RetrievalRequest":
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise bad_request("'retrieval' must be an object.", param="retrieval", code="invalid_value")
        unknown = sorted(set(raw) - {"enabled", "collections", "top_k", "return_sources"})
        if unknown:
            raise bad_request(f"Unrecognized retrieval option: {unknown[0]}", param=f"retrieval.{unknown[0]}", code="unknown_parameter")
        override = {k for k in ("enabled", "collections", "top_k") if k in raw}
        if override and not policy.allow_request_override:
            raise bad_request("This model's retrieval policy does not allow requests to change it.", param="retrieval", code="retrieval_override_not_allowed")
        collections = raw.get("collections")
        if collections is not None and (not isinstance(collections, list) or not all(isinstance(c, str) for c in collections)):
            raise bad_request("'retrieval.collections' must be an array of vector store ids or names.", param="retrieval.collections", code="invalid_value")
        top_k = raw.get("top_k")
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 50):
            raise bad_request("'retrieval.top_k' must be an integer from 1 to 50.", param="retrieval.top_k", code="invalid_value")
        return cls(raw.get("enabled"), collections, top_k, bool(raw.get("return_sources", False)))


def source_of(p: Passage) -> dict[str, Any]:
    """A retrieved passage as returned to clients who ask for sources."""
    return {"vector_store_id": p.vector_store_id, "file_id": p.file_id, "filename": p.filename, "chunk_index": p.chunk_index, "score": round(p.score, 4)}


async def retrieval(
    retriever: DeploymentHandle,
    guard: DeploymentHandle | None,
    model_id: str,
    policy: RetrievalPolicy,
    guard_policy: GuardrailPolicy,
    request: RetrievalRequest,
    messages: list[dict[str, Any]],
) -> list[Passage]:
    """Find passages for the last user message and put them in a system message at the
    start of the conversation. Returns the passages used (for sources)."""
    enabled = policy.enabled if request.enabled is None else request.enabled
    collections = request.collections or policy.collections
    if not enabled or not collections:
        return []
    query = next((s.get() for s in reversed(_text_slots(messages)) if s.role == "user" and s.get().strip()), "")
    if not query:
        return []
    # Stores a request names must exist (404 otherwise); stores the policy names may not
    # have been created yet, and chat goes on without them.
    passages: list[Passage] = await call(
        retriever.retrieve.remote(collections, query, request.top_k or policy.top_k, policy.min_score, skip_missing=not request.collections)
    )
    if passages and guard is not None and guard_policy.enabled:
        verdicts = await guard.check_passages.remote(model_id, guard_policy, [p.text for p in passages])
        kept = []
        for p, v in zip(passages, verdicts):
            if v.blocked:
                # A poisoned document must not take the whole conversation down: drop it.
                logger.warning("dropped a retrieved passage of %s/%s: %s", p.vector_store_id, p.file_id, v.code)
                continue
            kept.append(p if not v.redacted or v.text is None else _with_text(p, v.text))
        passages = kept
    if not passages:
        return []
    # Canonical order (not score order), so the same passages always render the same
    # prefix and vLLM's prefix cache can reuse it across questions.
    ordered = sorted(passages, key=lambda p: (p.vector_store_id, p.file_id, p.chunk_index))
    messages.insert(0, {"role": "system", "content": policy.render(ordered)})
    return passages


def _with_text(p: Passage, text: str) -> Passage:
    return replace(p, text=text)
