"""A deterministic ``LLMEngine`` for tests, injected into ``LLMServer`` via ``engine_cls``.

It speaks exactly the protocol Ray Serve LLM's vLLM engine speaks (SSE strings when
streaming, a response object otherwise, an ``ErrorResponse`` on bad input), so the whole
real Ray Serve path runs unchanged; only the tokens are scripted. The reply is chosen by
directives anywhere in the conversation (a system message keeps them away from the
input rails, which check what users write):

    [[say:TEXT]]        reply TEXT (split on spaces into tokens)
    [[chars:TEXT]]      reply TEXT one character per token
    [[tokens:N]]        reply "t0 t1 ... tN-1"
    [[delay-ms:N]]      sleep N ms before each token (to observe cancellation)
    [[fail-after:N]]    raise after N tokens (a crash mid-stream)
    [[exit-process]]    kill the replica process (an engine that dies)
    [[reject]]          answer with a 400 ErrorResponse, as vLLM does for bad values
    otherwise           reply "echo: <last user message>"

``max_tokens`` truncates the reply (finish_reason "length"). Every request's rendered
prompt and its fate (finished, cancelled, failed) go to the ``EngineRecorder`` actor when
one is running, so tests can see what reached the engine and whether it was cancelled.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from typing import Any, AsyncGenerator, Optional

import ray
from ray.llm._internal.serve.core.configs.openai_api_models import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
)
from ray.llm._internal.serve.core.engine.protocol import LLMEngine
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)

RECORDER_NAME = "scripted_engine_recorder"
RECORDER_NAMESPACE = "scripted_engine"
_DIRECTIVE = re.compile(r"\[\[(say|chars|tokens|delay-ms|fail-after|exit-process|reject):?([^\]]*)\]\]")


@ray.remote(num_cpus=0)
class EngineRecorder:
    """Collects what the scripted engine saw. Started by tests, found by name."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def record(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def get(self) -> list[dict[str, Any]]:
        return list(self.events)

    def clear(self) -> None:
        self.events.clear()


def _recorder():
    try:
        return ray.get_actor(RECORDER_NAME, namespace=RECORDER_NAMESPACE)
    except ValueError:
        return None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


class Script:
    """The reply a prompt asks for."""

    def __init__(self, prompt: str, last_user: str, max_tokens: Optional[int]):
        directives = {k: v for k, v in _DIRECTIVE.findall(prompt)}
        chars = None
        if "say" in directives:
            tokens = directives["say"].split(" ")
        elif "chars" in directives:
            tokens = chars = list(directives["chars"])
        elif "tokens" in directives:
            tokens = [f"t{i}" for i in range(int(directives["tokens"]))]
        else:
            tokens = ("echo: " + last_user).split(" ")
        # Streaming joins tokens with the space in front, like a real tokenizer's pieces.
        self.pieces = chars or [t if i == 0 else " " + t for i, t in enumerate(tokens)]
        self.finish_reason = "stop"
        if max_tokens is not None and len(self.pieces) > max_tokens:
            self.pieces = self.pieces[:max_tokens]
            self.finish_reason = "length"
        self.delay_s = int(directives.get("delay-ms", 0)) / 1000
        self.fail_after = int(directives["fail-after"]) if "fail-after" in directives else None
        self.prompt_tokens = len(prompt.split())
        self.exit_process = "exit-process" in directives
        self.reject = "reject" in directives


