"""The Serve config a gateway config becomes, and which tier each kind of edit falls in
(no cluster needed: the live behaviour is in test_live_config.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from gateway.config import load_config
from gateway.deploy import GATEWAY_APP, engine_app_name, plan, serve_config
from tests.conftest import FIXTURES, ROOT


@pytest.fixture
def configs(tmp_path) -> Path:
    for f in FIXTURES.glob("*.yaml"):
        shutil.copy(f, tmp_path / f.name)
    return tmp_path


def edit(path: Path, change) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data))


def rendered(configs: Path) -> dict:
    return serve_config(load_config(configs / "gateway.yaml"), engine_cls="engines.scripted_engine:ScriptedEngine")


def test_one_application_per_model_plus_the_gateway_and_serve_accepts_it(configs):
    config = rendered(configs)
    ServeDeploySchema.model_validate(config)  # what Serve's REST API and `serve deploy` accept
    names = [a["name"] for a in config["applications"]]
    assert names == [engine_app_name(m) for m in ("scripted", "scripted-b", "scripted-guarded")] + [GATEWAY_APP]
    gateway = config["applications"][-1]
    assert gateway["route_prefix"] == "/" and "models" not in gateway["args"]["settings"]
    assert all(a["route_prefix"] is None for a in config["applications"][:-1])
    # The engine layer gets only the engine part of a model file.
    assert set(config["applications"][0]["args"]["engine"]) == {
        "model_id",
        "source",
        "engine",
        "placement",
        "deployment",
    }


def test_the_shipped_config_renders(monkeypatch):
    monkeypatch.chdir(ROOT)
    ServeDeploySchema.model_validate(serve_config(load_config(ROOT / "configs/gateway.yaml")))


def test_each_edit_falls_in_its_tier(configs):
    before = rendered(configs)
    assert plan(before, before).empty

    edit(configs / "scripted-guarded.yaml", lambda d: d["guardrails"].update({"fail_open": True}))
    p = plan(before, rendered(configs))
    assert p.policy == {"scripted-guarded": ["guardrails.fail_open"]} and not (p.engine or p.gateway or p.added)

    before = rendered(configs)
    edit(configs / "scripted.yaml", lambda d: d["placement"].update({"cpus_per_worker": 0.2}))
    p = plan(before, rendered(configs))
    assert p.engine == {"scripted": ["placement.cpus_per_worker"]} and not (p.policy or p.gateway)

    before = rendered(configs)
    edit(configs / "gateway.yaml", lambda d: d["ingress"].update({"num_replicas": 2}))
    p = plan(before, rendered(configs))
    assert p.gateway == ["ingress.num_replicas"] and not (p.policy or p.engine)

    before = rendered(configs)
    edit(configs / "gateway.yaml", lambda d: d["models"].remove("scripted-b.yaml"))
    p = plan(before, rendered(configs))
    assert p.removed == ["scripted-b"] and not (p.gateway or p.engine or p.policy)
    assert plan(rendered(configs), before).added == ["scripted-b"]


def test_model_ids_that_are_not_safe_names_get_distinct_app_names():
    a, b = engine_app_name("org/model"), engine_app_name("org_model")
    assert a != b and "/" not in a and a.startswith("model-org_model")
