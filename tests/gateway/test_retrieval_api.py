"""Embeddings, files, vector stores and the retrieval stage, through the official SDK."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest

EMBEDDING_MODEL = "all-MiniLM-L6-v2"
DOCS = {
    "vacation.md": "# Vacation policy\n\nEvery employee gets 27 paid vacation days per year. Vacation requests go through the HR portal at least two weeks ahead.",
    "security.md": "# Office security\n\nVisitors must sign in at the front desk and wear a visitor badge. Lost badges are reported to facilities.",
    "sourdough.md": "# Sourdough\n\nFeed the starter with flour and water the night before baking. Bake the loaf at 250 degrees for forty minutes.",
}


@pytest.fixture(scope="module")
def handbook(gateway_url):
    """A vector store named like the scripted-guarded model's retrieval policy says."""
    from tests.conftest import API_KEY

    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    store = client.vector_stores.create(name="handbook")
    files = {}
    for name, text in DOCS.items():
        uploaded = client.files.create(file=(name, text.encode()), purpose="assistants")
        added = client.vector_stores.files.create(vector_store_id=store.id, file_id=uploaded.id)
        assert added.status == "completed"
        files[name] = uploaded.id
    return store, files


def test_embeddings_shapes_and_order(client):
    texts = ["the cat sat on the mat", "a kitten rests on a rug", "quarterly tax filing deadline"]
    out = client.embeddings.create(model=EMBEDDING_MODEL, input=texts)
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == EMBEDDING_MODEL
    vectors = np.array([d.embedding for d in out.data])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    sims = vectors @ vectors.T
    assert sims[0, 1] > sims[0, 2]  # similar sentences are closer
    assert out.usage.prompt_tokens > 3 and out.usage.total_tokens == out.usage.prompt_tokens
    single = client.embeddings.create(model=EMBEDDING_MODEL, input=texts[2])
    assert np.allclose(single.data[0].embedding, vectors[2], atol=1e-5)


def test_embeddings_base64_and_token_arrays(http):
    as_float = http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "hello world"}).json()
    as_b64 = http.post(
        "/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": "hello world", "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, as_float["data"][0]["embedding"], atol=1e-6)
    # MiniLM's own token ids for "hello world" (without [CLS]/[SEP]).
    tokens = http.post("/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": [[7592, 2088]]}).json()
    assert np.allclose(tokens["data"][0]["embedding"], as_float["data"][0]["embedding"], atol=1e-5)


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"model": EMBEDDING_MODEL, "input": ""}, 400, "invalid_value"),
        ({"model": EMBEDDING_MODEL, "input": []}, 400, "invalid_value"),
        ({"model": EMBEDDING_MODEL, "input": "word " * 400}, 400, "context_length_exceeded"),
        ({"model": EMBEDDING_MODEL, "input": "x", "encoding_format": "int8"}, 400, "invalid_value"),
        ({"model": "text-embedding-3-small", "input": "x"}, 404, "model_not_found"),
        ({"input": "x"}, 400, "missing_required_parameter"),
    ],
)
def test_embeddings_bad_input(http, body, status, code):
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_vector_store_search_finds_the_right_document(client, handbook):
    store, files = handbook
    page = client.vector_stores.search(vector_store_id=store.id, query="How many vacation days do I get?")
    assert page.data[0].file_id == files["vacation.md"]
    assert page.data[0].filename == "vacation.md" and 0 <= page.data[0].score <= 1
    assert "27 paid vacation days" in page.data[0].content[0].text
    listed = client.vector_stores.files.list(vector_store_id=store.id)
    assert sorted(f.id for f in listed.data) == sorted(files.values())
    assert client.vector_stores.retrieve(store.id).file_counts.completed == 3
    assert store.id in [s.id for s in client.vector_stores.list().data]


