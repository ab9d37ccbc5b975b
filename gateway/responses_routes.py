"""OpenAI's Responses API: ``/v1/responses`` and the stored responses behind it.

A mixin of the ingress, like ``RetrievalRoutes``: the app-wide auth dependency runs before each
route. ``create_response`` reads top to bottom as the request path, with the chat path's
stages in the chat path's order: the model's defaults and caps, input rails over
``instructions`` and every input item, retrieval (the ``file_search`` tool on our vector
stores, or the model's retrieval policy), then vLLM's own ``OpenAIServingResponses`` through
the model's ``LLMServer`` (engines/responses_server.py), with output rails on what comes back.
Stored responses live in the gateway (gateway/responses_store.py), owned per principal.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from ray.serve.handle import DeploymentHandle
from starlette.responses import Response

from gateway import chat_stages, responses_stages, sse
from gateway.auth import Principal
from gateway.errors import APIError, JSONBytesResponse, bad_request
from gateway.http import app
from gateway.limits import meter_of
from gateway.model_file import ModelPolicy
from gateway.protocol import read_json_body, split_extensions
from gateway.responses_stages import ResponsesCall
from gateway.responses_store import ResponseStore
from gateway.responses_stream import ResponseShaper, relay
from gateway.retrieval_routes import query_int, query_order, retrieval_caller
from retrieval.records import Passage

CONFIG_VERSION_HEADER = "X-Config-Version"
_LOGPROBS = "message.output_text.logprobs"


def response_not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", param=param, code="response_not_found")


class ResponsesRoutes:
    """Routes over the models' engines and ``self._responses`` (set by the ingress)."""

    _responses: ResponseStore | None
    _guard: DeploymentHandle | None
    _retriever: DeploymentHandle | None
    _searcher: Any  # the chat path's searches: the Retriever's handle or its copy in the ingress
    _settings: Any
    _output_metrics: Any

    def _store(self) -> ResponseStore:
        if self._responses is None:
            raise APIError(404, "Stored responses are not enabled on this gateway.", code="responses_store_disabled")
        return self._responses

    @app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        data = await read_json_body(request, self._settings.max_request_bytes)
        extensions = split_extensions(data)
        engine, policy = self._route(data, principal)
        owner = retrieval_caller(principal).owner
        call = ResponsesCall.parse(data)
        # 0. the model's request defaults and caps (`max_output_tokens` is its `max_tokens`)
        responses_stages.apply_request_policy(policy.requests, data)
        responses_stages.check_request(data)
        meter = meter_of(request)  # the key's limits: tokens charged, output bounded by its budget
        if meter is not None:
            meter.bound(data, "max_output_tokens")
        rails = policy.guardrails if policy.guardrails.enabled and policy.guardrails.output.enabled else None
        if rails and _LOGPROBS in call.include:
            raise APIError(
                400,
                f"'{_LOGPROBS}' is not available on this model: its output rails check generated text, "
                "which token logprobs would carry past them.",
                param="include",
                code="unsupported_with_output_rails",
            )
        # The conversation so far comes from our store: another principal's id is unknown here.
        if call.previous_response_id:
            previous = await self._store().load(owner, call.previous_response_id)
            if previous is None:
                raise response_not_found(call.previous_response_id, "previous_response_id")
            call.history = previous["context"] + responses_stages.output_as_input(previous["response"]["output"])
        # 1. input rails over `instructions` and every input item the client wrote, with
        # 2. the retrieval search beside them (cancelled if they refuse, searched again if they
        #    redact the query); its passages, checked by the same rails, go in a system message
        #    before the input
        guarded = policy.guardrails.enabled and self._guard is not None
        texts = responses_stages.response_texts(data) if guarded else []
        search = self._start_search(call, data, policy, extensions, principal)
        if guarded:
            try:
                await chat_stages.input_rails(
                    self._guard, data["model"], policy.guardrails, texts, param="input", **self._rail_bounds()
                )
            except BaseException:
                if search is not None:
                    search.cancel()
                raise
        passages, passages_item, search_item = await self._retrieve(call, data, policy, search)
        # 3. the engine (vLLM's Responses implementation), with 4. output rails on what it sends
        shaper = ResponseShaper(call, rails, self._output_metrics, search_item, passages)
        first, gen = await engine.call("responses", call.engine_body(data, passages_item))
        headers = {CONFIG_VERSION_HEADER: policy.version}
        if not isinstance(first, list):  # the whole response
            body = shaper.whole(first)
            if meter is not None:
                meter.charge(*shaper.tokens())
            await self._keep(owner, call, data, body)
            return JSONBytesResponse(body, headers=headers)

        async def keep(final: dict[str, Any]) -> None:
            await self._keep(owner, call, data, final)

        timeouts = getattr(self._settings, "timeouts", None)
        stream = relay(first, gen, shaper, keep, idle_s=getattr(timeouts, "stream_idle_s", None))
        if meter is not None:
            meter.follow_stream(shaper.tokens)
        return sse.EventStream(stream, headers, on_close=meter.close if meter is not None else None)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request) -> Response:
        record = await self._record(response_id, request)
        if request.query_params.get("stream") in ("true", "1"):
            raise bad_request(
                "Streaming a stored response is not supported.", param="stream", code="unsupported_parameter"
            )
        return JSONBytesResponse(record["response"])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> Response:
        principal: Principal = request.state.principal
        principal.require("chat")
        if not await self._store().delete(retrieval_caller(principal).owner, response_id):
            raise response_not_found(response_id)
        return JSONBytesResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(self, response_id: str, request: Request) -> Response:
        record = await self._record(response_id, request)
        items = list(record["input_items"])
        if query_order(request) == "desc":
            items.reverse()
        after = request.query_params.get("after")
        if after is not None:
            ids = [i.get("id") for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        limit = query_int(request, "limit", 20, 1, 100)
        page = items[:limit]
        return JSONBytesResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    # --- helpers ------------------------------------------------------------------------

    async def _record(self, response_id: str, request: Request) -> dict[str, Any]:
        principal: Principal = request.state.principal
        principal.require("chat")
        record = await self._store().load(retrieval_caller(principal).owner, response_id)
        if record is None:
            raise response_not_found(response_id)
        return record

    async def _keep(self, owner: str, call: ResponsesCall, data: dict[str, Any], body: dict[str, Any]) -> None:
        """Store the response (unless the request said ``store: false``) with what continues it."""
        if not call.store or self._responses is None:
            return
        record = {
            "response": body,
            "input_items": responses_stages.stored_items(data["input"]),
            "context": call.history + data["input"],
        }
        await self._responses.save(owner, record)

    def _start_search(
        self, call: ResponsesCall, data: dict[str, Any], policy: ModelPolicy, extensions: dict, principal: Principal
    ) -> chat_stages.PendingSearch | None:
        """The search for the request's last user text, submitted now (None without retrieval).
        The ``file_search`` tool searches the named stores, which must be the caller's own or
        the policy's (404 otherwise, as for a missing store)."""
        tool = call.file_search
        if self._retriever is None:
            if tool is not None:
                raise bad_request("Retrieval is not enabled on this gateway.", param="tools", code="retrieval_disabled")
            return None
        if tool is not None:
            wanted = chat_stages.RetrievalRequest(True, tool.vector_store_ids, tool.max_num_results)
        else:
            wanted = chat_stages.RetrievalRequest.parse(extensions.get("retrieval"), policy.retrieval)
        search = chat_stages.PendingSearch(
            self._searcher,
            data["model"],
            policy.retrieval,
            wanted,
            retrieval_caller(principal),
            timeout_s=self._settings.timeouts.retrieval_s,
            retry_after_s=self._settings.retry_after_s,
        )
        return search.submit(responses_stages.retrieval_messages(call.history + data["input"]))

    async def _retrieve(
        self, call: ResponsesCall, data: dict[str, Any], policy: ModelPolicy, search: chat_stages.PendingSearch | None
    ) -> tuple[list[Passage], dict[str, Any] | None, dict[str, Any] | None]:
        """Passages, the system message item that carries them, and the ``file_search_call``
        item (when the request asked for the tool)."""
        if search is None:
            return [], None, None
        messages = responses_stages.retrieval_messages(call.history + data["input"])
        search.submit(messages)  # the redacted query, if the rails rewrote it
        passages = await chat_stages.retrieved_passages(
            search,
            self._guard,
            policy.guardrails,
            messages,
            guardrails_timeout_s=self._settings.timeouts.guardrails_s,
            retry_after_s=self._settings.retry_after_s,
            known=self._passage_verdicts,
        )
        item = {"type": "message", "role": "system", "content": messages[0]["content"]} if passages else None
        found = None
        if call.file_search is not None:
            with_results = "file_search_call.results" in call.include
            found = responses_stages.file_search_item(chat_stages.last_user_text(messages), passages, with_results)
        return passages, item, found
