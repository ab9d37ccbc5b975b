"""Bad input over every route and method: malformed and invalid-UTF-8 bodies, wrong types,
unknown fields, empty and huge values, absurd numbers, unknown ids and query values.

Every answer is either a success (a value that happens to be valid) or a 4xx with OpenAI's
error body; never a 5xx, never a hang (the client's timeout fails the test); and the gateway
serves normally afterwards. The sweeps collect every bad answer before failing, so one run
shows all of them.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import tidy_operator_client

ERROR_KEYS = {"message", "type", "param", "code"}
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
UNKNOWN_ID = "zz-unknown-0000"
# The fast-tier config accepts bodies up to 65536 bytes; this is well inside it.
HUGE = "x" * 30_000

# A valid body per JSON route, and the fields the sweep puts bad values in.
ROUTES = {
    "/v1/chat/completions": (
        {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
        [
            "model",
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "n",
            "stop",
            "seed",
            "stream",
            "stream_options",
            "logprobs",
            "top_logprobs",
            "logit_bias",
            "tools",
            "tool_choice",
            "response_format",
            "presence_penalty",
            "user",
            "retrieval",
            "guardrails",
        ],
    ),
    "/v1/completions": (
        {"model": "scripted", "prompt": "hi"},
        [
            "model",
            "prompt",
            "max_tokens",
            "temperature",
            "n",
            "stop",
            "logprobs",
            "echo",
            "suffix",
            "best_of",
            "stream",
        ],
    ),
    "/v1/responses": (
        {"model": "scripted", "input": "hi", "store": False},
        [
            "model",
            "input",
            "instructions",
            "max_output_tokens",
            "temperature",
            "tools",
            "tool_choice",
            "include",
            "previous_response_id",
            "text",
            "reasoning",
            "store",
            "stream",
            "metadata",
        ],
    ),
    "/v1/embeddings": (
        {"model": EMBEDDING_MODEL, "input": "hi"},
        ["model", "input", "encoding_format", "dimensions", "user"],
    ),
    "/v1/vector_stores": (
        {"name": "bad-input-suite"},
        ["name", "metadata", "file_ids", "chunking_strategy", "expires_after", "description"],
    ),
    f"/v1/vector_stores/{UNKNOWN_ID}": ({"name": "renamed"}, ["name", "metadata", "expires_after"]),
    f"/v1/vector_stores/{UNKNOWN_ID}/files": (
        {"file_id": "file-" + UNKNOWN_ID},
        ["file_id", "attributes", "chunking_strategy"],
    ),
    f"/v1/vector_stores/{UNKNOWN_ID}/search": (
        {"query": "x"},
        ["query", "max_num_results", "filters", "ranking_options", "rewrite_query"],
    ),
}

# Bad values for any field: wrong types, empty and huge values, absurd numbers, odd text.
BAD_VALUES = [
    None,
    True,
    -1,
    0,
    2**63,
    1e38,  # what a 39-digit integer becomes once parsed
    -1.7e308,
    1e-320,
    "",
    HUGE,
    "\u0000\u202e\U0001f600",
    [],
    [None],
    ["x"] * 2000,
    {},
    {"zz_unknown": 1},
    [{"role": "user"}],
    {"type": "json_schema", "json_schema": {"name": 5}},
]

# Bodies that are not a JSON object at all, sent to every route and method.
RAW_BODIES = [
    b'{"model": "scripted", "messages": [',  # malformed
    b'{"model": "scri\xff\xfept"}',  # invalid UTF-8
    b'{"model": "\\ud800"}',  # lone surrogate
    b'{"a": 1e400}',  # a number JSON cannot hold
    b"[" * 5000 + b"]" * 5000,  # deep nesting
    b"[1, 2]",
    b'"a string"',
    b"null",
    b"\x00\x01\x02",
    b"",
]

# Query values for the list routes; the keys they read.
BAD_QUERIES = [
    {"limit": "-1"},
    {"limit": "0"},
    {"limit": "abc"},
    {"limit": "--5"},
    {"limit": "\u00b2"},  # a digit to str.isdigit, not to int()
    {"limit": "\u0663"},  # Arabic-Indic three: int() reads it
    {"limit": "99999999999999999999999"},
    {"limit": "9" * 5000},
    {"order": "sideways"},
    {"after": HUGE[:4000]},
    {"before": "\u0000"},
    {"purpose": "\U0001f600"},
    {"filter": "nonsense"},
    {"stream": "true"},
]

# Ids that name nothing: unknown, empty-looking, huge, path-like, odd text.
BAD_IDS = [UNKNOWN_ID, "file-" + "9" * 3000, "..%2F..%2Fetc%2Fpasswd", "%00", "%FF%FE", "caf%C3%A9", "a%20b", "null"]


def gateway_routes() -> list[tuple[str, str]]:
    """Every (method, path template) the ingress serves."""
    import gateway.ingress  # noqa: F401  (registers the class-based routes on the app)
    from gateway.http import app

    found = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or []):
            if method != "HEAD":
                found.append((method, route.path))
    return found


def concrete(path: str, ident: str = UNKNOWN_ID) -> str:
    for name in ("{file_id}", "{store_id}", "{response_id}", "{model_id:path}", "{model_id}"):
        path = path.replace(name, ident)
    return path


def problem(r: httpx.Response) -> str | None:
    """What is wrong with an answer to bad input, or None: a 5xx, or a 4xx without OpenAI's body."""
    if r.status_code >= 500:
        return f"{r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            return f"{r.status_code} not JSON: {r.text[:200]}"
        if set(body) != {"error"} or set(body["error"]) != ERROR_KEYS or not body["error"]["message"]:
            return f"{r.status_code} not an OpenAI error body: {r.text[:200]}"
        if r.headers.get("content-type", "").split(";")[0] != "application/json":
            return f"{r.status_code} content-type {r.headers.get('content-type')}"
    return None


