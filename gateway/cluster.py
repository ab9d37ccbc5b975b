"""A multi-node Ray cluster on this machine, for tests and demos.

``python -m gateway cluster up --workers 2`` starts a head and N worker nodes as separate
``ray start --block`` processes: separate raylets, object stores and resources, each killable on
its own (``python -m gateway cluster kill-worker 1`` SIGKILLs that node's raylet, as a machine
failure would), then applies the gateway to it through Serve's REST API as on any cluster.
``python -m gateway cluster down`` stops every process it started (by process group, then by
pid). ``ray.cluster_utils.Cluster`` would start the same raylets from inside one driver; separate
``ray start`` processes are what a real cluster runs, and what an operator kills.

Custom resources say which node is for what: by default the first worker has ``{"engine": 1}``
and the others ``{"stages": 1}``; a model's ``placement.resources`` and a stage's ``resources``
in ``gateway.yaml`` ask for them. Every node on one machine needs its own Serve proxy port: the
head's is the gateway's ``port``, each worker's is set through
``RAY_SERVE_WORKER_PROXY_HTTP_PORT`` (Serve's per-node override for colocated proxies).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.deploy import ray_auth_token

DEFAULT_STATE_DIR = Path(".data/cluster")
NODE_LABEL = "gateway-node"
START_ATTEMPTS = 3  # a Ray node label naming each node: head, worker-1, ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str
    pid: int  # the `ray start --block` process, leader of its own process group
    resources: dict[str, float]
    num_cpus: float
    proxy_port: int | None = None  # a worker's Serve proxy


@dataclass
class LocalCluster:
    """The processes of one local cluster, saved to ``<state_dir>/cluster.json``."""

    state_dir: Path
    gcs_port: int
    dashboard_port: int
    temp_dir: str
    nodes: list[Node] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    # -- starting --------------------------------------------------------------------------

    @classmethod
    def up(
        cls,
        workers: int = 2,
        *,
        state_dir: Path = DEFAULT_STATE_DIR,
        head_resources: dict[str, float] | None = None,
        worker_resources: list[dict[str, float]] | None = None,
        num_cpus: float = 2,
        env: dict[str, str] | None = None,
        timeout_s: float = 300,
    ) -> LocalCluster:
        """Start a head and ``workers`` worker nodes and wait until all are alive."""
        state_dir = Path(state_dir).resolve()
        if (state_dir / "cluster.json").exists():
            raise RuntimeError(f"a cluster is already up ({state_dir / 'cluster.json'}); run `cluster down` first")
        (state_dir / "logs").mkdir(parents=True, exist_ok=True)
        if worker_resources is None:
            worker_resources = [{"engine": 1} if i == 0 else {"stages": 1} for i in range(workers)]
        if len(worker_resources) != workers:
            raise ValueError(f"{len(worker_resources)} worker resource sets for {workers} workers")
        for attempt in range(1, START_ATTEMPTS + 1):
            gcs_port = free_port()
            cluster = cls(state_dir, gcs_port, free_port(), f"/tmp/ray-gw-{gcs_port}")
            try:
                cluster._start_head(head_resources or {}, num_cpus, env or {})
                cluster.save()
                cluster._wait(1, timeout_s)
                break
            except NodeExited:
                cluster.down(timeout_s=5)
                if attempt == START_ATTEMPTS:
                    raise
                print(f"the head did not start (attempt {attempt}; a loaded machine?): retrying", flush=True)
            except BaseException:
                cluster.down()
                raise
        try:
            for i, resources in enumerate(worker_resources, 1):
                cluster.add_worker(f"worker-{i}", resources, num_cpus=num_cpus, env=env, timeout_s=timeout_s)
        except BaseException:
            cluster.down()
            raise
        return cluster

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        from gateway.__main__ import RAY_ENV_DEFAULTS

        env = dict(os.environ)
        # Serve's HAProxy uses fixed ports (8404, 9101) and files (/tmp/haproxy-serve) per
        # node: several nodes on one machine would share them. Serve's Python proxy here.
        env.setdefault("RAY_SERVE_ENABLE_HA_PROXY", "0")
        for key, value in RAY_ENV_DEFAULTS.items():
            env.setdefault(key, value)
        if "RAY_AUTH_MODE" not in env and ray_auth_token():
            # A head finding a token turns token auth on by itself; a worker only when told.
            env["RAY_AUTH_MODE"] = "token"
        env.update(extra)
        return env

    def _spawn(self, node: str, args: list[str], env: dict[str, str]) -> int:
        ray = str(Path(sys.executable).with_name("ray"))
        log = open(self.state_dir / "logs" / f"{node}.log", "ab")  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen(
            [ray, "start", "--block", f"--temp-dir={self.temp_dir}", "--disable-usage-stats", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: `down` stops the whole node
        )
        log.close()
        return proc.pid

    def _start_head(self, resources: dict[str, float], num_cpus: float, env: dict[str, str]) -> None:
        pid = self._spawn(
            "head",
            [
                "--head",
                f"--port={self.gcs_port}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                f"--num-cpus={num_cpus}",
                f"--resources={json.dumps(resources)}",
                f"--labels={json.dumps({NODE_LABEL: 'head'})}",
                # Not the fixed default (52365): another Ray on this machine may hold it.
                f"--dashboard-agent-listen-port={free_port()}",
            ],
            self._env(env),
        )
        self.nodes.append(Node("head", pid, resources, num_cpus))

    def add_worker(
        self,
        name: str,
        resources: dict[str, float],
        *,
        num_cpus: float = 2,
        env: dict[str, str] | None = None,
        wait: bool = True,
        timeout_s: float = 300,
    ) -> Node:
        """Start one more worker node (also to replace a killed one). Ray gives a starting node
        30 s to register, which a loaded machine can miss: it is started again then."""
        for attempt in range(1, START_ATTEMPTS + 1):
            node = self._start_worker(name, resources, num_cpus, env)
            if not wait:
                return node
            try:
                self._wait(len(self.alive_nodes()) + 1, timeout_s)
                return node
            except NodeExited:
                self.nodes.remove(node)
                _kill_node(node.pid, self.temp_dir)
                self.save()
                if attempt == START_ATTEMPTS:
                    raise
                print(f"{name} did not start (attempt {attempt}; a loaded machine?): retrying", flush=True)
        raise AssertionError("unreachable")

    def _start_worker(
        self, name: str, resources: dict[str, float], num_cpus: float, env: dict[str, str] | None
    ) -> Node:
        proxy_port = free_port()
        extra = {"RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(proxy_port), **(env or {})}
        pid = self._spawn(
            name,
            [
                f"--address={self.address}",
                f"--num-cpus={num_cpus}",
                f"--resources={json.dumps(resources)}",
                f"--labels={json.dumps({NODE_LABEL: name})}",
                # Fixed by default (52365): one per node on one machine.
                f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}",
            ],
            self._env(extra),
        )
        node = Node(name, pid, resources, num_cpus, proxy_port)
        self.nodes.append(node)
        self.save()
        return node

    # -- looking at it ---------------------------------------------------------------------

    def _get(self, path: str) -> Any:
        token = ray_auth_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = httpx.get(self.dashboard + path, headers=headers, timeout=10)
        r.raise_for_status()
        return r.json()

    def ray_nodes(self) -> list[dict[str, Any]]:
        """Ray's view of the nodes (state API): node_id, state, labels, resources_total."""
        data = self._get("/api/v0/nodes?limit=1000&detail=true")
        return data["data"]["result"]["result"]

    def alive_nodes(self) -> dict[str, str]:
        """Node name (our label) -> Ray node id, for nodes Ray sees alive."""
        try:
            nodes = self.ray_nodes()
        except (httpx.HTTPError, KeyError, ValueError):
            return {}
        return {n["labels"].get(NODE_LABEL, "?"): n["node_id"] for n in nodes if n.get("state") == "ALIVE"}

    def _wait(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.alive_nodes()) < count:
            for node in self.nodes:
                if not _running(node.pid):
                    raise NodeExited(f"{node.name} exited; see {self.state_dir / 'logs' / (node.name + '.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} nodes not alive after {timeout_s:.0f}s: {self.alive_nodes()}")
            time.sleep(1)

    # -- failures and stopping -------------------------------------------------------------

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def kill_worker(self, name: str) -> int:
        """SIGKILL a worker node's raylet, as a machine failure would; its replicas die with it
        and `ray start --block` then stops the node's other processes. Returns the raylet's pid."""
        import psutil

        node = self.node(name)
        if node.name == "head":
            raise ValueError("the head holds the GCS and Serve's controller; kill a worker")
        raylets = [p for p in psutil.Process(node.pid).children(recursive=True) if p.name() == "raylet"]
        if not raylets:
            raise RuntimeError(f"{name} has no raylet running")
        for raylet in raylets:
            raylet.kill()
        return raylets[0].pid

    def down(self, timeout_s: float = 30) -> None:
        """Stop every node (workers first): SIGTERM to each node's process group, SIGKILL to
        whatever of it is left after ``timeout_s``."""
        import psutil

        procs: list[psutil.Process] = []
        for node in reversed(self.nodes):
            # A killed node's `ray start` has ended, but members of its group may live on.
            for proc in _node_processes(node.pid, self.temp_dir):
                procs.append(proc)
                try:
                    proc.terminate()
                except psutil.NoSuchProcess:
                    pass
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        # Ray's sessions (sockets, logs, spilled objects) of this cluster only; the `ray start`
        # output stays in <state_dir>/logs.
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        (self.state_dir / "cluster.json").unlink(missing_ok=True)

    # -- the state file --------------------------------------------------------------------

    def save(self) -> None:
        data = asdict(self)
        data["state_dir"] = str(self.state_dir)
        (self.state_dir / "cluster.json").write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, state_dir: Path = DEFAULT_STATE_DIR) -> LocalCluster:
        path = Path(state_dir).resolve() / "cluster.json"
        if not path.exists():
            raise RuntimeError(f"no cluster is up ({path} does not exist)")
        data = json.loads(path.read_text())
        data["state_dir"] = Path(data["state_dir"])
        data["nodes"] = [Node(**n) for n in data["nodes"]]
        return cls(**data)


