"""Per-model request defaults, caps and aliases (the `requests:` and `aliases:` sections of
a model file), on the real Serve app. `scripted-b` has defaults max_tokens 5, temperature 0.3,
caps max_tokens 50, n 2, top_logprobs 2, stop 2, and the alias `gpt-4o-mini`."""

from __future__ import annotations

import openai
import pytest

from gateway.request_policy import RequestPolicy, apply

USER = [{"role": "user", "content": "[[tokens:40]]"}]


def test_defaults_fill_what_the_request_left_out(client, engine_events):
    reply = client.chat.completions.create(model="scripted-b", messages=USER)
    fields = engine_events("started")[0]["fields"]
    assert fields["max_tokens"] == 5 and fields["temperature"] == 0.3
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    # What the request sets wins (within the caps).
    client.chat.completions.create(model="scripted-b", messages=USER, max_completion_tokens=7, temperature=0.9)
    fields = engine_events("started")[1]["fields"]
    assert fields["max_completion_tokens"] == 7 and fields["temperature"] == 0.9 and "max_tokens" not in fields


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"max_tokens": 51}, "max_tokens"),
        ({"max_completion_tokens": 500}, "max_completion_tokens"),
        ({"n": 3}, "n"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop": "x" * 300}, "stop"),
    ],
)
def test_caps_refuse_with_a_400_naming_the_field(client, engine_events, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="scripted-b", messages=USER, **extra)
    assert err.value.body["param"] == param and err.value.body["code"] == "invalid_value"
    assert engine_events("started") == []


def test_completions_get_the_same_policy(client, engine_events):
    reply = client.completions.create(model="scripted-b", prompt="[[tokens:40]]")
    assert reply.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="scripted-b", prompt="x", logprobs=3)
    assert err.value.body["param"] == "logprobs"


def test_an_alias_resolves_and_is_listed(client, engine_events):
    assert "gpt-4o-mini" in [m.id for m in client.models.list().data]
    assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=USER)
    assert raw.parse().model == "scripted-b"
    assert len(raw.headers["x-config-version"]) == 12
    assert engine_events("started")[0]["fields"]["max_tokens"] == 5


def test_clamp_instead_of_reject():
    policy = RequestPolicy.model_validate({"caps": {"max_tokens": 10, "n": 2}, "over_cap": "clamp"})
    data = {"max_tokens": 100, "n": 5}
    apply(policy, data, chat=True)
    assert data == {"max_tokens": 10, "n": 2}


def test_sampling_defaults_fill_only_what_is_missing():
    policy = RequestPolicy.model_validate({"defaults": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}})
    data: dict = {"temperature": 0.7, "top_p": None}
    apply(policy, data, chat=True)
    assert data == {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}


def test_default_never_exceeds_the_cap():
    policy = RequestPolicy.model_validate({"defaults": {"max_tokens": 100}, "caps": {"max_tokens": 10}})
    data: dict = {}
    apply(policy, data, chat=False)
    assert data == {"max_tokens": 10}


def test_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="max_tokenz"):
        RequestPolicy.model_validate({"defaults": {"max_tokenz": 5}})
