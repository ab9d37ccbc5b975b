"""OpenAI's embeddings, files and vector stores routes, served by the retrieval deployments.

A mixin of the ingress: each route parses and checks its input, calls the ``Retriever``
or ``Embedder`` handle, and returns what they answer (already in OpenAI's shapes).

Who is calling: the ingress's auth dependency has put the request's ``Principal`` in
``request.state.principal`` before any route runs. Files and vector store routes need the
``documents`` scope and act for ``caller_of(request)``: the Retriever records that caller as the
owner of what it creates and answers anyone else's files and stores as missing ones.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable
from typing import Any

import numpy as np
from fastapi import Request
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.auth import Principal
from gateway.bounds import overloaded, retry_after_of
from gateway.errors import APIError, JSONBytesResponse, bad_request, model_not_found
from gateway.http import app
from gateway.limits import meter_of
from gateway.protocol import bounded, read_json_body
from retrieval.errors import RetrievalError
from retrieval.tenancy import Caller

MAX_EMBEDDING_INPUTS = 2048
EMBEDDING_CALL_INPUTS = 64
# An upload's multipart framing and its small fields (purpose), beyond the file itself.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
MAX_FORM_FIELD_BYTES = 1024

STORE_FIELDS = {"name", "metadata", "file_ids", "chunking_strategy", "expires_after", "description"}
STORE_UPDATE_FIELDS = {"name", "metadata", "expires_after"}
STORE_FILE_FIELDS = {"file_id", "attributes", "chunking_strategy"}
SEARCH_FIELDS = {"query", "max_num_results", "filters", "ranking_options", "rewrite_query"}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}


async def call(awaitable: Awaitable[Any], stage: str = "retrieval", retry_after_s: float | None = 1) -> Any:
    """Await a retrieval deployment, mapping its typed errors to OpenAI errors, and a full
    queue (its own, or the Embedder's behind it) to a 503 with Retry-After."""
    try:
        return await awaitable
    except RetrievalError as exc:
        raise APIError(exc.status, exc.message, type=exc.error_type, param=exc.param, code=exc.code) from None
    except BackPressureError as exc:
        raise overloaded(stage, retry_after_of(exc, retry_after_s)) from None


def check_fields(data: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise bad_request(
            f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0], code="unknown_parameter"
        )


def check_objects(data: dict[str, Any], *names: str) -> None:
    """Fields that must be JSON objects (or null) when present: the Retriever reads them as mappings."""
    for name in names:
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise bad_request(f"Invalid type for '{name}': expected an object.", param=name, code="invalid_type")


def query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # ASCII digits only (str.isdigit() also accepts "²", which int() refuses), and few of them
    # (int() refuses over 4300 digits).
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18) or not lo <= int(raw) <= hi:
        raise bad_request(
            f"Invalid '{name}': expected an integer between {lo} and {hi}.", param=name, code="invalid_value"
        )
    return int(raw)


def retrieval_caller(principal: Principal) -> Caller:
    """Who the Retriever acts for: admin keys are the operator, anyone else themselves."""
    return Caller(principal.name, admin=principal.admin)


def caller_of(request: Request) -> Caller:
    """The retrieval caller for a files or vector stores request: its principal, which must
    hold the ``documents`` scope (403 otherwise)."""
    principal: Principal = request.state.principal
    principal.require("documents")
    return retrieval_caller(principal)


def query_order(request: Request) -> str:
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("Invalid 'order': expected 'asc' or 'desc'.", param="order", code="invalid_value")
    return order


