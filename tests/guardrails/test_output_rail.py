import logging
import random

import pytest

from guardrails.config import ForbiddenPattern, load_policy
from guardrails.entities import EntityType, RuleAction
from guardrails.metrics import RailMetrics
from guardrails.output_rail import PatternCheck, PiiOutputCheck, RuleMatch, StreamGuard
from guardrails.verdict import PolicyCode

SECRET = "Project Bluebird"


def stream(guard, deltas):
    """Feed deltas, return (released text, last step, max held chars after any push)."""
    released, max_held, step = [], 0, None
    for delta in deltas:
        step = guard.push(delta)
        released.append(step.text)
        max_held = max(max_held, guard.held_chars)
        if step.verdict.blocked:
            return "".join(released), step, max_held
    step = guard.finish()
    released.append(step.text)
    return "".join(released), step, max_held


def pattern_guard(window=16, **kwargs):
    return StreamGuard([PatternCheck([ForbiddenPattern(pattern=SECRET)])], window, **kwargs)


def test_clean_text_passes_through_unchanged():
    text = "The quick brown fox jumps over the lazy dog. " * 5
    released, step, _ = stream(pattern_guard(), list(text))
    assert released == text and step.verdict.allowed


def test_forbidden_string_split_one_character_at_a_time_is_never_released():
    text = "Sure. The internal code name is " + SECRET + " and it launches soon."
    released, step, _ = stream(pattern_guard(), list(text))
    assert step.verdict.blocked and step.verdict.code is PolicyCode.FORBIDDEN_CONTENT
    assert "Bluebird" not in released and "Project Blue" not in released
    assert text.startswith(released)


def test_forbidden_string_case_insensitive_and_in_one_big_delta():
    released, step, _ = stream(pattern_guard(), ["intro text that is long enough... project BLUEBIRD!"])
    assert step.verdict.blocked and released == ""


def test_nothing_is_released_after_a_block():
    guard = pattern_guard()
    stream(guard, list("xx " + SECRET))
    assert guard.push("more text " * 10).text == ""
    assert guard.finish().text == "" and guard.verdict.blocked


@pytest.mark.parametrize("seed", range(20))
def test_random_delta_sizes_never_leak_a_prefix_of_the_secret(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("abc de ") for _ in range(rng.randint(0, 200))) + SECRET + " tail"
    deltas, i = [], 0
    while i < len(text):
        n = rng.randint(1, 9)
        deltas.append(text[i : i + n])
        i += n
    released, step, max_held = stream(pattern_guard(window=8), deltas)
    assert step.verdict.blocked
    # Everything released lies strictly before the secret's start.
    assert len(released) <= text.index(SECRET)
    assert max_held <= 8 + len(SECRET) + 9  # window + pattern + one delta in flight


def test_holdback_bound_respected():
    checks = [PatternCheck([ForbiddenPattern(pattern="forbidden-thing"), ForbiddenPattern(pattern="xyz")])]
    guard = StreamGuard(checks, window_chars=20)
    longest = len("forbidden-thing")
    text = "a perfectly harmless sentence that goes on and on " * 6
    for ch in text:
        guard.push(ch)
        assert guard.held_chars <= 20 + longest
    # Minimal hold-back: prose that cannot become a match is not held; a possible match is.
    assert guard.held_chars == 0
    for ch in "forbidden-th":
        guard.push(ch)
    assert guard.held_chars == len("forbidden-th")


def test_window_is_raised_to_the_longest_pattern():
    guard = StreamGuard([PatternCheck([ForbiddenPattern(pattern="x" * 40)])], window_chars=8)
    assert guard.hold == 40


def test_redact_email_split_across_deltas():
    guard = StreamGuard([PiiOutputCheck({EntityType.EMAIL: RuleAction.REDACT})], window_chars=16)
    text = "You can write to jane.roe@example.org if you need anything else at all."
    released, step, _ = stream(guard, [text[i : i + 3] for i in range(0, len(text), 3)])
    assert released == "You can write to <EMAIL> if you need anything else at all."
    assert step.verdict.redacted and guard.verdict.code is PolicyCode.PII_REDACTED
    assert "jane" not in guard.verdict.reason


def test_redact_at_the_very_end_is_flushed_by_finish():
    guard = StreamGuard([PiiOutputCheck({EntityType.PHONE: RuleAction.REDACT})], window_chars=8)
    released, _, _ = stream(guard, list("Call me on +44 20 7946 0958"))
    assert released == "Call me on <PHONE>"


def test_pii_block_in_output_stops_stream():
    guard = StreamGuard.from_policy(load_policy({"output": {"holdback_chars": 16}}))
    text = "Your card number is 4111 1111 1111 1111, keep it safe."
    released, step, _ = stream(guard, list(text))
    assert step.verdict.blocked and step.verdict.code is PolicyCode.PII_BLOCKED
    assert "4111" not in released


