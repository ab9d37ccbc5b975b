"""Bad input gets an OpenAI error body and the right 4xx; engine failures end cleanly."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import API_KEY

ERROR_KEYS = {"message", "type", "param", "code"}


def assert_error(r: httpx.Response, status: int, code: str | None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    assert body["error"]["code"] == code
    if param is not None:
        assert body["error"]["param"] == param
    assert body["error"]["message"]
    return body["error"]


def test_invalid_json(http):
    r = http.post(
        "/v1/chat/completions",
        content=b'{"model": "scripted", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_error(r, 400, "invalid_json")


def test_body_not_an_object(http):
    assert_error(http.post("/v1/chat/completions", json=[1, 2]), 400, "invalid_json")


def test_missing_model(http):
    assert_error(
        http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
        400,
        "missing_required_parameter",
        "model",
    )


def test_empty_messages(http):
    assert_error(
        http.post("/v1/chat/completions", json={"model": "scripted", "messages": []}), 400, "invalid_value", "messages"
    )


def test_unknown_role(http):
    r = http.post("/v1/chat/completions", json={"model": "scripted", "messages": [{"role": "wizard", "content": "x"}]})
    assert_error(r, 400, "invalid_value", "messages[0].role")


@pytest.mark.parametrize("content", [{"a": 1}, [{"type": "text"}], [1, 2], 123])
def test_malformed_message_content(http, content):
    r = http.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": [{"role": "user", "content": content}]}
    )
    assert_error(r, 400, "invalid_value")


def test_wrong_field_type(http):
    r = http.post(
        "/v1/chat/completions",
        json={"model": "scripted", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
    )
    assert_error(r, 400, "invalid_value", "temperature")


def test_engine_rejects_out_of_range_value_as_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "[[reject]]"}])
    assert err.value.status_code == 400
    assert "out of range" in err.value.body["message"] and err.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_completions_missing_prompt(http):
    assert_error(http.post("/v1/completions", json={"model": "scripted"}), 400, "missing_required_parameter", "prompt")


def test_body_too_large_is_413(http):
    big = "x" * 70_000  # the fast-tier config allows 65536 bytes
    r = http.post("/v1/chat/completions", json={"model": "scripted", "messages": [{"role": "user", "content": big}]})
    assert_error(r, 413, "request_too_large")


def test_body_too_large_without_content_length_is_413(http):
    def chunks():
        yield b'{"model": "scripted", "messages": [{"role": "user", "content": "'
        for _ in range(80):
            yield b"y" * 1000
        yield b'"}]}'

    assert_error(http.post("/v1/chat/completions", content=chunks()), 413, "request_too_large")


def test_unknown_url_and_method(http):
    assert_error(http.get("/v1/nothing-here"), 404, "unknown_url")
    assert_error(http.get("/v1/chat/completions"), 405, "method_not_allowed")


def test_wrong_api_key_is_401(gateway_url):
    r = httpx.post(gateway_url + "/v1/chat/completions", json={}, headers={"Authorization": "Bearer wrong"})
    assert_error(r, 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway_url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_engine_failure_mid_stream_ends_with_error_event_and_done(http, client):
    body = {
        "model": "scripted",
        "stream": True,
        "messages": [{"role": "user", "content": "[[tokens:10]] [[fail-after:3]]"}],
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        text = "".join(r.iter_text())
    events = [e for e in text.split("\n\n") if e]
    assert '"content":" t2"' in events[-3]
    assert events[-2].startswith('data: {"error"') and events[-1] == "data: [DONE]"
    # The SDK surfaces the error event as an exception after the text that did arrive.
    got = []
    with pytest.raises(openai.APIError):
        for chunk in client.chat.completions.create(**body):
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
    assert "".join(got) == "t0 t1 t2"


def test_client_disconnect_cancels_generation(gateway_url, engine_events):
    body = {
        "model": "scripted",
        "stream": True,
        "messages": [{"role": "user", "content": "[[tokens:400]] [[delay-ms:20]]"}],
    }
    with httpx.Client(base_url=gateway_url, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 6:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not engine_events("cancelled"):
        time.sleep(0.2)
    cancelled = engine_events("cancelled")
    assert cancelled, f"the engine was not cancelled: {engine_events()}"
    assert cancelled[0]["tokens"] < 400
    assert not engine_events("finished")


def test_dead_engine_is_503_then_recovers(client):
    """The replica process dies mid-request: 503 in OpenAI's shape, and Serve restarts it."""
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="scripted-b", messages=[{"role": "user", "content": "[[exit-process]]"}])
    assert err.value.status_code == 503
    assert err.value.body["code"] == "engine_unavailable"
    # The other model is unaffected.
    assert (
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
        .choices[0]
        .message.content
    )
    deadline = time.monotonic() + 90
    while True:
        try:
            client.chat.completions.create(model="scripted-b", messages=[{"role": "user", "content": "hi"}])
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            assert time.monotonic() < deadline, "scripted-b did not come back"
            time.sleep(1)
