"""The Embedder and Retriever deployments in a real Ray Serve app, driven through their handles.

Runs as its own handle-only application (no HTTP route) in the session's Ray instance; the
HTTP routes and the ingress mapping are tested with the gateway.
"""

from __future__ import annotations

import numpy as np
import pytest
from ray import serve  # noqa: E402

from engines.provision import default_models_dir
from retrieval.config import ChunkingConfig, EmbeddingModelConfig, RetrievalConfig  # noqa: E402
from retrieval.embedding_deployment import OMP_ENV, Embedder  # noqa: E402
from retrieval.encoder import SentenceEncoder  # noqa: E402
from retrieval.errors import (  # noqa: E402
    CollectionNotFoundError,
    DocumentNotFoundError,
    FileNotFoundInStoreError,
    InputTooLongError,
    InvalidInputError,
    RetrievalError,
)
from retrieval.records import Passage  # noqa: E402
from retrieval.service import Retriever  # noqa: E402
from retrieval.tenancy import Caller  # noqa: E402

APP = "retrieval-serve-test"
# An admin key: the corpus is the operator's, so a model policy may name its store "docs".
# Ownership between tenants is tested in test_retrieval_tenancy.py.
OP = Caller("ops", admin=True)

SENTENCES = [
    f"Sentence number {i} is about {topic}."
    for i, topic in enumerate(
        [
            "cats",
            "rain",
            "trains",
            "bread",
            "chess",
            "rivers",
            "music",
            "stars",
            "tea",
            "boats",
            "snow",
            "clocks",
            "honey",
            "maps",
            "bridges",
            "owls",
            "salt",
            "kites",
            "glass",
            "wolves",
        ]
    )
]

DOCS = {
    "pasta.md": (
        "# Cooking pasta\n\nBring a large pot of salted water to a rolling boil before adding "
        "the spaghetti. Stir during the first minute so the noodles do not stick together.\n\n"
        "Cook until al dente, usually eight to ten minutes, then drain and toss with the sauce "
        "while the pasta is still hot. Save a cup of the starchy cooking water to loosen it."
    ),
    "black_holes.md": (
        "# Black holes\n\nA black hole forms when a massive star exhausts its nuclear fuel and "
        "its core collapses under gravity. Nothing, not even light, escapes from inside the "
        "event horizon.\n\nSupermassive black holes sit at the centres of galaxies, including "
        "Sagittarius A* in the Milky Way, and weigh millions of solar masses."
    ),
    "football.txt": (
        "Football rules. Each team fields eleven players, one of them the goalkeeper, the only "
        "player allowed to handle the ball inside the penalty area. A match lasts ninety "
        "minutes in two halves.\n\nA player is offside when nearer to the opponents' goal line "
        "than both the ball and the second-last defender as the ball is played to them."
    ),
}
VOLCANO = (
    "Volcanoes erupt when magma rises through the crust. Lava flows, ash clouds and "
    "pyroclastic flows make eruptions dangerous; Mount Etna in Sicily erupts often."
)


def _config(storage) -> RetrievalConfig:
    return RetrievalConfig(
        storage_dir=storage,
        embedding=EmbeddingModelConfig(num_threads=1, max_batch_size=16, batch_wait_timeout_s=0.05),
        chunking=ChunkingConfig(max_chunk_size_tokens=40, chunk_overlap_tokens=8),
    )


def _start(storage):
    config = _config(storage)
    # Small CPU claims: the session's Ray has 4 CPUs shared with the gateway's apps.
    embedder = Embedder.options(ray_actor_options={"num_cpus": 0.25, "runtime_env": {"env_vars": OMP_ENV}}).bind(
        config.embedding
    )
    retriever = Retriever.options(ray_actor_options={"num_cpus": 0.25}).bind(embedder, config)
    handle = serve.run(retriever, name=APP, route_prefix=None)
    return handle, serve.get_deployment_handle("Embedder", app_name=APP)


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("retrieval-serve")


@pytest.fixture(scope="module")
def app(ray_session, storage):
    handles = _start(storage)
    yield handles
    serve.delete(APP)


@pytest.fixture(scope="module")
def retriever(app):
    return app[0]


@pytest.fixture(scope="module")
def embedder(app):
    return app[1]


@pytest.fixture(scope="module")
def local_encoder():
    return SentenceEncoder.from_config(EmbeddingModelConfig(num_threads=1))


