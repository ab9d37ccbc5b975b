"""OutputRail and guard_response on hand-built events: every generated-text field (pure Python)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from gateway.errors import APIError
from gateway.output_stage import OutputRail, guard_response, refuse_unguardable
from guardrails.config import ForbiddenPattern, load_policy
from guardrails.metrics import RailMetrics
from guardrails.output_rail import PatternCheck, StreamGuard

DENIED = "FORBIDDEN-WORD"
EMAIL = "john.smith@example.org"
POLICY = load_policy(
    {"pii": {"output": {"email": "redact"}}, "output": {"holdback_chars": 8, "forbidden": [{"pattern": DENIED}]}}
)


def rail(chat: bool = True) -> OutputRail:
    return OutputRail(POLICY, RailMetrics(), chat=chat)


def entry(token: str, alts: tuple[str, ...] = ()) -> dict:
    top = [{"token": t, "logprob": -1.0, "bytes": list(t.encode())} for t in (token, *alts)]
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": top}


def chunk(
    delta: dict | None = None, *, index: int = 0, tokens: list[dict] | None = None, finish: str | None = None
) -> dict:
    choice = {
        "index": index,
        "delta": delta or {},
        "logprobs": {"content": tokens} if tokens else None,
        "finish_reason": finish,
    }
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}


def run(r: OutputRail, events: list[dict]) -> list[dict]:
    out = []
    for e in events:
        out += r(e)
        if r.stopped:
            break
    return out


def field(out: list[dict], name: str, index: int = 0) -> str:
    return "".join(c["delta"].get(name) or "" for e in out for c in e["choices"] if c["index"] == index)


def tokens(out: list[dict], index: int = 0) -> list[dict]:
    return [
        t
        for e in out
        for c in e["choices"]
        if c["index"] == index
        for t in ((c.get("logprobs") or {}).get("content") or [])
    ]


def content_stream(pieces: list[str], alts: tuple[str, ...] = ()) -> list[dict]:
    return (
        [chunk({"role": "assistant", "content": ""})]
        + [chunk({"content": p}, tokens=[entry(p, alts)]) for p in pieces]
        + [chunk(finish="stop")]
    )


def test_stream_guard_counts_consumed_characters_and_reports_rewritten_spans():
    guard = StreamGuard.from_policy(POLICY)
    text = f"mail {EMAIL} now and then some more text"
    steps = [guard.push(ch) for ch in text] + [guard.finish()]
    assert guard.consumed == len(text)
    spans = [s for step in steps for s in step.redacted]
    assert spans == [(5, 5 + len(EMAIL), "<EMAIL>")]
    blocked = StreamGuard([PatternCheck([ForbiddenPattern(pattern=DENIED)])], 4)
    for ch in "abcdefgh " + DENIED + " tail":
        blocked.push(ch)
    assert blocked.consumed <= len("abcdefgh ")


@pytest.mark.parametrize("seed", range(10))
def test_logprobs_never_run_ahead_of_their_text(seed):
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(40)]
    words.insert(rng.randint(5, 35), rng.choice([EMAIL, DENIED]))
    pieces, text = [], " ".join(words)
    i = 0
    while i < len(text):
        n = rng.randint(1, 7)
        pieces.append(text[i : i + n])
        i += n
    out, released_text, released_tokens = [], "", ""
    r = rail()
    for event in content_stream(pieces):
        for e in r(event):
            out.append(e)
            released_text += field([e], "content")
            released_tokens += "".join(t["token"] for t in tokens([e]))
            assert released_text.startswith(released_tokens)
        if r.stopped:
            break
    assert DENIED not in json.dumps(out) and EMAIL not in json.dumps(out)
    if DENIED in words:
        assert out[-1]["choices"][0]["finish_reason"] == "content_filter"
    else:
        assert released_tokens == released_text and "<EMAIL>" in released_tokens


def test_tokens_of_a_redacted_span_are_rewritten_consistently():
    out = run(rail(), content_stream(["mail jo", "hn.smith@exa", "mple.org", " now"]))
    assert field(out, "content") == "mail <EMAIL> now"
    assert [t["token"] for t in tokens(out)] == ["mail <EMAIL>", "", "", " now"]
    assert [t["top_logprobs"] for t in tokens(out)][:3] == [[], [], []]
    assert all(t["bytes"] == list(t["token"].encode()) for t in tokens(out))


def test_alternatives_are_checked_in_context():
    out = run(rail(), content_stream(["say", " FORBIDDEN-", " x", " y"], alts=("WORD", DENIED, "fine")))
    alts = {t["token"]: [a["token"] for a in t["top_logprobs"]] for t in tokens(out)}
    assert alts == {
        "say": ["say", "WORD", "fine"],
        " FORBIDDEN-": [" FORBIDDEN-", "WORD", "fine"],
        " x": [" x", "fine"],
        " y": [" y", "WORD", "fine"],
    }


def test_tokens_that_match_no_text_field_are_still_checked():
    # e.g. tool-call markup a parser swallows: the tokens are generated text of their own.
    events = [
        chunk({"content": "ok"}, tokens=[entry("ok")]),
        chunk({}, tokens=[entry(f"<call {DENIED}>")]),
        chunk({"content": " more " * 10}, tokens=[entry(" more " * 10)]),
    ]
    out = run(r := rail(), events)
    assert r.stopped and DENIED not in json.dumps(out)
    assert out[-1]["choices"][0]["finish_reason"] == "content_filter"


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content", "refusal"])
def test_every_text_field_has_its_own_guard(name):
    events = [chunk({name: "a" * 20}), chunk({name: " " + DENIED}), chunk({"content": "after"}), chunk(finish="stop")]
    out = run(r := rail(), events)
    assert r.stopped and DENIED not in json.dumps(out) and "after" not in json.dumps(out)
    out = run(rail(), [chunk({name: f"to {EMAIL}"}), chunk({"content": "x"}), chunk(finish="stop")])
    assert field(out, name) == "to <EMAIL>" and field(out, "content") == "x"


def tool_chunk(index: int, args: str, name: str | None = None) -> dict:
    call = {"index": index, "function": {"arguments": args}}
    if name is not None:
        call = {
            "index": index,
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": name, "arguments": args},
        }
    return chunk({"tool_calls": [call]})


def test_tool_call_arguments_are_guarded_per_call():
    events = [tool_chunk(0, "", "a"), tool_chunk(1, "", "b")]
    events += [tool_chunk(0, p) for p in ['{"x": "', EMAIL[:6], EMAIL[6:], '"}']]
    events += [tool_chunk(1, p) for p in ['{"y": "FORBIDDEN', '-WORD"}']] + [chunk(finish="tool_calls")]
    out = run(r := rail(), events)
    assert r.stopped and DENIED not in json.dumps(out) and EMAIL not in json.dumps(out)
    calls = [t for e in out for c in e["choices"] for t in c["delta"].get("tool_calls") or []]
    assert calls[0] == {"index": 0, "id": "call_0", "type": "function", "function": {"name": "a", "arguments": ""}}
    assert out[-1]["choices"][0]["finish_reason"] == "content_filter"
    out = run(rail(), events[:6] + [chunk(finish="tool_calls")])
    args = "".join(
        t["function"].get("arguments", "")
        for e in out
        for c in e["choices"]
        for t in c["delta"].get("tool_calls") or []
        if t["index"] == 0
    )
    assert args == '{"x": "<EMAIL>"}'


def test_a_tool_name_is_checked_before_it_is_announced():
    out = run(r := rail(), [tool_chunk(0, "{}", DENIED), chunk(finish="tool_calls")])
    assert r.stopped and DENIED not in json.dumps(out) and "call_0" not in json.dumps(out)


def test_a_block_in_one_choice_ends_every_choice():
    events = [
        chunk({"content": "clean " * 3}, index=0),
        chunk({"content": "bad " + DENIED}, index=1),
        chunk(index=1, finish="stop"),
        chunk({"content": "more"}, index=0),
    ]
    out = run(r := rail(), events)
    assert r.stopped and DENIED not in json.dumps(out)
    ends = {c["index"]: c["finish_reason"] for e in out for c in e["choices"] if c["finish_reason"]}
    assert ends == {0: "content_filter", 1: "content_filter"}


def test_role_chunk_and_usage_pass_through_and_token_ids_are_dropped():
    r = rail()
    role = chunk({"role": "assistant", "content": ""})
    assert r(role) == [role]
    usage = {"id": "x", "choices": [], "usage": {"total_tokens": 3}}
    assert r(usage) == [usage]
    with_ids = chunk({"content": "hello " * 5})
    with_ids["choices"][0]["token_ids"] = [1, 2, 3]
    assert all("token_ids" not in c for e in r(with_ids) for c in e["choices"])


def test_completion_logprobs_offsets_follow_the_rewritten_tokens():
    def event(text: str, offset: int, finish: str | None = None) -> dict:
        lp = (
            {
                "text_offset": [offset],
                "token_logprobs": [-0.1],
                "tokens": [text],
                "top_logprobs": [{text: -0.1, DENIED: -3.0}],
            }
            if text
            else None
        )
        return {"id": "cmpl-1", "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

    pieces, off, events = ["write ", "to ", EMAIL[:5], EMAIL[5:], " now"], 0, []
    for p in pieces:
        events.append(event(p, off))
        off += len(p)
    out = run(rail(chat=False), events + [event("", off, "stop")])
    text = "".join(c["text"] for e in out for c in e["choices"])
    lps = [c["logprobs"] for e in out for c in e["choices"] if c["logprobs"]]
    toks = [t for lp in lps for t in lp["tokens"]]
    offsets = [o for lp in lps for o in lp["text_offset"]]
    assert text == "write to <EMAIL> now" and "".join(toks) == text
    assert offsets == [sum(len(t) for t in toks[:i]) for i in range(len(toks))]
    assert all(DENIED not in top for lp in lps for top in lp["top_logprobs"])


def test_whole_response_guards_every_field_and_drops_what_follows_a_block():
    body = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "reasoning": f"ask {EMAIL}",
                    "content": f"answer {DENIED}",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                "logprobs": {"content": [entry("answer"), entry(" " + DENIED)]},
                "token_ids": [1, 2],
                "finish_reason": "tool_calls",
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": f"fine, {EMAIL}"},
                "logprobs": None,
                "finish_reason": "stop",
            },
        ]
    }
    out = guard_response(body, POLICY, RailMetrics(), chat=True)
    first, second = out["choices"]
    assert first["message"]["reasoning"] == "ask <EMAIL>" and first["message"]["content"] == ""
    assert "tool_calls" not in first["message"] and first["logprobs"] == {"content": []}
    assert first["finish_reason"] == "content_filter" and "token_ids" not in first
    assert second["message"]["content"] == "fine, <EMAIL>" and second["finish_reason"] == "stop"
    assert DENIED not in json.dumps(out) and EMAIL not in json.dumps(out)


def test_one_verdict_per_choice_whatever_the_number_of_fields():
    metrics = RailMetrics()
    r = OutputRail(POLICY, metrics, chat=True)
    run(
        r,
        [
            chunk({"reasoning": "think"}, tokens=[entry("think")]),
            tool_chunk(0, "{}", "f"),
            chunk({"content": f"at {EMAIL}"}),
            chunk(finish="stop"),
        ],
    )
    guard_response(
        {"choices": [{"index": 0, "message": {"content": DENIED}, "finish_reason": "stop"}]}, POLICY, metrics, chat=True
    )
    assert metrics.snapshot() == {("output", "redacted"): 1, ("output", "blocked"): 1}


def test_token_id_answers_are_refused_where_output_rails_are_on():
    refuse_unguardable(SimpleNamespace(return_tokens_as_token_ids=None, return_token_ids=False))
    for name in ("return_tokens_as_token_ids", "return_token_ids"):
        with pytest.raises(APIError) as err:
            refuse_unguardable(SimpleNamespace(**{name: True}))
        assert err.value.status == 400 and err.value.param == name and err.value.code == "unsupported_with_output_rails"
