"""Ray Serve LLM's vLLM engine plus ``responses``: vLLM's own ``OpenAIServingResponses``.

``VLLMEngine.start`` runs vLLM's ``init_app_state``, which builds ``openai_serving_responses``
beside the chat and completion servers, and keeps the state as ``self._app_state``; 2.60 only
has no method that calls it. This one does, the way ``VLLMEngine.chat`` calls chat.

vLLM's in-memory response store (``VLLM_ENABLE_RESPONSES_API_STORE=1``) is left off: it never
evicts, lives in one engine replica and dies with it. The gateway keeps stored responses itself
(gateway/responses_store.py) and sends vLLM whole conversations with ``store: false``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

# No public names in Ray Serve LLM 2.60: ErrorInfo, and the vLLM engine this one extends.
from ray.llm._internal.serve.core.configs.openai_api_models import ErrorInfo
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine
from ray.serve.llm.openai_api_models import ErrorResponse
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse
from vllm.entrypoints.serve.engine.protocol import ErrorResponse as VLLMErrorResponse
from vllm.exceptions import VLLMClientError


class VLLMResponsesEngine(VLLMEngine):
    """``VLLMEngine`` that also answers Responses API requests."""

    async def responses(self, request: dict[str, Any], raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        """Yields ``data: {event}`` strings when streaming, else one response dict; an
        ``ErrorResponse`` for a request vLLM refuses."""
        serving = getattr(self._app_state, "openai_serving_responses", None)
        if serving is None:
            yield self._make_error("This model does not support the 'generate' task; it has no Responses API.")
            return
        try:
            parsed = ResponsesRequest.model_validate(request)
            result = await serving.create_responses(parsed, raw_request=None)
        except (ValueError, VLLMClientError) as exc:  # pydantic's ValidationError is a ValueError
            yield self._make_error_response(serving, exc)
            return
        if isinstance(result, VLLMErrorResponse):
            yield ErrorResponse(error=ErrorInfo(**result.error.model_dump()))
        elif isinstance(result, ResponsesResponse):
            yield result.model_dump(mode="json", by_alias=True)
        else:
            async for event in result:
                yield f"data: {event.model_dump_json(by_alias=True)}\n\n"
