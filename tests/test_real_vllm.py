"""Real tier: the gateway started the way `make run` starts it, serving SmolLM2-135M-Instruct
through Ray Serve LLM and vLLM on CPU, driven with the official openai SDK.

The gateway boots once for the whole module (about 90 s on 2 cores), with auth on: a keys file
with an `operator` (every scope; the `client` fixture) and a `tenant` (chat only, one model).
Its gateway.yaml, model file and keys file are copies in a temporary folder, so tests can
rotate keys and edit the model's policy while it serves, without touching the repository.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import new_key
from tests.real_gateway import EMBEDDING_MODEL, MODEL, GatewayProcess, replace_file

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def gateway_process(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("real-gateway"))
    gateway.start()
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def real_gateway(gateway_process) -> str:
    return gateway_process.url


@pytest.fixture
def operator_key(gateway_process) -> str:
    return gateway_process.keys["operator"][-1]


@pytest.fixture
def client(real_gateway, operator_key):
    return openai.OpenAI(base_url=real_gateway + "/v1", api_key=operator_key, max_retries=0, timeout=120)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL, EMBEDDING_MODEL]


def test_capital_of_france(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_stream_deltas_and_final_usage(client):
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 5
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    # The output rail re-chunks text (it releases what it has checked), so deltas are not
    # tokens; the same greedy request answered whole must carry the same text and counts.
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48)
    assert "".join(deltas) == whole.choices[0].message.content
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_eight_concurrent_streams_have_correct_framing(real_gateway, operator_key):
    def run(i: int) -> tuple[int, list[str]]:
        body = {
            "model": MODEL,
            "stream": True,
            "max_tokens": 24,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}],
        }
        headers = {"Authorization": f"Bearer {operator_key}"}
        with httpx.stream("POST", real_gateway + "/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
            return r.status_code, [e for e in "".join(r.iter_text()).split("\n\n") if e]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for status, events in results:
        assert status == 200
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]" and sum(e == "data: [DONE]" for e in events) == 1
        assert not any('"error"' in e for e in events)
        assert any('"finish_reason":"' in e for e in events[:-1])


def test_completions(client):
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert "Paris" in reply.choices[0].text


def test_validation_errors_are_openai_400(client):
    # Past the model's cap (requests.caps.max_tokens: 2048): the gateway refuses, naming the field.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)
    assert err.value.body["param"] == "max_tokens"
    # Under the cap but past the context window: vLLM refuses, and its error is OpenAI's body.
    long_prompt = [{"role": "user", "content": "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 260}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=long_prompt, max_tokens=2048)
    assert set(err.value.body) == {"message", "type", "param", "code"}


def test_a_chat_ui_request_gets_a_short_sensible_answer(gateway_process, client):
    """Chat UIs send neither max_tokens nor temperature: the model's request defaults decide
    (vLLM's own defaults, temperature 1.0 and no length limit, give SmolLM2 nonsense for minutes)."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    replies = [client.chat.completions.create(model=MODEL, messages=question) for _ in range(3)]
    # Sampled at the defaults: measured 20 of 20 right on this question (14 of 20 without the
    # repetition penalty); a 135M model is not always right, so two of three must be.
    assert sum("Paris" in r.choices[0].message.content for r in replies) >= 2, [
        r.choices[0].message.content for r in replies
    ]
    assert all(r.usage.completion_tokens <= 256 for r in replies)
    # A new default applies to the running model without a restart.
    original = gateway_process.model_file.read_text()
    policy = yaml.safe_load(original)
    policy["requests"]["defaults"]["max_tokens"] = 3
    replace_file(gateway_process.model_file, yaml.safe_dump(policy, sort_keys=False))
    try:
        out = gateway_process.apply()
        assert f"model {MODEL}: policy tier" in out and "requests.defaults.max_tokens" in out, out
        # apply returns once Serve has pushed it: the very next request has the new default.
        reply = client.chat.completions.create(model=MODEL, messages=question)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    finally:
        replace_file(gateway_process.model_file, original)
        gateway_process.apply()
    assert client.chat.completions.create(model=MODEL, messages=question).usage.completion_tokens > 3


FACT_DOC = (
    "Project Nimbus facts.\nThe launch code for Project Nimbus is BLUE-HERON-42.\n"
    "Project Nimbus is led by Dr. Amara Okafor and launches from the Kestrel Bay site."
)


def test_uploaded_fact_reaches_the_answer(client):
    """The model cannot know this fact; it answers it only from the retrieved passage."""
    store = client.vector_stores.create(name="docs")  # the collection the model's policy names
    uploaded = client.files.create(file=("nimbus.md", FACT_DOC.encode()), purpose="assistants")
    assert client.vector_stores.files.create(vector_store_id=store.id, file_id=uploaded.id).status == "completed"
    question = [{"role": "user", "content": "What is the launch code for Project Nimbus?"}]
    with_docs = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=40)
    assert "BLUE-HERON-42" in with_docs.choices[0].message.content
    without = client.chat.completions.create(
        model=MODEL, messages=question, temperature=0, max_tokens=40, extra_body={"retrieval": {"enabled": False}}
    )
    assert "BLUE-HERON-42" not in without.choices[0].message.content


