"""The gateway on a multi-node Ray cluster on this machine (gateway/cluster.py): a head (Serve's
controller, the ingress) and two worker nodes offering the ``engine`` resource, each a separate
``ray start`` process. The scripted engine's replica must run on a worker; then that worker's
raylet is SIGKILLed under steady load, and Serve must bring the engine back on the other one.
With two engine replicas (one per worker), one replica actor is killed under streaming load; and
with autoscaling (1 to 2 replicas), load makes Serve add a replica and its end removes it again.

Marked ``cluster``: it starts its own Ray cluster (about 3 minutes on 2 idle cores; the two
replica tests add about 5), apart from the session's single-node Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

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
        # `retriever`: one Retriever replica per worker (test_retriever_replicas_on_two_nodes_share_a_store).
        worker_resources=[{"engine": 1, "retriever": 1}, {"engine": 1, "retriever": 1}],
        num_cpus=2,
    )
    yield c
    c.down()
    assert not (state / "cluster.json").exists()


@pytest.fixture(scope="module")
def gateway_files(tmp_path_factory) -> tuple:
    """The config folder and the gateway's port (the head's Serve proxy)."""
    return tmp_path_factory.mktemp("cluster-config"), free_port()


def _apply(cluster, files, deployment: dict | None = None, sections: dict | None = None) -> None:
    """Write the scripted model's and the gateway's files and apply them; ``deployment`` is
    the model file's ``deployment`` section (none: one replica); ``sections`` replaces sections of
    ``gateway.yaml`` (none: embedding, guardrails and retrieval off)."""
    folder, port = files
    model = {
        "model_id": "scripted",
        "source": {"path": "/nonexistent/scripted"},
        "engine": {"stream_batching_interval_ms": 0},
        "placement": {"accelerator": "cpu", "cpus_per_worker": 0.1, "resources": {"engine": 1}},
    }
    if deployment is not None:
        model["deployment"] = deployment
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
        **(sections or {}),
    }
    (folder / "scripted.yaml").write_text(yaml.safe_dump(model))
    (folder / "gateway.yaml").write_text(yaml.safe_dump(config))
    deploy.apply(
        load_config(folder / "gateway.yaml"), address=cluster.dashboard, engine_cls=SCRIPTED_ENGINE, timeout_s=600
    )


@pytest.fixture(scope="module")
def gateway(cluster, gateway_files):
    _apply(cluster, gateway_files)
    return f"http://127.0.0.1:{gateway_files[1]}"


def _replicas(cluster, app: str, deployment: str) -> list[dict]:
    apps = deploy.ServeAPI(cluster.dashboard).details()["applications"]
    return apps[app]["deployments"][deployment]["replicas"]


def _running_on(cluster, app: str, deployment: str) -> set[str]:
    names = {node_id: name for name, node_id in cluster.alive_nodes().items()}
    return {names.get(r["node_id"], "?") for r in _replicas(cluster, app, deployment) if r["state"] == "RUNNING"}


def _chat(base: str, text: str, timeout: float = 30) -> httpx.Response:
    body = {"model": "scripted", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=timeout)


@pytest.fixture
def engine_deployment(cluster, gateway, gateway_files):
    """Apply the scripted model with a ``deployment`` section; back to one replica afterwards."""
    yield lambda deployment: _apply(cluster, gateway_files, deployment)
    _apply(cluster, gateway_files)


def _engine_states(cluster) -> dict[str, int]:
    """Replica states of the engine deployment: what ``serve status`` shows (Serve's REST API)."""
    states: dict[str, int] = {}
    for replica in _replicas(cluster, ENGINE_APP, ENGINE_DEPLOYMENT):
        states[replica["state"]] = states.get(replica["state"], 0) + 1
    return states


def _kill_actor(cluster, name: str) -> None:
    """``ray kill-actor --force --no-restart``: ``ray.kill(actor)`` from Ray's CLI. (A driver in
    this process cannot join the cluster: it imported Ray before the cluster's token auth mode
    could be set in its environment.)"""
    env = dict(os.environ, RAY_AUTH_MODE="token") if deploy.ray_auth_token() else None
    ray = str(Path(sys.executable).with_name("ray"))
    args = ["kill-actor", f"--address={cluster.address}", f"--name={name}", "--namespace=serve", "--force"]
    subprocess.run([ray, *args, "--no-restart"], env=env, check=True, timeout=120, capture_output=True)


STREAM_TOKENS = 100
SLOW_STREAM = f"[[delay-ms:100]][[tokens:{STREAM_TOKENS}]]"  # about 10 s per stream


class StreamLoad:
    """``clients`` threads, each streaming one slow scripted chat after another. Every stream's
    (start, end, outcome): ``ok`` (every token, then [DONE]), ``error`` (an error event, then
    [DONE]), ``torn`` (no [DONE]), ``malformed``, ``http-<status>``, or ``exception`` (a hang past the timeout,
    a dropped connection)."""

    def __init__(self, base: str, clients: int):
        self.base, self.outcomes, self.in_flight = base, [], 0
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self) -> None:
        body = {
            "model": "scripted",
            "stream": True,
            "messages": [{"role": "system", "content": SLOW_STREAM}, {"role": "user", "content": "go"}],
        }
        while not self._stop.is_set():
            began = time.monotonic()
            with self._lock:
                self.in_flight += 1
            try:
                with httpx.stream("POST", f"{self.base}/v1/chat/completions", json=body, timeout=60) as r:
                    lines = [line for line in r.iter_lines() if line]
                outcome = _stream_outcome(r.status_code, lines)
            except httpx.HTTPError:
                outcome = "exception"
            with self._lock:
                self.in_flight -= 1
                self.outcomes.append((began, time.monotonic(), outcome))

    def stop(self) -> list[tuple[float, float, str]]:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        assert not any(t.is_alive() for t in self._threads), "a client hung"
        return self.outcomes


