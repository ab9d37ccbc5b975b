"""``benchmarks/overhead.py --backend instant``: the proxies' own cost with no engine time to hide it.

An instant OpenAI-compatible backend (benchmarks/instant_backend.py) is called directly and
through LiteLLM's proxy (``openai/`` provider); the gateway runs on the tests' scripted engine
(injected through ``engine_cls``) with stages off and on (the model file's rails and retrieval).
First each stack's CPU at rest (``--idle-seconds``, benchmarks/cpu_meter.py), then three phases,
each arm called in turn and each round starting with another arm:

1. sequential non-streamed one-token chats (a new prompt every round, so no cache answers):
   client-side latency, the latency added over the direct call in the same round, the proxy's
   own header;
2. streamed chats of ``--stream-tokens`` chunks and of one chunk: the marginal cost of a chunk
   as the client sees it ((p50 total of N chunks - p50 total of one) / (N - 1)), and the
   gateway's own relay time per chunk (``gateway_stream_overhead_per_token_ms``);
3. each arm alone under ``--clients`` concurrent clients for ``--seconds``: requests/s, and the CPU
   each answered request cost, by process (what requests/s is made of on a saturated machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml
from _common import (
    Arm,
    Progress,
    Server,
    free_port,
    gateway_stage_means,
    litellm_bin,
    litellm_server,
    pyplot,
    seed_docs,
    stage_means_table,
    start_all,
    summary,
    timed_chat,
    timed_stream,
)
from cpu_meter import CpuMeter, cpu_table

from gateway.__main__ import RAY_ENV_DEFAULTS
from gateway.config import load_config

ROOT = Path(__file__).resolve().parent.parent
METRICS_EXPORT_S = 12  # Ray's metrics export interval is 10 s


# The servers each arm's requests pass through, by the arm name's first word.
ARM_SERVERS = {"direct": ("backend",), "litellm": ("litellm", "backend"), "gateway": ("gateway",)}
INSTANT_HEADERS = {"litellm": "x-litellm-overhead-duration-ms", "gateway": "x-gateway-overhead-ms"}


def place_stages(gateway: dict, args: argparse.Namespace) -> None:
    """Where the rails and the chat path's searches run, when the flags say (else the config's)."""
    if args.guardrails_placement:
        gateway["guardrails"] = {**gateway.get("guardrails", {}), "placement": args.guardrails_placement}
    if args.search_placement:
        gateway["retrieval"] = {**gateway.get("retrieval", {}), "search_placement": args.search_placement}


def instant_gateway_config(
    config_path: Path, out_dir: Path, port: int, args: argparse.Namespace
) -> tuple[Path, str, str]:
    """The gateway config with two scripted-engine models: one without stages and one with the
    first model's guardrails and retrieval sections (input and output rails, retrieval), its
    stages placed as ``args`` say (``place_stages``)."""
    gateway = yaml.safe_load(config_path.read_text())
    place_stages(gateway, args)
    real = yaml.safe_load((config_path.parent / gateway["models"][0]).read_text())
    files, ids = [], ("instant-stages-off", "instant-stages-on")
    for model_id in ids:
        model = {
            "model_id": model_id,
            "source": {"path": f"/nonexistent/{model_id}"},  # the scripted engine loads nothing
            "engine": {"stream_batching_interval_ms": 0},
            "placement": {"accelerator": "cpu", "cpus_per_worker": 0.1},
            **{k: real[k] for k in ("deployment", "requests") if k in real},
        }
        if model_id.endswith("-on"):
            model.update({k: real[k] for k in ("guardrails", "retrieval") if k in real})
        files.append(out_dir / f"{model_id}.yaml")
        files[-1].write_text(yaml.safe_dump(model))
    gateway.update(models=[str(f) for f in files], port=port)
    gateway.setdefault("models_dir", str(load_config(config_path).models_dir))
    gateway["retrieval"] = {**gateway.get("retrieval", {}), "storage_dir": str(out_dir / "retrieval")}
    gateway["limits"] = {**gateway.get("limits", {}), "budget_file": str(out_dir / "budgets.json")}
    path = out_dir / "gateway.yaml"
    path.write_text(yaml.safe_dump(gateway))
    return path, ids[0], ids[1]


def chat_body(model: str, prompt: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}


# Questions the seeded handbook answers: with stages on, the search finds its passage, which the
# passage check then reads and the engine gets in a system message, as in a real RAG chat.
HANDBOOK_QUESTIONS = [
    "How many vacation days does an employee get per year?",
    "How far ahead do vacation requests go to the manager?",
    "When is the office open on weekdays?",
    "How quickly are expenses refunded after filing the receipt?",
]


def unique_prompts(n: int, tag: str = "") -> list[str]:
    """Distinct prompts, so no arm answers from a cache (the rails cache verdicts per text)."""
    return [f"{HANDBOOK_QUESTIONS[i % len(HANDBOOK_QUESTIONS)]} (#{tag}{i})" for i in range(n)]


async def drive_instant(arms: list[Arm], rounds: int, warmup: int) -> dict[str, list[dict]]:
    """One non-streamed one-token chat per arm per round, sequential, each round starting with
    another arm."""
    results: dict[str, list[dict]] = {a.name: [] for a in arms}
    clients = {a.name: httpx.AsyncClient(base_url=a.url, timeout=60) for a in arms}
    try:
        for arm in arms:
            for prompt in unique_prompts(warmup, "warm-"):
                r = await timed_chat(clients[arm.name], chat_body(arm.model, prompt))
                if r["status"] != 200:
                    raise RuntimeError(f"{arm.name} answered {r['status']} {r['code']} while warming up")
        progress = Progress(rounds * len(arms), "requests")
        for i, prompt in enumerate(unique_prompts(rounds)):
            for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
                r = await timed_chat(clients[arm.name], chat_body(arm.model, prompt), arm.header)
                results[arm.name].append({"round": i, **r})
            progress.update((i + 1) * len(arms))
    finally:
        for c in clients.values():
            await c.aclose()
    return results


async def requests_per_second(arm: Arm, clients: int, seconds: float, meter: CpuMeter | None = None) -> dict:
    """``clients`` concurrent clients, each sending one chat after another for ``seconds``
    (after a second of warm-up): answered requests per second and the latency under load, and
    with a ``meter`` the CPU each answered request cost, by process."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=arm.url, timeout=60, limits=limits) as http:

        async def client(c: int, until: float, record: bool) -> None:
            i = 0
            while time.perf_counter() < until:
                question = HANDBOOK_QUESTIONS[(c + i) % len(HANDBOOK_QUESTIONS)]
                r = await timed_chat(http, chat_body(arm.model, f"{question} ({c}-{i})"))
                i += 1
                if record:
                    rows.append(r)

        await asyncio.gather(*(client(c, time.perf_counter() + 1, False) for c in range(clients)))
        if meter is not None:
            meter.start()
        started = time.perf_counter()
        await asyncio.gather(*(client(c, started + seconds, True) for c in range(clients)))
        elapsed = time.perf_counter() - started
    ok = [r for r in rows if r["status"] == 200]
    return {
        "clients": clients,
        "requests": len(rows),
        "errors": len(rows) - len(ok),
        "rps": len(ok) / elapsed,
        "total_ms": summary([r["total_ms"] for r in ok]),
        "cpu_ms_per_request": meter.stop(len(ok)) if meter is not None else {},
    }