def send(http: httpx.Client, method: str, path: str, **kwargs) -> httpx.Response:
    try:
        return http.request(method, path, **kwargs)
    except httpx.TimeoutException:
        pytest.fail(f"{method} {path}: no answer within {http.timeout.read} s")


@pytest.fixture(scope="module")
def bad_http(gateway_url):
    """An operator client; the stores and files the sweep happens to create are removed after."""
    with tidy_operator_client(gateway_url) as c:
        yield c


def test_every_route_is_covered():
    """The sweeps below reach every route; a new route shows up here first."""
    routes = gateway_routes()
    assert len(routes) >= 25
    json_posts = {concrete(p) for m, p in routes if m == "POST" and p != "/v1/files"}
    assert json_posts == set(ROUTES), "a JSON route without bad-value sweep: add it to ROUTES"


def test_raw_bodies_on_every_route_and_method(bad_http):
    failures = []
    for method, path in gateway_routes():
        for body in RAW_BODIES:
            r = send(bad_http, method, concrete(path), content=body, headers={"content-type": "application/json"})
            if (bad := problem(r)) or (method == "POST" and r.status_code < 400):
                failures.append(f"{method} {path} {body[:40]!r}: {bad or r.status_code}")
    assert not failures, "\n".join(failures)


def test_wrong_methods_are_405(bad_http):
    failures = []
    paths = {p for _, p in gateway_routes()}
    for path in paths:
        served = {m for m, p in gateway_routes() if p == path}
        for method in {"GET", "POST", "PUT", "PATCH", "DELETE"} - served:
            r = send(bad_http, method, concrete(path), json={"model": "scripted"})
            if problem(r) or r.status_code != 405:
                failures.append(f"{method} {path}: {r.status_code} {r.text[:120]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("path", list(ROUTES))
def test_bad_values_in_every_field(bad_http, path):
    base, fields = ROUTES[path]
    failures = []
    for field in [*fields, "zz_unknown_field"]:
        for value in BAD_VALUES:
            body = {**base, field: value}
            r = send(bad_http, "POST", path, json=body)
            if bad := problem(r):
                failures.append(f"{field}={json.dumps(value)[:40]}: {bad}")
    assert not failures, f"POST {path}\n" + "\n".join(failures)


def test_bad_values_in_nested_fields(bad_http):
    """Inside messages, content parts, tools and input items, where the top-level sweep does not reach."""
    message = {"role": "user", "content": "hi"}
    chat = (
        [
            {"messages": [{**message, "content": value}]}
            for value in BAD_VALUES
            if value not in ("", HUGE)  # plain strings are valid content
        ]
        + [{"messages": [{**message, "role": value}]} for value in BAD_VALUES]
        + [
            {"messages": [message, {"role": "assistant", "tool_calls": [{"id": 1, "function": value}]}]}
            for value in BAD_VALUES
        ]
        + [{"messages": [{"role": "user", "content": [{"type": "text", "text": value}]}]} for value in (None, 5, [])]
        + [
            {"messages": [message], "tools": [{"type": "function", "function": {"name": value}}] * 3}
            for value in (None, 5, "", HUGE[:3000])
        ]
        + [
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            {"messages": [message] * 3000},
        ]
    )
    responses = (
        [{"input": [{"role": "user", "content": value}]} for value in BAD_VALUES]
        + [{"input": [{"type": value}]} for value in BAD_VALUES]
        + [{"tools": [{"type": "file_search", "vector_store_ids": value}]} for value in BAD_VALUES]
        + [
            {"tools": [{"type": "file_search", "vector_store_ids": [UNKNOWN_ID], "max_num_results": value}]}
            for value in BAD_VALUES
        ]
    )
    embeddings = [{"input": [[value]]} for value in (-1, 2**63, 1e38, 10**9, None, "x", 1.5)] + [
        {"input": [[1] * 5000]},
        {"input": ["x"] * 3000},
    ]
    cases = [("/v1/chat/completions", ROUTES["/v1/chat/completions"][0], c) for c in chat]
    cases += [("/v1/responses", ROUTES["/v1/responses"][0], c) for c in responses]
    cases += [("/v1/embeddings", ROUTES["/v1/embeddings"][0], c) for c in embeddings]
    failures = []
    for path, base, change in cases:
        r = send(bad_http, "POST", path, json={**base, **change})
        if bad := problem(r):
            failures.append(f"{path} {json.dumps(change)[:100]}: {bad}")
    assert not failures, "\n".join(failures)


def test_bad_query_values_on_every_get(bad_http):
    failures = []
    for method, path in gateway_routes():
        if method != "GET":
            continue
        for params in BAD_QUERIES:
            r = send(bad_http, method, concrete(path), params=params)
            if bad := problem(r):
                failures.append(f"GET {path} {params!r:.60}: {bad}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "path, params",
    [
        ("/v1/files", {"limit": "--5"}),
        ("/v1/vector_stores", {"limit": "\u00b2"}),
        ("/v1/vector_stores", {"limit": "99999999999999999999999"}),
        ("/v1/vector_stores", {"limit": "9" * 5000}),
        ("/v1/vector_stores", {"order": "sideways"}),
    ],
)
def test_bad_list_queries_are_400(bad_http, path, params):
    r = send(bad_http, "GET", path, params=params)
    assert r.status_code == 400 and not problem(r), r.text
    assert r.json()["error"]["param"] == next(iter(params))


def test_unknown_ids_on_every_route(bad_http):
    failures = []
    for method, path in gateway_routes():
        if "{" not in path:
            continue
        for ident in BAD_IDS:
            r = send(bad_http, method, concrete(path, ident), json={"name": "x", "file_id": "x", "query": "x"})
            if (bad := problem(r)) or r.status_code < 400:
                failures.append(f"{method} {concrete(path, ident)[:80]}: {bad or r.status_code}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/v1/chat/completions", {"model": "scripted", "messages": "hi"}, 400, "invalid_value"),
        ("/v1/chat/completions", {"model": 5, "messages": [{"role": "user", "content": "hi"}]}, 400, None),
        (
            "/v1/chat/completions",
            {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "n": -1},
            400,
            None,
        ),
        ("/v1/completions", {"model": "scripted", "prompt": "hi", "max_tokens": "many"}, 400, "invalid_value"),
        ("/v1/embeddings", {"model": EMBEDDING_MODEL, "input": "hi", "zz": 1}, 400, "unknown_parameter"),
        ("/v1/embeddings", {"model": EMBEDDING_MODEL, "input": [[-1]]}, 400, None),
        ("/v1/embeddings", {"model": EMBEDDING_MODEL, "input": [[2**63]]}, 400, None),
        ("/v1/vector_stores", {"name": "x", "zz": 1}, 400, "unknown_parameter"),
        (f"/v1/vector_stores/{UNKNOWN_ID}/search", {"query": "x"}, 404, None),
        (f"/v1/vector_stores/{UNKNOWN_ID}/files", {"file_id": 5}, 400, "missing_required_parameter"),
        ("/v1/responses", {"model": "scripted", "input": 5}, 400, None),
        ("/v1/vector_stores", {"metadata": ["a"]}, 400, "invalid_type"),
        ("/v1/chat/completions", {"model": "scripted", "messages": [{"role": ["user"], "content": "x"}]}, 400, None),
        (
            "/v1/chat/completions",
            {"model": "scripted", "messages": [{"role": "user", "content": "x"}], "n": 10**9},
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            {"model": "scripted", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto", "tools": []},
            400,
            None,
        ),
        ("/v1/completions", {"model": "scripted", "prompt": "hi", "logprobs": "many"}, 400, "invalid_value"),
        ("/v1/responses", {"model": "scripted", "input": "hi", "previous_response_id": "resp_nope"}, 404, None),
    ],
)
def test_specific_bad_values_are_4xx(bad_http, path, body, status, code):
    r = send(bad_http, "POST", path, json=body)
    assert r.status_code == status and not problem(r), r.text
    if code is not None:
        assert r.json()["error"]["code"] == code


