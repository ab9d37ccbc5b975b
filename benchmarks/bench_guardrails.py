"""Latency the guardrails add, rails on vs. rails off, side by side in one run.

The real Serve app (ingress, guardrails and embedding deployments) runs with the
scripted engine, so engine time is constant and the difference is the rails':

- input rails: non-streaming chats (benign prompts from the held-out eval set, one token
  out) to a model with rails on and one with rails off, alternating, sequentially;
- documents: the same chat with a benign tool result of the held-out split (a retrieved page,
  a product sheet, a JSON result), rails off, rails on with the shipped document stages (USE,
  then e5 and the windows' fine-tuned e5 on the windows it is unsure of), rails on without the
  fine-tuned e5 and rails on with the USE stage alone (the artifact without those, through
  ``injection.classifier_path``);
- output rails: 200-token streams; time per chunk from the first to the last chunk;
- in-process: the pieces without any Serve hop (one prompt's embedding with torch and with
  the int8 ONNX export the guardrails use; InputGuard on one text with its embedding
  precomputed; StreamGuard.push per delta).

The gateway runs with the Ray settings of `python -m gateway run` (RAY_ENV_DEFAULTS), and
the guardrails with their defaults (in-replica int8 ONNX encoder).

    python benchmarks/bench_guardrails.py [--requests 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
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
RAIL_EMBEDDING = "local"


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def benign_prompts() -> list[str]:
    """The held-out split's benign chat texts in a seeded random order. In file order the first
    200 were the English handwritten turns, which the second stage hardly sees; the split as a
    whole is two thirds multilingual hard turns and a quarter documents pasted as turns, of which
    about 40% and 80% reach it (2026-12-05)."""
    rows = [json.loads(line) for line in (ROOT / "guardrails/data/injection_eval.jsonl").open()]
    texts = [r["text"] for r in rows if r["label"] == 0 and r["category"] == "benign_chat"]
    random.Random(0).shuffle(texts)
    return texts


def start_gateway(workdir: Path) -> str:
    import os

    from gateway.__main__ import RAY_ENV_DEFAULTS

    # What `python -m gateway run` sets, before Ray is imported: Serve reads its settings
    # when its modules load, in this driver as well as in every process Ray starts.
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import ray
    from ray import serve

    from gateway import deploy
    from gateway.config import load_config

    (workdir / "rails-off.yaml").write_text("model_id: rails-off\n" + MODEL_BASE)
    (workdir / "rails-on.yaml").write_text("model_id: rails-on\n" + MODEL_BASE + GUARDED)
    # The shipped artifact without its documents' e5 stage: documents by the USE stage alone.
    from guardrails.detectors.injection_ensemble import load_scorer

    use_only = load_scorer(ROOT / ".models/injection_classifier.npz")
    use_only.doc_e5_hidden_weights = use_only.doc_e5_hidden_bias = use_only.doc_e5_weights = None
    use_only.window_e5 = None  # it reads the e5 stage's windows: without that stage, unused (not loaded)
    use_only.metadata = {**use_only.metadata, "document_threshold": use_only.metadata["document_use_threshold"]}
    use_only.save(workdir / "use-documents.npz")
    # ... and without the windows' fine-tuned e5: USE, then e5, at the e5 stage's own threshold.
    e5_only = load_scorer(ROOT / ".models/injection_classifier.npz")
    if e5_only.window_e5 is not None:
        e5_only.window_e5 = None
        e5_only.metadata = {**e5_only.metadata, "document_threshold": e5_only.metadata["window_e5_base_threshold"]}
    e5_only.save(workdir / "e5-documents.npz")
    for name, artifact in (("rails-on-use-docs", "use-documents.npz"), ("rails-on-e5-docs", "e5-documents.npz")):
        (workdir / f"{name}.yaml").write_text(
            f"model_id: {name}\n"
            + MODEL_BASE
            + f"guardrails: {{enabled: true, injection: {{classifier_path: {workdir / artifact}}}}}\n"
        )
    (workdir / "gateway.yaml").write_text(
        "models: [rails-off.yaml, rails-on.yaml, rails-on-use-docs.yaml, rails-on-e5-docs.yaml]\n"
        f"models_dir: {ROOT / '.models'}\n"
        f"retrieval: {{enabled: false}}\ningress: {{num_cpus: 0.1}}\n"
        f"guardrails: {{num_cpus: 0.1, embedding: {RAIL_EMBEDDING}}}\n"
        f"embedding: {{model: {{batch_wait_timeout_s: {BATCH_WAIT_S}}}}}\n"
    )
    port = free_port()
    # The dashboard carries Serve's REST API, through which the gateway is applied (as in production).
    context = ray.init(
        num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=free_port(),
        logging_level="ERROR", log_to_driver=False,
    )  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = load_config(workdir / "gateway.yaml", port=port)
    deploy.apply(config, address="http://" + context.dashboard_url, engine_cls="engines.scripted_engine:ScriptedEngine")
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


def benign_documents() -> list[str]:
    """The held-out split's benign documents (pages, product sheets, tool results), in a seeded
    random order. The document threshold was calibrated on them at 5% FPR, so about 1 in 20 is
    refused (tallied as blocked: the rails ran)."""
    from guardrails.train_injection import load_rows

    data = load_rows(ROOT / "guardrails/data/injection_eval.jsonl")
    texts = [t for t, y, s in zip(data.texts, data.labels, data.slots) if y == 0 and s == "document"]
    random.Random(0).shuffle(texts)
    return texts


def document_latency(http: httpx.Client, model: str, documents: list[str]) -> list[float]:
    """Latency per chat whose history holds ``documents[i]`` as a tool result."""
    out = []
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    for doc in documents:
        messages = [
            {"role": "user", "content": "Look it up, please."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": doc},
        ]
        t = time.perf_counter()
        r = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 1, "messages": messages})
        out.append((time.perf_counter() - t) * 1000)
        if r.status_code == 400:
            BLOCKED[model + "/documents"] = BLOCKED.get(model + "/documents", 0) + 1
        else:
            assert r.status_code == 200, r.text
    return out


def per_chunk_ms(http: httpx.Client, model: str, streams: int, tokens: int = 200) -> list[float]:
    out = []
    body = {
        "model": model,
        "stream": True,
        "messages": [
            {"role": "system", "content": f"[[tokens:{tokens}]]"},
            {"role": "user", "content": "Count for me."},
        ],
    }
    for _ in range(streams):
        stamps = []
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content":"' in line:
                    stamps.append(time.perf_counter())
        out.append((stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1))
    return out


def in_process(prompts: list[str]) -> dict[str, float]:
    """The pieces without Serve: one prompt's embedding per encoder runtime (with 20 ms idle
    between prompts, as spaced-out requests see it: caches cool down), the rails on one
    text with its embedding precomputed, and StreamGuard.push per delta."""
    from guardrails.config import GuardrailPolicy
    from guardrails.detectors.injection_ensemble import load_scorer
    from guardrails.input_rail import InputGuard
    from guardrails.output_rail import StreamGuard
    from retrieval.encoder import SentenceEncoder

    out: dict[str, float] = {}
    for backend in ("torch", "onnx-int8"):
        encoder = SentenceEncoder(ROOT / ".models/all-MiniLM-L6-v2", num_threads=1, backend=backend)
        encoder.encode(prompts[:5], truncate=True)
        times = []
        for p in prompts[:100]:
            time.sleep(0.02)
            t = time.perf_counter()
            encoder.encode([p], truncate=True)
            times.append((time.perf_counter() - t) * 1000)
        out[f"embed_{backend}_p50"] = pct(times, 50)
    scorer = load_scorer(ROOT / ".models/injection_classifier.npz")
    guard = InputGuard(GuardrailPolicy(), injection_scorer=scorer)
    guard.check_text(prompts[0], None)  # the scorer's encoder loads on first use
    rail_ms = []
    for p in prompts:
        e = encoder.encode([p], truncate=True) if guard.needs_embedding else None
        t = time.perf_counter()
        guard.check_text(p, e)
        rail_ms.append((time.perf_counter() - t) * 1000)
    stream = StreamGuard.from_policy(GuardrailPolicy())
    deltas = [" word"] * 2000
    t = time.perf_counter()
    for d in deltas:
        stream.push(d)
    stream.finish()
    out["push_us"] = (time.perf_counter() - t) * 1e6 / len(deltas)
    out["rails_p50"], out["rails_p99"] = pct(rail_ms, 50), pct(rail_ms, 99)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=150, help="chat requests per model per round")
    parser.add_argument("--streams", type=int, default=10, help="200-token streams per model per round")
    parser.add_argument("--documents", type=int, default=60, help="chats with a tool result per model per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-wait-s", type=float, default=0.005, help="embedding deployment's batch_wait_timeout_s")
    parser.add_argument(
        "--rail-embedding",
        choices=["local", "shared"],
        default="local",
        help="guardrails.embedding: the replica's own int8 encoder, or the embedding deployment",
    )
    args = parser.parse_args()
    global BATCH_WAIT_S, RAIL_EMBEDDING
    BATCH_WAIT_S, RAIL_EMBEDDING = args.batch_wait_s, args.rail_embedding

    prompts, documents = benign_prompts(), benign_documents()
    with tempfile.TemporaryDirectory() as tmp:
        url = start_gateway(Path(tmp))
        lat = {"rails-off": [], "rails-on": []}
        chunk = {"rails-off": [], "rails-on": []}
        docs: dict[str, list[float]] = {
            name: [] for name in ("rails-off", "rails-on", "rails-on-use-docs", "rails-on-e5-docs")
        }
        with httpx.Client(base_url=url, timeout=60) as http:
            input_latency(http, "rails-on", prompts[:20])  # warm-up: classifier, batches, routes
            input_latency(http, "rails-off", prompts[:20])
            document_latency(http, "rails-on-use-docs", documents[-5:])
            document_latency(http, "rails-on-e5-docs", documents[-5:])
            for r in range(args.rounds):
                order = ["rails-off", "rails-on"] if r % 2 == 0 else ["rails-on", "rails-off"]
                for model in order:
                    sample = [prompts[i % len(prompts)] for i in range(args.requests)]
                    lat[model] += input_latency(http, model, sample)
                    chunk[model] += per_chunk_ms(http, model, args.streams)
                # Each round its own documents (the verdict cache would answer a repeat).
                sample = documents[r * args.documents : (r + 1) * args.documents]
                for model in list(docs) if r % 2 == 0 else list(docs)[::-1]:
                    docs[model] += document_latency(http, model, sample)
        local = in_process(prompts)

    off, on = lat["rails-off"], lat["rails-on"]
    print(
        f"\ninput rails through the gateway ({len(off)} requests each, sequential, scripted engine, "
        f"guardrails.embedding: {RAIL_EMBEDDING})"
    )
    print(f"{'':>12} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    for name, values in (("rails off", off), ("rails on", on)):
        print(f"{name:>12} {pct(values, 50):8.2f} {pct(values, 90):8.2f} {pct(values, 99):8.2f}")
    added = [pct(on, q) - pct(off, q) for q in (50, 90, 99)]
    print(f"{'added':>12} {added[0]:8.2f} {added[1]:8.2f} {added[2]:8.2f}   (target: p50 under 15 ms)")
    print(f"benign prompts blocked by the rails: {BLOCKED.get('rails-on', 0)} of {len(on)}")
    print(
        f"\nchats with a benign tool result ({len(docs['rails-off'])} each, median {int(np.median([len(d) for d in documents]))}"
        " characters; the held-out split's benign documents)"
    )
    print(f"{'':>30} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'blocked':>8}")
    for name, label in (
        ("rails-off", "rails off"),
        ("rails-on-use-docs", "rails on, USE stage alone"),
        ("rails-on-e5-docs", "rails on, USE + e5 stage"),
        ("rails-on", "+ fine-tuned e5 (shipped)"),
    ):
        v = docs[name]
        blocked = BLOCKED.get(name + "/documents", 0)
        print(f"{label:>30} {pct(v, 50):8.2f} {pct(v, 90):8.2f} {pct(v, 99):8.2f} {blocked:>8}")
    c_off, c_on = statistics.median(chunk["rails-off"]), statistics.median(chunk["rails-on"])
    print(
        f"\noutput rails on 200-token streams: {c_off:.3f} ms/chunk off, {c_on:.3f} ms/chunk on, "
        f"added {c_on - c_off:.3f} ms/chunk (target: under 1 ms)"
    )
    print(
        f"\nin process, no Serve hop, 1 thread: MiniLM embedding of one prompt p50 "
        f"{local['embed_torch_p50']:.2f} ms torch, {local['embed_onnx-int8_p50']:.2f} ms int8 ONNX (the rails' default); "
        f"rails on one text p50 {local['rails_p50']:.3f} ms, p99 {local['rails_p99']:.3f} ms; "
        f"StreamGuard.push {local['push_us']:.1f} us per delta"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
