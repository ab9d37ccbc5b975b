"""Every field of one choice that carries generated text, each behind its own ``StreamGuard``.

Text fields: ``content``, ``reasoning`` / ``reasoning_content`` (vLLM has used both names),
``refusal``, each tool call's ``function.name`` and ``function.arguments`` (keyed by the tool
call's ``index``), the legacy ``function_call``, and a completion's ``text``.

Logprobs: the chosen tokens are generated text too, so they form one more stream with its own
guard (``LogprobGate``). An entry leaves only once (a) its own token has been released by that
guard and (b) every text the engine sent in the same chunk has been released by its field's
guard: logprobs never run ahead of the text they belong to. Tokens inside a rewritten span are
rewritten consistently with the text: the token where a span starts carries the placeholder,
the others inside it become "", their ``bytes`` are recomputed and their alternatives dropped.
``top_logprobs`` alternatives were never part of any text: each one is checked after the
released context it would have followed, and dropped if it completes a match.
Checking alternatives costs one scan per alternative (about 0.1 ms each with PII checks on).
``token_ids`` decode to generated text that no rail can read: they are removed (and
``output_stage.refuse_unguardable`` lets the ingress refuse requests for them up front).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from guardrails.config import GuardrailPolicy
from guardrails.entities import RuleAction
from guardrails.metrics import RailMetrics
from guardrails.output_rail import StreamGuard
from guardrails.verdict import Action, Verdict

CONTENT_FILTER = "content_filter"
# String fields of a chat delta or message, in the order a model generates them.
TEXT_FIELDS = ("reasoning_content", "reasoning", "content", "refusal")
_CALL_PARTS = ("name", "arguments")
_UNCHECKABLE = ("token_ids",)

Key = tuple  # ("content",), ("tool", 0, "arguments"), ("function_call", "name"), ("text",)
Needs = tuple[tuple[StreamGuard, int], ...]  # (guard, pushed characters it must have released)


def _texts(holder: dict[str, Any], chat: bool) -> list[tuple[Key, str]]:
    """(field, text) of every generated-text field of a delta, message or completion choice."""
    if not chat:
        return [(("text",), holder["text"])] if isinstance(holder.get("text"), str) else []
    out: list[tuple[Key, str]] = [((k,), holder[k]) for k in TEXT_FIELDS if isinstance(holder.get(k), str)]
    for pos, call in enumerate(holder.get("tool_calls") or []):
        fn = call.get("function") or {}
        out += [(("tool", call.get("index", pos), p), fn[p]) for p in _CALL_PARTS if isinstance(fn.get(p), str)]
    fn = holder.get("function_call") or {}
    out += [(("function_call", p), fn[p]) for p in _CALL_PARTS if isinstance(fn.get(p), str)]
    return out


class ChoiceGuards:
    """The guards of one choice: one per text field, and its logprobs held in step with them."""

    def __init__(self, policy: GuardrailPolicy, metrics: RailMetrics, *, chat: bool):
        self._policy = policy
        self._metrics = metrics
        self._chat = chat
        self._guards: dict[Key, StreamGuard] = {}
        self._pushed: dict[Key, int] = {}
        self._headers_sent: set[int] = set()  # tool call indexes whose id/type went out
        self._logprobs: LogprobGate | None = None
        self.blocked = False
        self.finished = False

    # --- streaming -------------------------------------------------------------------

    def filter(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """The choice as it may be sent now (None: nothing yet); sets ``blocked`` on a block."""
        holder = (choice.get("delta") or {}) if self._chat else choice
        texts = _texts(holder, self._chat)
        finish = choice.get("finish_reason")
        if not any(t for _, t in texts) and not _has_logprobs(choice) and finish is None:
            return _without(choice, _UNCHECKABLE)  # e.g. the role chunk
        released, entries = self._step(texts, choice.get("logprobs"), final=finish is not None)
        if self.blocked:
            finish = CONTENT_FILTER
        if finish is not None and not self.finished:
            self.finished = True
            self._metrics.record_verdict(self.verdict)
        if not self._chat:
            if not released.get(("text",)) and not entries and finish is None:
                return None
            new = _without(choice, ("text", "logprobs", "finish_reason", *_UNCHECKABLE))
            return {
                **new,
                "text": released.get(("text",), ""),
                "logprobs": self._format(entries),
                "finish_reason": finish,
            }
        delta = _without(holder, (*TEXT_FIELDS, "tool_calls", "function_call"))
        for (name, *rest), text in released.items():
            if not rest and (text or name in holder):
                delta[name] = text
        calls = self._tool_deltas(holder.get("tool_calls") or [], released)
        if calls:
            delta["tool_calls"] = calls
        function_call = {p: released[("function_call", p)] for p in _CALL_PARTS if released.get(("function_call", p))}
        if function_call:
            delta["function_call"] = function_call
        if finish is None and not entries and not any(released.values()) and delta.get("role") is None:
            return None
        new = _without(choice, ("delta", "logprobs", "finish_reason", *_UNCHECKABLE))
        return {**new, "delta": delta, "logprobs": self._format(entries), "finish_reason": finish}

    def _tool_deltas(self, calls: list[dict[str, Any]], released: dict[Key, str]) -> list[dict[str, Any]]:
        originals = {c.get("index", pos): c for pos, c in enumerate(calls)}
        indexes = sorted({*originals, *(k[1] for k in released if k[0] == "tool")})
        out = []
        for index in indexes:
            name, args = released.get(("tool", index, "name")), released.get(("tool", index, "arguments"))
            if self.blocked and index not in self._headers_sent and not name:
                continue  # never announce a call whose name did not pass
            call = _without(originals.get(index, {"index": index}), ("function",))
            fn = {"name": name} if name else {}
            if args or (
                index not in self._headers_sent and "arguments" in (originals.get(index, {}).get("function") or {})
            ):
                fn["arguments"] = args or ""
            if fn:
                call["function"] = fn
            if len(call) > 1:
                self._headers_sent.add(index)
                out.append(call)
        return out

    # --- a whole response ------------------------------------------------------------

    def guard_whole(self, choice: dict[str, Any]) -> None:
        """Guard a non-streamed choice in place: each field is cut at a violation, and nothing
        generated after a block is kept (no logprobs, no unfinished tool call)."""
        holder = choice["message"] if self._chat else choice
        released, entries = self._step(_texts(holder, self._chat), choice.get("logprobs"), final=True)
        for key in (k for k in (*TEXT_FIELDS, "text") if isinstance(holder.get(k), str)):
            holder[key] = released.get((key,), "")
        if self._chat and holder.get("tool_calls"):
            calls = [(c, ("tool", c.get("index", pos))) for pos, c in enumerate(holder["tool_calls"])]
            holder["tool_calls"] = [c for c, prefix in calls if self._keep_call(c.get("function"), prefix, released)]
            if not holder["tool_calls"]:
                del holder["tool_calls"]
        function_call = holder.get("function_call") if self._chat else None
        if function_call and not self._keep_call(function_call, ("function_call",), released):
            del holder["function_call"]
        if choice.get("logprobs") is not None:
            choice["logprobs"] = self._format(entries, empty=True)
        for key in _UNCHECKABLE:
            choice.pop(key, None)
        if self.blocked:
            choice["finish_reason"] = CONTENT_FILTER
        self.finished = True
        self._metrics.record_verdict(self.verdict)

    # --- shared ----------------------------------------------------------------------

    @property
    def verdict(self) -> Verdict:
        """One verdict for the whole choice: the block, else a redaction, else allowed."""
        verdicts = [g.verdict for g in self._guards.values()] + ([self._logprobs.verdict] if self._logprobs else [])
        return next((v for v in verdicts if v.blocked), None) or next(
            (v for v in verdicts if v.action is Action.REDACTED), Verdict.allow("output")
        )

    def _new_guard(self) -> StreamGuard:
        # The choice records one verdict for all its guards; each guard still counts its errors.
        return StreamGuard.from_policy(self._policy, metrics=_ErrorsOnly(self._metrics))

    def _guard(self, key: Key) -> StreamGuard:
        if key not in self._guards:
            self._guards[key], self._pushed[key] = self._new_guard(), 0
        return self._guards[key]

    def _keep_call(self, fn: dict[str, Any] | None, prefix: Key, released: dict[Key, str]) -> bool:
        """Rewrite a whole call's name and arguments in place; False if a part was not released whole."""
        parts = [p for p in _CALL_PARTS if isinstance((fn or {}).get(p), str)]
        for p in parts:
            key, guard = (*prefix, p), self._guards.get((*prefix, p))
            if key not in released or (
                guard is not None and (guard.verdict.blocked or guard.consumed < self._pushed[key])
            ):
                return False
        fn.update({p: released[(*prefix, p)] for p in parts})
        return True

    def _step(self, texts: list[tuple[Key, str]], logprobs: Any, *, final: bool) -> tuple[dict[Key, str], list]:
        """Push one chunk's texts and logprobs (and finish every guard if ``final``); return the
        text released per field and the logprob entries released."""
        released: dict[Key, str] = {}
        needs: list[tuple[StreamGuard, int]] = []
        finished: set[Key] = set()
        for key, text in texts:
            if not text:
                released.setdefault(key, "")
                continue
            guard = self._guard(key)
            self._pushed[key] += len(text)
            steps = [guard.push(text)]
            # Names arrive whole, and at the end so does every field: check and release it at once,
            # in generation order, so a block in a later field does not cut an earlier, finished one.
            if key[-1] == "name" or final:
                steps.append(guard.finish())
                finished.add(key)
            released[key] = released.get(key, "") + "".join(s.text for s in steps)
            needs.append((guard, self._pushed[key]))
            if steps[-1].verdict.blocked:
                self.blocked = True
                break
        if not self.blocked and _has_logprobs({"logprobs": logprobs}):
            if self._logprobs is None:
                self._logprobs = LogprobGate(self._new_guard(), chat=self._chat)
            self.blocked = self._logprobs.add(logprobs, tuple(needs))
        if final and not self.blocked:
            for key, guard in self._guards.items():
                if key[-1] == "name" or key in finished:
                    continue  # already finished when it arrived
                step = guard.finish()
                released[key] = released.get(key, "") + step.text
                if step.verdict.blocked:
                    self.blocked = True
                    break
            if not self.blocked and self._logprobs is not None:
                self.blocked = self._logprobs.finish()
        return released, (self._logprobs.release() if self._logprobs is not None else [])

    def _format(self, entries: list, *, empty: bool = False) -> dict[str, Any] | None:
        if not entries and not empty:
            return None
        return {"content": entries} if self._chat else _columns(entries)


