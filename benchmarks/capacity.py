"""One engine replica's capacity and cold start, and the autoscaling settings they imply.

Ray Serve's guide to autoscaling LLMs says: measure what one replica sustains at your latency
target, set ``target_ongoing_requests`` from it, and size the delays from how long a new replica
takes to start. This script does that for one model of a gateway config:

1. **Cold start**: starts the gateway (``python -m gateway run``, one replica, stages off) and
   times process start to the model answering (Ray, the Serve apps, vLLM loading the weights).
2. **Capacity**: drives it with vLLM's load generator (``vllm bench serve``, random prompts,
   ``--input-len``/``--output-len`` tokens, ``ignore_eos``) at rising concurrency, recording
   requests/s, output tokens/s, TTFT p50/p99 and TPOT p50 at each level, and stops at the first
   level past the latency target (``--ttft-p99-ms``, ``--tpot-ms``).
3. **Recommends** ``deployment.autoscaling`` for the model file: ``target_ongoing_requests`` 80%
   of the largest concurrency within the target (Serve adds a replica before the target is
   missed, not after), ``max_replicas`` from ``--peak-rps``, ``upscale_delay_s`` short (a new
   replica already takes the cold start to help) and ``downscale_delay_s`` several cold starts
   (removing a replica that is needed again soon costs a cold start).

    python benchmarks/capacity.py --config configs/gateway.yaml --levels 1,2,4,8,16 --peak-rps 5
    python benchmarks/capacity.py ... --readme    # also write the numbers into README.md

Needs the machine to itself: the numbers are one replica's on this hardware.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serving import VLLM_CLI, Server, free_port, without_stages  # noqa: E402

from gateway.__main__ import RAY_ENV_DEFAULTS  # noqa: E402
from gateway.config import load_config  # noqa: E402

README_START = "<!-- capacity:start -->"
README_END = "<!-- capacity:end -->"


def load_level(port: int, model: str, tokenizer: str, concurrency: int, args, out_dir: Path, env) -> dict:
    tag = f"c{concurrency}"
    prompts = max(args.min_prompts, args.prompts_per_slot * concurrency)
    cmd = VLLM_CLI + [
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(prompts),
        # Unmeasured requests first: vLLM's first requests of a new prompt shape are slow (one
        # waited 30-44 s at concurrency 1), which is warm-up, not capacity (cold start is timed apart).
        "--num-warmups",
        str(max(2, concurrency)),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        f"{tag}.json",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    data = json.loads((out_dir / f"{tag}.json").read_text())
    return {
        "concurrency": concurrency,
        "completed": data["completed"],
        "failed": prompts - data["completed"],
        "rps": data["request_throughput"],
        "tok_s": data["output_throughput"],
        "ttft_p50": data["median_ttft_ms"],
        "ttft_p99": data["p99_ttft_ms"],
        "tpot_p50": data["median_tpot_ms"],
        "e2e_p50": data.get("median_e2el_ms"),
    }


def recommend(levels: list[dict], cold_start_s: float, args) -> dict:
    within = [
        r for r in levels if r["failed"] == 0 and r["ttft_p99"] <= args.ttft_p99_ms and r["tpot_p50"] <= args.tpot_ms
    ]
    best = max(within, key=lambda r: r["concurrency"]) if within else None
    rec: dict = {"capacity": best, "cold_start_s": cold_start_s}
    if best is None:
        return rec
    rec["target_ongoing_requests"] = max(1, math.floor(0.8 * best["concurrency"]))
    rec["min_replicas"] = 1
    rec["max_replicas"] = max(1, math.ceil(args.peak_rps / best["rps"])) if args.peak_rps else None
    rec["upscale_delay_s"] = int(min(30, max(5, round(0.1 * cold_start_s))))
    rec["downscale_delay_s"] = int(max(300, round(5 * cold_start_s)))
    return rec


def report(levels: list[dict], rec: dict, args, when: str) -> str:
    lines = [
        f"Measured {when} by `benchmarks/capacity.py` ({args.input_len}-token prompts, {args.output_len} output "
        f"tokens, target TTFT p99 ≤ {args.ttft_p99_ms:.0f} ms and TPOT p50 ≤ {args.tpot_ms:.0f} ms, one replica):",
        "",
        "| concurrency | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms | failed |",
        "|---|---|---|---|---|---|",
    ]
    for r in levels:
        lines.append(
            f"| {r['concurrency']} | {r['rps']:.2f} | {r['tok_s']:.1f} | {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} "
            f"| {r['tpot_p50']:.0f} | {r['failed']} |"
        )
    lines.append("")
    lines.append(f"Cold start (process start to the model answering): **{rec['cold_start_s']:.0f} s**.")
    best = rec["capacity"]
    if best is None:
        lines.append("No level met the target: the replica cannot meet it at concurrency 1 on this hardware.")
        return "\n".join(lines)
    lines.append(
        f"Capacity at the target: concurrency {best['concurrency']}, {best['rps']:.2f} req/s, "
        f"{best['tok_s']:.1f} output tok/s. Recommended `deployment.autoscaling`:"
    )
    max_replicas = rec["max_replicas"] if rec["max_replicas"] is not None else "<peak req/s ÷ req/s above>"
    lines += [
        "",
        "```yaml",
        "deployment:",
        "  autoscaling:",
        f"    target_ongoing_requests: {rec['target_ongoing_requests']}",
        f"    min_replicas: {rec['min_replicas']}        # 2 if losing a node must not stop the model",
        f"    max_replicas: {max_replicas}",
        f"    upscale_delay_s: {rec['upscale_delay_s']}",
        f"    downscale_delay_s: {rec['downscale_delay_s']}",
        "```",
    ]
    return "\n".join(lines)


def write_readme(text: str) -> None:
    readme = ROOT / "README.md"
    content = readme.read_text()
    start, end = content.index(README_START) + len(README_START), content.index(README_END)
    readme.write_text(content[:start] + "\n" + text + "\n" + content[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "gateway.yaml"))
    parser.add_argument("--model", help="model id (default: the config's first model)")
    parser.add_argument("--levels", default="1,2,4,8,16,32", help="concurrency levels, rising")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ttft-p99-ms", type=float, default=3000)
    parser.add_argument("--tpot-ms", type=float, default=200)
    parser.add_argument("--prompts-per-slot", type=int, default=4)
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--peak-rps", type=float, help="the peak load to size max_replicas for")
    parser.add_argument("--readme", action="store_true", help=f"write the report between {README_START} and its end")
    args = parser.parse_args()

    config = load_config(args.config)
    model = next((m for m in config.models if m.model_id == args.model), config.models[0])
    tokenizer = model.source.resolve(config.models_dir)
    env = {**os.environ, **RAY_ENV_DEFAULTS}
    levels: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        bare = without_stages(Path(args.config), out_dir)
        port = free_port()
        cmd = [sys.executable, "-m", "gateway", "run", "--config", str(bare), "--port", str(port)]
        print(f"starting the gateway for {model.model_id} (cold start is timed)", flush=True)
        with Server("gateway", cmd, env, port, out_dir) as server:
            cold_start = server.ready_s
            for concurrency in (int(c) for c in args.levels.split(",")):
                r = load_level(port, model.model_id, tokenizer, concurrency, args, out_dir, env)
                levels.append(r)
                print(
                    f"  c={concurrency}: {r['rps']:.2f} req/s, {r['tok_s']:.1f} tok/s, TTFT p99 {r['ttft_p99']:.0f} ms, "
                    f"TPOT p50 {r['tpot_p50']:.0f} ms, failed {r['failed']}",
                    flush=True,
                )
                if r["ttft_p99"] > args.ttft_p99_ms or r["tpot_p50"] > args.tpot_ms or r["failed"]:
                    break  # past the target: higher levels only queue
    rec = recommend(levels, cold_start, args)
    text = report(levels, rec, args, time.strftime("%Y-%m-%d %H:%M"))
    print("\n" + text)
    if args.readme:
        write_readme(text)
        print(f"\nwritten to README.md ({README_START})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
