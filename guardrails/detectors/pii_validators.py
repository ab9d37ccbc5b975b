"""Checksums and range rules that tell real identifiers from look-alikes (pii.py's validators).

Luhn for payment cards, ISO 13616 mod-97 with the registry's lengths for IBANs, the SSA's area
rules for US SSNs, the 11-proof for Dutch BSNs, the control letter for Spanish DNI/NIE, and the
shape rules for IPv6 addresses and phone numbers.
"""

from __future__ import annotations

import ipaddress


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


def ipv6_valid(candidate: str) -> bool:
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    # "::" or "a::" alone are valid addresses but mostly C++/Rust path separators in chat.
    return sum(1 for group in candidate.split(":") if group) >= 3


def card_valid(digits: str) -> bool:
    # Issuer prefixes start with 2-6 (Mastercard 2-series, Amex/Diners/JCB, Visa, MC, Discover/UnionPay).
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn_valid(digits)


def phone_valid(candidate: str) -> bool:
    if len(candidate) == 11 and candidate[3] == candidate[6] == "-" and candidate.replace("-", "").isdecimal():
        return False  # SSN-shaped; the SSN rule owns it
    digits = "".join(ch for ch in candidate if ch.isdecimal())
    if candidate.startswith("+"):
        return 8 <= len(digits) <= 15  # E.164 allows at most 15 digits
    return 9 <= len(digits) <= 11
