"""OpenAI's vector store and file objects, built from the retrieval core's records.

Field names, ``object`` values and nullability follow ``shared/openai-openapi/openapi.yaml``
(VectorStoreObject, VectorStoreFileObject, OpenAIFile, the list/delete responses and
VectorStoreSearchResultsPage). Plain dicts, because they go straight to JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from retrieval.errors import InvalidInputError
from retrieval.files import StoredFile
from retrieval.ingest import FailedFile
from retrieval.records import CollectionInfo, DocumentInfo, Hit

T = TypeVar("T")
Order = Literal["asc", "desc"]


def similarity_to_score(cosine: float) -> float:
    """OpenAI's search ``score`` (in [0, 1]) from a cosine similarity (in [-1, 1]).

    Clamped rather than rescaled: scores keep the cosine's meaning (0.5 is a cosine of 0.5, so
    ``score_threshold`` reads the same as the chat path's ``min_score``); negative similarity,
    "unrelated" for these models, becomes 0.
    """
    return min(1.0, max(0.0, float(cosine)))


def vector_store(info: CollectionInfo, failed: int = 0) -> dict[str, Any]:
    counts = info.file_counts
    return {
        "id": info.id,
        "object": "vector_store",
        "created_at": info.created_at,
        "name": info.name,
        "usage_bytes": info.usage_bytes,
        "file_counts": {
            "in_progress": counts.in_progress,
            "completed": counts.completed,
            "failed": counts.failed + failed,
            "cancelled": counts.cancelled,
            "total": counts.total + failed,
        },
        "status": info.status,
        "expires_at": None,
        "last_active_at": info.last_active_at,
        "metadata": dict(info.metadata),
    }


def deleted(object_type: str, object_id: str) -> dict[str, Any]:
    return {"id": object_id, "object": object_type, "deleted": True}


def chunking_strategy(chunking: dict | None) -> dict[str, Any]:
    if chunking is None:  # indexed before the strategy was recorded
        return {"type": "other"}
    return {
        "type": "static",
        "static": {
            "max_chunk_size_tokens": chunking["max_chunk_size_tokens"],
            "chunk_overlap_tokens": chunking["chunk_overlap_tokens"],
        },
    }


def vector_store_file(store_id: str, doc: DocumentInfo) -> dict[str, Any]:
    return {
        "id": doc.doc_id,
        "object": "vector_store.file",
        "usage_bytes": doc.usage_bytes,
        "created_at": doc.created_at,
        "vector_store_id": store_id,
        "status": "completed",
        "last_error": None,
        "chunking_strategy": chunking_strategy(doc.chunking),
        "attributes": dict(doc.attributes),
    }


def failed_vector_store_file(store_id: str, failed: FailedFile) -> dict[str, Any]:
    return {
        "id": failed.file_id,
        "object": "vector_store.file",
        "usage_bytes": 0,
        "created_at": failed.created_at,
        "vector_store_id": store_id,
        "status": "failed",
        "last_error": {"code": failed.code, "message": failed.message},
        "chunking_strategy": chunking_strategy(failed.chunking),
        "attributes": dict(failed.attributes),
    }


def file_object(stored: StoredFile) -> dict[str, Any]:
    return stored.public()  # without the owner


def file_content_page(chunks: Sequence[str]) -> dict[str, Any]:
    """VectorStoreFileContentResponse: the parsed (chunked) text of a vector store file."""
    return {
        "object": "vector_store.file_content.page",
        "data": [{"type": "text", "text": text} for text in chunks],
        "has_more": False,
        "next_page": None,
    }


def search_results_page(queries: Sequence[str], hits: Sequence[Hit]) -> dict[str, Any]:
    """VectorStoreSearchResultsPage, one item per chunk, best first."""
    return {
        "object": "vector_store.search_results.page",
        "search_query": list(queries),
        "data": [
            {
                "file_id": hit.doc_id,
                "filename": hit.source,
                "score": similarity_to_score(hit.score),
                "attributes": dict(hit.attributes),
                "content": [{"type": "text", "text": hit.text}],
            }
            for hit in hits
        ],
        "has_more": False,
        "next_page": None,
    }


def page(
    items: Sequence[T],
    *,
    item_id: Callable[[T], str],
    render: Callable[[T], dict[str, Any]],
    limit: int,
    order: Order,
    after: str | None = None,
    before: str | None = None,
    max_limit: int = 100,
) -> dict[str, Any]:
    """An OpenAI cursor-paginated list of ``items`` (given oldest first).

    ``after``/``before`` are ids of items in the list; an id that is not there is a 400 (the
    object was deleted or never existed; OpenAI does the same). ``first_id``/``last_id`` are
    null for an empty page, as OpenAI returns them.
    """
    if not isinstance(limit, int) or not 1 <= limit <= max_limit:
        raise InvalidInputError(f"limit must be between 1 and {max_limit}", param="limit")
    if order not in ("asc", "desc"):
        raise InvalidInputError("order must be 'asc' or 'desc'", param="order")
    ordered = list(items) if order == "asc" else list(reversed(items))
    ids = [item_id(i) for i in ordered]
    start, end = 0, len(ordered)
    if after is not None:
        start = _position(ids, after, "after") + 1
    if before is not None:
        end = _position(ids, before, "before")
    window = ordered[start:end]
    if before is not None and after is None:
        # Walking backwards: the page is the `limit` items just before the cursor.
        chosen = window[-limit:]
        has_more = len(window) > limit
    else:
        chosen = window[:limit]
        has_more = len(window) > limit
    data = [render(i) for i in chosen]
    return {
        "object": "list",
        "data": data,
        "first_id": item_id(chosen[0]) if chosen else None,
        "last_id": item_id(chosen[-1]) if chosen else None,
        "has_more": has_more,
    }


def _position(ids: list[str], cursor: str, param: str) -> int:
    try:
        return ids.index(cursor)
    except ValueError:
        raise InvalidInputError(f"{param}: no object with id {cursor!r} in this list", param=param) from None