class NodeExited(RuntimeError):
    """A node's `ray start` process ended (while starting: usually Ray's 30 s registration limit)."""


def _node_processes(pgid: int, temp_dir: str) -> list:
    """The processes of one node we started: its `ray start` process group, and only those
    whose command line names this cluster's temp dir (a recycled process group id is not ours)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getpgid(proc.pid) == pgid and temp_dir in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def _kill_node(pgid: int, temp_dir: str) -> None:
    """SIGKILL what is left of a node that failed to start (its GCS or raylet may linger)."""
    for proc in _node_processes(pgid, temp_dir):
        try:
            proc.kill()
        except Exception:
            pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (our own child that exited) is not running
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:
        return True


# --- the command line ---------------------------------------------------------------------


def command(args) -> int:
    """``python -m gateway cluster up|down|status|kill-worker``."""
    state_dir = Path(args.state_dir)
    if args.cluster_command == "up":
        workers = [json.loads(r) for r in args.worker_resources] if args.worker_resources else None
        cluster = LocalCluster.up(
            args.workers,
            state_dir=state_dir,
            head_resources=json.loads(args.head_resources),
            worker_resources=workers,
            num_cpus=args.num_cpus,
        )
        print(f"cluster up: head and {args.workers} worker(s) at {cluster.address}", flush=True)
        for node in cluster.nodes:
            print(f"  {node.name}: pid {node.pid}, resources {node.resources}", flush=True)
        print(f"Serve REST API: {cluster.dashboard}", flush=True)
        if args.config:
            from gateway.__main__ import _apply_and_report

            overrides = {"port": args.port} if args.port else {}
            return _apply_and_report(args.config, overrides, cluster.dashboard, dry_run=False)
        return 0
    try:
        cluster = LocalCluster.load(state_dir)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.cluster_command == "down":
        cluster.down()
        print("cluster down", flush=True)
    elif args.cluster_command == "kill-worker":
        pid = cluster.kill_worker(args.name)
        print(f"killed {args.name}'s raylet (pid {pid})", flush=True)
    else:
        alive = cluster.alive_nodes()
        for node in cluster.nodes:
            state = "alive" if node.name in alive else "dead"
            print(f"{node.name}: {state}, resources {node.resources}, pid {node.pid}", flush=True)
        print(f"Serve REST API: {cluster.dashboard}", flush=True)
    return 0


def add_parser(sub) -> None:
    cluster = sub.add_parser("cluster", help="a multi-node Ray cluster on this machine (tests, demos)")
    cluster.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR))
    verbs = cluster.add_subparsers(dest="cluster_command", required=True)
    up = verbs.add_parser("up", help="start a head and worker nodes, then apply the gateway")
    up.add_argument("--workers", type=int, default=2)
    up.add_argument("--num-cpus", type=float, default=2, help="CPUs each node offers Ray")
    up.add_argument("--head-resources", default="{}", help="JSON, e.g. '{\"stages\": 1}'")
    up.add_argument(
        "--worker-resources",
        action="append",
        help='JSON, once per worker (default: {"engine": 1} for the first, {"stages": 1} for the others)',
    )
    up.add_argument("--config", default="configs/gateway.yaml", help="apply this gateway config ('' for none)")
    up.add_argument("--port", type=int, help="the gateway's port (the head's Serve proxy)")
    verbs.add_parser("down", help="stop every node the last `up` started")
    verbs.add_parser("status", help="which nodes are alive")
    kill = verbs.add_parser("kill-worker", help="SIGKILL a worker node's raylet (a node failure)")
    kill.add_argument("name", help="worker-1, worker-2, ...")
