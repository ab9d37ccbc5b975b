"""Shared fixtures.

Fast tier: the real Ray Serve application (our ingress, Ray Serve LLM's ``LLMServer``)
with the deterministic ``ScriptedEngine`` injected through ``engine_cls``, started once
per session in this process's Ray instance.
Real tier (``-m real``): the gateway started exactly as ``make run`` starts it, in a
subprocess, serving SmolLM2 through vLLM; see tests/test_real_vllm.py.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest

from gateway.__main__ import RAY_ENV_DEFAULTS

# The same Ray settings as `python -m gateway run`, so the fast tier tests the Serve mode
# production runs. Set before any test module imports Ray: Serve reads them when its
# modules load, in this driver as well as in every process Ray starts.
for _key, _value in RAY_ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)
# That mode (direct ingress) holds every stopping ingress replica, the engines' included, open
# for 30 s so load balancers can deregister it, which made each `serve.delete` and replica
# replacement here cost 31 s. Nothing balances load in front of the tests: 2 s is enough.
# The drain still waits for requests in flight.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
# Tests call deployment handles synchronously (`.remote().result()`), which Serve allows only
# with the router on its own event loop. This process reads the setting now, as pytest
# imports Ray; `ray_session` removes it before Ray starts, so every Ray process runs the
# production mode.
_DRIVER_ONLY_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}
_DRIVER_ONLY_ENV = {k: v for k, v in _DRIVER_ONLY_ENV.items() if k not in os.environ}
os.environ.update(_DRIVER_ONLY_ENV)
# Serve reads it when its modules load: load them now, while it is set.
import ray.serve  # noqa: E402,F401

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
API_KEY = "test-key-fast-tier"  # the operator's key (every scope), from the environment
API_KEYS_ENV = "GATEWAY_TEST_API_KEYS"
# Tenants, from the keys file: (scopes, models) by name; their keys are made per session.
TENANTS = {
    "alice": (["chat", "documents"], ["*"]),
    "bob": (["chat", "documents"], ["*"]),
    "carol": (["chat"], ["scripted"]),
}


def pytest_collection_modifyitems(config, items):
    # `make test` runs the ``offline`` tests in a second, niced process beside the rest: they
    # must not need the session's Ray instance, and they get no CPU while the rest need it.
    for item in items:
        if item.get_closest_marker("offline") and "ray_session" in item.fixturenames:
            raise pytest.UsageError(f"{item.nodeid} is marked offline but uses the session's Ray instance")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # Set before Ray starts so every replica inherits it.
    os.environ[API_KEYS_ENV] = f"operator={API_KEY}"
    for key in _DRIVER_ONLY_ENV:
        os.environ.pop(key, None)
    # The dashboard carries Serve's REST API, which `gateway apply` (the production path) uses.
    dashboard_port = free_port()
    ray.init(
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
        num_cpus=4,
        logging_level="WARNING",
    )
    from ray import serve

    # Start Serve on a free port before any test deploys (serve.run would pick 8000).
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    os.environ["RAY_DASHBOARD_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"
    yield port
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def recorder(ray_session):
    from engines.scripted_engine import RECORDER_NAME, RECORDER_NAMESPACE, EngineRecorder

    return EngineRecorder.options(name=RECORDER_NAME, namespace=RECORDER_NAMESPACE, lifetime="detached").remote()


def write_keys_file(path: Path, keys: dict[str, list[str]]) -> None:
    """The keys file for ``TENANTS``, each principal with the given keys (rotation: several)."""
    import yaml

    from gateway.auth import key_digest

    principals = [
        {"name": name, "key_sha256": [key_digest(k) for k in keys[name]], "scopes": scopes, "models": models}
        for name, (scopes, models) in TENANTS.items()
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"principals": principals}))
    os.replace(tmp, path)


@pytest.fixture(scope="session")
def tenant_keys(tmp_path_factory) -> dict:
    """The keys file the fast-tier gateway reads, and each tenant's current key."""
    from gateway.auth import new_key

    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = {name: [new_key()] for name in TENANTS}
    write_keys_file(path, keys)
    return {"path": path, "keys": keys}