def test_input_rail_blocks_a_card_number(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "charge 4111 1111 1111 1111"}]
        )
    assert err.value.body["code"] == "pii_blocked"


def wait_until(check, timeout_s: float, what: str, interval_s: float = 0.5):
    """Poll ``check`` until it returns something truthy; that value, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(interval_s)


def models_call(url: str, key: str | None) -> httpx.Response:
    """The cheapest authenticated call: GET /v1/models."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url + "/v1/models", headers=headers, timeout=30)


def test_a_key_rotates_while_serving(gateway_process, real_gateway):
    pid, boots = gateway_process.proc.pid, gateway_process.boots
    old = gateway_process.keys["tenant"][-1]
    assert models_call(real_gateway, old).status_code == 200
    anonymous = models_call(real_gateway, None)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(real_gateway + "/health", timeout=30).status_code == 200  # no key needed

    # 1. Add a second key: both work.
    new = new_key()
    gateway_process.keys["tenant"] = [old, new]
    gateway_process.write_keys()
    wait_until(lambda: models_call(real_gateway, new).status_code == 200, 10, "the added key to be accepted")
    assert models_call(real_gateway, old).status_code == 200

    # 2. Drop the old key: it is refused, the new one still works.
    gateway_process.keys["tenant"] = [new]
    gateway_process.write_keys()
    refused = wait_until(
        lambda: (r := models_call(real_gateway, old)).status_code == 401 and r, 10, "the dropped key to be refused"
    )
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key") and error["message"]
    assert models_call(real_gateway, new).status_code == 200

    # All of it without a restart.
    assert gateway_process.proc.poll() is None
    assert (gateway_process.proc.pid, gateway_process.boots) == (pid, boots)


def test_tenant_key_cannot_manage_documents_or_other_models(real_gateway, gateway_process):
    tenant = openai.OpenAI(
        base_url=real_gateway + "/v1", api_key=gateway_process.keys["tenant"][-1], max_retries=0, timeout=120
    )
    for forbidden in (
        lambda: tenant.vector_stores.list(),
        lambda: tenant.files.create(file=("notes.md", b"tenant notes"), purpose="assistants"),
    ):
        with pytest.raises(openai.PermissionDeniedError) as err:
            forbidden()
        assert err.value.status_code == 403 and err.value.body["code"] == "insufficient_permissions"
    # Its key names one model: the embedding model is hidden from it, as if it did not exist.
    assert [m.id for m in tenant.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as err:
        tenant.embeddings.create(model=EMBEDDING_MODEL, input="hello")
    assert err.value.body["code"] == "model_not_found"
    reply = tenant.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], temperature=0, max_tokens=10
    )
    assert reply.choices[0].message.content


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def ask_capital(client):
    return client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=30).choices[0]


