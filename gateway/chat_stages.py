"""The chat path's stages before the engine: input rails, and retrieval beside them.

Each function takes the collaborator it calls (a deployment handle), the model's current
policy and the request, and either raises an ``APIError`` (the request is refused) or
rewrites the request in place. ``Gateway.chat_completions`` calls them in order. The retrieval
search (``PendingSearch``) needs only the request, as the input rails do: it is submitted
first and runs while they check, so a guarded request waits for the slower of the two, not
their sum. A refusal cancels the search; a redaction of the query searches again with the
redacted text, so the passages always answer the text the engine sees.

The input rails read the request as the client sent it (the JSON body), so every string a
client controls is found wherever it sits: any role's content, content parts, names, tool
calls and their arguments, reasoning fields, tool definitions and template arguments.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from gateway import metrics
from gateway.bounds import RetryableError, overloaded, retry_after_of, within
from gateway.errors import UNAVAILABLE, APIError, bad_request
from gateway.retrieval_routes import call
from guardrails.config import GuardrailPolicy
from guardrails.verdict import Verdict, VerdictCache, policy_version
from retrieval.config import RetrievalPolicy
from retrieval.records import Passage
from retrieval.tenancy import Caller

logger = logging.getLogger(__name__)

# Keys whose string values are structure, not text that reaches the prompt.
_STRUCTURAL_KEYS = frozenset({"role", "type"})
# Content part types the rails can read; a guarded model refuses the others (images, audio,
# files), since their content would reach the engine unchecked.
_TEXT_PART_TYPES = frozenset({"text", "refusal", "input_text", "output_text"})
# Top-level request fields whose strings a chat template may render into the prompt.
_PROMPT_FIELDS = ("tools", "functions", "tool_choice", "documents", "chat_template_kwargs", "response_format")
# Roles (and fields) whose texts are documents, not a person's turn: tool and function results
# and client-sent documents, judged by the injection rail as documents (indirect injection).
_DOCUMENT_ROLES = frozenset({"tool", "function", "documents"})
# Fields that change how the prompt is built in ways no text rail can judge.
_UNCHECKABLE_FIELDS = ("chat_template", "prompt_embeds", "mm_processor_kwargs")


@dataclass
class TextSlot:
    """One client-written string anywhere in a request, so a redaction can be written back.
    ``role`` is the message's role, or the request field's name outside ``messages``."""

    container: Any  # the dict or list holding the string
    key: str | int
    role: str

    def get(self) -> str:
        return self.container[self.key]

    def set(self, text: str) -> None:
        self.container[self.key] = text


def string_slots(value: Any, role: str, out: list[TextSlot], skip: frozenset[str] = _STRUCTURAL_KEYS) -> None:
    """Every non-empty string inside ``value`` (dicts and lists walked), as slots; strings under
    the keys in ``skip`` (structure, not text) are left out."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(item, str):
            if item and key not in skip:
                out.append(TextSlot(value, key, role))
        elif isinstance(item, (dict, list)):
            string_slots(item, role, out, skip)


def _unreadable(field: str, what: str) -> APIError:
    return bad_request(
        f"This model's guardrails check text and cannot check {what}; remove '{field}'.",
        param=field,
        code="unsupported_by_guardrails",
    )


def chat_texts(data: dict[str, Any]) -> list[TextSlot]:
    """Every text of a chat request that a client controls and a template can put into the
    prompt, whatever the role. Parts and fields the rails cannot read are refused (400)."""
    for name in _UNCHECKABLE_FIELDS:
        if data.get(name) is not None:
            raise _unreadable(name, "custom templates, embeddings or processor arguments")
    slots: list[TextSlot] = []
    for i, message in enumerate(data.get("messages") or []):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") not in _TEXT_PART_TYPES:
                    raise _unreadable(f"messages[{i}].content[{j}]", f"{part.get('type')!r} content parts")
        string_slots(message, str(message.get("role", "")), slots)
    for name in _PROMPT_FIELDS:
        value = data.get(name)
        if isinstance(value, str):
            if value:
                slots.append(TextSlot(data, name, name))
        elif value is not None:
            string_slots(value, name, slots)
    return slots


