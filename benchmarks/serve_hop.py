"""What one Serve hop costs on this machine: a no-op deployment called through a handle.

A ``Caller`` replica awaits ``Noop.call`` ``--calls`` times in a row and times each call, with a
one-character argument and with one shaped like an input-rails call (a few texts and a policy's
worth of fields). Ray is started with the gateway's environment (``gateway.__main__``:
``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, gRPC between replicas) unless ``--serve-defaults``.
It is the floor under every stage the gateway calls through Serve (guardrails, retrieval): the
overhead benchmark's stage latencies minus the replicas' own times, less this, is waiting for CPU.
It also prints the CPU one call costs the caller's and the callee's processes (``time.process_time``
in each): on a saturated machine, that is what a hop takes from requests/s.

    python benchmarks/serve_hop.py                   # the gateway's settings
    python benchmarks/serve_hop.py --serve-defaults  # Ray Serve's own defaults
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="timed calls per payload")
    parser.add_argument("--serve-defaults", action="store_true", help="Ray Serve's defaults, not the gateway's")
    args = parser.parse_args()
    if not args.serve_defaults:
        from gateway.__main__ import RAY_ENV_DEFAULTS

        for key, value in RAY_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
    else:
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "0"
    # Serve reads its constants at import: the environment must be set first.
    import ray
    from ray import serve

    @serve.deployment
    class Noop:
        async def call(self, payload):
            return payload

        async def cpu_s(self) -> float:
            return time.process_time()  # every thread of the replica's process

    @serve.deployment
    class Caller:
        def __init__(self, noop) -> None:
            self._noop = noop

        async def run(self, calls: int, payload) -> tuple[list[float], float, float]:
            """Each call's latency (ms), and the CPU per call (ms) of this replica and the callee's."""
            times = []
            callee = await self._noop.cpu_s.remote()
            cpu = time.process_time()
            for _ in range(calls):
                started = time.perf_counter()
                await self._noop.call.remote(payload)
                times.append((time.perf_counter() - started) * 1000)
            cpu = time.process_time() - cpu
            callee = await self._noop.cpu_s.remote() - callee
            return times, cpu * 1000 / calls, callee * 1000 / calls

    payloads = {
        "one character": "x",
        "input-rails-like": [["What is our refund policy for damaged items?"] * 3, {"limits": list(range(64))}],
    }

    async def measure() -> None:
        # In the throughput mode a handle's router runs on the caller's event loop.
        handle = serve.run(Caller.bind(Noop.bind()), name="serve-hop", route_prefix=None)
        print(f"RAY_SERVE_THROUGHPUT_OPTIMIZED={os.environ.get('RAY_SERVE_THROUGHPUT_OPTIMIZED', '0')}")
        for label, payload in payloads.items():
            await handle.run.remote(20, payload)  # warm-up
            times, caller_cpu, callee_cpu = await handle.run.remote(args.calls, payload)
            q = statistics.quantiles(times, n=100)
            print(
                f"{label:>18}: p50 {statistics.median(times):.2f} ms  p90 {q[89]:.2f}  p99 {q[98]:.2f}"
                f"  | CPU a call: caller {caller_cpu:.2f} ms, callee {callee_cpu:.2f} ms"
            )
        await serve.shutdown_async()

    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(measure())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
