"""Who owns uploaded files and vector stores.

The gateway turns each request's principal into a ``Caller`` (``retrieval`` does not import
``gateway``). Every file and vector store records its owner string: ``"operator"`` for those made
with an admin key (the operator's shared stores, which a model's retrieval policy names and every
admin key manages), ``"principal:<name>"`` for anyone else's. Objects written before owners were
recorded belong to the operator.
"""

from __future__ import annotations

from dataclasses import dataclass

OPERATOR = "operator"
PRINCIPAL_PREFIX = "principal:"


@dataclass(frozen=True)
class Caller:
    """The principal a retrieval call acts for."""

    name: str
    admin: bool = False

    @property
    def owner(self) -> str:
        """The owner recorded on (and required of) the objects this caller touches."""
        return owner_of(self)


def owner_of(caller: Caller) -> str:
    if not isinstance(caller, Caller):
        # Fail closed: a missing or malformed caller must never match anyone's objects.
        raise TypeError(f"caller must be a retrieval.tenancy.Caller, not {type(caller).__name__}")
    return OPERATOR if caller.admin else PRINCIPAL_PREFIX + caller.name
