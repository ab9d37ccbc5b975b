"""The real tier's gateway: `python -m gateway run` as `make run` starts it, with its keys,
gateway.yaml and model file copied to a temporary folder (see test_real_vllm.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from gateway.auth import key_digest, new_key
from tests.conftest import _DRIVER_ONLY_ENV, ROOT, free_port

MODEL = "SmolLM2-135M-Instruct"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
MODEL_FILE = "configs/models/smollm2-135m-instruct.yaml"
BOOT_TIMEOUT_S = 600
# name -> (scopes, models)
PRINCIPALS = {"operator": (["chat", "documents", "admin"], ["*"]), "tenant": (["chat"], [MODEL])}


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a watcher never reads half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class GatewayProcess:
    """`python -m gateway run`, as `make run` starts it, with its data in a temporary folder."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dashboard_port = free_port()
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.model_file = workdir / Path(MODEL_FILE).name
        self.model_file.write_text((ROOT / MODEL_FILE).read_text())
        self.keys_file = workdir / "keys.yaml"
        self.keys = {name: [new_key()] for name in PRINCIPALS}  # each principal's keys, newest last
        self.write_keys()
        config = yaml.safe_load((ROOT / "configs/gateway.yaml").read_text())
        config["models"] = [str(self.model_file)]
        config["retrieval"]["storage_dir"] = str(workdir / "retrieval")
        config["auth"] = {"keys_file": str(self.keys_file), "api_keys_env": None}
        config["models_dir"] = str(os.environ.get("GATEWAY_MODELS_DIR", ROOT / ".models"))
        self.config = workdir / "gateway.yaml"
        self.config.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "gateway.log"
        self.proc: subprocess.Popen | None = None
        self.boots = 0

    def write_keys(self) -> None:
        """The keys file for ``self.keys`` (replaced atomically; the gateway re-reads it)."""
        principals = [
            {"name": name, "key_sha256": [key_digest(k) for k in self.keys[name]], "scopes": scopes, "models": models}
            for name, (scopes, models) in PRINCIPALS.items()
        ]
        replace_file(self.keys_file, yaml.safe_dump({"principals": principals}))

    def start(self) -> None:
        # Exactly `make run`'s environment: without the settings only this test process needs.
        env = {k: v for k, v in os.environ.items() if k not in _DRIVER_ONLY_ENV}
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("GATEWAY_API_KEYS", None)
        self.log = open(self.log_path, "a")
        offset = self.log_path.stat().st_size
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "gateway", "run", "--config", str(self.config)),
                *("--port", str(self.port), "--dashboard-port", str(self.dashboard_port)),
            ],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.boots += 1
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"gateway exited with {self.proc.returncode}; see {self.log_path}"
            assert time.monotonic() < deadline, f"gateway not ready after {BOOT_TIMEOUT_S}s; see {self.log_path}"
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                if b"gateway ready" in f.read():
                    return
            time.sleep(2)

    def apply(self) -> str:
        """`python -m gateway apply` against this gateway, as an operator runs it; its output."""
        env = {k: v for k, v in os.environ.items() if k not in _DRIVER_ONLY_ENV}
        done = subprocess.run(
            [
                *(sys.executable, "-m", "gateway", "apply", "--config", str(self.config)),
                *("--port", str(self.port), "--address", self.dashboard),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()

    def metrics_url(self) -> str:
        """Where this gateway's Ray node exports metrics (vLLM's among them). Other Ray instances
        may run on the box, so not /tmp/ray/session_latest: the session of our own raylet."""
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getsid(int(pid)) != self.proc.pid:  # started with start_new_session
                    continue
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except (OSError, ProcessLookupError):
                continue
            session = next((a.split("=", 1)[1] for a in args if a.startswith("--session_dir=")), None)
            if session and "raylet" in args[0]:
                (port_file,) = Path(session).glob("metrics_export_port_*")
                return f"http://127.0.0.1:{port_file.read_text().strip()}/metrics"
        raise AssertionError(f"no raylet of gateway pid {self.proc.pid} found")
