"""A named set of documents whose chunks are searchable by vector, backed by FAISS.

This module keeps the documents' bookkeeping (the document and chunk tables, adding, deleting,
reading) and the collection's persistence; the FAISS index itself (its kinds, search, deletion by
tombstones and compaction) is ``retrieval.faiss_index``'s. Chunk ids are int64s handed out in
increasing order and never reused, so a document's chunks are the contiguous range
``[first_chunk_id, first_chunk_id + chunk_count)`` and stay stable across rebuilds and reloads.

Persistence (when the collection has a CollectionDir): every mutation commits before returning.
The commit's snapshot (index bytes, manifest) is taken under the mutation lock, which is then
released so searches go on while the files are written; a second lock keeps commits in order. A
tombstone-only delete rewrites just the manifest: tombstones are the index ids no document owns.
If a commit fails the exception propagates and memory stays ahead of disk until the next
successful commit.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from retrieval.config import IndexConfig
from retrieval.errors import (
    DocumentExistsError,
    DocumentNotFoundError,
    InvalidInputError,
    StorageCorruptError,
)
from retrieval.faiss_index import FaissIndexMixin, new_index
from retrieval.persistence import CollectionDir, index_file_name
from retrieval.records import (
    CollectionInfo,
    CollectionStats,
    DocumentInfo,
    FileCounts,
    validate_attributes,
    validate_metadata,
)
from retrieval.tenancy import OPERATOR

logger = logging.getLogger(__name__)


def new_collection_id() -> str:
    """An OpenAI-style vector store id."""
    return f"vs_{secrets.token_hex(12)}"


@dataclass(slots=True)
class _Document:
    doc_id: str
    seq: int
    source: str
    attributes: dict
    created_at: int
    first_chunk_id: int
    chunk_count: int
    usage_bytes: int
    chunking: dict | None = None

    def entry(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    def info(self) -> DocumentInfo:
        return DocumentInfo(
            self.doc_id,
            self.source,
            dict(self.attributes),
            self.created_at,
            self.chunk_count,
            self.usage_bytes,
            dict(self.chunking) if self.chunking is not None else None,
        )


# What Collection.refresh takes over from a freshly loaded copy: everything loaded from disk.
_RELOADED = (
    "name",
    "metadata",
    "last_active_at",
    "index_config",
    "_index",
    "_inner",
    "_docs",
    "_chunks",
    "_next_chunk_id",
    "_next_doc_seq",
    "_version",
    "_committed_index_file",
    "_disk_signature",
)


@dataclass(slots=True)
class _PendingCommit:
    manifest: dict
    index_bytes: np.ndarray | None


class Collection(FaissIndexMixin):
    """Documents split into chunks, their vectors in FAISS and their metadata beside it.

    Thread-safe: one lock serialises mutations and searches (FAISS must not be read while it is
    written). Use ``Collection.create``/``Collection.load`` for a persistent collection and the
    constructor for an in-memory one.
    """

    def __init__(
        self,
        *,
        name: str,
        dimension: int,
        index_config: IndexConfig | None = None,
        metadata: Mapping[str, str] | None = None,
        id: str | None = None,
        created_at: int | None = None,
        owner: str = OPERATOR,
    ) -> None:
        if dimension < 1:
            raise InvalidInputError("dimension must be positive")
        self.id = id or new_collection_id()
        self.name = name
        # Who owns it (see retrieval.tenancy): fixed at creation, persisted in the manifest.
        self.owner = owner
        self.dimension = dimension
        self.created_at = created_at if created_at is not None else int(time.time())
        self.last_active_at = self.created_at
        self.metadata = validate_metadata(metadata)
        self.index_config = index_config or IndexConfig()
        self._index, self._inner = new_index(dimension, self.index_config)
        self._docs: dict[str, _Document] = {}
        # chunk id -> (document, chunk index, text): one dict lookup per hit.
        self._chunks: dict[int, tuple[_Document, int, str]] = {}
        self._next_chunk_id = 0
        self._next_doc_seq = 0
        self._version = 0
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()
        self._storage: CollectionDir | None = None
        # Guarded by _save_lock: what the committed manifest on disk names.
        self._committed_index_file: str | None = None
        # The manifest file this object last loaded or wrote (see refresh).
        self._disk_signature: tuple[int, ...] | None = None

    # -- persistence -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: Path,
        *,
        name: str,
        dimension: int,
        index_config: IndexConfig | None = None,
        metadata: Mapping[str, str] | None = None,
        id: str | None = None,
        owner: str = OPERATOR,
    ) -> Collection:
        """Create an empty collection and its directory at ``path``."""
        coll = cls(
            name=name,
            dimension=dimension,
            index_config=index_config,
            metadata=metadata,
            id=id,
            owner=owner,
        )
        coll._committed_index_file = index_file_name(0)
        manifest = coll._manifest(coll._committed_index_file)
        coll._storage = CollectionDir.create(path, manifest, faiss.serialize_index(coll._index))
        return coll

    @classmethod
    def load(cls, path: Path, *, collect_garbage: bool = True) -> Collection:
        """Load the last committed state at ``path`` and delete crash leftovers there (only when
        ``collect_garbage``: on shared storage, only a process holding the write lock may, since
        another writer's files in progress look like leftovers)."""
        storage = CollectionDir(path)
        manifest, index = storage.load()
        coll = cls(
            name=manifest.name,
            dimension=manifest.dimension,
            index_config=manifest.index,
            metadata=manifest.metadata,
            id=manifest.id,
            created_at=manifest.created_at,
            owner=manifest.owner,
        )
        coll.last_active_at = manifest.last_active_at
        coll._index = index
        coll._inner = faiss.downcast_index(index.index)
        if manifest.index.kind == "hnsw":
            coll._inner.hnsw.efSearch = manifest.index.ef_search
        coll._next_chunk_id, coll._next_doc_seq = manifest.next_chunk_id, manifest.next_doc_seq
        coll._version = manifest.version
        coll._committed_index_file = manifest.index_file
        for entry in manifest.documents:
            doc = _Document(**entry.model_dump())
            texts = storage.read_chunks(doc.seq) if doc.chunk_count else []
            if len(texts) != doc.chunk_count:
                raise StorageCorruptError(f"{path}: document {doc.doc_id!r} lost chunks")
            coll._docs[doc.doc_id] = doc
            for i, text in enumerate(texts):
                coll._chunks[doc.first_chunk_id + i] = (doc, i, text)
        ids = faiss.vector_to_array(index.id_map)
        live = np.fromiter(coll._chunks, dtype=np.int64, count=len(coll._chunks))
        if not np.isin(live, ids).all() or (manifest.index.kind == "flat" and ids.size != live.size):
            raise StorageCorruptError(f"{path}: index and manifest disagree")
        if collect_garbage:
            storage.remove_garbage(manifest)
        coll._storage = storage
        coll._disk_signature = storage.manifest_signature()
        return coll

    def refresh(self) -> bool:
        """Catch up with a commit another process made to this collection's directory (shared
        storage, ``retrieval.shared_storage``): reload it in place, so every holder of this object
        sees it. Cheap when nothing changed (one ``stat``). True if it reloaded."""
        if self._storage is None:
            return False
        if self._storage.manifest_signature() == self._disk_signature:
            return False
        fresh = Collection.load(self._storage.path, collect_garbage=False)
        # In _begin_commit's order: _lock, then _save_lock (no commit of ours is half done).
        with self._lock, self._save_lock:
            if fresh._version == self._version:
                self._disk_signature = fresh._disk_signature  # our own commit
                return False
            for name in _RELOADED:
                setattr(self, name, getattr(fresh, name))
        logger.debug("collection %s: reloaded version %d from disk", self.id, self._version)
        return True

    def _manifest(self, index_file: str) -> dict:
        return {
            "format": 1,
            "version": self._version,
            "id": self.id,
            "name": self.name,
            "created_at": self.created_at,
            "last_active_at": self.last_active_at,
            "metadata": self.metadata,
            "dimension": self.dimension,
            "index": self.index_config.model_dump(),
            "next_chunk_id": self._next_chunk_id,
            "next_doc_seq": self._next_doc_seq,
            "index_file": index_file,
            "documents": [d.entry() for d in self._docs.values()],
            "owner": self.owner,
        }

    def _begin_commit(self, index_changed: bool) -> _PendingCommit | None:
        """Snapshot the state; call with ``_lock`` held. Returns holding ``_save_lock``."""
        self.last_active_at = int(time.time())
        if self._storage is None:
            return None
        self._version += 1
        self._save_lock.acquire()
        try:
            write_index = index_changed or self._committed_index_file is None
            index_file = index_file_name(self._version) if write_index else self._committed_index_file
            index_bytes = faiss.serialize_index(self._index) if write_index else None
            return _PendingCommit(self._manifest(index_file), index_bytes)
        except BaseException:
            self._committed_index_file = None  # this version's changes were never written
            self._save_lock.release()
            raise

    def _finish_commit(self, pending: _PendingCommit | None) -> None:
        """Write a snapshot; call without ``_lock``, releases ``_save_lock``."""
        if pending is None:
            return
        try:
            assert self._storage is not None
            self._storage.commit(pending.manifest, pending.index_bytes)
            self._committed_index_file = pending.manifest["index_file"]
            self._disk_signature = self._storage.manifest_signature()
        except BaseException:
            # The named index file may not exist: the next commit must write the index.
            if pending.index_bytes is not None:
                self._committed_index_file = None
            raise
        finally:
            self._save_lock.release()

    # -- mutations ---------------------------------------------------------------------------

    def add_document(
        self,
        doc_id: str,
        chunks: Sequence[str],
        vectors: np.ndarray,
        source: str = "",
        attributes: Mapping[str, object] | None = None,
        chunking: Mapping[str, int] | None = None,
    ) -> int:
        """Add a document's chunks and their vectors (one row each); returns the chunk count.

        Vectors should be L2-normalised: scores are inner products. ``chunking`` records how the
        chunks were made (e.g. ``ChunkingConfig.model_dump()``), for the API to report.
        """
        if not isinstance(doc_id, str) or not doc_id:
            raise InvalidInputError("doc_id must be a non-empty string")
        if isinstance(chunks, str) or not all(isinstance(c, str) for c in chunks):
            raise InvalidInputError("chunks must be a list of strings")
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.shape != (len(chunks), self.dimension) and not (len(chunks) == 0 and vectors.size == 0):
            raise InvalidInputError(f"vectors must have shape ({len(chunks)}, {self.dimension}), got {vectors.shape}")
        if not np.isfinite(vectors).all():
            raise InvalidInputError("vectors must be finite")
        attrs = validate_attributes(attributes)
        texts = list(chunks)
        with self._lock:
            if doc_id in self._docs:
                raise DocumentExistsError(f"document {doc_id!r} already exists")
            seq = self._next_doc_seq
            self._next_doc_seq += 1
        if self._storage is not None and texts:
            # Before the manifest names it; an orphan (failure, race, crash) is collected at load.
            self._storage.write_chunks(seq, texts)
        with self._lock:
            if doc_id in self._docs:
                raise DocumentExistsError(f"document {doc_id!r} already exists")
            first = self._next_chunk_id
            if texts:
                self._index.add_with_ids(vectors, np.arange(first, first + len(texts), dtype=np.int64))
            self._next_chunk_id += len(texts)
            usage = sum(len(t.encode("utf-8")) for t in texts) + vectors.nbytes
            doc = _Document(
                doc_id,
                seq,
                source,
                attrs,
                int(time.time()),
                first,
                len(texts),
                usage,
                dict(chunking) if chunking is not None else None,
            )
            self._docs[doc_id] = doc
            for i, text in enumerate(texts):
                self._chunks[first + i] = (doc, i, text)
            pending = self._begin_commit(index_changed=bool(texts))
        self._finish_commit(pending)
        logger.debug("collection %s: added %s (%d chunks)", self.id, doc_id, len(texts))
        return len(texts)

    def delete_document(self, doc_id: str) -> int:
        """Remove a document and its chunks from search; returns how many chunks it had."""
        with self._lock:
            doc = self._docs.pop(doc_id, None)
            if doc is None:
                raise DocumentNotFoundError(f"no document {doc_id!r} in collection {self.id}")
            end = doc.first_chunk_id + doc.chunk_count
            for chunk_id in range(doc.first_chunk_id, end):
                del self._chunks[chunk_id]
            index_changed = self._remove_from_index(doc.first_chunk_id, doc.chunk_count)
            pending = self._begin_commit(index_changed)
        self._finish_commit(pending)
        if self._storage is not None:
            self._storage.remove_chunks(doc.seq)
        logger.debug("collection %s: deleted %s (%d chunks)", self.id, doc_id, doc.chunk_count)
        return doc.chunk_count

    def update_attributes(self, doc_id: str, attributes: Mapping[str, object] | None) -> DocumentInfo:
        """Replace a document's attributes (OpenAI's update of a vector store file)."""
        attrs = validate_attributes(attributes)
        with self._lock:
            doc = self._docs.get(doc_id)
            if doc is None:
                raise DocumentNotFoundError(f"no document {doc_id!r} in collection {self.id}")
            doc.attributes = attrs
            info = doc.info()
            pending = self._begin_commit(index_changed=False)
        self._finish_commit(pending)
        return info

    def update_info(self, *, name: str | None = None, metadata: Mapping[str, str] | None = None) -> CollectionInfo:
        """Rename and/or replace metadata. Name uniqueness is the CollectionStore's job."""
        checked = validate_metadata(metadata) if metadata is not None else None
        with self._lock:
            if name is not None:
                self.name = name
            if checked is not None:
                self.metadata = checked
            info = self._info()
            pending = self._begin_commit(index_changed=False)
        self._finish_commit(pending)
        return info

    # -- reads -------------------------------------------------------------------------------

    def get_document(self, doc_id: str) -> DocumentInfo:
        with self._lock:
            doc = self._docs.get(doc_id)
            if doc is None:
                raise DocumentNotFoundError(f"no document {doc_id!r} in collection {self.id}")
            return doc.info()

    def list_documents(self) -> list[DocumentInfo]:
        """Documents in the order they were added."""
        with self._lock:
            return [d.info() for d in self._docs.values()]

    def document_chunks(self, doc_id: str) -> list[str]:
        """A document's chunk texts in order (OpenAI's vector store file content)."""
        with self._lock:
            doc = self._docs.get(doc_id)
            if doc is None:
                raise DocumentNotFoundError(f"no document {doc_id!r} in collection {self.id}")
            start = doc.first_chunk_id
            return [self._chunks[start + i][2] for i in range(doc.chunk_count)]

    def info(self) -> CollectionInfo:
        with self._lock:
            return self._info()

    def _info(self) -> CollectionInfo:
        return CollectionInfo(
            id=self.id,
            name=self.name,
            created_at=self.created_at,
            last_active_at=self.last_active_at,
            metadata=dict(self.metadata),
            usage_bytes=sum(d.usage_bytes for d in self._docs.values()),
            file_counts=FileCounts(completed=len(self._docs)),
        )

    def holds_chunks(self) -> bool:
        """Whether a search could find anything: ``stats().chunks`` without summing every document."""
        return bool(self._chunks)

    def stats(self) -> CollectionStats:
        with self._lock:
            return CollectionStats(
                kind=self.index_config.kind,
                dimension=self.dimension,
                documents=len(self._docs),
                chunks=len(self._chunks),
                index_vectors=self._index.ntotal,
                tombstones=self._tombstones(),
                usage_bytes=sum(d.usage_bytes for d in self._docs.values()),
            )