@pytest.fixture(scope="module")
def corpus(retriever):
    """A store named "docs" holding the three DOCS; returns (store id, {filename: file id})."""
    file_ids = {}
    for name, text in DOCS.items():
        uploaded = retriever.create_file.remote(name, text.encode(), "assistants", caller=OP).result()
        file_ids[name] = uploaded["id"]
    store = retriever.create_store.remote(name="docs", metadata={"topic": "mixed"}, caller=OP).result()
    added = [
        retriever.add_file_to_store.remote(store["id"], fid, {"filename": name}, caller=OP)
        for name, fid in file_ids.items()
    ]
    for response in added:
        assert response.result()["status"] == "completed"
    return store["id"], file_ids


# --- embedder -------------------------------------------------------------------------------


def test_concurrent_embeds_are_batched_and_match_direct_encode(embedder, local_encoder):
    embedder.reset_batch_stats.remote().result()
    responses = [embedder.embed.remote(s) for s in SENTENCES]  # all in flight before any wait
    vectors = np.vstack([r.result() for r in responses])
    np.testing.assert_allclose(vectors, local_encoder.encode(SENTENCES), atol=1e-5)
    stats = embedder.batch_stats.remote().result()
    assert stats["inputs"] == len(SENTENCES)
    assert max(stats["batch_size_histogram"]) > 1, stats
    assert stats["batches"] < len(SENTENCES)
    assert "serve_actual_batch_size" in stats["prometheus_metrics"]


def test_token_input_and_counting(embedder, local_encoder):
    text = "Token arrays embed like the text they spell."
    ids = local_encoder.token_ids(text)[1:-1]  # without [CLS]/[SEP]
    from_ids = embedder.embed_tokens.remote(ids).result()
    np.testing.assert_allclose(from_ids, local_encoder.encode([text])[0], atol=1e-5)
    assert embedder.count_tokens.remote(["one two", text]).result() == local_encoder.count_tokens(["one two", text])
    info = embedder.info.remote().result()
    assert (info["dimension"], info["max_tokens"]) == (384, 256)
    assert info["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    with pytest.raises(InvalidInputError):
        embedder.embed_tokens.remote([10**9]).result()


def test_over_long_input_is_a_typed_400(embedder):
    long_text = "word " * 300
    with pytest.raises(InputTooLongError) as info:
        embedder.embed.remote(long_text, index=3).result()
    err = info.value
    assert (err.index, err.token_count, err.max_tokens) == (3, 302, 256)
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "input")
    assert "302 tokens" in err.message
    with pytest.raises(InputTooLongError):
        embedder.embed_tokens.remote([2773] * 255).result()  # 255 + 2 special tokens > 256
    assert embedder.embed.remote(long_text, truncate=True).result().shape == (384,)


# --- vector stores --------------------------------------------------------------------------


def test_search_finds_the_right_document_first(retriever, corpus):
    store_id, file_ids = corpus
    cases = {
        "How do black holes form from collapsing stars?": "black_holes.md",
        "how long should spaghetti boil": "pasta.md",
        "What is the offside rule?": "football.txt",
    }
    for query, expected in cases.items():
        page = retriever.search.remote(store_id, query, max_num_results=5, caller=OP).result()
        assert page["object"] == "vector_store.search_results.page"
        assert page["search_query"] == [query] and page["has_more"] is False
        assert page["next_page"] is None
        top = page["data"][0]
        assert (top["file_id"], top["filename"]) == (file_ids[expected], expected), query
        assert top["attributes"] == {"filename": expected}
        assert top["content"][0]["type"] == "text" and top["content"][0]["text"]
        scores = [item["score"] for item in page["data"]]
        assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)


