"""Attribute filters in OpenAI's shape (``ComparisonFilter`` / ``CompoundFilter``).

The HTTP layer can validate a request's ``filters`` straight into ``AttributeFilter``. Filters
are evaluated per document (attributes belong to a document, not a chunk), so their cost grows
with the number of documents, not of chunks.

Semantics: a missing key, or a value of another type than the filter's (numbers vs strings),
makes a comparison false, except ``ne`` and ``nin``, which are then true.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Scalar = str | float | int | bool
Attributes = Mapping[str, Scalar]


class ComparisonFilter(BaseModel):
    """Compare one attribute with a value."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["eq", "ne", "gt", "gte", "lt", "lte", "in", "nin"] = "eq"
    key: str
    value: Scalar | list[str | float | int]

    def matches(self, attributes: Attributes) -> bool:
        """True when the document's attributes satisfy this comparison."""
        negated = self.type in ("ne", "nin")
        if self.key not in attributes:
            return negated
        actual = attributes[self.key]
        if self.type in ("in", "nin"):
            values = self.value if isinstance(self.value, list) else [self.value]
            found = any(_same_kind(actual, v) and actual == v for v in values)
            return found != negated
        if not _same_kind(actual, self.value):
            return negated
        if self.type == "eq":
            return actual == self.value
        if self.type == "ne":
            return actual != self.value
        if isinstance(actual, bool):
            return False  # ordering booleans means nothing to a user
        try:
            if self.type == "gt":
                return actual > self.value  # type: ignore[operator]
            if self.type == "gte":
                return actual >= self.value  # type: ignore[operator]
            if self.type == "lt":
                return actual < self.value  # type: ignore[operator]
            return actual <= self.value  # type: ignore[operator]
        except TypeError:
            return False


class CompoundFilter(BaseModel):
    """All (``and``) or any (``or``) of several filters."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["and", "or"]
    filters: list[ComparisonFilter | CompoundFilter] = Field(min_length=1)

    def matches(self, attributes: Attributes) -> bool:
        """True when the document's attributes satisfy this combination."""
        if self.type == "and":
            return all(f.matches(attributes) for f in self.filters)
        return any(f.matches(attributes) for f in self.filters)


AttributeFilter = Annotated[ComparisonFilter | CompoundFilter, Field(union_mode="left_to_right")]


def _same_kind(a: object, b: object) -> bool:
    # bool is an int in Python; keep True from equalling 1.
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool)
    if isinstance(a, (int, float)) or isinstance(b, (int, float)):
        return isinstance(a, (int, float)) and isinstance(b, (int, float))
    return type(a) is type(b)
