"""CPU time per request, by process, while one arm of a benchmark is under load.

Requests/s on a saturated machine is its cores divided by the CPU one request costs, summed
over every process the request passes through. This meter says where that CPU goes: for the
gateway, per Serve deployment (ingress, Guardrails, Retriever, the engine replica, Serve's
proxy and controller, Ray's own processes); for LiteLLM, its proxy; and the instant backend
apart. It reads the processes' user + system time (``psutil``, which vLLM already requires)
at ``start`` and ``stop``, so it measures what the kernel charged, waits and stalls included.
"""

from __future__ import annotations

import psutil

# Ray process names (``ray::<actor class or replica>``) and binaries, as labels for the table;
# the first key found in a process's command line names it.
_RAY_LABELS = (
    ("ServeReplica:gateway:Gateway", "gateway ingress"),
    ("ServeReplica:gateway:Guardrails", "Guardrails"),
    ("ServeReplica:gateway:Retriever", "Retriever"),
    ("ServeReplica:gateway:Embedder", "Embedder"),
    ("ServeReplica:gateway:Limiter", "Limiter"),
    (":Engine:", "engine replica"),
    ("ProxyActor", "Serve proxy"),
    ("HAProxyManager", "Serve proxy"),
    ("haproxy", "Serve proxy"),
    ("ServeController", "Serve controller"),
    ("gcs_server", "Ray: GCS"),
    ("raylet", "Ray: raylet"),
    ("ray-dashboard-", "Ray: dashboard"),
    ("dashboard/dashboard.py", "Ray: dashboard"),
    ("Agent", "Ray: agents"),  # ray::DashboardAgent, TelemetryAgent, RuntimeEnvAgent
    ("log_monitor", "Ray: log monitor"),
)
# What stands for the model server in each stack: not the proxy's own CPU.
BACKEND_LABELS = ("instant backend", "engine replica")


def _label(server: str, proc: psutil.Process) -> str:
    if server != "gateway":
        return {"backend": "instant backend"}.get(server, server)
    try:
        name = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return "Ray system"
    return next((label for key, label in _RAY_LABELS if key in name), "Ray: other")


def _cpu_s(proc: psutil.Process) -> float | None:
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


class CpuMeter:
    """CPU seconds of each labelled process between ``start`` and ``stop``.

    ``roots`` maps a server's name to its root pid; every descendant is counted under that
    server (the gateway's Ray processes are split further by ``_RAY_LABELS``). Processes that
    start or end in between are left out, so measure a steady phase."""

    def __init__(self, roots: dict[str, int]):
        self._roots = roots
        self._start: dict[int, tuple[str, psutil.Process, float]] = {}

    def start(self) -> None:
        self._start = {}
        for server, pid in self._roots.items():
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in procs:
                cpu = _cpu_s(proc)
                if cpu is not None:
                    self._start[proc.pid] = (_label(server, proc), proc, cpu)

    def stop(self, requests: int) -> dict[str, float]:
        """Milliseconds of CPU per request, by label, for ``requests`` answered requests."""
        used: dict[str, float] = {}
        for label, proc, before in self._start.values():
            after = _cpu_s(proc)
            if after is not None:
                used[label] = used.get(label, 0.0) + (after - before)
        per_request = {label: s * 1000 / max(requests, 1) for label, s in used.items()}
        return {label: ms for label, ms in sorted(per_request.items(), key=lambda kv: -kv[1]) if ms >= 0.005}


def own_ms(per_request: dict[str, float]) -> float:
    """The proxy's own CPU per request: everything but what stands for the model server."""
    return sum(ms for label, ms in per_request.items() if label not in BACKEND_LABELS)


def cpu_table(by_arm: dict[str, dict[str, float]], cores: int | None, unit: str = "CPU ms per request") -> str:
    """Rows: processes; columns: arms; then the total, the proxy's own share (``own_ms``) and,
    with ``cores``, the requests/s the total would allow with every core of this machine to
    itself (an arm below it is bound elsewhere: one process's core, the load generator)."""
    arms = [a for a, v in by_arm.items() if v]
    labels: list[str] = []
    for arm in arms:
        labels += [label for label in by_arm[arm] if label not in labels]
    width = max([len(a) for a in arms] + [9])
    head = f"{unit:<24}" + "".join(f"{a:>{width + 2}}" for a in arms)
    lines = [head, "-" * len(head)]
    for label in labels:
        cells = "".join(
            f"{by_arm[a][label]:>{width + 2}.2f}" if label in by_arm[a] else f"{'-':>{width + 2}}" for a in arms
        )
        lines.append(f"{label:<24}{cells}")
    lines.append("-" * len(head))
    lines.append(f"{'total':<24}" + "".join(f"{sum(by_arm[a].values()):>{width + 2}.2f}" for a in arms))
    lines.append(f"{'own (not the backend)':<24}" + "".join(f"{own_ms(by_arm[a]):>{width + 2}.2f}" for a in arms))
    if cores:
        ceiling = "".join(f"{cores * 1000 / max(sum(by_arm[a].values()), 1e-9):>{width + 2}.0f}" for a in arms)
        lines.append(f"{f'CPU-bound req/s, {cores} cores':<24}" + ceiling)
    return "\n".join(lines)
