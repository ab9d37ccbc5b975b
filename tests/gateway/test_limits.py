"""Per-key limits through the real Serve app: a second small gateway application (two ingress
replicas sharing one Limiter, in front of the fast tier's scripted engines), driven with the
openai SDK and raw HTTP. Windows are 10 s (tests/fixtures/limits-gateway.yaml)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.conftest import FIXTURES

WINDOW_S = 10
SYSTEM = "system"


def _principals(keys: dict[str, str], limits: dict[str, dict]) -> dict:
    from gateway.auth import key_digest

    out = []
    for name, key in keys.items():
        entry = {"name": name, "key_sha256": [key_digest(key)], "scopes": ["chat", "documents", "admin"]}
        if limits.get(name):
            entry["limits"] = limits[name]
        out.append(entry)
    return {"principals": out}


class LimitedGateway:
    """One deployed test gateway: its URL, its keys file and each principal's key."""

    def __init__(self, url: str, app: str, keys_path: Path, keys: dict[str, str], limits: dict[str, dict], budgets):
        self.url, self.app, self.keys_path, self.keys, self.limits, self.budgets = (
            url,
            app,
            keys_path,
            keys,
            limits,
            budgets,
        )

    def write_keys(self) -> None:
        tmp = self.keys_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(_principals(self.keys, self.limits)))
        tmp.replace(self.keys_path)

    def client(self, name: str, **kw) -> openai.OpenAI:
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.keys[name], timeout=30, **kw)

    def post(self, name: str, body: dict, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[name]}"}
        return httpx.post(self.url + "/v1/chat/completions", json=body, headers=headers, timeout=30, **kw)


ENGINE_APP = "limits-engine-"


def _deploy(
    tmp: Path, fixture: str, app: str, port: int, limits: dict[str, dict], **settings: object
) -> LimitedGateway:
    """The gateway application of ``fixture`` as ``app`` at ``/app``, in front of the engines of
    ``limit_engines`` (its models' ``user_config`` points there)."""
    from ray import serve

    from gateway.app import build_gateway
    from gateway.auth import new_key
    from gateway.config import load_config
    from gateway.deploy import engine_deployment_name

    for f in ("scripted.yaml", "scripted-b.yaml"):
        (tmp / f).write_text((FIXTURES / f).read_text())
    (tmp / "gateway.yaml").write_text((FIXTURES / fixture).read_text().replace("/tmp/replaced-by-the-fixture", ""))
    keys = {name: new_key() for name in limits}
    gw = LimitedGateway("", app, tmp / "keys.yaml", keys, limits, tmp / "budgets.json")
    gw.write_keys()
    data = yaml.safe_load((tmp / "gateway.yaml").read_text())
    config = load_config(
        tmp / "gateway.yaml",
        port=port,
        auth={"api_keys_env": None, "keys_file": str(gw.keys_path)},
        retrieval={**data["retrieval"], "storage_dir": str(tmp / "retrieval")},
        limits={**data["limits"], "budget_file": str(gw.budgets), **settings},
    )
    models = [
        {
            "app": ENGINE_APP + m.model_id,
            "deployment": engine_deployment_name(m.model_id),
            "source": str(path),
            "file": m.model_dump(mode="json"),
        }
        for path, m in zip(config.model_files, config.models)
    ]
    prefix = "/" + app
    serve.run(build_gateway(config, user_config={"models": models}), name=app, route_prefix=prefix)
    gw.url = f"http://127.0.0.1:{port}{prefix}"
    return gw


@pytest.fixture(scope="module")
def limit_engines(ray_session, recorder):
    """The scripted engines, as their own applications (independent of the main fast gateway)."""
    from ray import serve

    from engines.deployments import build_engine_deployment
    from engines.scripted_engine import ScriptedEngine
    from gateway.deploy import engine_deployment_name
    from gateway.model_file import load_model_file

    names = []
    for f in ("scripted.yaml", "scripted-b.yaml"):
        model = load_model_file(FIXTURES / f)
        deployment = build_engine_deployment(
            model.engine_spec(), FIXTURES, engine_cls=ScriptedEngine, name=engine_deployment_name(model.model_id)
        )
        names.append(ENGINE_APP + model.model_id)
        serve.run(deployment, name=names[-1], route_prefix=None)
    yield
    for name in names:
        serve.delete(name)


