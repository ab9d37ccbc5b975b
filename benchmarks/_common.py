"""Helpers the benchmark scripts share: a server process started and stopped around a block (and
several side by side), a free port, one chat request (streamed or not) timed from the client's
side, percentile summaries, a progress line, LiteLLM's proxy from its own virtualenv, and
matplotlib when it is installed (the optional ``bench`` extra)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent

SUBJECTS = [
    "the moon", "a rainbow", "coffee", "a bicycle", "the ocean", "a library", "autumn", "a volcano",
    "bread", "a violin", "the desert", "honey", "a lighthouse", "snow", "a garden", "tea", "a river",
    "the sun", "a forest", "chess",
]  # fmt: skip
TEMPLATES = ["Tell me one fact about {}.", "Describe {} in a few words.", "Why do people like {}?"]


def prompts(n: int) -> list[str]:
    """``n`` short benign chat prompts, 60 distinct ones in turn (the rails cache verdicts per text)."""
    pairs = itertools.product(TEMPLATES, SUBJECTS)
    return [t.format(s) for t, s in itertools.islice(itertools.cycle(pairs), n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process for the duration of a ``with`` block: started in its own session, ready
    when ``ready_path`` answers 200, stopped with SIGINT (SIGKILL after 90 s)."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        port: int,
        log_dir: Path,
        ready_path: str = "/v1/models",
    ):
        self.name, self.cmd, self.env, self.port, self.ready_path = name, cmd, env, port, ready_path
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        started = time.monotonic()
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > 900:
                self.__exit__()
                raise RuntimeError(f"{self.name} not ready after 900 s; see {self.log_path}")
            time.sleep(2)
        self.ready_s = time.monotonic() - started
        print(f"  {self.name} ready in {self.ready_s:.0f} s", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.log.closed:  # never started, or stopped already
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(90)
        except ProcessLookupError:  # it exited on its own, with every process of its group
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        time.sleep(3)  # let Ray's and vLLM's processes release the cores


class Arm:
    """One way to reach the model: a base URL, the model id to send, the proxy's overhead header."""

    def __init__(self, name: str, port: int, model: str, header: str | None = None):
        self.name, self.url, self.model, self.header = name, f"http://127.0.0.1:{port}", model, header


async def timed_stream(http: httpx.AsyncClient, body: dict, overhead_header: str | None = None) -> dict:
    """One streamed chat completion, timed as the client sees it.

    Returns ``status`` (HTTP status, or ``"transport"``), ``code`` (the error body's code, or the
    mid-stream error event's), ``ttft_ms`` (first content delta), ``total_ms`` (``[DONE]`` or the
    end of the body), ``itl_ms`` (mean gap between content deltas), ``tokens`` (the usage chunk's
    completion tokens, else content deltas), ``overhead_ms`` (the named response header),
    ``done`` (the stream ended with ``[DONE]``) and ``retry_after`` (seconds, on refusals)."""
    out: dict = {"status": "transport", "code": None, "ttft_ms": None, "total_ms": None, "itl_ms": None}
    out.update(tokens=0, overhead_ms=None, done=False, retry_after=None)
    started = time.perf_counter()
    stamps: list[float] = []
    usage_tokens = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            out["status"] = r.status_code
            if overhead_header and overhead_header in r.headers:
                out["overhead_ms"] = float(r.headers[overhead_header])
            if r.status_code != 200:
                content = await r.aread()
                out["retry_after"] = _float(r.headers.get("retry-after"))
                out["code"] = _error_code(content)
            else:
                buffer = b""
                async for piece in r.aiter_bytes():
                    buffer += piece
                    *events, buffer = buffer.split(b"\n\n")
                    now = time.perf_counter()
                    for event in events:
                        if not event.startswith(b"data: "):
                            continue
                        data = event[6:]
                        if data == b"[DONE]":
                            out["done"] = True
                            continue
                        chunk = orjson.loads(data)
                        if "error" in chunk:
                            out["code"] = chunk["error"].get("code") or "stream_error"
                        if chunk.get("usage"):
                            usage_tokens = chunk["usage"].get("completion_tokens")
                        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                            stamps.append(now)
    except httpx.HTTPError as exc:
        out["code"] = type(exc).__name__
    out["total_ms"] = (time.perf_counter() - started) * 1000
    if stamps:
        out["ttft_ms"] = (stamps[0] - started) * 1000
    if len(stamps) > 1:
        out["itl_ms"] = (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1)
    out["tokens"] = usage_tokens if usage_tokens is not None else len(stamps)
    return out