def test_search_options(retriever, corpus):
    store_id, file_ids = corpus
    query = ["black hole event horizon", "penalty area goalkeeper"]
    page = retriever.search.remote(store_id, query, max_num_results=50, caller=OP).result()
    assert page["search_query"] == query
    # Several queries: each chunk once, with its best score over the queries.
    best: dict[tuple[str, str], float] = {}
    for q in query:
        for item in retriever.search.remote(store_id, q, max_num_results=50, caller=OP).result()["data"]:
            key = (item["file_id"], item["content"][0]["text"])
            best[key] = max(best.get(key, 0.0), item["score"])
    merged = {(i["file_id"], i["content"][0]["text"]): i["score"] for i in page["data"]}
    assert merged == pytest.approx(best)
    tops = [page["data"][0]["file_id"], page["data"][1]["file_id"]]
    assert file_ids["black_holes.md"] in tops or file_ids["football.txt"] in tops
    only_pasta = retriever.search.remote(
        store_id, "black holes", filters={"type": "eq", "key": "filename", "value": "pasta.md"}, caller=OP
    ).result()
    assert {item["file_id"] for item in only_pasta["data"]} == {file_ids["pasta.md"]}
    strict = retriever.search.remote(
        store_id, "black holes", ranking_options={"score_threshold": 0.99}, caller=OP
    ).result()
    assert strict["data"] == []
    for bad in (
        {"query": ""},
        {"query": "x", "max_num_results": 0},
        {"query": ["x"] * 17},
        {"query": "x", "filters": {"type": "eq"}},
        {"query": "x", "ranking_options": {"score_threshold": 2}},
    ):
        with pytest.raises(InvalidInputError):
            retriever.search.remote(store_id, **bad, caller=OP).result()


def test_objects_follow_the_openai_schema(retriever, corpus):
    from openai.types import FileObject, VectorStore, VectorStoreDeleted
    from openai.types.vector_stores import VectorStoreFile

    store_id, file_ids = corpus
    store = retriever.get_store.remote(store_id, caller=OP).result()
    assert set(store) == {
        "id",
        "object",
        "created_at",
        "name",
        "usage_bytes",
        "file_counts",
        "status",
        "expires_at",
        "last_active_at",
        "metadata",
    }
    VectorStore.model_validate(store)
    assert store["file_counts"]["completed"] >= 3 and store["metadata"] == {"topic": "mixed"}
    vs_file = retriever.get_store_file.remote(store_id, file_ids["pasta.md"], caller=OP).result()
    VectorStoreFile.model_validate(vs_file)
    assert vs_file["chunking_strategy"] == {
        "type": "static",
        "static": {"max_chunk_size_tokens": 40, "chunk_overlap_tokens": 8},
    }
    assert vs_file["status"] == "completed" and vs_file["last_error"] is None
    FileObject.model_validate(retriever.get_file.remote(file_ids["pasta.md"], caller=OP).result())
    content = retriever.get_store_file_content.remote(store_id, file_ids["pasta.md"], caller=OP).result()
    assert content["object"] == "vector_store.file_content.page" and len(content["data"]) >= 2
    assert retriever.get_file_content.remote(file_ids["pasta.md"], caller=OP).result() == DOCS["pasta.md"].encode()
    listing = retriever.list_store_files.remote(store_id, limit=2, order="asc", caller=OP).result()
    assert len(listing["data"]) == 2 and listing["has_more"] is True
    temp = retriever.create_store.remote(name="temp", caller=OP).result()
    deleted = retriever.delete_store.remote(temp["id"], caller=OP).result()
    VectorStoreDeleted.model_validate(deleted)
    assert deleted == {"id": temp["id"], "object": "vector_store.deleted", "deleted": True}


def test_undecodable_file_fails_with_last_error(retriever, corpus):
    store_id, _ = corpus
    binary = retriever.create_file.remote(
        "image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00", "assistants", caller=OP
    ).result()
    added = retriever.add_file_to_store.remote(store_id, binary["id"], caller=OP).result()
    assert added["status"] == "failed"
    assert added["last_error"]["code"] == "unsupported_file"
    failed = retriever.list_store_files.remote(store_id, filter="failed", caller=OP).result()
    assert [f["id"] for f in failed["data"]] == [binary["id"]]
    assert retriever.get_store.remote(store_id, caller=OP).result()["file_counts"]["failed"] == 1
    assert retriever.delete_store_file.remote(store_id, binary["id"], caller=OP).result()["deleted"]
    assert retriever.get_store.remote(store_id, caller=OP).result()["file_counts"]["failed"] == 0


