"""Files and vector stores belong to whoever created them (``retrieval.tenancy``).

The Retriever is driven directly, without Ray or HTTP: its class (``Retriever.func_or_class``)
is built on an event loop with a stand-in Embedder handle (bag-of-words vectors, so searches
still find the document sharing the query's words) and a whitespace tokenizer. Two tenants,
Alice and Bob, and two admin keys (both the operator) share one storage directory.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import zlib
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from retrieval import collection, files, service  # noqa: E402
from retrieval.config import ChunkingConfig, RetrievalConfig  # noqa: E402
from retrieval.errors import (  # noqa: E402
    CollectionNotFoundError,
    DocumentNotFoundError,
    FileNotFoundInStoreError,
    InvalidInputError,
    RetrievalError,
)
from retrieval.tenancy import OPERATOR, Caller  # noqa: E402

DIM = 64
ALICE = Caller("alice")
BOB = Caller("bob")
ADMIN = Caller("root", admin=True)
ADMIN2 = Caller("ops-2", admin=True)  # another admin key: the same operator

VOLCANO = "Volcanoes erupt when magma rises. Lava and ash pour from the volcano crater."
TIDES = "Tides rise and fall twice a day because the moon pulls on the oceans."
HANDBOOK = "The handbook says vacation requests go to the manager two weeks ahead."
IMPOSTOR = "Vacation requests go to alice directly, the handbook manager rule is void."

_WORD = re.compile(r"\w+")


def _word_id(word: str) -> int:
    return zlib.crc32(word.lower().encode()) % 30000 + 1


def _bag(ids: list[int]) -> np.ndarray:
    vector = np.zeros(DIM, dtype=np.float32)
    for i in ids:
        vector[i % DIM] += 1.0
    if not vector.any():
        vector[0] = 1.0
    return vector / np.linalg.norm(vector)


class FakeTokenizer:
    """Stands in for ``DocumentTokenizer``: one token per word."""

    def __init__(self, model_path: Any = None) -> None:
        pass

    def ids_and_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        matches = list(_WORD.finditer(text))
        return [_word_id(m.group()) for m in matches], [m.span() for m in matches]


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        async def run() -> Any:
            return self._fn(*args, **kwargs)

        return asyncio.ensure_future(run())  # awaitable and cancellable, as a response is


class FakeEmbedder:
    """The Embedder handle's methods the Retriever calls."""

    def __init__(self) -> None:
        info = {"max_tokens": 256, "dimension": DIM, "model": "fake-bag-of-words"}
        self.info = _Method(lambda: {**info, "model_path": "unused"})
        self.embed = _Method(lambda text, truncate=False, index=0: _bag(FakeTokenizer().ids_and_spans(text)[0]))
        self.embed_tokens = _Method(lambda ids, index=0: _bag(list(ids)))


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class TickingClock:
    """``time`` for the collection and file modules: every ``time()`` is one second later, so
    objects made in a row have distinct ``created_at`` and "the newest of a name" is the one
    made last, before and after a restart."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self._now = time.time()

    def time(self) -> float:
        self._now += 1.0
        return self._now


@pytest.fixture
def open_retriever(loop, tmp_path, monkeypatch):
    """``open_retriever()``: a Retriever on the test's storage dir (a new one each call, as
    after a restart)."""
    monkeypatch.setattr(service, "DocumentTokenizer", FakeTokenizer)
    clock = TickingClock()
    monkeypatch.setattr(collection, "time", clock)
    monkeypatch.setattr(files, "time", clock)
    config = RetrievalConfig(
        storage_dir=tmp_path / "storage",
        chunking=ChunkingConfig(max_chunk_size_tokens=40, chunk_overlap_tokens=8),
    )
    cls = service.Retriever.func_or_class

    def make():
        retriever = cls.__new__(cls)
        loop.run_until_complete(retriever.__init__(FakeEmbedder(), config))
        return retriever

    return make


@pytest.fixture
def world(loop, open_retriever):
    """Bob's store "notes" (TIDES), then Alice's "notes" (VOLCANO), each with its own file;
    the operator's "docs" (HANDBOOK), then Alice's newer "docs" (IMPOSTOR)."""
    r = open_retriever()
    run = loop.run_until_complete

    def upload(caller: Caller, name: str, text: str) -> str:
        return run(r.create_file(name, text.encode(), "assistants", caller=caller))["id"]

    w = SimpleNamespace(r=r, run=run, loop=loop)
    w.fb = upload(BOB, "tides.txt", TIDES)
    w.sb = run(r.create_store("notes", file_ids=[w.fb], caller=BOB))["id"]
    w.fa = upload(ALICE, "volcano.txt", VOLCANO)
    w.sa = run(r.create_store("notes", file_ids=[w.fa], caller=ALICE))["id"]
    w.fop = upload(ADMIN, "handbook.md", HANDBOOK)
    w.sop = run(r.create_store("docs", file_ids=[w.fop], caller=ADMIN))["id"]
    w.fimp = upload(ALICE, "impostor.md", IMPOSTOR)
    w.simp = run(r.create_store("docs", file_ids=[w.fimp], caller=ALICE))["id"]
    return w


def missing_like(
    run: Callable[[Coroutine], Any],
    call: Callable[[str], Coroutine],
    real_id: str,
    missing_id: str,
    error: type[RetrievalError],
) -> None:
    """``call(real_id)`` fails exactly as ``call(missing_id)`` does, an id that never existed."""
    with pytest.raises(error) as missing:
        run(call(missing_id))
    with pytest.raises(error) as foreign:
        run(call(real_id))
    m, f = missing.value, foreign.value
    assert type(f) is type(m)
    assert (f.status, f.code, f.error_type, f.param) == (m.status, m.code, m.error_type, m.param)
    assert f.message == m.message.replace(missing_id, real_id)
    assert real_id in f.message  # the comparison above is not vacuous


NO_FILE = "file-000000000000000000000000"
NO_STORE = "vs_000000000000000000000000"


def ids(page: dict) -> list[str]:
    return [item["id"] for item in page["data"]]


def stores_named(run, r, name: str, caller: Caller) -> set[str]:
    """The stores a request naming ``name`` (and no policy) searches."""
    passages = run(r.retrieve([], [name], "lava volcano tides moon", 10, caller=caller))
    return {p.vector_store_id for p in passages}


# --- files ----------------------------------------------------------------------------------


def test_files_are_invisible_to_other_tenants(world):
    r, run = world.r, world.run
    for call in (
        lambda f: r.get_file(f, caller=BOB),
        lambda f: r.get_file_content(f, caller=BOB),
        lambda f: r.delete_file(f, caller=BOB),
    ):
        missing_like(run, call, world.fa, NO_FILE, FileNotFoundInStoreError)
    # Bob's delete did nothing: Alice's file and its chunks are all there.
    assert run(r.get_file(world.fa, caller=ALICE))["filename"] == "volcano.txt"
    assert run(r.get_file_content(world.fa, caller=ALICE)) == VOLCANO.encode()
    assert run(r.get_store_file(world.sa, world.fa, caller=ALICE))["status"] == "completed"
    # An admin is not a tenant either: the operator's files are its own.
    missing_like(run, lambda f: r.get_file(f, caller=ADMIN), world.fa, NO_FILE, FileNotFoundInStoreError)
    missing_like(run, lambda f: r.get_file(f, caller=ALICE), world.fop, NO_FILE, FileNotFoundInStoreError)


def test_file_lists_show_only_the_callers_files(world):
    r, run = world.r, world.run
    assert ids(run(r.list_files(order="asc", caller=ALICE))) == [world.fa, world.fimp]
    assert ids(run(r.list_files(caller=BOB))) == [world.fb]
    assert ids(run(r.list_files(caller=ADMIN2))) == [world.fop]  # every admin key: the operator
    assert all("owner" not in f for f in run(r.list_files(caller=ALICE))["data"])
    # A cursor naming someone else's file is an unknown id.
    missing_like(run, lambda f: r.list_files(after=f, caller=BOB), world.fa, NO_FILE, InvalidInputError)


def test_deleting_a_file_removes_it_from_the_owners_stores(world):
    r, run = world.r, world.run
    assert run(r.delete_file(world.fa, caller=ALICE))["deleted"]
    with pytest.raises(DocumentNotFoundError):
        run(r.get_store_file(world.sa, world.fa, caller=ALICE))
    assert run(r.search(world.sa, "lava volcano", caller=ALICE))["data"] == []
    assert run(r.get_file(world.fb, caller=BOB))["id"] == world.fb  # Bob's file untouched


# --- vector stores --------------------------------------------------------------------------


def test_stores_are_invisible_to_other_tenants(world):
    r, run = world.r, world.run
    fa = world.fa
    for call in (
        lambda s: r.get_store(s, caller=BOB),
        lambda s: r.modify_store(s, name="mine now", caller=BOB),
        lambda s: r.list_store_files(s, caller=BOB),
        lambda s: r.get_store_file(s, fa, caller=BOB),
        lambda s: r.get_store_file_content(s, fa, caller=BOB),
        lambda s: r.update_store_file(s, fa, {"k": "v"}, caller=BOB),
        lambda s: r.search(s, "lava volcano", caller=BOB),
        lambda s: r.add_file_to_store(s, world.fb, caller=BOB),
        lambda s: r.delete_store_file(s, fa, caller=BOB),
        lambda s: r.delete_store(s, caller=BOB),
    ):
        missing_like(run, call, world.sa, NO_STORE, CollectionNotFoundError)
    # Nothing Bob tried changed Alice's store.
    store = run(r.get_store(world.sa, caller=ALICE))
    assert store["name"] == "notes" and store["file_counts"]["completed"] == 1
    assert "owner" not in store
    vs_file = run(r.get_store_file(world.sa, fa, caller=ALICE))
    assert vs_file["attributes"] == {} and "owner" not in vs_file
    hits = run(r.search(world.sa, "lava volcano", caller=ALICE))["data"]
    assert hits and hits[0]["file_id"] == fa
    assert run(r.get_store_file_content(world.sa, fa, caller=ALICE))["data"]
    # Tenants cannot reach the operator's stores through the API either, only through a policy.
    missing_like(run, lambda s: r.get_store(s, caller=ALICE), world.sop, NO_STORE, CollectionNotFoundError)
    missing_like(run, lambda s: r.get_store(s, caller=ADMIN), world.sa, NO_STORE, CollectionNotFoundError)
    # Every admin key manages the operator's stores.
    assert run(r.get_store(world.sop, caller=ADMIN2))["name"] == "docs"


def test_store_lists_show_only_the_callers_stores(world):
    r, run = world.r, world.run
    assert ids(run(r.list_stores(order="asc", caller=ALICE))) == [world.sa, world.simp]
    assert ids(run(r.list_stores(caller=BOB))) == [world.sb]
    assert ids(run(r.list_stores(caller=ADMIN2))) == [world.sop]
    for cursor in ("after", "before"):
        missing_like(
            run,
            lambda s, c=cursor: r.list_stores(**{c: s}, caller=BOB),
            world.sa,
            NO_STORE,
            InvalidInputError,
        )


def test_files_and_stores_of_different_owners_do_not_mix(world):
    r, run = world.r, world.run
    # Bob's store, Alice's file.
    missing_like(
        run,
        lambda f: r.add_file_to_store(world.sb, f, caller=BOB),
        world.fa,
        NO_FILE,
        FileNotFoundInStoreError,
    )
    # Alice's store, Bob's file (the store is what Bob cannot see).
    missing_like(
        run,
        lambda s: r.add_file_to_store(s, world.fb, caller=BOB),
        world.sa,
        NO_STORE,
        CollectionNotFoundError,
    )
    missing_like(
        run,
        lambda f: r.create_store("stolen", file_ids=[f], caller=BOB),
        world.fa,
        NO_FILE,
        FileNotFoundInStoreError,
    )
    assert ids(run(r.list_stores(caller=BOB))) == [world.sb]  # the failed create made nothing
    assert run(r.list_store_files(world.sb, caller=BOB))["data"][0]["id"] == world.fb


# --- the chat path --------------------------------------------------------------------------


def test_policy_names_resolve_among_the_operators_stores(world):
    r, run = world.r, world.run
    for caller in (ALICE, BOB, ADMIN):
        passages = run(r.retrieve(["docs"], None, "vacation handbook manager", 4, caller=caller))
        assert passages and {p.vector_store_id for p in passages} == {world.sop}
        assert {p.file_id for p in passages} == {world.fop}
    # Policy ids resolve whoever owns the store; missing policy stores are skipped.
    passages = run(r.retrieve([world.sa, "no-such-store", NO_STORE], None, "lava", 4, caller=BOB))
    assert {p.vector_store_id for p in passages} == {world.sa}
    assert run(r.retrieve(["no-such-store"], None, "lava", 4, caller=BOB)) == []


def test_a_search_too_large_for_the_loop_runs_in_a_thread_and_finds_the_same(world, monkeypatch):
    r, run = world.r, world.run
    query = "vacation handbook manager lava"
    on_loop = run(r.retrieve(["docs", world.sa], None, query, 4, caller=BOB))
    monkeypatch.setattr(service, "_INLINE_SEARCH_VECTORS", 0)
    threads: list[Any] = []
    to_thread = asyncio.to_thread
    monkeypatch.setattr(service.asyncio, "to_thread", lambda f, *a: threads.append(f) or to_thread(f, *a))
    assert run(r.retrieve(["docs", world.sa], None, query, 4, caller=BOB)) == on_loop
    assert on_loop and len(threads) == 2  # the storage catch-up, then the search


def test_a_small_search_waits_for_no_write_on_the_loop(world, monkeypatch):
    """A store a write holds (an HNSW insert can take seconds) is searched in a thread: the
    replica's event loop never waits for its lock."""
    import threading

    r, run = world.r, world.run
    store = r._stores.get_by_id(world.sa)
    query = "lava volcano"
    free = run(r.retrieve([world.sa], None, query, 4, caller=BOB))
    threads: list[Any] = []
    to_thread = asyncio.to_thread
    monkeypatch.setattr(service.asyncio, "to_thread", lambda f, *a: threads.append(f) or to_thread(f, *a))
    held, release = threading.Event(), threading.Event()

    def writer() -> None:
        with store._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=writer)
    holder.start()
    assert held.wait(10)
    try:
        pending = world.loop.create_task(r.retrieve([world.sa], None, query, 4, caller=BOB))
        world.loop.run_until_complete(asyncio.sleep(0.2))
        assert not pending.done() and len(threads) == 2  # waiting in its thread, not on the loop
    finally:
        release.set()
        holder.join()
    assert world.loop.run_until_complete(pending) == free and free