def _stream_outcome(status: int, lines: list[str]) -> str:
    if status != 200:
        return f"http-{status}"
    if not lines or lines[-1] != "data: [DONE]":
        return "torn"
    if any('"error"' in line for line in lines[-3:]):
        return "error"
    try:
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    except ValueError:
        return "malformed"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return "ok" if text.split() == [f"t{i}" for i in range(STREAM_TOKENS)] else f"short-{len(text.split())}"


def test_a_killed_engine_replica_under_load(cluster, gateway, engine_deployment):
    engine_deployment({"num_replicas": 2})
    # One `engine` resource per worker: one replica on each.
    assert _running_on(cluster, ENGINE_APP, ENGINE_DEPLOYMENT) == {"worker-1", "worker-2"}
    before = [r["actor_name"] for r in _replicas(cluster, ENGINE_APP, ENGINE_DEPLOYMENT) if r["state"] == "RUNNING"]
    assert len(before) == 2, before
    load = StreamLoad(gateway, clients=4)
    time.sleep(5)
    victim = before[0]
    kill_began = time.monotonic()
    _kill_actor(cluster, victim)
    killed_at = time.monotonic()  # the CLI has returned: the actor is dead

    def replaced() -> bool:
        running = [
            r["actor_name"] for r in _replicas(cluster, ENGINE_APP, ENGINE_DEPLOYMENT) if r["state"] == "RUNNING"
        ]
        return len(running) == 2 and victim not in running

    try:
        replaced_at = _until(replaced, 300, "the killed replica replaced (2 RUNNING again)")
        time.sleep(12)  # load on both replicas again
    finally:
        outcomes = load.stop()

    # In flight at the kill: began before the CLI was called, still going then. (The CLI
    # returns seconds after the actor is dead: the streams on it have ended by then.)
    in_flight = [o for b, e, o in outcomes if b < kill_began < e]
    # New requests (began after the kill) are served, by the surviving replica until the
    # replacement runs.
    new = [(b, o) for b, _, o in outcomes if b > killed_at]
    by_survivor = [o for b, o in new if b < replaced_at]
    failed_new = [b - killed_at for b, o in new if o != "ok"]
    last_failure = max((e for _, e, o in outcomes if o != "ok"), default=killed_at)
    recovered = next((e for b, e, o in outcomes if o == "ok" and b > last_failure), float("nan"))
    served = sum(1 for *_, o in outcomes if o == "ok")
    failed_at = ", ".join(f"+{t:.1f}s" for t in failed_new)
    print(
        f"\nreplica kill under load (4 streaming clients, 10 s streams; the kill CLI took "
        f"{killed_at - kill_began:.1f}s): {len(outcomes)} streams, {served} served, {len(outcomes) - served} failed "
        f"({sorted(set(o for *_, o in outcomes))}); in flight across the kill: {in_flight}; "
        f"{len(failed_new)} begun after the kill failed{' (at ' + failed_at + ')' if failed_new else ''}; "
        f"{len(by_survivor)} begun before the replacement ran, {by_survivor.count('ok')} served; replacement "
        f"RUNNING {replaced_at - killed_at:.1f}s after the kill; every stream served from "
        f"+{recovered - killed_at:.1f}s"
    )
    bad = [o for *_, o in outcomes if o not in ("ok", "error")]
    assert not bad, f"streams neither completed nor ended with an error event and [DONE]: {bad}"
    assert all(b < kill_began for b, _, o in outcomes if o != "ok"), "a stream begun after the kill failed"
    assert "error" in in_flight, f"no stream in flight on the killed replica ended with an error: {in_flight}"
    assert "ok" in by_survivor, f"no request served between the kill and the replacement: {by_survivor}"
    assert not failed_new or max(failed_new) < replaced_at - killed_at, "requests still failing once replaced"


