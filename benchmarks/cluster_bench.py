"""The gateway on a local multi-node Ray cluster: throughput with 1 vs 2 engine replicas, and the
gateway's added latency with its stages on one node vs split across two.

Starts a head and three workers with the project's ``gateway.cluster.LocalCluster`` (separate
``ray start`` processes, as ``python -m gateway cluster up``), applies generated configs with
``gateway.deploy.apply`` (Serve's REST API) and always stops the cluster, on Ctrl-C too. Nodes:
head ``{head: 1}`` (the ingress), worker-1 ``{engine: 1, worker_1: 1}``, worker-2
``{engine: 1, worker_2: 1}``, worker-3 ``{stages: 1, worker_3: 1}``.

**Part 1**, stages off: the model at ``num_replicas: 1``, then 2 (one per ``engine`` worker, from
``placement.resources``); ``--clients`` streaming clients, one chat after another, for
``--duration`` s each: requests/s, output tokens/s, TTFT p50/p99, failures, the ratio. With
``--engine scripted`` (default; ``[[tokens:N]][[delay-ms:M]]``, timed sleeps) it measures Serve's
routing and spreading over nodes, not model compute; each replica takes at most ``--max-ongoing``
streams (default half the clients), standing in for an engine's batch capacity, which a scripted
replica does not have. ``--engine vllm``: the embedded SmolLM2 on real vLLM; on 2 cores both
replicas share the same cores, so no speed-up is expected.

**Part 2**: the default stages (guardrails, retrieval on a one-file ``docs`` store, embedding)
with the scripted engine answering one token at once, placed (a) ``one-node``: the ingress and
every stage on the head, or (b) ``two-nodes``: the ingress on the head, guardrails on worker-3,
embedding and retrieval on worker-2. Rounds alternate a, b, a, b (the machine is noisy):
``--requests`` sequential non-streamed chats, then ``--p2-clients`` clients for ``--p2-seconds``;
``x-gateway-overhead-ms`` and end-to-end latency p50/p90, and the ratio b/a. The nodes are
processes of one machine: "across nodes" is loopback between raylets, not a network.

    python benchmarks/cluster_bench.py                           # ~15 min on 2 loaded cores
    python benchmarks/cluster_bench.py --duration 20 --parts 1   # part 1 only
    python benchmarks/cluster_bench.py --engine vllm             # part 1 on real vLLM

Writes report.md, cluster.json and (with matplotlib) cluster.png to
benchmarks/results/cluster-<time>/. If killed hard: ``python -m gateway cluster down --state-dir
<that folder>/cluster``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Progress, closed_loop, prompts, pyplot, seed_docs, summary, timed_chat, timed_stream  # noqa: E402

from gateway import deploy  # noqa: E402
from gateway.cluster import LocalCluster, free_port  # noqa: E402
from gateway.config import load_config  # noqa: E402
from gateway.metrics import OVERHEAD_HEADER  # noqa: E402

SCRIPTED = "engines.scripted_engine:ScriptedEngine"
SCRIPTED_ID = "scripted"
HEAD = {"head": 1}
WORKERS = [{"engine": 1, "worker_1": 1}, {"engine": 1, "worker_2": 1}, {"stages": 1, "worker_3": 1}]
STAGES = ("embedding", "retrieval", "guardrails")
ON = 0.01  # a custom resource amount that only places a replica
PLACEMENTS = {  # part 2: stage -> the node resource it asks for
    "one-node": {"ingress": "head", "guardrails": "head", "embedding": "head", "retrieval": "head"},
    "two-nodes": {"ingress": "head", "guardrails": "worker_3", "embedding": "worker_2", "retrieval": "worker_2"},
}
DEPLOYMENT = {"ingress": "Gateway", "guardrails": "Guardrails", "embedding": "Embedder", "retrieval": "Retriever"}
NODE = {"head": "head", "worker_1": "worker-1", "worker_2": "worker-2", "worker_3": "worker-3"}
PROMPTS = prompts(60)


class Bench:
    """The cluster, the settings, the config folder and what the run has recorded so far."""

    def __init__(self, args: argparse.Namespace, out: Path, cluster: LocalCluster):
        self.args, self.out, self.cluster, self.port = args, out, cluster, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = yaml.safe_load(Path(args.config).read_text())
        self.config_dir = Path(args.config).resolve().parent
        self.real_model = yaml.safe_load((self.config_dir / self.base["models"][0]).read_text())
        self.models_dir = str(load_config(args.config).models_dir)
        self.loads: list[tuple[str, float]] = []
        self.applies: list[dict] = []
        self.seeded: str | None = None

    def note(self, what: str) -> None:
        self.loads.append((what, os.getloadavg()[0]))
        print(f"[{time.strftime('%H:%M:%S')}] {what} (load {os.getloadavg()[0]:.1f})", flush=True)

    def write_config(self, name: str, *, engine: str, replicas: int, engine_res: dict, stages: dict | None) -> Path:
        """A gateway.yaml and its one model file under the run's folder. ``stages``: stage ->
        node resource (stages on), or None (stages off)."""
        folder = self.out / "configs" / name
        folder.mkdir(parents=True, exist_ok=True)
        if engine == "vllm":
            model = {k: copy.deepcopy(v) for k, v in self.real_model.items() if k not in ("guardrails", "retrieval")}
            model["placement"] = {**model.get("placement", {}), "resources": engine_res}
        else:
            model = {
                "model_id": SCRIPTED_ID,
                "source": {"path": "/nonexistent/scripted"},  # the scripted engine loads nothing
                "engine": {"stream_batching_interval_ms": 0},
                "placement": {"accelerator": "cpu", "cpus_per_worker": 0.1, "resources": engine_res},
            }
            if stages is not None:
                model.update(
                    {k: self.real_model[k] for k in ("guardrails", "retrieval", "requests") if k in self.real_model}
                )
        model["deployment"] = {**model.get("deployment", {}), "num_replicas": replicas}
        max_ongoing = self.args.max_ongoing or (self.args.clients // 2 if engine == "scripted" else None)
        if stages is None and max_ongoing:
            model["deployment"]["max_ongoing_requests"] = max_ongoing
        gw = copy.deepcopy(self.base)
        gw.update(host="127.0.0.1", port=self.port, models=["model.yaml"], models_dir=self.models_dir)
        for section in ("embedding", "guardrails", "retrieval"):
            gw[section] = dict(gw.get(section) or {})
        gw["guardrails"]["placement"] = "deployment"  # a stage of its own, placed on a node below
        gw["retrieval"]["storage_dir"] = str(self.out / "retrieval")
        gw["limits"] = {**(gw.get("limits") or {}), "budget_file": str(self.out / "budgets.json")}
        gw["ingress"] = {**(gw.get("ingress") or {}), "resources": {"head": ON}}
        for stage in STAGES:
            if stages is None:
                gw[stage]["enabled"] = False
            else:
                gw[stage]["resources"] = {stages[stage]: ON}
        (folder / "model.yaml").write_text(yaml.safe_dump(model, sort_keys=False))
        (folder / "gateway.yaml").write_text(yaml.safe_dump(gw, sort_keys=False))
        return folder / "gateway.yaml"

    def placement(self) -> dict[str, list[str]]:
        """Deployment -> the nodes its RUNNING replicas are on (Serve's REST API), plus any
        replica not RUNNING (starting or stopping) as ``<state>``."""
        names = {node_id: name for name, node_id in self.cluster.alive_nodes().items()}
        out = {}
        for app in deploy.ServeAPI(self.cluster.dashboard).details()["applications"].values():
            for name, dep in app["deployments"].items():
                out[name] = sorted(
                    names.get(r["node_id"], "?") if r["state"] == "RUNNING" else f"<{r['state']}>"
                    for r in dep["replicas"]
                )
        return out

    def apply(self, label: str, path: Path, engine_cls: str | None, expect: dict[str, list[str] | int]) -> None:
        """Apply ``path`` and wait until the replicas are where ``expect`` says (a list of nodes,
        or a replica count on any node), with no other replica of those deployments left."""
        self.note(f"applying {label}")
        began = time.monotonic()
        deploy.apply(load_config(path), address=self.cluster.dashboard, engine_cls=engine_cls, timeout_s=900)

        while True:
            seen = self.placement()
            if all(_placed(seen.get(d, []), want) for d, want in expect.items()):
                break
            if time.monotonic() - began > 600:
                raise RuntimeError(f"{label}: replicas not placed as expected {expect}: {seen}")
            time.sleep(1)
        took = time.monotonic() - began
        shown = {d: v for d, v in seen.items() if d in expect or d in DEPLOYMENT.values()}
        self.applies.append({"label": label, "seconds": round(took, 1), "placement": shown})
        self.note(f"{label} running after {took:.0f} s: {shown}")


def _placed(got: list[str], want: list[str] | int) -> bool:
    """Every replica RUNNING, on exactly the nodes ``want`` lists (or ``want`` of them anywhere)."""
    return not any(n.startswith("<") for n in got) and (got == want if isinstance(want, list) else len(got) == want)


# --- part 1: engine replicas ---------------------------------------------------------------


def stream_body(args: argparse.Namespace, model: str, n: int) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if args.engine == "scripted":
        directives = f"[[tokens:{args.tokens}]][[delay-ms:{args.delay_ms}]]"
        body["messages"] = [{"role": "system", "content": directives}, {"role": "user", "content": "go"}]
    else:  # a fixed output length; sampling stated so the model's defaults do not vary it
        body["messages"] = [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}]
        body.update(max_tokens=args.tokens, ignore_eos=True, temperature=0, top_p=1, repetition_penalty=1.0)
    return body


async def stream_load(url: str, args: argparse.Namespace, model: str, seconds: float, label: str) -> dict:
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        rows, elapsed = await closed_loop(
            args.clients, seconds, lambda c, i: timed_stream(http, stream_body(args, model, c + i)), label
        )
    return {"elapsed_s": elapsed, "rows": rows}


def stream_figures(runs: list[dict], expected_tokens: int) -> dict:
    rows = [r for run in runs for r in run["rows"]]
    ok = [r for r in rows if r["status"] == 200 and r["done"] and not r["code"] and r["tokens"] >= expected_tokens]
    elapsed = sum(run["elapsed_s"] for run in runs)
    return {
        "requests": len(rows),
        "ok": len(ok),
        "failed": len(rows) - len(ok),
        "failures": sorted({f"{r['status']}/{r['code']}/{r['tokens']} tokens" for r in rows if r not in ok}),
        "seconds": round(elapsed, 1),
        "rps": len(ok) / elapsed,
        "tok_s": sum(r["tokens"] for r in ok) / elapsed,
        "ttft_ms": summary([r["ttft_ms"] for r in ok]),
        "total_ms": summary([r["total_ms"] for r in ok]),
    }


def part1(bench: Bench) -> dict:
    args = bench.args
    model = SCRIPTED_ID if args.engine == "scripted" else bench.real_model["model_id"]
    engine_cls = SCRIPTED if args.engine == "scripted" else None
    engine_dep = deploy.engine_deployment_name(model)
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for rnd in range(args.replica_rounds):
        for replicas in (1, 2):
            label = f"part 1: {replicas} engine replica(s), round {rnd + 1}"
            path = bench.write_config(
                f"p1-{replicas}", engine=args.engine, replicas=replicas, engine_res={"engine": 1}, stages=None
            )
            expect = {engine_dep: 1 if replicas == 1 else ["worker-1", "worker-2"], "Gateway": ["head"]}
            bench.apply(label, path, engine_cls, expect)
            asyncio.run(stream_load(bench.url, args, model, 2, "warm-up"))  # connections, first requests
            bench.note(f"{label}: {args.clients} streaming clients for {args.duration:.0f} s")
            run = asyncio.run(stream_load(bench.url, args, model, args.duration, f"{replicas} replica(s)"))
            runs[replicas].append(run)
            f = stream_figures([run], args.tokens)
            bench.note(f"{label}: {f['ok']} ok, {f['failed']} failed, {f['rps']:.2f} req/s, {f['tok_s']:.1f} tok/s")
    figures = {n: stream_figures(r, args.tokens) for n, r in runs.items()}
    return {"model": model, "figures": figures}


# --- part 2: stage placement ---------------------------------------------------------------


async def placement_round(url: str, args: argparse.Namespace, tag: str) -> dict:
    """Warm-up, ``args.requests`` sequential chats, then ``args.p2_clients`` concurrent clients;
    every prompt distinct (the rails cache verdicts per text)."""
    limits = httpx.Limits(max_connections=args.p2_clients, max_keepalive_connections=args.p2_clients)

    def ask(http: httpx.AsyncClient, c: int | str, i: int):
        body = {"model": SCRIPTED_ID, "max_tokens": 1}
        body["messages"] = [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} (#{tag}-{c}-{i})"}]
        return timed_chat(http, body, OVERHEAD_HEADER)

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        for i in range(5):
            await ask(http, "warm", i)
        sequential = []
        progress = Progress(args.requests, f"{tag} sequential", every_s=10)
        for i in range(args.requests):
            sequential.append(await ask(http, "seq", i))
            progress.update(i + 1)
        concurrent, elapsed = await closed_loop(
            args.p2_clients, args.p2_seconds, lambda c, i: ask(http, c, i), f"{tag} concurrent"
        )
    return {"sequential": sequential, "concurrent": concurrent, "concurrent_s": elapsed}


def chat_figures(rows: list[dict], seconds: float | None = None) -> dict:
    ok = [r for r in rows if r["status"] == 200]
    out = {
        "requests": len(rows),
        "ok": len(ok),
        "refused": sum(r["status"] == 400 for r in rows),  # the injection classifier's false positives
        "errors": sum(r["status"] not in (200, 400) for r in rows),
        "overhead_ms": summary([r["overhead_ms"] for r in ok]),
        "total_ms": summary([r["total_ms"] for r in ok]),
    }
    if seconds:
        out["rps"] = len(ok) / seconds
    return out


def part2(bench: Bench) -> dict:
    args = bench.args
    engine_dep = deploy.engine_deployment_name(SCRIPTED_ID)
    rounds: dict[str, list[dict]] = {name: [] for name in PLACEMENTS}
    for rnd in range(args.placement_rounds):
        for name, stages in PLACEMENTS.items():
            path = bench.write_config(
                f"p2-{name}", engine="scripted", replicas=1, engine_res={"engine": 1, "worker_1": 1}, stages=stages
            )
            expect = {DEPLOYMENT[s]: [NODE[res]] for s, res in stages.items()} | {engine_dep: ["worker-1"]}
            label = f"part 2: stages {name}, round {rnd + 1}"
            bench.apply(label, path, SCRIPTED, expect)
            if bench.seeded is None:
                bench.seeded = seed_docs(bench.url)
                bench.note(f"retrieval store `docs`: {bench.seeded}")
            bench.note(f"{label}: {args.requests} sequential chats, then {args.p2_clients} clients")
            result = asyncio.run(placement_round(bench.url, args, f"{name}-{rnd}"))
            rounds[name].append(result)
            seq = chat_figures(result["sequential"])
            bench.note(
                f"{label}: sequential overhead p50 {seq['overhead_ms']['p50']:.1f} ms, "
                f"end-to-end p50 {seq['total_ms']['p50']:.1f} ms"
            )
    figures = {}
    for name, results in rounds.items():
        figures[name] = {
            "sequential": chat_figures([r for x in results for r in x["sequential"]]),
            "concurrent": chat_figures(
                [r for x in results for r in x["concurrent"]], sum(x["concurrent_s"] for x in results)
            ),
            "sequential_p50_by_round": [chat_figures(x["sequential"])["total_ms"]["p50"] for x in results],
        }
    return {"figures": figures, "rounds": rounds}


# --- the report ----------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:.2f}x" if a and b is not None else "-"


def _pair(s: dict, high: str = "p90") -> str:
    return " / ".join(f"{s[k]:.1f}" if s[k] is not None else "-" for k in ("p50", high))


def part1_md(args: argparse.Namespace, p1: dict) -> list[str]:
    one, two = p1["figures"][1], p1["figures"][2]
    per = args.max_ongoing or args.clients // 2
    what = (
        f"**Scripted engine** (`[[tokens:{args.tokens}]][[delay-ms:{args.delay_ms}]]`: timed sleeps, no model "
        f"compute), at most {per} streams per replica (`max_ongoing_requests`, standing in for an engine's batch "
        f"capacity; {per * 1000 / (args.tokens * args.delay_ms):.1f} req/s per replica at most): this measures "
        "Serve's routing and spreading over nodes, not an engine's speed."
        if args.engine == "scripted"
        else f"**Real vLLM** ({p1['model']}, {args.tokens} tokens, `ignore_eos`). Both replicas share the same "
        f"{os.cpu_count()} cores of this one machine, so no speed-up is expected: a second replica only splits them."
    )
    failures = sorted(set(one["failures"]) | set(two["failures"]))
    return [
        f"## Part 1: engine replicas ({args.clients} streaming clients, {args.duration:.0f} s per run, "
        f"{args.replica_rounds} run(s) each, stages off)",
        "",
        what,
        "",
        "| engine replicas | streams ok / failed | req/s | output tok/s | TTFT p50 / p99 ms |",
        "|---|---|---|---|---|",
        *(
            f"| {n} | {f['ok']} / {f['failed']} | {f['rps']:.2f} | {f['tok_s']:.1f} | {_pair(f['ttft_ms'], 'p99')} |"
            for n, f in ((1, one), (2, two))
        ),
        f"| **2 / 1** | | **{_ratio(one['rps'], two['rps'])}** | **{_ratio(one['tok_s'], two['tok_s'])}** | "
        f"{_ratio(one['ttft_ms']['p50'], two['ttft_ms']['p50'])} / {_ratio(one['ttft_ms']['p99'], two['ttft_ms']['p99'])} |",
        "",
        f"Failures: {', '.join(failures) or 'none'}.",
        "",
    ]


def part2_md(args: argparse.Namespace, p2: dict) -> list[str]:
    a, b = p2["figures"]["one-node"], p2["figures"]["two-nodes"]
    modes = (("sequential", "sequential"), ("concurrent", f"{args.p2_clients} clients"))
    lines = [
        f"## Part 2: stage placement ({args.placement_rounds} rounds a, b, a, b...; {args.requests} sequential "
        f"non-streamed one-token chats per round, then {args.p2_clients} clients for {args.p2_seconds:.0f} s)",
        "",
        "Scripted engine answering at once; guardrails, retrieval (one-file `docs` store) and embedding on. (a) "
        "one-node: ingress and every stage on the head; (b) two-nodes: ingress on the head, guardrails on worker-3, "
        "embedding and retrieval on worker-2. The nodes are processes of one machine (loopback, not a network).",
        "",
        "| placement | requests | ok / refused / errors | gateway overhead p50 / p90 ms | end-to-end p50 / p90 ms "
        "| req/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in (("(a) one-node", a), ("(b) two-nodes", b)):
        for mode, label in modes:
            g, rps = f[mode], f"{f[mode]['rps']:.1f}" if "rps" in f[mode] else ""
            lines.append(
                f"| {name} | {label} | {g['ok']} / {g['refused']} / {g['errors']} | {_pair(g['overhead_ms'])} | "
                f"{_pair(g['total_ms'])} | {rps} |"
            )
    for mode, label in modes:
        x, y = a[mode], b[mode]
        ratios = [_ratio(x[m][k], y[m][k]) for m in ("overhead_ms", "total_ms") for k in ("p50", "p90")]
        rps = _ratio(x["rps"], y["rps"]) if "rps" in x else ""
        lines.append(
            f"| **b / a** | {label} | | **{ratios[0]}** / {ratios[1]} | **{ratios[2]}** / {ratios[3]} | {rps} |"
        )
    by_round = "; ".join(
        f"{n} {[round(v, 1) for v in p2['figures'][n]['sequential_p50_by_round']]}" for n in PLACEMENTS
    )
    return lines + ["", f"Sequential end-to-end p50 by round (ms): {by_round}.", ""]


def report(bench: Bench, p1: dict | None, p2: dict | None, meta: dict) -> str:
    loads = [v for _, v in bench.loads]
    lines = [
        f"# Cluster benchmark, {meta['when']}",
        "",
        f"Local cluster: head + 3 workers (`gateway/cluster.py`), {meta['num_cpus']:g} CPUs offered per node, on a "
        f"{os.cpu_count()}-core machine shared with other work. Load average (1 min) during the run: "
        f"{min(loads):.1f} to {max(loads):.1f}; `uptime` at the start: `{meta['uptime_start']}`; at the end: "
        f"`{meta['uptime_end']}`.",
        "",
        *(part1_md(bench.args, p1) if p1 else []),
        *(part2_md(bench.args, p2) if p2 else []),
        "## Deployments",
        "",
        *(f"- {x['label']}: running after {x['seconds']} s; replicas on {x['placement']}" for x in bench.applies),
    ]
    return "\n".join(lines) + "\n"


def plot(p1: dict | None, p2: dict | None, path: Path) -> bool:
    plt = pyplot()
    if plt is None or not (p1 or p2):
        return False
    panels = [p for p in (p1, p2) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    ax = iter(axes[0])
    if p1:
        a, f = next(ax), p1["figures"]
        a.bar(["1 replica", "2 replicas"], [f[1]["tok_s"], f[2]["tok_s"]], color=["#888", "#3a7"])
        a.set(title="part 1: output tokens/s at the same concurrency", ylabel="tokens/s")
    if p2:
        a, f, names = next(ax), p2["figures"], list(PLACEMENTS)
        for i, mode in enumerate(("sequential", "concurrent")):
            values = [f[n][mode]["overhead_ms"]["p50"] or 0 for n in names]
            a.bar([x + 0.4 * i for x in range(len(names))], values, width=0.4, label=mode)
        a.set_xticks([x + 0.2 for x in range(len(names))], names)
        a.set(title="part 2: x-gateway-overhead-ms p50", ylabel="ms")
        a.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _left_over(temp_dir: str) -> int:
    """Processes still naming the cluster's temp dir (none once it is down)."""
    import psutil

    return sum(temp_dir in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("scripted", "vllm"), default="scripted", help="part 1's engine")
    parser.add_argument("--parts", default="1,2", help="which parts to run: 1, 2 or 1,2")
    parser.add_argument("--config", default=str(ROOT / "configs" / "gateway.yaml"), help="stage and model settings")
    parser.add_argument("--clients", type=int, default=8, help="part 1: concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=60, help="part 1: seconds per run")
    parser.add_argument("--tokens", type=int, default=40, help="part 1: output tokens per stream")
    parser.add_argument("--delay-ms", type=int, default=50, help="part 1, scripted: milliseconds per token")
    parser.add_argument("--max-ongoing", type=int, help="part 1: streams per replica (scripted default: clients/2)")
    parser.add_argument("--replica-rounds", type=int, default=1, help="part 1: runs of 1 then 2 replicas")
    parser.add_argument("--placement-rounds", type=int, default=2, help="part 2: rounds of a then b")
    parser.add_argument("--requests", type=int, default=100, help="part 2: sequential chats per round")
    parser.add_argument("--p2-clients", type=int, default=8, help="part 2: concurrent clients")
    parser.add_argument("--p2-seconds", type=float, default=10, help="part 2: seconds of concurrent load per round")
    parser.add_argument("--num-cpus", type=float, default=2, help="CPUs each node offers Ray")
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",")}

    out = ROOT / "benchmarks" / "results" / time.strftime("cluster-%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "uptime_start": _uptime(), "num_cpus": args.num_cpus}
    meta["args"] = vars(args)

    def on_sigterm(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"starting a head and 3 workers (state and logs: {out / 'cluster'}); {meta['uptime_start']}", flush=True)
    cluster = LocalCluster.up(
        3, state_dir=out / "cluster", head_resources=HEAD, worker_resources=WORKERS, num_cpus=args.num_cpus
    )
    p1 = p2 = None
    try:
        bench = Bench(args, out, cluster)
        meta["cluster"] = {"gcs": cluster.address, "dashboard": cluster.dashboard, "temp_dir": cluster.temp_dir}
        meta["nodes"] = {n.name: n.resources for n in cluster.nodes}
        meta["gateway"] = bench.url
        bench.note(f"cluster up at {cluster.address} (temp dir {cluster.temp_dir}); the gateway will be {bench.url}")
        if "1" in parts:
            p1 = part1(bench)
        if "2" in parts:
            p2 = part2(bench)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        print("stopping the cluster", flush=True)
        cluster.down()
        left = _left_over(cluster.temp_dir)
        print(f"cluster down; {left} of its processes left", flush=True)
    meta["uptime_end"] = _uptime()
    text = report(bench, p1, p2, meta)
    print("\n" + text)
    (out / "report.md").write_text(text)
    raw = {"part1": p1, "part2": p2 and {"figures": p2["figures"], "rounds": p2["rounds"]}}
    data = {**meta, "load": bench.loads, "applies": bench.applies, **raw}
    (out / "cluster.json").write_text(json.dumps(data, indent=1, default=str))
    plotted = plot(p1, p2, out / "cluster.png")
    print(f"report, JSON{' and plot' if plotted else ''}: {out}", flush=True)
    failed = (p1 and any(f["failed"] for f in p1["figures"].values())) or (
        p2 and any(f[m]["errors"] for f in p2["figures"].values() for m in ("sequential", "concurrent"))
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
