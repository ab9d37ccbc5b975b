"""Gateway vs raw `vllm serve`, same model, same engine settings, alternating in one run.

Each round boots one server at a time (so they never share the CPU), drives it with
vLLM's own load generator (`vllm bench serve`, random 128-token prompts, 64 output
tokens, ignore_eos) at each concurrency, then stops it. Rounds alternate which server
goes first. Reported figures are medians over rounds; ratios are gateway / raw vLLM.

    python benchmarks/bench_serving.py                 # 2 rounds, concurrency 1 and 8
    python benchmarks/bench_serving.py --rounds 3 --gateway-env RAY_SERVE_THROUGHPUT_OPTIMIZED=1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.config import load_config  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import Server, free_port  # noqa: E402  (capacity.py imports them from here)

VLLM_CLI = [sys.executable, str(ROOT / "benchmarks" / "vllm_cli.py")]
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_ttft_ms")


def without_stages(config_path: Path, out_dir: Path) -> Path:
    """A copy of the gateway config whose models have no guardrail or retrieval stage."""
    gateway = yaml.safe_load(config_path.read_text())
    files = []
    for name in gateway["models"]:
        model = yaml.safe_load((config_path.parent / name).read_text())
        model.pop("guardrails", None)
        model.pop("retrieval", None)
        files.append(out_dir / Path(name).name)
        files[-1].write_text(yaml.safe_dump(model))
    gateway["models"] = [str(f) for f in files]
    gateway.setdefault("models_dir", str(load_config(config_path).models_dir))
    gateway["retrieval"] = {**gateway.get("retrieval", {}), "storage_dir": str(out_dir / "retrieval")}
    path = out_dir / "gateway.yaml"
    path.write_text(yaml.safe_dump(gateway))
    return path


def engine_flags(kwargs: dict) -> list[str]:
    """vLLM engine kwargs from the model config, as `vllm serve` flags."""
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def run_load(
    server: Server, model: str, tokenizer: str, concurrency: int, prompts: int, out_dir: Path, tag: str
) -> dict:
    result_file = f"{tag}.json"
    cmd = VLLM_CLI + [
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        f"http://127.0.0.1:{server.port}",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        "128",
        "--random-output-len",
        "64",
        "--ignore-eos",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        result_file,
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=server.env)
    data = json.loads((out_dir / result_file).read_text())
    return {k: data[k] for k in METRICS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gateway.yaml")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompts-per-stream", type=int, default=6, help="requests per concurrent stream")
    parser.add_argument("--gateway-env", action="append", default=[], help="KEY=VALUE for the gateway's processes")
    parser.add_argument(
        "--stages", choices=["off", "on"], default="off", help="guardrail and retrieval stages of the model"
    )
    args = parser.parse_args()

    out_dir = ROOT / "benchmarks" / "results" / time.strftime("serving-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True)
    if args.stages == "off":
        args.config = str(without_stages(ROOT / args.config, out_dir))
    config = load_config(ROOT / args.config)
    model = config.models[0]
    folder = model.source.resolve(config.models_dir)
    base_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **model.engine.env}
    gateway_env = {**base_env, **dict(kv.split("=", 1) for kv in args.gateway_env)}

    def servers():
        vllm_port, gw_port = free_port(), free_port()
        raw = Server(
            "vllm",
            VLLM_CLI
            + ["serve", folder, "--served-model-name", model.model_id, "--port", str(vllm_port)]
            + engine_flags(model.engine.kwargs),
            base_env,
            vllm_port,
            out_dir,
        )
        gw = Server(
            "gateway",
            [sys.executable, "-m", "gateway", "run", "--config", args.config, "--port", str(gw_port)],
            gateway_env,
            gw_port,
            out_dir,
        )
        return raw, gw

    results: dict[tuple[str, int], list[dict]] = {}
    ready: dict[str, list[float]] = {}
    for r in range(args.rounds):
        raw, gw = servers()
        order = [raw, gw] if r % 2 == 0 else [gw, raw]
        print(f"round {r + 1}/{args.rounds}: {' then '.join(s.name for s in order)}", flush=True)
        for server in order:
            with server:
                ready.setdefault(server.name, []).append(server.ready_s)
                run_load(server, model.model_id, folder, 1, 2, out_dir, f"warmup-{server.name}-{r}")
                for c in args.concurrency:
                    figures = run_load(
                        server,
                        model.model_id,
                        folder,
                        c,
                        c * args.prompts_per_stream,
                        out_dir,
                        f"{server.name}-c{c}-r{r}",
                    )
                    results.setdefault((server.name, c), []).append(figures)
                    print(
                        f"    c={c}: {figures['output_throughput']:.1f} tok/s, TTFT p50 {figures['median_ttft_ms']:.0f} ms, "
                        f"TPOT p50 {figures['median_tpot_ms']:.1f} ms",
                        flush=True,
                    )

    def med(name: str, c: int, key: str) -> float:
        return statistics.median(f[key] for f in results[(name, c)])

    print(f"\n{model.model_id}, 128 tokens in / 64 out, medians of {args.rounds} rounds")
    header = f"{'':>4} | {'output tok/s':>24} | {'TTFT p50 (ms)':>24} | {'TPOT p50 (ms)':>24}"
    print(header + "\n" + "-" * len(header))
    print(
        f"{'c':>4} | {'vllm':>7} {'gateway':>8} {'ratio':>7} | {'vllm':>7} {'gateway':>8} {'ratio':>7} | {'vllm':>7} {'gateway':>8} {'ratio':>7}"
    )
    summary = {}
    for c in args.concurrency:
        row = []
        for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            v, g = med("vllm", c, key), med("gateway", c, key)
            row.append(f"{v:7.1f} {g:8.1f} {g / v:6.2f}x")
            summary[f"c{c}_{key}"] = {"vllm": v, "gateway": g, "ratio": g / v}
        print(f"{c:>4} | " + " | ".join(row))
    print(
        f"\nready in (median): vllm {statistics.median(ready['vllm']):.0f} s, gateway {statistics.median(ready['gateway']):.0f} s"
    )
    (out_dir / "summary.json").write_text(
        json.dumps(
            {"rounds": args.rounds, "stages": args.stages, "gateway_env": args.gateway_env, "figures": summary},
            indent=2,
        )
    )
    print(f"raw results: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