SCRIPTED_ENGINE = "engines.scripted_engine:ScriptedEngine"


class FastGateway:
    """The fast tier's gateway config (a copy tests may edit) and how to apply it, exactly as
    `python -m gateway apply` does: through Serve's REST API."""

    def __init__(self, configs: Path, port: int, overrides: dict):
        self.configs = configs
        self.port = port
        self.overrides = overrides

    def load(self):
        from gateway.config import load_config

        return load_config(self.configs / "gateway.yaml", port=self.port, **self.overrides)

    def apply(self):
        """Apply the files as they are now; returns the plan. Raises ConfigError if invalid."""
        from gateway.deploy import apply

        return apply(self.load(), engine_cls=SCRIPTED_ENGINE, timeout_s=600)


@pytest.fixture(scope="session")
def fast_gateway(ray_session, recorder, tenant_keys, tmp_path_factory) -> FastGateway:
    port = ray_session
    storage = tmp_path_factory.mktemp("retrieval")
    # A copy, so tests can edit model files and apply them to the running gateway.
    configs = tmp_path_factory.mktemp("configs")
    for f in FIXTURES.glob("*.yaml"):
        (configs / f.name).write_text(f.read_text())
    overrides = {
        "auth": {"api_keys_env": API_KEYS_ENV, "keys_file": str(tenant_keys["path"])},
        "retrieval": {"storage_dir": str(storage)},
    }
    gateway = FastGateway(configs, port, overrides)
    gateway.apply()
    return gateway


@pytest.fixture(scope="session")
def gateway_url(fast_gateway) -> str:
    """Base URL of the fast-tier gateway (scripted engine, real Serve apps)."""
    return f"http://127.0.0.1:{fast_gateway.port}"


@pytest.fixture
def model_file(fast_gateway):
    """Edit a fast-tier model file and apply it (``gateway apply``); the original comes back
    (and is applied) afterwards. Raises ConfigError, changing nothing, if the edit is invalid."""
    edited: dict[Path, str] = {}

    def edit(name: str, text: str):
        path = fast_gateway.configs / name
        edited.setdefault(path, path.read_text())
        path.write_text(text)
        return fast_gateway.apply()

    yield edit
    for path, text in edited.items():
        path.write_text(text)
    if edited:
        fast_gateway.apply()


@pytest.fixture
def client(gateway_url):
    from openai import OpenAI

    return OpenAI(base_url=gateway_url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.fixture
def tenant(gateway_url, tenant_keys):
    """An openai client for a tenant of the keys file: ``tenant("alice")``."""
    from openai import OpenAI

    def make(name: str):
        return OpenAI(base_url=gateway_url + "/v1", api_key=tenant_keys["keys"][name][-1], max_retries=0, timeout=30)

    return make


@pytest.fixture
def http(gateway_url):
    import httpx

    with httpx.Client(base_url=gateway_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        yield c


@pytest.fixture
def engine_events(recorder):
    """Read what the scripted engine saw during this test."""
    import ray

    ray.get(recorder.clear.remote())

    def events(kind: str | None = None) -> list[dict]:
        got = ray.get(recorder.get.remote())
        return [e for e in got if kind is None or e["event"] == kind]

    return events


@contextlib.contextmanager
def tidy_operator_client(gateway_url: str):
    """An operator's httpx client; the vector stores and files created while it is open (by a
    sweep or a fuzzer that cannot know what its requests made) are deleted when it closes."""
    import httpx

    def owned(c) -> dict[str, set[str]]:
        stores = c.get("/v1/vector_stores", params={"limit": 100}).json()["data"]
        files = c.get("/v1/files").json()["data"]
        return {"vector_stores": {s["id"] for s in stores}, "files": {f["id"] for f in files}}

    with httpx.Client(base_url=gateway_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        before = owned(c)
        yield c
        for kind, ids in owned(c).items():
            for ident in ids - before[kind]:
                c.delete(f"/v1/{kind}/{ident}")
