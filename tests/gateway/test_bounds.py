"""Every resource bounded, every refusal a clean, retryable OpenAI error.

Bodies and lists through the fast tier's gateway (its upload limit is small in
tests/fixtures/gateway.yaml); timeouts and full queues through a dedicated small gateway
application (``bounds``, under ``/bounds``) whose engine takes one request at a time and queues
one more, with timeouts of a second or two. The stage-failure policies (retrieval's
``on_error``, the rails' timeout) are checked on ``gateway.chat_stages`` with stand-in handles.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from tests.conftest import API_KEY, API_KEYS_ENV

BOUNDS_APP = "bounds"
BOUNDS_MODEL = "scripted-bounds"
SCRIPTED_ENGINE = "engines.scripted_engine:ScriptedEngine"
BOUNDS_GATEWAY_YAML = """
host: 127.0.0.1
models: [bounds-model.yaml]
max_request_bytes: 4096
timeouts: {guardrails_s: 1, retrieval_s: 1, first_token_s: 1, stream_idle_s: 1, total_s: 3}
retry_after_s: 2
ingress: {num_cpus: 0.05}
embedding: {enabled: false}
retrieval: {enabled: false}
guardrails: {enabled: false}
"""
BOUNDS_MODEL_YAML = f"""
model_id: {BOUNDS_MODEL}
source: {{path: /nonexistent/scripted}}
engine: {{stream_batching_interval_ms: 0}}
placement: {{accelerator: cpu, cpus_per_worker: 0.05}}
deployment: {{max_ongoing_requests: 1, max_queued_requests: 1}}
"""


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _events(response: httpx.Response) -> list:
    """The SSE payloads of a streamed response, ``"[DONE]"`` as a string."""
    out = []
    for block in response.text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def _wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()


# --- the dedicated small gateway ---------------------------------------------------------


@pytest.fixture(scope="module")
def bounds_url(ray_session, recorder, tmp_path_factory):
    """A gateway application of its own (and its model's engine application), deployed beside
    the fast tier's; removed afterwards."""
    from ray import serve

    from engines.app import build_engine_app
    from gateway.app import build_gateway
    from gateway.config import load_config
    from gateway.deploy import engine_app_name, engine_deployment_name, policy_user_config

    folder = tmp_path_factory.mktemp("bounds")
    (folder / "gateway.yaml").write_text(BOUNDS_GATEWAY_YAML)
    (folder / "bounds-model.yaml").write_text(BOUNDS_MODEL_YAML)
    config = load_config(folder / "gateway.yaml", port=ray_session, auth={"api_keys_env": API_KEYS_ENV})
    model = config.models[0]
    engine_app = engine_app_name(model.model_id)
    engine_args = {
        "engine": model.engine_spec().model_dump(mode="json"),
        "deployment_name": engine_deployment_name(model.model_id),
        "engine_cls": SCRIPTED_ENGINE,
    }
    serve.run(build_engine_app(engine_args), name=engine_app, route_prefix=None)
    serve.run(build_gateway(config, user_config=policy_user_config(config)), name=BOUNDS_APP, route_prefix="/bounds")
    yield f"http://127.0.0.1:{ray_session}/bounds"
    serve.delete(BOUNDS_APP)
    serve.delete(engine_app)


@pytest.fixture
def bounds(bounds_url):
    with httpx.Client(base_url=bounds_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        yield c


def _chat(prompt: str, **extra) -> dict:
    return {"model": BOUNDS_MODEL, "messages": [{"role": "user", "content": prompt}], **extra}


def test_first_token_timeout_is_a_504_before_the_stream_starts(bounds, engine_events):
    started = time.monotonic()
    r = bounds.post(
        "/v1/completions",
        json={"model": BOUNDS_MODEL, "prompt": "[[tokens:3]][[delay-ms:4000]]", "stream": True},
    )
    elapsed = time.monotonic() - started
    assert r.status_code == 504, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = _error(r)
    assert err["code"] == "engine_timeout" and "1 s" in err["message"]
    assert elapsed < 3.5
    # The engine call was cancelled: the scripted engine recorded it stopping.
    assert _wait_for(lambda: engine_events("cancelled"))


def test_whole_answer_past_total_is_a_504(bounds, engine_events):
    started = time.monotonic()
    r = bounds.post("/v1/chat/completions", json=_chat("[[tokens:10]][[delay-ms:500]]"))
    assert r.status_code == 504, r.text
    assert _error(r)["code"] == "engine_timeout"
    assert time.monotonic() - started < 5
    assert _wait_for(lambda: engine_events("cancelled"))


def test_stalled_stream_ends_with_an_error_event_and_done(bounds, engine_events):
    # The role chunk comes at once, then nothing for 4 s: past stream_idle_s (1 s).
    started = time.monotonic()
    r = bounds.post("/v1/chat/completions", json=_chat("[[tokens:3]][[delay-ms:4000]]", stream=True))
    elapsed = time.monotonic() - started
    assert r.status_code == 200
    events = _events(r)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = events[-2]["error"]
    assert error["code"] == "engine_timeout" and "nothing for 1 s" in error["message"]
    assert not any("t0" in str(e) for e in events)
    assert elapsed < 3.5
    assert _wait_for(lambda: engine_events("cancelled"))
    assert not engine_events("finished")


def test_stream_past_total_time_is_stopped(bounds, engine_events):
    # A token every 0.4 s never stalls the stream, but 20 of them outlast total_s (3 s).
    started = time.monotonic()
    r = bounds.post("/v1/chat/completions", json=_chat("[[tokens:20]][[delay-ms:400]]", stream=True))
    elapsed = time.monotonic() - started
    events = _events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_timeout"
    assert any("t0" in str(e) for e in events)  # it was streaming before it was stopped
    assert 2.5 < elapsed < 5
    assert _wait_for(lambda: engine_events("cancelled"))


def test_full_engine_queue_is_a_503_with_retry_after(bounds_url, engine_events):
    """The engine takes 1 request and queues 1: of 8 at once, the rest are refused at once,
    before the first served request (0.6 s of engine time) is done: none waited for a slot."""

    def send(i: int) -> tuple[int, float, httpx.Response]:
        with httpx.Client(base_url=bounds_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
            r = c.post("/v1/chat/completions", json=_chat(f"[[tokens:3]][[delay-ms:200]] {i}"))
        return r.status_code, time.monotonic(), r

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(8)))
    statuses = sorted(s for s, _, _ in results)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 1 and statuses.count(503) >= 5, statuses
    first_served = min(done for status, done, _ in results if status == 200)
    for status, done, r in results:
        if status == 503:
            err = _error(r)
            assert err["code"] == "engine_overloaded" and err["type"] == "service_unavailable_error"
            assert r.headers["retry-after"] == "2"
            assert done < first_served
    # Served afterwards as usual.
    with httpx.Client(base_url=bounds_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        reply = c.post("/v1/chat/completions", json=_chat("[[say:ok]]"))
    assert reply.json()["choices"][0]["message"]["content"] == "ok"


def test_openai_sdk_retries_an_overload_and_gets_through(bounds_url, engine_events):
    """With Retry-After the SDK's own retry logic takes a refused request through: the patient
    client's first try is refused (one request runs, one waits: the queue is full) and a retry
    is answered. The holding requests go in one after the other: two arriving at once are both
    pending in Serve's router for an instant, and the second of them would be the one refused."""
    from openai import DefaultHttpxClient, OpenAI

    statuses: list[int] = []
    seen = DefaultHttpxClient(event_hooks={"response": [lambda r: statuses.append(r.status_code)]})
    hold = OpenAI(base_url=bounds_url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
    patient = OpenAI(base_url=bounds_url + "/v1", api_key=API_KEY, max_retries=3, timeout=30, http_client=seen)

    def holding(tag: str):
        prompt = f"[[tokens:3]][[delay-ms:300]] {tag}"
        return pool.submit(
            hold.chat.completions.create, model=BOUNDS_MODEL, messages=[{"role": "user", "content": prompt}]
        )

    with ThreadPoolExecutor(3) as pool:
        busy = [holding("a")]
        assert _wait_for(lambda: engine_events("started")), "the first holding request never reached the engine"
        busy.append(holding("b"))
        time.sleep(0.3)  # the second one waits in the queue
        reply = patient.chat.completions.create(
            model=BOUNDS_MODEL, messages=[{"role": "user", "content": "[[say:through]]"}]
        )
        for f in busy:
            f.result()
    assert reply.choices[0].message.content == "through"
    assert statuses[0] == 503 and statuses[-1] == 200, statuses


def test_bounds_app_body_limit(bounds, engine_events):
    r = bounds.post("/v1/chat/completions", json=_chat("x" * 5000))
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
    assert not engine_events("started")


# --- bodies, uploads and lists on the fast tier's gateway ---------------------------------


def _chunked(total: int, piece: int = 4096):
    """A body of ``total`` bytes sent with Transfer-Encoding: chunked (no Content-Length)."""
    sent = 0
    while sent < total:
        n = min(piece, total - sent)
        sent += n
        yield b" " * n


def test_chunked_json_body_over_the_limit_is_413_and_stores_nothing(http, engine_events):
    # 200 KB against the fast tier's 64 KB limit, no Content-Length.
    head = b'{"name": "bounds-chunked", "metadata": {"pad": "'
    body = head + b"x" * 200_000 + b'"}}'
    pieces = iter([body[i : i + 8192] for i in range(0, len(body), 8192)])
    r = http.post("/v1/vector_stores", content=pieces, headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    assert _error(r)["code"] == "request_too_large"
    names = [s["name"] for s in http.get("/v1/vector_stores", params={"limit": 100}).json()["data"]]
    assert "bounds-chunked" not in names
    chat = b'{"model": "scripted", "messages": [{"role": "user", "content": "' + b"y" * 100_000 + b'"}]}'
    r = http.post(
        "/v1/chat/completions",
        content=iter([chat[i : i + 8192] for i in range(0, len(chat), 8192)]),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
    assert not engine_events("started")


def _multipart(size: int, boundary: str = "bounds-boundary"):
    """A multipart upload whose file part has ``size`` bytes, streamed in pieces."""
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.txt"\r\n'
        "Content-Type: text/plain\r\n\r\n"
    ).encode()
    for chunk in _chunked(size, 65536):
        yield chunk.replace(b" ", b"a")
    yield f"\r\n--{boundary}--\r\n".encode()


def test_upload_over_the_limit_is_413_and_keeps_no_file(http, gateway_url):
    before = {f["id"] for f in http.get("/v1/files").json()["data"]}
    headers = {"Content-Type": "multipart/form-data; boundary=bounds-boundary"}
    # Chunked: 2 MB against the fast tier's 256 KiB limit.
    r = http.post("/v1/files", content=_multipart(2_000_000), headers=headers)
    assert "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    err = _error(r)
    assert err["code"] == "request_too_large" and "262144" in err["message"]
    # With an honest Content-Length it is refused before the body is read.
    body = b"".join(_multipart(400_000))
    r = http.post("/v1/files", content=body, headers=headers)
    assert r.status_code == 413 and "262144" in _error(r)["message"]
    after = {f["id"] for f in http.get("/v1/files").json()["data"]}
    assert after == before
    # A file under the limit still goes through, and the gateway serves normally.
    r = http.post("/v1/files", content=b"".join(_multipart(1000)), headers=headers)
    assert r.status_code == 200, r.text
    http.delete(f"/v1/files/{r.json()['id']}")


def test_upload_with_too_many_files_is_400(http):
    boundary = "bounds-boundary"
    parts = "".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="f{i}.txt"\r\n\r\nhello\r\n'
        for i in range(3)
    )
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n{parts}--{boundary}--\r\n'
    )
    r = http.post(
        "/v1/files", content=body.encode(), headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    assert r.status_code == 400, r.text
    assert _error(r)["param"] == "file"


def test_file_past_the_index_limit_fails_naming_it(client):
    store = client.vector_stores.create(name="bounds-index-limit")
    try:
        big = client.files.create(file=("big.txt", b"word " * 40_000), purpose="assistants")  # 200 KB
        added = client.vector_stores.files.create(vector_store_id=store.id, file_id=big.id)
        assert added.status == "failed"
        assert added.last_error.code == "invalid_file" and "131072" in added.last_error.message
        client.files.delete(big.id)
    finally:
        client.vector_stores.delete(store.id)


def test_long_lists_are_400_naming_the_field(http):
    store = http.post("/v1/vector_stores", json={"name": "bounds-lists"}).json()["id"]
    try:
        r = http.post(f"/v1/vector_stores/{store}/search", json={"query": [f"q{i}" for i in range(17)]})
        assert r.status_code == 400 and _error(r)["param"] == "query"
        r = http.post(f"/v1/vector_stores/{store}/search", json={"query": "q", "max_num_results": 51})
        assert r.status_code == 400 and _error(r)["param"] == "max_num_results"
        deep: dict = {"type": "eq", "key": "k", "value": 1}
        for _ in range(20):
            deep = {"type": "and", "filters": [deep]}
        r = http.post(f"/v1/vector_stores/{store}/search", json={"query": "q", "filters": deep})
        assert r.status_code == 400 and _error(r)["param"] == "filters"
        wide = {"type": "or", "filters": [{"type": "eq", "key": "k", "value": i} for i in range(100)]}
        r = http.post(f"/v1/vector_stores/{store}/search", json={"query": "q", "filters": wide})
        assert r.status_code == 400 and _error(r)["param"] == "filters"
        r = http.post(
            f"/v1/vector_stores/{store}/search",
            json={"query": "q", "filters": {"type": "in", "key": "k", "value": list(range(300))}},
        )
        assert r.status_code == 400 and _error(r)["param"] == "filters"
    finally:
        http.delete(f"/v1/vector_stores/{store}")
    r = http.post("/v1/vector_stores", json={"name": "bounds-ids", "file_ids": [f"file-{i}" for i in range(101)]})
    assert r.status_code == 400 and _error(r)["param"] == "file_ids"
    r = http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": ["a"] * 2049})
    assert r.status_code == 400 and _error(r)["param"] == "input"
    # The gateway still answers.
    assert http.get("/health").status_code == 200


# --- stage failures: the policy decides (chat_stages with stand-in handles) -------------------


class _Call:
    """Stands in for a ``DeploymentResponse``: awaitable, cancellable."""

    def __init__(self, result=None, *, error: BaseException | None = None, delay_s: float = 0.0):
        self._result, self._error, self._delay_s = result, error, delay_s
        self.cancelled = False

    def __await__(self):
        return self._run().__await__()

    async def _run(self):
        await asyncio.sleep(self._delay_s)
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self):
        self.cancelled = True


class _Method:
    def __init__(self, call: _Call):
        self.call = call

    def remote(self, *args, **kwargs):
        return self.call


class _Handle:
    def __init__(self, **methods: _Call):
        for name, call in methods.items():
            setattr(self, name, _Method(call))


def _retrieve(retriever, guard=None, **policy):
    from gateway.chat_stages import PendingSearch, RetrievalRequest, retrieved_passages
    from guardrails.config import GuardrailPolicy
    from retrieval.config import RetrievalPolicy
    from retrieval.tenancy import Caller

    rp = RetrievalPolicy(enabled=True, collections=["docs"], **policy)
    gp = GuardrailPolicy(enabled=guard is not None)
    messages = [{"role": "user", "content": "how many vacation days?"}]

    async def run():
        search = PendingSearch(
            retriever, "m", rp, RetrievalRequest(), Caller("operator", admin=True), timeout_s=0.2, retry_after_s=2
        ).submit(messages)
        return await retrieved_passages(search, guard, gp, messages, guardrails_timeout_s=0.2, retry_after_s=2)

    passages = asyncio.run(run())
    return passages, messages


def _passage():
    from retrieval.records import Passage

    return Passage(
        score=0.9,
        vector_store_id="vs_1",
        vector_store_name="docs",
        file_id="file-1",
        filename="a.txt",
        chunk_index=0,
        text="Ten days.",
        attributes={},
    )


def test_retrieval_timeout_answers_without_passages_or_fails_as_the_policy_says():
    from gateway.errors import APIError

    slow = _Call([], delay_s=5)
    passages, messages = _retrieve(_Handle(retrieve=slow))
    assert passages == [] and len(messages) == 1 and slow.cancelled
    with pytest.raises(APIError) as info:
        _retrieve(_Handle(retrieve=_Call([], delay_s=5)), on_error="fail")
    assert info.value.status == 504 and info.value.code == "retrieval_timeout"


def test_retrieval_failure_degrades_and_client_errors_stay_4xx():
    from ray.serve.exceptions import BackPressureError

    from gateway.errors import APIError
    from retrieval.errors import CollectionNotFoundError

    passages, _ = _retrieve(_Handle(retrieve=_Call(error=RuntimeError("replica died"))))
    assert passages == []
    with pytest.raises(APIError) as info:
        _retrieve(_Handle(retrieve=_Call(error=BackPressureError(3, 3, 503, None))), on_error="fail")
    assert info.value.status == 503 and info.value.code == "retrieval_overloaded"
    assert info.value.headers == {"Retry-After": "2"}
    with pytest.raises(APIError) as info:
        _retrieve(_Handle(retrieve=_Call(error=CollectionNotFoundError("no such store", param="collections"))))
    assert info.value.status == 404


def test_failed_passage_check_never_lets_unchecked_passages_through():
    from gateway.errors import APIError

    retriever = _Handle(retrieve=_Call([_passage()]))
    guard = _Handle(check_passages=_Call(error=RuntimeError("rails down")))
    passages, messages = _retrieve(retriever, guard)
    assert passages == [] and len(messages) == 1
    with pytest.raises(APIError) as info:
        _retrieve(retriever, _Handle(check_passages=_Call([], delay_s=5)), on_error="fail")
    assert info.value.status == 504 and info.value.code == "guardrails_timeout"


def test_input_rails_timeout_is_a_504_unless_the_policy_fails_open():
    from gateway.chat_stages import TextSlot, input_rails
    from gateway.errors import APIError
    from guardrails.config import GuardrailPolicy

    def run(policy, call):
        slots = [TextSlot({"content": "hello"}, "content", "user")]
        return asyncio.run(input_rails(_Handle(check_input=call), "m", policy, slots, timeout_s=0.2))

    slow = _Call(delay_s=5)
    with pytest.raises(APIError) as info:
        run(GuardrailPolicy(enabled=True), slow)
    assert info.value.status == 504 and info.value.code == "guardrails_timeout" and slow.cancelled
    assert run(GuardrailPolicy(enabled=True, fail_open=True), _Call(delay_s=5)).redacted is False
