"""The gateway on a multi-node Ray cluster on this machine (gateway/cluster.py): a head (Serve's
controller, the ingress) and two worker nodes offering the ``engine`` resource, each a separate
``ray start`` process. The scripted engine's replica must run on a worker; then that worker's
raylet is SIGKILLed under steady load, and Serve must bring the engine back on the other one.

Marked ``cluster``: it starts its own Ray cluster (about 3 minutes on 2 idle cores), apart from
the session's single-node Ray.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import yaml

from gateway import deploy
from gateway.cluster import LocalCluster, free_port
from gateway.config import load_config

pytestmark = pytest.mark.cluster

SCRIPTED_ENGINE = "engines.scripted_engine:ScriptedEngine"
ENGINE_APP = deploy.engine_app_name("scripted")
ENGINE_DEPLOYMENT = deploy.engine_deployment_name("scripted")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("cluster")
    c = LocalCluster.up(
        2,
        state_dir=state,
        head_resources={"stages": 1},
        worker_resources=[{"engine": 1}, {"engine": 1}],
        num_cpus=2,
    )
    yield c
    c.down()
    assert not (state / "cluster.json").exists()


@pytest.fixture(scope="module")
def gateway(cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster-config")
    port = free_port()
    model = {
        "model_id": "scripted",
        "source": {"path": "/nonexistent/scripted"},
        "engine": {"stream_batching_interval_ms": 0},
        "placement": {"accelerator": "cpu", "cpus_per_worker": 0.1, "resources": {"engine": 1}},
    }
    stages = {"resources": {"stages": 0.01}}
    config = {
        "host": "127.0.0.1",
        "port": port,
        "models": ["scripted.yaml"],
        "ingress": {"num_cpus": 0.1, **stages},
        "embedding": {"enabled": False},
        "guardrails": {"enabled": False},
        "retrieval": {"enabled": False, "storage_dir": str(folder / "retrieval")},
        "limits": {"budget_file": str(folder / "budgets.json")},
    }
    (folder / "scripted.yaml").write_text(yaml.safe_dump(model))
    (folder / "gateway.yaml").write_text(yaml.safe_dump(config))
    deploy.apply(
        load_config(folder / "gateway.yaml"), address=cluster.dashboard, engine_cls=SCRIPTED_ENGINE, timeout_s=600
    )
    return f"http://127.0.0.1:{port}"


def _replicas(cluster, app: str, deployment: str) -> list[dict]:
    apps = deploy.ServeAPI(cluster.dashboard).details()["applications"]
    return apps[app]["deployments"][deployment]["replicas"]


def _running_on(cluster, app: str, deployment: str) -> set[str]:
    names = {node_id: name for name, node_id in cluster.alive_nodes().items()}
    return {names.get(r["node_id"], "?") for r in _replicas(cluster, app, deployment) if r["state"] == "RUNNING"}


def _chat(base: str, text: str, timeout: float = 30) -> httpx.Response:
    body = {"model": "scripted", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=timeout)


def test_engine_on_a_worker_serves_and_comes_back_after_its_node_dies(cluster, gateway):
    engine_nodes = _running_on(cluster, ENGINE_APP, ENGINE_DEPLOYMENT)
    assert len(engine_nodes) == 1 and engine_nodes <= {"worker-1", "worker-2"}, engine_nodes
    assert _running_on(cluster, deploy.GATEWAY_APP, deploy.INGRESS_DEPLOYMENT) == {"head"}
    reply = _chat(gateway, "[[say:hello from a worker]]")
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "hello from a worker"

    # Steady load: one request after another, recording (start, end, status).
    outcomes: list[tuple[float, float, int]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            began = time.monotonic()
            try:
                status = _chat(gateway, "[[say:ok]]", timeout=20).status_code
            except httpx.HTTPError:
                status = 0
            outcomes.append((began, time.monotonic(), status))
            time.sleep(0.2)

    # A stream in flight when the node dies ends with an error event and [DONE], not a hang.
    stream_lines: list[str] = []

    def stream() -> None:
        content = "[[tokens:400]][[delay-ms:100]]"
        body = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": content}]}
        with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=120) as r:
            stream_lines.extend(line for line in r.iter_lines() if line)

    threads = [threading.Thread(target=load), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    time.sleep(3)
    (victim,) = engine_nodes
    other = ({"worker-1", "worker-2"} - {victim}).pop()
    killed_at = time.monotonic()
    cluster.kill_worker(victim)
    threads[1].join(180)
    assert stream_lines and stream_lines[-1] == "data: [DONE]"
    assert any('"error"' in line for line in stream_lines[-3:]), stream_lines[-3:]

    # Ray marks the node dead (its health checks), Serve starts the engine on the other worker,
    # and requests started after that succeed.
    dead_at = _until(lambda: victim not in cluster.alive_nodes(), 180, "the killed node marked dead")
    moved_at = _until(lambda: _running_on(cluster, ENGINE_APP, ENGINE_DEPLOYMENT) == {other}, 300, "engine moved")
    _until(lambda: any(b > moved_at and st == 200 for b, _, st in outcomes), 120, "a request served after")
    stop.set()
    threads[0].join(30)
    failures = [e for _, e, st in outcomes if st != 200]
    last_failure = max(failures, default=killed_at)
    recovered = next((e for b, e, st in outcomes if st == 200 and b > last_failure), float("nan"))
    served = sum(1 for *_, st in outcomes if st == 200)
    print(
        f"\nnode kill under load: {len(outcomes)} requests, {served} served, {len(outcomes) - served} failed; "
        f"node marked dead after {dead_at - killed_at:.1f}s, engine running on {other} after "
        f"{moved_at - killed_at:.1f}s, served again (first success after the last failure) after "
        f"{recovered - killed_at:.1f}s"
    )
    reply = _chat(gateway, "[[say:back again]]")
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "back again"


def _until(check, timeout_s: float, what: str) -> float:
    """Poll ``check`` until true; the time it became true."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f}s"
        time.sleep(0.5)
    return time.monotonic()
