"""Persistence: reloads give identical results; failed saves leave the previous state on disk."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import retrieval.persistence as persistence
from retrieval.collection import Collection
from retrieval.config import IndexConfig
from retrieval.errors import CollectionExistsError, CollectionNotFoundError, StorageCorruptError
from retrieval.files import FileStore
from retrieval.store import CollectionStore

DIM = 16


def snapshot(coll: Collection, queries: np.ndarray) -> tuple:
    results = [
        [(h.score, h.doc_id, h.chunk_id, h.chunk_index, h.text, h.source, h.attributes) for h in coll.search(q, 8)]
        for q in queries
    ]
    return results, coll.list_documents(), coll.info(), coll.stats()


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_reload_gives_identical_results(kind, tmp_path, unit_vectors):
    store = CollectionStore(tmp_path, dimension=DIM)
    coll = store.create(
        "kb",
        metadata={"team": "search"},
        index_config=IndexConfig(kind=kind, hnsw_m=8, compact_tombstone_ratio=0.5),
    )
    for d in range(12):
        coll.add_document(
            f"file-{d}",
            [f"{d}:{c} {{braces}} é" for c in range(4)],
            unit_vectors(4, DIM),
            source=f"f{d}.md",
            attributes={"d": d, "x": 0.5},
        )
    coll.delete_document("file-4")
    coll.delete_document("file-9")
    coll.update_attributes("file-1", {"lang": "de"})
    queries = unit_vectors(30, DIM)
    before = snapshot(coll, queries)

    reopened = CollectionStore(tmp_path, dimension=DIM).get("kb")
    assert snapshot(reopened, queries) == before
    # The reloaded collection keeps working and keeps allocating fresh ids.
    reopened.add_document("file-new", ["n"], unit_vectors(1, DIM))
    assert reopened.get_document("file-new").chunk_count == 1
    assert max(h.chunk_id for h in reopened.search(unit_vectors(1, DIM)[0], 50)) == 48
    assert sorted(p.name for p in (tmp_path / coll.id / "chunks").iterdir()) == sorted(
        f"d{i}.json" for i in [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12]
    )


def reopen_copy(root: Path, dest: Path) -> CollectionStore:
    """Open a copy of a live store: what a crash now would leave (opening cleans leftovers)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(root, dest)
    return CollectionStore(dest, dimension=DIM)


def test_failed_commit_keeps_previous_state_on_disk(tmp_path, unit_vectors, monkeypatch):
    root = tmp_path / "live"
    store = CollectionStore(root, dimension=DIM)
    coll = store.create("kb")
    coll.add_document("a", ["a0"], unit_vectors(1, DIM))

    real_replace = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith(persistence.MANIFEST_NAME):
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(persistence.os, "replace", failing_replace)
    with pytest.raises(OSError):
        coll.add_document("b", ["b0", "b1"], unit_vectors(2, DIM))
    monkeypatch.setattr(persistence.os, "replace", real_replace)

    on_disk = reopen_copy(root, tmp_path / "copy").get("kb")
    assert [d.doc_id for d in on_disk.list_documents()] == ["a"]
    assert on_disk.stats().index_vectors == 1
    # Memory was ahead of disk; the next successful commit carries both changes.
    coll.update_attributes("a", {"k": "v"})
    on_disk = reopen_copy(root, tmp_path / "copy").get("kb")
    assert [d.doc_id for d in on_disk.list_documents()] == ["a", "b"]
    assert on_disk.stats().index_vectors == 3
    assert on_disk.document_chunks("b") == ["b0", "b1"]


def test_leftovers_are_removed_at_load(tmp_path, unit_vectors):
    store = CollectionStore(tmp_path, dimension=DIM)
    coll = store.create("kb")
    coll.add_document("a", ["a0"], unit_vectors(1, DIM))
    cdir = tmp_path / coll.id
    (cdir / f".manifest.json{persistence.TMP_MARKER}123-abcd").write_text("{half")
    (cdir / "index-0000009999.faiss").write_bytes(b"junk")
    (cdir / "chunks" / "d77.json").write_text("[]")
    (tmp_path / f"{persistence.TMP_MARKER}vs_half").mkdir()
    (tmp_path / ".trash-vs_old-1234").mkdir()

    CollectionStore(tmp_path, dimension=DIM)
    assert sorted(p.name for p in tmp_path.iterdir()) == [coll.id]
    names = sorted(p.name for p in cdir.iterdir())
    assert names == ["chunks", persistence.index_file_name(1), "manifest.json"]
    assert [p.name for p in (cdir / "chunks").iterdir()] == ["d0.json"]


def test_store_create_list_rename_delete(tmp_path, unit_vectors):
    store = CollectionStore(tmp_path, dimension=DIM)
    a = store.create("alpha", metadata={"owner": "me"})
    b = store.create()
    assert a.id.startswith("vs_") and b.name == b.id
    with pytest.raises(CollectionExistsError):
        store.create("alpha")
    assert store.get("alpha") is a and store.get(a.id) is a
    store.update(a.id, name="beta", metadata={"owner": "you"})
    with pytest.raises(CollectionNotFoundError):
        store.get("alpha")
    info = store.get("beta").info()
    assert (info.name, info.metadata, info.object, info.status) == (
        "beta",
        {"owner": "you"},
        "vector_store",
        "completed",
    )
    store.delete(b.id)
    assert not (tmp_path / b.id).exists()
    with pytest.raises(CollectionNotFoundError):
        store.delete(b.id)
    reopened = CollectionStore(tmp_path, dimension=DIM)
    assert [(i.id, i.name, i.metadata) for i in reopened.list()] == [(a.id, "beta", {"owner": "you"})]
    with pytest.raises(StorageCorruptError):
        CollectionStore(tmp_path, dimension=DIM + 1)


def test_file_store_round_trip(tmp_path):
    files = FileStore(tmp_path / "files", max_bytes=100)
    f = files.create("notes.txt", b"hello\nworld", purpose="assistants")
    assert f.id.startswith("file-") and f.bytes == 11 and f.object == "file"
    g = files.create("../../etc/passwd", b"", purpose="user_data")
    assert files.read(f.id) == b"hello\nworld"
    assert [x.id for x in files.list(purpose="assistants")] == [f.id]
    (tmp_path / "files" / "file-orphan.bin").write_bytes(b"x")
    (tmp_path / "files" / f".{f.id}.json{persistence.TMP_MARKER}1-2").write_bytes(b"{")
    reopened = FileStore(tmp_path / "files")
    assert reopened.get(f.id) == f and reopened.get(g.id).filename == "../../etc/passwd"
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(
        [f"{f.id}.bin", f"{f.id}.json", f"{g.id}.bin", f"{g.id}.json"]
    )
    reopened.delete(f.id)
    assert [x.id for x in FileStore(tmp_path / "files").list()] == [g.id]
    with pytest.raises(Exception, match="larger than"):
        files.create("big", b"x" * 101)


def test_holds_chunks_says_whether_anything_can_be_searched(tmp_path, unit_vectors):
    """The Retriever starts a query's encoding early only when its view holds some chunk."""
    store = CollectionStore(tmp_path, dimension=DIM)
    assert not store.holds_chunks()
    coll = store.create("kb")
    assert not store.holds_chunks()  # an empty store has nothing to search
    coll.add_document("a", ["a0"], unit_vectors(1, DIM))
    assert store.holds_chunks()
    coll.delete_document("a")
    assert not store.holds_chunks()
