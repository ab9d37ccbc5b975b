"""Several Retriever replicas over one storage directory (retrieval/shared_storage.py).

The lock and generation counter across real processes, then two Retriever deployments (separate
replica processes, each handle pinned to one of them) sharing one storage dir in a real Serve
app: a write through one is seen by the other, concurrent writes through both lose nothing.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest
from ray import serve  # noqa: E402

from retrieval.config import ChunkingConfig, EmbeddingModelConfig, RetrievalConfig  # noqa: E402
from retrieval.embedding_deployment import OMP_ENV, Embedder  # noqa: E402
from retrieval.service import Retriever  # noqa: E402
from retrieval.shared_storage import SharedStorage
from retrieval.tenancy import Caller  # noqa: E402

APP = "shared-storage-test"
OP = Caller("ops", admin=True)
CTX = multiprocessing.get_context("fork")


# --- the lock and the generation, across processes ------------------------------------


def _count(root: str, rounds: int) -> None:
    storage = SharedStorage(root)
    path = os.path.join(root, "counter")
    for _ in range(rounds):
        with storage.write():
            value = int(open(path).read()) if os.path.exists(path) else 0
            time.sleep(0.0005)  # widen the read-modify-write window
            with open(path, "w") as f:
                f.write(str(value + 1))


def test_writers_in_several_processes_take_turns(tmp_path):
    procs = [CTX.Process(target=_count, args=(str(tmp_path), 100)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert (tmp_path / "counter").read_text() == "300"  # no update lost
    assert SharedStorage(tmp_path).generation() == "300"  # one generation per write


def test_a_reader_reloads_only_after_another_process_writes(tmp_path):
    reloads = []
    reader = SharedStorage(tmp_path, reload=lambda: reloads.append(1))
    reader.mark_current()
    assert not reader.sync() and not reloads
    p = CTX.Process(target=_count, args=(str(tmp_path), 1))
    p.start()
    p.join(60)
    assert reader.sync() and len(reloads) == 1
    assert not reader.sync() and len(reloads) == 1


def _hold_and_die(root: str, ready) -> None:
    storage = SharedStorage(root)
    with storage.write():
        ready.set()
        time.sleep(600)


def test_a_writer_killed_holding_the_lock_releases_it(tmp_path):
    ready = CTX.Event()
    p = CTX.Process(target=_hold_and_die, args=(str(tmp_path), ready))
    p.start()
    assert ready.wait(60)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    started = time.monotonic()
    with SharedStorage(tmp_path).write():
        pass
    assert time.monotonic() - started < 5


# --- two Retriever replicas in Serve ---------------------------------------------------


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class _Both:
    """Only puts both Retriever deployments in one app; the test gets a handle to each."""

    def __init__(self, a, b) -> None:
        self._handles = (a, b)

    async def __call__(self) -> str:
        return "ok"


@pytest.fixture(scope="module")
def replicas(ray_session, tmp_path_factory):
    storage = tmp_path_factory.mktemp("shared-storage")
    config = RetrievalConfig(
        storage_dir=storage,
        embedding=EmbeddingModelConfig(num_threads=1, max_batch_size=16, batch_wait_timeout_s=0.05),
        chunking=ChunkingConfig(max_chunk_size_tokens=40, chunk_overlap_tokens=8),
    )
    embedder = Embedder.options(ray_actor_options={"num_cpus": 0.25, "runtime_env": {"env_vars": OMP_ENV}}).bind(
        config.embedding
    )
    a = Retriever.options(name="RetrieverA", ray_actor_options={"num_cpus": 0.1}).bind(embedder, config)
    b = Retriever.options(name="RetrieverB", ray_actor_options={"num_cpus": 0.1}).bind(embedder, config)
    serve.run(_Both.bind(a, b), name=APP, route_prefix=None)
    yield (
        serve.get_deployment_handle("RetrieverA", app_name=APP),
        serve.get_deployment_handle("RetrieverB", app_name=APP),
    )
    serve.delete(APP)


def _doc(topic: str, fact: str) -> bytes:
    return f"# Notes on {topic}\n\nThe important fact about {topic}: {fact}\n".encode()


def test_a_write_through_one_replica_is_seen_by_the_other(replicas):
    a, b = replicas
    store = a.create_store.remote("handbook", caller=OP).result()
    # The store, a file uploaded through A, indexed into it through B, searched through A.
    assert b.get_store.remote(store["id"], caller=OP).result()["name"] == "handbook"
    upload = a.create_file.remote("volcano.md", _doc("volcanoes", "Etna erupts often."), caller=OP).result()
    added = b.add_file_to_store.remote(store["id"], upload["id"], caller=OP).result()
    assert added["status"] == "completed"
    hits = a.search.remote(store["id"], "Which volcano erupts often?", caller=OP).result()
    assert [h["file_id"] for h in hits["data"]][:1] == [upload["id"]]
    # The chat path too, by the store's name.
    passages = a.retrieve.remote(["handbook"], None, "Etna", 3, caller=OP).result()
    assert passages and passages[0].file_id == upload["id"]
    # Deleted through A: gone from B's search.
    b_before = b.search.remote(store["id"], "volcano", caller=OP).result()
    assert b_before["data"]
    a.delete_store_file.remote(store["id"], upload["id"], caller=OP).result()
    assert b.search.remote(store["id"], "volcano", caller=OP).result()["data"] == []
    a.delete_store.remote(store["id"], caller=OP).result()
    ids = [s["id"] for s in b.list_stores.remote(caller=OP).result()["data"]]
    assert store["id"] not in ids


def test_concurrent_writes_through_both_replicas_lose_nothing(replicas):
    a, b = replicas
    store = a.create_store.remote("concurrent", caller=OP).result()
    topics = ["owls", "kites", "salt", "glass", "wolves", "honey", "maps", "bridges"]
    handles = [a if i % 2 == 0 else b for i in range(len(topics))]

    async def run() -> list[dict]:
        uploads = await asyncio.gather(
            *(
                h.create_file.remote(f"{t}.md", _doc(t, f"{t} fact {i}."), caller=OP)
                for i, (h, t) in enumerate(zip(handles, topics))
            )
        )
        # Both replicas commit into the same store at once.
        return await asyncio.gather(
            *(h.add_file_to_store.remote(store["id"], u["id"], caller=OP) for h, u in zip(reversed(handles), uploads))
        )

    added = asyncio.run(run())
    assert [x["status"] for x in added] == ["completed"] * len(topics)
    for handle in (a, b):
        files = handle.list_store_files.remote(store["id"], limit=100, caller=OP).result()["data"]
        assert sorted(f["id"] for f in files) == sorted(x["id"] for x in added)
        assert handle.get_store.remote(store["id"], caller=OP).result()["file_counts"]["completed"] == len(topics)
    for topic in topics:
        hits = b.search.remote(store["id"], f"The important fact about {topic}", max_num_results=1, caller=OP)
        assert hits.result()["data"][0]["filename"] == f"{topic}.md"
