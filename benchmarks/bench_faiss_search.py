"""Single-query search latency: raw FAISS against retrieval.collection.Collection.search.

Synthetic data: ``--n`` clustered, L2-normalised vectors (seeded), queries drawn the same way.
Searches run on one FAISS thread, one query at a time, ``top_k`` 10. "Raw" is the bare
``IndexFlatIP`` / ``IndexHNSWFlat`` that the collection wraps (same graph, so the ratio measures
only our overhead: ``IndexIDMap2``, the tombstone check and building Hit objects with metadata).
Recall@10 of HNSW is measured against exact flat search.

    python benchmarks/bench_faiss_search.py            # 100k x 384, about 1-2 minutes
    python benchmarks/bench_faiss_search.py --n 20000  # quick
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval.collection import Collection  # noqa: E402
from retrieval.config import IndexConfig  # noqa: E402


def clustered_vectors(rng: np.random.Generator, n: int, dim: int, centers: np.ndarray, noise: float) -> np.ndarray:
    """Points around random unit centres plus Gaussian noise of norm about ``noise``, normalised
    (cosine to their centre about 1/sqrt(1 + noise^2))."""
    picks = rng.integers(0, len(centers), size=n)
    scale = np.float32(noise / np.sqrt(dim))
    x = centers[picks] + rng.standard_normal((n, dim), dtype=np.float32) * scale
    faiss.normalize_L2(x)
    return x


def latencies_ms(search: Callable[[np.ndarray], object], queries: np.ndarray) -> np.ndarray:
    for q in queries[:20]:  # warm caches and lazy allocations
        search(q)
    out = np.empty(len(queries))
    for i, q in enumerate(queries):
        start = time.perf_counter_ns()
        search(q)
        out[i] = (time.perf_counter_ns() - start) / 1e6
    return out


def build_collection(kind: str, data: np.ndarray, args: argparse.Namespace) -> Collection:
    config = IndexConfig(kind=kind, hnsw_m=args.m, ef_construction=args.ef_construction)
    coll = Collection(name=f"bench-{kind}", dimension=data.shape[1], index_config=config)
    per_doc = 100
    started = time.perf_counter()
    for start in range(0, len(data), per_doc):
        block = data[start : start + per_doc]
        coll.add_document(
            f"doc-{start // per_doc}",
            [f"chunk text {start + i}" for i in range(len(block))],
            block,
            source=f"file-{start // per_doc}.txt",
            attributes={"group": start % 7},
        )
    print(
        f"built {kind} collection of {len(data)} in {time.perf_counter() - started:.1f}s",
        file=sys.stderr,
    )
    return coll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--flat-queries", type=int, default=200, help="flat is slow; fewer")
    parser.add_argument("--m", type=int, default=32)
    parser.add_argument("--ef-construction", type=int, default=IndexConfig().ef_construction)
    parser.add_argument("--ef-search", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--build-threads", type=int, default=2)
    parser.add_argument("--noise", type=float, default=1.0, help="cluster spread; higher is harder")
    parser.add_argument("--clusters", type=int, default=0, help="default n/500")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    k = 10

    rng = np.random.default_rng(args.seed)
    centers = rng.standard_normal((args.clusters or max(10, args.n // 500), args.dim), dtype=np.float32)
    faiss.normalize_L2(centers)
    data = clustered_vectors(rng, args.n, args.dim, centers, args.noise)
    queries = clustered_vectors(rng, args.queries, args.dim, centers, args.noise)

    faiss.omp_set_num_threads(args.build_threads)
    flat = build_collection("flat", data, args)
    hnsw = build_collection("hnsw", data, args)
    faiss.omp_set_num_threads(1)

    raw_flat = flat._inner  # the bare IndexFlatIP inside the collection (benchmark-only access)
    raw_hnsw = hnsw._inner  # the bare IndexHNSWFlat, same graph
    _, truth = raw_flat.search(queries, k)

    rows = []
    fq = queries[: args.flat_queries]
    raw = latencies_ms(lambda q: raw_flat.search(q.reshape(1, -1), k), fq)
    ours = latencies_ms(lambda q: flat.search(q, k), fq)
    rows.append(("flat (exact)", raw, ours, 1.0))
    for ef in args.ef_search:
        hnsw.set_ef_search(ef)
        _, found = raw_hnsw.search(queries, k)
        recall = np.mean([len(set(found[i]) & set(truth[i])) / k for i in range(len(queries))])
        raw = latencies_ms(lambda q: raw_hnsw.search(q.reshape(1, -1), k), queries)
        ours = latencies_ms(lambda q: hnsw.search(q, k), queries)
        rows.append((f"hnsw M={args.m} efSearch={ef}", raw, ours, recall))

    # Sanity: our hits are the raw ids (chunk ids equal insertion order here).
    hits = hnsw.search(queries[0], k)
    assert [h.chunk_id for h in hits] == [int(i) for i in raw_hnsw.search(queries[:1], k)[1][0]]

    print(f"\n{args.n} x {args.dim}, top_k={k}, 1 thread, single queries (efConstruction={args.ef_construction})\n")
    header = (
        f"{'index':<26}{'recall@10':>10}{'raw p50':>10}{'raw p99':>10}"
        f"{'ours p50':>10}{'ours p99':>10}{'p50 ratio':>11}{'p99 ratio':>11}"
    )
    print(header)
    print("-" * len(header))
    for name, raw, ours, recall in rows:
        r50, r99, o50, o99 = (
            np.percentile(raw, 50),
            np.percentile(raw, 99),
            np.percentile(ours, 50),
            np.percentile(ours, 99),
        )
        print(
            f"{name:<26}{recall:>10.3f}{r50:>9.3f}ms{r99:>8.3f}ms{o50:>8.3f}ms{o99:>8.3f}ms"
            f"{o50 / r50:>10.2f}x{o99 / r99:>10.2f}x"
        )


if __name__ == "__main__":
    main()
