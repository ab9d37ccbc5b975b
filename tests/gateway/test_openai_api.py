"""The OpenAI surface through the official SDK, on the real Serve app + scripted engine."""

from __future__ import annotations

import concurrent.futures

import pytest
from openai import NotFoundError

USER = [{"role": "user", "content": "hello there"}]


def test_models_list_and_retrieve(client):
    ids = sorted(m.id for m in client.models.list().data)
    assert ids == ["all-MiniLM-L6-v2", "gpt-4o-mini", "scripted", "scripted-b", "scripted-guarded"]
    model = client.models.retrieve("scripted")
    assert (model.id, model.object, model.owned_by) == ("scripted", "model", "ray-llm-gateway")
    with pytest.raises(NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


def test_chat_non_streaming_has_openai_shape(client, http):
    reply = client.chat.completions.create(model="scripted", messages=USER)
    assert reply.choices[0].message.content == "echo: hello there"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 3
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    raw = http.post("/v1/chat/completions", json={"model": "scripted", "messages": USER}).json()
    # Nulls OpenAI's schema does not allow (vLLM extras, object-typed fields) are gone;
    # the fields it requires even when null are there.
    assert set(raw) == {"id", "object", "created", "model", "choices", "usage"}
    assert raw["object"] == "chat.completion"
    choice = raw["choices"][0]
    assert choice["logprobs"] is None and "stop_reason" not in choice
    assert choice["message"] == {"role": "assistant", "content": "echo: hello there", "refusal": None}


def test_chat_routes_by_model(client, engine_events):
    client.chat.completions.create(model="scripted-b", messages=USER)
    started = engine_events("started")
    assert len(started) == 1


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model="scripted",
        messages=[{"role": "user", "content": "[[tokens:7]]"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(content) == "t0 t1 t2 t3 t4 t5 t6"
    assert len(content) == 7
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 7
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_framing_ends_with_single_done(http):
    body = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "[[tokens:3]]"}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and text.count("[DONE]") == 1


def test_max_tokens_truncates_with_length(client):
    reply = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "[[tokens:20]]"}], max_tokens=4
    )
    assert reply.choices[0].message.content == "t0 t1 t2 t3"
    assert reply.choices[0].finish_reason == "length"


def test_openai_fields_pass_through_to_engine(client, engine_events):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    client.chat.completions.create(
        model="scripted",
        messages=USER,
        seed=7,
        stop=["END"],
        temperature=0.3,
        top_p=0.9,
        n=1,
        logprobs=True,
        top_logprobs=2,
        tools=tools,
        response_format={"type": "json_object"},
        presence_penalty=0.5,
        user="u-1",
    )
    fields = engine_events("started")[0]["fields"]
    assert fields["seed"] == 7 and fields["stop"] == ["END"] and fields["temperature"] == 0.3
    assert fields["top_p"] == 0.9 and fields["logprobs"] is True and fields["top_logprobs"] == 2
    assert fields["tools"][0]["function"]["name"] == "lookup"
    assert fields["response_format"]["type"] == "json_object"
    assert fields["presence_penalty"] == 0.5


def test_completions_non_streaming_and_streaming(client):
    reply = client.completions.create(model="scripted", prompt="[[say:once upon a time]]")
    assert reply.choices[0].text == "once upon a time"
    assert reply.object == "text_completion"
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model="scripted", prompt="[[tokens:4]]", stream=True)
        if c.choices
    ]
    assert "".join(pieces) == "t0 t1 t2 t3"


def test_eight_concurrent_streams_all_complete(client):
    def run(i: int) -> str:
        stream = client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": f"[[tokens:{10 + i}]] [[delay-ms:5]]"}], stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for i, text in enumerate(results):
        assert text.split() == [f"t{k}" for k in range(10 + i)]


def test_health(gateway_url):
    import httpx

    r = httpx.get(gateway_url + "/health")  # no API key needed for probes
    assert r.status_code == 200 and r.json()["status"] == "ok"