def test_requested_stores_are_the_callers_own_or_the_policys(world):
    r, run = world.r, world.run
    query = "lava volcano tides moon vacation handbook"

    def stores(policy, requested, caller):
        return {p.vector_store_id for p in run(r.retrieve(policy, requested, query, 10, caller=caller))}

    # Another tenant's store, by id, is a 404 exactly like a store that does not exist.
    missing_like(
        run,
        lambda s: r.retrieve(["docs"], [s], query, 10, caller=BOB),
        world.sa,
        NO_STORE,
        CollectionNotFoundError,
    )
    # ... and so is an operator store the policy does not name.
    missing_like(
        run,
        lambda s: r.retrieve([], [s], query, 10, caller=BOB),
        world.sop,
        NO_STORE,
        CollectionNotFoundError,
    )
    # Names resolve among the caller's own stores: Alice's "notes" is newer than Bob's.
    assert stores([], ["notes"], BOB) == {world.sb}
    assert stores([], ["notes"], ALICE) == {world.sa}
    assert stores([], [world.sb], BOB) == {world.sb}
    # The policy's stores, by the policy's name or the resolved id.
    assert stores(["docs"], ["docs"], BOB) == {world.sop}
    assert stores(["docs"], [world.sop], BOB) == {world.sop}
    # A name that is both the caller's store and the policy's means the caller's own.
    assert stores(["docs"], ["docs"], ALICE) == {world.simp}
    # Requested replaces the policy's list; without it the policy's stores are searched.
    assert stores(["docs"], ["notes", "docs"], BOB) == {world.sb, world.sop}
    assert stores(["docs"], None, BOB) == {world.sop}
    assert stores(["docs"], [], BOB) == set()


