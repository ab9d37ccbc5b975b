"""The request id: one id finds a request's whole story.

Ray Serve takes the caller's ``X-Request-Id`` (or makes one), echoes it in the response, and
carries it in its request context through every deployment handle call: the guardrails,
retrieval and embedding replicas and the ``LLMServer`` all run under the same id, and Ray's
log records from inside a request carry it as ``request_id``. The ingress also stamps it
explicitly on the engine request, so vLLM's own request id (its logs, its abort) is this id
whatever the client put in the body's ``request_id``.
"""

from __future__ import annotations

from typing import Any

from ray.serve import context as serve_context


def request_id() -> str:
    """The current request's id ('' outside a request).

    Ray 2.60 has no public accessor for it; Ray Serve LLM reads the same context
    (``ray.llm._internal.serve.utils.server_utils.get_serve_request_id``)."""
    ctx = serve_context._serve_request_context.get()
    return ctx.request_id if ctx is not None else ""


def stamp(request: Any) -> None:
    """Give an engine request (vLLM's chat or completion model) the current request id."""
    rid = request_id()
    if rid and hasattr(request, "request_id"):
        request.request_id = rid


def otlp_span_processors() -> list:
    """Ray Serve's tracing exporter hook, off unless named: with
    ``RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH=gateway.request_context:otlp_span_processors`` in
    every node's environment, Serve sends a span per HTTP request and per deployment call (the
    ingress, each stage, the engine; the trace context travels with the handle call) to the
    OTLP endpoint in ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return [BatchSpanProcessor(OTLPSpanExporter())]
