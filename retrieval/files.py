"""Uploaded files (OpenAI ``files.create``), kept on disk under one directory.

Layout: ``<root>/<file_id>.bin`` (content) and ``<root>/<file_id>.json`` (the file object). The
content is written first and the object last, each atomically, so a file exists exactly when its
object does. The user's filename is only metadata, never a path. Leftovers of interrupted writes
(temporary files, content without an object) are removed when the store opens.

Each file records its owner (see ``retrieval.tenancy``) in its object on disk; objects written
before owners were recorded belong to the operator. The owner is never part of the OpenAI file
object (``StoredFile.public()``). Methods given an ``owner`` treat someone else's file exactly
like a missing one.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from retrieval.errors import FileNotFoundInStoreError, InvalidInputError
from retrieval.persistence import TMP_MARKER, atomic_write, fsync_dir
from retrieval.tenancy import OPERATOR

logger = logging.getLogger(__name__)

FilePurpose = Literal[
    "assistants",
    "assistants_output",
    "batch",
    "batch_output",
    "fine-tune",
    "fine-tune-results",
    "vision",
    "user_data",
]


class StoredFile(BaseModel):
    """OpenAI's ``file`` object as kept on disk: what the files endpoints return (``public()``)
    plus its owner."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["file"] = "file"
    bytes: int = Field(ge=0)
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    owner: str = OPERATOR

    def public(self) -> dict:
        """The OpenAI ``file`` object, without the owner."""
        return self.model_dump(exclude={"owner"})


class FileStore:
    """Saves, lists, reads and deletes uploaded files; all objects are kept in memory."""

    def __init__(self, root: Path, *, max_bytes: int = 64 * 1024 * 1024, collect_garbage: bool = True) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: dict[str, StoredFile] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        for entry in self.root.iterdir():
            if TMP_MARKER in entry.name:
                if collect_garbage:  # on shared storage, only under the write lock
                    entry.unlink(missing_ok=True)
            elif entry.suffix == ".json":
                stored = StoredFile.model_validate_json(entry.read_bytes())
                self._files[stored.id] = stored
        if collect_garbage:
            for entry in self.root.glob("*.bin"):
                if entry.stem not in self._files:
                    entry.unlink(missing_ok=True)

    def refresh(self) -> None:
        """Catch up with other processes writing under ``root``: files they stored or deleted
        (a file never changes once stored). Collects no garbage."""
        on_disk = {e.stem: e for e in self.root.glob("*.json") if TMP_MARKER not in e.name}
        with self._lock:
            known = set(self._files)
        new = [StoredFile.model_validate_json(on_disk[f].read_bytes()) for f in on_disk.keys() - known]
        with self._lock:
            for file_id in known - on_disk.keys():
                self._files.pop(file_id, None)
            for stored in new:
                self._files[stored.id] = stored

    def create(
        self,
        filename: str,
        content: bytes,
        purpose: FilePurpose = "assistants",
        *,
        owner: str = OPERATOR,
    ) -> StoredFile:
        """Store ``content`` and return its file object, owned by ``owner``."""
        if not filename or len(filename) > 512:
            raise InvalidInputError("filename must be 1 to 512 characters")
        if len(content) > self.max_bytes:
            raise InvalidInputError(f"file is larger than {self.max_bytes} bytes")
        stored = StoredFile(
            id=f"file-{secrets.token_hex(12)}",
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
            owner=owner,
        )
        atomic_write(self._content_path(stored.id), content)
        atomic_write(self.root / f"{stored.id}.json", stored.model_dump_json().encode("utf-8"))
        with self._lock:
            self._files[stored.id] = stored
        logger.info("stored %s (%d bytes, purpose %s)", stored.id, stored.bytes, purpose)
        return stored

    def get(self, file_id: str, *, owner: str | None = None) -> StoredFile:
        """A file by id; with ``owner``, someone else's file is not found either (same error)."""
        with self._lock:
            stored = self._files.get(file_id)
        if stored is None or (owner is not None and stored.owner != owner):
            raise FileNotFoundInStoreError(f"no file {file_id!r}")
        return stored

    def list(self, purpose: FilePurpose | None = None, *, owner: str | None = None) -> list[StoredFile]:
        """Files, oldest first, optionally of one purpose and/or one owner."""
        with self._lock:
            files = list(self._files.values())
        files = [f for f in files if (purpose is None or f.purpose == purpose) and (owner is None or f.owner == owner)]
        return sorted(files, key=lambda f: (f.created_at, f.id))

    def read(self, file_id: str, *, owner: str | None = None) -> bytes:
        """The file's content (``owner`` as in ``get``)."""
        self.get(file_id, owner=owner)
        return self._content_path(file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        """Delete a file: its object first, so a crash never leaves an object without content."""
        with self._lock:
            if self._files.pop(file_id, None) is None:
                raise FileNotFoundInStoreError(f"no file {file_id!r}")
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        fsync_dir(self.root)
        self._content_path(file_id).unlink(missing_ok=True)

    def _content_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.bin"
