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
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import _DRIVER_ONLY_ENV, ROOT, free_port

pytestmark = pytest.mark.real
MODEL = "SmolLM2-135M-Instruct"
BOOT_TIMEOUT_S = 600


class GatewayProcess:
    """`python -m gateway run`, as `make run` starts it, with its data in a temporary folder."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "gateway.yaml"
        text = (ROOT / "configs/gateway.yaml").read_text()
        text = text.replace("models/smollm2-135m-instruct.yaml", str(ROOT / "configs/models/smollm2-135m-instruct.yaml"))
        text = text.replace("../.data/retrieval", str(workdir / "retrieval"))
        self.config.write_text(text + f"models_dir: {os.environ.get('GATEWAY_MODELS_DIR', ROOT / '.models')}\n")
        self.log_path = workdir / "gateway.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # Exactly `make run`'s environment: without the settings only this test process needs.
        env = {k: v for k, v in os.environ.items() if k not in _DRIVER_ONLY_ENV}
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("GATEWAY_API_KEYS", None)
        self.log = open(self.log_path, "a")
        offset = self.log_path.stat().st_size
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(self.config), "--port", str(self.port)],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"gateway exited with {self.proc.returncode}; see {self.log_path}"
            assert time.monotonic() < deadline, f"gateway not ready after {BOOT_TIMEOUT_S}s; see {self.log_path}"
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                if b"gateway ready" in f.read():
                    return
            time.sleep(2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def gateway_process(tmp_path_factory):
    gateway = GatewayProcess(tmp_path_factory.mktemp("real-gateway"))
    gateway.start()
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def real_gateway(gateway_process) -> str:
    return gateway_process.url


@pytest.fixture
def client(real_gateway):
    return openai.OpenAI(base_url=real_gateway + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "all-MiniLM-L6-v2"]


def test_capital_of_france(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=30
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0


def test_stream_deltas_and_final_usage(client):
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=48, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 5
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    # The output rail re-chunks text (it releases what it has checked), so deltas are not
    # tokens; the same greedy request answered whole must carry the same text and counts.
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48)
    assert "".join(deltas) == whole.choices[0].message.content
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


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


FACT_DOC = (
    "Project Nimbus facts.\nThe launch code for Project Nimbus is BLUE-HERON-42.\n"
    "Project Nimbus is led by Dr. Amara Okafor and launches from the Kestrel Bay site."
)


def test_uploaded_fact_reaches_the_answer(client):
    """The model cannot know this fact; it answers it only from the retrieved passage."""
    store = client.vector_stores.create(name="docs")  # the collection the model's policy names
    uploaded = client.files.create(file=("nimbus.md", FACT_DOC.encode()), purpose="assistants")
    assert client.vector_stores.files.create(vector_store_id=store.id, file_id=uploaded.id).status == "completed"
    question = [{"role": "user", "content": "What is the launch code for Project Nimbus?"}]
    with_docs = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=40)
    assert "BLUE-HERON-42" in with_docs.choices[0].message.content
    without = client.chat.completions.create(
        model=MODEL, messages=question, temperature=0, max_tokens=40, extra_body={"retrieval": {"enabled": False}}
    )
    assert "BLUE-HERON-42" not in without.choices[0].message.content


def test_input_rail_blocks_a_card_number(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "charge 4111 1111 1111 1111"}])
    assert err.value.body["code"] == "pii_blocked"


def test_vector_stores_survive_a_full_restart(gateway_process, client):
    """Ingest, restart the whole gateway (Ray included), search again: the same results."""
    store = client.vector_stores.create(name="restart-check")
    for name, text in {"a.md": "Otters hold hands while they sleep.", "b.md": "Basalt forms from cooling lava."}.items():
        f = client.files.create(file=(name, text.encode()), purpose="assistants")
        client.vector_stores.files.create(vector_store_id=store.id, file_id=f.id)
    before = client.vector_stores.search(vector_store_id=store.id, query="sleeping otters").model_dump()
    gateway_process.stop()
    gateway_process.start()
    fresh = openai.OpenAI(base_url=gateway_process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    after = fresh.vector_stores.search(vector_store_id=store.id, query="sleeping otters").model_dump()
    assert after == before and after["data"][0]["filename"] == "a.md"
    assert fresh.vector_stores.retrieve(store.id).file_counts.completed == 2
