"""PII and secret detection by regular expression plus checksum.

Patterns find candidates; a validator (Luhn, ISO 13616 mod-97, SSN area rules, the Dutch 11-proof,
the Spanish DNI/NIE control letter, octet ranges) rejects the look-alikes. No model is involved, so
this runs on every request and every streamed window.

National ids covered: US Social Security Number, Dutch BSN (burgerservicenummer, needs a nearby
keyword because any 9 digits pass the 11-proof one time in 11), Spanish DNI and NIE.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

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
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29,
    "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28, "EE": 20, "EG": 29,
    "ES": 24, "FI": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28,
    "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20,
    "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19,
    "MR": 27, "MT": 31, "MU": 30, "NL": 18, "NO": 15, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29,
    "RO": 24, "RS": 22, "SA": 24, "SC": 31, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28,
    "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
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
    if re.fullmatch(r"\d{3}-\d{2}-\d{4}", candidate):
        return False  # SSN-shaped; the SSN rule owns it
    digits = re.sub(r"\D", "", candidate)
    if candidate.startswith("+"):
        return 8 <= len(digits) <= 15  # E.164 allows at most 15 digits
    return 9 <= len(digits) <= 11


# --- patterns ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Rule:
    entity: EntityType
    pattern: re.Pattern[str]
    kind: str = ""
    # Receives the match with separators stripped where relevant; None means the regex is enough.
    validate: Callable[[str], bool] | None = None
    strip: str = ""
    group: int = 0


def _digits(text: str) -> str:
    return re.sub(r"\D", "", text)


_RULES: tuple[_Rule, ...] = (
    _Rule(
        EntityType.PRIVATE_KEY,
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----(?:.*?-----END [A-Z0-9 ]+-----|.*\Z)", re.DOTALL
        ),
        "pem",
    ),
    _Rule(
        EntityType.API_KEY,
        re.compile(r"(?<![\w-])sk-(?:proj-|svcacct-|admin-|ant-)?[A-Za-z0-9_-]{20,256}"),
        "openai",
    ),
    _Rule(EntityType.API_KEY, re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b"), "aws_access_key_id"),
    _Rule(
        EntityType.API_KEY,
        re.compile(r"(?i)aws_secret_access_key\s*[:=]\s*[\"']?([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])"),
        "aws_secret_access_key",
        group=1,
    ),
    _Rule(EntityType.API_KEY, re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b"), "github"),
    _Rule(EntityType.API_KEY, re.compile(r"\bgithub_pat_[A-Za-z0-9_]{22,255}\b"), "github"),
    _Rule(EntityType.API_KEY, re.compile(r"\bxox[bpas]-[A-Za-z0-9-]{10,255}"), "slack"),
    _Rule(EntityType.API_KEY, re.compile(r"\bAIza[0-9A-Za-z_-]{35}(?![\w-])"), "google"),
    _Rule(
        EntityType.API_KEY,
        re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"),
        "jwt",
    ),
    _Rule(
        EntityType.EMAIL,
        re.compile(
            r"(?<![\w.%+-])[A-Za-z0-9](?:[A-Za-z0-9._%+-]{0,62}[A-Za-z0-9_%+-])?"
            r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}(?![\w-])"
        ),
    ),
    _Rule(
        EntityType.IBAN,
        re.compile(r"(?<![A-Za-z0-9])[A-Za-z]{2}\d{2}(?: ?[A-Za-z0-9]){11,30}(?![A-Za-z0-9])"),
        validate=iban_valid,
        strip=" ",
    ),
    _Rule(
        EntityType.CREDIT_CARD,
        re.compile(r"(?<![\d.-])\d(?:[ -]?\d){12,18}(?![\d-]|\.\d)"),
        validate=_card_valid,
        strip=" -",
    ),
    _Rule(EntityType.US_SSN, re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])"), validate=ssn_valid, strip="-"),
    _Rule(
        EntityType.NL_BSN,
        re.compile(r"(?i)\b(?:bsn|burgerservicenummer|sofinummer)\b\D{0,30}?(\d{4}\.?\d{2}\.?\d{3}|\d{8,9})(?![\d.])"),
        validate=bsn_valid,
        strip=".",
        group=1,
    ),
    _Rule(
        EntityType.ES_NIF,
        re.compile(r"(?<![\w-])(?:\d{8}|[XYZxyz][- ]?\d{7})[- ]?[A-Za-z](?![\w-])"),
        validate=nif_valid,
        strip=" -",
    ),
    _Rule(
        EntityType.IP_ADDRESS,
        re.compile(
            r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\w]|\.\d)"
        ),
        "ipv4",
    ),
    _Rule(
        EntityType.IP_ADDRESS,
        re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])"),
        "ipv6",
        validate=_ipv6_valid,
    ),
    _Rule(
        EntityType.PHONE,
        # International: +CC then groups separated by space, dot or dash, optional (area) part.
        re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}){2,6}(?![\d]|[.-]\d)"),
        validate=_phone_valid,
    ),
    _Rule(
        EntityType.PHONE,
        # North American: (415) 555-2671, 415-555-2671, 415.555.2671.
        re.compile(r"(?<![\w(.-])(?:\(\d{3}\) ?|\d{3}[-. ])\d{3}[-. ]\d{4}(?![\d]|[.-]\d)"),
        validate=_phone_valid,
    ),
    _Rule(
        EntityType.PHONE,
        # European national trunk prefix 0: 020 7946 0958, 06-12345678, 030 1234567, 01 23 45 67 89.
        re.compile(r"(?<![\w.+/-])0[1-9]\d{0,3}(?:[ -]?\d{2,4}){1,4}(?![\d]|[./-]\d)"),
        validate=_phone_valid,
    ),
)

# Earlier entities win when two findings cover the same span (a card number is not also a phone).
_PRIORITY = {entity: i for i, entity in enumerate(EntityType)}


def detect(text: str, entities: Iterable[EntityType] | None = None) -> list[PiiFinding]:
    """Find PII and secrets in `text`, sorted by position, overlapping findings resolved to the longest."""
    wanted = set(EntityType) if entities is None else set(entities)
    found: list[PiiFinding] = []
    for rule in _RULES:
        if rule.entity not in wanted:
            continue
        for match in rule.pattern.finditer(text):
            start, end = match.span(rule.group)
            if rule.entity is EntityType.IBAN:
                finding = _iban_finding(text, start, end)
                if finding:
                    found.append(finding)
                continue
            value = match.group(rule.group)
            if rule.strip:
                value = re.sub(f"[{re.escape(rule.strip)}]", "", value)
            if rule.validate is None or rule.validate(value):
                found.append(PiiFinding(rule.entity, start, end, rule.kind))
    return _resolve_overlaps(found)


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
    """Detect and decide in one call; entities whose action is ALLOW are not even searched for."""
    wanted = [e for e, a in actions.items() if a is not RuleAction.ALLOW]
    return pii_verdict(text, detect(text, wanted), actions, rail)
