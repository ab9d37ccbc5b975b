"""The FAISS side of a ``retrieval.collection.Collection``: building, searching and compacting
its index.

Index: ``IndexIDMap2`` over ``IndexFlatIP`` (exact inner product, the default) or over
``IndexHNSWFlat`` with ``METRIC_INNER_PRODUCT``. The ids are the collection's chunk ids.

Deletion: the flat index removes vectors. HNSW cannot, so a deleted document's vectors stay in
the graph as tombstones: its ids leave the chunk table, searches over-fetch and drop hits whose id
is no longer in the table, and once tombstones exceed ``compact_tombstone_ratio`` of the index the
index is rebuilt from the live vectors (under the lock; seconds at 100k vectors).

Filtered searches restrict FAISS to the matching documents' chunk ids; when HNSW's graph walk
finds too few of them, the search goes exact over the stored vectors.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import faiss
import numpy as np

from retrieval.config import IndexConfig
from retrieval.errors import InvalidInputError
from retrieval.filters import AttributeFilter
from retrieval.records import Hit

if TYPE_CHECKING:
    from retrieval.collection import _Document

logger = logging.getLogger(__name__)


def new_index(dimension: int, config: IndexConfig) -> tuple[faiss.IndexIDMap2, faiss.Index]:
    """An empty index and the inner index it maps ids onto."""
    if config.kind == "flat":
        inner = faiss.IndexFlatIP(dimension)
    else:
        inner = faiss.IndexHNSWFlat(dimension, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        inner.hnsw.efConstruction = config.ef_construction
        inner.hnsw.efSearch = config.ef_search
    return faiss.IndexIDMap2(inner), inner


class FaissIndexMixin:
    """Index mechanics for ``Collection``, which owns the state used here: the index, the
    chunk table (live chunk ids) and the documents, all guarded by ``_lock``."""

    id: str
    dimension: int
    index_config: IndexConfig
    _index: faiss.IndexIDMap2
    _inner: faiss.Index
    _docs: dict[str, _Document]
    _chunks: dict[int, tuple[_Document, int, str]]
    _lock: threading.RLock

    def set_ef_search(self, ef_search: int) -> None:
        """Change HNSW's search breadth (recall vs latency); persisted with the next commit."""
        if self.index_config.kind != "hnsw":
            raise InvalidInputError("ef_search applies to hnsw collections only")
        with self._lock:
            self.index_config = IndexConfig.model_validate({**self.index_config.model_dump(), "ef_search": ef_search})
            self._inner.hnsw.efSearch = ef_search

    def scan_size(self) -> int:
        """About how many vectors one search compares the query with: all of a flat index's; an
        HNSW walk's candidates (``ef_search`` times the graph's degree), however large it is."""
        total = self._index.ntotal
        if self.index_config.kind == "flat":
            return total
        return min(total, self.index_config.ef_search * self.index_config.hnsw_m)

    @contextmanager
    def held_if_free(self) -> Iterator[bool]:
        """Hold this index's lock if no other thread holds it (True), else nothing (False): an
        event loop searches inline only when it need not wait, since a write (an HNSW insert, a
        compaction) can hold the lock for seconds."""
        held = self._lock.acquire(blocking=False)
        try:
            yield held
        finally:
            if held:
                self._lock.release()

    def _remove_from_index(self, first_chunk_id: int, chunk_count: int) -> bool:
        """Drop a deleted document's chunk ids (already out of the chunk table) from search;
        call with ``_lock`` held. True when the index itself changed."""
        if not chunk_count:
            return False
        if self.index_config.kind == "flat":
            end = first_chunk_id + chunk_count
            self._index.remove_ids(faiss.IDSelectorRange(first_chunk_id, end))
            return True
        if self._tombstones() > self.index_config.compact_tombstone_ratio * self._index.ntotal:
            self._compact()
            return True
        return False

    def _tombstones(self) -> int:
        return self._index.ntotal - len(self._chunks)

    def _compact(self) -> None:
        """Rebuild the HNSW index from its live vectors; call with ``_lock`` held."""
        started = time.perf_counter()
        index, inner = new_index(self.dimension, self.index_config)
        if self._chunks:
            ids = faiss.vector_to_array(self._index.id_map)
            live = np.fromiter(self._chunks, dtype=np.int64, count=len(self._chunks))
            keep = np.isin(ids, live)
            vectors = self._inner.reconstruct_n(0, self._index.ntotal)
            index.add_with_ids(np.ascontiguousarray(vectors[keep]), ids[keep])
        dropped = self._index.ntotal - index.ntotal
        self._index, self._inner = index, inner
        logger.info(
            "collection %s: compacted %d tombstones in %.2fs",
            self.id,
            dropped,
            time.perf_counter() - started,
        )

    def search(
        self,
        vector: np.ndarray,
        top_k: int = 10,
        min_score: float | None = None,
        filter: AttributeFilter | None = None,
    ) -> list[Hit]:
        """Best ``top_k`` chunks for one query vector, best first, scores >= ``min_score``."""
        query = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, -1)
        if query.shape[1] != self.dimension:
            raise InvalidInputError(f"query must have {self.dimension} dimensions")
        if top_k < 1:
            raise InvalidInputError("top_k must be at least 1")
        with self._lock:
            live = len(self._chunks)
            if live == 0:
                return []
            if filter is not None:
                return self._search_filtered(query, top_k, min_score, filter)
            ntotal = self._index.ntotal
            want = min(top_k, live)
            # Tombstones (HNSW only) take result slots: ask for enough to expect `want` live ones.
            fetch = want if ntotal == live else min(ntotal, math.ceil(want * ntotal / live * 1.25) + 8)
            while True:
                scores, ids = self._index.search(query, fetch)
                hits, exhausted = self._collect(scores[0].tolist(), ids[0].tolist(), want, min_score)
                if exhausted or len(hits) >= want or fetch >= ntotal:
                    return hits
                fetch = min(ntotal, fetch * 2)

    def _search_filtered(
        self, query: np.ndarray, top_k: int, min_score: float | None, filter: AttributeFilter
    ) -> list[Hit]:
        docs = [d for d in self._docs.values() if d.chunk_count and filter.matches(d.attributes)]
        if not docs:
            return []
        allowed = np.concatenate(
            [np.arange(d.first_chunk_id, d.first_chunk_id + d.chunk_count, dtype=np.int64) for d in docs]
        )
        want = min(top_k, allowed.size)
        selector = faiss.IDSelectorBatch(allowed)
        if self.index_config.kind == "flat":
            scores, ids = self._index.search(query, want, params=faiss.SearchParameters(sel=selector))
        else:
            params = faiss.SearchParametersHNSW(sel=selector, efSearch=max(self.index_config.ef_search, want))
            scores, ids = self._index.search(query, want, params=params)
            if (ids[0] >= 0).sum() < want:
                # The graph walk found too few allowed vectors (a selective filter): go exact.
                translated = faiss.IDSelectorTranslated(self._index.id_map, selector)
                storage = faiss.downcast_index(self._inner.storage)
                scores, rows = storage.search(query, want, params=faiss.SearchParameters(sel=translated))
                id_map = self._index.id_map
                ids = np.array([[id_map.at(int(r)) if r >= 0 else -1 for r in rows[0]]])
        hits, _ = self._collect(scores[0].tolist(), ids[0].tolist(), want, min_score)
        return hits

    def _collect(
        self, scores: list[float], ids: list[int], want: int, min_score: float | None
    ) -> tuple[list[Hit], bool]:
        """FAISS results to hits; True when min_score cut the list (no point fetching more)."""
        hits: list[Hit] = []
        chunks = self._chunks
        for score, chunk_id in zip(scores, ids, strict=True):
            record = chunks.get(chunk_id)
            if record is None:  # -1 padding or a tombstone
                continue
            if min_score is not None and score < min_score:
                return hits, True
            doc, chunk_index, text = record
            hits.append(Hit(score, doc.doc_id, chunk_id, chunk_index, text, doc.source, dict(doc.attributes)))
            if len(hits) == want:
                break
        return hits, False
