"""Embedding throughput through Ray Serve, with @serve.batch on and off, against in-process.

Starts its own Ray (``num_cpus=4``, no dashboard), with Serve configured as the gateway runs it
(``gateway.__main__.RAY_ENV_DEFAULTS``) unless ``--serve-defaults``, and two handle-only Serve
apps running the ``Embedder`` deployment: batching ON (``max_batch_size`` 32) and OFF
(``max_batch_size`` 1), both with 2 torch threads (``--threads``; the gateway's own Embedder
replica, at ``num_cpus: 0.5``, gets one: Ray sets ``OMP_NUM_THREADS=1`` in it). ``c`` concurrent callers each send one sentence per
``handle.embed.remote`` and await it before sending the next; sentences/s is completed calls
over wall time. The in-process ceiling is ``SentenceEncoder.encode`` on batches of 32 in this
process (2 threads), no Serve. Cells run in alternating order for ``--rounds`` rounds and the
median is reported, because other work on the machine moves the figures.

Batch figures come from the deployment's own counters (``Embedder.batch_stats``); Ray exports
the same through Prometheus as ``ray_serve_batch_*`` / ``ray_serve_actual_batch_size``.

    python benchmarks/bench_embeddings.py               # about 2 minutes
    python benchmarks/bench_embeddings.py --seconds 2 --rounds 1   # quick look
    OMP_WAIT_POLICY=ACTIVE python benchmarks/bench_embeddings.py   # OpenMP's spinning default
    python benchmarks/bench_embeddings.py --serve-defaults         # Serve's defaults, not the gateway's
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

# Before torch loads (below), so the in-process ceiling waits for OpenMP work the way the
# deployment does (see retrieval.embedding_deployment.OMP_ENV). Both sides get this value.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Serve as the gateway runs it (gateway.__main__: throughput-optimized, gRPC between replicas
# and from this driver's handles), unless --serve-defaults. Serve reads these when it is
# imported (below), so they are set before anything parses the arguments.
if "--serve-defaults" in sys.argv:
    os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "0"
else:
    from gateway.__main__ import RAY_ENV_DEFAULTS  # noqa: E402

    for _key, _value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(_key, _value)

from retrieval.config import EmbeddingModelConfig  # noqa: E402
from retrieval.embedding_deployment import SERVE_BATCH_METRICS, Embedder  # noqa: E402
from retrieval.encoder import SentenceEncoder  # noqa: E402

CONCURRENCY = (1, 8, 32)
BATCH = 32
WORDS = (
    "the a river city engine model bright quiet storm garden market train quickly slowly "
    "over under near after before during small large ancient modern blue green red old new "
    "scientist teacher farmer child dog cat bird ship road bridge mountain forest ocean desert "
    "builds finds carries watches opens closes crosses follows measures paints writes reads"
).split()


def make_sentences(n: int, seed: int = 7) -> list[str]:
    """Varied sentences of 8 to 20 words (about 10 to 25 tokens), reproducible."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))).capitalize() + "." for _ in range(n)]


