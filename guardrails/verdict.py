"""Typed results returned by every rail.

A rail never returns a bare bool or dict: it returns a `Verdict`, so the deployment can map it to an
OpenAI error body (blocked), a rewritten message (redacted) or nothing (allowed) in one place.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any


class Action(StrEnum):
    """Outcome of a rail."""

    ALLOWED = "allowed"
    BLOCKED = "blocked"
    REDACTED = "redacted"


class PolicyCode(StrEnum):
    """Stable machine-readable reason codes; clients and dashboards key on these."""

    PII_BLOCKED = "pii_blocked"
    PII_REDACTED = "pii_redacted"
    PROMPT_INJECTION = "prompt_injection"
    DENIED_TOPIC = "denied_topic"
    INPUT_TOO_LARGE = "input_too_large"
    FORBIDDEN_CONTENT = "forbidden_content"
    RAIL_ERROR = "rail_error"


@dataclass(frozen=True, slots=True)
class Verdict:
    """Result of one rail (or of several, once combined).

    `reason` is short and written by the rail itself; it never quotes the user's or model's text, so it
    is safe to log and to return to the client. `text` is set only when `action` is REDACTED.
    `failed_open` marks a verdict that let text through only because a rail failed and the
    policy fails open: it says nothing about the text, so it is never remembered.
    """

    action: Action
    rail: str
    reason: str = ""
    score: float | None = None
    code: PolicyCode | None = None
    text: str | None = None
    failed_open: bool = False

    @classmethod
    def allow(cls, rail: str, score: float | None = None) -> Verdict:
        """An allowed verdict."""
        return cls(Action.ALLOWED, rail, score=score)

    @classmethod
    def allow_failed(cls, rail: str) -> Verdict:
        """The allow a failed rail yields under ``fail_open``: not a judgement of the text."""
        return cls(Action.ALLOWED, rail, reason=f"rail {rail} failed open", failed_open=True)

    @classmethod
    def block(cls, rail: str, code: PolicyCode, reason: str, score: float | None = None) -> Verdict:
        """A blocked verdict."""
        return cls(Action.BLOCKED, rail, reason=reason, score=score, code=code)

    @classmethod
    def redact(cls, rail: str, text: str, reason: str, code: PolicyCode = PolicyCode.PII_REDACTED) -> Verdict:
        """A redacted verdict carrying the rewritten text."""
        return cls(Action.REDACTED, rail, reason=reason, code=code, text=text)

    @property
    def blocked(self) -> bool:
        return self.action is Action.BLOCKED

    @property
    def allowed(self) -> bool:
        return self.action is Action.ALLOWED

    @property
    def redacted(self) -> bool:
        return self.action is Action.REDACTED


def combine(verdicts: Iterable[Verdict], rail: str = "guardrails") -> Verdict:
    """Fold verdicts of rails that ran one after another on the same message.

    The first block wins. Otherwise, if any rail redacted, the result is REDACTED with the text of the
    last redaction: rails run in sequence each see the previous rail's rewrite (see `run_sequence`), so
    the last text already contains every earlier redaction. A rail that failed open makes the result
    `failed_open` too, so no cache keeps it.
    """
    redactions: list[Verdict] = []
    failed: Verdict | None = None
    for verdict in verdicts:
        if verdict.blocked:
            return verdict
        if verdict.redacted:
            redactions.append(verdict)
        if verdict.failed_open and failed is None:
            failed = verdict
    if not redactions:
        return failed if failed is not None else Verdict.allow(rail)
    if len(redactions) == 1 and failed is None:
        return redactions[0]
    return Verdict(
        Action.REDACTED,
        "+".join(v.rail for v in redactions),
        reason="; ".join(v.reason for v in redactions if v.reason),
        code=redactions[0].code,
        text=redactions[-1].text,
        failed_open=failed is not None,
    )


def run_sequence(text: str, rails: Iterable[Callable[[str], Verdict]], rail: str = "guardrails") -> Verdict:
    """Run text rails in order, feeding each redaction to the next rail; stop at the first block."""
    seen: list[Verdict] = []
    current = text
    for check in rails:
        verdict = check(current)
        seen.append(verdict)
        if verdict.blocked:
            break
        if verdict.redacted and verdict.text is not None:
            current = verdict.text
    return combine(seen, rail=rail)


def with_rail(verdict: Verdict, rail: str) -> Verdict:
    """Same verdict attributed to another rail name (used when a wrapper reports for a detector)."""
    return replace(verdict, rail=rail)


def policy_version(policy: Any) -> str:
    """A digest naming a policy (a pydantic model) in ``VerdictCache`` keys: a new policy never
    sees an old one's verdicts."""
    return hashlib.blake2b(policy.model_dump_json().encode(), digest_size=8).hexdigest()


class VerdictCache:
    """Bounded LRU of verdicts by (policy version, text digest). Only verdicts a rail reached
    on its own are kept: a rail error or a budget overrun, blocked or failed open, is decided
    again next time. The guardrails replica keeps one (a long conversation pays only for its
    new messages), and so does the ingress for retrieved passages (the same passages answer
    many questions: a known one needs no call to the guardrails)."""

    def __init__(self, entries: int = 8192):
        self._entries = entries
        self._data: OrderedDict[tuple[str, bytes], Verdict] = OrderedDict()

    @staticmethod
    def key(version: str, text: str) -> tuple[str, bytes]:
        return version, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def get(self, key: tuple[str, bytes]) -> Verdict | None:
        verdict = self._data.get(key)
        if verdict is not None:
            self._data.move_to_end(key)
        return verdict

    def put(self, key: tuple[str, bytes], verdict: Verdict) -> None:
        if verdict.failed_open or verdict.code is PolicyCode.RAIL_ERROR:
            return
        self._data[key] = verdict
        self._data.move_to_end(key)
        while len(self._data) > self._entries:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
