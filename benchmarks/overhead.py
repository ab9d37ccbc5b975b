"""The gateway's own cost on real vLLM: raw `vllm serve`, LiteLLM's proxy in front of it, and the
gateway with rails off and on, all running at once and called in turn, request by request.

Every arm serves the same model folder with the same engine settings (the model file's vLLM
kwargs and environment; raw vLLM gets them as `vllm serve` flags, as in bench_serving.py). The
gateway serves the model twice, as two engines: the model file as it is (rails on: input and
output rails, and retrieval on a small `docs` store the script creates) and a copy without its
guardrails and retrieval sections (`<model>-rails-off`). LiteLLM's proxy (``hosted_vllm/``
provider) runs from its own virtualenv under benchmarks/results/, made on first use.

Each round sends one short streamed chat (a new prompt every round, the same for every arm;
temperature 0, ``ignore_eos`` so every arm generates ``--max-tokens`` tokens) to each arm in
turn, sequentially, starting with a different arm each round, so machine noise falls on every
arm alike. Per request: time to first token and total latency as the client sees them, the
mean gap between tokens, and the proxy's own figure (`x-gateway-overhead-ms`,
`x-litellm-overhead-duration-ms`). It prints medians, p90 and ratios to raw vLLM, and writes
JSON and a plot to benchmarks/results/overhead-<backend>-<time>/.

With ``--backend instant`` no engine time hides the proxies' own (benchmarks/overhead_instant.py):
an instant OpenAI-compatible backend called directly and through LiteLLM's proxy, and the gateway
on the tests' scripted engine with stages off and on; non-streamed one-token chats in turn, then
streams of ``--stream-tokens`` chunks and of one (the cost of a chunk), then requests/s under
``--clients`` concurrent clients.

    python benchmarks/overhead.py                       # ~5 min on 2 cores: 40 rounds, 8 tokens
    python benchmarks/overhead.py --rounds 100 --max-tokens 16 --no-litellm
    python benchmarks/overhead.py --backend instant     # ~6 min: 200 rounds, 30 x 2 streams, 32 clients x 10 s
    python benchmarks/overhead.py --backend instant --guardrails-placement deployment   # the rails as their own deployment
    python benchmarks/overhead.py --backend instant --search-placement ingress   # chat searches in the ingress
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import (  # noqa: E402
    Arm,
    Progress,
    Server,
    free_port,
    litellm_bin,
    litellm_server,
    prompts,
    pyplot,
    seed_docs,
    start_all,
    summary,
    timed_stream,
)
from bench_serving import VLLM_CLI, engine_flags, without_stages  # noqa: E402
from overhead_instant import place_stages, run_instant  # noqa: E402

from gateway.__main__ import RAY_ENV_DEFAULTS  # noqa: E402
from gateway.config import load_config  # noqa: E402


def gateway_config(config_path: Path, out_dir: Path, args: argparse.Namespace) -> tuple[Path, str, str]:
    """A gateway config serving the config's first model twice: its file as it is (rails on) and
    a copy without guardrails and retrieval under another id. Storage goes to ``out_dir``; the
    stages are placed as ``args`` say (``place_stages``)."""
    config = load_config(config_path)
    path = without_stages(config_path, out_dir)
    gateway = yaml.safe_load(path.read_text())
    place_stages(gateway, args)
    bare_file = Path(gateway["models"][0])
    bare = yaml.safe_load(bare_file.read_text())
    on_id, off_id = bare["model_id"], bare["model_id"] + "-rails-off"
    bare["model_id"] = off_id
    bare_file.write_text(yaml.safe_dump(bare))
    gateway["models"] = [str(config.model_files[0]), str(bare_file)]
    gateway["limits"] = {**gateway.get("limits", {}), "budget_file": str(out_dir / "budgets.json")}
    path.write_text(yaml.safe_dump(gateway))
    return path, on_id, off_id


def body(model: str, prompt: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        # Stated, so the gateway's model defaults (repetition_penalty, top_p) do not apply to some arms only.
        "temperature": 0,
        "top_p": 1,
        "repetition_penalty": 1.0,
    }


async def drive(arms: list[Arm], rounds: int, warmup: int, max_tokens: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {a.name: [] for a in arms}
    clients = {a.name: httpx.AsyncClient(base_url=a.url, timeout=120) for a in arms}
    try:
        for arm in arms:
            for i in range(warmup):
                r = await timed_stream(clients[arm.name], body(arm.model, f"Warm up {i}: say hi.", max_tokens))
                if r["status"] != 200:
                    raise RuntimeError(f"{arm.name} answered {r['status']} {r['code']} while warming up")
        progress = Progress(rounds * len(arms), "requests")
        for i, prompt in enumerate(prompts(rounds)):
            for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:
                r = await timed_stream(clients[arm.name], body(arm.model, prompt, max_tokens), arm.header)
                results[arm.name].append({"round": i, **r})
            last = {a: results[a][-1]["ttft_ms"] for a in results}
            progress.update(
                (i + 1) * len(arms), "last TTFT ms: " + ", ".join(f"{a} {v:.0f}" for a, v in last.items() if v)
            )
    finally:
        for c in clients.values():
            await c.aclose()
    return results


def summarise(results: dict[str, list[dict]]) -> dict:
    out = {}
    for name, rows in results.items():
        ok = [r for r in rows if r["status"] == 200 and r["done"] and not r["code"]]
        out[name] = {
            "requests": len(rows),
            "ok": len(ok),
            "refused": sum(r["status"] == 400 for r in rows),
            "errors": sum(r not in ok and r["status"] != 400 for r in rows),
            "tokens_mean": sum(r["tokens"] for r in ok) / len(ok) if ok else None,
            **{key: summary([r[key] for r in ok]) for key in ("ttft_ms", "total_ms", "itl_ms", "overhead_ms")},
        }
    base = out.get("vllm")
    for figures in out.values():
        for key in ("ttft_ms", "total_ms", "itl_ms"):
            for p in ("p50", "p90"):
                v, b = figures[key][p], base[key][p] if base else None
                figures[key][f"ratio_{p}"] = v / b if v and b else None
    return out


def table(figures: dict, model: str, rounds: int, max_tokens: int) -> str:
    def cell(f: dict) -> str:
        if f["p50"] is None:
            return f"{'-':>22}"
        ratio = f" ({f['ratio_p50']:.2f}x)" if f.get("ratio_p50") else ""
        return f"{f['p50']:7.1f} /{f['p90']:7.1f}{ratio:>9}"

    lines = [
        f"{model}, {rounds} rounds of one streamed chat per arm, {max_tokens} output tokens; ms, p50 / p90 (p50 vs vllm)",
        f"{'arm':<12} {'ok':>4} {'400':>4} {'err':>4} {'tok':>5} | {'TTFT':^24} | {'total':^24} | "
        f"{'inter-token':^24} | {'own overhead header':^19}",
    ]
    lines.append("-" * len(lines[1]))
    for name, f in figures.items():
        own = f["overhead_ms"]
        own_cell = f"{own['p50']:7.2f} /{own['p90']:7.2f}" if own["p50"] is not None else f"{'-':>16}"
        tokens = f"{f['tokens_mean']:5.1f}" if f["tokens_mean"] is not None else f"{'-':>5}"
        lines.append(
            f"{name:<12} {f['ok']:>4} {f['refused']:>4} {f['errors']:>4} {tokens} | {cell(f['ttft_ms'])} | "
            f"{cell(f['total_ms'])} | {cell(f['itl_ms'])} | {own_cell:>19}"
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    titles = {"ttft_ms": "time to first token", "total_ms": "total latency", "itl_ms": "inter-token latency"}
    for ax, (key, title) in zip(axes, titles.items()):
        for name, rows in results.items():
            values = sorted(r[key] for r in rows if r[key] is not None and r["status"] == 200)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend()
    own = {n: [r["overhead_ms"] for r in rows if r["overhead_ms"] is not None] for n, rows in results.items()}
    own = {n: v for n, v in own.items() if v}
    if own:
        axes[3].boxplot(list(own.values()), tick_labels=list(own))
    axes[3].set(title="proxy's own time (response header)", ylabel="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "gateway.yaml"))
    parser.add_argument("--backend", choices=("vllm", "instant"), default="vllm", help="real vLLM, or instant")
    parser.add_argument("--rounds", type=int, help="requests per arm (default: 40 on vLLM, 200 instant)")
    parser.add_argument("--warmup", type=int, default=3, help="unrecorded requests per arm first")
    parser.add_argument("--max-tokens", type=int, default=8, help="vLLM mode (instant mode: one token)")
    parser.add_argument("--clients", type=int, default=32, help="instant mode: concurrent clients for requests/s")
    parser.add_argument("--seconds", type=float, default=10, help="instant mode: per arm under load (0: skip)")
    parser.add_argument(
        "--idle-seconds", type=float, default=20, help="instant mode: each stack's CPU at rest first (0: skip)"
    )
    parser.add_argument(
        "--stream-rounds",
        type=int,
        default=30,
        help="instant mode: streamed chats per arm for the per-chunk cost (0: skip)",
    )
    parser.add_argument("--stream-tokens", type=int, default=64, help="instant mode: chunks per streamed chat")
    parser.add_argument(
        "--guardrails-placement",
        choices=("ingress", "deployment"),
        help="where the gateway's rails run (default: the config's guardrails.placement)",
    )
    parser.add_argument(
        "--search-placement",
        choices=("ingress", "deployment"),
        help="where the chat path's searches run (default: the config's retrieval.search_placement)",
    )
    parser.add_argument("--no-litellm", action="store_true", help="leave LiteLLM's proxy out")
    parser.add_argument("--no-install", action="store_true", help="use LiteLLM only if its virtualenv exists")
    args = parser.parse_args()

    out_dir = ROOT / "benchmarks" / "results" / time.strftime(f"overhead-{args.backend}-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True)
    return run_instant(args, out_dir) if args.backend == "instant" else run_vllm(args, out_dir)


def run_vllm(args: argparse.Namespace, out_dir: Path) -> int:
    args.rounds = args.rounds or 40
    config_path, on_id, off_id = gateway_config(Path(args.config), out_dir, args)
    config = load_config(config_path)
    model = config.models[0]
    folder = model.source.resolve(config.models_dir)
    env = {**os.environ, **RAY_ENV_DEFAULTS, **model.engine.env}
    litellm = None if args.no_litellm else litellm_bin(install=not args.no_install)
    if litellm is None and not args.no_litellm:
        print("LiteLLM is not available: its arm is left out", flush=True)

    vllm_port, gw_port, lite_port = free_port(), free_port(), free_port()
    servers = [
        Server(
            "vllm",
            VLLM_CLI + ["serve", str(folder), "--served-model-name", on_id, "--port", str(vllm_port)]
            + engine_flags(model.engine.kwargs),
            env,
            vllm_port,
            out_dir,
        ),
        Server(
            "gateway",
            [sys.executable, "-m", "gateway", "run", "--config", str(config_path), "--port", str(gw_port)]
            + ["--dashboard-port", str(free_port())],
            env,
            gw_port,
            out_dir,
            ready_path="/ready",
        ),
    ]  # fmt: skip
    arms = [Arm("vllm", vllm_port, on_id)]
    if litellm is not None:
        api_base = f"http://127.0.0.1:{vllm_port}/v1"
        servers.append(litellm_server(litellm, on_id, f"hosted_vllm/{on_id}", api_base, lite_port, out_dir))
        arms.append(Arm("litellm", lite_port, on_id, "x-litellm-overhead-duration-ms"))
    arms += [
        Arm("rails-off", gw_port, off_id, "x-gateway-overhead-ms"),
        Arm("rails-on", gw_port, on_id, "x-gateway-overhead-ms"),
    ]

    with ExitStack() as stack:
        start_all(servers, stack)
        print(f"retrieval store for the rails-on arm: {seed_docs(arms[-1].url)}", flush=True)
        print(f"driving {len(arms)} arms x {args.rounds} rounds, interleaved", flush=True)
        results = asyncio.run(drive(arms, args.rounds, args.warmup, args.max_tokens))
        print("stopping the servers", flush=True)

    figures = summarise(results)
    text = table(figures, on_id, args.rounds, args.max_tokens)
    print("\n" + text)
    meta = {"rounds": args.rounds, "max_tokens": args.max_tokens, "model": on_id, "when": time.strftime("%F %T")}
    (out_dir / "overhead.json").write_text(json.dumps({**meta, "summary": figures, "requests": results}, indent=1))
    plotted = plot(results, out_dir / "overhead.png")
    print(f"\nJSON{' and plot' if plotted else ''}: {out_dir}")
    return 0 if all(f["errors"] == 0 for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
