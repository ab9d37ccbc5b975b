"""The Responses API's answer side: vLLM's response (a body, or its typed ``response.*`` events)
turned into what the client gets, with output rails on every generated text.

``ResponseShaper`` sees each event once, in order. Every delta of generated text
(``response.output_text.delta``, reasoning, refusals, function call arguments) goes through its
own ``StreamGuard`` (guardrails/output_rail.py), which holds back a bounded window and releases
only checked text; the matching ``.done`` events, parts, items and the final response carry the
released text, never the engine's. On a block the answer ends there: the open item is closed
as ``incomplete`` and a ``response.incomplete`` event (``incomplete_details.reason:
"content_filter"``) ends the stream, and the relay cancels the engine call.

It also puts back what the client asked for where vLLM saw something else: the client's
``instructions``, ``tools`` (with ``file_search``), ``previous_response_id`` and ``store``; the
``file_search_call`` item first in the output (every later ``output_index`` moves up by one);
``file_citation`` annotations on the answer; usage in OpenAI's shape; sequence numbers in order.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from ray.serve.handle import DeploymentResponseGenerator

from gateway import sse
from gateway.engine_client import _UNAVAILABLE
from gateway.errors import APIError, engine_unavailable, internal_error
from gateway.responses_stages import ResponsesCall, citations
from guardrails.config import GuardrailPolicy
from guardrails.metrics import RailMetrics
from guardrails.output_rail import StreamGuard
from retrieval.records import Passage

logger = logging.getLogger(__name__)

CONTENT_FILTER = "content_filter"
# Streamed text: delta event type -> (the text's family, the field its .done event carries).
_DELTAS = {
    "response.output_text.delta": ("output_text", "text"),
    "response.refusal.delta": ("refusal", "refusal"),
    "response.reasoning_text.delta": ("reasoning_text", "text"),
    "response.reasoning_summary_text.delta": ("summary_text", "text"),
    "response.function_call_arguments.delta": ("arguments", "arguments"),
}
_DONES = {t.replace(".delta", ".done"): v for t, v in _DELTAS.items()}
# Fields of vLLM's response object that OpenAI's does not have.
_VLLM_ONLY = ("input_messages", "output_messages", "kv_transfer_params", "ec_transfer_params")
# Fields OpenAI's response always carries, null or not; other nulls are left out.
_REQUIRED_NULLABLE = frozenset({"error", "incomplete_details", "instructions", "previous_response_id"})

Key = tuple[str, int, int]  # (family, output_index, content_index)


def _texts_of(item: dict[str, Any], index: int) -> list[tuple[Key, dict[str, Any], str]]:
    """(key, holder, field) of every generated text in an output item."""
    kind = item.get("type")
    if kind == "function_call":
        return [(("arguments", index, 0), item, "arguments")]
    out = []
    for j, part in enumerate(item.get("content") or []):
        family = part.get("type")
        name = "refusal" if family == "refusal" else "text"
        if isinstance(part.get(name), str):
            out.append(((family, index, j), part, name))
    for j, part in enumerate(item.get("summary") or []):
        if isinstance(part.get("text"), str):
            out.append((("summary_text", index, j), part, "text"))
    return out


def openai_item(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as OpenAI's schema has it: text parts always carry a logprobs list."""
    for part in item.get("content") or []:
        if part.get("type") == "output_text" and part.get("logprobs") is None:
            part["logprobs"] = []
    return item


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's usage in OpenAI's shape (its per-turn lists dropped)."""
    if not usage:
        return None
    return {
        "input_tokens": usage.get("input_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.get("output_tokens", 0),
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("output_tokens_details") or {}).get("reasoning_tokens", 0)
        },
        "total_tokens": usage.get("total_tokens", 0),
    }


class ResponseShaper:
    """One response's way out: events (``__call__``) or a whole body (``whole``)."""

    def __init__(
        self,
        call: ResponsesCall,
        rails: GuardrailPolicy | None,
        metrics: RailMetrics,
        file_search: dict[str, Any] | None = None,
        passages: list[Passage] | None = None,
    ):
        self._call = call
        self._rails = rails
        self._metrics = metrics
        self._file_search = file_search
        self._passages = passages or []
        self._shift = 1 if file_search else 0
        self._guards: dict[Key, StreamGuard] = {}
        self._released: dict[Key, str] = {}
        self._sequence = 0
        self._base: dict[str, Any] | None = None  # the response as created
        self._items: dict[int, dict[str, Any]] = {}  # output items done or open, by output_index
        self.stopped = False  # set on a block: the relay then cancels the engine
        self.final: dict[str, Any] | None = None  # the response as it ended (to store)
        self._usage: dict[str, Any] | None = None  # the engine's, even when a cut drops it
        self._deltas = 0  # output deltas seen (one per token), while the usage is unknown

    # --- the whole response ------------------------------------------------------------

    def whole(self, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed response: every text checked whole, cut at a violation."""
        self._usage = body.get("usage")
        output = list(body.get("output") or [])
        kept = []
        for i, item in enumerate(output):
            kept.append(item)
            for key, holder, name in _texts_of(item, i + self._shift):
                holder[name] = self._push(key, holder[name]) + self._finish(key)
                if key[0] == "output_text":
                    holder["annotations"] = self._citations(len(holder[name]))
                if self.stopped:
                    break
            if self.stopped:
                item["status"] = "incomplete"
                break
        body["output"] = kept
        self.final = self._shape(body, final=True)
        return self.final

    def tokens(self) -> tuple[int, int]:
        """(input, output) tokens as the engine counted them; while it has not said (a stream
        cut or failed before its end), the output deltas seen and no input."""
        usage = self._usage or {}
        if usage:
            return usage.get("input_tokens") or 0, usage.get("output_tokens") or 0
        return 0, self._deltas

    # --- events --------------------------------------------------------------------------

    def __call__(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if self.stopped:
            return []
        kind = event.get("type", "")
        if "output_index" in event:
            event["output_index"] += self._shift
        if kind in ("response.created", "response.in_progress"):
            event["response"] = self._shape(event["response"], final=False)
            self._base = event["response"]
            out = [event]
            if kind == "response.in_progress" and self._file_search:
                out += self._file_search_events()
            return self._numbered(out)
        if kind in ("response.completed", "response.incomplete"):
            response = event["response"]
            self._usage = response.get("usage")
            output = response.get("output") or []
            for i, item in enumerate(output):
                self._settle(item, i + self._shift)
            self.final = self._shape(response, final=True)
            if self.stopped:  # a text blocked at the very end
                return self._numbered(self._cut())
            event["response"] = self.final
            event["type"] = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
            return self._numbered([event])
        if kind in _DELTAS:
            self._deltas += 1
            family, _ = _DELTAS[kind]
            key = (family, event["output_index"], event.get("content_index", event.get("summary_index", 0)))
            text = self._push(key, event["delta"])
            if self.stopped:
                return self._numbered(self._cut())
            if not text:
                return []
            if self._rails is not None:
                event["logprobs"] = []  # refused up front on guarded models; never let through
            return self._numbered([{**event, "delta": text}])
        if kind in _DONES:
            family, name = _DONES[kind]
            key = (family, event["output_index"], event.get("content_index", event.get("summary_index", 0)))
            tail = self._finish(key)
            if self.stopped:
                return self._numbered(self._cut())
            # What the guard still held goes out as a last delta before the done event.
            out = []
            if tail:
                delta = {k: v for k, v in event.items() if k != name}
                out.append({**delta, "type": kind.replace(".done", ".delta"), "delta": tail})
                if family == "output_text":
                    out[0]["logprobs"] = []
            event[name] = self._released.get(key, event.get(name, ""))
            if family == "output_text":
                out += self._annotation_events(event, len(event[name]))
            return self._numbered(out + [event])
        if kind == "response.output_item.added":
            self._items[event["output_index"]] = copy.deepcopy(event["item"])  # the event leaves as it is
        elif kind == "response.content_part.done":
            part = event["part"]
            key = (part.get("type"), event["output_index"], event.get("content_index", 0))
            if key in self._released:
                part["refusal" if part.get("type") == "refusal" else "text"] = self._released[key]
            if part.get("type") == "output_text":
                part["annotations"] = self._citations(len(part.get("text", "")))
                part["logprobs"] = part.get("logprobs") or []
        elif kind == "response.output_item.done":
            self._settle(openai_item(event["item"]), event["output_index"])
            self._items[event["output_index"]] = copy.deepcopy(event["item"])
        return self._numbered([event])

    def failed(self, error: APIError) -> list[str]:
        """The last events of a stream the engine broke: ``error``, then ``response.failed``."""
        events = [{"type": "error", "code": error.code, "message": error.message, "param": None}]
        if self._base is not None:
            response = {**self._base, "status": "failed", "output": list(self._items.values())}
            response["error"] = {"code": "server_error", "message": error.message}
            events.append({"type": "response.failed", "response": response})
        return [encode(e) for e in self._numbered(events)]

    # --- helpers -------------------------------------------------------------------------

    def _push(self, key: Key, text: str) -> str:
        if self._rails is None:
            self._released[key] = self._released.get(key, "") + text
            return text
        guard = self._guards.get(key)
        if guard is None:
            guard = self._guards[key] = StreamGuard.from_policy(self._rails, metrics=self._metrics)
        step = guard.push(text)
        if step.verdict.blocked:
            self.stopped = True
        self._released[key] = self._released.get(key, "") + step.text
        return step.text

    def _finish(self, key: Key) -> str:
        guard = self._guards.pop(key, None)
        if guard is None:
            self._released.setdefault(key, "")
            return ""
        step = guard.finish()
        if step.verdict.blocked:
            self.stopped = True
        self._released[key] = self._released.get(key, "") + step.text
        return step.text

    def _settle(self, item: dict[str, Any], index: int) -> None:
        """An item's texts as released (a text never streamed is checked whole here)."""
        for key, holder, name in _texts_of(item, index):
            if key not in self._released:
                self._push(key, holder[name])
                self._finish(key)
            holder[name] = self._released.get(key, "")
            if key[0] == "output_text":
                holder["annotations"] = self._citations(len(holder[name]))

    def _cut(self) -> list[dict[str, Any]]:
        """A rail blocked: close the open item as incomplete, end with ``response.incomplete``."""
        events: list[dict[str, Any]] = []
        if self._items:
            index = max(self._items)
            item = self._items[index]
            if item.get("status") == "in_progress":
                for key, holder, name in _texts_of(item, index):
                    holder[name] = self._released.get(key, "")
                if item.get("type") == "message":
                    text = self._released.get(("output_text", index, 0), "")
                    item["content"] = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
                elif item.get("type") == "function_call":
                    item["arguments"] = self._released.get(("arguments", index, 0), "")
                item["status"] = "incomplete"
                events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        base = self.final or self._base or {}
        output = ([self._file_search] if self._file_search else []) + [
            self._items[i] for i in sorted(self._items) if i >= self._shift
        ]
        self.final = {k: v for k, v in base.items() if k not in ("usage", "completed_at")}
        self.final["output"] = output
        self.final.update(status="incomplete", incomplete_details={"reason": CONTENT_FILTER})
        events.append({"type": "response.incomplete", "response": self.final})
        return events

    def _shape(self, response: dict[str, Any], *, final: bool) -> dict[str, Any]:
        body = {k: v for k, v in response.items() if k not in _VLLM_ONLY and (v is not None or k in _REQUIRED_NULLABLE)}
        call = self._call
        body.update(
            id=call.response_id,
            instructions=call.instructions,
            tools=call.tools,
            previous_response_id=call.previous_response_id,
            store=call.store,
            usage=usage_of(body.get("usage")),
        )
        if body["usage"] is None:
            del body["usage"]  # unknown (a cut stream), rather than a null the schema does not allow
        body.setdefault("error", None)
        body["metadata"] = body.get("metadata") or {}
        if body.get("text") is None:
            body["text"] = {"format": {"type": "text"}}
        if final:
            output = list(body.get("output") or [])
            if self._file_search and not (output and output[0].get("type") == "file_search_call"):
                output.insert(0, self._file_search)
            body["output"] = [openai_item(item) for item in output]
            if self.stopped:
                body.update(status="incomplete", incomplete_details={"reason": CONTENT_FILTER})
            if body.get("status") == "completed":
                body["completed_at"] = int(time.time())
        return body

    def _citations(self, index: int) -> list[dict[str, Any]]:
        return citations(self._passages, index) if self._file_search else []

    def _file_search_events(self) -> list[dict[str, Any]]:
        item = self._file_search
        added = {**item, "status": "in_progress", "results": None}
        events: list[dict[str, Any]] = [{"type": "response.output_item.added", "output_index": 0, "item": added}]
        for state in ("in_progress", "searching", "completed"):
            events.append({"type": f"response.file_search_call.{state}", "output_index": 0, "item_id": item["id"]})
        events.append({"type": "response.output_item.done", "output_index": 0, "item": item})
        return events

    def _annotation_events(self, done: dict[str, Any], length: int) -> list[dict[str, Any]]:
        return [
            {
                "type": "response.output_text.annotation.added",
                "item_id": done["item_id"],
                "output_index": done["output_index"],
                "content_index": done.get("content_index", 0),
                "annotation_index": i,
                "annotation": annotation,
            }
            for i, annotation in enumerate(self._citations(length))
        ]

    def _numbered(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for event in events:
            event["sequence_number"] = self._sequence
            self._sequence += 1
        return events


def encode(event: dict[str, Any]) -> str:
    """An event as OpenAI streams it: its type on an ``event:`` line, then its JSON."""
    return f"event: {event['type']}\ndata: " + orjson.dumps(event).decode() + "\n\n"


async def relay(
    first: list[Any],
    gen: DeploymentResponseGenerator,
    shaper: ResponseShaper,
    on_final: Callable[[dict[str, Any]], Awaitable[None]],
    *,
    idle_s: float | None = None,
) -> AsyncIterator[str]:
    """Forward an engine's Responses stream through ``shaper``. A block ends it and cancels
    the engine; so does a client that goes away. An engine failure mid-stream ends it with
    ``error`` and ``response.failed``. The response as it ended goes to ``on_final``."""
    finished = False
    try:
        batch = first
        while True:
            out = []
            for payload in sse.parse_events(p for p in batch if isinstance(p, str)):
                if payload is None:
                    continue
                if "error" in payload and "type" not in payload:
                    raise RuntimeError("engine error event")
                out.extend(shaper(payload))
            if shaper.stopped:
                gen.cancel()  # stop the engine before telling the client
                finished = True
                yield "".join(encode(e) for e in out)
                break
            if out:
                yield "".join(encode(e) for e in out)
            try:
                batch = await asyncio.wait_for(gen.__anext__(), idle_s)
            except StopAsyncIteration:
                break
            if not isinstance(batch, list) or not all(isinstance(p, str) for p in batch):
                raise RuntimeError("engine error mid-stream")
        finished = True
        if shaper.final is not None:
            await on_final(shaper.final)
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:  # the engine crashed, raised, went silent, or the store failed
        finished = True
        gen.cancel()
        logger.error("responses stream failed mid-way: %s", type(exc).__name__)
        error = engine_unavailable() if isinstance(exc, _UNAVAILABLE) else internal_error()
        yield "".join(shaper.failed(error))
    finally:
        if not finished:
            gen.cancel()  # the client went away: stop the engine
