"""API keys as named principals: every route behind the check, scopes, model lists, rotation
without a restart, and no key in any log."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import ROOT, write_keys_file

ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/v1/models/scripted"),
    ("GET", "/v1/admin/config"),
    ("GET", "/openapi.json"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/files"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files/file-x"),
    ("GET", "/v1/files/file-x/content"),
    ("DELETE", "/v1/files/file-x"),
    ("GET", "/v1/vector_stores"),
    ("POST", "/v1/vector_stores"),
    ("GET", "/v1/vector_stores/vs_x"),
    ("POST", "/v1/vector_stores/vs_x"),
    ("DELETE", "/v1/vector_stores/vs_x"),
    ("GET", "/v1/vector_stores/vs_x/files"),
    ("POST", "/v1/vector_stores/vs_x/files"),
    ("GET", "/v1/vector_stores/vs_x/files/file-x"),
    ("DELETE", "/v1/vector_stores/vs_x/files/file-x"),
    ("POST", "/v1/vector_stores/vs_x/search"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/resp_x"),
    ("DELETE", "/v1/responses/resp_x"),
    ("GET", "/v1/responses/resp_x/input_items"),
]


# The only routes that answer without a key: liveness and readiness (load balancers carry no
# key; they name models and their states only), and the chat page's static files (the page
# sends the user's key itself; `/` redirects to it).
PUBLIC = [
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/"),
    ("GET", "/chat"),
    ("GET", "/chat/chat.js"),
    ("GET", "/chat/chat.css"),
]


def test_every_route_needs_a_key(gateway_url):
    # Every route the app serves is in the list above (or public), so a new route cannot
    # slip past this test.
    from gateway.http import PUBLIC_PATHS

    served = {(m, r.path) for r in _app_routes() for m in r.methods if m != "HEAD"}
    listed = {
        (
            m,
            p.replace("scripted", "{model_id:path}")
            .replace("vs_x", "{store_id}")
            .replace("file-x", "{file_id}")
            .replace("resp_x", "{response_id}"),
        )
        for m, p in ROUTES
    }
    assert served - listed == set(PUBLIC), served - listed
    assert PUBLIC_PATHS == {p for _, p in PUBLIC}
    for method, path in PUBLIC:
        assert httpx.request(method, gateway_url + path, timeout=10).status_code in (200, 307), path
    for method, path in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "Basic abc"}):
            r = httpx.request(method, gateway_url + path, headers=headers, json={}, timeout=10)
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(gateway_url + "/health").status_code == 200


def _app_routes():
    import gateway.ingress  # noqa: F401  (its class body registers the routes on the app)
    from gateway.http import app

    return [r for r in app.routes if hasattr(r, "methods")]


def test_a_key_sees_only_its_models(tenant):
    carol = tenant("carol")
    assert [m.id for m in carol.models.list().data] == ["scripted"]
    with pytest.raises(openai.NotFoundError) as err:
        carol.chat.completions.create(model="scripted-b", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        carol.models.retrieve("scripted-b")
    with pytest.raises(openai.NotFoundError):
        carol.embeddings.create(model="all-MiniLM-L6-v2", input="hi")
    assert carol.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}]).choices


def test_documents_need_the_documents_scope(tenant):
    carol = tenant("carol")
    with pytest.raises(openai.PermissionDeniedError) as err:
        carol.vector_stores.list()
    assert err.value.body["code"] == "insufficient_permissions"
    with pytest.raises(openai.PermissionDeniedError):
        carol.files.create(file=("a.txt", b"hello"), purpose="assistants")


def test_a_key_rotates_without_a_restart(gateway_url, tenant_keys):
    from gateway.auth import new_key

    keys = tenant_keys["keys"]
    old, new = keys["bob"][-1], new_key()

    def status(key: str) -> int:
        return httpx.get(gateway_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

    assert status(old) == 200 and status(new) == 401
    keys["bob"] = [old, new]
    write_keys_file(tenant_keys["path"], keys)
    _eventually(lambda: status(new) == 200)
    assert status(old) == 200  # both work while clients move over
    keys["bob"] = [new]
    write_keys_file(tenant_keys["path"], keys)
    _eventually(lambda: status(old) == 401)
    assert status(new) == 200
    # A broken file keeps the last good keys rather than locking everyone out.
    tenant_keys["path"].write_text("principals: [{name: bob, key_sha256: nothex}]\n")
    time.sleep(2.5)
    assert status(new) == 200
    write_keys_file(tenant_keys["path"], keys)


def test_no_key_reaches_the_logs(gateway_url, tenant_keys):
    wrong = "sk-wrong-" + "z" * 30
    httpx.get(gateway_url + "/v1/models", headers={"Authorization": f"Bearer {wrong}"})
    logs = Path("/tmp/ray/session_latest/logs")
    text = "\n".join(
        p.read_text(errors="replace") for p in logs.glob("*") if p.is_file() and p.stat().st_size < 50_000_000
    )
    assert text, "no Ray logs found"
    for key in [wrong] + [k for ks in tenant_keys["keys"].values() for k in ks]:
        assert key not in text


def test_auth_off_is_for_loopback_only(tmp_path):
    from engines.config import ConfigError
    from gateway.config import load_config

    (tmp_path / "m.yaml").write_text("model_id: m\nsource: {path: /x}\n")
    (tmp_path / "gateway.yaml").write_text("models: [m.yaml]\nauth: {api_keys_env: GATEWAY_NO_SUCH_VARIABLE}\n")
    load_config(tmp_path / "gateway.yaml").check_auth()  # 127.0.0.1: allowed, with a warning at run
    with pytest.raises(ConfigError, match="not a loopback address"):
        load_config(tmp_path / "gateway.yaml", host="0.0.0.0").check_auth()
    load_config(
        tmp_path / "gateway.yaml", host="0.0.0.0", auth={"api_keys_env": None, "allow_unauthenticated": True}
    ).check_auth()
    # The CLI refuses before starting anything.
    run = subprocess.run(
        [sys.executable, "-m", "gateway", "run", "--config", str(tmp_path / "gateway.yaml"), "--host", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "not a loopback address" in run.stderr


def test_keys_file_errors_name_the_key(tmp_path):
    from gateway.auth import KeyRing, key_digest

    path = tmp_path / "keys.yaml"
    path.write_text("principals: [{name: a, key_sha256: abc}]\n")
    with pytest.raises(ValueError, match="key_sha256"):
        KeyRing(path, None)
    path.write_text(f"principals: [{{name: a, key_sha256: {key_digest('k')}, scopes: [root]}}]\n")
    with pytest.raises(ValueError, match="scopes"):
        KeyRing(path, None)
    path.write_text(f"principals: [{{name: a, key_sha256: {key_digest('k')}}}]\n")
    ring = KeyRing(path, None)
    assert ring.authenticate("Bearer k").name == "a"
    assert not ring.authenticate("Bearer k").admin


def test_with_auth_off_only_loopback_callers_are_served():
    """Behind Serve's HAProxy the ingress replicas' own ports listen on every interface: with no
    keys, a caller from another host is refused, whatever it sends."""
    from gateway.auth import LOCAL, KeyRing
    from gateway.errors import APIError

    ring = KeyRing(None, None)
    assert not ring.enabled
    for peer in ("127.0.0.1", "::1", "127.0.0.53"):
        assert ring.authenticate(None, peer).name == LOCAL
    for peer in ("10.0.0.7", "192.168.1.20", "::ffff:10.0.0.7", None, "testclient"):
        with pytest.raises(APIError) as err:
            ring.authenticate("Bearer anything", peer)
        assert err.value.status == 401
    # The operator said anyone may call it (auth.allow_unauthenticated).
    assert KeyRing(None, None, loopback_only=False).authenticate(None, "10.0.0.7").name == LOCAL


def _eventually(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.2)