def test_retrieve_for_chat_is_deterministic(retriever, corpus):
    store_id, file_ids = corpus
    query = "Which black hole is in the middle of the Milky Way?"
    first = retriever.retrieve.remote(["docs"], None, query, 3, caller=OP).result()
    assert all(isinstance(p, Passage) for p in first) and len(first) == 3
    assert first[0].file_id == file_ids["black_holes.md"]
    assert (first[0].vector_store_id, first[0].vector_store_name) == (store_id, "docs")
    assert first[0].source == "black_holes.md" and "Sagittarius" in first[0].text
    assert [p.score for p in first] == sorted((p.score for p in first), reverse=True)
    again = retriever.retrieve.remote([store_id, "docs"], None, query, 3, caller=OP).result()
    assert again == first  # the same store twice
    high = retriever.retrieve.remote(["docs"], None, query, 3, 0.99, caller=OP).result()
    assert high == []
    # Requested stores must exist; the policy's may not (yet).
    with pytest.raises(CollectionNotFoundError):
        retriever.retrieve.remote(["docs"], ["no-such-store"], query, 3, caller=OP).result()
    lenient = retriever.retrieve.remote(["no-such-store", "docs"], None, query, 3, caller=OP)
    assert lenient.result() == first
    requested = retriever.retrieve.remote([], ["docs"], query, 3, caller=OP)  # its own store
    assert requested.result() == first


def test_deleting_a_file_removes_its_chunks(retriever, corpus):
    store_id, _ = corpus
    volcano = retriever.create_file.remote("volcano.txt", VOLCANO.encode(), "assistants", caller=OP).result()
    retriever.add_file_to_store.remote(store_id, volcano["id"], caller=OP).result()
    query = "lava and ash from an erupting volcano"
    before = retriever.search.remote(store_id, query, caller=OP).result()
    assert before["data"][0]["file_id"] == volcano["id"]
    deleted = retriever.delete_file.remote(volcano["id"], caller=OP).result()
    assert deleted == {"id": volcano["id"], "object": "file", "deleted": True}
    after = retriever.search.remote(store_id, query, caller=OP).result()
    assert volcano["id"] not in {item["file_id"] for item in after["data"]}
    with pytest.raises(DocumentNotFoundError):
        retriever.get_store_file.remote(store_id, volcano["id"], caller=OP).result()
    with pytest.raises(FileNotFoundInStoreError):
        retriever.get_file.remote(volcano["id"], caller=OP).result()


def test_errors_cross_ray_typed(retriever):
    with pytest.raises(CollectionNotFoundError) as info:
        retriever.get_store.remote("vs_missing", caller=OP).result()
    err = info.value
    assert isinstance(err, RetrievalError)
    assert (err.status, err.code, err.param) == (404, "vector_store_not_found", "vector_store_id")
    assert err.message == "No vector store found with id 'vs_missing'."
    with pytest.raises(InvalidInputError):
        retriever.create_file.remote("a.txt", b"x", "not-a-purpose", caller=OP).result()


def test_duplicate_store_names_are_allowed(retriever):
    a = retriever.create_store.remote(name="dup", caller=OP).result()
    b = retriever.create_store.remote(name="dup", caller=OP).result()
    assert a["id"] != b["id"]
    names = [s["name"] for s in retriever.list_stores.remote(limit=100, caller=OP).result()["data"]]
    assert names.count("dup") == 2
    for store in (a, b):
        retriever.delete_store.remote(store["id"], caller=OP).result()


def test_cli_ingest_through_an_sdk_shaped_client(retriever, tmp_path):
    from retrieval.cli import ingest_folder, search

    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    (folder / "tea.md").write_text("Green tea is steeped at about 80 degrees for two minutes.")
    (folder / "sub" / "trains.txt").write_text("High-speed trains run on dedicated tracks.")
    (folder / "empty.txt").write_text("   ")
    (folder / "skip.json").write_text("{}")
    client = HandleClient(retriever)
    summary = ingest_folder(client, folder, "cli-notes", progress=False)
    assert (summary.files, len(summary.failures)) == (2, 1)
    assert summary.failures[0][0] == "empty.txt" and "invalid_file" in summary.failures[0][1]
    assert summary.chunks == 2 and summary.uncounted == 0
    hits = search(client, "cli-notes", "how hot should the water be for tea", top=2)
    assert hits[0].filename == "tea.md" and hits[0].attributes == {"path": "tea.md"}
    again = ingest_folder(client, folder, "cli-notes", ["**/*.md"], progress=False)
    assert again.store_id == summary.store_id and again.files == 1