class _ErrorsOnly(RailMetrics):
    """Metrics that pass rail errors on and leave verdicts to the caller."""

    def __init__(self, metrics: RailMetrics):
        super().__init__()
        self._metrics = metrics

    def record_verdict(self, verdict: Verdict) -> None:
        return None

    def record_error(self, rail: str) -> None:
        self._metrics.record_error(rail)


def _has_logprobs(choice: dict[str, Any]) -> bool:
    lp = choice.get("logprobs")
    return isinstance(lp, dict) and bool(lp.get("content") or lp.get("tokens"))


def _without(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in keys}


def _columns(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Completion logprobs are columns: one list per field."""
    return {
        "text_offset": [e["text_offset"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "tokens": [e["token"] for e in entries],
        "top_logprobs": [e["top_logprobs"] for e in entries],
    }


@dataclass
class _Entry:
    token: str
    raw: dict[str, Any]
    start: int  # offsets in the stream of chosen tokens
    end: int
    needs: Needs = field(default_factory=tuple)


class LogprobGate:
    """One choice's logprob entries, released in step with their tokens and their chunk's text."""

    def __init__(self, guard: StreamGuard, *, chat: bool):
        self._guard = guard  # checks the stream of chosen tokens
        self._chat = chat
        self._pending: deque[_Entry] = deque()
        self._spans: list[tuple[int, int, str]] = []  # rewritten spans not yet behind every entry
        self._text = ""  # chosen-token text from offset `_base`: context for the alternatives
        self._base = 0
        self._pushed = 0
        self._offset: int | None = None  # completions: text_offset of the next released token

    def add(self, logprobs: dict[str, Any], needs: Needs) -> bool:
        """Queue one chunk's entries; True if their tokens complete a blocked match."""
        raws = (logprobs.get("content") or []) if self._chat else _rows(logprobs)
        if not self._chat and self._offset is None and raws:
            self._offset = raws[0]["text_offset"] or 0
        for raw in raws:
            token = raw.get("token") or ""
            self._pending.append(_Entry(token, raw, self._pushed, self._pushed + len(token), needs))
            self._pushed += len(token)
            self._text += token
        step = self._guard.push("".join(r.get("token") or "" for r in raws))
        self._spans.extend(step.redacted)
        return step.verdict.blocked

    @property
    def verdict(self) -> Verdict:
        return self._guard.verdict

    def finish(self) -> bool:
        step = self._guard.finish()
        self._spans.extend(step.redacted)
        return step.verdict.blocked

    def release(self) -> list[dict[str, Any]]:
        out = []
        while self._pending and self._ready(self._pending[0]):
            out.append(self._rewrite(self._pending.popleft()))
        nxt = self._pending[0].start if self._pending else self._pushed
        self._spans = [s for s in self._spans if s[1] > nxt]
        keep = max(self._base, nxt - self._guard.lookbehind)
        self._text, self._base = self._text[keep - self._base :], keep
        return out

    def _ready(self, entry: _Entry) -> bool:
        return self._guard.consumed >= entry.end and all(g.consumed >= n for g, n in entry.needs)

    def _rewrite(self, entry: _Entry) -> dict[str, Any]:
        token, touched, pos = [], False, entry.start
        for start, end, replacement in self._spans:
            if end <= entry.start or start >= entry.end:
                continue
            touched = True
            token.append(entry.token[pos - entry.start : max(pos, start) - entry.start])
            if start >= entry.start:
                token.append(replacement)
            pos = max(pos, min(end, entry.end))
        token.append(entry.token[pos - entry.start :])
        new = "".join(token)
        raw = entry.raw
        if self._chat:
            alts = (
                []
                if touched
                else [
                    {**a, **_bytes_of(a)}
                    for a in raw.get("top_logprobs") or []
                    if self._allowed(entry, a.get("token") or "")
                ]
            )
            return {**raw, "token": new, **_bytes_of({**raw, "token": new}), "top_logprobs": alts}
        top = raw["top_logprobs"]
        if top is not None:
            top = {} if touched else {t: lp for t, lp in top.items() if self._allowed(entry, t)}
        offset = self._offset or 0
        self._offset = offset + len(new)
        return {"token": new, "logprob": raw["logprob"], "top_logprobs": top, "text_offset": offset}

    def _allowed(self, entry: _Entry, alternative: str) -> bool:
        """Whether an alternative token, after the chosen text before it, completes no match."""
        if alternative == entry.token:
            return True  # the chosen token itself: its guard has checked it in this very context
        start = entry.start
        context = self._text[max(0, start - self._base - self._guard.lookbehind) : start - self._base]
        for check in self._guard.checks:
            try:
                matches = check.scan(context + alternative)
            except Exception:  # noqa: BLE001 -- a failing check must not wave an alternative through
                return False
            if any(m.end > len(context) and m.action is not RuleAction.ALLOW for m in matches):
                return False
        return True


def _rows(logprobs: dict[str, Any]) -> list[dict[str, Any]]:
    tokens = logprobs.get("tokens") or []

    def column(name: str) -> list[Any]:
        values = logprobs.get(name) or []
        return list(values) + [None] * (len(tokens) - len(values))

    return [
        {"token": t, "logprob": lp, "top_logprobs": top, "text_offset": off}
        for t, lp, top, off in zip(tokens, column("token_logprobs"), column("top_logprobs"), column("text_offset"))
    ]


def _bytes_of(entry: dict[str, Any]) -> dict[str, Any]:
    # Recomputed from the released token, as vLLM computes them: bytes never say more than the token.
    if entry.get("bytes") is None:
        return {}
    return {"bytes": list((entry.get("token") or "").encode("utf-8", errors="replace"))}