@pytest.fixture
def paris_forbidden(gateway_process, client):
    """The running gateway's model file with an output rail forbidding "Paris"; restored after."""
    original = gateway_process.model_file.read_text()
    policy = yaml.safe_load(original)
    policy["guardrails"]["output"]["forbidden"] = [{"pattern": "Paris"}]
    replace_file(gateway_process.model_file, yaml.safe_dump(policy, sort_keys=False))
    try:
        gateway_process.apply()
        c = ask_capital(client)
        assert c.finish_reason == "content_filter" and "Paris" not in c.message.content, c
        yield
    finally:
        replace_file(gateway_process.model_file, original)
        gateway_process.apply()
    assert "Paris" in ask_capital(client).message.content


def leaks(choices: list[dict]) -> list[str]:
    """Where "Paris" (any case) shows in these choices' generated text: the content, the chosen
    logprob tokens and their bytes, and each top_logprobs alternative after the text before it."""
    found, content, chosen, chosen_bytes = [], "", "", b""
    for choice in choices:
        content += (choice.get("delta") or choice.get("message") or {}).get("content") or ""
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            for alt in entry.get("top_logprobs") or []:
                as_text = (chosen + alt["token"]).lower()
                as_bytes = (chosen_bytes + bytes(alt.get("bytes") or [])).decode(errors="replace").lower()
                if "paris" in as_text or "paris" in as_bytes:
                    found.append(f"alternative {alt!r} after {chosen[-30:]!r}")
            chosen += entry["token"]
            chosen_bytes += bytes(entry.get("bytes") or [])
    for name, text in (
        ("content", content),
        ("logprob tokens", chosen),
        ("logprob bytes", chosen_bytes.decode(errors="replace")),
    ):
        if "paris" in text.lower():
            found.append(f"{name}: {text!r}")
    return found


# vLLM's metrics as Ray exports them (the node's metrics export port): "ray_" prefix, ":" as "_".
GENERATION_TOKENS = "ray_vllm_generation_tokens_total"
REQUEST_SUCCESS = "ray_vllm_request_success_total"  # label finished_reason: stop, length, abort, ...
RUNNING = "ray_vllm_num_requests_running"  # a gauge: Ray drops it from the export ~20 s after vLLM last set it
RAY_EXPORT_QUIET_S = 12  # longer than Ray's metrics report interval


def vllm_metrics(url: str) -> dict[str, float | None]:
    """vLLM's counters, summed over label sets (there is one engine). ``running`` is None
    while the gauge is not exported (vLLM sets it on every engine step: then it is idle)."""
    out: dict[str, float | None] = {"generation_tokens": 0.0, "finished": 0.0, "aborted": 0.0, "running": None}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == GENERATION_TOKENS:
                out["generation_tokens"] += sample.value
            elif sample.name == RUNNING:
                out["running"] = (out["running"] or 0) + sample.value
            elif sample.name == REQUEST_SUCCESS and sample.labels.get("finished_reason") == "abort":
                out["aborted"] += sample.value
            elif sample.name == REQUEST_SUCCESS:
                out["finished"] += sample.value  # stop, length: the request ran to its end
    return out


def settled_metrics(url: str, timeout_s: float = 120) -> tuple[dict, list[dict]]:
    """vLLM's metrics once its counters have not moved for a Ray report interval and its
    running gauge read 0 since they last moved; with every scrape seen on the way."""
    seen, start = [], time.monotonic()
    while True:
        seen.append({"t": round(time.monotonic() - start, 1), **vllm_metrics(url)})
        now, counters = seen[-1], ("generation_tokens", "finished", "aborted")
        moved = [m for m in seen if any(m[k] != now[k] for k in counters)]
        since = seen[len(moved) :] if not moved else seen[seen.index(moved[-1]) + 1 :]
        if since and now["t"] - since[0]["t"] >= RAY_EXPORT_QUIET_S and any(m["running"] == 0 for m in since):
            return now, seen
        assert time.monotonic() - start < timeout_s, f"vLLM metrics at {url} not settled after {timeout_s}s: {seen}"
        time.sleep(1)


