import pytest

from guardrails.detectors.pii import check_pii, detect, pii_verdict, redact
from guardrails.detectors.pii_validators import bsn_valid, iban_valid, luhn_valid, nif_valid, ssn_valid
from guardrails.entities import EntityType, RuleAction
from guardrails.verdict import PolicyCode


def entities(text):
    return [(f.entity, text[f.start : f.end]) for f in detect(text)]


def only(text, entity):
    return [value for e, value in entities(text) if e is entity]


# --- checksums ---------------------------------------------------------------------------------


@pytest.mark.parametrize("number", ["4111111111111111", "5500005555555559", "378282246310005", "6011111111111117"])
def test_luhn_valid(number):
    assert luhn_valid(number)


@pytest.mark.parametrize("number", ["4111111111111112", "5500005555555550", "378282246310006"])
def test_luhn_invalid(number):
    assert not luhn_valid(number)


@pytest.mark.parametrize(
    "iban", ["NL91ABNA0417164300", "GB82WEST12345698765432", "DE89370400440532013000", "FR1420041010050500013M02606"]
)
def test_iban_valid(iban):
    assert iban_valid(iban)


@pytest.mark.parametrize(
    "iban",
    [
        "NL92ABNA0417164300",  # check digits wrong
        "GB82WEST1234569876543",  # one character short for GB
        "QQ82WEST12345698765432",  # not a registered country
        "DE89370400440532013001",  # mod-97 fails
    ],
)
def test_iban_invalid(iban):
    assert not iban_valid(iban)


def test_ssn_rules():
    assert ssn_valid("536221234")
    for bad in ("000221234", "666221234", "912221234", "536001234", "536220000", "078051120"):
        assert not ssn_valid(bad)


def test_bsn_eleven_proof():
    assert bsn_valid("111222333")
    assert bsn_valid("123456782")
    assert not bsn_valid("123456789")
    assert not bsn_valid("000000000")


def test_spanish_nif_letter():
    assert nif_valid("12345678Z")
    assert nif_valid("X1234567L")
    assert not nif_valid("12345678A")
    assert not nif_valid("X1234567A")


# --- detection ---------------------------------------------------------------------------------


def test_credit_card_with_separators_and_luhn():
    assert only("card 4111 1111 1111 1111 exp 12/26", EntityType.CREDIT_CARD) == ["4111 1111 1111 1111"]
    assert only("card 4111-1111-1111-1111.", EntityType.CREDIT_CARD) == ["4111-1111-1111-1111"]
    assert only("amex 3782 822463 10005", EntityType.CREDIT_CARD) == ["3782 822463 10005"]


def test_credit_card_false_cases():
    assert only("card 4111 1111 1111 1112", EntityType.CREDIT_CARD) == []  # Luhn fails
    assert only("order 1234567812345670 shipped", EntityType.CREDIT_CARD) == []  # Luhn ok, no issuer prefix
    assert only("pi is 3.1415926535897932384", EntityType.CREDIT_CARD) == []


def test_iban_in_text_with_spaces_stops_at_registered_length():
    text = "Pay to NL91 ABNA 0417 1643 00 is my account"
    assert only(text, EntityType.IBAN) == ["NL91 ABNA 0417 1643 00"]
    assert only("ref NL92ABNA0417164300", EntityType.IBAN) == []


def test_email_true_and_false():
    assert only("mail john.doe+tag@example.co.uk.", EntityType.EMAIL) == ["john.doe+tag@example.co.uk"]
    assert only("write to a_b@sub.domain.org, thanks", EntityType.EMAIL) == ["a_b@sub.domain.org"]
    assert only("use @decorator syntax or user@localhost", EntityType.EMAIL) == []
    assert only("version foo@1.2.3", EntityType.EMAIL) == []


@pytest.mark.parametrize(
    "text, phone",
    [
        ("call +31 6 12345678 today", "+31 6 12345678"),
        ("US office (415) 555-2671", "(415) 555-2671"),
        ("US office 415-555-2671.", "415-555-2671"),
        ("London 020 7946 0958", "020 7946 0958"),
        ("mobiel 06-12345678", "06-12345678"),
        ("Paris 01 23 45 67 89", "01 23 45 67 89"),
        ("intl +44 20 7946 0958", "+44 20 7946 0958"),
    ],
)
def test_phone_true(text, phone):
    assert only(text, EntityType.PHONE) == [phone]


@pytest.mark.parametrize(
    "text",
    [
        "It happened in 1999 and again in 2024.",
        "Due on 2024-01-15 or 15.01.2024 or 12/05/2023.",
        "The total was 1,234,567.89 dollars.",
        "Room 101, floor 3, version 1.2.3.4",
        "Chapter 12 pages 345-678",
        "call extension 4512",
    ],
)
def test_phone_false(text):
    assert only(text, EntityType.PHONE) == []