# --- persistence ----------------------------------------------------------------------------


def test_owners_survive_a_restart(world, open_retriever):
    run = world.run
    r = open_retriever()  # a new Retriever on the same storage directory
    missing_like(run, lambda s: r.get_store(s, caller=BOB), world.sa, NO_STORE, CollectionNotFoundError)
    missing_like(run, lambda f: r.get_file(f, caller=BOB), world.fa, NO_FILE, FileNotFoundInStoreError)
    assert ids(run(r.list_stores(order="asc", caller=ALICE))) == [world.sa, world.simp]
    assert ids(run(r.list_files(caller=BOB))) == [world.fb]
    assert ids(run(r.list_stores(caller=ADMIN))) == [world.sop]
    passages = run(r.retrieve(["docs"], None, "vacation handbook", 4, caller=BOB))
    assert {p.vector_store_id for p in passages} == {world.sop}
    assert stores_named(run, r, "notes", BOB) == {world.sb}


def test_data_without_an_owner_belongs_to_the_operator(world, open_retriever, tmp_path):
    run = world.run
    root = tmp_path / "storage"
    # As written before owners were recorded: no "owner" key anywhere.
    for path in [
        root / "vector_stores" / world.sa / "manifest.json",
        root / "files" / f"{world.fa}.json",
    ]:
        data = json.loads(path.read_text())
        assert data.pop("owner") == "principal:alice"
        path.write_text(json.dumps(data))
    r = open_retriever()
    assert run(r.get_store(world.sa, caller=ADMIN))["id"] == world.sa
    assert run(r.get_file(world.fa, caller=ADMIN2))["id"] == world.fa
    missing_like(run, lambda s: r.get_store(s, caller=ALICE), world.sa, NO_STORE, CollectionNotFoundError)
    missing_like(run, lambda f: r.get_file(f, caller=ALICE), world.fa, NO_FILE, FileNotFoundInStoreError)
    # The operator's now: a policy may name it.
    assert stores_named(run, r, "notes", ADMIN) == {world.sa}
    passages = run(r.retrieve(["notes"], None, "lava volcano", 4, caller=BOB))
    assert {p.vector_store_id for p in passages} == {world.sa}
    # Written back with an owner on the next change.
    run(r.modify_store(world.sa, metadata={"k": "v"}, caller=ADMIN))
    manifest = json.loads((root / "vector_stores" / world.sa / "manifest.json").read_text())
    assert manifest["owner"] == OPERATOR


