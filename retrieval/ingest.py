"""Turning an uploaded file into chunks ready to embed, and remembering files that failed to.

Ray-free: the retrieval deployment's indexing (``retrieval.file_indexer``) calls these from
worker threads.
"""

from __future__ import annotations

import bisect
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from retrieval.chunking import chunk_text
from retrieval.config import ChunkingConfig
from retrieval.encoder import DocumentTokenizer
from retrieval.errors import InvalidInputError, StorageCorruptError
from retrieval.persistence import atomic_write

FailureCode = Literal["server_error", "unsupported_file", "invalid_file"]

# OpenAI's ``auto`` strategy is 800/400 tokens, more than MiniLM's window; ``auto`` here means
# the deployment's configured ChunkingConfig.
AUTO_STRATEGY = "auto"
STATIC_STRATEGY = "static"


class IngestFailure(Exception):
    """Why a file could not be indexed; becomes the vector store file's ``last_error``."""

    def __init__(self, code: FailureCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class ChunkTokens:
    """One chunk: its text, and its token ids (no special tokens) in the embedding model's vocab."""

    text: str
    ids: list[int]


def decode_document(content: bytes) -> str:
    """The text of an uploaded file: UTF-8 (a BOM is dropped) with something in it.

    Only plain text and markdown are indexed; anything else is an IngestFailure.
    """
    if b"\x00" in content:
        raise IngestFailure("unsupported_file", "binary file: only UTF-8 text or markdown is indexed")
    try:
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise IngestFailure(
            "unsupported_file",
            f"not UTF-8 text (byte {exc.start}): only text or markdown is indexed",
        ) from exc
    if not text.strip():
        raise IngestFailure("invalid_file", "the file has no text")
    return text


def split_document(text: str, config: ChunkingConfig, tokenizer: DocumentTokenizer) -> list[ChunkTokens]:
    """Chunk ``text`` on the embedding model's own tokens and keep each chunk's token ids.

    Embedding the ids (not re-tokenizing the chunk text) guarantees every chunk fits the model:
    a chunk cut inside a word would tokenize differently, possibly longer, on its own.
    """
    ids, spans = tokenizer.ids_and_spans(text)
    chunks = chunk_text(text, config, token_spans=lambda _: spans)
    starts = [s for s, _ in spans]
    out = []
    for chunk in chunks:
        first = bisect.bisect_left(starts, chunk.start)
        out.append(ChunkTokens(chunk.text, ids[first : first + chunk.token_count]))
    if not out:
        raise IngestFailure("invalid_file", "the file has no text the embedding model can read")
    return out


def chunking_from_strategy(strategy: dict | None, default: ChunkingConfig, limit: int) -> ChunkingConfig:
    """The ChunkingConfig an OpenAI ``chunking_strategy`` asks for.

    ``None`` or ``{"type": "auto"}`` is ``default``; ``{"type": "static", "static": {...}}`` must
    fit the embedding model (``limit`` tokens per chunk), or it is a 400.
    """
    if strategy is None:
        return default
    if not isinstance(strategy, dict):
        raise InvalidInputError("chunking_strategy must be an object", param="chunking_strategy")
    kind = strategy.get("type")
    if kind == AUTO_STRATEGY and set(strategy) == {"type"}:
        return default
    if kind != STATIC_STRATEGY or set(strategy) != {"type", "static"}:
        raise InvalidInputError(
            "chunking_strategy must be {'type': 'auto'} or {'type': 'static', 'static': {...}}",
            param="chunking_strategy",
        )
    try:
        config = ChunkingConfig.model_validate(strategy["static"])
    except ValueError as exc:
        raise InvalidInputError(f"invalid static chunking strategy: {exc}", param="chunking_strategy") from exc
    if config.max_chunk_size_tokens > limit:
        raise InvalidInputError(
            f"max_chunk_size_tokens must be at most {limit} for this embedding model",
            param="chunking_strategy",
        )
    return config


@dataclass(frozen=True, slots=True)
class FailedFile:
    """A file that was added to a vector store but could not be indexed."""

    file_id: str
    created_at: int
    code: FailureCode
    message: str
    attributes: dict
    chunking: dict | None


class FailedFiles:
    """Failed vector store files, per store, in one JSON file rewritten atomically on change.

    Collections hold only indexed documents; OpenAI's API also lists files that failed, with
    their ``last_error``, until they are deleted or retried.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stores: dict[str, dict[str, FailedFile]] = {}
        self.reload()

    def reload(self) -> None:
        """Read the file again (another process sharing it may have rewritten it)."""
        stores: dict[str, dict[str, FailedFile]] = {}
        if self.path.exists():
            try:
                raw = json.loads(self.path.read_bytes())
                stores = {store: {f["file_id"]: FailedFile(**f) for f in files} for store, files in raw.items()}
            except (OSError, ValueError, TypeError, KeyError) as exc:
                raise StorageCorruptError(f"{self.path}: {exc}") from exc
        with self._lock:
            self._stores = stores

    def add(self, store_id: str, failed: FailedFile) -> None:
        with self._lock:
            self._stores.setdefault(store_id, {})[failed.file_id] = failed
            self._save()

    def get(self, store_id: str, file_id: str) -> FailedFile | None:
        with self._lock:
            return self._stores.get(store_id, {}).get(file_id)

    def list(self, store_id: str) -> list[FailedFile]:
        with self._lock:
            return list(self._stores.get(store_id, {}).values())

    def count(self, store_id: str) -> int:
        with self._lock:
            return len(self._stores.get(store_id, {}))

    def discard(self, store_id: str, file_id: str) -> bool:
        """Forget one failed file; True if there was one."""
        with self._lock:
            files = self._stores.get(store_id, {})
            if file_id not in files:
                return False
            del files[file_id]
            if not files:
                del self._stores[store_id]
            self._save()
            return True

    def discard_file(self, file_id: str) -> None:
        """Forget a deleted upload in every store."""
        with self._lock:
            changed = False
            for store_id in list(self._stores):
                if self._stores[store_id].pop(file_id, None) is not None:
                    changed = True
                    if not self._stores[store_id]:
                        del self._stores[store_id]
            if changed:
                self._save()

    def discard_store(self, store_id: str) -> None:
        with self._lock:
            if self._stores.pop(store_id, None) is not None:
                self._save()

    def _save(self) -> None:
        data = {
            store: [
                {
                    "file_id": f.file_id,
                    "created_at": f.created_at,
                    "code": f.code,
                    "message": f.message,
                    "attributes": f.attributes,
                    "chunking": f.chunking,
                }
                for f in files.values()
            ]
            for store, files in self._stores.items()
        }
        atomic_write(self.path, json.dumps(data).encode("utf-8"))
