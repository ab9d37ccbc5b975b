"""Crash-safe on-disk layout of one collection.

Layout of a collection directory::

    manifest.json          the committed state: collection info, documents, which index file
    index-<version>.faiss  the FAISS index (IndexIDMap2) written by the commit of that version
    chunks/d<seq>.json     chunk texts of one document, written once before any manifest names it

Every file is written to a temporary name in the same directory, fsynced, then renamed over its
final name (and the directory fsynced), so a reader only ever sees complete files. A commit
writes the new index file first and replaces ``manifest.json`` last: a crash at any point leaves
the previous manifest, which names only files that already existed completely. Whatever a crash
leaves behind (temporary files, an index or chunk file no manifest names) is deleted by
``remove_garbage`` when the collection is next loaded.

A new collection is assembled in a temporary sibling directory and renamed into place, so a
collection directory without a manifest is never a crash leftover.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

import faiss
import numpy as np
from pydantic import BaseModel, ConfigDict

from retrieval.config import IndexConfig
from retrieval.errors import StorageCorruptError
from retrieval.tenancy import OPERATOR

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
TMP_MARKER = ".tmp-"
_INDEX_FILE = re.compile(r"^index-\d+\.faiss$")
_CHUNKS_FILE = re.compile(r"^d(\d+)\.json$")


class DocumentEntry(BaseModel):
    """One document as recorded in the manifest."""

    model_config = ConfigDict(extra="forbid")

    doc_id: str
    seq: int
    source: str
    attributes: dict[str, str | bool | int | float]
    created_at: int
    first_chunk_id: int
    chunk_count: int
    usage_bytes: int
    chunking: dict[str, int] | None = None


class CollectionManifest(BaseModel):
    """The committed state of a collection, minus vectors and chunk texts."""

    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT_VERSION
    version: int
    id: str
    name: str
    created_at: int
    last_active_at: int
    metadata: dict[str, str]
    dimension: int
    index: IndexConfig
    next_chunk_id: int
    next_doc_seq: int
    index_file: str
    documents: list[DocumentEntry]
    # Who owns the collection (see retrieval.tenancy); absent in manifests written before owners
    # were recorded, which belong to the operator.
    owner: str = OPERATOR


def index_file_name(version: int) -> str:
    """Name of the index file written by the commit of ``version``."""
    return f"index-{version:010d}.faiss"


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    """Replace ``path`` with ``data``; readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class CollectionDir:
    """Reads and writes one collection's directory; knows nothing of searching."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def chunks_dir(self) -> Path:
        return self.path / "chunks"

    @classmethod
    def create(cls, path: Path, manifest: dict, index_bytes: np.ndarray) -> CollectionDir:
        """Write a complete first version in a temporary sibling, then rename it to ``path``."""
        if path.exists():
            raise FileExistsError(path)
        tmp = path.with_name(f"{TMP_MARKER}{path.name}-{secrets.token_hex(4)}")
        tmp.mkdir(parents=True)
        try:
            staging = cls(tmp)
            staging.chunks_dir.mkdir()
            staging.commit(manifest, index_bytes)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(path.parent)
        return cls(path)

    def write_chunks(self, seq: int, texts: list[str]) -> None:
        """Store a document's chunk texts; harmless if no manifest ever names them."""
        data = json.dumps(texts, ensure_ascii=False).encode("utf-8")
        atomic_write(self.chunks_dir / f"d{seq}.json", data)

    def read_chunks(self, seq: int) -> list[str]:
        try:
            return json.loads((self.chunks_dir / f"d{seq}.json").read_bytes())
        except (OSError, ValueError) as exc:
            raise StorageCorruptError(f"{self.path}: chunks of document #{seq}: {exc}") from exc

    def remove_chunks(self, seq: int) -> None:
        (self.chunks_dir / f"d{seq}.json").unlink(missing_ok=True)

    def commit(self, manifest: dict, index_bytes: np.ndarray | None) -> None:
        """Make ``manifest`` the committed state, first writing ``index_bytes`` (if given) to the
        file the manifest names (see ``index_file_name``)."""
        if index_bytes is not None:
            atomic_write(self.path / manifest["index_file"], memoryview(index_bytes))
        atomic_write(self.path / MANIFEST_NAME, json.dumps(manifest).encode("utf-8"))
        if index_bytes is not None:
            self._remove_index_files(keep=manifest["index_file"])

    def manifest_signature(self) -> tuple[int, ...] | None:
        """Identifies the committed manifest file: every commit renames a new file over it (a new
        inode), so a changed signature means another commit. None if there is none."""
        try:
            st = os.stat(self.path / MANIFEST_NAME)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def load(self) -> tuple[CollectionManifest, faiss.Index]:
        """Read the committed manifest and its index."""
        try:
            manifest = CollectionManifest.model_validate_json((self.path / MANIFEST_NAME).read_bytes())
        except (OSError, ValueError) as exc:
            raise StorageCorruptError(f"{self.path}: unreadable manifest: {exc}") from exc
        if manifest.format != FORMAT_VERSION:
            raise StorageCorruptError(f"{self.path}: unknown format {manifest.format}")
        try:
            index = faiss.read_index(str(self.path / manifest.index_file))
        except RuntimeError as exc:
            raise StorageCorruptError(f"{self.path}: unreadable index: {exc}") from exc
        return manifest, index

    def remove_garbage(self, manifest: CollectionManifest) -> None:
        """Delete what interrupted saves and deletions left: only files no manifest names."""
        live_seqs = {d.seq for d in manifest.documents}
        removed = 0
        for entry in self.path.iterdir():
            if TMP_MARKER in entry.name or (_INDEX_FILE.match(entry.name) and entry.name != manifest.index_file):
                entry.unlink(missing_ok=True)
                removed += 1
        for entry in self.chunks_dir.iterdir():
            match = _CHUNKS_FILE.match(entry.name)
            if TMP_MARKER in entry.name or (match and int(match.group(1)) not in live_seqs):
                entry.unlink(missing_ok=True)
                removed += 1
        if removed:
            logger.info("%s: removed %d leftover file(s)", self.path, removed)

    def _remove_index_files(self, keep: str) -> None:
        for entry in self.path.iterdir():
            if _INDEX_FILE.match(entry.name) and entry.name != keep:
                entry.unlink(missing_ok=True)
