"""``LLMServer`` with the Responses API: one more method, ``responses``, beside ``chat``.

Ray Serve LLM 2.60 keeps vLLM's ``OpenAIServingResponses`` in its engine's app state but has
no method that reaches it. ``build_llm_deployment(deployment_cls=ResponsesServer)`` deploys this
subclass instead of ``LLMServer``; its default engine is ``VLLMResponsesEngine``
(engines/responses_engine.py, vLLM's engine plus ``responses``), and ``engine_cls`` still
replaces it (the fast tier's ``ScriptedEngine`` answers ``responses`` too).

The request travels as the JSON body (a dict): the engine builds vLLM's ``ResponsesRequest``
itself, so nothing iterator-typed has to be pickled across the Serve hop.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator
from typing import Any

# No public names in Ray Serve LLM 2.60: the engine-class variable LLMServer reads, and ErrorInfo.
from ray.llm._internal.serve.constants import RAYLLM_VLLM_ENGINE_CLS_ENV
from ray.llm._internal.serve.core.configs.openai_api_models import ErrorInfo
from ray.serve.llm import LLMServer
from ray.serve.llm.openai_api_models import ErrorResponse


class ResponsesServer(LLMServer):
    """An ``LLMServer`` whose engine also serves ``/v1/responses`` (through the gateway)."""

    def _get_default_engine_class(self) -> type:
        if os.environ.get(RAYLLM_VLLM_ENGINE_CLS_ENV):
            return super()._get_default_engine_class()
        # Imported here: the module imports vLLM's engine, which only engine replicas need.
        from engines.responses_engine import VLLMResponsesEngine

        return VLLMResponsesEngine

    async def responses(self, request: dict[str, Any], raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        """A Responses API request (the body as a dict). Streams: lists of ``data: {event}``
        strings, batched like chat's; otherwise one response dict, or an ``ErrorResponse``."""
        method = getattr(self.engine, "responses", None)
        if method is None:
            return _unsupported()
        stream = method(request, raw_request_info)
        return self._batch_output_stream(stream) if request.get("stream") else stream


async def _unsupported() -> AsyncGenerator[ErrorResponse, None]:
    yield ErrorResponse(
        error=ErrorInfo(
            message="This model's engine does not serve the Responses API.", type="BadRequestError", code=400
        )
    )
