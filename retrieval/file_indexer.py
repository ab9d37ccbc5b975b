"""Indexing an uploaded file into a vector store, end to end, inside the Retriever deployment.

``FileIndexer.index`` reads the upload, decodes and chunks it (``retrieval.ingest``, in a worker
thread), embeds every chunk through the ``Embedder`` deployment (one ``handle.remote()`` call
per chunk, gathered together so that Serve batches them) and adds the chunks to the collection.
It answers once the file is indexed (``completed``) or has failed: a failure is recorded in
``FailedFiles`` and answered as a ``failed`` vector store file with ``last_error``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from ray.serve.handle import DeploymentHandle, DeploymentResponse

from retrieval import openai_objects as oai
from retrieval.collection import Collection
from retrieval.config import ChunkingConfig, IngestLimits
from retrieval.encoder import DocumentTokenizer
from retrieval.errors import DocumentExistsError, DocumentNotFoundError
from retrieval.files import FileStore
from retrieval.ingest import (
    ChunkTokens,
    FailedFile,
    FailedFiles,
    IngestFailure,
    decode_document,
    split_document,
)

logger = logging.getLogger(__name__)


class FileIndexer:
    """Adds uploads from ``files`` to collections, recording failures in ``failed``.

    ``tokenizer`` must be the embedding model's, so that chunk token counts are the model's.
    """

    def __init__(
        self,
        embedder: DeploymentHandle,
        files: FileStore,
        failed: FailedFiles,
        tokenizer: DocumentTokenizer,
        limits: IngestLimits | None = None,
    ) -> None:
        self._embedder = embedder
        self._files = files
        self._failed = failed
        self._tokenizer = tokenizer
        self._limits = limits or IngestLimits()
        # (store id, file id) pairs being ingested: a second add of the same pair is a 409.
        self._ingesting: set[tuple[str, str]] = set()

    async def index(
        self,
        coll: Collection,
        file_id: str,
        filename: str,
        attributes: dict,
        chunking: ChunkingConfig,
    ) -> dict[str, Any]:
        """Index one upload into ``coll``; the OpenAI vector store file (``completed`` or
        ``failed``). A file already in the store, or being added to it, is a DocumentExistsError."""
        key = (coll.id, file_id)
        if key in self._ingesting or _has_document(coll, file_id):
            raise DocumentExistsError(f"file {file_id!r} is already in vector store {coll.id!r}", param="file_id")
        self._ingesting.add(key)
        started = time.perf_counter()
        try:
            try:
                pieces = await asyncio.to_thread(self._prepare, file_id, chunking)
            except IngestFailure as failure:
                return await self._fail(coll, file_id, attributes, chunking, failure)
            try:
                rows = await self._embed(pieces)
            except Exception:
                logger.exception("embedding %s for %s failed", file_id, coll.id)
                failure = IngestFailure("server_error", "embedding the file failed; add it again")
                return await self._fail(coll, file_id, attributes, chunking, failure)
            await asyncio.to_thread(
                coll.add_document,
                file_id,
                [p.text for p in pieces],
                np.vstack(rows),
                source=filename,
                attributes=attributes,
                chunking=chunking.model_dump(),
            )
            await asyncio.to_thread(self._failed.discard, coll.id, file_id)
            logger.info(
                "indexed %s into %s: %d chunks in %.2fs",
                file_id,
                coll.id,
                len(pieces),
                time.perf_counter() - started,
            )
            return oai.vector_store_file(coll.id, coll.get_document(file_id))
        finally:
            self._ingesting.discard(key)

    def _prepare(self, file_id: str, chunking: ChunkingConfig) -> list[ChunkTokens]:
        limits = self._limits
        # Checked before reading: the tokenizer never sees more than max_index_bytes.
        size = self._files.get(file_id).bytes
        if size > limits.max_index_bytes:
            raise IngestFailure(
                "invalid_file", f"the file has {size} bytes; at most {limits.max_index_bytes} are indexed"
            )
        text = decode_document(self._files.read(file_id))
        pieces = split_document(text, chunking, self._tokenizer)
        if len(pieces) > limits.max_chunks_per_file:
            raise IngestFailure(
                "invalid_file", f"the file makes {len(pieces)} chunks; at most {limits.max_chunks_per_file} are indexed"
            )
        return pieces

    async def _embed(self, pieces: list[ChunkTokens]) -> list[np.ndarray]:
        """Every chunk's vector, with at most ``embed_concurrency`` calls in flight: the
        Embedder still batches them, and its queue stays bounded whatever the file."""
        step = self._limits.embed_concurrency
        rows: list[np.ndarray] = []
        for start in range(0, len(pieces), step):
            batch = pieces[start : start + step]
            rows += await gather_responses([self._embedder.embed_tokens.remote(p.ids) for p in batch])
        return rows

    async def _fail(
        self,
        coll: Collection,
        file_id: str,
        attributes: dict,
        chunking: ChunkingConfig,
        failure: IngestFailure,
    ) -> dict[str, Any]:
        failed = FailedFile(
            file_id=file_id,
            created_at=int(time.time()),
            code=failure.code,
            message=failure.message,
            attributes=dict(attributes),
            chunking=chunking.model_dump(),
        )
        await asyncio.to_thread(self._failed.add, coll.id, failed)
        logger.info("could not index %s into %s: %s", file_id, coll.id, failure.code)
        return oai.failed_vector_store_file(coll.id, failed)


async def gather_responses(responses: Sequence[DeploymentResponse]) -> list:
    """Await every response; on the first failure cancel the rest and raise it."""
    try:
        return list(await asyncio.gather(*responses))
    except BaseException:
        for response in responses:
            response.cancel()
        raise


def _has_document(coll: Collection, file_id: str) -> bool:
    try:
        coll.get_document(file_id)
    except DocumentNotFoundError:
        return False
    return True
