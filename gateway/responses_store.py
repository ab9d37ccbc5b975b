"""Stored responses, on disk, each owned by the principal that created it.

One JSON file per response under ``<root>/<owner digest>/<response id>.json``: the response as
the client got it, the input items it was given (``GET .../input_items``) and the conversation
before its output (what ``previous_response_id`` continues). Owners are the same strings as
for files and vector stores (retrieval/tenancy.py: ``operator`` for admin keys,
``principal:<name>`` otherwise); a response is looked up only under its caller's own folder,
so another principal's id reads as one that does not exist.

Files, not engine memory: a stored response survives an ingress or engine restart and is seen
by every ingress replica that shares the folder. Each write goes to a temporary file that is
renamed into place, so a reader never sees half a record. Disk access runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from pathlib import Path
from typing import Any

import orjson

from retrieval.persistence import atomic_write

_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,128}$")


class ResponseStore:
    """Response records by (owner, id)."""

    def __init__(self, root: Path):
        self._root = Path(root)

    def _path(self, owner: str, response_id: str) -> Path | None:
        if not isinstance(response_id, str) or not _ID.match(response_id):
            return None  # ids are ours: anything else cannot name a file
        folder = hashlib.sha256(owner.encode()).hexdigest()[:32]
        return self._root / folder / f"{response_id}.json"

    async def save(self, owner: str, record: dict[str, Any]) -> None:
        path = self._path(owner, record["response"]["id"])
        if path is None:
            raise ValueError("not a response id")
        await asyncio.to_thread(_write, path, orjson.dumps(record))

    async def load(self, owner: str, response_id: str) -> dict[str, Any] | None:
        path = self._path(owner, response_id)
        if path is None:
            return None
        data = await asyncio.to_thread(_read, path)
        return orjson.loads(data) if data is not None else None

    async def delete(self, owner: str, response_id: str) -> bool:
        path = self._path(owner, response_id)
        return path is not None and await asyncio.to_thread(_remove, path)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
