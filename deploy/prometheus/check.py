"""Prove the dashboard's queries return data: a real Prometheus against a running gateway.

    make prometheus-check                      # installs Debian's prometheus if missing
    python deploy/prometheus/check.py --gateway http://127.0.0.1:8000 --api-key-env GATEWAY_API_KEY

Starts Debian's ``prometheus`` with this folder's scrape setup (Ray's service discovery file,
so every Ray node's metrics export is scraped) at a 2 s interval, sends the gateway a few
requests (plain, streamed, and one the input rail refuses), waits until Ray has exported them
and Prometheus has scraped them, then runs every PromQL expression of
deploy/grafana/llm-gateway.json (Grafana's ``$__rate_interval`` as ``1m``) and prints what each
returned. A query has data when some series has a number (a quantile over buckets that did not
move in the last minute is NaN and does not count). Exits 1 when a query of the gateway's own layers or Serve's returned nothing; vLLM's
and the embedder's panels are reported and only required with ``--strict``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE.parent / "grafana" / "llm-gateway.json"
SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"
# Panels backed by series only some deployments have (vLLM's, the embedding batcher's, streams
# cut by output rails, 429s, the rails' own errors): reported, required only with --strict.
OPTIONAL = ("ray_vllm_", "ray_serve_actual_batch_size", "ray_serve_batch_wait", "streams_cut", "429", "errors_total")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_queries(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with Grafana's interval variable filled in."""
    board = json.loads(path.read_text())
    return [
        (panel.get("title", "?"), target["expr"].replace("$__rate_interval", "1m"))
        for panel in board.get("panels", [])
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def start_prometheus(sd_file: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("prometheus")
    if binary is None:
        sys.exit("prometheus is not installed: `make prometheus-check` installs Debian's package")
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 2s, evaluation_interval: 2s}\n"
        "scrape_configs:\n"
        f"  - job_name: ray\n    file_sd_configs: [{{files: [{json.dumps(sd_file)}]}}]\n"
    )
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(workdir / "prometheus.log", "w"),  # noqa: SIM115 - lives as long as the process
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"prometheus did not start; see {workdir / 'prometheus.log'}")


_ROUND = iter(range(1, 1_000_000))


def drive(gateway: str, key: str, model: str | None) -> None:
    """A few requests of each kind, so each layer's series move (numbered, so the rails'
    verdict cache does not answer them all)."""
    n = next(_ROUND)
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=gateway, headers=headers, timeout=120) as http:
        if model is None:
            model = http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": f"Name colour number {n}."}], "max_tokens": 8}
        statuses = [
            http.post("/v1/chat/completions", json={**chat, "stream": i % 2 == 1}).status_code for i in range(4)
        ]
        card = {**chat, "messages": [{"role": "user", "content": f"My card is 4111 1111 1111 1111 ({n})."}]}
        statuses.append(http.post("/v1/chat/completions", json=card).status_code)  # refused by input rails
        print(f"  sent 5 requests: {statuses}", flush=True)


def query_all(prom: str, queries: list[tuple[str, str]]) -> list[tuple[str, str, list]]:
    out = []
    for title, expr in queries:
        r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10).json()
        if r.get("status") != "success":
            raise SystemExit(f"query failed ({title}): {r.get('error')}\n  {expr}")
        out.append((title, expr, r["data"]["result"]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key-env", default="GATEWAY_API_KEY", help="environment variable holding a key")
    parser.add_argument("--model", help="model to call (default: the first listed)")
    parser.add_argument("--sd-file", default=SD_FILE, help="Ray's Prometheus service discovery file")
    parser.add_argument("--wait-s", type=float, default=60, help="how long to wait for every series")
    parser.add_argument("--strict", action="store_true", help="require vLLM's and the embedder's panels too")
    args = parser.parse_args()
    key = os.environ.get(args.api_key_env)
    if not key:
        sys.exit(f"set {args.api_key_env} to a key of the gateway")
    if not Path(args.sd_file).exists():
        sys.exit(f"{args.sd_file} not found: is a Ray cluster running on this machine?")
    queries = dashboard_queries()
    with tempfile.TemporaryDirectory(prefix="prom-check-") as tmp:
        proc, prom = start_prometheus(args.sd_file, Path(tmp))
        try:
            print(f"prometheus at {prom}; driving {args.gateway}", flush=True)
            # Ray exports a worker's metrics every few seconds and Prometheus scrapes every 2 s;
            # requests keep coming meanwhile, so that rates are not zero.
            deadline = time.monotonic() + args.wait_s
            while True:
                drive(args.gateway, key, args.model)
                results = query_all(prom, queries)
                missing = [
                    t for t in results if not _has_data(t[2]) and (args.strict or not any(o in t[1] for o in OPTIONAL))
                ]
                print(f"  {len(results) - len(missing)}/{len(results)} queries with data", flush=True)
                if not missing or time.monotonic() > deadline:
                    break
        finally:
            proc.terminate()
            proc.wait(10)
    for title, _expr, result in results:
        values = ", ".join(f"{_labels(r['metric'])}={float(r['value'][1]):.3g}" for r in result[:3])
        print(f"{'ok  ' if _has_data(result) else 'NONE'} {title}: {values or '-'}")
    if missing:
        print(f"\n{len(missing)} required queries returned no data:")
        for title, expr, _ in missing:
            print(f"  {title}: {expr}")
        return 1
    print("\nevery required dashboard query returned data")
    return 0


def _has_data(result: list) -> bool:
    """A series with a number: a quantile over buckets that did not move is NaN, not data."""
    return any(math.isfinite(float(r["value"][1])) for r in result)


def _labels(metric: dict) -> str:
    return "{" + ",".join(f"{k}={v}" for k, v in metric.items() if k != "__name__") + "}"


if __name__ == "__main__":
    sys.exit(main())
