"""Soak: many concurrent streaming clients for a few minutes against the embedded default gateway
(real vLLM, rails on) with per-key limits on, watching the Serve replicas' memory.

The script writes a keys file with one principal, ``soak``, whose limits (``--rpm``,
``--concurrent``) are set there, as an operator would (README "Limits"); starts
``python -m gateway run`` on a copy of the config that uses it; then runs ``--clients`` clients,
each sending streamed chats one after another until ``--duration`` is over. A 429 is answered as
the openai SDK would: wait ``Retry-After`` (at most 5 s), then go on. Every ``--sample-s``
seconds it lists the live actors through Ray's state API (``ray.util.state.list_actors`` on
the gateway's dashboard) and reads the resident memory of each Serve replica's process and its
children (the vLLM engine core is a child of its replica) with psutil: single-node only.

It reports successes, 429s (by code), 5xx and streams that failed mid-way (these must be 0: the
exit status is 1 otherwise), TTFT / total / inter-token percentiles, and per replica the RSS at
the start and end of the run and its least-squares slope after the warm-up (the first quarter of
the run), with a verdict: flat when the fitted growth over that window is under
max(``--flat-mb`` MB, 2% of the replica's RSS). JSON and a plot go to benchmarks/results/soak-<time>/.

    python benchmarks/soak.py                         # 3 minutes, 16 clients, 8 concurrent / 600 rpm for the key
    python benchmarks/soak.py --duration 600 --clients 32 --rpm 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
# A local Ray 2.60 cluster turns on token auth by default (token in ~/.ray/auth_token); the state
# API client sends that token only when this process, not a driver of the cluster, is told so.
os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import Progress, Server, free_port, prompts, pyplot, summary, timed_stream  # noqa: E402

from gateway.__main__ import RAY_ENV_DEFAULTS  # noqa: E402
from gateway.auth import key_digest, new_key  # noqa: E402
from gateway.config import load_config  # noqa: E402

WARMUP_FRACTION = 0.25  # RSS before this part of the run is start-up and first allocations, not a trend


def soak_config(config_path: Path, out_dir: Path, rpm: int, concurrent: int) -> tuple[Path, str]:
    """A copy of the gateway config with a keys file holding one limited principal; its key."""
    config = load_config(config_path)
    key = new_key()
    keys = {
        "principals": [
            {
                "name": "soak",
                "key_sha256": [key_digest(key)],
                "scopes": ["chat"],
                "limits": {"requests_per_minute": rpm, "concurrent_requests": concurrent},
            }
        ]
    }
    (out_dir / "keys.yaml").write_text(yaml.safe_dump(keys))
    gateway = yaml.safe_load(config_path.read_text())
    gateway["models"] = [str(f) for f in config.model_files]
    gateway["models_dir"] = str(config.models_dir)
    gateway["auth"] = {"keys_file": "keys.yaml", "api_keys_env": None}
    gateway["retrieval"] = {**gateway.get("retrieval", {}), "storage_dir": str(out_dir / "retrieval")}
    gateway["limits"] = {**gateway.get("limits", {}), "budget_file": str(out_dir / "budgets.json")}
    path = out_dir / "gateway.yaml"
    path.write_text(yaml.safe_dump(gateway))
    return path, key


class MemorySampler(threading.Thread):
    """Every ``every_s``: each live Serve replica (and Serve's proxy) by Ray's state API, and the
    RSS of its process tree in MB. ``samples``: ``{"t": s, "replicas": {name: {"pid", "rss_mb"}}}``."""

    def __init__(self, dashboard: str, every_s: float, started: float):
        super().__init__(daemon=True, name="memory-sampler")
        self.dashboard, self.every_s, self.started = dashboard, every_s, started
        self.samples: list[dict] = []
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        from ray.util.state import list_actors

        while True:
            try:
                actors = list_actors(address=self.dashboard, filters=[("state", "=", "ALIVE")], limit=1000)
                replicas = {}
                for actor in actors:
                    name = actor.class_name
                    if name.startswith("ServeReplica:") or name == "ProxyActor":
                        replicas[name.removeprefix("ServeReplica:")] = {
                            "pid": actor.pid,
                            "rss_mb": _tree_rss_mb(actor.pid),
                        }
                self.samples.append({"t": time.monotonic() - self.started, "replicas": replicas})
            except Exception as exc:  # a missed sample is reported, not fatal
                self.errors += 1
                print(f"  memory sample failed: {exc}", file=sys.stderr, flush=True)
            if self.stop.wait(self.every_s):
                return

    def total_mb(self) -> float:
        return sum(r["rss_mb"] for r in self.samples[-1]["replicas"].values()) if self.samples else 0.0


def _tree_rss_mb(pid: int) -> float:
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


async def soak(url: str, key: str, model: str, args, sampler: MemorySampler) -> list[dict]:
    rows: list[dict] = []
    started = time.monotonic()
    deadline = started + args.duration
    texts = prompts(args.clients * 50)
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    headers = {"Authorization": f"Bearer {key}"}
    progress = Progress(args.duration, "seconds", every_s=10)

    async def client(i: int, http: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() < deadline:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": texts[(i + n * args.clients) % len(texts)]}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": args.max_tokens,
            }
            sent = time.monotonic() - started
            r = await timed_stream(http, body)
            rows.append({"t": sent, "client": i, **r})
            n += 1
            if r["status"] == 429:
                await asyncio.sleep(min(r["retry_after"] or 1.0, 5.0))

    async def report() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(1)
            tally = Counter(_outcome(r) for r in rows)
            elapsed = time.monotonic() - started
            progress.update(
                min(elapsed, args.duration),
                f"ok {tally['ok']}, 429 {tally['429']}, failed {tally['failed']}, refused {tally['400']}, "
                f"{tally['ok'] / elapsed:.2f} ok/s, replicas' RSS {sampler.total_mb():.0f} MB",
            )

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as http:
        await asyncio.gather(report(), *(client(i, http) for i in range(args.clients)))
    return rows


def _outcome(row: dict) -> str:
    if row["status"] == 200 and row["done"] and not row["code"]:
        return "ok"
    if row["status"] in (429, 400):
        return str(row["status"])
    return "failed"  # 5xx, a stream that ended in an error event or without [DONE], a transport error


def memory_trends(samples: list[dict], duration: float, flat_mb: float) -> dict:
    names = sorted({n for s in samples for n in s["replicas"]})
    out = {}
    for name in names:
        points = [
            (s["t"], s["replicas"][name]["rss_mb"], s["replicas"][name]["pid"])
            for s in samples
            if name in s["replicas"]
        ]
        steady = [(t, mb) for t, mb, _ in points if t >= WARMUP_FRACTION * duration]
        entry = {
            "first_mb": points[0][1],
            "last_mb": points[-1][1],
            "max_mb": max(mb for _, mb, _ in points),
            "pids": sorted({pid for _, _, pid in points}),  # more than one: the replica was restarted
        }
        if len(steady) >= 3:
            t, mb = np.array(steady).T
            slope = float(np.polyfit(t, mb, 1)[0])  # MB per second
            growth = slope * (t[-1] - t[0])
            entry.update(
                slope_mb_per_min=slope * 60,
                fitted_growth_mb=growth,
                flat=bool(growth <= max(flat_mb, 0.02 * float(np.mean(mb))) and len(entry["pids"]) == 1),
            )
        else:
            entry.update(slope_mb_per_min=None, fitted_growth_mb=None, flat=None)
        out[name] = entry
    return out


def print_report(rows: list[dict], trends: dict, duration: float) -> dict:
    tally = Counter(_outcome(r) for r in rows)
    codes = Counter(f"{r['status']} {r['code']}" for r in rows if _outcome(r) != "ok")
    ok = [r for r in rows if _outcome(r) == "ok"]
    figures = {
        "requests": len(rows),
        "ok": tally["ok"],
        "rate_limited_429": tally["429"],
        "refused_400": tally["400"],
        "failed": tally["failed"],
        "status_5xx": sum(isinstance(r["status"], int) and r["status"] >= 500 for r in rows),
        "not_ok_by_code": dict(codes),
        "ok_per_s": tally["ok"] / duration,
        "tokens_per_s": sum(r["tokens"] for r in ok) / duration,
        "ttft_ms": summary([r["ttft_ms"] for r in ok]),
        "total_ms": summary([r["total_ms"] for r in ok]),
        "itl_ms": summary([r["itl_ms"] for r in ok]),
        "refusal_ms": summary([r["total_ms"] for r in rows if r["status"] == 429]),
    }
    print(f"\n{len(rows)} requests in {duration:.0f} s: {tally['ok']} ok ({figures['ok_per_s']:.2f}/s, "
          f"{figures['tokens_per_s']:.1f} output tok/s), {tally['429']} x 429, {tally['400']} x 400, "
          f"{tally['failed']} failed (5xx: {figures['status_5xx']})")  # fmt: skip
    for outcome, count in codes.most_common():
        print(f"  {outcome}: {count}")
    print(f"{'latency ms':<22} {'p50':>8} {'p90':>8} {'p99':>8}")
    for label, key in (
        ("TTFT", "ttft_ms"),
        ("total", "total_ms"),
        ("inter-token", "itl_ms"),
        ("429 answer", "refusal_ms"),
    ):
        f = figures[key]
        if f["n"]:
            print(f"{label:<22} {f['p50']:>8.1f} {f['p90']:>8.1f} {f['p99']:>8.1f}")
    print(f"\n{'replica (RSS MB)':<58} {'first':>7} {'last':>7} {'max':>7} {'MB/min':>7}  verdict")
    for name, m in trends.items():
        slope = f"{m['slope_mb_per_min']:7.2f}" if m["slope_mb_per_min"] is not None else f"{'-':>7}"
        verdict = {True: "flat", False: "GROWING or restarted", None: "too few samples"}[m["flat"]]
        print(f"{name[:58]:<58} {m['first_mb']:7.0f} {m['last_mb']:7.0f} {m['max_mb']:7.0f} {slope}  {verdict}")
    return figures


def plot(rows: list[dict], samples: list[dict], path: Path, duration: float) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (mem, out) = plt.subplots(1, 2, figsize=(15, 5))
    for name in sorted({n for s in samples for n in s["replicas"]}):
        points = [(s["t"], s["replicas"][name]["rss_mb"]) for s in samples if name in s["replicas"]]
        mem.plot(*zip(*points), marker=".", label=name.split(":")[-1])
    mem.axvline(WARMUP_FRACTION * duration, color="grey", linestyle=":", label="end of warm-up")
    mem.set(title="Serve replicas' RSS (process and children)", xlabel="s", ylabel="MB", yscale="log")
    mem.legend(fontsize=7)
    bins = np.arange(0, duration + 10, 10)
    for outcome in ("ok", "429", "failed"):
        counts, _ = np.histogram([r["t"] for r in rows if _outcome(r) == outcome], bins=bins)
        out.plot(bins[:-1], counts / 10, label=outcome)
    out.set(title="answers per second (by request start, 10 s bins)", xlabel="s", ylabel="per s")
    out.legend()
    for ax in (mem, out):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "gateway.yaml"))
    parser.add_argument("--duration", type=float, default=180, help="seconds of load")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--rpm", type=int, default=600, help="the key's requests_per_minute")
    parser.add_argument("--concurrent", type=int, default=8, help="the key's concurrent_requests")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=5, help="seconds between memory samples")
    parser.add_argument("--flat-mb", type=float, default=10, help="growth under this (or 2%%) counts as flat")
    args = parser.parse_args()

    out_dir = ROOT / "benchmarks" / "results" / time.strftime("soak-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True)
    config_path, key = soak_config(Path(args.config), out_dir, args.rpm, args.concurrent)
    model = load_config(config_path).models[0].model_id
    port, dashboard_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "gateway", "run", "--config", str(config_path), "--port", str(port)]
    cmd += ["--dashboard-port", str(dashboard_port)]
    env = {**os.environ, **RAY_ENV_DEFAULTS}
    print(f"starting the gateway ({model}, rails on; log: {out_dir / 'gateway.log'})", flush=True)
    with Server("gateway", cmd, env, port, out_dir, ready_path="/ready"):
        print(
            f"{args.clients} streaming clients for {args.duration:.0f} s; key limits: {args.rpm} rpm, "
            f"{args.concurrent} concurrent",
            flush=True,
        )
        sampler = MemorySampler(f"http://127.0.0.1:{dashboard_port}", args.sample_s, time.monotonic())
        sampler.start()
        rows = asyncio.run(soak(f"http://127.0.0.1:{port}", key, model, args, sampler))
        sampler.stop.set()
        sampler.join()
        print("stopping the gateway", flush=True)
    trends = memory_trends(sampler.samples, args.duration, args.flat_mb)
    figures = print_report(rows, trends, args.duration)
    verdicts = [m["flat"] for m in trends.values()]
    flat = None if not verdicts or None in verdicts else all(verdicts)
    verdict = {True: "flat", False: "NOT flat", None: "not known (too few samples)"}[flat]
    print(f"memory: {verdict} ({len(sampler.samples)} samples, {sampler.errors} failed)")
    meta = {"args": vars(args), "when": time.strftime("%F %T"), "model": model}
    data = {
        **meta,
        "summary": figures,
        "memory": trends,
        "memory_flat": flat,
        "samples": sampler.samples,
        "requests": rows,
    }
    (out_dir / "soak.json").write_text(json.dumps(data, indent=1))
    plotted = plot(rows, sampler.samples, out_dir / "soak.png", args.duration)
    print(f"JSON{' and plot' if plotted else ''}: {out_dir}")
    if figures["failed"]:
        print(f"FAIL: {figures['failed']} requests failed (5xx, stream errors or transport errors)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