def test_deleting_a_file_removes_it_from_search(client):
    store = client.vector_stores.create(name="scratch")
    kept = client.files.create(file=("kept.txt", b"Penguins live in the southern hemisphere."), purpose="assistants")
    gone = client.files.create(file=("gone.txt", b"The penguin colony count was 4512 last year."), purpose="assistants")
    for f in (kept, gone):
        client.vector_stores.files.create(vector_store_id=store.id, file_id=f.id)
    client.vector_stores.files.delete(file_id=gone.id, vector_store_id=store.id)
    hits = client.vector_stores.search(vector_store_id=store.id, query="penguin colony count").data
    assert [h.file_id for h in hits] == [kept.id]
    deleted = client.vector_stores.delete(store.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.vector_stores.retrieve(store.id)


def test_retrieval_errors(client, http):
    with pytest.raises(openai.NotFoundError) as err:
        client.vector_stores.search(vector_store_id="vs_missing", query="x")
    assert err.value.body["code"] == "vector_store_not_found"
    r = http.post("/v1/vector_stores", json={"name": "x", "colour": "blue"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "colour"
    r = http.post("/v1/files", content=b"not multipart", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_chat_gets_the_matching_passage(client, handbook, engine_events):
    store, files = handbook
    raw = client.chat.completions.with_raw_response.create(
        model="scripted-guarded", messages=[{"role": "user", "content": "How many vacation days per year?"}]
    )
    reply = raw.parse()
    assert reply.choices[0].message.content
    prompt = engine_events("started")[0]["prompt"]
    assert prompt.startswith("system: ") and "27 paid vacation days" in prompt
    # Sources name documents: not sent unless the policy or the request asks.
    assert "x-retrieval-sources" not in raw.headers and "sources" not in raw.http_response.json()
    raw = client.chat.completions.with_raw_response.create(
        model="scripted-guarded",
        messages=[{"role": "user", "content": "How many vacation days per year?"}],
        extra_body={"retrieval": {"return_sources": True}},
    )
    sources = json.loads(raw.headers["x-retrieval-sources"])
    assert sources[0]["file_id"] == files["vacation.md"] and sources[0]["vector_store_id"] == store.id


def test_sources_on_request_and_retrieval_switched_off(client, handbook, engine_events):
    _, files = handbook
    reply = client.chat.completions.create(
        model="scripted-guarded",
        messages=[{"role": "user", "content": "Where do visitors sign in?"}],
        extra_body={"retrieval": {"return_sources": True, "top_k": 1}},
    )
    assert [s["file_id"] for s in reply.model_extra["sources"]] == [files["security.md"]]
    client.chat.completions.create(
        model="scripted-guarded",
        messages=[{"role": "user", "content": "Where do visitors sign in?"}],
        extra_body={"retrieval": {"enabled": False}},
    )
    prompts = [e["prompt"] for e in engine_events("started")]
    assert "front desk" in prompts[0] and "front desk" not in prompts[1]


def test_same_passages_give_the_same_prompt_prefix(client, handbook, engine_events):
    for question in ("vacation days and visitor badges?", "visitor badges and vacation days?"):
        client.chat.completions.create(model="scripted-guarded", messages=[{"role": "user", "content": question}])
    first, second = (e["prompt"] for e in engine_events("started"))
    assert first.split("\nuser: ")[0] == second.split("\nuser: ")[0]


def test_retrieval_override_is_validated(http, handbook):
    body = {"model": "scripted-guarded", "messages": [{"role": "user", "content": "hi"}], "retrieval": {"top_k": 0}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "retrieval.top_k"
    body["model"], body["retrieval"] = "scripted", {"nonsense": 1}
    assert http.post("/v1/chat/completions", json=body).json()["error"]["code"] == "unknown_parameter"


def test_streaming_chat_carries_the_sources_header(gateway_url, handbook):
    from tests.conftest import API_KEY

    body = {
        "model": "scripted-guarded",
        "stream": True,
        "messages": [{"role": "user", "content": "How do I feed the sourdough starter?"}],
        "retrieval": {"return_sources": True},
    }
    with httpx.stream(
        "POST", gateway_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as r:
        assert r.status_code == 200
        sources = json.loads(r.headers["x-retrieval-sources"])
        text = "".join(r.iter_text())
    assert sources[0]["filename"] == "sourdough.md" and text.endswith("data: [DONE]\n\n")
