"""A deterministic ``LLMEngine`` for tests, injected into ``LLMServer`` via ``engine_cls``.

It speaks exactly the protocol Ray Serve LLM's vLLM engine speaks (SSE strings when
streaming, a response object otherwise, an ``ErrorResponse`` on bad input), so the whole
real Ray Serve path runs unchanged; only the tokens are scripted. The reply is chosen by
directives anywhere in the conversation (a system message keeps them away from the
input rails, which check what users write):

    [[say:TEXT]]        reply TEXT (split on spaces into tokens)
    [[chars:TEXT]]      reply TEXT one character per token
    [[tokens:N]]        reply "t0 t1 ... tN-1"
    [[say-n:A|B]]       with n > 1, choice i replies the i-th of A, B, ... (cycling)
    [[reason:TEXT]]     reasoning text (``reasoning``), streamed before the content
    [[refusal:TEXT]]    a ``refusal`` text, streamed after the content
    [[tool:NAME:ARGS]]  a tool call whose arguments stream in 4-character pieces (repeatable;
                        with no say/chars/tokens the reply has no content, finish "tool_calls")
    [[alt:TEXT]]        TEXT is a top_logprobs alternative at every position (repeatable)
    [[delay-ms:N]]      sleep N ms before each token (to observe cancellation)
    [[fail-after:N]]    raise after N tokens (a crash mid-stream)
    [[exit-process]]    kill the replica process (an engine that dies)
    [[reject]]          answer with a 400 ErrorResponse, as vLLM does for bad values
    otherwise           reply "echo: <last user message>"

Every TEXT directive has a ``-hex`` twin taking UTF-8 text hex-encoded and written backwards
(``[[say-hex:HEX]]``, ``[[chars-hex:HEX]]``, ``[[say-n-hex:HEXA|HEXB]]``, ``[[reason-hex:HEX]]``,
``[[refusal-hex:HEX]]``, ``[[tool-hex:NAME:HEXARGS]]``, ``[[alt-hex:HEX]]``; ``HEX`` is
``text.encode().hex()[::-1]``), so a test can make the engine say what the input rails would
refuse to forward: the injection rail decodes hex and base64 runs that are text
(guardrails/detectors/text_fold.py), and reversed hex decodes to no text.

``n`` gives n choices. When the request asks for ``logprobs`` (chat) or ``logprobs: k``
(completions), every streamed piece of every field gets an entry: token = the piece, its
UTF-8 bytes, and as alternatives the piece itself then each ``alt``, cut to ``top_logprobs``.
``max_tokens`` truncates the content (finish_reason "length"). Every request's rendered
prompt and its fate (finished, cancelled, failed) go to the ``EngineRecorder`` actor when
one is running, so tests can see what reached the engine and whether it was cancelled.
The Responses API (``responses``) is answered from the same directives by
engines/responses_script.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import ray

# Ray Serve LLM 2.60 has no public name for ErrorInfo or for the engine protocol that
# LLMServer's engine_cls implements; the response classes are the public ones.
from ray.llm._internal.serve.core.configs.openai_api_models import ErrorInfo
from ray.llm._internal.serve.core.engine.protocol import LLMEngine
from ray.serve.llm.openai_api_models import ChatCompletionResponse, CompletionResponse, ErrorResponse
from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaToolCall
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)

RECORDER_NAME = "scripted_engine_recorder"
RECORDER_NAMESPACE = "scripted_engine"
_NAMES = "say|chars|tokens|say-n|reason|refusal|tool|alt|delay-ms|fail-after|exit-process|reject"
_DIRECTIVE = re.compile(r"\[\[(" + _NAMES + r")(-hex)?(?::([^\]]*))?\]\]")
_REPEATABLE = ("tool", "alt")
_ARGS_PIECE = 4  # characters of tool call arguments per streamed piece
_LOGPROB, _ALT_LOGPROB = -0.25, -2.5


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


def _unhex(value: str, name: str) -> str:
    if name == "tool":  # NAME:HEXARGS
        tool, _, args = value.partition(":")
        return f"{tool}:{bytes.fromhex(args[::-1]).decode()}"
    return "|".join(bytes.fromhex(part[::-1]).decode() for part in value.split("|"))


def _words(text: str) -> list[str]:
    # Streaming joins tokens with the space in front, like a real tokenizer's pieces.
    return [t if i == 0 else " " + t for i, t in enumerate(text.split(" "))]


class Script:
    """The reply a prompt asks for: per choice, the pieces of each field in generation order."""

    def __init__(self, prompt: str, last_user: str, max_tokens: int | None, n: int = 1):
        directives: dict[str, Any] = {k: [] for k in _REPEATABLE}
        for name, hexed, value in _DIRECTIVE.findall(prompt):
            value = _unhex(value, name) if hexed else value
            if name in _REPEATABLE:
                directives[name].append(value)
            else:
                directives[name] = value
        self.tools = [(t.partition(":")[0], t.partition(":")[2]) for t in directives["tool"]]
        self.alts: list[str] = directives["alt"]
        self.reasoning = _words(directives["reason"]) if "reason" in directives else []
        self.refusal = _words(directives["refusal"]) if "refusal" in directives else []
        if "say-n" in directives:
            options = directives["say-n"].split("|")
            contents = [_words(options[i % len(options)]) for i in range(n)]
        elif "say" in directives:
            contents = [_words(directives["say"])] * n
        elif "chars" in directives:
            contents = [list(directives["chars"])] * n
        elif "tokens" in directives:
            contents = [[f"t{i}" if i == 0 else f" t{i}" for i in range(int(directives["tokens"]))]] * n
        elif self.tools or self.refusal:
            contents = [[]] * n
        else:
            contents = [_words("echo: " + last_user)] * n
        self.finish_reasons = ["tool_calls" if self.tools else "stop"] * n
        if max_tokens is not None:
            for i, pieces in enumerate(contents):
                if len(pieces) > max_tokens:
                    contents[i], self.finish_reasons[i] = pieces[:max_tokens], "length"
        self.contents = contents
        self.pieces = contents[0]  # the first choice's content, as before
        self.finish_reason = self.finish_reasons[0]
        self.delay_s = int(directives.get("delay-ms", 0)) / 1000
        self.fail_after = int(directives["fail-after"]) if "fail-after" in directives else None
        self.prompt_tokens = len(prompt.split())
        self.exit_process = "exit-process" in directives
        self.reject = "reject" in directives

    def steps(self, choice: int, chat: bool) -> list[tuple[str, Any, str]]:
        """(field, tool index, piece) in the order one choice generates them."""
        if not chat:
            return [("content", None, p) for p in self.contents[choice]]
        out = [("reasoning", None, p) for p in self.reasoning]
        out += [("content", None, p) for p in self.contents[choice]]
        out += [("refusal", None, p) for p in self.refusal]
        for index, (_, args) in enumerate(self.tools):
            pieces = [args[i : i + _ARGS_PIECE] for i in range(0, len(args), _ARGS_PIECE)] or [""]
            out += [("tool", index, p) for p in pieces]
        return out

    def alternatives(self, piece: str, k: int) -> list[tuple[str, float]]:
        return [(piece, _LOGPROB)] + [(a, _ALT_LOGPROB) for a in self.alts][: max(k - 1, 0)] if k > 0 else []


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
        script = Script(prompt, last_user, request.max_completion_tokens or request.max_tokens, request.n or 1)
        top = (request.top_logprobs or 0) if request.logprobs else None
        async for item in self._run(request, prompt, script, top, chat=True, roles=sorted(roles)):
            yield item

    async def completions(self, request, raw_request_info=None) -> AsyncGenerator[Any, None]:
        prompt = request.prompt if isinstance(request.prompt, str) else str(request.prompt)
        script = Script(prompt, prompt, request.max_tokens, request.n or 1)
        async for item in self._run(request, prompt, script, request.logprobs, chat=False):
            yield item

    async def embeddings(self, request, raw_request_info=None):
        yield _error("the scripted engine does not embed")

    async def transcriptions(self, request, raw_request_info=None):
        yield _error("the scripted engine does not transcribe")

    async def responses(self, request: dict, raw_request_info=None) -> AsyncGenerator[Any, None]:
        """The Responses API (engines/responses_script.py), as ``VLLMResponsesEngine`` answers it."""
        from engines.responses_script import scripted_responses  # it imports this module

        async for item in scripted_responses(self._model_id, request):
            yield item

    async def _run(
        self, request, prompt: str, script: Script, top: int | None, *, chat: bool, **extra
    ) -> AsyncGenerator[Any, None]:
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
        n = len(script.contents)
        steps = [script.steps(i, chat) for i in range(n)]
        try:
            if request.stream:
                include_usage = bool(request.stream_options and request.stream_options.include_usage)
                chunk_id = ("chatcmpl-" if chat else "cmpl-") + request_id
                out = _Chunks(chunk_id, self._model_id, script, top, chat)
                if chat:
                    for i in range(n):
                        yield _sse(out.chat(i, DeltaMessage(role="assistant", content="")))
                for position in range(max(map(len, steps), default=0)):
                    if script.fail_after is not None and emitted >= script.fail_after:
                        raise RuntimeError("scripted engine failure")
                    if script.delay_s:
                        await asyncio.sleep(script.delay_s)
                    emitted += 1
                    for i in range(n):
                        if position < len(steps[i]):
                            yield _sse(out.piece(i, *steps[i][position]))
                for i in range(n):
                    yield _sse(
                        out.chat(i, DeltaMessage(), script.finish_reasons[i])
                        if chat
                        else out.completion(i, "", None, script.finish_reasons[i])
                    )
                if include_usage:
                    usage = _usage(script.prompt_tokens, emitted)
                    cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield _sse(
                        cls(
                            id=chunk_id,
                            object=obj,
                            created=int(time.time()),
                            model=self._model_id,
                            choices=[],
                            usage=usage,
                        )
                    )
                yield "data: [DONE]\n\n"
            else:
                if script.fail_after is not None:
                    raise RuntimeError("scripted engine failure")
                for _ in range(max(map(len, steps), default=0)):
                    if script.delay_s:
                        await asyncio.sleep(script.delay_s)
                    emitted += 1
                usage = _usage(script.prompt_tokens, emitted)
                if chat:
                    choices = [_chat_choice(i, script, steps[i], top) for i in range(n)]
                    yield ChatCompletionResponse(
                        id="chatcmpl-" + request_id, model=self._model_id, choices=choices, usage=usage
                    )
                else:
                    choices = [_completion_choice(i, script, steps[i], top) for i in range(n)]
                    yield CompletionResponse(
                        id="cmpl-" + request_id, model=self._model_id, choices=choices, usage=usage
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


class _Chunks:
    """Stream chunks of one response, built from vLLM's own protocol classes."""

    def __init__(self, chunk_id: str, model: str, script: Script, top: int | None, chat: bool):
        self.chunk_id, self.model, self.script, self.top, self.is_chat = chunk_id, model, script, top, chat
        self.text_len: dict[int, int] = {}  # completions: text length so far per choice
        self.announced: set[tuple[int, int]] = set()  # (choice, tool index) whose header went out

    def piece(self, choice: int, field: str, tool: int | None, piece: str) -> Any:
        if not self.is_chat:
            return self.completion(
                choice, piece, _completion_logprobs(self.script, [piece], self.top, self.text_len.get(choice, 0))
            )
        if field == "tool":
            call = DeltaToolCall(index=tool, function=DeltaFunctionCall(arguments=piece))
            if (choice, tool) not in self.announced:
                self.announced.add((choice, tool))
                name = self.script.tools[tool][0]
                call = DeltaToolCall(
                    index=tool,
                    id=f"call_{tool}",
                    type="function",
                    function=DeltaFunctionCall(name=name, arguments=piece),
                )
            delta = DeltaMessage(tool_calls=[call])
        else:
            delta = DeltaMessage(**{field: piece})
        return self.chat(choice, delta, logprobs=_chat_logprobs(self.script, [piece], self.top))

    def chat(
        self, choice: int, delta: DeltaMessage, finish_reason: str | None = None, logprobs=None
    ) -> ChatCompletionStreamResponse:
        kwargs = {"logprobs": logprobs} if logprobs is not None else {}
        c = ChatCompletionResponseStreamChoice(index=choice, delta=delta, finish_reason=finish_reason, **kwargs)
        # Set object/created explicitly: vLLM does, and exclude_unset would drop defaults.
        return ChatCompletionStreamResponse(
            id=self.chunk_id, object="chat.completion.chunk", created=int(time.time()), model=self.model, choices=[c]
        )

    def completion(
        self, choice: int, text: str, logprobs=None, finish_reason: str | None = None
    ) -> CompletionStreamResponse:
        self.text_len[choice] = self.text_len.get(choice, 0) + len(text)
        kwargs = {"logprobs": logprobs} if logprobs is not None else {}
        c = CompletionResponseStreamChoice(index=choice, text=text, finish_reason=finish_reason, **kwargs)
        return CompletionStreamResponse(
            id=self.chunk_id, object="text_completion", created=int(time.time()), model=self.model, choices=[c]
        )