def completion_texts(data: dict[str, Any]) -> list[TextSlot]:
    """The prompt (a string or strings) and suffix of a completions request. Token-id prompts
    and prompt embeddings cannot be read by text rails, so a guarded model refuses them."""
    if data.get("prompt_embeds") is not None:
        raise _unreadable("prompt_embeds", "prompt embeddings")
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        slots = [TextSlot(data, "prompt", "user")]
    elif isinstance(prompt, list) and all(isinstance(t, str) for t in prompt):
        slots = [TextSlot(prompt, i, "user") for i in range(len(prompt))]
    else:
        raise bad_request(
            "This model's guardrails check text; send 'prompt' as a string or an array of strings.",
            param="prompt",
            code="invalid_value",
        )
    if isinstance(data.get("suffix"), str) and data["suffix"]:
        slots.append(TextSlot(data, "suffix", "user"))
    return slots


def blocked_error(verdict, param: str = "messages") -> APIError:
    code = verdict.code.value if verdict.code else "guardrail_blocked"
    return APIError(
        400, f"The request was blocked by the {verdict.rail} guardrail: {verdict.reason}.", param=param, code=code
    )


async def input_rails(
    guard: DeploymentHandle,
    model_id: str,
    policy: GuardrailPolicy,
    slots: list[TextSlot],
    *,
    param: str = "messages",
    timeout_s: float | None = None,
    retry_after_s: float | None = None,
) -> RailsOutcome:
    """Size limits over every text; PII, injection and denied topics over every text whose
    role the policy does not exempt. Blocks with a 400 naming the policy, or writes the
    redacted texts back into the request (``redacted``). Past ``timeout_s`` the check counts
    as failed: 504 unless the policy fails open."""
    checked = [s for s in slots if s.role not in policy.exempt_roles]
    try:
        instructions = [s.role in policy.injection.instruction_roles for s in checked]
        documents = [s.role in _DOCUMENT_ROLES for s in checked]
        call_ = guard.check_input.remote(
            model_id,
            policy,
            [s.get() for s in checked],
            [s.get() for s in slots],
            instructions,
            documents,
        )
        with metrics.stage("input_rails"):
            decision = await within(call_, timeout_s, "guardrails")
    except Exception as exc:
        # The guardrails deployment itself failed: fail closed unless the policy says otherwise.
        logger.error("guardrails unavailable for %s: %s", model_id, type(exc).__name__)
        if policy.fail_open:
            return RailsOutcome(False)
        raise stage_failure("guardrails", exc, retry_after_s) from None
    if decision.verdict.blocked:
        raise blocked_error(decision.verdict, param)
    if not decision.verdict.redacted:
        return RailsOutcome(False)
    for slot, text in zip(checked, decision.texts):
        slot.set(text)
    return RailsOutcome(True)


@dataclass(frozen=True)
class RailsOutcome:
    redacted: bool  # the request's texts were rewritten: parse it again


@dataclass(frozen=True)
class RetrievalRequest:
    """What a request may ask of retrieval through ``extra_body={"retrieval": {...}}``."""

    enabled: bool | None = None
    collections: list[str] | None = None
    top_k: int | None = None
    return_sources: bool = False

    @classmethod
    def parse(cls, raw: Any, policy: RetrievalPolicy) -> RetrievalRequest:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise bad_request("'retrieval' must be an object.", param="retrieval", code="invalid_value")
        unknown = sorted(set(raw) - {"enabled", "collections", "top_k", "return_sources"})
        if unknown:
            raise bad_request(
                f"Unrecognized retrieval option: {unknown[0]}",
                param=f"retrieval.{unknown[0]}",
                code="unknown_parameter",
            )
        override = {k for k in ("enabled", "collections", "top_k") if k in raw}
        if override and not policy.allow_request_override:
            raise bad_request(
                "This model's retrieval policy does not allow requests to change it.",
                param="retrieval",
                code="retrieval_override_not_allowed",
            )
        collections = raw.get("collections")
        if collections is not None and (
            not isinstance(collections, list)
            or not all(isinstance(c, str) for c in collections)
            or len(collections) > 16
        ):
            raise bad_request(
                "'retrieval.collections' must be an array of at most 16 vector store ids or names.",
                param="retrieval.collections",
                code="invalid_value",
            )
        top_k = raw.get("top_k")
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 50):
            raise bad_request(
                "'retrieval.top_k' must be an integer from 1 to 50.", param="retrieval.top_k", code="invalid_value"
            )
        return_sources = raw.get("return_sources", False)
        if not isinstance(return_sources, bool):
            raise bad_request(
                "'retrieval.return_sources' must be a boolean.", param="retrieval.return_sources", code="invalid_value"
            )
        return cls(raw.get("enabled"), collections, top_k, return_sources)


