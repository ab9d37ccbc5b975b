"""The scripted engine's Responses API: the same directives as chat, answered with vLLM's own
Responses protocol classes and streaming-event helpers, so the gateway sees exactly the
shapes ``OpenAIServingResponses`` produces (``response.created``, ``response.in_progress``, the
message's item/part/text events, then ``response.completed`` with the whole response).

The conversation is flattened with vLLM's ``construct_input_messages`` (what vLLM renders
through the chat template) into ``role: text`` lines, which is the prompt the recorder sees.
Only content is scripted here (``say``, ``chars``, ``tokens``, the echo); ``max_output_tokens``
truncates it with status ``incomplete``.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from openai.types.responses import ResponseOutputMessage, ResponseOutputText
from vllm.entrypoints.openai.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseInProgressEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from vllm.entrypoints.openai.responses.streaming_events import (
    SimpleStreamingState,
    emit_simple_content_delta,
    emit_simple_content_done,
    emit_simple_content_open,
)
from vllm.entrypoints.openai.responses.utils import construct_input_messages

from engines.scripted_engine import Script, _error, _recorder, _text_of


async def scripted_responses(model_id: str, request: dict[str, Any]) -> AsyncGenerator[Any, None]:
    """What ``VLLMResponsesEngine.responses`` yields, scripted: ``data: {event}`` strings when
    streaming, else one response dict."""
    try:
        req = ResponsesRequest.model_validate(request)
    except ValueError as exc:
        yield _error(str(exc))
        return
    messages = construct_input_messages(request_instructions=req.instructions, request_input=req.input)
    prompt = "\n".join(f"{m.get('role')}: {_text_of(m.get('content'))}" for m in messages)
    last_user = next((_text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    script = Script(prompt, last_user, req.max_output_tokens)
    params = req.to_sampling_params(req.max_output_tokens or 4096, {})
    created = int(time.time())
    recorder = _recorder()

    def record(event: str, **fields):
        if recorder is not None:
            entry = {"request_id": req.request_id, "event": event, "time": time.time(), **fields}
            return recorder.record.remote(entry)
        return None

    fields = {k: v for k, v in request.items() if k not in ("input", "instructions")}
    started = record("started", prompt=prompt, stream=bool(req.stream), fields=fields, method="responses")
    if started is not None:
        await started
    if script.exit_process:
        os._exit(1)
    if script.reject:
        yield _error("scripted rejection: this value is out of range")
        return
    pieces = script.pieces
    status = "incomplete" if script.finish_reason == "length" else "completed"
    emitted = 0

    def response(output: list, state: str, usage: ResponseUsage | None) -> ResponsesResponse:
        return ResponsesResponse.from_request(
            req, params, model_name=model_id, created_time=created, output=output, status=state, usage=usage
        )

    def usage() -> ResponseUsage:
        return ResponseUsage(
            input_tokens=script.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=0),
            output_tokens=emitted,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=script.prompt_tokens + emitted,
        )

    def message(item_id: str, text: str) -> list:
        content = [ResponseOutputText(type="output_text", text=text, annotations=[])] if text else []
        return [
            ResponseOutputMessage(id=item_id, type="message", role="assistant", content=content, status="completed")
        ]

    try:
        if req.stream:
            sequence = 0

            def sse(event) -> str:
                nonlocal sequence
                event.sequence_number, sequence = sequence, sequence + 1
                return f"data: {event.model_dump_json(by_alias=True)}\n\n"

            initial = response([], "in_progress", None).model_dump(mode="json", by_alias=True)
            yield sse(ResponseCreatedEvent(type="response.created", sequence_number=0, response=initial))
            yield sse(ResponseInProgressEvent(type="response.in_progress", sequence_number=0, response=initial))
            state = SimpleStreamingState()
            for position, piece in enumerate(pieces):
                if script.fail_after is not None and emitted >= script.fail_after:
                    raise RuntimeError("scripted engine failure")
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                emitted += 1
                events = emit_simple_content_open(state) if position == 0 else []
                for event in events + emit_simple_content_delta(state, piece):
                    yield sse(event)
            item_id, text = state.current_item_id, state.accumulated_text
            if pieces:
                for event in emit_simple_content_done(state):
                    yield sse(event)
            final = response(message(item_id or uuid.uuid4().hex, text), status, usage())
            yield sse(ResponseCompletedEvent(type="response.completed", sequence_number=0, response=final))
        else:
            if script.fail_after is not None:
                raise RuntimeError("scripted engine failure")
            for _ in pieces:
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                emitted += 1
            final = response(message(f"msg_{uuid.uuid4().hex}", "".join(pieces)), status, usage())
            yield final.model_dump(mode="json", by_alias=True)
    except (asyncio.CancelledError, GeneratorExit):
        record("cancelled", tokens=emitted)
        raise
    except Exception as exc:
        record("failed", tokens=emitted, error=str(exc))
        raise
    record("finished", tokens=emitted)
