"""Schema fuzzing: schemathesis generates requests from the gateway's own OpenAPI description
(``/openapi.json``, gateway/openapi.py), valid and invalid, for every operation, and checks each
answer: never a 5xx, a status code and content type the description declares, a body that
matches the declared schema, and every error in OpenAI's body.

``GATEWAY_FUZZ_EXAMPLES`` sets the examples per operation and mode (positive and negative; 12 by
default, under a minute on a 2-core machine); ``GATEWAY_FUZZ_EXAMPLES=200`` fuzzes far longer.
Hypothesis draws new examples each run; a failure prints a curl command that repeats it.

The operations are driven from one test rather than schemathesis's pytest loader, whose lazy
fixture support does not run on pytest 9.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import API_KEY, tidy_operator_client

EXAMPLES = int(os.environ.get("GATEWAY_FUZZ_EXAMPLES", "12"))
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ERROR_KEYS = {"message", "type", "param", "code"}


def openai_error_body(ctx, response, case) -> None:
    """A 4xx or 5xx carries OpenAI's body: ``error`` with its four fields and a message (``/ready``
    adds its checks beside it)."""
    if response.status_code < 400:
        return None
    body = response.json()
    assert set(body) - {"status", "checks"} == {"error"}, f"not an OpenAI error body: {response.text[:200]}"
    assert set(body["error"]) == ERROR_KEYS and body["error"]["message"], response.text[:200]
    return None


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    openai_error_body,
]


@pytest.fixture(scope="module")
def description(gateway_url) -> dict:
    with httpx.Client(base_url=gateway_url, headers=AUTH, timeout=30) as c:
        served = c.get("/openapi.json")
    assert served.status_code == 200, served.text
    return served.json()


@pytest.fixture
def fuzz_client(gateway_url):
    """The stores and files the fuzzer happens to create are removed afterwards."""
    with tidy_operator_client(gateway_url) as c:
        yield c


def test_description_needs_a_key(gateway_url):
    r = httpx.get(gateway_url + "/openapi.json", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_description_documents_the_main_routes(description):
    paths = description["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"):
        assert paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"], path
    assert "multipart/form-data" in paths["/v1/files"]["post"]["requestBody"]["content"]
    chat = description["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "model", "stream", "max_tokens", "n"} <= set(chat["properties"])
    assert "text/event-stream" in paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert {p["name"] for p in paths["/v1/vector_stores"]["get"]["parameters"]} >= {"limit", "order", "after"}
    assert all("422" not in op["responses"] for ops in paths.values() for op in ops.values())
    assert paths["/health"]["get"]["security"] == [] and description["security"] == [{"bearer": []}]


def test_fuzz_every_operation(description, gateway_url, fuzz_client):
    config = SchemathesisConfig()
    project = config.projects.default
    project.update(base_url=gateway_url, headers=AUTH, request_timeout=30)
    project.generation.update(with_security_parameters=False)
    schema = schemathesis.openapi.from_dict(description, config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25
    failures: list[str] = []
    counts: dict[tuple[str, str], int] = {}
    started = time.monotonic()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            counts[operation.label, mode] = 0
            try:
                fuzz(operation, mode, failures, counts)
            except Unsatisfiable:
                # Nothing to make invalid: an operation without parameters or body.
                assert mode == GenerationMode.NEGATIVE, operation.label
    elapsed = time.monotonic() - started
    negative = {label for (label, mode), n in counts.items() if mode == GenerationMode.NEGATIVE and n}
    print(f"fuzzed {sum(counts.values())} requests, {len(operations)} operations, {elapsed:.1f} s")
    assert {label for (label, _), n in counts.items() if n} == {o.label for o in operations}
    # Every operation with a body got invalid bodies too (any string is a valid path id).
    assert {o.label for o in operations if o.method.upper() == "POST"} <= negative
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    # And the gateway still serves.
    assert fuzz_client.get("/health").status_code == 200
    reply = fuzz_client.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": [{"role": "user", "content": "[[say:ok]]"}]}
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "ok"


def fuzz(operation, mode: GenerationMode, failures: list[str], counts: dict) -> None:
    """Send ``EXAMPLES`` generated requests to one operation. Failures are collected rather than
    raised: no shrinking (bounded time), and one run reports every operation that misbehaves."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        counts[operation.label, mode] += 1
        try:
            case.call_and_validate(headers=AUTH, checks=CHECKS)
        except Exception as exc:  # schemathesis's check failures, or the client's timeout
            failures.append(f"{operation.label} ({mode}): {str(exc)[:600]}\n  {case.as_curl_command()[:600]}")

    run()