def summarise_instant(results: dict[str, list[dict]], load: dict[str, dict]) -> dict:
    """Per arm: the client-side latency, the latency added over the direct call in the same
    round (arm minus direct), the proxy's own header, and requests/s under load."""
    direct = {r["round"]: r["total_ms"] for r in results["direct"] if r["status"] == 200}
    out = {}
    for name, rows in results.items():
        ok = [r for r in rows if r["status"] == 200]
        out[name] = {
            "requests": len(rows),
            "ok": len(ok),
            "refused": sum(r["status"] == 400 for r in rows),
            "errors": sum(r["status"] not in (200, 400) for r in rows),
            "total_ms": summary([r["total_ms"] for r in ok]),
            "added_ms": summary([r["total_ms"] - direct[r["round"]] for r in ok if r["round"] in direct]),
            "overhead_ms": summary([r["overhead_ms"] for r in ok]),
            "load": load.get(name),
        }
    return out


def instant_table(figures: dict, rounds: int, clients: int) -> str:
    def pair(f: dict) -> str:
        return f"{f['p50']:6.1f} /{f['p99']:6.1f}" if f["p50"] is not None else f"{'-':>14}"

    lines = [
        f"instant backends: {rounds} sequential non-streamed one-token chats per arm; ms, p50 / p99",
        f"{'arm':<18} {'ok':>4} {'400':>4} {'err':>4} | {'client total':^14} | {'added vs direct':^15} | "
        f"{'own header':^14} | req/s @{clients}",
    ]
    lines.append("-" * len(lines[1]))
    for name, f in figures.items():
        rps = f"{f['load']['rps']:8.1f}" if f["load"] else f"{'-':>8}"
        lines.append(
            f"{name:<18} {f['ok']:>4} {f['refused']:>4} {f['errors']:>4} | {pair(f['total_ms'])} | "
            f"{pair(f['added_ms']):>15} | {pair(f['overhead_ms'])} | {rps}"
        )
    return "\n".join(lines)


