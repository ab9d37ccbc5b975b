"""The Responses API's request side: reading the body, the texts the input rails check, the
model's defaults and caps, the ``file_search`` tool, and the body the engine gets.

The gateway owns a response's conversation: a request continuing ``previous_response_id`` is
sent to vLLM as one whole conversation (the stored items, the previous output, the new input)
with ``store: false``, so vLLM's own per-replica store is never needed.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

from gateway import request_policy
from gateway.chat_stages import TextSlot, string_slots
from gateway.errors import APIError, bad_request
from gateway.protocol import validate
from retrieval.records import Passage

# Item types whose text the rails can read, and the content part types inside them.
_READABLE_ITEMS = frozenset({"message", "function_call", "function_call_output", "reasoning"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "refusal", "summary_text", "reasoning_text", "text"})
# Keys of an item that are structure (ids, kinds, states), never prompt text.
_STRUCTURAL_KEYS = frozenset({"role", "type", "id", "call_id", "status"})
# Top-level fields whose strings reach the prompt (tool definitions, template arguments, formats).
_PROMPT_FIELDS = ("tools", "tool_choice", "text", "chat_template_kwargs")
# Fields that change the prompt in ways no text rail can judge.
_UNCHECKABLE_FIELDS = ("mm_processor_kwargs", "previous_input_messages", "prompt")
# OpenAI features this gateway does not offer, refused by name rather than ignored.
_UNSUPPORTED_FIELDS = ("conversation", "background")
MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
FILE_SEARCH = "file_search"
MAX_VECTOR_STORES = 16


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _unreadable(param: str, what: str) -> APIError:
    return bad_request(
        f"This model's guardrails check text and cannot check {what}; remove '{param}'.",
        param=param,
        code="unsupported_by_guardrails",
    )


@dataclass(frozen=True)
class FileSearch:
    """The request's ``file_search`` tool: our vector stores, searched by the retrieval stage."""

    vector_store_ids: list[str]
    max_num_results: int | None = None