async def timed_chat(http: httpx.AsyncClient, body: dict, overhead_header: str | None = None) -> dict:
    """One non-streamed chat completion, timed as the client sees it: ``status``, ``code``,
    ``total_ms`` and ``overhead_ms`` (the named response header)."""
    out: dict = {"status": "transport", "code": None, "total_ms": None, "overhead_ms": None}
    started = time.perf_counter()
    try:
        r = await http.post("/v1/chat/completions", json=body)
        out["status"] = r.status_code
        if overhead_header and overhead_header in r.headers:
            out["overhead_ms"] = float(r.headers[overhead_header])
        if r.status_code != 200:
            out["code"] = _error_code(r.content)
    except httpx.HTTPError as exc:
        out["code"] = type(exc).__name__
    out["total_ms"] = (time.perf_counter() - started) * 1000
    return out


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _error_code(content: bytes) -> str:
    try:
        return str(orjson.loads(content)["error"].get("code"))
    except Exception:  # Serve's own proxy answers some refusals in plain text
        return "(plain text)"


def summary(values: list[float]) -> dict:
    """n, p50, p90, p99 and mean of the values that are not None (all None when there are none)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"n": len(values), "p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


class Progress:
    """A progress line on stderr: done of total, elapsed, an estimate of what is left, a note."""

    def __init__(self, total: float, label: str, every_s: float = 5.0):
        self.total, self.label, self.every_s = total, label, every_s
        self.started = time.monotonic()
        self.last = 0.0

    def update(self, done: float, note: str = "", force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        elapsed = now - self.started
        left = elapsed * (self.total - done) / done if done else float("nan")
        pct = 100 * done / self.total if self.total else 100
        print(
            f"  [{self.label}] {done:.0f}/{self.total:.0f} ({pct:.0f}%), {elapsed:.0f} s elapsed, ~{left:.0f} s left"
            + (f"; {note}" if note else ""),
            file=sys.stderr,
            flush=True,
        )


async def closed_loop(clients: int, seconds: float, call, label: str) -> tuple[list, float]:
    """``clients`` clients, each awaiting ``call(client, i)`` one after another for ``seconds``,
    with a progress line. A call begun before the end runs to its end; the time returned
    includes it. Returns every call's result and that time."""
    rows: list = []
    progress, started = Progress(seconds, label, every_s=10), time.perf_counter()

    async def client(c: int) -> None:
        i = 0
        while time.perf_counter() - started < seconds:
            rows.append(await call(c, i))
            i += 1
            progress.update(min(seconds, time.perf_counter() - started), f"{len(rows)} done")

    await asyncio.gather(*(client(c) for c in range(clients)))
    return rows, time.perf_counter() - started


