"""Tenants kept apart: files and vector stores belong to the key that made them.

Alice and Bob are two principals of the keys file; the operator's key (admin scope) owns the
stores a model's retrieval policy names. Each assertion would fail if the owner check went.
"""

from __future__ import annotations

import openai
import pytest

from tests.conftest import API_KEY

MODEL = "scripted-guarded"  # its retrieval policy names the store "handbook"


@pytest.fixture(scope="module")
def alices(gateway_url, tenant_keys):
    alice = openai.OpenAI(
        base_url=gateway_url + "/v1", api_key=tenant_keys["keys"]["alice"][-1], max_retries=0, timeout=60
    )
    uploaded = alice.files.create(
        file=("alice-notes.md", b"# Notes\n\nThe launch code word is ALICE-ONLY-ORCHID."), purpose="assistants"
    )
    store = alice.vector_stores.create(name="notes", file_ids=[uploaded.id])
    return alice, uploaded, store


def test_another_tenant_sees_nothing(tenant, alices):
    alice, uploaded, store = alices
    bob = tenant("bob")
    assert uploaded.id not in [f.id for f in bob.files.list()]
    assert store.id not in [s.id for s in bob.vector_stores.list()]
    denied = [
        lambda: bob.files.retrieve(uploaded.id),
        lambda: bob.files.content(uploaded.id),
        lambda: bob.files.delete(uploaded.id),
        lambda: bob.vector_stores.retrieve(store.id),
        lambda: bob.vector_stores.update(store.id, name="mine now"),
        lambda: bob.vector_stores.search(vector_store_id=store.id, query="launch code"),
        lambda: bob.vector_stores.files.list(vector_store_id=store.id),
        lambda: bob.vector_stores.files.retrieve(vector_store_id=store.id, file_id=uploaded.id),
        lambda: bob.vector_stores.files.delete(vector_store_id=store.id, file_id=uploaded.id),
        lambda: bob.vector_stores.delete(store.id),
    ]
    for attempt in denied:
        with pytest.raises(openai.NotFoundError):
            attempt()
    # Bob cannot pull Alice's file into his own store either.
    bobs = bob.vector_stores.create(name="bob")
    with pytest.raises(openai.NotFoundError):
        bob.vector_stores.files.create(vector_store_id=bobs.id, file_id=uploaded.id)
    # Nothing of Alice's was touched.
    assert alice.vector_stores.retrieve(store.id).name == "notes"
    hits = alice.vector_stores.search(vector_store_id=store.id, query="launch code word")
    assert "ALICE-ONLY-ORCHID" in hits.data[0].content[0].text
    assert alice.files.content(uploaded.id).read().endswith(b"ALICE-ONLY-ORCHID.")


def test_a_request_may_only_name_its_own_stores(tenant, alices, engine_events):
    alice, _, store = alices
    bob = tenant("bob")
    question = [{"role": "user", "content": "What is the launch code word?"}]
    with pytest.raises(openai.NotFoundError):
        bob.chat.completions.create(
            model=MODEL, messages=question, extra_body={"retrieval": {"collections": [store.id]}}
        )
    with pytest.raises(openai.NotFoundError):
        bob.chat.completions.create(
            model=MODEL, messages=question, extra_body={"retrieval": {"collections": ["notes"]}}
        )
    assert all("ALICE-ONLY-ORCHID" not in e["prompt"] for e in engine_events("started"))
    alice.chat.completions.create(model=MODEL, messages=question, extra_body={"retrieval": {"collections": ["notes"]}})
    assert "ALICE-ONLY-ORCHID" in engine_events("started")[-1]["prompt"]


def test_a_tenants_store_named_like_the_policys_changes_nothing(gateway_url, tenant, engine_events):
    operator = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    official = operator.files.create(
        file=("parking.md", b"# Parking\n\nStaff park on level 3 of the garage."), purpose="assistants"
    )
    handbook = operator.vector_stores.create(name="handbook", file_ids=[official.id])
    bob = tenant("bob")
    planted = bob.files.create(
        file=("parking.md", b"# Parking\n\nStaff park on the roof, in the bays marked BOB-PLANTED."),
        purpose="assistants",
    )
    bob.vector_stores.create(name="handbook", file_ids=[planted.id])  # newer, same name
    for client in (bob, tenant("alice"), operator):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Where do staff park?"}])
        prompt = engine_events("started")[-1]["prompt"]
        assert "level 3 of the garage" in prompt and "BOB-PLANTED" not in prompt
    # The policy may also name a store by id.
    assert handbook.id.startswith("vs_")


def test_the_operator_manages_shared_stores_tenants_do_not_see(tenant, gateway_url):
    operator = openai.OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    shared = operator.vector_stores.create(name="shared-only")
    assert shared.id not in [s.id for s in tenant("alice").vector_stores.list()]
    with pytest.raises(openai.NotFoundError):
        tenant("alice").vector_stores.delete(shared.id)
    assert operator.vector_stores.delete(shared.id).deleted