def source_of(p: Passage) -> dict[str, Any]:
    """A retrieved passage as returned to clients who ask for sources."""
    return {
        "vector_store_id": p.vector_store_id,
        "file_id": p.file_id,
        "filename": p.filename,
        "chunk_index": p.chunk_index,
        "score": round(p.score, 4),
    }


def last_user_text(messages: list[dict[str, Any]]) -> str:
    """The retrieval query: the text of the last user message that has any."""
    for message in reversed(messages):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(
                p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        if isinstance(content, str) and content.strip():
            return content
    return ""


class PendingSearch:
    """The retrieval search for the last user message, submitted as soon as the request is read
    so that it runs while the input rails check the same request (both need only the request).
    ``passages()`` awaits it; ``cancel()`` drops it (the rails refused the request). A redaction
    that changes the query re-submits it with the redacted text (``submit`` again), so the
    passages always answer the text the engine will see.

    The policy's stores are the operator's (by id, or by a name among the operator's own
    stores); a request may name only its caller's stores or the policy's. When the search fails
    or times out, ``policy.on_error`` decides: answer without passages, or refuse (503/504). A
    client's own mistake (an unknown store) stays a 4xx.
    """

    def __init__(
        self,
        retriever: DeploymentHandle | None,
        model_id: str,
        policy: RetrievalPolicy,
        request: RetrievalRequest,
        caller: Caller,
        *,
        timeout_s: float | None = None,
        retry_after_s: float | None = None,
    ):
        self.model_id, self.policy, self.request, self.caller = model_id, policy, request, caller
        self._retriever, self._timeout_s, self._retry_after_s = retriever, timeout_s, retry_after_s
        enabled = policy.enabled if request.enabled is None else request.enabled
        self.wanted = retriever is not None and enabled and bool(request.collections or policy.collections)
        self.query = ""
        self._response: Any = None
        self._task: asyncio.Future | None = None

    def submit(self, messages: list[dict[str, Any]]) -> PendingSearch:
        """Search for the last user message's text, unless that search is already running."""
        query = last_user_text(messages) if self.wanted else ""
        if query == self.query:
            return self
        self.cancel()
        self.query = query
        if query:
            self._response = self._retriever.retrieve.remote(
                self.policy.collections,
                self.request.collections,
                query,
                self.request.top_k or self.policy.top_k,
                self.policy.min_score,
                caller=self.caller,
            )
            self._task = asyncio.ensure_future(self._search(self._response))
        return self

    async def _search(self, response: Any) -> list[Passage]:
        with metrics.stage("retrieval_search"):
            return await call(within(response, self._timeout_s, "retrieval"), "retrieval", self._retry_after_s)

    def cancel(self) -> None:
        """Drop the search (the deployment call too, if it is still running)."""
        task, self._task = self._task, None
        if task is None:
            return
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: no "exception never retrieved" warning
        else:
            task.cancel()
            self._response.cancel()

    async def passages(self) -> list[Passage]:
        """The passages found ([] when retrieval does not apply, or failed and the policy answers
        without them)."""
        if self._task is None:
            return []
        try:
            return await self._task
        except Exception as exc:
            if isinstance(exc, APIError) and exc.status < 500 and not isinstance(exc, RetryableError):
                raise
            _degrade(self.policy, self.model_id, "retrieval", exc, self._retry_after_s)
            return []


async def retrieved_passages(
    search: PendingSearch,
    guard: DeploymentHandle | None,
    guard_policy: GuardrailPolicy,
    messages: list[dict[str, Any]],
    *,
    guardrails_timeout_s: float | None = None,
    retry_after_s: float | None = None,
    known: VerdictCache | None = None,
) -> list[Passage]:
    """Await the search's passages, check them with the same rails, and put them in a system
    message at the start of the conversation. Returns the passages used (for sources).
    ``known``: the ingress's verdicts of passages it has seen checked (see ``_checked_passages``)."""
    policy, model_id = search.policy, search.model_id
    passages = await search.passages()
    if passages and guard is not None and guard_policy.enabled:
        try:
            with metrics.stage("passage_check"):
                passages = await _checked_passages(guard, model_id, guard_policy, passages, guardrails_timeout_s, known)
        except Exception as exc:
            # Never unchecked passages: without a verdict they are all left out.
            _degrade(policy, model_id, "guardrails", exc, retry_after_s)
            return []
    if not passages:
        return []
    # Canonical order (not score order), so the same passages always render the same
    # prefix and vLLM's prefix cache can reuse it across questions.
    ordered = sorted(passages, key=lambda p: (p.vector_store_id, p.file_id, p.chunk_index))
    messages.insert(0, {"role": "system", "content": policy.render(ordered)})
    return passages


def stage_failure(stage: str, exc: BaseException, retry_after_s: float | None) -> APIError:
    """The client's error when a stage deployment failed: its own timeout (504), a full queue
    (503 with Retry-After), or anything else (503)."""
    if isinstance(exc, RetryableError):
        return exc
    if isinstance(exc, BackPressureError):
        return overloaded(stage, retry_after_of(exc, retry_after_s))
    return APIError(
        503, f"The {stage} service is unavailable; try again shortly.", type=UNAVAILABLE, code=f"{stage}_unavailable"
    )


def _degrade(
    policy: RetrievalPolicy, model_id: str, stage: str, exc: BaseException, retry_after_s: float | None
) -> None:
    """Answer without passages (the policy's ``on_error: answer_without``), or raise."""
    reason = exc.code if isinstance(exc, APIError) else type(exc).__name__
    if policy.on_error == "fail":
        logger.error("%s failed for %s (%s): refusing the request", stage, model_id, reason)
        raise stage_failure(stage, exc, retry_after_s) from None
    logger.warning("%s failed for %s (%s): answering without passages", stage, model_id, reason)


async def _checked_passages(
    guard: DeploymentHandle,
    model_id: str,
    policy: GuardrailPolicy,
    passages: list[Passage],
    timeout_s: float | None = None,
    known: VerdictCache | None = None,
) -> list[Passage]:
    """The same rails on what retrieval found: each passage's text and the filename placed
    beside it. A passage that fails either is dropped (a poisoned document must not take the
    whole conversation down); a redaction is applied.

    Stored passages come back question after question: the verdicts the guardrails gave are
    kept in ``known`` (by this policy's version and the text), and only texts not found there
    are sent, so a search that finds known passages costs no call to the guardrails."""
    texts = [t for p in passages for t in (p.text, p.filename)]
    version = "passage:" + policy_version(policy)
    keys = [VerdictCache.key(version, t) for t in texts]
    verdicts: list[Verdict | None] = [known.get(k) if known is not None else None for k in keys]
    todo = [i for i, v in enumerate(verdicts) if v is None]
    if todo:
        call_ = guard.check_passages.remote(model_id, policy, [texts[i] for i in todo])
        for i, verdict in zip(todo, await within(call_, timeout_s, "guardrails")):
            verdicts[i] = verdict
            if known is not None:
                known.put(keys[i], verdict)
    kept = []
    for i, p in enumerate(passages):
        text_v, name_v = verdicts[2 * i], verdicts[2 * i + 1]
        if text_v.blocked or name_v.blocked:
            code = (text_v if text_v.blocked else name_v).code
            logger.warning("dropped a retrieved passage of %s/%s: %s", p.vector_store_id, p.file_id, code)
            continue
        if text_v.redacted and text_v.text is not None:
            p = replace(p, text=text_v.text)
        if name_v.redacted and name_v.text is not None:
            p = replace(p, filename=name_v.text)
        kept.append(p)
    return kept