@dataclass
class ResponsesCall:
    """One ``POST /v1/responses`` as the client sent it (the fields the gateway acts on)."""

    response_id: str
    input_items: list[dict[str, Any]]
    instructions: str | None
    tools: list[Any]
    previous_response_id: str | None
    store: bool
    stream: bool
    include: list[str]
    file_search: FileSearch | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def parse(cls, data: dict[str, Any]) -> ResponsesCall:
        """Check the fields the gateway reads and turn ``input`` into items (in place)."""
        for name in _UNSUPPORTED_FIELDS:
            if data.get(name):
                raise bad_request(
                    f"'{name}' is not supported by this server.", param=name, code="unsupported_parameter"
                )
        if "input" not in data:
            raise bad_request("Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
        data["input"] = input_items(data["input"])
        instructions = data.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string.", param="instructions", code="invalid_type")
        previous = data.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise bad_request(
                "'previous_response_id' must be a string.", param="previous_response_id", code="invalid_type"
            )
        include = data.get("include") or []
        if not isinstance(include, list):
            raise bad_request("'include' must be an array.", param="include", code="invalid_type")
        tools = data.get("tools") or []
        if not isinstance(tools, list):
            raise bad_request("'tools' must be an array.", param="tools", code="invalid_type")
        return cls(
            response_id=new_id("resp"),
            input_items=data["input"],
            instructions=instructions,
            tools=copy.deepcopy(tools),
            previous_response_id=previous,
            store=data.get("store") is not False,
            stream=bool(data.get("stream")),
            include=list(include),
            file_search=_file_search(tools),
        )

    def engine_body(self, data: dict[str, Any], passages_item: dict[str, Any] | None) -> dict[str, Any]:
        """What vLLM gets: the whole conversation, our id, no store, no file_search tool."""
        body = {k: v for k, v in data.items() if k not in ("previous_response_id", "store", "include")}
        body["input"] = ([passages_item] if passages_item else []) + [
            _for_engine(item) for item in self.history + data["input"]
        ]
        body["tools"] = [t for t in data.get("tools") or [] if not _is_file_search(t)]
        body["store"] = False
        body["request_id"] = self.response_id
        include = [i for i in self.include if i != "file_search_call.results"]
        if include:
            body["include"] = include
        return body


def input_items(value: Any) -> list[dict[str, Any]]:
    """``input`` as a list of items: a string is one user message; each easy message
    (``{"role", "content"}``) becomes a ``message`` item with content parts."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request(
            "'input' must be a string or a non-empty array of items.", param="input", code="invalid_value"
        )
    items = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad_request(f"'input[{i}]' must be an object.", param=f"input[{i}]", code="invalid_type")
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_request(
                    f"Invalid value for 'input[{i}].role': {role!r} is not one of {sorted(MESSAGE_ROLES)}.",
                    param=f"input[{i}].role",
                    code="invalid_value",
                )
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if role == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
            elif not isinstance(content, list):
                raise bad_request(
                    f"'input[{i}].content' must be a string or an array of content parts.",
                    param=f"input[{i}].content",
                    code="invalid_value",
                )
        items.append(item)
    return items


def stored_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as ``input_items`` lists them: each with an id and a status."""
    out = []
    for item in items:
        item = copy.deepcopy(item)
        item.setdefault("id", new_id("msg" if item.get("type") == "message" else "item"))
        if item.get("type") == "message":
            item.setdefault("status", "completed")
        out.append(item)
    return out


def _for_engine(item: dict[str, Any]) -> dict[str, Any]:
    # vLLM parses assistant messages as output messages (which carry ids); other messages
    # are typed dicts that do not.
    if item.get("type") == "message" and item.get("role") != "assistant":
        return {k: v for k, v in item.items() if k not in ("id", "status")}
    return item


def output_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output as the next turn's input: its messages (with text), function
    calls and reasoning; retrieval items stay out (their passages were that turn's context)."""
    items = []
    for item in output:
        kind = item.get("type")
        if kind == "message":
            content = [c for c in item.get("content") or [] if c.get("type") == "output_text" and c.get("text")]
            if content:
                items.append({**item, "content": content})
        elif kind in ("function_call", "reasoning"):
            items.append(item)
    return items


def _is_file_search(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type") == FILE_SEARCH


def _file_search(tools: list[Any]) -> FileSearch | None:
    found = [t for t in tools if _is_file_search(t)]
    if not found:
        return None
    if len(found) > 1:
        raise bad_request("Only one 'file_search' tool may be given.", param="tools", code="invalid_value")
    tool = found[0]
    ids = tool.get("vector_store_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or len(ids) > MAX_VECTOR_STORES
        or not all(isinstance(i, str) and i for i in ids)
    ):
        raise bad_request(
            f"'file_search.vector_store_ids' must be an array of 1 to {MAX_VECTOR_STORES} vector store ids.",
            param="tools.vector_store_ids",
            code="invalid_value",
        )
    k = tool.get("max_num_results")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 50):
        raise bad_request(
            "'file_search.max_num_results' must be an integer from 1 to 50.",
            param="tools.max_num_results",
            code="invalid_value",
        )
    for unsupported in ("filters", "ranking_options"):
        if tool.get(unsupported):
            raise bad_request(
                f"'file_search.{unsupported}' is not supported by this server.",
                param=f"tools.{unsupported}",
                code="unsupported_parameter",
            )
    return FileSearch(list(ids), k)


def apply_request_policy(policy: request_policy.RequestPolicy, data: dict[str, Any]) -> None:
    """The model's defaults and caps: ``max_output_tokens`` is the model's ``max_tokens``;
    output logprobs (``include: message.output_text.logprobs``) count as ``logprobs``."""
    names = ("temperature", "top_p", "repetition_penalty", "top_logprobs", "stop")
    view = {k: data[k] for k in names if k in data}
    view["max_tokens"] = data.get("max_output_tokens")
    if "message.output_text.logprobs" in (data.get("include") or []):
        view["logprobs"] = True
    try:
        request_policy.apply(policy, view, chat=True)
    except APIError as exc:
        if exc.param == "max_tokens":
            exc.param = "max_output_tokens"
            exc.message = exc.message.replace("'max_tokens'", "'max_output_tokens'")
        raise
    view["max_output_tokens"] = view.pop("max_tokens")
    view.pop("logprobs", None)
    data.update({k: v for k, v in view.items() if v is not None})


def check_request(data: dict[str, Any]) -> None:
    """vLLM's own request model, on a copy (its validators rewrite ``input``): 400s naming the
    field before anything reaches a stage."""
    validate(ResponsesRequest, copy.deepcopy(data))


def response_texts(data: dict[str, Any]) -> list[TextSlot]:
    """Every text of a Responses request that a client controls and the prompt may carry:
    ``instructions``, every input item (messages of any role, function calls and their outputs,
    reasoning), tool definitions and template arguments. What the rails cannot read (images,
    files, audio, item references, other item types) is refused with a 400."""
    for name in _UNCHECKABLE_FIELDS:
        if data.get(name) is not None:
            raise _unreadable(name, "prompt templates, raw messages or processor arguments")
    slots: list[TextSlot] = []
    if isinstance(data.get("instructions"), str) and data["instructions"]:
        slots.append(TextSlot(data, "instructions", "system"))
    for i, item in enumerate(data["input"]):
        kind = item.get("type")
        if kind not in _READABLE_ITEMS:
            raise _unreadable(f"input[{i}]", f"{kind!r} items")
        for j, part in enumerate((item.get("content") or []) if kind == "message" else []):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                what = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _unreadable(f"input[{i}].content[{j}]", f"{what!r} content parts")
        role = item.get("role") if kind == "message" else "tool" if kind == "function_call_output" else "assistant"
        string_slots(item, str(role), slots, _STRUCTURAL_KEYS)
    for name in _PROMPT_FIELDS:
        value = data.get(name)
        if name == "tools" and isinstance(value, list):
            value = [t for t in value if not _is_file_search(t)]  # store ids, not prompt text
        if isinstance(value, str):
            if value:
                slots.append(TextSlot(data, name, name))
        elif value:
            string_slots(value, name, slots, _STRUCTURAL_KEYS)
    return slots


def retrieval_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat-style messages, for the retrieval stage's query (the last user text)."""
    return [{"role": i.get("role"), "content": i.get("content")} for i in items if i.get("type") == "message"]


def file_search_item(query: str, passages: list[Passage], with_results: bool) -> dict[str, Any]:
    """The ``file_search_call`` output item. Its results (passage texts and filenames) are
    included only when the request asks (``include: ["file_search_call.results"]``)."""
    results = None
    if with_results:
        results = [
            {
                "file_id": p.file_id,
                "filename": p.filename,
                "score": round(min(max(p.score, 0.0), 1.0), 4),
                "text": p.text,
                "attributes": {"vector_store_id": p.vector_store_id, "chunk_index": p.chunk_index},
            }
            for p in passages
        ]
    return {
        "id": new_id("fs"),
        "type": "file_search_call",
        "status": "completed",
        "queries": [query] if query else [],
        "results": results,
    }


def citations(passages: list[Passage], index: int) -> list[dict[str, Any]]:
    """One ``file_citation`` per file the answer was given, in retrieval order, placed at
    ``index`` (the end of the answer's text: the model does not mark where it used each)."""
    seen: dict[str, Passage] = {}
    for p in passages:
        seen.setdefault(p.file_id, p)
    return [{"type": "file_citation", "file_id": f, "filename": p.filename, "index": index} for f, p in seen.items()]