class Timeline:
    """Every second: the engine's replica states and Serve's target replica count (Serve's REST
    API, what ``serve status`` shows) and the streams in flight (each one ongoing at the engine)."""

    def __init__(self, cluster):
        self.cluster, self.rows, self.load = cluster, [], None
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            at = time.monotonic()
            try:
                apps = deploy.ServeAPI(self.cluster.dashboard).details()["applications"]
                engine = apps[ENGINE_APP]["deployments"][ENGINE_DEPLOYMENT]
                target, states = engine["target_num_replicas"], {}
                for replica in engine["replicas"]:
                    states[replica["state"]] = states.get(replica["state"], 0) + 1
            except Exception as exc:  # a slow or restarting controller: a gap in the timeline
                target, states = None, {"error": type(exc).__name__}
            load = self.load
            self.rows.append(
                (at - self.started, states.get("RUNNING", 0), target, load.in_flight if load else 0, states)
            )
            self._stop.wait(max(0.0, 1 - (time.monotonic() - at)))

    def running(self) -> int:
        return self.rows[-1][1] if self.rows else 0

    def settled(self, replicas: int) -> bool:
        return bool(self.rows) and self.rows[-1][4] == {"RUNNING": replicas}

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(30)
        lines = ["   t  running  target  in-flight  replica states"]
        lines += [f"{t:4.0f}  {r:7d}  {g!s:>6}  {f:9d}  {s}" for t, r, g, f, s in self.rows]
        return "\n".join(lines)


AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 2,
    "downscale_delay_s": 5,
}


