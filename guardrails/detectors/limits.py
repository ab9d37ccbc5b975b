"""Request size limits, checked first because they are free and bound the cost of every later rail."""

from __future__ import annotations

import math
from collections.abc import Sequence

from guardrails.config import LimitsPolicy
from guardrails.verdict import PolicyCode, Verdict


def approx_tokens(text: str) -> int:
    """Cheap upper-leaning token estimate without a tokenizer.

    English BPE averages about 4 characters a token; scripts outside ASCII (CJK, Cyrillic, emoji)
    often cost a token or more per character, so those count one each.
    """
    non_ascii = sum(1 for ch in text if ord(ch) > 127)
    return math.ceil((len(text) - non_ascii) / 4) + non_ascii


def check_limits(messages: Sequence[str], limits: LimitsPolicy, rail: str = "limits") -> Verdict:
    """Block a request whose message count, total characters or approximate tokens exceed the policy."""
    if len(messages) > limits.max_messages:
        return Verdict.block(
            rail, PolicyCode.INPUT_TOO_LARGE, f"{len(messages)} messages exceed the limit of {limits.max_messages}"
        )
    chars = sum(len(m) for m in messages)
    if chars > limits.max_input_chars:
        return Verdict.block(
            rail, PolicyCode.INPUT_TOO_LARGE, f"{chars} characters exceed the limit of {limits.max_input_chars}"
        )
    tokens = sum(approx_tokens(m) for m in messages)
    if tokens > limits.max_input_tokens:
        return Verdict.block(
            rail,
            PolicyCode.INPUT_TOO_LARGE,
            f"about {tokens} tokens exceed the limit of {limits.max_input_tokens}",
        )
    return Verdict.allow(rail)
