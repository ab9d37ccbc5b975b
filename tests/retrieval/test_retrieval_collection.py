"""Collection: add, search, delete, filters and metadata, for flat and HNSW indexes (no disk)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from retrieval.collection import Collection
from retrieval.config import IndexConfig
from retrieval.errors import DocumentExistsError, DocumentNotFoundError, InvalidInputError
from retrieval.filters import ComparisonFilter, CompoundFilter

DIM = 32
KINDS = ["flat", "hnsw"]


def make_collection(kind: str, **index_kwargs) -> Collection:
    config = IndexConfig(kind=kind, hnsw_m=16, ef_construction=64, ef_search=64, **index_kwargs)
    return Collection(name=f"test-{kind}", dimension=DIM, index_config=config)


def fill(coll: Collection, unit_vectors, docs: int = 10, chunks: int = 5) -> dict[str, np.ndarray]:
    vectors = {}
    for d in range(docs):
        v = unit_vectors(chunks, DIM)
        coll.add_document(
            f"file-{d}",
            [f"doc {d} chunk {c}" for c in range(chunks)],
            v,
            source=f"name-{d}.txt",
            attributes={"n": d, "even": d % 2 == 0, "tag": f"t{d % 3}"},
        )
        vectors[f"file-{d}"] = v
    return vectors


@pytest.mark.parametrize("kind", KINDS)
def test_search_finds_each_chunk_with_its_metadata(kind, unit_vectors):
    coll = make_collection(kind)
    vectors = fill(coll, unit_vectors)
    for doc_id, v in vectors.items():
        for c in range(len(v)):
            top = coll.search(v[c], top_k=3)
            assert len(top) == 3
            hit = top[0]
            assert hit.doc_id == doc_id and hit.chunk_index == c
            assert hit.score == pytest.approx(1.0, abs=1e-5)
            d = int(doc_id.split("-")[1])
            assert hit.text == f"doc {d} chunk {c}"
            assert hit.source == f"name-{d}.txt"
            assert hit.attributes == {"n": d, "even": d % 2 == 0, "tag": f"t{d % 3}"}
            assert [h.score for h in top] == sorted((h.score for h in top), reverse=True)


def test_hnsw_matches_flat_on_small_data(unit_vectors):
    flat, hnsw = make_collection("flat"), make_collection("hnsw")
    for d in range(20):
        v = unit_vectors(10, DIM)
        for coll in (flat, hnsw):
            coll.add_document(f"d{d}", [str(i) for i in range(10)], v)
    for q in unit_vectors(20, DIM):
        assert [h.chunk_id for h in flat.search(q, 5)] == [h.chunk_id for h in hnsw.search(q, 5)]


@pytest.mark.parametrize("kind", KINDS)
def test_delete_removes_chunks_from_results(kind, unit_vectors):
    coll = make_collection(kind, compact_tombstone_ratio=0.9)
    vectors = fill(coll, unit_vectors)
    assert coll.delete_document("file-3") == 5
    for q in vectors["file-3"]:
        hits = coll.search(q, top_k=45)
        assert len(hits) == 45
        assert all(h.doc_id != "file-3" for h in hits)
        filtered = coll.search(q, top_k=10, filter=ComparisonFilter(type="eq", key="n", value=3))
        assert filtered == []
    stats = coll.stats()
    assert (stats.documents, stats.chunks) == (9, 45)
    assert stats.tombstones == (5 if kind == "hnsw" else 0)
    assert stats.index_vectors == 45 + stats.tombstones
    with pytest.raises(DocumentNotFoundError):
        coll.delete_document("file-3")
    # Re-adding a deleted id is allowed and gets fresh chunk ids.
    coll.add_document("file-3", ["again"], vectors["file-3"][:1])
    hit = coll.search(vectors["file-3"][0], 1)[0]
    assert (hit.doc_id, hit.text) == ("file-3", "again") and hit.chunk_id >= 50


def test_hnsw_compacts_when_tombstones_pass_ratio(unit_vectors):
    coll = make_collection("hnsw", compact_tombstone_ratio=0.25)
    vectors = fill(coll, unit_vectors, docs=8)
    coll.delete_document("file-0")
    assert coll.stats().tombstones == 5  # 5/40 below the ratio
    coll.delete_document("file-1")
    coll.delete_document("file-2")  # 15/40 above: rebuilt
    stats = coll.stats()
    assert stats.tombstones == 0 and stats.index_vectors == stats.chunks == 25
    for doc_id in ("file-5", "file-7"):
        hit = coll.search(vectors[doc_id][2], 1)[0]
        assert (hit.doc_id, hit.chunk_index) == (doc_id, 2)
    for doc_id in list(vectors)[3:]:
        coll.delete_document(doc_id)
    assert coll.stats().index_vectors == 0
    assert coll.search(vectors["file-7"][0], 5) == []


@pytest.mark.parametrize("kind", KINDS)
def test_top_k_min_score_and_filters(kind, unit_vectors):
    coll = make_collection(kind)
    vectors = fill(coll, unit_vectors)
    q = vectors["file-4"][1]
    assert len(coll.search(q, top_k=500)) == 50
    above = coll.search(q, top_k=50, min_score=0.3)
    assert above[0].doc_id == "file-4" and all(h.score >= 0.3 for h in above)
    assert len(above) < 50

    evens = coll.search(q, top_k=50, filter=ComparisonFilter(type="eq", key="even", value=True))
    assert len(evens) == 25 and {h.attributes["n"] for h in evens} == {0, 2, 4, 6, 8}
    combo = CompoundFilter(
        type="and",
        filters=[
            ComparisonFilter(type="in", key="tag", value=["t0", "t1"]),
            ComparisonFilter(type="gte", key="n", value=5),
        ],
    )
    got = coll.search(q, top_k=50, filter=combo)
    assert {h.attributes["n"] for h in got} == {6, 7, 9}
    # One allowed document among many: exact results even when the graph walk finds too few.
    only = coll.search(q, top_k=5, filter=ComparisonFilter(type="eq", key="n", value=8))
    assert sorted(h.chunk_index for h in only) == [0, 1, 2, 3, 4]
    exact = sorted(((float(vectors["file-8"][c] @ q), c) for c in range(5)), reverse=True)
    assert [h.chunk_index for h in only] == [c for _, c in exact]


def test_attributes_update_and_document_listing(unit_vectors):
    coll = make_collection("flat")
    vectors = fill(coll, unit_vectors, docs=3)
    info = coll.update_attributes("file-1", {"n": 100, "lang": "fr"})
    assert info.attributes == {"n": 100, "lang": "fr"}
    assert coll.search(vectors["file-1"][0], 1)[0].attributes == {"n": 100, "lang": "fr"}
    assert [d.doc_id for d in coll.list_documents()] == ["file-0", "file-1", "file-2"]
    assert coll.document_chunks("file-2") == [f"doc 2 chunk {c}" for c in range(5)]
    doc = coll.get_document("file-0")
    assert doc.chunk_count == 5 and doc.source == "name-0.txt"
    assert doc.usage_bytes == sum(len(f"doc 0 chunk {c}") for c in range(5)) + 5 * DIM * 4
    info = coll.info()
    assert info.file_counts.completed == info.file_counts.total == 3
    assert info.usage_bytes == sum(d.usage_bytes for d in coll.list_documents())


def test_rejects_bad_input(unit_vectors):
    coll = make_collection("flat")
    coll.add_document("a", ["x"], unit_vectors(1, DIM))
    with pytest.raises(DocumentExistsError):
        coll.add_document("a", ["x"], unit_vectors(1, DIM))
    with pytest.raises(InvalidInputError):
        coll.add_document("b", ["x", "y"], unit_vectors(1, DIM))
    with pytest.raises(InvalidInputError):
        coll.add_document("b", ["x"], unit_vectors(1, DIM + 1))
    with pytest.raises(InvalidInputError):
        coll.add_document("b", ["x"], np.full((1, DIM), np.nan, dtype=np.float32))
    with pytest.raises(InvalidInputError):
        coll.add_document("b", ["x"], unit_vectors(1, DIM), attributes={"k": [1, 2]})
    with pytest.raises(InvalidInputError):
        coll.add_document("b", ["x"], unit_vectors(1, DIM), attributes={f"k{i}": i for i in range(17)})
    with pytest.raises(InvalidInputError):
        coll.search(unit_vectors(1, DIM + 1)[0], 3)
    with pytest.raises(InvalidInputError):
        coll.search(unit_vectors(1, DIM)[0], 0)
    assert coll.stats().documents == 1


def test_empty_document_and_empty_collection(unit_vectors):
    coll = make_collection("hnsw")
    assert coll.search(unit_vectors(1, DIM)[0], 3) == []
    assert coll.add_document("empty", [], np.empty((0, DIM), dtype=np.float32)) == 0
    assert coll.get_document("empty").chunk_count == 0
    assert coll.search(unit_vectors(1, DIM)[0], 3) == []
    assert coll.delete_document("empty") == 0


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_adds_deletes_and_searches(kind, rng):
    coll = make_collection(kind)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        local = np.random.default_rng(w)
        try:
            for d in range(30):
                v = local.standard_normal((3, DIM)).astype(np.float32)
                coll.add_document(f"w{w}-{d}", ["a", "b", "c"], v / np.linalg.norm(v, axis=1, keepdims=True))
                if d % 3 == 2:
                    coll.delete_document(f"w{w}-{d - 1}")
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(200):
                for hit in coll.search(rng.standard_normal(DIM).astype(np.float32), 5):
                    assert hit.text in ("a", "b", "c")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert coll.stats().documents == 3 * 20 and coll.stats().chunks == 3 * 20 * 3


def test_scan_size_bounds_what_a_search_compares(unit_vectors):
    """Retriever.retrieve searches on its event loop when the scan is small: a flat index
    compares the query with every vector, an HNSW walk with its candidates only."""
    flat = make_collection("flat")
    config = IndexConfig(kind="hnsw", hnsw_m=4, ef_construction=64, ef_search=4)
    hnsw = Collection(name="test-hnsw-narrow", dimension=DIM, index_config=config)
    assert flat.scan_size() == hnsw.scan_size() == 0
    fill(flat, unit_vectors)
    fill(hnsw, unit_vectors)
    assert flat.scan_size() == 50
    assert hnsw.scan_size() == 16  # ef_search x hnsw_m, below the 50 vectors it holds
