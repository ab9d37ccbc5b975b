"""Typed results of the retrieval core, and validation of user-supplied attributes/metadata.

Plain frozen dataclasses rather than pydantic models: a search builds one Hit per result and
the per-hit cost is part of the latency budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from retrieval.errors import InvalidInputError

AttributeValue = str | int | float | bool

# OpenAI's limits on vector store file attributes and on object metadata.
MAX_ATTRIBUTES = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512


@dataclass(frozen=True, slots=True)
class Hit:
    """One search result: a chunk and the document it belongs to.

    ``score`` is the raw inner product (cosine similarity for normalised vectors, so in [-1, 1]);
    OpenAI's API wants [0, 1], which the HTTP layer gets by clamping.
    """

    score: float
    doc_id: str
    chunk_id: int
    chunk_index: int
    text: str
    source: str
    attributes: dict[str, AttributeValue]


@dataclass(frozen=True, slots=True)
class Passage:
    """One retrieved chunk for the chat path: a Hit plus the vector store it came from.

    ``score`` is the raw cosine similarity in [-1, 1] (what ``RetrievalPolicy.min_score``
    compares against). ``doc_id`` and ``source`` alias ``file_id`` and ``filename`` so that
    ``RetrievalPolicy.render`` takes passages as it takes hits.
    """

    score: float
    vector_store_id: str
    vector_store_name: str
    file_id: str
    filename: str
    chunk_index: int
    text: str
    attributes: dict[str, AttributeValue]

    @property
    def doc_id(self) -> str:
        return self.file_id

    @property
    def source(self) -> str:
        return self.filename


@dataclass(frozen=True, slots=True)
class DocumentInfo:
    """A document (an OpenAI vector store file) as stored in a collection."""

    doc_id: str
    source: str
    attributes: dict[str, AttributeValue]
    created_at: int
    chunk_count: int
    usage_bytes: int
    chunking: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class FileCounts:
    """OpenAI's ``file_counts``; the core only ever holds completed documents."""

    completed: int
    in_progress: int = 0
    failed: int = 0
    cancelled: int = 0

    @property
    def total(self) -> int:
        return self.completed + self.in_progress + self.failed + self.cancelled


@dataclass(frozen=True, slots=True)
class CollectionInfo:
    """Enough to answer OpenAI's ``vector_store`` object."""

    id: str
    name: str
    created_at: int
    last_active_at: int
    metadata: dict[str, str]
    usage_bytes: int
    file_counts: FileCounts
    status: Literal["completed"] = "completed"
    object: Literal["vector_store"] = field(default="vector_store")


@dataclass(frozen=True, slots=True)
class CollectionStats:
    """Index internals, for logs, metrics and tests."""

    kind: str
    dimension: int
    documents: int
    chunks: int
    index_vectors: int
    tombstones: int
    usage_bytes: int


def validate_attributes(attributes: Mapping[str, object] | None) -> dict[str, AttributeValue]:
    """Check OpenAI's attribute rules and return a plain dict copy."""
    if attributes is None:
        return {}
    if len(attributes) > MAX_ATTRIBUTES:
        raise InvalidInputError(f"at most {MAX_ATTRIBUTES} attributes are allowed")
    out: dict[str, AttributeValue] = {}
    for key, value in attributes.items():
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
            raise InvalidInputError(f"attribute keys must be strings of 1 to {MAX_KEY_CHARS} chars")
        if isinstance(value, str):
            if len(value) > MAX_VALUE_CHARS:
                raise InvalidInputError(f"attribute {key!r} is longer than {MAX_VALUE_CHARS} chars")
        elif not isinstance(value, (bool, int, float)):
            raise InvalidInputError(f"attribute {key!r} must be a string, number or boolean")
        out[key] = value
    return out


def validate_metadata(metadata: Mapping[str, object] | None) -> dict[str, str]:
    """Check OpenAI's metadata rules (string values only) and return a plain dict copy."""
    checked = validate_attributes(metadata)
    if any(not isinstance(v, str) for v in checked.values()):
        raise InvalidInputError("metadata values must be strings")
    return checked  # type: ignore[return-value]