class RetrievalRoutes:
    """Routes over ``self._retriever`` and ``self._embedder`` (set by the ingress)."""

    _retriever: DeploymentHandle | None
    _embedder: DeploymentHandle | None
    _embedding_model: str | None
    _settings: Any

    def _retrieval(self) -> DeploymentHandle:
        if self._retriever is None:
            raise APIError(404, "Retrieval is not enabled on this gateway.", code="retrieval_disabled")
        return self._retriever

    async def _json(self, request: Request, allowed: set[str]) -> dict[str, Any]:
        data = await read_json_body(request, self._settings.max_request_bytes)
        check_fields(data, allowed)
        return data

    # --- embeddings -------------------------------------------------------------------

    @app.post("/v1/embeddings")
    async def create_embeddings(self, request: Request) -> Response:
        data = await self._json(request, EMBEDDING_FIELDS)
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
        if self._embedder is None or model != self._embedding_model or not request.state.principal.may_use(model):
            raise model_not_found(model)
        inputs = _embedding_inputs(data.get("input"))
        encoding = data.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise bad_request(
                "Invalid 'encoding_format': expected 'float' or 'base64'.",
                param="encoding_format",
                code="invalid_value",
            )
        dimensions = data.get("dimensions")
        if dimensions is not None and dimensions != 384:
            raise bad_request(f"'dimensions' must be 384 for {model}.", param="dimensions", code="invalid_value")
        # Calls of up to EMBEDDING_CALL_INPUTS inputs: few Serve hops for a long list, spread over
        # the embedding replicas, whose batcher mixes them with other requests' inputs.
        calls = [
            self._embedder.embed_many.remote(inputs[i : i + EMBEDDING_CALL_INPUTS], start=i)
            for i in range(0, len(inputs), EMBEDDING_CALL_INPUTS)
        ]
        counts = self._embedder.count_tokens.remote([t for t in inputs if isinstance(t, str)])
        vectors = [v for part in await call(asyncio.gather(*calls), "embedder") for v in part]
        tokens = sum(await call(counts, "embedder")) + sum(len(t) + 2 for t in inputs if isinstance(t, list))
        meter = meter_of(request)
        if meter is not None:
            meter.charge(tokens, 0)  # settled by the limits dependency as the route returns
        data_out = [
            {"object": "embedding", "index": i, "embedding": _encode(v, encoding)} for i, v in enumerate(vectors)
        ]
        return JSONBytesResponse(
            {
                "object": "list",
                "data": data_out,
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    # --- files ------------------------------------------------------------------------

    @app.post("/v1/files")
    async def create_file(self, request: Request) -> Response:
        caller = caller_of(request)
        limit = self._settings.retrieval.ingest.max_upload_bytes
        too_large = APIError(413, f"Files larger than {limit} bytes are not accepted.", code="request_too_large")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request(
                "Upload files as multipart/form-data with fields 'file' and 'purpose'.",
                param="file",
                code="invalid_value",
            )
        # The body is counted as it streams in (chunked or not): past the limit the parser stops,
        # and the part it spooled to a temporary file is closed (deleted) at once.
        try:
            form = await bounded(request, limit + MULTIPART_OVERHEAD_BYTES).form(
                max_files=1, max_fields=8, max_part_size=MAX_FORM_FIELD_BYTES
            )
        except APIError as exc:
            raise too_large if exc.status == 413 else exc from None
        except StarletteHTTPException as exc:  # malformed multipart, too many files or fields
            raise bad_request(f"Invalid upload: {exc.detail}", param="file", code="invalid_value") from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise bad_request(
                    "Missing required parameter: 'file'.", param="file", code="missing_required_parameter"
                )
            if not isinstance(purpose, str) or not purpose:
                raise bad_request(
                    "Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter"
                )
            content = await upload.read(limit + 1)
        finally:
            await form.close()
        if len(content) > limit:
            raise too_large
        return JSONBytesResponse(
            await call(
                self._retrieval().create_file.remote(upload.filename or "upload", content, purpose, caller=caller)
            )
        )

    @app.get("/v1/files")
    async def list_files(self, request: Request) -> Response:
        caller = caller_of(request)
        page = self._retrieval().list_files.remote(
            request.query_params.get("purpose"),
            query_int(request, "limit", 10000, 1, 10000),
            query_order(request),
            request.query_params.get("after"),
            caller=caller,
        )
        return JSONBytesResponse(await call(page))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(self, file_id: str, request: Request) -> Response:
        caller = caller_of(request)
        return JSONBytesResponse(await call(self._retrieval().get_file.remote(file_id, caller=caller)))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(self, file_id: str, request: Request) -> Response:
        caller = caller_of(request)
        content = await call(self._retrieval().get_file_content.remote(file_id, caller=caller))
        return Response(content, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(self, file_id: str, request: Request) -> Response:
        caller = caller_of(request)
        return JSONBytesResponse(await call(self._retrieval().delete_file.remote(file_id, caller=caller)))

    # --- vector stores ------------------------------------------------------------------

    @app.post("/v1/vector_stores")
    async def create_vector_store(self, request: Request) -> Response:
        caller = caller_of(request)
        data = await self._json(request, STORE_FIELDS)
        check_objects(data, "metadata", "chunking_strategy", "expires_after")
        store = self._retrieval().create_store.remote(
            data.get("name"), data.get("metadata"), data.get("file_ids"), data.get("chunking_strategy"), caller=caller
        )
        return JSONBytesResponse(await call(store))

    @app.get("/v1/vector_stores")
    async def list_vector_stores(self, request: Request) -> Response:
        caller = caller_of(request)
        q = request.query_params
        page = self._retrieval().list_stores.remote(
            query_int(request, "limit", 20, 1, 100),
            query_order(request),
            q.get("after"),
            q.get("before"),
            caller=caller,
        )
        return JSONBytesResponse(await call(page))

    @app.get("/v1/vector_stores/{store_id}")
    async def retrieve_vector_store(self, store_id: str, request: Request) -> Response:
        caller = caller_of(request)
        return JSONBytesResponse(await call(self._retrieval().get_store.remote(store_id, caller=caller)))

    @app.post("/v1/vector_stores/{store_id}")
    async def modify_vector_store(self, store_id: str, request: Request) -> Response:
        caller = caller_of(request)
        data = await self._json(request, STORE_UPDATE_FIELDS)
        check_objects(data, "metadata", "expires_after")
        modified = self._retrieval().modify_store.remote(
            store_id, data.get("name"), data.get("metadata"), caller=caller
        )
        return JSONBytesResponse(await call(modified))

    @app.delete("/v1/vector_stores/{store_id}")
    async def delete_vector_store(self, store_id: str, request: Request) -> Response:
        caller = caller_of(request)
        return JSONBytesResponse(await call(self._retrieval().delete_store.remote(store_id, caller=caller)))

    @app.post("/v1/vector_stores/{store_id}/files")
    async def create_vector_store_file(self, store_id: str, request: Request) -> Response:
        caller = caller_of(request)
        data = await self._json(request, STORE_FILE_FIELDS)
        check_objects(data, "attributes", "chunking_strategy")
        if not isinstance(data.get("file_id"), str):
            raise bad_request(
                "Missing required parameter: 'file_id'.", param="file_id", code="missing_required_parameter"
            )
        added = self._retrieval().add_file_to_store.remote(
            store_id, data["file_id"], data.get("attributes"), data.get("chunking_strategy"), caller=caller
        )
        return JSONBytesResponse(await call(added))

    @app.get("/v1/vector_stores/{store_id}/files")
    async def list_vector_store_files(self, store_id: str, request: Request) -> Response:
        caller = caller_of(request)
        q = request.query_params
        page = self._retrieval().list_store_files.remote(
            store_id,
            query_int(request, "limit", 20, 1, 100),
            query_order(request),
            q.get("after"),
            q.get("before"),
            q.get("filter"),
            caller=caller,
        )
        return JSONBytesResponse(await call(page))

    @app.get("/v1/vector_stores/{store_id}/files/{file_id}")
    async def retrieve_vector_store_file(self, store_id: str, file_id: str, request: Request) -> Response:
        caller = caller_of(request)
        return JSONBytesResponse(await call(self._retrieval().get_store_file.remote(store_id, file_id, caller=caller)))

    @app.delete("/v1/vector_stores/{store_id}/files/{file_id}")
    async def delete_vector_store_file(self, store_id: str, file_id: str, request: Request) -> Response:
        caller = caller_of(request)
        return JSONBytesResponse(
            await call(self._retrieval().delete_store_file.remote(store_id, file_id, caller=caller))
        )

    @app.post("/v1/vector_stores/{store_id}/search")
    async def search_vector_store(self, store_id: str, request: Request) -> Response:
        caller = caller_of(request)
        data = await self._json(request, SEARCH_FIELDS)
        if "query" not in data:
            raise bad_request("Missing required parameter: 'query'.", param="query", code="missing_required_parameter")
        # The Retriever checks the values (query: a non-empty string or 1 to 16 of them;
        # max_num_results: an integer from 1 to 50) and answers a 400 naming the parameter.
        page = self._retrieval().search.remote(
            store_id,
            data["query"],
            data.get("max_num_results", 10),
            data.get("filters"),
            data.get("ranking_options"),
            bool(data.get("rewrite_query", False)),
            caller=caller,
        )
        return JSONBytesResponse(await call(page))


def _embedding_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's input forms: a string, strings, a token array, or token arrays."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request(
            "'input' must be a string, an array of strings, or token arrays.", param="input", code="invalid_value"
        )
    if not items:
        raise bad_request("'input' must not be empty.", param="input", code="invalid_value")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise bad_request(
            f"'input' may hold at most {MAX_EMBEDDING_INPUTS} items.", param="input", code="invalid_value"
        )
    for i, item in enumerate(items):
        ok = (isinstance(item, str) and item != "") or (
            isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        )
        if not ok:
            raise bad_request(
                f"'input[{i}]' must be a non-empty string or token array.", param="input", code="invalid_value"
            )
    return items


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return np.asarray(vector, dtype=np.float32).tolist()