def pyplot():
    """matplotlib's pyplot on a file backend, or None (with a hint) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return None
    return plt


def start_all(servers: list[Server], stack: ExitStack) -> None:
    """Start the servers side by side (start-up is mostly waiting), each stopped by ``stack``."""
    for server in servers:
        print(f"starting {server.name} (log: {server.log_path})", flush=True)
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(server.__enter__) for server in servers]
        wait(futures)
    for server in servers:
        if server.proc is not None:
            stack.push(server)
    for future in futures:
        future.result()  # the first failure, once every server is in the stack


LITELLM_VENV = ROOT / "benchmarks" / "results" / "litellm-venv"
LITELLM_SPEC = "litellm[proxy]"


def litellm_bin(install: bool) -> Path | None:
    """LiteLLM's CLI from its own virtualenv (made on first use), or None."""
    cli = LITELLM_VENV / "bin" / "litellm"
    if cli.exists() or not install:
        return cli if cli.exists() else None
    print(f"installing {LITELLM_SPEC} into {LITELLM_VENV} (once; about 2 minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
    done = subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", LITELLM_SPEC])
    return cli if done.returncode == 0 and cli.exists() else None


def litellm_server(cli: Path, model: str, provider_model: str, api_base: str, port: int, out_dir: Path) -> Server:
    """LiteLLM's proxy serving ``model`` as ``provider_model`` at ``api_base``, without a key
    (like the gateway's auth-off loopback mode, so neither pays for auth)."""
    config = out_dir / "litellm.yaml"
    entry = {"model_name": model, "litellm_params": {"model": provider_model, "api_base": api_base, "api_key": "none"}}
    config.write_text(yaml.safe_dump({"model_list": [entry]}))
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
    }
    cmd = [str(cli), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    return Server("litellm", cmd, env, port, out_dir)


HANDBOOK = (
    "Acme handbook. Every employee gets 27 vacation days per year. Vacation requests go to your "
    "manager two weeks ahead. The office is open from 8 to 18 on weekdays. Expenses are refunded "
    "within 30 days of the receipt being filed in the expense tool."
)


def seed_docs(url: str) -> str:
    """The `docs` vector store the default model's retrieval policy names, with one small file."""
    with httpx.Client(base_url=url, timeout=60) as http:
        file = http.post(
            "/v1/files", files={"file": ("handbook.md", HANDBOOK.encode())}, data={"purpose": "assistants"}
        )
        file.raise_for_status()
        store = http.post("/v1/vector_stores", json={"name": "docs", "file_ids": [file.json()["id"]]})
        store.raise_for_status()
        for _ in range(60):
            counts = http.get(f"/v1/vector_stores/{store.json()['id']}").json()["file_counts"]
            if counts["in_progress"] == 0:
                return f"{counts['completed']} file indexed"
            time.sleep(1)
    return "file still indexing"


def gateway_stage_means(session_dir: Path = Path("/tmp/ray/session_latest")) -> dict[str, tuple[float, int]]:
    """The gateway's own latency series from the Ray node's metrics endpoint (the gateway under
    test must be the only Ray instance here): ``series{label}`` -> (total ms, count), for
    the stages seen from the ingress, each rail inside the guardrails replica, the overhead
    header's histogram and the embedding batcher. Subtract two snapshots for one phase."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "ray_gateway_stage_latency_ms": "stage",
        "ray_gateway_rail_latency_ms": "rail",
        "ray_gateway_overhead_ms": "model",
        "ray_gateway_stream_overhead_per_token_ms": "model",
        "ray_serve_batch_execution_time_ms": "deployment",
        "ray_serve_batch_wait_time_ms": "deployment",
    }
    out: dict[str, list[float]] = {}
    for port_file in session_dir.glob("metrics_export_port_*"):
        text = httpx.get(f"http://127.0.0.1:{port_file.read_text().strip()}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            label = wanted.get(family.name)
            if label is None:
                continue
            for s in family.samples:
                if s.name.endswith(("_sum", "_count")):
                    key = f"{family.name.removeprefix('ray_')}{{{s.labels.get(label, '')}}}"
                    row = out.setdefault(key, [0.0, 0])
                    row[0 if s.name.endswith("_sum") else 1] += s.value
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def stage_means_table(before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]]) -> str:
    """Mean ms per observation of each series between two ``gateway_stage_means`` snapshots."""
    lines = [f"{'series (gateway metrics, this phase)':<58} {'n':>6} {'mean ms':>8}"]
    for key in sorted(after):
        total = after[key][0] - before.get(key, (0.0, 0))[0]
        n = after[key][1] - before.get(key, (0.0, 0))[1]
        if n > 0:
            lines.append(f"{key:<58} {n:>6} {total / n:>8.2f}")
    return "\n".join(lines)
