"""Streaming output rail: check model text as it streams, release only what no rail would block.

`StreamGuard.push` receives each text delta and returns the part that may be sent to the client now:
everything except the tail that could still become part of a match. Each check says where that tail
begins (`hold_from`: partial matching on RE2, see guardrails/detectors/partial_regex.py), so plain
prose goes out as it arrives and only a possible match waits, e.g. the word being written (it could
grow into an e-mail address), a run of digits (a card number), or "Project Blue" while "Project
Bluebird" is forbidden. The moment a possible match is ruled out, its text is released.

A possible match of a check is held at most `holdback_chars`, or the check's `horizon_chars` if
larger; past that its start is released. Every scan covers the held text plus a look-behind of
already released text. Guarantee: a match that a check recognises within that many characters of
its start is seen whole before any of its characters is released, however the text is split.

Once a blocking match is found nothing more is released; the caller cancels generation and ends the
stream with finish_reason "content_filter". Redactions are rewritten before release; a redaction that
may still be growing is held until it is complete.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import re2

from guardrails.config import ForbiddenPattern, GuardrailPolicy
from guardrails.detectors import linear_regex as lrx
from guardrails.detectors import partial_regex
from guardrails.detectors.pii import detect, possible_match_start
from guardrails.entities import EntityType, RuleAction
from guardrails.metrics import RailMetrics
from guardrails.verdict import Action, PolicyCode, Verdict

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RuleMatch:
    """A span an output check objects to, and what to do about it."""

    start: int
    end: int
    label: str
    action: RuleAction
    code: PolicyCode
    replacement: str = "[REDACTED]"


class OutputCheck(Protocol):
    """A check run over streamed text. `horizon_chars` bounds how far past a match's start it must see.

    A check may also define ``hold_from(text, start) -> int``: the earliest offset >= start at which
    a match could begin that more text might complete (``len(text)`` if none). A check without it
    gets the fixed window: the last `hold` characters are always held back.
    """

    name: str
    horizon_chars: int

    def scan(self, text: str) -> Sequence[RuleMatch]: ...


class PiiOutputCheck:
    """PII and secrets in model output, with per-entity actions."""

    name = "pii"

    def __init__(self, actions: Mapping[EntityType, RuleAction], horizon_chars: int = 64) -> None:
        # 64 characters covers every fixed-format entity (cards 37, IBAN 42, PEM header 40) and the
        # recognisable prefix of every API key; longer e-mail local parts are the accepted gap.
        self.actions = dict(actions)
        self.entities = [e for e, a in self.actions.items() if a is not RuleAction.ALLOW]
        self.horizon_chars = horizon_chars

    def scan(self, text: str) -> list[RuleMatch]:
        if not self.entities:
            return []
        matches = []
        for f in detect(text, self.entities):
            action = self.actions[f.entity]
            code = PolicyCode.PII_BLOCKED if action is RuleAction.BLOCK else PolicyCode.PII_REDACTED
            matches.append(RuleMatch(f.start, f.end, f.entity.value, action, code, f.entity.placeholder))
        return matches

    def hold_from(self, text: str, start: int = 0) -> int:
        """Where a possible entity (one more text could complete) begins, at or after `start`."""
        if not self.entities:
            return len(text)
        return possible_match_start(text, self.entities, start)


class PatternCheck:
    """Forbidden literal strings and regular expressions from the policy, matched with RE2 (linear time).

    ``name`` names the check (in error metrics, and as the matches' label instead of "pattern
    N"), ``replacement`` is what a redacted match becomes."""

    def __init__(
        self, patterns: Iterable[ForbiddenPattern], *, name: str = "forbidden", replacement: str = "[REDACTED]"
    ) -> None:
        self.name = name
        self._label = None if name == "forbidden" else name
        self._replacement = replacement
        self._compiled: list[tuple[lrx.Pattern, ForbiddenPattern]] = []
        # Per pattern: its open-tail pattern (partial matching), or its horizon when it has none.
        self._tails: list[lrx.Pattern | int] = []
        horizon = 1
        for p in patterns:
            pattern, tail = _compile_forbidden(p.pattern, p.regex, p.ignore_case)
            pattern_horizon = p.max_match_chars or (64 if p.regex else len(p.pattern))
            self._compiled.append((pattern, p))
            self._tails.append(tail if tail is not None else pattern_horizon)
            horizon = max(horizon, pattern_horizon)
        self.horizon_chars = horizon

    def scan(self, text: str) -> list[RuleMatch]:
        matches = []
        data = lrx.to_utf8(text)
        for index, (pattern, spec) in enumerate(self._compiled):
            for start, end in lrx.finditer_plain(pattern, data):
                label = self._label or f"pattern {index}"
                matches.append(
                    RuleMatch(start, end, label, spec.action, PolicyCode.FORBIDDEN_CONTENT, self._replacement)
                )
        return matches

    def hold_from(self, text: str, start: int = 0) -> int:
        """Where a possible match of any pattern begins, at or after `start`."""
        if start >= len(text) or not self._tails:
            return len(text)
        data = lrx.to_utf8(text)
        pos = len(lrx.to_utf8(text[:start]))
        best = len(text)
        for tail in self._tails:
            if isinstance(tail, int):  # no partial matcher: hold the pattern's horizon
                best = min(best, max(start, len(text) - tail))
                continue
            found = partial_regex.open_tail_start(tail, data, pos)
            if found < len(data):
                best = min(best, start + len(data[pos:found].decode("utf-8")))
        return best


# An image on another host, up to the start of its address (and the first 128 characters of
# it): Markdown `![alt](https://...)` or `(//...)`, and HTML `<img ... src="https://...">` or
# `srcset`. A reference-style image, `![alt][ref]` or `![alt][]`, is defused whatever its
# target: the address stands elsewhere in the answer, possibly still to come. Redacting this
# much is enough: what follows is plain text that nothing fetches. Not recognised: an alt text
# or attribute list over 256 characters (the span must stay short, since a possible match is
# held back while it is written), and the shortcut form `![ref]`.
EXTERNAL_IMAGE_PATTERNS = (
    r"!\[[^\]\n]{0,256}\]\(\s{0,16}<?\s{0,16}(?:https?:)?//[^\s)>\x22']{0,128}>?\)?",
    r"<img\b[^>]{0,256}\bsrc(?:set)?\s{0,8}=\s{0,8}[\x22']?\s{0,8}(?:https?:)?//[^\s>\x22']{0,128}",
    r"!\[[^\]\n]{0,256}\]\[[^\]\n]{0,64}\]",
)
EXTERNAL_IMAGE_CHARS = 448  # the longest match of any of them, with room to spare
EXTERNAL_IMAGE_PLACEHOLDER = "[external image removed]"


@functools.cache
def external_image_check(action: RuleAction) -> PatternCheck:
    """The output check for ``output.external_images`` (redact or block). Built once per action:
    a ``PatternCheck`` keeps no state between scans, and every stream's every field asks for it."""
    patterns = [
        ForbiddenPattern(pattern=p, regex=True, ignore_case=True, action=action, max_match_chars=EXTERNAL_IMAGE_CHARS)
        for p in EXTERNAL_IMAGE_PATTERNS
    ]
    return PatternCheck(patterns, name="external_image", replacement=EXTERNAL_IMAGE_PLACEHOLDER)


@functools.lru_cache(maxsize=256)
def _compile_forbidden(pattern: str, regex: bool, ignore_case: bool) -> tuple[lrx.Pattern, lrx.Pattern | None]:
    """A forbidden pattern and its open-tail pattern, compiled once per process (guards are per stream).

    The open-tail pattern is None when RE2 cannot fit it in memory (a pattern with several large
    counted repetitions): that pattern then holds back its horizon, as a fixed window.
    """
    compiled = lrx.compile_forbidden(pattern, regex=regex, ignore_case=ignore_case)
    try:
        tail = partial_regex.compile_open_tail(compiled.pattern, ignore_case=ignore_case)
    except (ValueError, re2.error):
        logger.warning("forbidden pattern has no partial matcher; it holds back its horizon instead")
        tail = None
    return compiled, tail


@dataclass(frozen=True, slots=True)
class StreamStep:
    """What `push`/`finish` decided: text safe to send now, and the verdict so far."""

    text: str
    verdict: Verdict
    # Spans rewritten in this step, as (start, end, replacement) in offsets of the pushed text.
    redacted: tuple[tuple[int, int, str], ...] = ()


class StreamGuard:
    """Holds back the text that could still become part of a match and releases the rest, checked and rewritten.

    One instance per response stream; not thread-safe. Guarantee: the concatenation of every released
    `text` never contains a match that a check reports as BLOCK, provided the check can recognise the
    match within `hold` characters of its start (`hold` is `window_chars` or the largest
    `horizon_chars`). What is held back at a time is the tail where a check's possible match begins
    (`hold_from`), at most `hold` characters, plus a redaction that may still grow; the buffer never
    exceeds `hold + max_redact_chars` characters, and a redaction longer than that blocks instead.
    `consumed` counts the pushed characters released so far (verbatim or rewritten): everything a
    caller derived from pushed text before that offset may follow it out (e.g. token logprobs).
    """

    def __init__(
        self,
        checks: Sequence[OutputCheck],
        window_chars: int = 64,
        *,
        fail_open: bool = False,
        max_redact_chars: int = 512,
        metrics: RailMetrics | None = None,
        rail: str = "output",
    ) -> None:
        if window_chars < 1:
            raise ValueError("window_chars must be positive")
        # window_chars: the longest a possible match is held back (`holdback_chars` in the policy).
        self.checks = list(checks)
        horizon = max((c.horizon_chars for c in self.checks), default=1)
        self.hold = max(window_chars, horizon)
        self.window_chars = window_chars
        self.lookbehind = max(horizon, 1)
        self.fail_open = fail_open
        self.max_redact_chars = max_redact_chars
        self.metrics = metrics if metrics is not None else RailMetrics()
        self.rail = rail
        self._held = ""
        self._tail = ""
        self._blocked: Verdict | None = None
        self.consumed = 0
        # Label -> code of every span rewritten so far (labels name entities or pattern numbers, never text).
        self._redacted: dict[str, PolicyCode] = {}

    @classmethod
    def from_policy(
        cls,
        policy: GuardrailPolicy,
        extra_checks: Sequence[OutputCheck] = (),
        metrics: RailMetrics | None = None,
    ) -> StreamGuard:
        """Guard built from a model's policy: PII output actions, forbidden patterns, then extra checks.

        With guardrails or the output rail disabled the guard has no checks and releases text at once.
        """
        checks: list[OutputCheck] = []
        if not (policy.enabled and policy.output.enabled):
            return cls([], 1, metrics=metrics)
        if policy.pii.enabled:
            checks.append(PiiOutputCheck(policy.pii.output))
        if policy.output.forbidden:
            checks.append(PatternCheck(policy.output.forbidden))
        if policy.output.external_images is not RuleAction.ALLOW:
            checks.append(external_image_check(policy.output.external_images))
        checks.extend(extra_checks)
        return cls(
            checks,
            policy.output.holdback_chars,
            fail_open=policy.fail_open,
            max_redact_chars=policy.output.max_redact_chars,
            metrics=metrics,
        )

    @property
    def held_chars(self) -> int:
        """Characters received but not yet released."""
        return len(self._held)

    @property
    def verdict(self) -> Verdict:
        """Verdict over everything seen so far: blocked, redacted (if any span was rewritten) or allowed."""
        if self._blocked is not None:
            return self._blocked
        if self._redacted:
            labels = ", ".join(sorted(self._redacted))
            code = next(iter(self._redacted.values()))
            return Verdict(Action.REDACTED, self.rail, reason=f"redacted {labels}", code=code)
        return Verdict.allow(self.rail)

    def push(self, delta: str) -> StreamStep:
        """Add generated text; return the text that may be released now."""
        if self._blocked is not None:
            return StreamStep("", self._blocked)
        self._held += delta
        if not self.checks:
            released, self._held = self._held, ""
            self.consumed += len(released)
            return StreamStep(released, self.verdict)
        if not delta:
            return StreamStep("", self.verdict)
        return self._process(final=False)

    def finish(self) -> StreamStep:
        """End of generation: check and release whatever is still held."""
        if self._blocked is not None:
            return StreamStep("", self._blocked)
        return self._process(final=True)

    def _block(self, verdict: Verdict) -> StreamStep:
        self._blocked = verdict
        # Drop held text: it must never be released, and the guard keeps nothing it does not need.
        self._held = ""
        self._tail = ""
        self.metrics.record_verdict(verdict)
        return StreamStep("", verdict)

    def _failed(self, check: OutputCheck, exc: Exception) -> Verdict | None:
        # Any failure inside a check must not pass text through (unless the policy says fail open).
        self.metrics.record_error(f"{self.rail}.{check.name}")
        # The exception message may quote the text, so only its type is logged.
        logger.error("output check %s raised %s", check.name, type(exc).__name__)
        logger.debug("output check %s traceback", check.name, exc_info=True)
        if self.fail_open:
            return None
        return Verdict.block(self.rail, PolicyCode.RAIL_ERROR, f"output check {check.name} failed")

    def _scan(self, text: str, off: int) -> list[RuleMatch] | Verdict:
        """Every check's matches in `text`, whose first `off` characters were released. Each
        check reads only its own look-behind (its horizon) of released text: a short check does
        not rescan the long look-behind a long pattern needs."""
        matches: list[RuleMatch] = []
        for check in self.checks:
            start = max(0, off - max(check.horizon_chars, 1))
            try:
                found = check.scan(text[start:])
            except Exception as exc:
                if (verdict := self._failed(check, exc)) is not None:
                    return verdict
                continue
            matches += [replace(m, start=m.start + start, end=m.end + start) for m in found] if start else found
        return matches

    def _hold_point(self, text: str, off: int) -> int | Verdict:
        """Offset in `text` from which to hold back: the earliest possible match still open at the end.

        A possible match that began more than its check's horizon (or `window_chars`) ago, or in
        released text, no longer holds anything back (the guarantee covers matches recognisable
        within that many characters)."""
        cut = len(text)
        for check in self.checks:
            # Each check holds a possible match for its own horizon (or the window, if longer):
            # a long pattern (an image's address) must not make every word wait as long.
            floor = max(off, len(text) - max(self.window_chars, check.horizon_chars))
            hold_from = getattr(check, "hold_from", None)
            if hold_from is None:
                cut = min(cut, floor)  # a check that cannot tell holds the whole window
                continue
            try:
                cut = min(cut, max(floor, hold_from(text, floor)))
            except Exception as exc:
                if (verdict := self._failed(check, exc)) is not None:
                    return verdict
                cut = min(cut, floor)
        return cut

    def _process(self, final: bool) -> StreamStep:
        text = self._tail + self._held
        off = len(self._tail)
        scanned = self._scan(text, off)
        if isinstance(scanned, Verdict):
            return self._block(scanned)
        # Matches wholly inside the look-behind were handled when that text was released.
        live = [m for m in scanned if m.end > off]
        for m in live:
            if m.action is RuleAction.BLOCK:
                return self._block(Verdict.block(self.rail, m.code, f"output matched {m.label}"))
        redactions = _merge([m for m in live if m.action is RuleAction.REDACT])

        cut = len(text) if final else self._hold_point(text, off)
        if isinstance(cut, Verdict):
            return self._block(cut)
        if not final:
            for m in redactions:
                # Hold back a redaction that crosses the cut or touches the end (it may still grow).
                if m.start < cut and (m.end > cut or m.end >= len(text)):
                    cut = max(off, m.start)
                    break
        if len(text) - cut > self.hold + self.max_redact_chars:
            return self._block(Verdict.block(self.rail, PolicyCode.PII_BLOCKED, "redaction span too long to hold back"))

        out: list[str] = []
        spans: list[tuple[int, int, str]] = []
        pos = off
        for m in redactions:
            if m.start >= cut or m.end > cut:
                break
            out.append(text[pos : max(pos, m.start)])
            out.append(m.replacement)
            spans.append((self.consumed + max(pos, m.start) - off, self.consumed + m.end - off, m.replacement))
            self._redacted.setdefault(m.label, m.code)
            pos = max(pos, m.end)
        out.append(text[pos:cut])
        self._tail = (self._tail + self._held[: cut - off])[-self.lookbehind :]
        self._held = self._held[cut - off :]
        self.consumed += cut - off
        step = StreamStep("".join(out), self.verdict, tuple(spans))
        if final:
            self.metrics.record_verdict(step.verdict)
        return step


def _merge(matches: list[RuleMatch]) -> list[RuleMatch]:
    # Overlapping redactions collapse into one span with the first match's placeholder.
    merged: list[RuleMatch] = []
    for m in sorted(matches, key=lambda m: (m.start, -m.end)):
        if merged and m.start < merged[-1].end:
            last = merged[-1]
            if m.end > last.end:
                merged[-1] = RuleMatch(last.start, m.end, last.label, last.action, last.code, last.replacement)
            continue
        merged.append(m)
    return merged
