"""``retrieval.search_placement: ingress``: the chat path's searches run on a read-only copy of the
Retriever built in each ingress replica (gateway.local_stage), while the files and vector stores
API stays with the Retriever deployment. A second gateway application of the fast tier's config
with that setting (and the rails in the ingress, as the shipped config has them), on its own
storage, in front of the session's scripted engine: the copy must find what the deployment
wrote, catch up with every later write and delete, and be what answers the chat path."""

from __future__ import annotations

import dataclasses
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import API_KEY
from tests.gateway.test_metrics import EXPORT_TIMEOUT_S, ray_session_dir

APP = "search-in-ingress"
MODEL = "scripted-guarded"  # its retrieval policy searches the operator's store named "handbook"


@pytest.fixture(scope="module")
def in_ingress(fast_gateway, tmp_path_factory):
    from ray import serve

    from gateway.app import build_gateway
    from gateway.config import load_config
    from gateway.deploy import policy_user_config

    overrides = {
        **fast_gateway.overrides,
        "guardrails": {"num_cpus": 0.1, "placement": "ingress"},
        "retrieval": {"storage_dir": str(tmp_path_factory.mktemp("search-in-ingress")), "search_placement": "ingress"},
    }
    config = load_config(fast_gateway.configs / "gateway.yaml", port=fast_gateway.port, **overrides)
    i = [m.model_id for m in config.models].index(MODEL)
    config = dataclasses.replace(config, models=[config.models[i]], model_files=[config.model_files[i]])
    serve.run(build_gateway(config, user_config=policy_user_config(config)), name=APP, route_prefix="/" + APP)
    url = f"http://127.0.0.1:{fast_gateway.port}/{APP}"
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
            yield client
    finally:
        serve.delete(APP)


def retriever_calls() -> float:
    """Calls the Retriever deployment of this application has answered (Serve's own counter)."""
    (port_file,) = ray_session_dir().glob("metrics_export_port_*")
    text = httpx.get(f"http://127.0.0.1:{port_file.read_text().strip()}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "ray_serve_deployment_request_counter_total"
        and s.labels.get("application") == APP
        and s.labels.get("deployment") == "Retriever"
    )


def wait_for_retriever_calls(before: float, calls: int) -> None:
    """Wait until the counter moved by ``calls``, then check it moved by exactly that."""
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while (moved := retriever_calls() - before) < calls:
        assert time.monotonic() < deadline, f"the Retriever's counter moved by {moved}, expected {calls}"
        time.sleep(1)
    assert moved == calls, f"the Retriever answered {moved} calls, expected only the {calls} API calls"


def _ask(client: openai.OpenAI, question: str, **retrieval) -> list[dict]:
    """The chat's sources: what the search found for ``question``."""
    import json

    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        extra_body={"retrieval": {"return_sources": True, **retrieval}},
    )
    assert raw.http_response.status_code == 200, raw.http_response.text
    return json.loads(raw.headers["x-retrieval-sources"])


def test_no_searcher_deployment_and_the_api_still_goes_to_the_retriever(in_ingress):
    from ray import serve

    deployments = set(serve.status().applications[APP].deployments)
    assert {"Gateway", "Retriever", "Embedder"} <= deployments and "Guardrails" not in deployments, deployments


def test_the_copy_in_the_ingress_answers_chats_and_follows_the_deployments_writes(in_ingress, engine_events):
    client = in_ingress
    # Written through the API: the Retriever deployment (the ingress copy opened the storage
    # empty at start-up and must catch up).
    store = client.vector_stores.create(name="handbook")
    vacation = client.files.create(
        file=("vacation.md", b"Every employee gets 27 paid vacation days per year."), purpose="assistants"
    )
    assert client.vector_stores.files.create(vector_store_id=store.id, file_id=vacation.id).status == "completed"

    sources = _ask(client, "How many vacation days per year?")  # the policy's store, by name
    assert [s["file_id"] for s in sources][:1] == [vacation.id], sources
    assert "27 paid vacation days" in engine_events("started")[0]["prompt"]

    # A later write through the deployment is searched by the next chat.
    badge = client.files.create(
        file=("security.md", b"Lost visitor badges are reported to facilities at once."), purpose="assistants"
    )
    assert client.vector_stores.files.create(vector_store_id=store.id, file_id=badge.id).status == "completed"
    sources = _ask(client, "What do I do about a lost visitor badge?", collections=[store.id])
    assert sources and sources[0]["file_id"] == badge.id, sources

    # So is a file taken out of the store, and the store's deletion.
    client.vector_stores.files.delete(file_id=badge.id, vector_store_id=store.id)
    sources = _ask(client, "What do I do about a lost visitor badge?", collections=[store.id])
    assert badge.id not in [s["file_id"] for s in sources], sources
    assert client.vector_stores.delete(store.id).deleted
    with pytest.raises(openai.NotFoundError):
        _ask(client, "How many vacation days per year?", collections=[store.id])
    # The chats' searches never reached the Retriever deployment (new with this application):
    # only the seven API calls did (a store, two uploads, two adds, a removal, a deletion).
    wait_for_retriever_calls(0, 7)


def test_building_the_app_leaves_the_stage_classes_as_they_are(in_ingress):
    """The stages in the ingress travel as import paths (gateway.local_stage). As class objects,
    Serve's build pickled them by value and unpickled them in this process, which replaced their
    methods with copies bound to a private globals dict: monkeypatching the module no longer
    reached them (tests/retrieval/test_retrieval_tenancy.py broke after this module ran)."""
    from guardrails import deployment
    from retrieval import service

    assert service.Retriever.func_or_class.__init__.__globals__ is service.__dict__
    assert deployment.Guardrails.func_or_class.__init__.__globals__ is deployment.__dict__


def test_searches_in_the_ingress_need_its_own_query_encoder():
    from pydantic import ValidationError

    from gateway.config import RetrievalSettings

    assert RetrievalSettings(search_placement="ingress").search_placement == "ingress"
    with pytest.raises(ValidationError, match="query_embedding: local"):
        RetrievalSettings(search_placement="ingress", query_embedding="shared")