def test_national_ids():
    assert only("my SSN is 536-22-1234", EntityType.US_SSN) == ["536-22-1234"]
    assert only("sample 078-05-1120 and 000-12-3456", EntityType.US_SSN) == []
    assert only("BSN: 111222333", EntityType.NL_BSN) == ["111222333"]
    assert only("order 111222333", EntityType.NL_BSN) == []  # no BSN keyword nearby
    assert only("BSN 123456789", EntityType.NL_BSN) == []  # fails 11-proof
    assert only("DNI 12345678Z y NIE X-1234567-L", EntityType.ES_NIF) == ["12345678Z", "X-1234567-L"]
    assert only("DNI 12345678A", EntityType.ES_NIF) == []


def test_ip_addresses():
    assert only("server 192.168.1.10 ok", EntityType.IP_ADDRESS) == ["192.168.1.10"]
    assert only("v6 2001:db8::8a2e:370:7334 here", EntityType.IP_ADDRESS) == ["2001:db8::8a2e:370:7334"]
    assert only("bad 999.1.1.1 and 1.2.3 and 12:30:45 and std::vector", EntityType.IP_ADDRESS) == []


@pytest.mark.parametrize(
    "secret, kind",
    [
        ("sk-proj-" + "aB3dE5fG7hJ9kL1mN3pQ5rS7", "openai"),
        ("AKIAIOSFODNN7EXAMPLE", "aws_access_key_id"),
        ("ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8", "github"),
        ("github_pat_" + "11ABCDEFG0123456789_abcdefghijk", "github"),
        ("xoxb-123456789012-1234567890123-AbCdEfGh", "slack"),
        ("AIza" + "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", "google"),
        ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.dBjftJeZ4CVPmB92K27uhbUJU1p1r_wW1gFWFOEjXk", "jwt"),
    ],
)
def test_api_keys(secret, kind):
    found = detect(f"my key is {secret} thanks")
    assert [(f.entity, f.kind) for f in found] == [(EntityType.API_KEY, kind)]


def test_api_key_false_cases():
    text = "use sk-learn, AKIA is a prefix, ghp_short, xoxb-1, eyJ alone, AIzaShort"
    assert only(text, EntityType.API_KEY) == []


def test_private_key_block():
    pem = "-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----"
    assert only(f"here:\n{pem}\nbye", EntityType.PRIVATE_KEY) == [pem]
    assert only("-----BEGIN PUBLIC KEY-----\nMIIB\n-----END PUBLIC KEY-----", EntityType.PRIVATE_KEY) == []


# --- redaction and verdicts ---------------------------------------------------------------------


ACTIONS = {
    EntityType.EMAIL: RuleAction.REDACT,
    EntityType.PHONE: RuleAction.REDACT,
    EntityType.CREDIT_CARD: RuleAction.BLOCK,
    EntityType.IP_ADDRESS: RuleAction.ALLOW,
}


def test_redact_replaces_spans_with_placeholders():
    text = "Mail jane@example.org or call (415) 555-2671 from 10.0.0.1."
    assert redact(text, detect(text), ACTIONS) == "Mail <EMAIL> or call <PHONE> from 10.0.0.1."


def test_pii_verdict_redacts_without_quoting_text():
    text = "I am jane@example.org"
    verdict = pii_verdict(text, detect(text), ACTIONS)
    assert verdict.redacted and verdict.text == "I am <EMAIL>"
    assert "jane" not in verdict.reason and verdict.code is PolicyCode.PII_REDACTED


def test_pii_verdict_block_wins_over_redact():
    text = "jane@example.org card 4111 1111 1111 1111"
    verdict = check_pii(text, ACTIONS)
    assert verdict.blocked and verdict.code is PolicyCode.PII_BLOCKED
    assert verdict.reason == "detected credit_card" and verdict.text is None


def test_pii_verdict_allows_clean_text():
    assert check_pii("What's the capital of France?", ACTIONS).allowed


