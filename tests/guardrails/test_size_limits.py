from guardrails.config import LimitsPolicy
from guardrails.detectors.limits import approx_tokens, check_limits
from guardrails.verdict import PolicyCode

LIMITS = LimitsPolicy(max_input_chars=100, max_input_tokens=20, max_messages=3)


def test_within_limits_is_allowed():
    assert check_limits(["hello", "how are you?"], LIMITS).allowed


def test_too_many_messages():
    verdict = check_limits(["a"] * 4, LIMITS)
    assert verdict.blocked and verdict.code is PolicyCode.INPUT_TOO_LARGE and "4 messages" in verdict.reason


def test_too_many_chars():
    verdict = check_limits(["x" * 60, "y" * 41], LIMITS)
    assert verdict.blocked and "101 characters" in verdict.reason


def test_too_many_tokens_counts_non_ascii_per_character():
    assert approx_tokens("abcd" * 10) == 10
    assert approx_tokens("日本語のテキスト") == 8
    verdict = check_limits(["日本語" * 8], LIMITS)  # 24 chars fit, about 24 tokens do not
    assert verdict.blocked and "tokens" in verdict.reason