def test_engine_autoscales_up_under_load_and_back_down(cluster, gateway, engine_deployment):
    engine_deployment({"autoscaling": AUTOSCALING})
    _until(lambda: _engine_states(cluster) == {"RUNNING": 1}, 120, "one engine replica at min_replicas")
    timeline = Timeline(cluster)
    time.sleep(3)
    timeline.load = load = StreamLoad(gateway, clients=4)
    load_at = time.monotonic()
    try:
        up_at = _until(lambda: timeline.running() == 2, 180, "2 replicas under load")
        time.sleep(10)
    finally:
        outcomes = load.stop()
        stopped_at = time.monotonic()
        timeline.load = None
    try:
        down_at = _until(lambda: timeline.settled(1), 300, "back to 1 replica once the load stopped")
        time.sleep(3)
    finally:
        print("\n" + timeline.stop())
    served = sum(1 for *_, o in outcomes if o == "ok")
    up_decided = next(t for t, _, g, *_ in timeline.rows if g == 2) + timeline.started - load_at
    down_decided = next(t for t, _, g, *_ in timeline.rows if t + timeline.started > stopped_at and g == 1)
    print(
        f"autoscaling {AUTOSCALING}, 4 streaming clients (10 s streams): Serve's target 1 -> 2 "
        f"{up_decided:.1f}s after the load began, 2 replicas RUNNING after {up_at - load_at:.1f}s; target back "
        f"to 1 {down_decided + timeline.started - stopped_at:.1f}s after the load stopped, 1 replica left after "
        f"{down_at - stopped_at:.1f}s; {len(outcomes)} streams, {served} served"
    )
    assert served == len(outcomes), [o for *_, o in outcomes if o != "ok"]


RETRIEVER = "Retriever"
FACT = "The lighthouse keeper on Skarvholm island owns exactly 7351 brass telescopes."


def test_retriever_replicas_on_two_nodes_share_a_store(cluster, gateway, gateway_files, tmp_path):
    storage = tmp_path / "shared-retrieval"  # a path every node reaches (one machine: a local folder)
    sections = {
        "embedding": {"enabled": True, "num_cpus": 0.1, "resources": {"stages": 0.01}},
        "retrieval": {
            "enabled": True,
            "storage_dir": str(storage),
            "num_replicas": 2,
            "num_cpus": 0.1,
            "resources": {"retriever": 1},  # one per worker: each replica on its own node
        },
    }
    http = httpx.Client(base_url=gateway, timeout=120)
    _apply(cluster, gateway_files, sections=sections)
    try:
        assert _running_on(cluster, deploy.GATEWAY_APP, RETRIEVER) == {"worker-1", "worker-2"}
        store = http.post("/v1/vector_stores", json={"name": "cluster-shared"})
        assert store.status_code == 200, store.text
        store_id = store.json()["id"]
        upload = http.post(
            "/v1/files", files={"file": ("skarvholm.txt", FACT.encode())}, data={"purpose": "assistants"}
        )
        assert upload.status_code == 200, upload.text
        file_id = upload.json()["id"]
        added = http.post(f"/v1/vector_stores/{store_id}/files", json={"file_id": file_id})
        assert added.status_code == 200, added.text

        def indexed() -> bool:
            r = http.get(f"/v1/vector_stores/{store_id}/files/{file_id}")
            assert r.status_code == 200, r.text
            assert r.json()["status"] != "failed", r.text
            return r.json()["status"] == "completed"

        _until(indexed, 120, "the file indexed")

        def search() -> list[dict]:
            r = http.post(f"/v1/vector_stores/{store_id}/search", json={"query": "How many brass telescopes?"})
            assert r.status_code == 200, r.text
            return r.json()["data"]

        found = [search() for _ in range(20)]
        misses = [
            i
            for i, hits in enumerate(found)
            if not any("7351 brass telescopes" in h["content"][0]["text"] for h in hits)
        ]
        assert not misses, f"searches {misses} of 20 did not find the fact"
        # Which replica served each search is not observable here: the response does not say, and
        # Serve's per-replica access log lines are buffered in the replica (RAY_SERVE_THROUGHPUT_OPTIMIZED
        # sets RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE to 1000), so the log files stay empty meanwhile.
        # Serve's router picks among both RUNNING replicas per call (not verified per call here).
        print("\n20 of 20 searches through 2 Retriever replicas (worker-1, worker-2) found the fact")

        deleted = http.delete(f"/v1/vector_stores/{store_id}/files/{file_id}")
        assert deleted.status_code == 200 and deleted.json()["deleted"], deleted.text
        still = [i for i in range(20) if any(h["file_id"] == file_id for h in search())]
        assert not still, f"searches {still} of 20 still found the deleted file"
    finally:
        http.close()
        _apply(cluster, gateway_files)


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
