"""The ingress's OpenAPI description, served (with a key) at ``/openapi.json``.

The routes read their bodies themselves (``Request``), so FastAPI alone describes no request
bodies, no query parameters, no error responses and a 422 the gateway never sends. This module
adds what the routes accept and answer: vLLM's own request models for chat and completions (the
gateway passes their fields through), compact schemas for the Responses API and the retrieval
routes, the list routes' query parameters, OpenAI's error body for every 4xx and 503, the
streaming media types, and the bearer key. tests/gateway/test_schema_fuzz.py fuzzes the gateway
against it.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERROR_REF = {"$ref": "#/components/schemas/Error"}
_ERROR_RESPONSE = {"description": "OpenAI's error body", "content": {"application/json": {"schema": _ERROR_REF}}}
_STREAMED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")

_METADATA = {"type": ["object", "null"], "additionalProperties": {"type": "string"}}
_STRING_OR_STRINGS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_OBJECT = {"type": ["object", "null"]}

_RESPONSES_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": {"type": "string"},
        "input": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "type": {"type": "string"},
                            "role": {"enum": ["user", "assistant", "system", "developer"]},
                            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                        },
                    },
                },
            ]
        },
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": ["boolean", "null"]},
        "store": {"type": ["boolean", "null"]},
        "previous_response_id": {"type": ["string", "null"]},
        "include": {"type": ["array", "null"], "items": {"type": "string"}},
        "tools": {"type": ["array", "null"], "items": {"type": "object"}},
        "tool_choice": {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}]},
        "metadata": _METADATA,
        "text": _OBJECT,
        "reasoning": _OBJECT,
        "user": {"type": ["string", "null"]},
    },
}

_EMBEDDINGS_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string"},
        "input": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "array", "items": {"type": "integer"}},
                {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            ]
        },
        "encoding_format": {"enum": ["float", "base64"]},
        "dimensions": {"type": "integer"},
        "user": {"type": "string"},
    },
}

_STORE_REQUEST = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {"type": ["string", "null"]},
        "metadata": _METADATA,
        "file_ids": {"type": ["array", "null"], "items": {"type": "string"}},
        "chunking_strategy": _OBJECT,
        "expires_after": _OBJECT,
        "description": {"type": ["string", "null"]},
    },
}

_STORE_UPDATE_REQUEST = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"name": {"type": ["string", "null"]}, "metadata": _METADATA, "expires_after": _OBJECT},
}

_STORE_FILE_REQUEST = {
    "type": "object",
    "required": ["file_id"],
    "additionalProperties": False,
    "properties": {
        "file_id": {"type": "string"},
        "attributes": {"type": ["object", "null"]},
        "chunking_strategy": _OBJECT,
    },
}

_SEARCH_REQUEST = {
    "type": "object",
    "required": ["query"],
    "additionalProperties": False,
    "properties": {
        "query": _STRING_OR_STRINGS,
        "max_num_results": {"type": "integer", "minimum": 1, "maximum": 50},
        "filters": _OBJECT,
        "ranking_options": _OBJECT,
        "rewrite_query": {"type": "boolean"},
    },
}

_UPLOAD = {
    "multipart/form-data": {
        "schema": {
            "type": "object",
            "required": ["file", "purpose"],
            "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string"}},
        }
    }
}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _page(limit_max: int, default: int) -> list[dict[str, Any]]:
    return [
        _query("limit", {"type": "integer", "minimum": 1, "maximum": limit_max, "default": default}),
        _query("order", {"enum": ["asc", "desc"]}),
        _query("after", {"type": "string"}),
    ]


QUERIES = {
    ("get", "/v1/files"): [*_page(10000, 10000), _query("purpose", {"type": "string"})],
    ("get", "/v1/vector_stores"): [*_page(100, 20), _query("before", {"type": "string"})],
    ("get", "/v1/vector_stores/{store_id}/files"): [
        *_page(100, 20),
        _query("before", {"type": "string"}),
        _query("filter", {"enum": ["in_progress", "completed", "failed", "cancelled"]}),
    ],
    ("get", "/v1/responses/{response_id}/input_items"): _page(100, 20),
}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _request_bodies(components: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(method, path) -> requestBody. vLLM's models go into ``components`` under their names."""
    from pydantic.json_schema import models_json_schema
    from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

    refs, defs = models_json_schema(
        [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    components.update(defs.get("$defs", {}))
    chat = refs[(ChatCompletionRequest, "validation")]
    completion = refs[(CompletionRequest, "validation")]
    return {
        ("post", "/v1/chat/completions"): _json_body(chat),
        ("post", "/v1/completions"): _json_body(completion),
        ("post", "/v1/responses"): _json_body(_RESPONSES_REQUEST),
        ("post", "/v1/embeddings"): _json_body(_EMBEDDINGS_REQUEST),
        ("post", "/v1/files"): {"required": True, "content": _UPLOAD},
        ("post", "/v1/vector_stores"): _json_body(_STORE_REQUEST),
        ("post", "/v1/vector_stores/{store_id}"): _json_body(_STORE_UPDATE_REQUEST),
        ("post", "/v1/vector_stores/{store_id}/files"): _json_body(_STORE_FILE_REQUEST),
        ("post", "/v1/vector_stores/{store_id}/search"): _json_body(_SEARCH_REQUEST),
    }


def describe(app: FastAPI, public_paths: frozenset[str]) -> dict[str, Any]:
    """The app's OpenAPI document with the gateway's bodies, parameters, errors and auth."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["Error"] = ERROR
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    doc["security"] = [{"bearer": []}]
    bodies = _request_bodies(schemas)
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            responses = op["responses"]
            responses.pop("422", None)
            ok = responses.get("200", {}).get("content", {})
            if path in _STREAMED:
                ok["text/event-stream"] = {"schema": {"type": "string"}}
            elif path == "/v1/files/{file_id}/content":
                ok.clear()
                ok["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
            if path in public_paths:
                op["security"] = []
                if path == "/ready":
                    responses["503"] = deepcopy(_ERROR_RESPONSE)
                continue
            for status in ("400", "401", "403", "404", "413", "429", "503"):
                responses[status] = deepcopy(_ERROR_RESPONSE)
            if (method, path) in bodies:
                op["requestBody"] = bodies[(method, path)]
            op.setdefault("parameters", []).extend(QUERIES.get((method, path), []))
    return doc
