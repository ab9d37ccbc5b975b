"""Checking the arguments of the Retriever's API calls, before any store or file is touched.

Ray-free. Every check raises ``InvalidInputError`` (HTTP 400) naming the offending ``param``, so
the HTTP layer can pass request fields on unchecked.
"""

from __future__ import annotations

from typing import get_args

from pydantic import TypeAdapter, ValidationError

from retrieval.errors import InvalidInputError
from retrieval.files import FilePurpose
from retrieval.filters import AttributeFilter

_FILTER = TypeAdapter(AttributeFilter)
_PURPOSES = set(get_args(FilePurpose))
_RANKERS = {"none", "auto", "default-2024-11-15"}
_FILE_STATUSES = {"in_progress", "completed", "failed", "cancelled"}
MAX_SEARCH_RESULTS = 50
MAX_SEARCH_QUERIES = 16
# Attribute filters: how deep compound filters nest, how many filters in all, and how many
# values one `in`/`nin` lists. Each is evaluated per document at every search.
MAX_FILTER_DEPTH = 8
MAX_FILTER_NODES = 64
MAX_FILTER_VALUES = 256


def check_purpose(purpose: str | None, *, optional: bool = False) -> None:
    """A file purpose OpenAI knows (``None`` allowed when ``optional``)."""
    if optional and purpose is None:
        return
    if purpose not in _PURPOSES:
        raise InvalidInputError(f"purpose must be one of {sorted(_PURPOSES)}", param="purpose")


def check_file_status_filter(filter: str | None) -> None:
    """A vector store file status to list by, or ``None`` for all."""
    if filter is not None and filter not in _FILE_STATUSES:
        raise InvalidInputError(f"filter must be one of {sorted(_FILE_STATUSES)}", param="filter")


def string_list(value: object, param: str, *, max_items: int | None = None) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise InvalidInputError(f"{param} must be a list of strings", param=param)
    if max_items is not None and len(value) > max_items:
        raise InvalidInputError(f"{param} may list at most {max_items} items", param=param)
    return list(value)


def search_queries(query: object) -> list[str]:
    """A search's ``query``: one string or a list of 1 to ``MAX_SEARCH_QUERIES``, none blank."""
    queries = [query] if isinstance(query, str) else string_list(query, "query")
    if not queries or len(queries) > MAX_SEARCH_QUERIES or not all(q.strip() for q in queries):
        raise InvalidInputError(
            f"query must be a non-empty string or a list of 1 to {MAX_SEARCH_QUERIES} of them",
            param="query",
        )
    return queries


def check_max_num_results(max_num_results: object) -> None:
    if (
        not isinstance(max_num_results, int)
        or isinstance(max_num_results, bool)
        or not 1 <= max_num_results <= MAX_SEARCH_RESULTS
    ):
        raise InvalidInputError(
            f"max_num_results must be between 1 and {MAX_SEARCH_RESULTS}",
            param="max_num_results",
        )


def parse_filter(filters: dict | None) -> AttributeFilter | None:
    if filters is None:
        return None
    _check_filter_size(filters)
    try:
        return _FILTER.validate_python(filters)
    except ValidationError as exc:
        raise InvalidInputError(f"invalid filters: {exc.errors()[0]['msg']}", param="filters") from exc


def _check_filter_size(filters: object) -> None:
    """Refuse filters past the bounds before pydantic walks them (recursively)."""
    nodes, stack = 0, [(filters, 1)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_FILTER_DEPTH or nodes > MAX_FILTER_NODES:
            raise InvalidInputError(
                f"filters may nest {MAX_FILTER_DEPTH} deep and hold {MAX_FILTER_NODES} filters in all",
                param="filters",
            )
        if not isinstance(node, dict):
            continue
        value = node.get("value")
        if isinstance(value, list) and len(value) > MAX_FILTER_VALUES:
            raise InvalidInputError(f"a filter may list at most {MAX_FILTER_VALUES} values", param="filters")
        children = node.get("filters")
        if isinstance(children, list):
            stack.extend((child, depth + 1) for child in children)


def score_threshold(ranking_options: dict | None) -> float | None:
    """Minimum cosine for a clamped ``score_threshold`` (0 keeps everything)."""
    if ranking_options is None:
        return None
    if not isinstance(ranking_options, dict) or set(ranking_options) - {
        "ranker",
        "score_threshold",
    }:
        raise InvalidInputError("ranking_options takes 'ranker' and 'score_threshold'", param="ranking_options")
    if ranking_options.get("ranker", "auto") not in _RANKERS:
        raise InvalidInputError(f"ranker must be one of {sorted(_RANKERS)}", param="ranking_options")
    threshold = ranking_options.get("score_threshold", 0.0)
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 <= threshold <= 1.0:
        raise InvalidInputError("score_threshold must be between 0 and 1", param="ranking_options")
    return float(threshold) if threshold > 0 else None


def check_retrieval_args(query: object, top_k: object) -> None:
    """The chat path's retrieval query (non-blank) and ``top_k`` (a positive integer)."""
    if not isinstance(query, str) or not query.strip():
        raise InvalidInputError("the retrieval query is empty", param="messages")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise InvalidInputError("top_k must be a positive integer", param="top_k")
