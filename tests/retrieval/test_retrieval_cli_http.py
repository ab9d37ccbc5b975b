"""The ingest CLI against the running fast-tier gateway over HTTP, as an operator runs it."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import API_KEY, ROOT


def run_cli(gateway_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "retrieval.cli", *args, "--base-url", gateway_url + "/v1", "--api-key", API_KEY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ingest_folder_then_search(gateway_url, tmp_path, client):
    (tmp_path / "sub").mkdir()
    (tmp_path / "tides.md").write_text("# Tides\n\nTides are caused by the gravitational pull of the moon.")
    (tmp_path / "sub" / "glass.txt").write_text("Glass is made by melting sand at high temperature.")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")  # not matched by the default globs
    done = run_cli(gateway_url, "ingest", str(tmp_path), "--store", "cli-docs", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "2 files" in done.stdout
    store = next(s for s in client.vector_stores.list().data if s.name == "cli-docs")
    assert store.file_counts.completed == 2
    found = run_cli(gateway_url, "search", "what makes the tides", "--store", "cli-docs")
    assert found.returncode == 0, found.stderr
    assert "tides.md" in found.stdout.splitlines()[0]  # the best hit comes first


def test_failed_file_makes_a_non_zero_exit(gateway_url, tmp_path):
    (tmp_path / "ok.md").write_text("A perfectly fine document.")
    (tmp_path / "broken.md").write_bytes(b"\xff\xfe\x00\x00 not utf-8 \x00\x81")
    done = run_cli(gateway_url, "ingest", str(tmp_path), "--store", "cli-broken", "--no-progress")
    assert done.returncode == 1
    assert "broken.md" in done.stderr
