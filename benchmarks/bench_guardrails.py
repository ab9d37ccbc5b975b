"""Latency the guardrails add, rails on vs. rails off, side by side in one run.

The real Serve app (ingress, guardrails and embedding deployments) runs with the
scripted engine, so engine time is constant and the difference is the rails':

- input rails: non-streaming chats (benign prompts from the held-out eval set, one token
  out) to a model with rails on and one with rails off, alternating, sequentially;
- output rails: 200-token streams; time per chunk from the first to the last chunk;
- in-process: the pure rail code without any Serve hop (InputGuard on one text with its
  embedding precomputed; StreamGuard.push per delta).

    python benchmarks/bench_guardrails.py [--requests 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL_BASE = """source: {path: /nonexistent}
engine: {stream_batching_interval_ms: 0}
placement: {accelerator: cpu, cpus_per_worker: 0.1}
"""
GUARDED = "guardrails: {enabled: true}\n"
BATCH_WAIT_S = 0.005  # the defaults: PII, injection, limits, output rail


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def benign_prompts() -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "guardrails/data/injection_eval.jsonl").open()]
    return [r["text"] for r in rows if r["label"] == 0 and r["category"] == "benign_chat"]


def start_gateway(workdir: Path) -> str:
    import ray
    from ray import serve

    from engines.scripted_engine import ScriptedEngine
    from gateway.app import build_gateway
    from gateway.config import load_config

    (workdir / "rails-off.yaml").write_text("model_id: rails-off\n" + MODEL_BASE)
    (workdir / "rails-on.yaml").write_text("model_id: rails-on\n" + MODEL_BASE + GUARDED)
    (workdir / "gateway.yaml").write_text(
        f"models: [rails-off.yaml, rails-on.yaml]\nmodels_dir: {ROOT / '.models'}\n"
        f"retrieval: {{enabled: false}}\ningress: {{num_cpus: 0.1}}\nguardrails: {{num_cpus: 0.1}}\n"
        f"embedding: {{model: {{batch_wait_timeout_s: {BATCH_WAIT_S}}}}}\n"
    )
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_gateway(load_config(workdir / "gateway.yaml"), engine_cls=ScriptedEngine), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}"


BLOCKED: dict[str, int] = {}


def input_latency(http: httpx.Client, model: str, prompts: list[str]) -> list[float]:
    """Latency per request. A benign prompt the rails block (the classifier's false
    positives) still counts: the rails ran; it is tallied in BLOCKED."""
    out = []
    for prompt in prompts:
        body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]}
        t = time.perf_counter()
        r = http.post("/v1/chat/completions", json=body)
        out.append((time.perf_counter() - t) * 1000)
        if r.status_code == 400:
            BLOCKED[model] = BLOCKED.get(model, 0) + 1
        else:
            assert r.status_code == 200, r.text
    return out


def per_chunk_ms(http: httpx.Client, model: str, streams: int, tokens: int = 200) -> list[float]:
    out = []
    body = {"model": model, "stream": True, "messages": [
        {"role": "system", "content": f"[[tokens:{tokens}]]"}, {"role": "user", "content": "Count for me."}]}
    for _ in range(streams):
        stamps = []
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content":"' in line:
                    stamps.append(time.perf_counter())
        out.append((stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1))
    return out


def in_process(prompts: list[str]) -> dict[str, float]:
    from guardrails.config import GuardrailPolicy
    from guardrails.detectors.injection import InjectionClassifier
    from guardrails.input_rail import InputGuard
    from guardrails.output_rail import StreamGuard
    from retrieval.encoder import SentenceEncoder

    encoder = SentenceEncoder(ROOT / ".models/all-MiniLM-L6-v2", num_threads=1)
    classifier = InjectionClassifier.load(ROOT / ".models/injection_classifier.npz")
    guard = InputGuard(GuardrailPolicy(), injection_scorer=classifier)
    embed_ms, rail_ms = [], []
    for p in prompts:
        t = time.perf_counter()
        e = encoder.encode([p], truncate=True)
        t1 = time.perf_counter()
        guard.check_text(p, e)
        t2 = time.perf_counter()
        embed_ms.append((t1 - t) * 1000)
        rail_ms.append((t2 - t1) * 1000)
    stream = StreamGuard.from_policy(GuardrailPolicy())
    deltas = [" word"] * 2000
    t = time.perf_counter()
    for d in deltas:
        stream.push(d)
    stream.finish()
    push_us = (time.perf_counter() - t) * 1e6 / len(deltas)
    return {"embed_p50": pct(embed_ms, 50), "rails_p50": pct(rail_ms, 50), "rails_p99": pct(rail_ms, 99), "push_us": push_us}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=150, help="chat requests per model per round")
    parser.add_argument("--streams", type=int, default=10, help="200-token streams per model per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-wait-s", type=float, default=0.005, help="embedding deployment's batch_wait_timeout_s")
    args = parser.parse_args()
    global BATCH_WAIT_S
    BATCH_WAIT_S = args.batch_wait_s

    prompts = benign_prompts()
    with tempfile.TemporaryDirectory() as tmp:
        url = start_gateway(Path(tmp))
        lat = {"rails-off": [], "rails-on": []}
        chunk = {"rails-off": [], "rails-on": []}
        with httpx.Client(base_url=url, timeout=60) as http:
            input_latency(http, "rails-on", prompts[:20])  # warm-up: classifier, batches, routes
            input_latency(http, "rails-off", prompts[:20])
            for r in range(args.rounds):
                order = ["rails-off", "rails-on"] if r % 2 == 0 else ["rails-on", "rails-off"]
                for model in order:
                    sample = [prompts[i % len(prompts)] for i in range(args.requests)]
                    lat[model] += input_latency(http, model, sample)
                    chunk[model] += per_chunk_ms(http, model, args.streams)
        local = in_process(prompts)

    off, on = lat["rails-off"], lat["rails-on"]
    print(f"\ninput rails through the gateway ({len(off)} requests each, sequential, scripted engine)")
    print(f"{'':>12} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"{'rails off':>12} {pct(off, 50):8.2f} {pct(off, 99):8.2f}")
    print(f"{'rails on':>12} {pct(on, 50):8.2f} {pct(on, 99):8.2f}")
    print(f"{'added':>12} {pct(on, 50) - pct(off, 50):8.2f} {pct(on, 99) - pct(off, 99):8.2f}   (target: p50 under 15 ms)")
    print(f"benign prompts blocked by the rails: {BLOCKED.get('rails-on', 0)} of {len(on)}")
    c_off, c_on = statistics.median(chunk["rails-off"]), statistics.median(chunk["rails-on"])
    print(f"\noutput rails on 200-token streams: {c_off:.3f} ms/chunk off, {c_on:.3f} ms/chunk on, "
          f"added {c_on - c_off:.3f} ms/chunk (target: under 1 ms)")
    print(f"\nin process, no Serve hop: MiniLM embedding p50 {local['embed_p50']:.2f} ms (1 thread); "
          f"rails on one text p50 {local['rails_p50']:.3f} ms, p99 {local['rails_p99']:.3f} ms; "
          f"StreamGuard.push {local['push_us']:.1f} us per delta")
    return 0


if __name__ == "__main__":
    sys.exit(main())
