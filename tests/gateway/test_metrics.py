"""Observability through the real Serve app: the gateway's series in Ray's metrics export, the
request id from the client to the engine and into the logs, the overhead header, readiness."""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import API_KEY

CHAT = "/v1/chat/completions"
CARD = "4111 1111 1111 1111"  # a Luhn-valid test card number: the guarded model blocks it
EXPORT_TIMEOUT_S = 90  # Ray reports metrics to its node exporter every few seconds


def ray_session_dir() -> Path:
    """This test process's Ray session (others may run on the box: not session_latest).
    Ray has no public accessor for it."""
    import ray

    return Path(ray._private.worker._global_node.get_session_dir_path())


def scrape() -> dict[tuple[str, frozenset], float]:
    """Every ``ray_gateway_*`` sample of this node, by (name, labels without Serve's replica tags)."""
    (port_file,) = ray_session_dir().glob("metrics_export_port_*")
    text = httpx.get(f"http://127.0.0.1:{port_file.read_text().strip()}/metrics", timeout=10).text
    out: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_gateway_"):
                labels = {k: v for k, v in s.labels.items() if k in _OUR_LABELS}
                key = (s.name, frozenset(labels.items()))
                out[key] = out.get(key, 0.0) + s.value
    return out


_OUR_LABELS = {"route", "model", "status", "code", "stream", "stage", "rail", "outcome", "direction", "le"}


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum over samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_for_moves(before: dict, expected: dict[tuple, float]) -> dict:
    """Scrape until each (name, labels) moved by at least its amount since ``before``; then
    assert the exact amounts (counters must not move more than the requests made them)."""
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while True:
        now = scrape()
        moved = {k: value(now, k[0], **dict(k[1])) - value(before, k[0], **dict(k[1])) for k in expected}
        if all(moved[k] >= want for k, want in expected.items()):
            return moved
        assert time.monotonic() < deadline, f"series did not move as expected: {moved} vs {expected}"
        time.sleep(1)


def key(name: str, **labels: str) -> tuple[str, frozenset]:
    return name, frozenset(labels.items())


