"""Real tier: the gateway started the way `make run` starts it, serving SmolLM2-135M-Instruct
through Ray Serve LLM and vLLM on CPU, driven with the official openai SDK.

The gateway boots once for the whole module (about 90 s on 2 cores).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.real
MODEL = "SmolLM2-135M-Instruct"
BOOT_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def real_gateway():
    port = free_port()
    log_path = ROOT / ".data" / "real-tier-gateway.log"
    log_path.parent.mkdir(exist_ok=True)
    log = open(log_path, "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("GATEWAY_API_KEYS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "run", "--config", "configs/gateway.yaml", "--port", str(port)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    try:
        while True:
            assert proc.poll() is None, f"gateway exited with {proc.returncode}; see {log_path}"
            assert time.monotonic() < deadline, f"gateway not ready after {BOOT_TIMEOUT_S}s; see {log_path}"
            if "gateway ready" in log_path.read_text():
                break
            time.sleep(2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture
def client(real_gateway):
    return openai.OpenAI(base_url=real_gateway + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_capital_of_france(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=30
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_stream_deltas_and_final_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write two sentences about the sea."}], temperature=0,
        max_tokens=48, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 5
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    # vLLM counts the end-of-sequence token, which carries no text.
    eos = 1 if finish == "stop" else 0
    assert final.usage.completion_tokens == len(deltas) + eos
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens


def test_eight_concurrent_streams_have_correct_framing(real_gateway):
    def run(i: int) -> tuple[int, list[str]]:
        body = {"model": MODEL, "stream": True, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}]}
        with httpx.stream("POST", real_gateway + "/v1/chat/completions", json=body, timeout=300) as r:
            return r.status_code, [e for e in "".join(r.iter_text()).split("\n\n") if e]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for status, events in results:
        assert status == 200
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]" and sum(e == "data: [DONE]" for e in events) == 1
        assert not any('"error"' in e for e in events)
        assert any('"finish_reason":"' in e for e in events[:-1])


def test_completions(client):
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert "Paris" in reply.choices[0].text


def test_engine_validation_error_is_openai_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)
    assert err.value.body["param"] == "max_tokens"