# --- search bounds ----------------------------------------------------------------------------


def test_search_bounds(world):
    r, run = world.r, world.run
    ok = run(r.search(world.sa, ["lava"] * 16, max_num_results=50, caller=ALICE))
    assert ok["search_query"] == ["lava"] * 16
    for bad, param in [
        ({"query": ["lava"] * 17}, "query"),
        ({"query": []}, "query"),
        ({"query": ""}, "query"),
        ({"query": ["lava", " "]}, "query"),
        ({"query": 5}, "query"),
        ({"query": "lava", "max_num_results": 0}, "max_num_results"),
        ({"query": "lava", "max_num_results": 51}, "max_num_results"),
        ({"query": "lava", "max_num_results": "5"}, "max_num_results"),
        ({"query": "lava", "max_num_results": True}, "max_num_results"),
        ({"query": "lava", "max_num_results": 5.0}, "max_num_results"),
    ]:
        with pytest.raises(InvalidInputError) as info:
            run(r.search(world.sa, caller=ALICE, **bad))
        assert info.value.param == param, bad


# --- the gateway's principal -> caller ----------------------------------------------------


def test_caller_of_a_request():
    import gateway.retrieval_routes as routes
    from gateway.auth import Principal
    from gateway.errors import APIError

    def request(principal):
        return SimpleNamespace(state=SimpleNamespace(principal=principal))

    assert routes.caller_of(request(Principal("alice", frozenset({"documents"})))) == ALICE
    admin = routes.caller_of(request(Principal("root", frozenset({"documents", "admin"}))))
    assert admin == ADMIN and admin.owner == OPERATOR and ALICE.owner == "principal:alice"
    with pytest.raises(APIError) as info:
        routes.caller_of(request(Principal("chatty", frozenset({"chat"}))))
    assert info.value.status == 403
