"""Exceptions raised by the retrieval package, each carrying its OpenAI error fields.

Every class has an HTTP ``status``, an OpenAI error ``error_type`` and ``code`` (class attributes)
and every instance a ``message`` and a ``param`` (instance attributes), so the HTTP layer maps
any of them with one line::

    except RetrievalError as exc:
        raise APIError(exc.status, exc.message, type=exc.error_type, param=exc.param, code=exc.code)

=============================  ======  =========================  ==============================
class                          status  error_type                 code
=============================  ======  =========================  ==============================
InvalidInputError              400     invalid_request_error      invalid_value
InputTooLongError              400     invalid_request_error      context_length_exceeded
CollectionNotFoundError        404     invalid_request_error      vector_store_not_found
DocumentNotFoundError          404     invalid_request_error      vector_store_file_not_found
FileNotFoundInStoreError       404     invalid_request_error      file_not_found
CollectionExistsError          409     invalid_request_error      vector_store_exists
DocumentExistsError            409     invalid_request_error      vector_store_file_exists
EmbeddingModelMissingError     500     server_error               embedding_model_missing
StorageCorruptError            500     server_error               storage_corrupt
RetrievalError (anything else) 500     server_error               retrieval_error
=============================  ======  =========================  ==============================

They cross Ray unchanged: ``__reduce__`` rebuilds them without calling ``__init__`` (whose
arguments differ between classes), and a caller of a deployment handle gets Ray's
``RayTaskError(<class>)``, which is an instance of the class and forwards instance attributes
(``message``, ``param``, ``index``...) to the original. Use ``exc.message``, not ``str(exc)``:
on the Ray wrapper ``str`` is the remote traceback. Per-instance fields are never class
attributes, because the wrapper would find the class's value before forwarding to the original.
"""

from __future__ import annotations

from typing import Any, ClassVar


def _restore(cls: type[RetrievalError], args: tuple, state: dict[str, Any]) -> RetrievalError:
    # cls.__new__ rather than Exception.__new__: OSError subclasses need their own.
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class RetrievalError(Exception):
    """Base class of every error raised by the retrieval package."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "retrieval_error"

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple:
        return (_restore, (type(self), self.args, dict(self.__dict__)))


class InvalidInputError(RetrievalError, ValueError):
    """The caller passed something malformed (wrong vector shape, bad attributes...)."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_value"


class InputTooLongError(InvalidInputError):
    """An embedding input has more tokens than the model accepts and truncation was refused."""

    code = "context_length_exceeded"

    def __init__(self, index: int, token_count: int, max_tokens: int) -> None:
        self.index = index
        self.token_count = token_count
        self.max_tokens = max_tokens
        super().__init__(
            f"input[{index}] has {token_count} tokens, more than the model's limit of {max_tokens}",
            param="input",
        )


class EmbeddingModelMissingError(RetrievalError, FileNotFoundError):
    """The embedding model folder (or the package that ships it) is not installed."""

    code = "embedding_model_missing"


class CollectionNotFoundError(RetrievalError, LookupError):
    """No collection with that id or name."""

    status = 404
    error_type = "invalid_request_error"
    code = "vector_store_not_found"


class CollectionExistsError(RetrievalError):
    """A collection with that name already exists."""

    status = 409
    error_type = "invalid_request_error"
    code = "vector_store_exists"


class DocumentNotFoundError(RetrievalError, LookupError):
    """No document with that id in the collection."""

    status = 404
    error_type = "invalid_request_error"
    code = "vector_store_file_not_found"


class DocumentExistsError(RetrievalError):
    """The collection already holds a document with that id."""

    status = 409
    error_type = "invalid_request_error"
    code = "vector_store_file_exists"


class FileNotFoundInStoreError(RetrievalError, LookupError):
    """No uploaded file with that id."""

    status = 404
    error_type = "invalid_request_error"
    code = "file_not_found"


class StorageCorruptError(RetrievalError):
    """Persisted state is unreadable or inconsistent (not a leftover of an interrupted save)."""

    code = "storage_corrupt"
