"""Per-model config changes applied to the running gateway (``gateway apply``, through Serve's
REST API): the policy tier reaches the ingress replicas without restarting one, the engine tier
replaces only that model's replicas, models come and go, and a broken config changes nothing."""

from __future__ import annotations

import threading

import openai
import pytest
import yaml

from engines.config import ConfigError
from gateway.deploy import GATEWAY_APP, INGRESS_DEPLOYMENT, ServeAPI, engine_app_name, engine_deployment_name

SLOW = "[[tokens:30]][[delay-ms:150]]"  # a stream that lasts ~4.5 s


def pids(app: str, deployment: str) -> set[int]:
    """The process ids of a deployment's running replicas, as Serve reports them."""
    details = ServeAPI().details()["applications"][app]["deployments"][deployment]
    return {r["pid"] for r in details["replicas"] if r["state"] == "RUNNING"}


def engine_pids(model_id: str) -> set[int]:
    return pids(engine_app_name(model_id), engine_deployment_name(model_id))


def gateway_pids() -> set[int]:
    return pids(GATEWAY_APP, INGRESS_DEPLOYMENT)


def effective(http) -> dict:
    r = http.get("/v1/admin/config")
    assert r.status_code == 200, r.text
    return r.json()


def edited(fast_gateway, name: str, change) -> str:
    data = yaml.safe_load((fast_gateway.configs / name).read_text())
    change(data)
    return yaml.safe_dump(data, sort_keys=False)


class Stream(threading.Thread):
    """A streamed chat request read to its end in the background."""

    def __init__(self, client, model: str):
        super().__init__(daemon=True)
        self.client, self.model = client, model
        self.started = threading.Event()
        self.text, self.finish, self.version, self.error = "", None, None, None
        self.start()
        assert self.started.wait(60), "the stream did not start"

    def run(self):
        try:
            messages = [{"role": "system", "content": SLOW}, {"role": "user", "content": "go"}]
            raw = self.client.chat.completions.with_raw_response.create(
                model=self.model, messages=messages, stream=True, max_tokens=40
            )
            self.version = raw.headers.get("x-config-version")
            for chunk in raw.parse():
                self.started.set()
                if chunk.choices:
                    self.text += chunk.choices[0].delta.content or ""
                    self.finish = chunk.choices[0].finish_reason or self.finish
        except Exception as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()


def test_policy_change_reaches_the_next_request_and_restarts_nothing(client, http, model_file, fast_gateway):
    before = effective(http)["models"]["scripted-b"]
    ingress, engine = gateway_pids(), engine_pids("scripted-b")
    stream = Stream(client, "scripted-b")

    def change(d):
        d["requests"]["defaults"]["max_tokens"] = 3

    plan = model_file("scripted-b.yaml", edited(fast_gateway, "scripted-b.yaml", change))
    assert plan.policy == {"scripted-b": ["requests.defaults.max_tokens"]} and not plan.engine and not plan.gateway
    # The stream that started before the change finishes under the policy it started with.
    stream.join(60)
    assert stream.error is None and stream.version == before["version"]
    assert stream.text.split() == [f"t{i}" for i in range(30)] and stream.finish == "stop"
    # The next request gets the new default, and says which config produced it.
    messages = [{"role": "system", "content": "[[tokens:10]]"}, {"role": "user", "content": "go"}]
    raw = client.chat.completions.with_raw_response.create(model="scripted-b", messages=messages)
    reply = raw.parse()
    after = effective(http)["models"]["scripted-b"]
    assert reply.choices[0].message.content.split() == ["t0", "t1", "t2"]
    assert raw.headers["x-config-version"] == after["version"] != before["version"]
    assert after["requests"]["defaults"]["max_tokens"] == 3 and after["applied_at"] > before["applied_at"]
    # No replica was restarted for it.
    assert gateway_pids() == ingress and engine_pids("scripted-b") == engine


def test_moving_an_alias_is_a_policy_change(client, model_file, fast_gateway):
    def drop(d):
        d["aliases"] = []

    def take(d):
        d["aliases"] = ["gpt-4o-mini"]

    ingress = gateway_pids()
    model_file("scripted-b.yaml", edited(fast_gateway, "scripted-b.yaml", drop))
    plan = model_file("scripted.yaml", edited(fast_gateway, "scripted.yaml", take))
    assert set(plan.policy) == {"scripted"} and not plan.engine
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert reply.model == "scripted"
    assert gateway_pids() == ingress


def test_engine_change_replaces_only_that_models_replicas(client, model_file, fast_gateway):
    a, b, ingress = engine_pids("scripted"), engine_pids("scripted-b"), gateway_pids()
    stream = Stream(client, "scripted-b")  # another model's stream in flight

    def change(d):
        d.setdefault("engine", {}).setdefault("kwargs", {})["max_model_len"] = 2048

    plan = model_file("scripted.yaml", edited(fast_gateway, "scripted.yaml", change))
    assert plan.engine == {"scripted": ["engine.kwargs.max_model_len"]} and not plan.gateway
    stream.join(60)
    assert stream.error is None and stream.text.split() == [f"t{i}" for i in range(30)]
    assert engine_pids("scripted").isdisjoint(a), "the changed model's replicas were not replaced"
    assert engine_pids("scripted-b") == b and gateway_pids() == ingress
    assert client.models.retrieve("scripted").model_extra["max_model_len"] == 2048
    assert client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}]).choices


def test_a_model_is_added_then_removed(client, model_file, fast_gateway):
    others = {m: engine_pids(m) for m in ("scripted", "scripted-b")}
    ingress = gateway_pids()
    text = (fast_gateway.configs / "scripted.yaml").read_text().replace("model_id: scripted", "model_id: scripted-c")
    (fast_gateway.configs / "scripted-c.yaml").write_text(text)
    try:
        plan = model_file(
            "gateway.yaml", edited(fast_gateway, "gateway.yaml", lambda d: d["models"].append("scripted-c.yaml"))
        )
        assert plan.added == ["scripted-c"] and not plan.engine and not plan.gateway
        assert "scripted-c" in {m.id for m in client.models.list()}
        reply = client.chat.completions.create(model="scripted-c", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "echo: hi"
        plan = model_file(
            "gateway.yaml", edited(fast_gateway, "gateway.yaml", lambda d: d["models"].remove("scripted-c.yaml"))
        )
        assert plan.removed == ["scripted-c"]
        assert "scripted-c" not in {m.id for m in client.models.list()}
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="scripted-c", messages=[{"role": "user", "content": "hi"}])
        assert engine_app_name("scripted-c") not in ServeAPI().details()["applications"]
    finally:
        (fast_gateway.configs / "scripted-c.yaml").unlink()
    assert {m: engine_pids(m) for m in others} == others and gateway_pids() == ingress


def test_a_broken_config_is_refused_and_nothing_changes(client, http, model_file, fast_gateway):
    before_config = ServeAPI().deployed_config()
    before = effective(http)["models"]

    def break_it(d):
        d["requests"]["defaults"]["max_tokens"] = -1

    with pytest.raises(ConfigError, match=r"scripted-b.yaml.*\n.*requests.defaults.max_tokens"):
        model_file("scripted-b.yaml", edited(fast_gateway, "scripted-b.yaml", break_it))
    assert ServeAPI().deployed_config() == before_config
    assert effective(http)["models"] == before


def test_the_effective_config_is_for_admins_only(tenant):
    with pytest.raises(openai.PermissionDeniedError):
        tenant("alice").get("/admin/config", cast_to=object)