def test_a_local_query_encoder_finds_what_the_embedder_finds(retriever, corpus, storage):
    """The gateway's default (``retrieval.query_embedding: local``): a second Retriever on the
    same storage embeds queries with its own int8 ONNX encoder, makes no call to its Embedder
    for them, and ranks as the Embedder-backed one does."""
    store_id, _ = corpus
    config = _config(storage).model_copy(
        update={
            "query_encoder": EmbeddingModelConfig(
                model_path=default_models_dir() / "all-MiniLM-L6-v2", backend="onnx-int8", num_threads=1
            )
        }
    )
    app = APP + "-local-query"
    embedder = Embedder.options(ray_actor_options={"num_cpus": 0.1, "runtime_env": {"env_vars": OMP_ENV}}).bind(
        config.embedding
    )
    local = serve.run(
        Retriever.options(ray_actor_options={"num_cpus": 0.1}).bind(embedder, config), name=app, route_prefix=None
    )
    try:
        queries = ["How do black holes form from collapsing stars?", "how long should spaghetti boil", "offside"]
        for query in queries:
            shared_page = retriever.search.remote(store_id, query, max_num_results=3, caller=OP).result()
            local_page = local.search.remote(store_id, query, max_num_results=3, caller=OP).result()
            assert [d["file_id"] for d in local_page["data"]] == [d["file_id"] for d in shared_page["data"]]
            assert local_page["data"][0]["score"] == pytest.approx(shared_page["data"][0]["score"], abs=0.03)
            shared = retriever.retrieve.remote(["docs"], None, query, 3, caller=OP).result()
            found = local.retrieve.remote(["docs"], None, query, 3, caller=OP).result()
            assert [(p.file_id, p.chunk_index) for p in found][:1] == [(p.file_id, p.chunk_index) for p in shared][:1]
        stats = serve.get_deployment_handle("Embedder", app_name=app).batch_stats.remote().result()
        assert stats["inputs"] == 0  # every query was embedded in the Retriever replica
    finally:
        serve.delete(app)


# Last: restarts the application.
def test_state_survives_a_restart(retriever, corpus, storage):
    store_id, _ = corpus
    queries = ["offside position", "event horizon light", "salted boiling water"]
    before = [retriever.search.remote(store_id, q, caller=OP).result() for q in queries]
    passages = retriever.retrieve.remote(["docs"], None, queries[1], 4, caller=OP).result()
    listing = retriever.list_store_files.remote(store_id, caller=OP).result()
    serve.delete(APP)
    restarted, _ = _start(storage)
    assert [restarted.search.remote(store_id, q, caller=OP).result() for q in queries] == before
    assert restarted.retrieve.remote(["docs"], None, queries[1], 4, caller=OP).result() == passages
    assert restarted.list_store_files.remote(store_id, caller=OP).result() == listing


class HandleClient:
    """The slice of ``openai.OpenAI`` the CLI uses, answered by the Retriever handle.

    Responses go through the SDK's own models, so the CLI sees what it would over HTTP.
    """

    def __init__(self, handle):
        from types import SimpleNamespace

        from openai.types import FileObject, VectorStore
        from openai.types.vector_stores import VectorStoreFile

        h = handle
        self.files = SimpleNamespace(
            create=lambda file, purpose: FileObject.model_validate(
                h.create_file.remote(file[0], file[1], purpose, caller=OP).result()
            )
        )
        files = SimpleNamespace(
            create=lambda store_id, file_id, attributes=None: VectorStoreFile.model_validate(
                h.add_file_to_store.remote(store_id, file_id, attributes, caller=OP).result()
            ),
            content=lambda file_id, vector_store_id: [
                SimpleNamespace(**item)
                for item in h.get_store_file_content.remote(vector_store_id, file_id, caller=OP).result()["data"]
            ],
        )
        self.vector_stores = SimpleNamespace(
            list=lambda limit=20: [
                VectorStore.model_validate(s) for s in h.list_stores.remote(limit=limit, caller=OP).result()["data"]
            ],
            create=lambda name: VectorStore.model_validate(h.create_store.remote(name=name, caller=OP).result()),
            files=files,
            search=lambda store_id, query, max_num_results: self._search(h, store_id, query, max_num_results),
        )

    @staticmethod
    def _search(h, store_id, query, max_num_results):
        from openai.types import VectorStoreSearchResponse

        page = h.search.remote(store_id, query, max_num_results=max_num_results, caller=OP).result()
        return [VectorStoreSearchResponse.model_validate(item) for item in page["data"]]