CUISINE = [{"role": "user", "content": "Write two sentences about French cuisine, then name the capital of France."}]


def test_a_client_that_stops_reading_stops_vllm(gateway_process, operator_key):
    """A chat UI's stop button closes the connection: the gateway cancels the engine call and
    vLLM stops generating (uncut, this request would run 1000 tokens, minutes on this CPU)."""
    metrics_url = gateway_process.metrics_url()
    before, _ = settled_metrics(metrics_url)
    body = {"model": MODEL, "stream": True, "max_tokens": 1000, "ignore_eos": True, "messages": CUISINE}
    headers = {"Authorization": f"Bearer {operator_key}"}
    with httpx.stream(
        "POST", gateway_process.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        received = 0
        for line in r.iter_lines():
            received += line.startswith("data: ")
            if received >= 5:
                break  # the user pressed stop: leaving the block closes the connection
    after, seen = settled_metrics(metrics_url)
    generated = after["generation_tokens"] - before["generation_tokens"]
    print(f"stop button: {received} events read, vLLM generated {generated:.0f} of 1000 tokens; {seen[-1]}")
    # settled_metrics also saw the running-requests gauge at 0 after the last token.
    assert generated < 200 and after["finished"] == before["finished"]


def test_output_rail_cuts_the_real_stream_and_vllm_aborts(gateway_process, operator_key, paris_forbidden):
    url = gateway_process.url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {operator_key}"}
    metrics_url = gateway_process.metrics_url()
    before, _ = settled_metrics(metrics_url)
    # Greedy, never stopping at EOS: uncut, vLLM would generate all 1000 tokens (minutes on CPU).
    # The answer names Paris after some 140 characters, so text and logprobs are released before
    # the cut; and " Paris" is among the top 5 alternatives at three of those released tokens.
    # (The answer to CAPITAL is cut inside the rail's holdback window: nothing would be released.)
    body = {
        "model": MODEL,
        "messages": CUISINE,
        "temperature": 0,
        "max_tokens": 1000,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 5,
    }

    def stream(body: dict) -> tuple[httpx.Response, bytes]:
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=300) as r:
            return r, r.read()

    # (a) streamed: the raw bytes never carry "Paris", in any field.
    started = time.monotonic()
    response, raw = stream(body)
    if response.status_code == 400 and json.loads(raw)["error"]["code"] == "logprobs_not_supported_with_output_rails":
        print("the gateway refuses logprobs with output rails: streaming without them")
        body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
        started = time.monotonic()
        response, raw = stream(body)
    took = time.monotonic() - started
    assert response.status_code == 200, raw[:1000]
    assert b"paris" not in raw.lower(), raw
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), raw
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert not any("error" in c for c in chunks), raw
    choices = [choice for c in chunks for choice in c["choices"]]
    assert [c["finish_reason"] for c in choices if c.get("finish_reason")] == ["content_filter"]
    assert choices[-1]["finish_reason"] == "content_filter"
    assert leaks(choices) == []
    content = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
    entries = [e for c in choices for e in (c.get("logprobs") or {}).get("content") or []]
    print(f"streamed answer cut after {took:.1f}s, {len(entries)} logprob entries released: {content!r}")
    if "logprobs" in body:
        assert entries, "no logprobs were released before the cut: nothing above checked them"
        assert any(len(e["top_logprobs"]) < 5 for e in entries), "no alternative was withheld"

    # (c) vLLM stopped generating: far short of 1000 tokens, the request never finished normally
    # (vLLM does not count a request it aborts in request_success), nothing runs.
    after, scrapes = settled_metrics(metrics_url)
    generated = after["generation_tokens"] - before["generation_tokens"]
    print(
        f"vLLM metrics at {metrics_url}\n  before: {before}\n  after:  {after}\n  tokens generated for the cut request: {generated:.0f}"
    )
    print("  scrapes after the cut:", *scrapes, sep="\n    ")
    assert generated < 200
    assert after["finished"] == before["finished"]

    # (b) the same, not streamed: the whole body carries no "Paris" either. (max_tokens lowered:
    # a non-streamed request runs to its end in vLLM before any rail sees it.)
    whole = httpx.post(url, json={**body, "max_tokens": 80}, headers=headers, timeout=300)
    assert whole.status_code == 200, whole.text
    assert "paris" not in whole.text.lower(), whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "content_filter"
    assert leaks([choice]) == []

    # ... and the cut request stayed stopped: since, vLLM generated exactly the non-streamed answer.
    final, _ = settled_metrics(metrics_url)
    print(f"  after the non-streamed request ({whole.json()['usage']['completion_tokens']} tokens): {final}")
    assert final["generation_tokens"] - after["generation_tokens"] == whole.json()["usage"]["completion_tokens"]