def _chat_logprobs(script: Script, pieces: list[str], top: int | None) -> ChatCompletionLogProbs | None:
    if top is None:
        return None

    def entry(cls, token: str, logprob: float, **more):
        return cls(token=token, logprob=logprob, bytes=list(token.encode()), **more)

    return ChatCompletionLogProbs(
        content=[
            entry(
                ChatCompletionLogProbsContent,
                p,
                _LOGPROB,
                top_logprobs=[entry(ChatCompletionLogProb, t, lp) for t, lp in script.alternatives(p, top)],
            )
            for p in pieces
        ]
    )


def _completion_logprobs(script: Script, pieces: list[str], top: int | None, offset: int) -> CompletionLogProbs | None:
    if top is None:
        return None
    offsets = [offset + sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    return CompletionLogProbs(
        text_offset=offsets,
        token_logprobs=[_LOGPROB] * len(pieces),
        tokens=list(pieces),
        top_logprobs=[dict(script.alternatives(p, max(top, 1))) for p in pieces],
    )


def _chat_choice(
    index: int, script: Script, steps: list[tuple[str, Any, str]], top: int | None
) -> ChatCompletionResponseChoice:
    def joined(field: str) -> str | None:
        pieces = [p for f, _, p in steps if f == field]
        return "".join(pieces) if pieces else None

    calls = [
        ToolCall(id=f"call_{i}", function=FunctionCall(name=name, arguments=args))
        for i, (name, args) in enumerate(script.tools)
    ]
    message = ChatMessage(
        role="assistant",
        content=joined("content"),
        reasoning=joined("reasoning"),
        refusal=joined("refusal"),
        tool_calls=calls,
    )
    logprobs = _chat_logprobs(script, [p for _, _, p in steps], top)
    return ChatCompletionResponseChoice(
        index=index, message=message, logprobs=logprobs, finish_reason=script.finish_reasons[index]
    )


def _completion_choice(
    index: int, script: Script, steps: list[tuple[str, Any, str]], top: int | None
) -> CompletionResponseChoice:
    pieces = [p for _, _, p in steps]
    logprobs = _completion_logprobs(script, pieces, top, 0)
    return CompletionResponseChoice(
        index=index, text="".join(pieces), logprobs=logprobs, finish_reason=script.finish_reasons[index]
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def _sse(chunk) -> str:
    # vLLM serialises stream chunks the same way.
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def _error(message: str) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type="BadRequestError", code=400))
