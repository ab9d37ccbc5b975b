"""Vocabulary shared by the guardrail policy and the detectors.

Kept apart from both so that `config` (pydantic) and `detectors` (pure logic) can import it without
importing each other.
"""

from enum import StrEnum


class EntityType(StrEnum):
    """Kinds of sensitive data the PII detector recognises.

    The value is the key used in YAML policies; the upper-case name is the redaction placeholder.
    """

    EMAIL = "email"
    PHONE = "phone"
    CREDIT_CARD = "credit_card"
    IBAN = "iban"
    US_SSN = "us_ssn"
    NL_BSN = "nl_bsn"
    ES_NIF = "es_nif"
    IP_ADDRESS = "ip_address"
    API_KEY = "api_key"
    PRIVATE_KEY = "private_key"

    @property
    def placeholder(self) -> str:
        """Text that replaces a redacted span, e.g. ``<EMAIL>``."""
        return f"<{self.name}>"


class RuleAction(StrEnum):
    """What a policy says to do when a rule (PII entity, forbidden pattern) matches."""

    BLOCK = "block"
    REDACT = "redact"
    ALLOW = "allow"