def instant_plot(results: dict[str, list[dict]], figures: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (latency, rate) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in results.items():
        values = sorted(r["total_ms"] for r in rows if r["status"] == 200)
        if values:
            latency.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    latency.set(title="one-token chat, sequential (client side)", xlabel="ms", ylabel="fraction of requests")
    latency.grid(alpha=0.3)
    latency.legend()
    loaded = {n: f["load"]["rps"] for n, f in figures.items() if f["load"]}
    rate.bar(list(loaded), list(loaded.values()))
    rate.set(title="requests/s at concurrent clients", ylabel="requests/s")
    rate.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def stream_body(model: str, prompt: str, tokens: int) -> dict:
    """A streamed chat of ``tokens`` chunks on every arm: the instant backend streams
    ``max_tokens`` chunks, the scripted engine reads ``[[tokens:N]]`` (in a system message,
    where the input rails run their heuristics only, as an app's own prompt would be)."""
    return {
        "model": model,
        "messages": [{"role": "system", "content": f"[[tokens:{tokens}]]"}, {"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": tokens,
    }


async def drive_streams(
    arms: list[Arm], rounds: int, tokens: int, on_long_done=None
) -> dict[str, dict[int, list[dict]]]:
    """Streams of ``tokens`` chunks, then streams of one chunk, ``rounds`` per arm, each round
    starting with another arm. ``on_long_done`` runs between the two (the gateway's relay time
    per chunk is read over the long streams only: a one-chunk stream's is mostly its end)."""
    results: dict[str, dict[int, list[dict]]] = {a.name: {tokens: [], 1: []} for a in arms}
    clients = {a.name: httpx.AsyncClient(base_url=a.url, timeout=60) for a in arms}
    progress = Progress(rounds * len(arms) * 2, "streams")
    try:
        for phase, n in enumerate((tokens, 1)):
            for i, prompt in enumerate(unique_prompts(rounds, f"stream-{n}-")):
                for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
                    results[arm.name][n].append(
                        await timed_stream(clients[arm.name], stream_body(arm.model, prompt, n))
                    )
                progress.update((phase * rounds + i + 1) * len(arms))
            if phase == 0 and on_long_done is not None:
                on_long_done()
    finally:
        for c in clients.values():
            await c.aclose()
    return results


def summarise_streams(results: dict[str, dict[int, list[dict]]], tokens: int, own: dict[str, float]) -> dict:
    """Per arm: p50 total of the long and the one-chunk streams, the marginal ms per chunk, and
    (gateway arms) the relay's own ms per chunk from the gateway's metrics."""
    out = {}
    for name, by_n in results.items():
        ok = {n: [r for r in rows if r["status"] == 200 and r["done"] and not r["code"]] for n, rows in by_n.items()}
        long_, short = summary([r["total_ms"] for r in ok[tokens]]), summary([r["total_ms"] for r in ok[1]])
        chunks = summary([r["tokens"] for r in ok[tokens]])
        marginal = (long_["p50"] - short["p50"]) / (tokens - 1) if long_["p50"] and short["p50"] else None
        out[name] = {
            "ok": len(ok[tokens]) + len(ok[1]),
            "errors": sum(len(rows) for rows in by_n.values()) - len(ok[tokens]) - len(ok[1]),
            "chunks_p50": chunks["p50"],
            "total_ms": long_,
            "one_chunk_ms": short,
            "marginal_ms_per_chunk": marginal,
            "own_ms_per_chunk": own.get(name),
        }
    return out


def stream_table(figures: dict, rounds: int, tokens: int) -> str:
    def num(v: float | None, width: int, digits: int = 2) -> str:
        return f"{v:{width}.{digits}f}" if v is not None else f"{'-':>{width}}"

    lines = [
        f"streams: {rounds} rounds per arm of one {tokens}-chunk and one 1-chunk streamed chat; p50 ms",
        f"{'arm':<18} {'ok':>4} {'err':>4} {'chunks':>6} | {'total':>8} {'1 chunk':>8} | "
        f"{'per chunk (client)':>18} | {'own per chunk':>13}",
    ]
    lines.append("-" * len(lines[1]))
    for name, f in figures.items():
        lines.append(
            f"{name:<18} {f['ok']:>4} {f['errors']:>4} {num(f['chunks_p50'], 6, 0)} | "
            f"{num(f['total_ms']['p50'], 8, 1)} {num(f['one_chunk_ms']['p50'], 8, 1)} | "
            f"{num(f['marginal_ms_per_chunk'], 18, 3)} | {num(f['own_ms_per_chunk'], 13, 3)}"
        )
    return "\n".join(lines)


def own_per_chunk(before: dict, after: dict, models: dict[str, str]) -> dict[str, float]:
    """The gateway's relay time per chunk (``gateway_stream_overhead_per_token_ms``) by arm."""
    out = {}
    for arm, model in models.items():
        key = f"gateway_stream_overhead_per_token_ms{{{model}}}"
        total = after.get(key, (0.0, 0))[0] - before.get(key, (0.0, 0))[0]
        n = after.get(key, (0.0, 0))[1] - before.get(key, (0.0, 0))[1]
        if n:
            out[arm] = total / n
    return out


def run_instant(args: argparse.Namespace, out_dir: Path) -> int:
    backend_port, gw_port, lite_port = free_port(), free_port(), free_port()
    config_path, off_id, on_id = instant_gateway_config(Path(args.config), out_dir, gw_port, args)
    placed = load_config(config_path).gateway
    placement, search_placement = placed.guardrails.placement, placed.retrieval.search_placement
    print(f"the gateway's rails run in: {placement} (guardrails.placement)", flush=True)
    print(f"the chat path's searches run in: {search_placement} (retrieval.search_placement)", flush=True)
    script = str(ROOT / "benchmarks" / "instant_backend.py")
    env = {**os.environ, **RAY_ENV_DEFAULTS}
    servers = [
        Server("backend", [sys.executable, script, "backend", "--port", str(backend_port)], env, backend_port, out_dir),
        Server(
            "gateway",
            [sys.executable, script, "gateway", "--config", str(config_path), "--dashboard-port", str(free_port())],
            env,
            gw_port,
            out_dir,
            ready_path="/ready",
        ),
    ]
    arms = [Arm("direct", backend_port, "instant")]
    litellm = None if args.no_litellm else litellm_bin(install=not args.no_install)
    if litellm is not None:
        api_base = f"http://127.0.0.1:{backend_port}/v1"
        servers.append(litellm_server(litellm, "instant", "openai/instant", api_base, lite_port, out_dir))
        arms.append(Arm("litellm", lite_port, "instant", INSTANT_HEADERS["litellm"]))
    elif not args.no_litellm:
        print("LiteLLM is not available: its arm is left out", flush=True)
    arms += [
        Arm("gateway-stages-off", gw_port, off_id, INSTANT_HEADERS["gateway"]),
        Arm("gateway-stages-on", gw_port, on_id, INSTANT_HEADERS["gateway"]),
    ]
    with ExitStack() as stack:
        start_all(servers, stack)
        print(f"retrieval store for the stages-on arm: {seed_docs(arms[-1].url)}", flush=True)
        pids = {s.name: s.proc.pid for s in servers if s.proc is not None}
        idle = {}
        if args.idle_seconds > 0:
            # What each stack costs at rest: on a small machine, that is taken from every request.
            print(f"each stack at rest for {args.idle_seconds:.0f} s", flush=True)
            meters = {name: CpuMeter({name: pid}) for name, pid in pids.items()}
            for meter in meters.values():
                meter.start()
            time.sleep(args.idle_seconds)
            idle = {name: meter.stop(round(args.idle_seconds)) for name, meter in meters.items()}
        rounds = args.rounds or 200
        print(f"driving {len(arms)} arms x {rounds} rounds, interleaved", flush=True)
        before = gateway_stage_means()
        results = asyncio.run(drive_instant(arms, rounds, args.warmup))
        time.sleep(METRICS_EXPORT_S)  # Ray exports a replica's metrics every few seconds
        stages = stage_means_table(before, gateway_stage_means())
        streams = None
        if args.stream_rounds > 0:
            print(f"streams: {args.stream_rounds} rounds of {args.stream_tokens} and 1 chunks per arm", flush=True)
            before, after = gateway_stage_means(), {}

            def read_relay_metrics() -> None:
                time.sleep(METRICS_EXPORT_S)
                after.update(gateway_stage_means())

            by_arm = asyncio.run(drive_streams(arms, args.stream_rounds, args.stream_tokens, read_relay_metrics))
            gateway_arms = {a.name: a.model for a in arms if a.url.endswith(f":{gw_port}")}
            own = own_per_chunk(before, after, gateway_arms)
            streams = summarise_streams(by_arm, args.stream_tokens, own)
        load = {}
        for arm in arms if args.seconds > 0 else ():
            print(f"{arm.name}: {args.clients} concurrent clients for {args.seconds:.0f} s", flush=True)
            # Only the processes this arm's requests pass through (the idle stack's are not its cost).
            meter = CpuMeter({name: pid for name, pid in pids.items() if name in ARM_SERVERS[arm.name.split("-")[0]]})
            load[arm.name] = asyncio.run(requests_per_second(arm, args.clients, args.seconds, meter))
        print("stopping the servers", flush=True)
    figures = summarise_instant(results, load)
    text = instant_table(figures, rounds, args.clients)
    print("\n" + text)
    print("\nwhere the gateway's time went in the sequential rounds (both gateway arms):\n" + stages)
    if idle:
        print("\nat rest, before any load (CPU ms per second, by process):")
        print(cpu_table(idle, None, unit="CPU ms per second"))
    if load:
        cpu = {name: result["cpu_ms_per_request"] for name, result in load.items()}
        print(f"\nwhere the CPU went under {args.clients} clients (user + system time / answered requests):")
        print(cpu_table(cpu, os.cpu_count()))
    if streams is not None:
        print("\n" + stream_table(streams, args.stream_rounds, args.stream_tokens))
    meta = {
        "backend": "instant",
        "rounds": rounds,
        "clients": args.clients,
        "guardrails_placement": placement,
        "search_placement": search_placement,
        "when": time.strftime("%F %T"),
    }
    meta["loadavg"] = os.getloadavg()
    payload = {**meta, "summary": figures, "streams": streams, "idle_cpu_ms_per_s": idle, "requests": results}
    (out_dir / "overhead.json").write_text(json.dumps(payload, indent=1))
    plotted = instant_plot(results, figures, out_dir / "overhead.png")
    print(f"\nJSON{' and plot' if plotted else ''}: {out_dir}")
    failed = [f for f in [*figures.values(), *(streams or {}).values()] if f["errors"]]
    return 0 if not failed else 1