# Each test has its own key, so windows never carry over between tests.
LIMITS = {
    "rpm": {"requests_per_minute": 6},
    "headers": {"requests_per_minute": 2, "tokens_per_minute": 100000},
    "tpm": {"tokens_per_minute": 30},
    "tpm-stream": {"tokens_per_minute": 30},
    "tpm-usage": {"tokens_per_minute": 30},
    "conc": {"concurrent_requests": 1},
    "budget": {"budget": {"tokens": 40, "period": "day"}},
    "per-model": {"models": {"scripted": {"requests_per_minute": 1}}},
    "live": {},
    "outage": {"budget": {"tokens": 5, "period": "month"}},
    "free": {},
    "resp-tpm": {"tokens_per_minute": 30},
    "resp-budget": {"budget": {"tokens": 30, "period": "day"}},
    "resp-budget-stream": {"budget": {"tokens": 30, "period": "day"}},
    "measured": {"requests_per_minute": 100000, "tokens_per_minute": 10000000, "concurrent_requests": 100},
}


@pytest.fixture(scope="module")
def limited(limit_engines, ray_session, tmp_path_factory):
    from ray import serve

    yield _deploy(tmp_path_factory.mktemp("limits"), "limits-gateway.yaml", "limits-test", ray_session, LIMITS)
    serve.delete("limits-test")


def _chat(directives: str, **kw) -> dict:
    return {
        "model": "scripted",
        "messages": [{"role": SYSTEM, "content": directives}, {"role": "user", "content": "hi"}],
        **kw,
    }


def _is_429(resp: httpx.Response, kind: str, code: str = "rate_limit_exceeded") -> None:
    assert resp.status_code == 429, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == (kind, code)
    assert int(resp.headers["retry-after"]) >= 1
    assert int(resp.headers["retry-after-ms"]) >= 1


