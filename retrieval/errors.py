"""Exceptions raised by the retrieval core.

The HTTP layer maps them to OpenAI error bodies: ``*NotFoundError`` -> 404, ``*ExistsError`` -> 409,
``InputTooLongError`` and ``InvalidInputError`` -> 400, everything else -> 500.
"""

from __future__ import annotations


class RetrievalError(Exception):
    """Base class of every error raised by the retrieval package."""


class InvalidInputError(RetrievalError, ValueError):
    """The caller passed something malformed (wrong vector shape, bad attributes...)."""


class InputTooLongError(InvalidInputError):
    """An embedding input has more tokens than the model accepts and truncation was refused."""

    def __init__(self, index: int, token_count: int, max_tokens: int) -> None:
        self.index = index
        self.token_count = token_count
        self.max_tokens = max_tokens
        super().__init__(
            f"input[{index}] has {token_count} tokens, more than the model's maximum of {max_tokens}"
        )


class EmbeddingModelMissingError(RetrievalError, FileNotFoundError):
    """The embedding model folder (or the package that ships it) is not installed."""


class CollectionNotFoundError(RetrievalError, LookupError):
    """No collection with that id or name."""


class CollectionExistsError(RetrievalError):
    """A collection with that name already exists."""


class DocumentNotFoundError(RetrievalError, LookupError):
    """No document with that id in the collection."""


class DocumentExistsError(RetrievalError):
    """The collection already holds a document with that id."""


class FileNotFoundInStoreError(RetrievalError, LookupError):
    """No uploaded file with that id."""


class StorageCorruptError(RetrievalError):
    """Persisted state is unreadable or inconsistent (not a leftover of an interrupted save)."""
