"""The retrieval deployment: OpenAI's files and vector stores API, and the chat path's retrieval.

``Retriever`` owns the on-disk state (uploaded files, collections, failed-ingest records under
``RetrievalConfig.storage_dir``) and asks the ``Embedder`` deployment for the vectors of the
documents it indexes, one input per ``handle.remote()`` call gathered together, so that Serve
batches them. Search queries are embedded in this replica (``RetrievalConfig.query_encoder``,
an int8 ONNX copy of the same model) unless the config sends them to the Embedder too. Every public method
returns OpenAI-shaped dicts (see ``retrieval.openai_objects``) or, for ``retrieve``, typed
``Passage`` records, and raises ``retrieval.errors`` types that carry their HTTP status.

Ingestion is synchronous: ``add_file_to_store`` answers once the file is indexed (``completed``)
or has failed (``failed`` with ``last_error``), never ``in_progress``; the indexing itself is
``retrieval.file_indexer``'s.

Tenancy: every method that touches files or stores takes ``caller`` (a ``retrieval.tenancy.Caller``,
built by the gateway from the request's principal). Files and stores are recorded with their
owner; someone else's object is answered exactly like a missing one (same error, same message),
lists show only the caller's objects, and a store named by name resolves only among the caller's
own stores. ``retrieve`` (the chat path) also searches the stores a model's policy names: by id,
whoever owns them, or by name among the operator's stores only. Those lookup rules live in
``retrieval.store_resolution``; the checks of request arguments in ``retrieval.request_args``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from retrieval import openai_objects as oai
from retrieval.collection import Collection
from retrieval.config import SPECIAL_TOKENS_PER_INPUT, ChunkingConfig, RetrievalConfig
from retrieval.embeddings import LocalEmbeddings, SharedEmbeddings, TextEmbeddings
from retrieval.encoder import DocumentTokenizer
from retrieval.errors import CollectionNotFoundError, DocumentNotFoundError, InvalidInputError
from retrieval.file_indexer import FileIndexer
from retrieval.files import FileStore
from retrieval.ingest import FailedFiles, chunking_from_strategy
from retrieval.records import Hit, Passage, validate_attributes
from retrieval.request_args import (
    check_file_status_filter,
    check_max_num_results,
    check_purpose,
    check_retrieval_args,
    parse_filter,
    score_threshold,
    search_queries,
    string_list,
)
from retrieval.shared_storage import (
    COLLECTION_WRITES,
    FAILED_WRITES,
    FILE_WRITES,
    STORE_WRITES,
    SharedStorage,
    WriteLocked,
)
from retrieval.store import CollectionStore
from retrieval.store_resolution import owned_store, policy_stores, requested_store
from retrieval.tenancy import Caller, owner_of

logger = logging.getLogger(__name__)

# Vectors a chat search scans at most on the event loop (flat, 2048: 0.1 ms here); more: a thread.
_INLINE_SEARCH_VECTORS = 2048


def _current(method):
    """Run a public method on this replica's state caught up with other replicas' writes."""

    @functools.wraps(method)
    async def caught_up(self: Retriever, *args: Any, **kwargs: Any) -> Any:
        await asyncio.to_thread(self._shared.sync)
        return await method(self, *args, **kwargs)

    return caught_up


# Any number of replicas, on any nodes that mount storage_dir: they take turns writing and
# reload after each other's writes (retrieval.shared_storage).
@serve.deployment(name="Retriever", num_replicas=1, max_ongoing_requests=64)
class Retriever:
    """Vector stores, uploaded files and search, on disk under ``config.storage_dir``."""

    async def __init__(self, embedder: DeploymentHandle, config: RetrievalConfig) -> None:
        self._embedder = embedder
        self._config = config
        info = await embedder.info.remote()
        # Queries: one short text per search, where the replica's own ONNX encoder is
        # several times faster than a round trip to the Embedder and its batch wait.
        self._queries: TextEmbeddings = (
            await asyncio.to_thread(LocalEmbeddings.shared, config.query_encoder)
            if config.query_encoder is not None
            else SharedEmbeddings(embedder)
        )
        self._chunk_limit = info["max_tokens"] - SPECIAL_TOKENS_PER_INPUT
        if config.chunking.max_chunk_size_tokens > self._chunk_limit:
            raise ValueError(
                f"chunking.max_chunk_size_tokens ({config.chunking.max_chunk_size_tokens}) exceeds "
                f"what the embedding model takes ({self._chunk_limit} + special tokens)"
            )
        root = Path(config.storage_dir)
        self._shared = SharedStorage(root)

        def open_storage() -> tuple:
            # The Embedder's tokenizer (same folder), so chunk token counts are the model's.
            tokenizer = DocumentTokenizer(info["model_path"])
            # Exclusive: no other replica is mid-write, so leftovers are a crash's and go.
            with self._shared.exclusive():
                stores = CollectionStore(
                    root / "vector_stores",
                    dimension=info["dimension"],
                    default_index=config.index,
                    unique_names=False,  # OpenAI allows duplicate names; see CollectionStore
                )
                files = FileStore(root / "files", max_bytes=config.ingest.max_upload_bytes)
                failed = FailedFiles(root / "failed.json")
                self._shared.mark_current()

            def reload() -> None:
                stores.refresh()
                files.refresh()
                failed.reload()

            self._shared.set_reload(reload)
            # Their writes take the storage's write lock (the Retriever's own and FileIndexer's).
            return (
                tokenizer,
                WriteLocked(stores, self._shared, STORE_WRITES),
                WriteLocked(files, self._shared, FILE_WRITES),
                WriteLocked(failed, self._shared, FAILED_WRITES),
            )

        tokenizer, self._stores, self._files, self._failed = await asyncio.to_thread(open_storage)
        self._indexer = FileIndexer(embedder, self._files, self._failed, tokenizer, config.ingest)
        logger.info("retriever ready: %s, embedding model %s", root, info["model"])

    async def check_health(self) -> None:
        """Serve's health check, and the ingress's readiness probe: the replica answers."""

    # --- vector stores ------------------------------------------------------------------

    @_current
    async def create_store(
        self,
        name: str | None = None,
        metadata: dict[str, str] | None = None,
        file_ids: list[str] | None = None,
        chunking_strategy: dict | None = None,
        *,
        caller: Caller,
    ) -> dict[str, Any]:
        """Create a vector store owned by ``caller`` and index ``file_ids`` (the caller's own
        files) into it before answering."""
        owner = owner_of(caller)
        file_ids = string_list(file_ids or [], "file_ids", max_items=self._config.ingest.max_files_per_request)
        # 404 before creating
        uploads = [self._files.get(f, owner=owner) for f in dict.fromkeys(file_ids)]
        chunking = self._chunking(chunking_strategy)
        coll = await asyncio.to_thread(self._stores.create, name, metadata=metadata, owner=owner)
        await asyncio.gather(
            *(self._indexer.index(self._locked(coll), u.id, u.filename, {}, chunking) for u in uploads)
        )
        return self._store_object(coll)

    @_current
    async def list_stores(
        self,
        limit: int = 20,
        order: oai.Order = "desc",
        after: str | None = None,
        before: str | None = None,
        *,
        caller: Caller,
    ) -> dict[str, Any]:
        """The caller's stores; a cursor naming anyone else's store is an unknown id."""
        infos = self._stores.list(owner=owner_of(caller))
        return oai.page(
            infos,
            item_id=lambda i: i.id,
            render=lambda i: oai.vector_store(i, self._failed.count(i.id)),
            limit=limit,
            order=order,
            after=after,
            before=before,
        )

    @_current
    async def get_store(self, store_id: str, *, caller: Caller) -> dict[str, Any]:
        return self._store_object(owned_store(self._stores, store_id, caller))

    @_current
    async def modify_store(
        self,
        store_id: str,
        name: str | None = None,
        metadata: dict[str, str] | None = None,
        *,
        caller: Caller,
    ) -> dict[str, Any]:
        coll = owned_store(self._stores, store_id, caller)
        info = await asyncio.to_thread(self._stores.update, coll.id, name=name, metadata=metadata)
        return oai.vector_store(info, self._failed.count(coll.id))

    @_current
    async def delete_store(self, store_id: str, *, caller: Caller) -> dict[str, Any]:
        coll = owned_store(self._stores, store_id, caller)

        def delete() -> None:
            with self._shared.write():
                self._stores.delete(coll.id)
                self._failed.discard_store(coll.id)

        await asyncio.to_thread(delete)
        return oai.deleted("vector_store.deleted", coll.id)

    # --- files --------------------------------------------------------------------------

    @_current
    async def create_file(
        self, filename: str, content: bytes, purpose: str = "assistants", *, caller: Caller
    ) -> dict[str, Any]:
        owner = owner_of(caller)
        check_purpose(purpose)
        if not isinstance(content, (bytes, bytearray)):
            raise InvalidInputError("file content must be bytes", param="file")
        stored = await asyncio.to_thread(self._files.create, filename, bytes(content), purpose, owner=owner)
        return oai.file_object(stored)

    @_current
    async def list_files(
        self,
        purpose: str | None = None,
        limit: int = 10000,
        order: oai.Order = "desc",
        after: str | None = None,
        *,
        caller: Caller,
    ) -> dict[str, Any]:
        """The caller's files; a cursor naming anyone else's file is an unknown id."""
        owner = owner_of(caller)
        check_purpose(purpose, optional=True)
        return oai.page(
            self._files.list(purpose, owner=owner),  # type: ignore[arg-type]
            item_id=lambda f: f.id,
            render=oai.file_object,
            limit=limit,
            order=order,
            after=after,
            max_limit=10000,
        )

    @_current
    async def get_file(self, file_id: str, *, caller: Caller) -> dict[str, Any]:
        return oai.file_object(self._files.get(file_id, owner=owner_of(caller)))

    @_current
    async def get_file_content(self, file_id: str, *, caller: Caller) -> bytes:
        return await asyncio.to_thread(self._files.read, file_id, owner=owner_of(caller))

    @_current
    async def delete_file(self, file_id: str, *, caller: Caller) -> dict[str, Any]:
        """Delete an upload and remove it from every vector store that indexed it: the
        caller's own stores, the only ones a file of theirs can be added to."""
        owner = owner_of(caller)
        self._files.get(file_id, owner=owner)

        def remove_everywhere() -> None:
            with self._shared.write():
                for store_id in self._stores.ids(owner=owner):
                    try:
                        self._stores.get_by_id(store_id, owner=owner).delete_document(file_id)
                    except (CollectionNotFoundError, DocumentNotFoundError):
                        pass
                self._failed.discard_file(file_id)
                self._files.delete(file_id)

        await asyncio.to_thread(remove_everywhere)
        return oai.deleted("file", file_id)

    # --- vector store files -------------------------------------------------------------

    @_current
    async def add_file_to_store(
        self,
        store_id: str,
        file_id: str,
        attributes: dict | None = None,
        chunking_strategy: dict | None = None,
        *,
        caller: Caller,
    ) -> dict[str, Any]:
        """Index an uploaded file into a store (both the caller's); answers ``completed`` or
        ``failed``."""
        coll = owned_store(self._stores, store_id, caller)
        upload = self._files.get(file_id, owner=owner_of(caller))
        attrs = validate_attributes(attributes)
        chunking = self._chunking(chunking_strategy)
        return await self._indexer.index(self._locked(coll), upload.id, upload.filename, attrs, chunking)

    @_current
    async def list_store_files(
        self,
        store_id: str,
        limit: int = 20,
        order: oai.Order = "desc",
        after: str | None = None,
        before: str | None = None,
        filter: str | None = None,
        *,
        caller: Caller,
    ) -> dict[str, Any]:
        check_file_status_filter(filter)
        coll = owned_store(self._stores, store_id, caller)
        objects = [oai.vector_store_file(coll.id, d) for d in coll.list_documents()]
        objects += [oai.failed_vector_store_file(coll.id, f) for f in self._failed.list(coll.id)]
        objects = [o for o in objects if filter is None or o["status"] == filter]
        objects.sort(key=lambda o: (o["created_at"], o["id"]))
        return oai.page(
            objects,
            item_id=lambda o: o["id"],
            render=lambda o: o,
            limit=limit,
            order=order,
            after=after,
            before=before,
        )

    @_current
    async def get_store_file(self, store_id: str, file_id: str, *, caller: Caller) -> dict[str, Any]:
        coll = owned_store(self._stores, store_id, caller)
        failed = self._failed.get(coll.id, file_id)
        if failed is not None:
            return oai.failed_vector_store_file(coll.id, failed)
        return oai.vector_store_file(coll.id, coll.get_document(file_id))

    @_current
    async def update_store_file(
        self, store_id: str, file_id: str, attributes: dict | None, *, caller: Caller
    ) -> dict[str, Any]:
        """Replace an indexed file's attributes."""
        coll = owned_store(self._stores, store_id, caller)
        doc = await asyncio.to_thread(self._locked(coll).update_attributes, file_id, attributes)
        return oai.vector_store_file(coll.id, doc)

    @_current
    async def get_store_file_content(self, store_id: str, file_id: str, *, caller: Caller) -> dict[str, Any]:
        """The file's chunks, in order (``vector_store.file_content.page``)."""
        coll = owned_store(self._stores, store_id, caller)
        if self._failed.get(coll.id, file_id) is not None:
            return oai.file_content_page([])
        return oai.file_content_page(coll.document_chunks(file_id))

    @_current
    async def delete_store_file(self, store_id: str, file_id: str, *, caller: Caller) -> dict[str, Any]:
        """Remove a file from a store (its chunks leave search); the upload itself stays."""
        coll = owned_store(self._stores, store_id, caller)
        if not await asyncio.to_thread(self._failed.discard, coll.id, file_id):
            await asyncio.to_thread(self._locked(coll).delete_document, file_id)
        return oai.deleted("vector_store.file.deleted", file_id)

    # --- search -------------------------------------------------------------------------

    @_current
    async def search(
        self,
        store_id: str,
        query: str | list[str],
        max_num_results: int = 10,
        filters: dict | None = None,
        ranking_options: dict | None = None,
        rewrite_query: bool = False,
        *,
        caller: Caller,
    ) -> dict[str, Any]:
        """OpenAI's vector store search: best chunks first, scores clamped to [0, 1].

        Several queries are searched separately and merged, a chunk keeping its best score.
        ``rewrite_query`` is accepted and ignored (``search_query`` echoes the queries as
        given), and so is ``ranking_options.ranker``: there is no re-ranker. This is where the
        request's ``query`` and ``max_num_results`` are checked (the HTTP layer passes them on).
        """
        coll = owned_store(self._stores, store_id, caller)
        queries = search_queries(query)
        check_max_num_results(max_num_results)
        attr_filter = parse_filter(filters)
        min_score = score_threshold(ranking_options)
        vectors = await self._queries.embed(queries)

        def run() -> list[Hit]:
            best: dict[int, Hit] = {}
            for vector in vectors:
                for hit in coll.search(vector, max_num_results, min_score, attr_filter):
                    if hit.chunk_id not in best or hit.score > best[hit.chunk_id].score:
                        best[hit.chunk_id] = hit
            ranked = sorted(best.values(), key=lambda h: (-h.score, h.doc_id, h.chunk_index))
            return ranked[:max_num_results]

        hits = await asyncio.to_thread(run)
        return oai.search_results_page(queries, hits)

    async def retrieve(
        self,
        policy_collections: list[str],
        requested: list[str] | None,
        query: str,
        top_k: int,
        min_score: float | None = None,
        *,
        caller: Caller,
    ) -> list[Passage]:
        """The chat path's retrieval: the ``top_k`` best chunks across the chosen stores.

        ``policy_collections`` come from the model's retrieval policy (the operator's config):
        each resolves by id, whoever owns the store, or by name among the operator's stores only
        (the latest of that name), so no tenant's store can stand in for the policy's. Policy
        stores that do not exist (yet) are skipped with a logged warning.

        ``requested`` (the request's ``retrieval.collections``) must each be a store the policy
        resolved (its id, or the name the policy gives) or one of the caller's own stores (id, or
        name among the caller's stores); anything else is a CollectionNotFoundError, the same as
        for a store that does not exist. A requested name matching both one of the caller's
        stores and a policy entry means the caller's own. When ``requested`` is given (even
        empty) exactly those stores are searched, otherwise the policy's.

        Scores are raw cosine similarities, which ``min_score`` is compared with. The query is
        truncated to the model's window rather than refused. Ties are broken by store id, file id
        and chunk position, so the same state always gives the same passages in the same order.
        """
        owner = owner_of(caller)
        check_retrieval_args(query, top_k)
        # The query's vector needs nothing from storage: when this replica's last view holds
        # anything to search, its encoding starts now, beside the catch-up with other replicas'
        # writes (a thread hop), as ``_current`` does for the other methods. What is searched
        # is decided on the caught-up view.
        early = asyncio.ensure_future(self._queries.start([query])) if self._stores.holds_chunks() else None
        try:
            await asyncio.to_thread(self._shared.sync)
            policy = policy_stores(self._stores, string_list(policy_collections, "policy_collections"))
            if requested is None:
                chosen = list(policy.values())
            else:
                chosen = [
                    requested_store(self._stores, entry, owner, policy)
                    for entry in string_list(requested, "collections")
                ]
            found: dict[str, Collection] = {c.id: c for c in chosen}
            colls = [c for c in found.values() if c.holds_chunks()]
            if not colls:
                return []
            (vector,) = await (early if early is not None else self._queries.embed([query]))
        finally:
            if early is not None:
                if not early.done():
                    early.cancel()
                elif not early.cancelled():
                    early.exception()  # retrieved: no "exception never retrieved" warning

        def run() -> list[Passage]:
            passages = [
                Passage(
                    score=hit.score,
                    vector_store_id=coll.id,
                    vector_store_name=coll.name,
                    file_id=hit.doc_id,
                    filename=hit.source,
                    chunk_index=hit.chunk_index,
                    text=hit.text,
                    attributes=hit.attributes,
                )
                for coll in colls
                for hit in coll.search(vector, top_k, min_score)
            ]
            passages.sort(key=lambda p: (-p.score, p.vector_store_id, p.file_id, p.chunk_index))
            return passages[:top_k]

        # A small scan (~0.1 us a vector here) costs less than the thread hop it would take
        # (~0.3 ms, several under load): it runs on the loop, unless a write holds a store.
        # Larger ones in a thread.
        if sum(c.scan_size() for c in colls) <= _INLINE_SEARCH_VECTORS:
            with contextlib.ExitStack() as held:
                if all(held.enter_context(c.held_if_free()) for c in colls):
                    return run()
        return await asyncio.to_thread(run)

    # --- helpers ------------------------------------------------------------------------

    def _locked(self, coll: Collection) -> Collection:
        """``coll`` with its writes under the storage's write lock."""
        return WriteLocked(coll, self._shared, COLLECTION_WRITES)  # type: ignore[return-value]

    def _store_object(self, coll: Collection) -> dict[str, Any]:
        return oai.vector_store(coll.info(), self._failed.count(coll.id))

    def _chunking(self, strategy: dict | None) -> ChunkingConfig:
        return chunking_from_strategy(strategy, self._config.chunking, self._chunk_limit)
