"""The OpenAI wire protocol at our edge: reading request bodies into vLLM's request
models (so every field vLLM supports passes through untouched) and shaping responses to
OpenAI's published schema.
"""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

# Ray's own ingress runs this before sending a chat request through a handle (a pickling
# workaround for iterator-typed fields); Ray Serve LLM 2.60 has no public name for it.
from ray.llm._internal.serve.core.ingress.utils import _sanitize_chat_completion_request
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest
from starlette.requests import Request
from starlette.types import Message
from vllm.exceptions import VLLMClientError

from gateway.errors import APIError, bad_request

T = TypeVar("T", bound=BaseModel)

# Roles OpenAI's chat API defines. vLLM accepts any role string, which turns typos
# into confusing prompts; we reject them instead.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

# Fields of ours that clients send through `extra_body`; removed before vLLM sees the
# request (vLLM warns on unknown fields).
EXTENSION_FIELDS = ("retrieval", "guardrails")

# Optional fields OpenAI's schema allows to be null; every other null is dropped.
NULLABLE_FIELDS = frozenset({"content", "refusal", "logprobs", "finish_reason"})

# OpenAI's bound on choices per request. vLLM has none: n=10**18 would ask the engine for that
# many sequences (and a negative n fails deep inside it), so the edge refuses both.
MAX_CHOICES = 128


async def read_json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 past ``max_bytes``, 400 if not JSON."""
    body = bytearray()
    async for chunk in bounded(request, max_bytes).stream():
        body += chunk
    if not body:
        raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return data


def bounded(request: Request, max_bytes: int, what: str = "request body") -> Request:
    """The same request, refused with 413 as soon as its body passes ``max_bytes``: at once when
    Content-Length says so, otherwise while it streams in (a chunked body has no Content-Length,
    and a declared one may lie). Nothing past the limit is read, kept or spooled to disk."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes, what)
    received = 0

    async def receive() -> Message:
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise _too_large(max_bytes, what)
        return message

    return Request(request.scope, receive)


def _too_large(max_bytes: int, what: str = "request body") -> APIError:
    return APIError(
        413, f"The {what} is larger than the {max_bytes} bytes this server accepts.", code="request_too_large"
    )


def validate(model: type[T], data: dict[str, Any]) -> T:
    """Build a pydantic request model, turning the first validation error into a 400
    that names the offending field the way OpenAI does (``messages[0].role``)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param_path(err["loc"])
        raise bad_request(
            f"Invalid value for '{param}': {err['msg']}" if param else err["msg"],
            param=param or None,
            code="invalid_value",
        ) from None
    except (ValueError, TypeError) as exc:  # model validators raising plain errors
        raise bad_request(str(exc), code="invalid_value") from None
    except VLLMClientError as exc:  # vLLM's validators: not ValueErrors, and they name the field
        raise client_error(exc) from None


def client_error(exc: VLLMClientError, renamed: dict[str, str] | None = None) -> APIError:
    """A 400 for a value vLLM refused, naming its field (``renamed`` maps vLLM's names to the API's).
    The message leaves out the refused value, which may be huge."""
    param = getattr(exc, "parameter", None)
    param = (renamed or {}).get(param, param)
    return bad_request(str(exc.args[0]) if exc.args else "Invalid request.", param=param, code="invalid_value")


def _param_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not path:
            path = str(part)
        elif str(part)[:1].isupper() or "[" in str(part) or "-" in str(part):
            continue  # pydantic's union-member labels, not field names
        else:
            path += f".{part}"
    return path


def split_extensions(data: dict[str, Any]) -> dict[str, Any]:
    """Remove and return our extension fields from a request body."""
    return {k: data.pop(k) for k in EXTENSION_FIELDS if k in data}


def parse_chat_request(data: dict[str, Any]) -> ChatCompletionRequest:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of messages.", param="messages", code="invalid_value")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(
                f"Invalid type for 'messages[{i}]': expected an object.", param=f"messages[{i}]", code="invalid_type"
            )
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(
                f"Invalid value for 'messages[{i}].role': {role!r} is not one of {sorted(CHAT_ROLES)}.",
                param=f"messages[{i}].role",
                code="invalid_value",
            )
    _require_model(data)
    _check_choices(data)
    request = validate(ChatCompletionRequest, data)
    # Materialise iterator-typed fields so the request pickles across the Serve hop.
    # Pydantic validates those iterators lazily, so bad content parts surface only here.
    try:
        return _sanitize_chat_completion_request(request)
    except ValueError as exc:
        raise bad_request(f"Invalid message content: {exc}", param="messages", code="invalid_value") from None


def parse_completion_request(data: dict[str, Any]) -> CompletionRequest:
    _require_model(data)
    if "prompt" not in data:
        raise bad_request("Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    _check_choices(data)
    return validate(CompletionRequest, data)


def _check_choices(data: dict[str, Any]) -> None:
    n = data.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES):
        raise bad_request(
            f"Invalid value for 'n': expected an integer from 1 to {MAX_CHOICES}.", param="n", code="invalid_value"
        )


def _require_model(data: dict[str, Any]) -> None:
    if not isinstance(data.get("model"), str) or not data["model"]:
        raise bad_request("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")


def prune_nulls(value: Any) -> Any:
    """Drop nulls that OpenAI's schema does not allow (it types those fields as objects
    or arrays), keeping the few it declares nullable, and vLLM's empty ``tool_calls``."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if v is None and k not in NULLABLE_FIELDS:
                continue
            if k == "tool_calls" and v == []:
                continue
            out[k] = prune_nulls(v)
        return out
    if isinstance(value, list):
        return [prune_nulls(v) for v in value]
    return value


def response_body(response: BaseModel) -> dict[str, Any]:
    """A non-streaming chat or completion response in OpenAI's shape."""
    body = prune_nulls(response.model_dump(mode="json"))
    for choice in body.get("choices", []):
        choice.setdefault("logprobs", None)
        message = choice.get("message")
        if message is not None:
            message.setdefault("content", None)
            message.setdefault("refusal", None)
    return body