def test_bad_uploads(bad_http):
    cases = [
        {"content": b"not multipart", "headers": {"content-type": "text/plain"}},
        {"content": b"--x\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=x"}},
        {"content": b"", "headers": {"content-type": "multipart/form-data"}},
        {"files": {"file": ("a.txt", b"hello")}},  # no purpose
        {"data": {"purpose": "assistants"}},  # no file
        {"files": {"file": ("a.txt", b"")}, "data": {"purpose": "assistants"}},  # empty file
        {"files": {"file": ("\u0000/../x.exe", b"\xff\xfe\x00")}, "data": {"purpose": "assistants"}},
        {"files": {"file": ("a.txt", b"hi")}, "data": {"purpose": HUGE[:2000]}},
        {"files": {"file": ("a.txt", b"x" * 300_000)}, "data": {"purpose": "assistants"}},  # over the limit
    ]
    failures = []
    for case in cases:
        r = send(bad_http, "POST", "/v1/files", **case)
        if bad := problem(r):
            failures.append(f"{str(case)[:100]}: {bad}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("field, value", [("max_output_tokens", 0), ("temperature", -1), ("temperature", 1e38)])
def test_values_the_engine_refuses_are_400_naming_the_field(bad_http, field, value):
    """vLLM checks these when it builds its sampling parameters, past the gateway's own checks."""
    r = send(bad_http, "POST", "/v1/responses", json={"model": "scripted", "input": "hi", "store": False, field: value})
    assert r.status_code == 400 and not problem(r), r.text
    assert r.json()["error"]["param"] == field


def test_serves_normally_afterwards(bad_http, client):
    """Runs last in this module: the sweeps above left nothing broken."""
    assert bad_http.get("/health").status_code == 200
    reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "[[say:fine]]"}])
    assert reply.choices[0].message.content == "fine"
    assert len(client.embeddings.create(model=EMBEDDING_MODEL, input="ok").data[0].embedding) == 384
    assert bad_http.get("/v1/files", params={"limit": 5}).status_code == 200
