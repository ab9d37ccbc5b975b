"""CORS: pages from an allowed origin may call the API from a browser; others get no
``Access-Control-Allow-Origin``. The fast tier allows one origin (tests/fixtures/gateway.yaml)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import API_KEY, ROOT

ALLOWED = "http://allowed.example:3000"
OTHER = "http://evil.example"


def _preflight(gateway_url: str, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    # What a browser sends before a cross-origin POST with a key and a JSON body: no key.
    return httpx.options(
        gateway_url + path,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=10,
    )


def test_preflight_from_an_allowed_origin(gateway_url):
    r = _preflight(gateway_url, ALLOWED)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed_headers = r.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers and "content-type" in allowed_headers
    assert r.headers["access-control-max-age"] == "600"
    assert "access-control-allow-credentials" not in r.headers  # off by default
    assert "origin" in r.headers["vary"].lower()


def test_preflight_from_another_origin_is_not_allowed(gateway_url):
    r = _preflight(gateway_url, OTHER)
    assert "access-control-allow-origin" not in r.headers
    assert r.status_code == 400


def test_actual_requests_carry_the_header_for_allowed_origins_only(gateway_url):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(gateway_url + "/v1/models", headers={**auth, "Origin": ALLOWED}, timeout=10)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ALLOWED
    # A cross-origin page can read the retrieval sources of an answer.
    assert "x-retrieval-sources" in r.headers["access-control-expose-headers"].lower()
    # Errors too, so the page can show OpenAI's error body instead of an opaque failure.
    denied = httpx.get(gateway_url + "/v1/models", headers={"Origin": ALLOWED}, timeout=10)
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ALLOWED
    other = httpx.get(gateway_url + "/v1/models", headers={**auth, "Origin": OTHER}, timeout=10)
    assert other.status_code == 200  # CORS is the browser's rule; the key is the gateway's
    assert "access-control-allow-origin" not in other.headers


def test_streaming_answers_carry_the_header(gateway_url):
    body = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "[[say:a b c]]"}]}
    headers = {"Authorization": f"Bearer {API_KEY}", "Origin": ALLOWED}
    with httpx.stream("POST", gateway_url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ALLOWED
        assert "data: [DONE]" in r.read().decode()


def test_options_without_a_preflight_is_still_not_a_route(gateway_url):
    # Only a real preflight is answered without a key; OPTIONS itself opens nothing.
    r = httpx.options(gateway_url + "/v1/models", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_cors_config_is_checked_at_load(tmp_path):
    from engines.config import ConfigError
    from gateway.config import load_config

    models = ROOT / "tests" / "fixtures" / "scripted.yaml"

    def load(cors: str):
        path = tmp_path / "gateway.yaml"
        path.write_text(f"models: [{models}]\ncors: {cors}\n")
        return load_config(path)

    with pytest.raises(ConfigError, match=r"cannot be combined with allow_credentials"):
        load('{allow_origins: ["*"], allow_credentials: true}')
    with pytest.raises(ConfigError, match=r"cannot be combined with allow_credentials"):
        load('{allow_origins: ["https://app.example"], allow_headers: ["*"], allow_credentials: true}')
    with pytest.raises(ConfigError, match=r"cors\.allow_origins.*not an origin"):
        load('{allow_origins: ["https://app.example/"]}')
    with pytest.raises(ConfigError, match=r"cors\.allow_origin\b.*Extra inputs"):
        load('{allow_origin: ["https://app.example"]}')
    assert load('{allow_origins: ["*"]}').gateway.cors.enabled
    assert load('{allow_origins: ["https://app.example"], allow_credentials: true}').gateway.cors.allow_credentials
    # Off unless configured: the shipped config allows no other origin.
    assert not load_config(ROOT / "configs" / "gateway.yaml").gateway.cors.enabled
