"""Server-sent events, the way OpenAI streams: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson

DONE = "data: [DONE]\n\n"
_PREFIX = "data: "


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
