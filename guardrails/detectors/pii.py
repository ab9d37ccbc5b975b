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
import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from guardrails.detectors import linear_regex as lrx
from guardrails.detectors import partial_regex
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


# --- validators -------------------------------------------------------------------------------


def luhn_valid(digits: str) -> bool:
    """Luhn (mod 10) check used by payment card numbers."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


# ISO 13616 registry lengths by country code.
IBAN_LENGTHS: dict[str, int] = {
    "AD": 24,
    "AE": 23,
    "AL": 28,
    "AT": 20,
    "AZ": 28,
    "BA": 20,
    "BE": 16,
    "BG": 22,
    "BH": 22,
    "BR": 29,
    "BY": 28,
    "CH": 21,
    "CR": 22,
    "CY": 28,
    "CZ": 24,
    "DE": 22,
    "DK": 18,
    "DO": 28,
    "EE": 20,
    "EG": 29,
    "ES": 24,
    "FI": 18,
    "FO": 18,
    "FR": 27,
    "GB": 22,
    "GE": 22,
    "GI": 23,
    "GL": 18,
    "GR": 27,
    "GT": 28,
    "HR": 21,
    "HU": 28,
    "IE": 22,
    "IL": 23,
    "IQ": 23,
    "IS": 26,
    "IT": 27,
    "JO": 30,
    "KW": 30,
    "KZ": 20,
    "LB": 28,
    "LC": 32,
    "LI": 21,
    "LT": 20,
    "LU": 20,
    "LV": 21,
    "MC": 27,
    "MD": 24,
    "ME": 22,
    "MK": 19,
    "MR": 27,
    "MT": 31,
    "MU": 30,
    "NL": 18,
    "NO": 15,
    "PK": 24,
    "PL": 28,
    "PS": 29,
    "PT": 25,
    "QA": 29,
    "RO": 24,
    "RS": 22,
    "SA": 24,
    "SC": 31,
    "SE": 24,
    "SI": 19,
    "SK": 24,
    "SM": 27,
    "ST": 25,
    "SV": 28,
    "TL": 23,
    "TN": 24,
    "TR": 26,
    "UA": 29,
    "VA": 22,
    "VG": 24,
    "XK": 20,
}


def iban_valid(iban: str) -> bool:
    """ISO 13616: known country, registered length, and mod-97 of the rearranged number equals 1."""
    iban = iban.upper()
    if IBAN_LENGTHS.get(iban[:2]) != len(iban) or not iban[2:4].isdigit() or not iban.isalnum():
        return False
    rearranged = iban[4:] + iban[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


def ssn_valid(ssn: str) -> bool:
    """US SSN structure rules: area not 000/666/9xx, group not 00, serial not 0000, not a known sample."""
    area, group, serial = ssn[:3], ssn[3:5], ssn[5:]
    if area in ("000", "666") or area[0] == "9" or group == "00" or serial == "0000":
        return False
    return ssn not in ("078051120", "219099999", "123456789")


def bsn_valid(bsn: str) -> bool:
    """Dutch BSN 11-proof: weights 9..2 and -1 on the last digit, sum divisible by 11 and non-zero."""
    if len(bsn) == 8:
        bsn = "0" + bsn
    if len(bsn) != 9 or not bsn.isdigit():
        return False
    total = sum(int(d) * w for d, w in zip(bsn[:8], range(9, 1, -1), strict=True)) - int(bsn[8])
    return total != 0 and total % 11 == 0


_NIF_LETTERS = "TRWAGMYFPDXBNJZSQVHLCKE"


def nif_valid(nif: str) -> bool:
    """Spanish DNI (8 digits + letter) or NIE (X/Y/Z + 7 digits + letter) control letter."""
    nif = nif.upper()
    if nif[0] in "XYZ":
        nif = str("XYZ".index(nif[0])) + nif[1:]
    number, letter = nif[:-1], nif[-1]
    return len(number) == 8 and number.isdigit() and _NIF_LETTERS[int(number) % 23] == letter


def _ipv6_valid(candidate: str) -> bool:
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    # "::" or "a::" alone are valid addresses but mostly C++/Rust path separators in chat.
    return sum(1 for group in candidate.split(":") if group) >= 3


def _card_valid(digits: str) -> bool:
    # Issuer prefixes start with 2-6 (Mastercard 2-series, Amex/Diners/JCB, Visa, MC, Discover/UnionPay).
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn_valid(digits)


def _phone_valid(candidate: str) -> bool:
    if len(candidate) == 11 and candidate[3] == candidate[6] == "-" and candidate.replace("-", "").isdecimal():
        return False  # SSN-shaped; the SSN rule owns it
    digits = "".join(ch for ch in candidate if ch.isdecimal())
    if candidate.startswith("+"):
        return 8 <= len(digits) <= 15  # E.164 allows at most 15 digits
    return 9 <= len(digits) <= 11


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
        validate=_card_valid,
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
        validate=_ipv6_valid,
    ),
    _Rule(
        EntityType.PHONE,
        # International: +CC then groups separated by space, dot or dash, optional (area) part.
        _rx(f"[^{_W}+]", r"\+\p{Nd}{1,3}(?:[ .-]?\(\p{Nd}{1,4}\))?(?:[ .-]?\p{Nd}{1,5}){2,6}", _PHONE_END),
        validate=_phone_valid,
    ),
    _Rule(
        EntityType.PHONE,
        # North American: (415) 555-2671, 415-555-2671, 415.555.2671.
        _rx(f"[^{_W}(.-]", r"(?:\(\p{Nd}{3}\) ?|\p{Nd}{3}[-. ])\p{Nd}{3}[-. ]\p{Nd}{4}", _PHONE_END),
        validate=_phone_valid,
    ),
    _Rule(
        EntityType.PHONE,
        # European national trunk prefix 0: 020 7946 0958, 06-12345678, 030 1234567, 01 23 45 67 89.
        _rx(
            f"[^{_W}.+/-]",
            r"0[1-9]\p{Nd}{0,3}(?:[ -]?\p{Nd}{2,4}){1,4}",
            r"(?:\z|[^\p{Nd}./-]|[./-](?:\z|\P{Nd}))",
        ),
        validate=_phone_valid,
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