def test_series_move_for_each_request(gateway_url, engine_events):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = scrape()
    with httpx.Client(base_url=gateway_url, headers=headers, timeout=30) as http:
        plain = http.post(CHAT, json={"model": "scripted", "messages": [{"role": "user", "content": "[[tokens:5]]"}]})
        streamed = http.post(
            CHAT,
            json={"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "[[tokens:4]]"}]},
        )
        blocked = http.post(
            CHAT, json={"model": "scripted-guarded", "messages": [{"role": "user", "content": f"My card is {CARD}"}]}
        )
        guarded = http.post(
            CHAT,
            json={"model": "scripted-guarded", "messages": [{"role": "user", "content": "What is the weather like?"}]},
        )
    assert plain.status_code == 200 and streamed.status_code == 200 and guarded.status_code == 200
    assert blocked.status_code == 400 and blocked.json()["error"]["code"] == "pii_blocked"
    for r in (plain, streamed, blocked, guarded):
        assert float(r.headers["x-gateway-overhead-ms"]) >= 0
    # The gateway asked the engine for the stream's usage; the client did not, so it gets none.
    events = [e for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all('"usage"' not in e for e in events)
    usage = plain.json()["usage"]
    chat = {"route": CHAT, "model": "scripted"}
    expected = {
        key("ray_gateway_requests_total", **chat, status="200", code=""): 2,
        key("ray_gateway_requests_total", route=CHAT, model="scripted-guarded", status="400", code="pii_blocked"): 1,
        key("ray_gateway_requests_total", route=CHAT, model="scripted-guarded", status="200", code=""): 1,
        key("ray_gateway_request_latency_ms_count", **chat, stream="false"): 1,
        key("ray_gateway_request_latency_ms_count", **chat, stream="true"): 1,
        key("ray_gateway_overhead_ms_count", **chat): 2,
        key("ray_gateway_time_to_first_token_ms_count", **chat): 1,
        key("ray_gateway_time_per_output_token_ms_count", **chat): 1,
        key("ray_gateway_stream_overhead_per_token_ms_count", model="scripted"): 1,
        # 5 tokens not streamed + 4 streamed (counted from the usage chunk the gateway asked for)
        key("ray_gateway_tokens_total", model="scripted", direction="completion"): usage["completion_tokens"] + 4,
        key("ray_gateway_tokens_total", model="scripted", direction="prompt"): 2 * usage["prompt_tokens"],
        key("ray_gateway_stage_latency_ms_count", stage="input_rails", model="scripted-guarded"): 2,
        key("ray_gateway_guardrail_verdicts_total", rail="pii", outcome="blocked"): 1,
        key("ray_gateway_rail_latency_ms_count", rail="pii"): 2,
        key("ray_gateway_rail_latency_ms_count", rail="limits"): 2,
        key("ray_gateway_rail_latency_ms_count", rail="check_input"): 2,
    }
    moved = wait_for_moves(before, expected)
    assert usage["completion_tokens"] == 5
    exact = [k for k in expected if k[0] == "ray_gateway_requests_total" or k[0] == "ray_gateway_tokens_total"]
    assert {k: moved[k] for k in exact} == {k: expected[k] for k in exact}
    # Nothing of the blocked request reached the engine.
    assert all(CARD not in e["prompt"] for e in engine_events("started"))


def test_a_stream_cut_by_a_rail_is_counted(gateway_url):
    before = scrape()
    say = "[[say:this answer holds FORBIDDEN-WORD inside]]"
    r = httpx.post(
        gateway_url + CHAT,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "scripted-guarded", "stream": True, "messages": [{"role": "system", "content": say}]},
        timeout=30,
    )
    assert '"content_filter"' in r.text
    expected = {
        key("ray_gateway_streams_cut_total", route=CHAT, model="scripted-guarded"): 1,
        key("ray_gateway_requests_total", route=CHAT, model="scripted-guarded", status="200", code=""): 1,
    }
    moved = wait_for_moves(before, expected)
    assert moved == expected


def test_the_request_id_reaches_the_engine_and_every_log_line(gateway_url, engine_events):
    request_id = f"req-{uuid.uuid4().hex}"
    marker = f"zebra{uuid.uuid4().hex[:12]}"  # prompt text, which must appear in no log
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": request_id}
    # Guarded (rails, retrieval, engine) and failing mid-stream, so the ingress logs an error.
    body = {
        "model": "scripted-guarded",
        "stream": True,
        "messages": [
            {"role": "system", "content": "[[tokens:3]] [[fail-after:1]]"},
            {"role": "user", "content": f"Tell me about {marker} please"},
        ],
    }
    r = httpx.post(gateway_url + CHAT, headers=headers, json=body, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == request_id
    assert '"error"' in r.text and r.text.endswith("data: [DONE]\n\n")
    started = engine_events("started")
    assert [e["request_id"] for e in started] == [request_id]
    assert marker in started[0]["prompt"]

    logs = ray_session_dir() / "logs"
    deadline = time.monotonic() + 30
    while True:  # Serve buffers its replica logs briefly
        lines = [(p, line) for p in logs.rglob("*") if p.is_file() for line in _lines(p) if request_id in line]
        ours = [line for _, line in lines if "stream failed mid-way" in line or "mid-stream" in line]
        if ours or time.monotonic() > deadline:
            break
        time.sleep(1)
    # Serve's per-replica access logs carry the id too, but in the throughput-optimized mode they
    # are buffered (1000 lines) and not flushed within a test's patience: not asserted here.
    assert ours, f"no gateway log line carries {request_id}: {lines}"
    leaked = [str(p) for p in logs.rglob("*") if p.is_file() and any(marker in line for line in _lines(p))]
    assert leaked == []


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def test_ready_when_every_part_answers(gateway_url):
    r = httpx.get(gateway_url + "/ready", timeout=10)  # no key: load balancers carry none
    assert r.status_code == 200, r.text
    checks = r.json()["checks"]
    assert checks == {
        "engine:scripted": "ok",
        "engine:scripted-b": "ok",
        "engine:scripted-guarded": "ok",
        "guardrails": "ok",
        "retrieval": "ok",
        "embeddings": "ok",
    }
    assert set(r.json()) == {"status", "checks"}


@pytest.fixture
def probe_gateway(fast_gateway):
    """A second, small gateway application (route ``/probe``) on the fast tier's scripted
    engine, whose guardrails stage is a deployment the test can switch off."""
    from ray import serve

    from gateway.deploy import policy_user_config
    from gateway.ingress import Gateway

    @serve.deployment(health_check_period_s=3600, ray_actor_options={"num_cpus": 0})
    class SwitchableStage:
        def __init__(self):
            self.down = False

        def set_down(self, down: bool) -> None:
            self.down = down

        def check_health(self) -> None:
            if self.down:
                raise RuntimeError("switched off by the test")

    config = fast_gateway.load()
    scripted = dataclasses.replace(config, models=config.models[:1], model_files=config.model_files[:1])
    app = Gateway.options(user_config=policy_user_config(scripted), ray_actor_options={"num_cpus": 0}).bind(
        settings=config.gateway, guard=SwitchableStage.bind()
    )
    serve.run(app, name="probe", route_prefix="/probe")
    try:
        yield (
            f"http://127.0.0.1:{fast_gateway.port}/probe",
            serve.get_deployment_handle("SwitchableStage", app_name="probe"),
        )
    finally:
        serve.delete("probe")


def test_ready_is_503_naming_the_part_that_is_down(probe_gateway):
    url, stage = probe_gateway
    up = httpx.get(url + "/ready", timeout=10)
    assert up.status_code == 200, up.text
    assert up.json()["checks"] == {"engine:scripted": "ok", "guardrails": "ok"}
    stage.set_down.remote(True).result()
    time.sleep(1.5)  # past the probe's cache
    down = httpx.get(url + "/ready", timeout=10)
    assert down.status_code == 503, down.text
    body = down.json()
    assert body["checks"] == {"engine:scripted": "ok", "guardrails": "unavailable"}
    assert body["error"]["code"] == "not_ready" and "guardrails" in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    stage.set_down.remote(False).result()
    time.sleep(1.5)
    assert httpx.get(url + "/ready", timeout=10).status_code == 200


def test_every_response_carries_nosniff_and_no_store(gateway_url):
    """Answers, streams, refusals and errors are never sniffed as another type (a model's text
    is not HTML) nor kept by a cache in between; the chat page's files keep their own policy."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=gateway_url, timeout=30) as http:
        responses = [
            http.post(CHAT, headers=auth, json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}),
            http.post(
                CHAT,
                headers=auth,
                json={"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            ),
            http.post(
                CHAT,
                headers=auth,
                json={"model": "scripted-guarded", "messages": [{"role": "user", "content": f"My card is {CARD}"}]},
            ),
            http.get("/v1/models"),  # no key: 401
            http.get("/v1/nowhere", headers=auth),  # 404
            http.get("/health"),
        ]
        page = http.get("/chat")
    assert [r.status_code for r in responses] == [200, 200, 400, 401, 404, 200]
    for r in responses:
        assert r.headers["x-content-type-options"] == "nosniff", r.request.url
        assert r.headers["cache-control"] == "no-store", r.request.url
    assert page.status_code == 200 and page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["cache-control"] == "no-cache"  # its own: revalidate, so a new page is picked up