class ScriptedEngine(LLMEngine):
    """Deterministic stand-in for ``VLLMEngine``; see the module docstring."""

    def __init__(self, llm_config):
        self._config = llm_config
        self._model_id = llm_config.model_id

    async def start(self) -> None:
        return None

    def routing_stats(self) -> dict:
        return {}

    async def resolve_lora(self, lora_model) -> None:
        return None

    async def reset_prefix_cache(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    async def chat(self, request, raw_request_info=None) -> AsyncGenerator[Any, None]:
        messages = list(request.messages)
        roles = {m.get("role") for m in messages}
        if not messages:
            yield _error("messages must not be empty")
            return
        prompt = "\n".join(f"{m.get('role')}: {_text_of(m.get('content'))}" for m in messages)
        last_user = next((_text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        script = Script(prompt, last_user, request.max_completion_tokens or request.max_tokens)
        async for item in self._run(request, prompt, script, chat=True, roles=sorted(roles)):
            yield item

    async def completions(self, request, raw_request_info=None) -> AsyncGenerator[Any, None]:
        prompt = request.prompt if isinstance(request.prompt, str) else str(request.prompt)
        script = Script(prompt, prompt, request.max_tokens)
        async for item in self._run(request, prompt, script, chat=False):
            yield item

    async def embeddings(self, request, raw_request_info=None):
        yield _error("the scripted engine does not embed")

    async def transcriptions(self, request, raw_request_info=None):
        yield _error("the scripted engine does not transcribe")

    async def _run(self, request, prompt: str, script: Script, *, chat: bool, **extra) -> AsyncGenerator[Any, None]:
        request_id = getattr(request, "request_id", None) or uuid.uuid4().hex
        recorder = _recorder()

        def record(event: str, **fields):
            if recorder is not None:
                return recorder.record.remote({"request_id": request_id, "event": event, "time": time.time(), **fields})
            return None

        # Everything the client set besides the prompt, to check that fields pass through.
        fields = request.model_dump(mode="json", exclude_unset=True, exclude={"messages", "prompt", "request_id"})
        started = record("started", prompt=prompt, stream=bool(request.stream), fields=fields, **extra)
        if started is not None:
            await started  # recorded before any answer exists: a test may read it on the reply
        if script.exit_process:
            os._exit(1)
        if script.reject:
            yield _error("scripted rejection: this value is out of range")
            return
        emitted = 0
        try:
            if request.stream:
                include_usage = bool(request.stream_options and request.stream_options.include_usage)
                chunk_id = ("chatcmpl-" if chat else "cmpl-") + request_id
                if chat:
                    yield _sse(_chat_chunk(chunk_id, self._model_id, DeltaMessage(role="assistant", content="")))
                for piece in script.pieces:
                    if script.fail_after is not None and emitted >= script.fail_after:
                        raise RuntimeError("scripted engine failure")
                    if script.delay_s:
                        await asyncio.sleep(script.delay_s)
                    emitted += 1
                    if chat:
                        yield _sse(_chat_chunk(chunk_id, self._model_id, DeltaMessage(content=piece)))
                    else:
                        yield _sse(_completion_chunk(chunk_id, self._model_id, piece))
                if chat:
                    yield _sse(_chat_chunk(chunk_id, self._model_id, DeltaMessage(), script.finish_reason))
                else:
                    yield _sse(_completion_chunk(chunk_id, self._model_id, "", script.finish_reason))
                if include_usage:
                    usage = _usage(script.prompt_tokens, emitted)
                    cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield _sse(cls(id=chunk_id, object=obj, created=int(time.time()), model=self._model_id, choices=[], usage=usage))
                yield "data: [DONE]\n\n"
            else:
                if script.fail_after is not None:
                    raise RuntimeError("scripted engine failure")
                for _ in script.pieces:
                    if script.delay_s:
                        await asyncio.sleep(script.delay_s)
                    emitted += 1
                text = "".join(script.pieces)
                usage = _usage(script.prompt_tokens, emitted)
                if chat:
                    yield ChatCompletionResponse(
                        id="chatcmpl-" + request_id,
                        model=self._model_id,
                        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content=text), finish_reason=script.finish_reason)],
                        usage=usage,
                    )
                else:
                    yield CompletionResponse(
                        id="cmpl-" + request_id,
                        model=self._model_id,
                        choices=[CompletionResponseChoice(index=0, text=text, finish_reason=script.finish_reason)],
                        usage=usage,
                    )
        except (asyncio.CancelledError, GeneratorExit):
            # vLLM's AsyncLLM.generate aborts the sequence on both (a cancelled task, or a
            # consumer that closed the stream); we record that it happened.
            record("cancelled", tokens=emitted)
            raise
        except Exception as exc:
            record("failed", tokens=emitted, error=str(exc))
            raise
        record("finished", tokens=emitted)


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


def _chat_chunk(chunk_id: str, model: str, delta: DeltaMessage, finish_reason: Optional[str] = None) -> ChatCompletionStreamResponse:
    choice = ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish_reason)
    # Set object/created explicitly: vLLM does, and exclude_unset would drop defaults.
    return ChatCompletionStreamResponse(id=chunk_id, object="chat.completion.chunk", created=int(time.time()), model=model, choices=[choice])


def _completion_chunk(chunk_id: str, model: str, text: str, finish_reason: Optional[str] = None) -> CompletionStreamResponse:
    choice = CompletionResponseStreamChoice(index=0, text=text, finish_reason=finish_reason)
    return CompletionStreamResponse(id=chunk_id, object="text_completion", created=int(time.time()), model=model, choices=[choice])


def _sse(chunk) -> str:
    # vLLM serialises stream chunks the same way.
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def _error(message: str) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type="BadRequestError", code=400))
