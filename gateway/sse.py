"""Server-sent events, the way OpenAI streams: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
_PREFIX = "data: "
HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """An SSE response whose end is certain: when it ends, however it ends (sent, failed, or
    the client left and the request's task was cancelled), the body's generators are closed at
    once, which stops the engine call, and ``on_close`` runs (a meter settles there). Left to
    itself, a generator abandoned by a cancelled response is closed only when it is garbage
    collected, which was seen to take more than 15 s."""

    def __init__(
        self,
        body: AsyncIterator[str],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        super().__init__(body, media_type="text/event-stream", headers={**HEADERS, **(headers or {})})
        self._source = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._source.aclose()  # type: ignore[attr-defined]
            except BaseException as exc:  # noqa: BLE001 - the response is over either way
                logger.debug("closing a stream's body: %s", type(exc).__name__)
            finally:
                if self._on_close is not None:
                    self._on_close()


def event(payload: dict[str, Any]) -> str:
    return _PREFIX + orjson.dumps(payload).decode() + "\n\n"


def parse_events(packets: Iterable[str]) -> Iterator[dict[str, Any] | None]:
    """Yield each event's JSON payload, or None for ``[DONE]``.

    Ray Serve LLM hands us lists of already formatted SSE strings; one string may hold
    several events.
    """
    for packet in packets:
        for block in packet.split("\n\n"):
            block = block.strip()
            if not block.startswith(_PREFIX):
                continue
            data = block[len(_PREFIX) :]
            yield None if data == "[DONE]" else orjson.loads(data)