def test_rpm_holds_across_two_ingress_replicas(limited):
    from ray import serve

    replicas = serve.status().applications["limits-test"].deployments["Gateway"].replica_states
    assert replicas.get("RUNNING") == 2
    n = LIMITS["rpm"]["requests_per_minute"]
    statuses: list[int] = []
    retry_after: list[str] = []

    def send():
        r = limited.post("rpm", _chat("[[tokens:1]]"))
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry_after.append(r.headers.get("retry-after"))

    started = time.monotonic()
    threads = [threading.Thread(target=send) for _ in range(2 * n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < WINDOW_S, "the requests did not fit in one window"
    # Counted per replica, each of the two would have served up to n.
    assert statuses.count(200) == n, statuses
    assert statuses.count(429) == n and all(retry_after), statuses


def test_429_headers_and_the_sdk_retries_after_retry_after(limited):
    first = limited.post("headers", _chat("[[tokens:2]]"))
    assert first.status_code == 200
    h = first.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("2", "1")
    assert h["x-ratelimit-limit-tokens"] == "100000"
    assert h["x-ratelimit-reset-requests"].endswith("s")
    assert limited.post("headers", _chat("[[tokens:2]]")).status_code == 200
    refused = limited.post("headers", _chat("[[tokens:2]]"))
    _is_429(refused, "requests")
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-limit-tokens"] == "100000"
    wait_s = int(refused.headers["retry-after-ms"]) / 1000
    assert 0 < wait_s <= WINDOW_S
    # The SDK, unchanged: retries on 429 after the server's retry-after-ms, then succeeds.
    started = time.monotonic()
    raw = limited.client("headers", max_retries=3).chat.completions.with_raw_response.create(**_chat("[[say:ok]]"))
    assert raw.parse().choices[0].message.content == "ok"
    assert time.monotonic() - started >= wait_s - 0.5
    assert raw.retries_taken >= 1


def test_tokens_per_minute_charged_from_usage_not_streamed(limited):
    client = limited.client("tpm")
    reply = client.chat.completions.create(**_chat("[[tokens:30]]"))
    assert reply.usage.total_tokens >= 30
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(**_chat("[[tokens:1]]"))
    assert err.value.body["type"] == "tokens" and err.value.code == "rate_limit_exceeded"
    assert err.value.response.headers["x-ratelimit-remaining-tokens"] == "0"


def test_tokens_per_minute_charged_from_a_stream_whose_usage_the_client_did_not_ask(limited):
    client = limited.client("tpm-stream")
    chunks = list(client.chat.completions.create(**_chat("[[tokens:30]]"), stream=True))
    # The gateway asked the engine for usage; the client did not, so it sees none.
    assert all(c.usage is None and c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks).count("t") == 30
    refused = limited.post("tpm-stream", _chat("[[tokens:1]]"))
    _is_429(refused, "tokens")


def test_stream_usage_when_the_client_asks(limited):
    client = limited.client("tpm-usage")
    chunks = list(
        client.chat.completions.create(**_chat("[[tokens:5]]"), stream=True, stream_options={"include_usage": True})
    )
    assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_concurrent_requests_and_release_on_finish(limited):
    slow = _chat("[[delay-ms:100]][[tokens:20]]", stream=True)
    headers = {"Authorization": f"Bearer {limited.keys['conc']}"}
    with httpx.Client(base_url=limited.url, headers=headers, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=slow) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            _is_429(limited.post("conc", _chat("[[tokens:1]]")), "requests")
            for _ in lines:  # read to the end: the answer finishes
                pass
    # A finished answer frees its slot.
    deadline = time.monotonic() + 10
    while (r := limited.post("conc", _chat("[[tokens:1]]"))).status_code == 429:
        assert time.monotonic() < deadline, "the slot of a finished stream was never released"
        time.sleep(0.1)
    assert r.status_code == 200
    assert limited.post("conc", _chat("[[tokens:1]]")).status_code == 200


def test_a_disconnected_stream_frees_its_slot(limited, engine_events):
    slow = _chat("[[delay-ms:100]][[tokens:20]]", stream=True)
    headers = {"Authorization": f"Bearer {limited.keys['conc']}"}
    with httpx.Client(base_url=limited.url, headers=headers, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=slow) as held:
            assert held.status_code == 200
            next(held.iter_lines())
    # The client left mid-stream: the slot comes back once the gateway notices.
    deadline = time.monotonic() + 10
    while (r := limited.post("conc", _chat("[[tokens:1]]"))).status_code == 429:
        assert time.monotonic() < deadline, "the slot of a disconnected stream was never released"
        time.sleep(0.1)
    assert r.status_code == 200
    assert engine_events("cancelled"), "the engine call of the abandoned stream was not cancelled"


def test_budget_cuts_a_stream_with_length_and_cancels_the_engine(limited, engine_events):
    client = limited.client("budget", max_retries=2)
    budget = LIMITS["budget"]["budget"]["tokens"]
    chunks = list(client.chat.completions.create(**_chat("[[delay-ms:20]][[tokens:200]]"), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    # The scripted engine reports usage only at the end, so the cut counts its output tokens.
    assert len(text.split()) == budget
    # The cut cancels the engine call without waiting for it: the engine records it shortly after.
    deadline = time.monotonic() + 5
    while not (cancelled := engine_events("cancelled")):
        assert time.monotonic() < deadline, "the engine call of the cut stream was not cancelled"
        time.sleep(0.05)
    assert cancelled[-1]["tokens"] < 200
    # The next request: insufficient_quota, and the SDK does not retry it (x-should-retry: false).
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(**_chat("[[tokens:1]]"))
    assert err.value.code == "insufficient_quota" and err.value.body["type"] == "insufficient_quota"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert time.monotonic() - started < 1.0
    # Persisted atomically beside the other state.
    deadline = time.monotonic() + 5
    while (
        json.loads(limited.budgets.read_text() if limited.budgets.exists() else "{}").get("budget", [0, 0])[1] != budget
    ):
        assert time.monotonic() < deadline, "the budget was not persisted"
        time.sleep(0.1)


def _respond(limited: LimitedGateway, name: str, directives: str, **kw) -> httpx.Response:
    body = {"model": "scripted", "instructions": directives, "input": "hi", **kw}
    headers = {"Authorization": f"Bearer {limited.keys[name]}"}
    return httpx.post(limited.url + "/v1/responses", json=body, headers=headers, timeout=30)


def test_responses_tokens_are_charged(limited):
    client = limited.client("resp-tpm")
    reply = client.responses.create(model="scripted", instructions="[[tokens:30]]", input="hi")
    assert reply.usage.output_tokens == 30
    refused = _respond(limited, "resp-tpm", "[[tokens:1]]")
    _is_429(refused, "tokens")


def test_responses_output_is_bounded_by_the_budget(limited):
    budget = LIMITS["resp-budget"]["budget"]["tokens"]
    client = limited.client("resp-budget")
    reply = client.responses.create(model="scripted", instructions="[[tokens:200]]", input="hi")
    assert reply.status == "incomplete" and 0 < reply.usage.output_tokens <= budget
    _is_429(_respond(limited, "resp-budget", "[[tokens:1]]"), "insufficient_quota", "insufficient_quota")


def test_responses_stream_is_bounded_by_the_budget(limited):
    budget = LIMITS["resp-budget-stream"]["budget"]["tokens"]
    client = limited.client("resp-budget-stream")
    events = list(client.responses.create(model="scripted", instructions="[[tokens:200]]", input="hi", stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete" and 0 < len(deltas) <= budget
    _is_429(_respond(limited, "resp-budget-stream", "[[tokens:1]]"), "insufficient_quota", "insufficient_quota")


def test_per_model_limit(limited):
    assert limited.post("per-model", _chat("[[tokens:1]]")).status_code == 200
    _is_429(limited.post("per-model", _chat("[[tokens:1]]")), "requests")
    other = limited.post("per-model", {**_chat("[[tokens:1]]"), "model": "scripted-b"})
    assert other.status_code == 200 and "x-ratelimit-limit-requests" not in other.headers


def test_limits_changed_in_the_keys_file_apply_without_restart(limited):
    for _ in range(3):
        assert limited.post("live", _chat("[[tokens:1]]")).status_code == 200
    limited.limits["live"] = {"requests_per_minute": 1}
    try:
        limited.write_keys()
        time.sleep(1.5)  # each replica re-reads the keys file within a second
        statuses = [limited.post("live", _chat("[[tokens:1]]")).status_code for _ in range(4)]
        assert statuses.count(200) == 1 and statuses.count(429) == 3, statuses
    finally:
        limited.limits["live"] = {}
        limited.write_keys()


def test_limiter_adds_little_latency(limited):
    """Not a benchmark: a bound that catches a limiter on the slow path (printed with -s)."""

    def p50(name: str) -> float:
        times = []
        for _ in range(40):
            started = time.perf_counter()
            assert limited.post(name, _chat("[[tokens:1]]")).status_code == 200
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000

    rounds = [(p50("free"), p50("measured")) for _ in range(2)]
    free, measured = (statistics.median(x) for x in zip(*rounds))
    print(f"\nlimiter: p50 {free:.1f} ms without limits, {measured:.1f} ms with (+{measured - free:.1f} ms)")
    assert measured - free < 25


def _kill_limiter(app: str) -> None:
    import ray

    prefix = f"SERVE_REPLICA::{app}#Limiter#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def _until(check, timeout_s: float, what: str | Callable[[], str]):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def outage(limit_engines, ray_session, tmp_path_factory):
    """A gateway of its own: with the main one's generous limiter timeout (3 s), Serve may
    replace a killed limiter before any request has waited that long, and no outage is seen."""
    from ray import serve

    gw = _deploy(
        tmp_path_factory.mktemp("limits-outage"),
        "limits-outage.yaml",
        "limits-outage",
        ray_session,
        {"outage": LIMITS["outage"]},
        on_limiter_failure="open",
    )
    yield gw
    serve.delete(gw.app)


def test_limiter_failure_fails_open_and_budgets_survive_its_restart(outage):
    client = outage.client("outage")
    reply = client.chat.completions.create(**_chat("[[tokens:50]]"))
    assert reply.choices[0].finish_reason == "length"  # max_tokens lowered to the budget
    _is_429(outage.post("outage", _chat("[[tokens:1]]")), "insufficient_quota", "insufficient_quota")
    time.sleep(0.5)  # the charge reaches the disk
    _kill_limiter(outage.app)
    # While the limiter is down, requests are served without limits (on_limiter_failure: open).
    seen: list[int] = []

    def served() -> bool:
        seen.append(outage.post("outage", _chat("[[tokens:1]]")).status_code)
        return seen[-1] == 200

    _until(served, 10, lambda: f"did not fail open: {seen}")
    # Serve replaces the replica; the new one reads the budgets back from disk.
    _until(lambda: outage.post("outage", _chat("[[tokens:1]]")).status_code == 429, 90, "limiter never came back")
    _is_429(outage.post("outage", _chat("[[tokens:1]]")), "insufficient_quota", "insufficient_quota")


def test_limiter_failure_fails_closed_when_configured(limit_engines, ray_session, tmp_path_factory):
    from ray import serve

    closed = _deploy(
        tmp_path_factory.mktemp("limits-closed"),
        "limits-outage.yaml",
        "limits-closed",
        ray_session,
        {"k": {"requests_per_minute": 1000}},
        on_limiter_failure="closed",
    )
    try:
        assert closed.post("k", _chat("[[tokens:1]]")).status_code == 200
        _kill_limiter(closed.app)
        refused = _until(
            lambda: (r := closed.post("k", _chat("[[tokens:1]]"))).status_code == 503 and r, 10, "did not fail closed"
        )
        error = refused.json()["error"]
        assert error["code"] == "limiter_unavailable" and refused.headers["retry-after"] == "1"
        _until(lambda: closed.post("k", _chat("[[tokens:1]]")).status_code == 200, 90, "limiter never came back")
    finally:
        serve.delete(closed.app)
