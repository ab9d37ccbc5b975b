from guardrails.verdict import Action, PolicyCode, Verdict, combine, run_sequence


def test_combine_first_block_wins():
    first = Verdict.block("pii", PolicyCode.PII_BLOCKED, "detected credit_card")
    second = Verdict.block("injection", PolicyCode.PROMPT_INJECTION, "heuristic")
    result = combine([Verdict.allow("limits"), first, second])
    assert result is first


def test_combine_all_allowed():
    assert combine([Verdict.allow("a"), Verdict.allow("b")]).action is Action.ALLOWED


def test_combine_redactions_keep_last_text_and_name_all_rails():
    a = Verdict.redact("pii", "call <PHONE> now", "redacted phone")
    b = Verdict.redact("custom", "call <PHONE> today", "redacted word")
    result = combine([a, Verdict.allow("x"), b])
    assert result.redacted
    assert result.text == "call <PHONE> today"
    assert result.rail == "pii+custom"


def test_run_sequence_feeds_redactions_forward_and_stops_at_block():
    calls = []

    def redact_digits(text):
        calls.append(text)
        return Verdict.redact("digits", text.replace("5", "#"), "digits")

    def redact_words(text):
        calls.append(text)
        return Verdict.redact("words", text.replace("call", "ring"), "words")

    def block(text):
        calls.append(text)
        return Verdict.block("stop", PolicyCode.DENIED_TOPIC, "stop")

    def never(text):  # pragma: no cover - must not run
        raise AssertionError("ran after a block")

    ok = run_sequence("call 555", [redact_digits, redact_words])
    assert ok.text == "ring ###"
    assert calls == ["call 555", "call ###"]
    blocked = run_sequence("call 555", [redact_digits, block, never])
    assert blocked.blocked and blocked.rail == "stop"


def test_verdict_is_immutable():
    verdict = Verdict.allow("x")
    try:
        verdict.rail = "y"  # type: ignore[misc]
    except AttributeError:
        return
    raise AssertionError("Verdict should be frozen")
