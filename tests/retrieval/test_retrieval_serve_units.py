"""Ray-free parts of the retrieval Serve layer: errors across processes, batch budget, OpenAI
objects and pagination, ingestion helpers, duplicate store names."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest

from retrieval import errors
from retrieval import openai_objects as oai
from retrieval.config import ChunkingConfig, EmbeddingModelConfig
from retrieval.embedding_deployment import QueuedInput, batch_budget
from retrieval.errors import InvalidInputError, RetrievalError
from retrieval.ingest import (
    FailedFile,
    FailedFiles,
    IngestFailure,
    chunking_from_strategy,
    decode_document,
)
from retrieval.store import CollectionStore

ALL_ERRORS = [
    errors.RetrievalError("boom"),
    errors.InvalidInputError("bad", param="limit"),
    errors.InputTooLongError(2, 300, 256),
    errors.EmbeddingModelMissingError("no model"),
    errors.CollectionNotFoundError("no store"),
    errors.CollectionExistsError("taken"),
    errors.DocumentNotFoundError("no doc"),
    errors.DocumentExistsError("dup doc"),
    errors.FileNotFoundInStoreError("no file"),
    errors.StorageCorruptError("broken"),
]


@pytest.mark.parametrize("exc", ALL_ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_errors_pickle_with_their_fields(exc, dumps):
    back = pickle.loads(dumps(exc))
    assert type(back) is type(exc)
    assert (back.status, back.code, back.error_type) == (exc.status, exc.code, exc.error_type)
    assert (back.message, back.param, back.args) == (exc.message, exc.param, exc.args)
    if isinstance(exc, errors.InputTooLongError):
        assert (back.index, back.token_count, back.max_tokens) == (2, 300, 256)


def test_error_status_mapping():
    expected = {
        "InvalidInputError": (400, "invalid_value"),
        "InputTooLongError": (400, "context_length_exceeded"),
        "CollectionNotFoundError": (404, "vector_store_not_found"),
        "DocumentNotFoundError": (404, "vector_store_file_not_found"),
        "FileNotFoundInStoreError": (404, "file_not_found"),
        "CollectionExistsError": (409, "vector_store_exists"),
        "DocumentExistsError": (409, "vector_store_file_exists"),
        "EmbeddingModelMissingError": (500, "embedding_model_missing"),
        "StorageCorruptError": (500, "storage_corrupt"),
        "RetrievalError": (500, "retrieval_error"),
    }
    got = {type(e).__name__: (e.status, e.code) for e in ALL_ERRORS}
    assert got == expected
    for exc in ALL_ERRORS:
        assert exc.error_type == ("server_error" if exc.status >= 500 else "invalid_request_error")
    assert errors.InputTooLongError(0, 9, 8).param == "input"


def test_batch_budget_counts_inputs_unless_tokens_can_bind():
    size, fn = batch_budget(EmbeddingModelConfig())  # 32 * 256 <= 8192
    assert (size, fn) == (32, None)

    config = EmbeddingModelConfig(max_batch_size=32, max_tokens=256, max_batch_tokens=1024)
    size, fn = batch_budget(config)
    assert size == 1024

    def items(*lengths):
        return [QueuedInput(list(range(n)), 0.0) for n in lengths]

    assert fn(items(256, 256, 256, 256)) <= size  # exactly the token budget
    assert fn(items(256, 256, 256, 256, 1)) > size  # one token over
    assert fn(items(*[4] * 32)) <= size  # 32 short inputs fit
    assert fn(items(*[4] * 33)) > size  # the 33rd input does not


def test_page_cursors_both_ways():
    items = [f"id{i}" for i in range(5)]  # oldest first

    def listing(**kw):
        return oai.page(items, item_id=lambda i: i, render=lambda i: {"id": i}, **kw)

    first = listing(limit=2, order="desc")
    assert [d["id"] for d in first["data"]] == ["id4", "id3"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("id4", "id3", True)
    second = listing(limit=2, order="desc", after="id3")
    assert [d["id"] for d in second["data"]] == ["id2", "id1"] and second["has_more"]
    last = listing(limit=2, order="desc", after="id1")
    assert [d["id"] for d in last["data"]] == ["id0"] and not last["has_more"]
    back = listing(limit=2, order="desc", before="id1")
    assert [d["id"] for d in back["data"]] == ["id3", "id2"] and back["has_more"]
    assert [d["id"] for d in listing(limit=10, order="asc")["data"]] == items
    empty = oai.page([], item_id=str, render=dict, limit=5, order="asc")
    assert empty == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "nope"}):
        with pytest.raises(InvalidInputError):
            listing(**{"limit": 2, "order": "asc", **bad})


def test_scores_are_clamped_cosines():
    assert [oai.similarity_to_score(c) for c in (-0.3, 0.0, 0.42, 1.0000001)] == [
        0.0,
        0.0,
        0.42,
        1.0,
    ]


def test_chunking_strategy_parsing():
    default = ChunkingConfig(max_chunk_size_tokens=200, chunk_overlap_tokens=40)
    assert chunking_from_strategy(None, default, 254) is default
    assert chunking_from_strategy({"type": "auto"}, default, 254) is default
    static = {
        "type": "static",
        "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 20},
    }
    assert chunking_from_strategy(static, default, 254) == ChunkingConfig(
        max_chunk_size_tokens=100, chunk_overlap_tokens=20
    )
    too_big = {
        "type": "static",
        "static": {"max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400},
    }
    overlap = {
        "type": "static",
        "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 60},
    }
    for bad in (too_big, overlap, {"type": "static"}, {"type": "fancy"}, "auto"):
        with pytest.raises(InvalidInputError) as info:
            chunking_from_strategy(bad, default, 254)
        assert info.value.param == "chunking_strategy"


def test_decode_document_accepts_text_only():
    assert decode_document("\ufeff# Title\nbody".encode()) == "# Title\nbody"
    for content, code in [
        (b"\x89PNG\r\n\x1a\n\x00\x00", "unsupported_file"),
        (b"caf\xe9", "unsupported_file"),
        (b"  \n\t ", "invalid_file"),
        (b"", "invalid_file"),
    ]:
        with pytest.raises(IngestFailure) as info:
            decode_document(content)
        assert info.value.code == code


def test_failed_files_persist(tmp_path):
    path = tmp_path / "failed.json"
    book = FailedFiles(path)
    book.add("vs_a", FailedFile("file-1", 10, "invalid_file", "empty", {"k": 1}, None))
    book.add("vs_b", FailedFile("file-1", 11, "unsupported_file", "binary", {}, None))
    again = FailedFiles(path)
    assert again.get("vs_a", "file-1").message == "empty" and again.count("vs_b") == 1
    again.discard_file("file-1")
    assert FailedFiles(path).count("vs_a") == 0 and FailedFiles(path).count("vs_b") == 0


def test_duplicate_names_resolve_to_the_latest(tmp_path):
    store = CollectionStore(tmp_path, dimension=4, unique_names=False)
    older = store.create("docs")
    newer = store.create("docs")  # same second: creation order decides
    assert store.get("docs") is newer and store.get(older.id) is older
    reopened = CollectionStore(tmp_path, dimension=4, unique_names=False)
    assert {c.id for c in (reopened.get(older.id), reopened.get(newer.id))} == {older.id, newer.id}
    store.delete(newer.id)
    assert store.get("docs") is older


def test_retrieval_error_is_the_common_base():
    assert all(isinstance(e, RetrievalError) for e in ALL_ERRORS)


def test_encode_gate_merges_batches_that_wait():
    import asyncio

    import numpy as np

    from retrieval.embedding_deployment import EncodeGate

    calls: list[int] = []
    release = None

    async def run(items):
        calls.append(len(items))
        if len(calls) == 1:
            await release.wait()  # hold the first encode so later batches queue up
        if any(i.ids == [-1] for i in items):
            raise RuntimeError("model failed")
        return np.array([[float(i.ids[0])] for i in items])

    async def scenario():
        nonlocal release
        release = asyncio.Event()
        gate = EncodeGate(run, limit=1, max_size=4)

        def batch(*values):
            return [QueuedInput([v], 0.0) for v in values]

        first = asyncio.create_task(gate.submit(batch(0)))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(gate.submit(batch(*b))) for b in ([1, 2], [3], [4, 5], [6])]
        await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(first, *waiting)
        assert calls == [1, 3, 3]  # [1,2]+[3] fill 3 of 4; [4,5]+[6] the next encode
        assert [[float(v[0]) for v in r] for r in results] == [[0], [1, 2], [3], [4, 5], [6]]
        # The gate is idle: [7] starts alone, [-1] waits and runs alone; only its waiter fails.
        failing = [asyncio.create_task(gate.submit(batch(*b))) for b in ([7], [-1])]
        ok, failed = await asyncio.gather(*failing, return_exceptions=True)
        assert float(ok[0][0]) == 7 and isinstance(failed, RuntimeError)
        assert calls[-2:] == [1, 1]

    asyncio.run(scenario())


def test_encode_gate_starts_a_free_encode_inside_enqueue_and_reports_a_failed_start():
    """A ``run`` returning an executor future has its thread started before ``enqueue``
    returns (no loop step in between); a ``run`` that raises at once fails its own waiters
    and the gate goes on with the next batch."""
    import asyncio
    import threading

    import numpy as np

    from retrieval.embedding_deployment import EncodeGate

    started = threading.Event()
    encoded: list[int] = []

    def run(items):
        if items[0].ids == [-1]:
            raise RuntimeError("cannot start")
        encoded.extend(i.ids[0] for i in items)

        def work():
            started.set()
            return np.array([[float(i.ids[0])] for i in items])

        return asyncio.get_running_loop().run_in_executor(None, work)

    async def scenario():
        gate = EncodeGate(run, limit=1, max_size=4)
        future = gate.enqueue([QueuedInput([3], 0.0)])
        # No await since enqueue: only a thread started inside it can have run.
        assert started.wait(5)
        assert [float(v[0]) for v in await future] == [3.0]
        with pytest.raises(RuntimeError, match="cannot start"):
            await gate.enqueue([QueuedInput([-1], 0.0)])
        assert [float(v[0]) for v in await gate.enqueue([QueuedInput([4], 0.0)])] == [4.0]
        # A batch whose waiter was cancelled while it queued is not encoded.
        busy = gate.enqueue([QueuedInput([5], 0.0)])
        gone, kept = gate.enqueue([QueuedInput([6], 0.0)]), gate.enqueue([QueuedInput([7], 0.0)])
        gone.cancel()
        await busy
        assert [float(v[0]) for v in await kept] == [7.0]
        assert 6 not in encoded

    asyncio.run(scenario())
