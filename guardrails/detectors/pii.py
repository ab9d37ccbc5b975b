"""PII and secret detection by regular expression plus checksum.

Patterns find candidates; a validator (Luhn, ISO 13616 mod-97, SSN area rules, the Dutch 11-proof,
the Spanish DNI/NIE control letter, octet ranges) rejects the look-alikes. No model is involved, so
this runs on every request and every streamed window. The patterns run on RE2, whose time is linear
in the text whatever the text holds.

National ids covered: US Social Security Number, Dutch BSN (burgerservicenummer, needs a nearby
keyword because any 9 digits pass the 11-proof one time in 11), Spanish DNI and NIE.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from guardrails.detectors import linear_regex as lrx
from guardrails.detectors import partial_regex
from guardrails.detectors.pii_validators import (
    IBAN_LENGTHS,
    bsn_valid,
    card_valid,
    iban_valid,
    ipv6_valid,
    nif_valid,
    phone_valid,
    ssn_valid,
)
from guardrails.detectors.text_fold import MAX_DECODE_DEPTH, decoded_runs
from guardrails.entities import EntityType, RuleAction
from guardrails.verdict import PolicyCode, Verdict


@dataclass(frozen=True, slots=True)
class PiiFinding:
    """One detected entity: `text[start:end]`. `kind` refines the entity (e.g. "github" for API_KEY)."""

    entity: EntityType
    start: int
    end: int
    kind: str = ""


# --- patterns ---------------------------------------------------------------------------------
#
# RE2 (linear time) spelling of the former `re` patterns; see `linear_regex` for the conventions.
# Each pattern is LEAD(BODY)TRAIL: LEAD is the one character a lookbehind `(?<!X)` inspected
# (`[^X]`; `_ANY` where there was none), group 1 is what `re` matched, TRAIL stands for the
# lookahead. `\d`/`\D` are `\p{Nd}`/`\P{Nd}` and `\w` is `[\p{L}\p{N}_]`, like Python's Unicode
# classes; `\b` next to a word character is a lookbehind/lookahead on `\w`.

_ANY = r"(?s:.)"
_W = lrx.WORD
_D = lrx.DIGIT
# [A-Za-z0-9/+] under re.IGNORECASE: also long s, Kelvin sign, dotted and dotless i.
_B64_CI = r"A-Za-z0-9/+\x{17f}\x{212a}\x{130}\x{131}"
_S = f"[{lrx.SPACE}]"
_OCTET = r"(?:25[0-5]|2[0-4]\p{Nd}|1\p{Nd}\p{Nd}|[1-9]?\p{Nd})"
# (?![\d]|[.-]\d) after an international or North American number.
_PHONE_END = r"(?:\z|[^\p{Nd}.-]|[.-](?:\z|\P{Nd}))"


def _rx(lead: str, body: str, trail: str = "") -> lrx.Pattern:
    return lrx.compile(f"{lead}({body}){trail}")


@dataclass(frozen=True, slots=True)
class _Rule:
    entity: EntityType
    pattern: lrx.Pattern
    kind: str = ""
    # Receives the match with separators stripped where relevant; None means the regex is enough.
    validate: Callable[[str], bool] | None = None
    strip: str = ""
    # Capturing group of the original pattern that is the entity (0: the whole match).
    group: int = 0

    @property
    def strip_table(self) -> dict[int, None]:
        return str.maketrans("", "", self.strip)


_RULES: tuple[_Rule, ...] = (
    _Rule(
        EntityType.PRIVATE_KEY,
        _rx(
            _ANY,
            r"(?s:-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----(?:.*?-----END [A-Z0-9 ]+-----|.*\z))",
        ),
        "pem",
    ),
    _Rule(
        EntityType.API_KEY,
        _rx(f"[^{_W}-]", r"sk-(?:proj-|svcacct-|admin-|ant-)?[A-Za-z0-9_-]{20,256}"),
        "openai",
    ),
    _Rule(
        EntityType.API_KEY,
        _rx(f"[^{_W}]", r"(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}", rf"(?:\z|[^{_W}])"),
        "aws_access_key_id",
    ),
    _Rule(
        EntityType.API_KEY,
        _rx(
            _ANY,
            lrx.ci("aws_secret_access_key") + rf"{_S}*[:=]{_S}*[\"']?([{_B64_CI}]{{40}})",
            rf"(?:\z|[^{_B64_CI}])",
        ),
        "aws_secret_access_key",
        group=1,
    ),
    _Rule(EntityType.API_KEY, _rx(f"[^{_W}]", r"gh[pousr]_[A-Za-z0-9]{36,255}", rf"(?:\z|[^{_W}])"), "github"),
    _Rule(EntityType.API_KEY, _rx(f"[^{_W}]", r"github_pat_[A-Za-z0-9_]{22,255}", rf"(?:\z|[^{_W}])"), "github"),
    _Rule(EntityType.API_KEY, _rx(f"[^{_W}]", r"xox[bpas]-[A-Za-z0-9-]{10,255}"), "slack"),
    _Rule(EntityType.API_KEY, _rx(f"[^{_W}]", r"AIza[0-9A-Za-z_-]{35}", rf"(?:\z|[^{_W}-])"), "google"),
    _Rule(
        EntityType.API_KEY,
        _rx(f"[^{_W}]", r"eyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"),
        "jwt",
    ),
    _Rule(
        EntityType.EMAIL,
        _rx(
            f"[^{_W}.%+-]",
            r"[A-Za-z0-9](?:[A-Za-z0-9._%+-]{0,62}[A-Za-z0-9_%+-])?"
            r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}",
            rf"(?:\z|[^{_W}-])",
        ),
    ),
    _Rule(
        EntityType.IBAN,
        _rx("[^A-Za-z0-9]", r"[A-Za-z]{2}\p{Nd}{2}(?: ?[A-Za-z0-9]){11,30}", r"(?:\z|[^A-Za-z0-9])"),
        validate=iban_valid,
        strip=" ",
    ),
    _Rule(
        EntityType.CREDIT_CARD,
        # Not glued to Latin letters: digits inside a hex run (a hash, hex-encoded text) or an
        # identifier are not a card; CJK text, which writes numbers between its letters, is.
        _rx(f"[^{_D}A-Za-z.-]", r"\p{Nd}(?:[ -]?\p{Nd}){12,18}", r"(?:\z|[^\p{Nd}A-Za-z.-]|\.(?:\z|\P{Nd}))"),
        validate=card_valid,
        strip=" -",
    ),
    _Rule(
        EntityType.US_SSN,
        _rx(f"[^{_D}-]", r"\p{Nd}{3}-\p{Nd}{2}-\p{Nd}{4}", r"(?:\z|[^\p{Nd}-])"),
        validate=ssn_valid,
        strip="-",
    ),
    _Rule(
        EntityType.NL_BSN,
        # `\b\D{0,30}?` after the keyword: the first non-digit must be a non-word character.
        _rx(
            f"[^{_W}]",
            "(?:" + "|".join(lrx.ci(k) for k in ("bsn", "burgerservicenummer", "sofinummer")) + ")"
            rf"[^{_W}]\P{{Nd}}{{0,29}}?(\p{{Nd}}{{4}}\.?\p{{Nd}}{{2}}\.?\p{{Nd}}{{3}}|\p{{Nd}}{{8,9}})",
            r"(?:\z|[^\p{Nd}.])",
        ),
        validate=bsn_valid,
        strip=".",
        group=1,
    ),
    _Rule(
        EntityType.ES_NIF,
        _rx(f"[^{_W}-]", r"(?:\p{Nd}{8}|[XYZxyz][- ]?\p{Nd}{7})[- ]?[A-Za-z]", rf"(?:\z|[^{_W}-])"),
        validate=nif_valid,
        strip=" -",
    ),
    _Rule(
        EntityType.IP_ADDRESS,
        _rx(f"[^{_W}.]", rf"(?:{_OCTET}\.){{3}}{_OCTET}", rf"(?:\z|[^{_W}.]|\.(?:\z|\P{{Nd}}))"),
        "ipv4",
    ),
    _Rule(
        EntityType.IP_ADDRESS,
        _rx(f"[^{_W}:]", r"(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}", rf"(?:\z|[^{_W}:])"),
        "ipv6",
        validate=ipv6_valid,
    ),
    _Rule(
        EntityType.PHONE,
        # International: +CC then groups separated by space, dot or dash, optional (area) part.
        _rx(f"[^{_W}+]", r"\+\p{Nd}{1,3}(?:[ .-]?\(\p{Nd}{1,4}\))?(?:[ .-]?\p{Nd}{1,5}){2,6}", _PHONE_END),
        validate=phone_valid,
    ),
    _Rule(
        EntityType.PHONE,
        # North American: (415) 555-2671, 415-555-2671, 415.555.2671.
        _rx(f"[^{_W}(.-]", r"(?:\(\p{Nd}{3}\) ?|\p{Nd}{3}[-. ])\p{Nd}{3}[-. ]\p{Nd}{4}", _PHONE_END),
        validate=phone_valid,
    ),
    _Rule(
        EntityType.PHONE,
        # European national trunk prefix 0: 020 7946 0958, 06-12345678, 030 1234567, 01 23 45 67 89.
        _rx(
            f"[^{_W}.+/-]",
            r"0[1-9]\p{Nd}{0,3}(?:[ -]?\p{Nd}{2,4}){1,4}",
            r"(?:\z|[^\p{Nd}./-]|[./-](?:\z|\P{Nd}))",
        ),
        validate=phone_valid,
    ),
)

# Earlier entities win when two findings cover the same span (a card number is not also a phone).
_PRIORITY = {entity: i for i, entity in enumerate(EntityType)}


def detect(text: str, entities: Iterable[EntityType] | None = None) -> list[PiiFinding]:
    """Find PII and secrets in `text`, sorted by position, overlapping findings resolved to the longest."""
    wanted = frozenset(EntityType) if entities is None else frozenset(entities)
    found: list[PiiFinding] = []
    subject = lrx.lead_subject(text)
    any_rule = _any_rule(wanted)
    if any_rule is None or not lrx.found_in(any_rule, subject):
        return found  # no rule matches anywhere: one search instead of one per rule
    for rule in _RULES:
        if rule.entity not in wanted:
            continue
        # Group 1 of the RE2 pattern is the original match, group g + 1 the original group g.
        for start, end in lrx.finditer_spans(rule.pattern, subject, rule.group + 1):
            if rule.entity is EntityType.IBAN:
                finding = _iban_finding(text, start, end)
                if finding:
                    found.append(finding)
                continue
            value = text[start:end]
            if rule.strip:
                value = value.translate(rule.strip_table)
            if rule.validate is None or rule.validate(value):
                found.append(PiiFinding(rule.entity, start, end, rule.kind))
    return _resolve_overlaps(found)


# RE2's budget for the DFA cache of the patterns below, which hold many rules each: with the
# default (8 MB) a union kept refilling its cache (25-300 us a search against about 1 us); RE2
# takes the memory as the cache grows, not up front.
_UNION_MAX_MEM = 32 << 20


@functools.cache
def _open_tails() -> dict[EntityType, lrx.Pattern]:
    """Per entity, the open tail (partial matching) of all its rules at once. Compiled on first
    use, once per process. One pattern per entity, not one for every rule: the union of all of
    them (phone numbers' optional groups beside the rest) made RE2's DFA blow up on noisy text."""
    tails = {}
    for entity in EntityType:
        sources = [rule.pattern.pattern for rule in _RULES if rule.entity is entity]
        if sources:
            union = "|".join(f"(?:{source})" for source in sources)
            tails[entity] = partial_regex.compile_open_tail(union, max_mem=_UNION_MAX_MEM)
    return tails


@functools.cache
def _any_rule(entities: frozenset[EntityType]) -> lrx.Pattern | None:
    """One pattern matching wherever a rule of ``entities`` matches: ``detect`` skips a text it
    does not match with one search instead of one per rule (a stream checks every chunk)."""
    sources = [rule.pattern.pattern for rule in _RULES if rule.entity in entities]
    if not sources:
        return None
    return lrx.compile("|".join(f"(?:{source})" for source in sources), max_mem=_UNION_MAX_MEM)


def possible_match_start(text: str, entities: Iterable[EntityType] | None = None, start: int = 0) -> int:
    """Earliest offset >= `start` at which an entity could begin that more text might complete.

    `text[result:]` is a prefix of a match of some rule's pattern (with its boundary character
    before it), so a stream must hold it back; everything before `result` can become part of an
    entity only through matches `detect` already sees. ``len(text)`` when nothing is open. Partial
    matching on RE2 (`partial_regex`): linear in ``len(text) - start``. Validators (Luhn, mod-97)
    are not consulted: a candidate that may still grow is held whether or not it validates yet.
    """
    if start >= len(text):
        return len(text)
    wanted = frozenset(EntityType) if entities is None else frozenset(entities)
    subject = lrx.lead_subject(text)
    # Every rule's pattern consumes the character before the entity (its LEAD): search from the
    # character before `start`, or from the NUL in front of the text.
    lead = 0 if start == 0 else 1 + len(lrx.to_utf8(text[: start - 1]))
    best = len(subject)
    for entity, tail in _open_tails().items():
        if entity in wanted:
            best = min(best, partial_regex.open_tail_start(tail, subject, lead))
    if best >= len(subject):
        return len(text)
    # The match starts with its LEAD character; the entity begins one character later.
    return start + len(subject[lead:best].decode("utf-8"))


def _iban_finding(text: str, start: int, end: int) -> PiiFinding | None:
    # The pattern may run into a following word ("... 00 is mine"); cut the candidate to the
    # registered length for its country before checking.
    compact_positions = [i for i in range(start, end) if text[i] != " "]
    country = text[start : start + 2].upper()
    length = IBAN_LENGTHS.get(country)
    if length is None or len(compact_positions) < length:
        return None
    positions = compact_positions[:length]
    candidate = "".join(text[i] for i in positions)
    after = positions[-1] + 1
    # Must not stop in the middle of an alphanumeric run.
    if after < len(text) and text[after].isalnum():
        return None
    if not iban_valid(candidate):
        return None
    return PiiFinding(EntityType.IBAN, start, after)


def _resolve_overlaps(findings: list[PiiFinding]) -> list[PiiFinding]:
    ordered = sorted(findings, key=lambda f: (f.start, -(f.end - f.start), _PRIORITY[f.entity]))
    kept: list[PiiFinding] = []
    for finding in ordered:
        if kept and finding.start < kept[-1].end:
            continue
        kept.append(finding)
    return kept


def redact(text: str, findings: Sequence[PiiFinding], actions: Mapping[EntityType, RuleAction]) -> str:
    """Replace every finding whose action is not ALLOW with its placeholder, e.g. ``<EMAIL>``.

    Blocked entities are replaced too, so the result is safe to log or show in an audit trail.
    """
    out: list[str] = []
    pos = 0
    for finding in sorted(findings, key=lambda f: f.start):
        if actions.get(finding.entity, RuleAction.ALLOW) is RuleAction.ALLOW or finding.start < pos:
            continue
        out.append(text[pos : finding.start])
        out.append(finding.entity.placeholder)
        pos = finding.end
    out.append(text[pos:])
    return "".join(out)


def pii_verdict(
    text: str,
    findings: Sequence[PiiFinding],
    actions: Mapping[EntityType, RuleAction],
    rail: str = "pii",
) -> Verdict:
    """Turn findings into a verdict: any BLOCK entity blocks, else any REDACT entity redacts."""
    acted = {f.entity: actions.get(f.entity, RuleAction.ALLOW) for f in findings}
    blocked = sorted(e.value for e, a in acted.items() if a is RuleAction.BLOCK)
    if blocked:
        return Verdict.block(rail, PolicyCode.PII_BLOCKED, f"detected {', '.join(blocked)}")
    redacted = sorted(e.value for e, a in acted.items() if a is RuleAction.REDACT)
    if redacted:
        return Verdict.redact(rail, redact(text, findings, actions), f"redacted {', '.join(redacted)}")
    return Verdict.allow(rail)


def check_pii(text: str, actions: Mapping[EntityType, RuleAction], rail: str = "pii") -> Verdict:
    """Detect and decide in one call; entities whose action is ALLOW are not even searched for.

    A base64 or hex run that decodes to text carrying one of them (a card number written in
    base64 for the model to decode) counts as that text: the run is written out decoded, and
    the entity in it blocks or is redacted like any other (the redacted text then carries the
    decoded words, placeholders in place of the entities)."""
    wanted = [e for e, a in actions.items() if a is not RuleAction.ALLOW]
    if not wanted:
        return Verdict.allow(rail)
    text = _revealed(text, wanted)
    return pii_verdict(text, detect(text, wanted), actions, rail)


def _revealed(text: str, wanted: Sequence[EntityType], depth: int = 0) -> str:
    """``text`` with each encoded run whose decoded text (read down to ``MAX_DECODE_DEPTH``
    levels) carries a wanted entity written out decoded; other runs as they were."""
    for start, end, decoded in reversed(decoded_runs(text)):
        inner = _revealed(decoded, wanted, depth + 1) if depth + 1 < MAX_DECODE_DEPTH else decoded
        if detect(inner, wanted):
            text = text[:start] + inner + text[end:]
    return text