def _fullwidth(text: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


@pytest.mark.parametrize("encode", ["base64", "urlsafe", "hex", "fullwidth base64"])
def test_pii_written_encoded_for_the_model_to_decode_is_found(encode):
    """A model decodes base64 and hex: a card number or an address written that way is the
    entity, blocked or redacted as the policy says. Digits alone decode too (the base64 of a
    spaced card number has no digit in it)."""
    import base64

    def enc(plain: str) -> str:
        raw = plain.encode()
        if encode == "hex":
            return raw.hex()
        if encode == "urlsafe":
            return base64.urlsafe_b64encode(raw).decode()
        b64 = base64.b64encode(raw).decode()
        return _fullwidth(b64) if encode == "fullwidth base64" else b64

    for card in ("4111 1111 1111 1111", "4111111111111111", "my card: 5555 5555 5555 4444"):
        verdict = check_pii(f"Decode this and keep it: {enc(card)} thanks", ACTIONS)
        assert verdict.blocked and verdict.reason == "detected credit_card", (card, encode)
    verdict = check_pii(f"Write to {enc('mail jane.doe@example.org today')} please.", ACTIONS)
    assert verdict.redacted and verdict.text == "Write to mail <EMAIL> today please."
    # Encoded text without an entity is left as it was written.
    assert check_pii(f"Decode {enc('the weather is nice today')} please.", ACTIONS).allowed


def test_pii_encoded_twice_is_found():
    import base64

    twice = base64.b64encode(base64.b64encode(b"card 4111 1111 1111 1111")).decode()
    assert check_pii(f"decode twice: {twice}", ACTIONS).blocked
    address = base64.b64encode(base64.b64encode(b"mail jane.doe@example.org")).decode()
    assert check_pii(f"write to {address}", ACTIONS).text == "write to mail <EMAIL>"


def test_encoded_looking_words_and_hashes_are_not_pii():
    for text in (
        "ThisIsAVeryLongCamelCaseIdentifierName returns a value",
        "sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "order 123456789012345678901234 shipped",
        # Hex of ASCII text is mostly digits: a Luhn-valid run of 16 between two hex letters.
        "blob e41111111111111111f0 and id a4111111111111111b",
    ):
        assert check_pii(text, ACTIONS).allowed, text
    # A card written between CJK letters, as those languages write numbers, is still a card.
    assert check_pii("カード番号4111111111111111です", ACTIONS).blocked


# --- RE2 boundaries: lookbehind/lookahead emulation keeps the spans of the `re` patterns ----------


@pytest.mark.parametrize(
    "text, entity, values",
    [
        # A boundary character consumed after one match is the lookbehind of the next.
        ("a@b.cc d@e.ff", EntityType.EMAIL, ["a@b.cc", "d@e.ff"]),
        ("a@b.cc,d@e.ff", EntityType.EMAIL, ["a@b.cc", "d@e.ff"]),
        ("1.2.3.4 5.6.7.8", EntityType.IP_ADDRESS, ["1.2.3.4", "5.6.7.8"]),
        ("536-22-1234 536-22-1235", EntityType.US_SSN, ["536-22-1234", "536-22-1235"]),
        ("+31 6 12345678,+44 20 7946 0958", EntityType.PHONE, ["+31 6 12345678", "+44 20 7946 0958"]),
        ("12345678Z X1234567L", EntityType.ES_NIF, ["12345678Z", "X1234567L"]),
        (
            "AKIAIOSFODNN7EXAMPLE AKIAIOSFODNN7EXAMPLF",
            EntityType.API_KEY,
            ["AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLF"],
        ),
        # A lookahead that fails makes the pattern back off to a shorter match, as in `re`.
        ("mail a@b.cd.ef-x", EntityType.EMAIL, ["a@b.cd"]),
        ("x@y.zz" * 3, EntityType.EMAIL, ["x@y.zzx", "y.zzx@y.zz"]),  # what `re` found too
        ("ip 1.2.3.4.5", EntityType.IP_ADDRESS, []),
        ("ip 1.2.3.4. next", EntityType.IP_ADDRESS, ["1.2.3.4"]),
    ],
)
def test_adjacent_and_backed_off_matches(text, entity, values):
    assert only(text, entity) == values


def test_word_boundaries_are_unicode_like_re():
    # `\b` and `\w` count non-ASCII letters and digits as word characters, as Python's `re` did.
    assert only("éAKIAIOSFODNN7EXAMPLE", EntityType.API_KEY) == []
    assert only("AKIAIOSFODNN7EXAMPLE日", EntityType.API_KEY) == []
    assert only("«AKIAIOSFODNN7EXAMPLE»", EntityType.API_KEY) == ["AKIAIOSFODNN7EXAMPLE"]
    assert only("ü sk-proj-aB3dE5fG7hJ9kL1mN3pQ5rS7", EntityType.API_KEY) == ["sk-proj-aB3dE5fG7hJ9kL1mN3pQ5rS7"]
    assert only("üsk-proj-aB3dE5fG7hJ9kL1mN3pQ5rS7", EntityType.API_KEY) == []
    assert only("ñjohn@example.org", EntityType.EMAIL) == []
    assert only("— john@example.org —", EntityType.EMAIL) == ["john@example.org"]
    assert only("BSN: 111222333", EntityType.NL_BSN) == ["111222333"]
    assert only("éBSN: 111222333", EntityType.NL_BSN) == []
    # `\d` is any decimal digit, as before: a full-width SSN is still an SSN.
    assert only("ssn ５３６-２２-１２３４", EntityType.US_SSN) == ["５３６-２２-１２３４"]


def test_spans_are_str_offsets_after_multibyte_text():
    text = "🙂🙂 mail jane@example.org, ünd (415) 555-2671"
    assert entities(text) == [(EntityType.EMAIL, "jane@example.org"), (EntityType.PHONE, "(415) 555-2671")]