def test_regex_pattern_redaction():
    spec = ForbiddenPattern(pattern=r"ticket-\d{4}", regex=True, action=RuleAction.REDACT, max_match_chars=11)
    guard = StreamGuard([PatternCheck([spec])], window_chars=4)
    released, step, _ = stream(guard, list("see ticket-1234 and ticket-9876 now"))
    assert released == "see [REDACTED] and [REDACTED] now" and step.verdict.redacted


class Exploding:
    name = "exploding"
    horizon_chars = 4

    def scan(self, text):
        raise RuntimeError(f"cannot scan {text}")


def test_raising_check_fails_closed_and_is_counted_without_logging_text(caplog):
    metrics = RailMetrics()
    guard = StreamGuard([Exploding()], window_chars=4, metrics=metrics)
    with caplog.at_level(logging.DEBUG, logger="guardrails.output_rail"):
        released, step, _ = stream(guard, ["confidential words here"])
    assert released == "" and step.verdict.blocked and step.verdict.code is PolicyCode.RAIL_ERROR
    assert metrics.errors() == 1 and metrics.errors("output.exploding") == 1
    messages = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert "exploding" in messages and "confidential" not in messages


def test_raising_check_with_fail_open_releases_text_and_still_counts():
    metrics = RailMetrics()
    guard = StreamGuard([Exploding()], window_chars=4, fail_open=True, metrics=metrics)
    released, step, _ = stream(guard, ["harmless words here"])
    assert released == "harmless words here" and not step.verdict.blocked
    assert metrics.errors() >= 1


class LongRedaction:
    name = "long"
    horizon_chars = 4

    def scan(self, text):
        start = text.find("<<")
        if start < 0:
            return []
        return [RuleMatch(start, len(text), "long", RuleAction.REDACT, PolicyCode.PII_REDACTED)]


def test_redaction_that_keeps_growing_is_bounded():
    guard = StreamGuard([LongRedaction()], window_chars=4, max_redact_chars=50)
    released, step, max_held = stream(guard, ["ok <<"] + ["x"] * 200)
    assert step.verdict.blocked and released == "ok "
    assert max_held <= 4 + 50 + 1


@pytest.mark.parametrize("seed", range(10))
def test_streamed_redaction_equals_whole_text_redaction(seed):
    from guardrails.detectors.pii import detect, redact

    actions = {EntityType.EMAIL: RuleAction.REDACT, EntityType.PHONE: RuleAction.REDACT}
    rng = random.Random(seed)
    parts = ["Contact ", "jane.roe@example.org", " or ", "+31 6 12345678", " and ", "bob@mail.example.com", ". Bye"]
    text = " filler words".join(parts) * 2
    deltas, i = [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        deltas.append(text[i : i + n])
        i += n
    guard = StreamGuard([PiiOutputCheck(actions)], window_chars=rng.randint(4, 64))
    released, step, _ = stream(guard, deltas)
    assert released == redact(text, detect(text), actions)
    assert step.verdict.redacted


def test_card_after_long_prefix_is_not_leaked_digit_by_digit():
    guard = StreamGuard.from_policy(load_policy({"output": {"holdback_chars": 8}}))
    text = "Here is a long and friendly preamble about payment methods and safety. " * 3
    text += "The number is 4111 1111 1111 1111 and more."
    released, step, _ = stream(guard, list(text))
    assert step.verdict.blocked and "4111" not in released and len(released) > 100


def test_disabled_output_rail_releases_immediately():
    guard = StreamGuard.from_policy(load_policy({"output": {"enabled": False}}))
    assert guard.push("card 4111 1111 1111 1111").text == "card 4111 1111 1111 1111"
    assert guard.finish().text == "" and guard.verdict.allowed


def test_pattern_check_runs_on_re2_and_escapes_literals():
    from guardrails.detectors.linear_regex import Pattern

    check = PatternCheck(
        [ForbiddenPattern(pattern="a.b*(c)"), ForbiddenPattern(pattern=r"id-\d+", regex=True, ignore_case=False)]
    )
    assert all(isinstance(p, Pattern) for p, _ in check._compiled)
    text = "ü axbbc A.B*(C) id-12 ID-34"
    assert [(text[m.start : m.end], m.label) for m in check.scan(text)] == [
        ("A.B*(C)", "pattern 0"),
        ("id-12", "pattern 1"),
    ]


def test_pattern_check_literal_folds_case_like_re():
    check = PatternCheck([ForbiddenPattern(pattern="project titan")])
    for text in ("PROJECT TITAN", "project tİtan", "Project Tıtan"):
        assert [(m.start, m.end) for m in check.scan(f"é {text}!")] == [(2, 15)], text


def test_pattern_check_survives_text_utf8_cannot_encode():
    check = PatternCheck([ForbiddenPattern(pattern="secret")])
    assert [(m.start, m.end) for m in check.scan("\ud800 secret")] == [(2, 8)]