async def drive(handle, sentences: list[str], concurrency: int, seconds: float) -> dict:
    """``concurrency`` closed-loop callers for ``seconds``: throughput and latency."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def caller() -> None:
        while time.perf_counter() < deadline:
            text = sentences[next(counter) % len(sentences)]
            sent = time.perf_counter()
            await handle.embed.remote(text)
            latencies.append(time.perf_counter() - sent)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    ordered = sorted(latencies)
    return {
        "rate": len(latencies) / elapsed,
        "p50_ms": 1000 * ordered[len(ordered) // 2],
        "p95_ms": 1000 * ordered[int(len(ordered) * 0.95)],
    }


def in_process_rate(encoder: SentenceEncoder, sentences: list[str], seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = [sentences[(done + i) % len(sentences)] for i in range(BATCH)]
        encoder.encode(batch)
        done += BATCH
    return done / (time.perf_counter() - start)


async def measure(args: argparse.Namespace) -> None:
    from ray import serve

    sentences = make_sentences(4096)
    configs = {
        "batched": EmbeddingModelConfig(num_threads=args.threads, max_batch_size=BATCH, batch_wait_timeout_s=args.wait),
        "unbatched": EmbeddingModelConfig(num_threads=args.threads, max_batch_size=1),
    }
    handles = {}
    env = {"runtime_env": {"env_vars": {"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]}}}
    for label, config in configs.items():
        app = Embedder.options(name=f"Embedder-{label}", ray_actor_options=env).bind(config)
        handles[label] = serve.run(app, name=f"bench-emb-{label}", route_prefix=None)
    for handle in handles.values():  # warm: first calls pay lazy allocations
        await asyncio.gather(*(handle.embed.remote(s) for s in sentences[:64]))

    encoder = SentenceEncoder.from_config(EmbeddingModelConfig(num_threads=args.threads))
    in_process_rate(encoder, sentences, 1.0)

    results: dict[tuple[str, int], list[dict]] = {}
    ceiling: list[float] = []
    for round_no in range(args.rounds):
        labels = list(handles) if round_no % 2 == 0 else list(reversed(handles))
        for concurrency in CONCURRENCY:
            for label in labels:
                handle = handles[label]
                await handle.reset_batch_stats.remote()
                cell = await drive(handle, sentences, concurrency, args.seconds)
                cell["stats"] = await handle.batch_stats.remote()
                results.setdefault((label, concurrency), []).append(cell)
                print(
                    f"round {round_no + 1} {label:9s} c={concurrency:<2d} "
                    f"{cell['rate']:7.1f} sentences/s  p50 {cell['p50_ms']:6.1f} ms  "
                    f"mean batch {cell['stats']['mean_batch_size']:5.1f}",
                    flush=True,
                )
        ceiling.append(in_process_rate(encoder, sentences, args.seconds))
        print(f"round {round_no + 1} in-process ceiling {ceiling[-1]:7.1f} sentences/s", flush=True)

    report(results, statistics.median(ceiling), args)
    # On this loop: with the gateway's environment the handles' routers run on it.
    await serve.shutdown_async()


def report(results: dict, ceiling: float, args: argparse.Namespace) -> None:
    def median(label: str, c: int, key: str) -> float:
        return statistics.median(cell[key] for cell in results[(label, c)])

    print()
    print(
        f"Embedding throughput, sentences/s, p50 latency (median of {args.rounds} round(s) x "
        f"{args.seconds:.0f} s; "
        f"torch threads {args.threads}; batch_wait_timeout_s {args.wait}; "
        f"OMP_WAIT_POLICY {os.environ['OMP_WAIT_POLICY']}; "
        f"RAY_SERVE_THROUGHPUT_OPTIMIZED={os.environ.get('RAY_SERVE_THROUGHPUT_OPTIMIZED', '0')}; load average before "
        f"{args.load_before:.2f})"
    )
    header = "".join(f"{'c=' + str(c):>16s}" for c in CONCURRENCY)
    print(f"{'':28s}{header}")
    for label, title in (
        ("batched", f"Serve, batching ON ({BATCH})"),
        ("unbatched", "Serve, batching OFF (1)"),
    ):
        cells = "".join(f"{median(label, c, 'rate'):8.1f} ({median(label, c, 'p50_ms'):4.0f}ms)" for c in CONCURRENCY)
        print(f"{title:28s}{cells}")
    ratios = "".join(f"{median('batched', c, 'rate') / median('unbatched', c, 'rate'):15.2f}x" for c in CONCURRENCY)
    print(f"{'ON / OFF':28s}{ratios}")
    print(f"{'in-process ceiling (32)':28s}{ceiling:16.1f}")
    on32 = median("batched", 32, "rate")
    off32 = median("unbatched", 32, "rate")
    print()
    print(f"batched / unbatched at c=32:        {on32 / off32:5.2f}x  (target >= 3)")
    print(f"batched c=32 / in-process ceiling:  {on32 / ceiling:5.2f}   (target >= 0.7)")
    print()
    print("Batches (Embedder.batch_stats, last round). serve = as serve.batch formed them,")
    print("encode = per forward pass after EncodeGate merged them; wait = queue to encode start.")
    print(
        f"{'':20s}{'serve':>7s}{'encode':>8s}{'fill':>6s}{'wait ms':>9s}{'encode ms':>10s}"
        f"{'util':>6s}  commonest encode sizes"
    )
    for label in ("batched", "unbatched"):
        for c in CONCURRENCY:
            s = results[(label, c)][-1]["stats"]
            formed = s["serve_batch_size_histogram"]
            serve_mean = sum(k * v for k, v in formed.items()) / max(1, sum(formed.values()))
            common = sorted(s["batch_size_histogram"].items(), key=lambda kv: -kv[1])[:4]
            sizes = ", ".join(f"{size}x{count}" for size, count in common)
            print(
                f"{label + ' c=' + str(c):20s}{serve_mean:7.1f}{s['mean_batch_size']:8.1f}"
                f"{s['mean_fill']:6.2f}{s['mean_wait_ms']:9.1f}{s['mean_encode_ms']:10.1f}"
                f"{s['utilisation']:6.2f}  {sizes}"
            )
    print()
    print("Prometheus (Ray metrics port, names prefixed ray_): " + ", ".join(SERVE_BATCH_METRICS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per cell")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument("--wait", type=float, default=0.005, help="batch_wait_timeout_s (ON)")
    parser.add_argument("--serve-defaults", action="store_true", help="Ray Serve's defaults, not the gateway's")
    args = parser.parse_args()
    args.load_before = os.getloadavg()[0]

    import ray
    from ray import serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    # Handle-only: no HTTP proxy to start or to collide with a running gateway's port.
    serve.start(proxy_location="Disabled")
    try:
        asyncio.run(measure(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