def test_the_request_id_reaches_vllm(real_gateway, operator_key):
    """The caller's X-Request-Id is vLLM's request id: vLLM names its completion after it
    (``chatcmpl-<id>``, streamed and not), and the gateway echoes it with its overhead."""
    headers = {"Authorization": f"Bearer {operator_key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    rid = f"real-{new_key()[-12:]}"
    whole = httpx.post(
        real_gateway + "/v1/chat/completions", json=body, headers={**headers, "X-Request-Id": rid}, timeout=120
    )
    assert whole.status_code == 200, whole.text
    assert whole.headers["x-request-id"] == rid
    assert whole.json()["id"] == f"chatcmpl-{rid}"
    overhead = float(whole.headers["x-gateway-overhead-ms"])
    streamed_id = rid + "-s"
    with httpx.stream(
        "POST",
        real_gateway + "/v1/chat/completions",
        json={**body, "stream": True},
        headers={**headers, "X-Request-Id": streamed_id},
        timeout=120,
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["id"] for c in chunks} == {f"chatcmpl-{streamed_id}"}
    print(f"vLLM's request ids: chatcmpl-{rid}, chatcmpl-{streamed_id}; gateway overhead {overhead:.1f} ms")


def test_responses_file_search_answers_from_an_uploaded_document(client):
    """The Responses API on real vLLM (its own ``OpenAIServingResponses``): the fact comes only
    from the ``file_search`` tool's passages, cited as the uploaded file."""
    store = client.vector_stores.create(name="nimbus-responses")  # not the policy's `docs` store
    uploaded = client.files.create(file=("nimbus.md", FACT_DOC.encode()), purpose="assistants")
    assert client.vector_stores.files.create(vector_store_id=store.id, file_id=uploaded.id).status == "completed"
    question = "What is the launch code for Project Nimbus?"
    tools = [{"type": "file_search", "vector_store_ids": [store.id], "max_num_results": 2}]
    answer = client.responses.create(model=MODEL, input=question, tools=tools, temperature=0, max_output_tokens=40)
    print(f"with file_search: {answer.output_text!r}")
    assert "BLUE-HERON-42" in answer.output_text
    # SmolLM2 often talks on past the fact: then the answer is cut at max_output_tokens, as OpenAI marks it.
    assert answer.status == "completed" or answer.incomplete_details.reason == "max_output_tokens"
    search, message = answer.output
    assert search.type == "file_search_call" and search.queries == [question]
    assert [a.file_id for a in message.content[0].annotations] == [uploaded.id]
    assert answer.usage.input_tokens > 0 and answer.usage.output_tokens > 0
    # The same question without the tool (and without the policy's own stores): no fact.
    without = client.responses.create(
        model=MODEL, input=question, temperature=0, max_output_tokens=40, extra_body={"retrieval": {"enabled": False}}
    )
    print(f"without: {without.output_text!r}")
    assert without.status in ("completed", "incomplete") and "BLUE-HERON-42" not in without.output_text
    assert client.responses.retrieve(answer.id).output_text == answer.output_text
