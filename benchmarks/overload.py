"""Overload: many more concurrent clients than the engine can take, each answered promptly with
either a result or a retryable error (503 with Retry-After), never left waiting.

By default it starts the gateway the way the fast test tier does (real Serve applications through
`gateway.deploy.apply`, the scripted engine, stages off) with a deliberately small engine:
``max_ongoing_requests`` 8 and ``max_queued_requests`` 8, each answer taking about
``--tokens`` x ``--token-ms``. Then it fires ``--clients`` requests at once, ``--rounds`` times,
half of them streamed. With ``--url`` it drives a gateway that already runs (``make run``) with a
real prompt instead.

    python benchmarks/overload.py [--clients 200] [--rounds 3] [--tokens 16] [--token-ms 50]
    python benchmarks/overload.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct --key sk-gw-...

It prints the outcomes (status and error code), latency percentiles per outcome, how many
refusals carried Retry-After, and the slowest refusal. Not part of the test command.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import free_port  # noqa: E402

SCRIPTED_ENGINE = "engines.scripted_engine:ScriptedEngine"
MODEL_ID = "scripted-overload"


def start_gateway(workdir: Path, ongoing: int, queued: int) -> tuple[str, str | None]:
    """A fast-tier-like gateway on a fresh local Ray; returns its URL and an API key."""
    from gateway.__main__ import RAY_ENV_DEFAULTS

    # Serve reads these when its modules load, here and in every process Ray starts.
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ["GATEWAY_OVERLOAD_KEYS"] = "operator=overload-key"
    import ray
    from ray import serve

    from gateway import deploy
    from gateway.config import load_config

    (workdir / "model.yaml").write_text(
        f"model_id: {MODEL_ID}\nsource: {{path: /nonexistent}}\nengine: {{stream_batching_interval_ms: 0}}\n"
        "placement: {accelerator: cpu, cpus_per_worker: 0.1}\n"
        f"deployment: {{max_ongoing_requests: {ongoing}, max_queued_requests: {queued}}}\n"
    )
    (workdir / "gateway.yaml").write_text(
        "models: [model.yaml]\nauth: {api_keys_env: GATEWAY_OVERLOAD_KEYS}\nretry_after_s: 1\n"
        "ingress: {num_cpus: 0.1}\nembedding: {enabled: false}\nretrieval: {enabled: false}\n"
        "guardrails: {enabled: false}\n"
    )
    port = free_port()
    context = ray.init(
        num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=free_port(),
        logging_level="ERROR", log_to_driver=False,
    )  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = load_config(workdir / "gateway.yaml", port=port)
    deploy.apply(config, address="http://" + context.dashboard_url, engine_cls=SCRIPTED_ENGINE, timeout_s=600)
    return f"http://127.0.0.1:{port}", "overload-key"


async def one(http: httpx.AsyncClient, body: dict, stream: bool) -> tuple[str, float, bool]:
    """(outcome, seconds, had Retry-After). Outcomes: ``ok``, ``<status> <code>``, or
    ``stream-error <code>`` for a stream that ended with an error event."""
    started = time.perf_counter()
    try:
        if not stream:
            r = await http.post("/v1/chat/completions", json=body)
            return _outcome(r.status_code, r.content), time.perf_counter() - started, "retry-after" in r.headers
        async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            content = await r.aread()
            if r.status_code != 200:
                return _outcome(r.status_code, content), time.perf_counter() - started, "retry-after" in r.headers
        events = [b[6:] for b in content.split(b"\n\n") if b.startswith(b"data: ")]
        errors = [orjson.loads(e)["error"] for e in events if e != b"[DONE]" and b'"error"' in e[:12]]
        done = events and events[-1] == b"[DONE]"
        if errors:
            return f"stream-error {errors[0].get('code')}", time.perf_counter() - started, False
        return ("ok" if done else "stream-unterminated"), time.perf_counter() - started, False
    except httpx.HTTPError as exc:
        return f"transport {type(exc).__name__}", time.perf_counter() - started, False


def _outcome(status: int, content: bytes) -> str:
    if status == 200:
        return "ok"
    try:
        code = orjson.loads(content)["error"]["code"]
    except Exception:  # Serve's own proxy answers some refusals in plain text
        code = "(plain text: " + content[:60].decode(errors="replace") + ")"
    return f"{status} {code}"


async def run(url: str, key: str | None, model: str, prompt: str, max_tokens: int, clients: int, rounds: int):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    results: list[tuple[str, float, bool]] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as http:
        warm = await http.post(
            "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert warm.status_code == 200, warm.text
        for r in range(rounds):
            body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]}
            started = time.perf_counter()
            batch = await asyncio.gather(*(one(http, body, stream=i % 2 == 1) for i in range(clients)))
            wall = time.perf_counter() - started
            tally = Counter(o for o, _, _ in batch)
            print(f"round {r + 1}: {clients} clients in {wall:.2f}s: {dict(tally)}", flush=True)
            results += batch
            await asyncio.sleep(1.0)
    return results


def report(results: list[tuple[str, float, bool]]) -> None:
    by: dict[str, list[float]] = defaultdict(list)
    retry_after: Counter = Counter()
    for outcome, seconds, has_retry in results:
        by[outcome].append(seconds * 1000)
        retry_after[outcome] += has_retry
    everything = [s * 1000 for _, s, _ in results]
    print(f"\n{len(results)} requests; latency ms over all: p50 {np.percentile(everything, 50):.0f}, "
          f"p99 {np.percentile(everything, 99):.0f}, max {max(everything):.0f}")  # fmt: skip
    print(f"{'outcome':<40} {'count':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'Retry-After':>12}")
    for outcome, values in sorted(by.items(), key=lambda kv: -len(kv[1])):
        print(
            f"{outcome:<40} {len(values):>6} {np.percentile(values, 50):>8.0f} {np.percentile(values, 99):>8.0f} "
            f"{max(values):>8.0f} {retry_after[outcome]:>12}"
        )
    bad = [o for o in by if not (o == "ok" or o.startswith(("503 ", "429 ", "504 ")))]
    print("5xx other than 503/504, or unterminated:", bad or "none")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running gateway; default: start a fast-tier-like one")
    parser.add_argument("--key", default=os.environ.get("GATEWAY_API_KEY"))
    parser.add_argument("--model", default=MODEL_ID)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="scripted engine: tokens per answer")
    parser.add_argument("--token-ms", type=int, default=50, help="scripted engine: time per token")
    parser.add_argument("--max-ongoing", type=int, default=8, help="scripted engine: max_ongoing_requests")
    parser.add_argument("--max-queued", type=int, default=8, help="scripted engine: max_queued_requests")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.url:
        url, key, prompt = args.url, args.key, "Say hello in one short sentence."
    else:
        workdir = Path(tempfile.mkdtemp(prefix="overload-"))
        url, key = start_gateway(workdir, args.max_ongoing, args.max_queued)
        prompt = f"[[tokens:{args.tokens}]][[delay-ms:{args.token_ms}]] hello"
        print(
            f"scripted engine: max_ongoing_requests {args.max_ongoing}, max_queued_requests {args.max_queued}, "
            f"answers of {args.tokens} x {args.token_ms} ms",
            flush=True,
        )
    results = asyncio.run(run(url, key, args.model, prompt, args.max_tokens, args.clients, args.rounds))
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
