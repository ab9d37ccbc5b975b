"""The set of persistent collections (OpenAI vector stores) under one directory.

Layout: ``<root>/<vs_id>/`` per collection (see ``retrieval.persistence``). Creating assembles the
directory under a temporary name and renames it into place; deleting renames it to a trash name
first, so a crash never leaves a half-made or half-deleted collection that looks real. Leftover
temporary and trash directories are removed when the store opens.

Names: unique by default (``CollectionStore(..., unique_names=True)``), so that a model's
retrieval policy names its collections unambiguously. OpenAI's API allows duplicate names, so the
vector stores API opens its store with ``unique_names=False``; a name then resolves to the most
recently created collection of that name (latest ``created_at``; within the same second, the one
created last by this process, or after a restart the greater id).

Owners: every collection records who owns it (see ``retrieval.tenancy``). ``get`` and ``list``
take an optional ``owner``: given one, only that owner's collections exist for the call (by id and
by name), so someone else's collection is "not found" like a missing one.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path

from retrieval.collection import Collection, new_collection_id
from retrieval.config import IndexConfig
from retrieval.errors import (
    CollectionExistsError,
    CollectionNotFoundError,
    InvalidInputError,
    StorageCorruptError,
)
from retrieval.persistence import TMP_MARKER, fsync_dir
from retrieval.records import CollectionInfo
from retrieval.tenancy import OPERATOR

logger = logging.getLogger(__name__)

_TRASH_MARKER = ".trash-"


class CollectionStore:
    """Creates, finds, lists and deletes collections; loads all of them when opened.

    Every collection has vectors of ``dimension`` (the embedding model's); a stored collection of
    another dimension is an error at open, not at its first search.
    """

    def __init__(
        self,
        root: Path,
        *,
        dimension: int,
        default_index: IndexConfig | None = None,
        unique_names: bool = True,
        collect_garbage: bool = True,
    ) -> None:
        self.root = Path(root)
        self.dimension = dimension
        self.default_index = default_index or IndexConfig()
        self.unique_names = unique_names
        self._lock = threading.Lock()
        self._collections: dict[str, Collection] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        loaded = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith((TMP_MARKER, _TRASH_MARKER)):
                # On shared storage another writer's work in progress looks the same: only a
                # process holding the write lock collects (retrieval.shared_storage).
                if collect_garbage:
                    logger.info("removing leftover %s", entry)
                    shutil.rmtree(entry, ignore_errors=True)
            elif entry.is_dir():
                loaded.append(self._load(entry, collect_garbage))
        # Oldest first, as if created in this process: name lookups prefer the latest.
        for coll in sorted(loaded, key=lambda c: (c.created_at, c.id)):
            self._collections[coll.id] = coll
        logger.info("opened collection store %s: %d collection(s)", self.root, len(self._collections))

    def _load(self, entry: Path, collect_garbage: bool) -> Collection:
        coll = Collection.load(entry, collect_garbage=collect_garbage)
        if coll.dimension != self.dimension:
            raise StorageCorruptError(f"{entry}: collection has dimension {coll.dimension}, the store {self.dimension}")
        return coll

    def refresh(self) -> None:
        """Catch up with other processes writing under ``root`` (several Retriever replicas on
        shared storage): collections they created or deleted, and their commits (reloaded in
        place, see ``Collection.refresh``). Collects no garbage."""
        on_disk = {
            e.name: e for e in self.root.iterdir() if e.is_dir() and not e.name.startswith((TMP_MARKER, _TRASH_MARKER))
        }
        with self._lock:
            known = dict(self._collections)
        new = [self._load(on_disk[cid], collect_garbage=False) for cid in on_disk.keys() - known.keys()]
        for cid, coll in known.items():
            if cid in on_disk:
                coll.refresh()
        with self._lock:
            for cid in known.keys() - on_disk.keys():
                self._collections.pop(cid, None)
            for coll in sorted(new, key=lambda c: (c.created_at, c.id)):
                self._collections[coll.id] = coll

    def create(
        self,
        name: str | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
        index_config: IndexConfig | None = None,
        owner: str = OPERATOR,
    ) -> Collection:
        """Create an empty persistent collection owned by ``owner``; ``name`` defaults to its id."""
        collection_id = new_collection_id()
        name = collection_id if name is None else name
        _check_name(name)
        with self._lock:
            self._ensure_name_free(name)
            coll = Collection.create(
                self.root / collection_id,
                id=collection_id,
                name=name,
                dimension=self.dimension,
                index_config=index_config or self.default_index,
                metadata=metadata,
                owner=owner,
            )
            self._collections[collection_id] = coll
        logger.info("created collection %s (%s)", collection_id, coll.index_config.kind)
        return coll

    def get(self, id_or_name: str, *, owner: str | None = None) -> Collection:
        """Find a collection by id, else by name (the most recently created of that name).

        With ``owner``, only that owner's collections are looked at, by id and by name.
        """
        with self._lock:
            coll = self._collections.get(id_or_name)
            if coll is not None and (owner is None or coll.owner == owner):
                return coll
            # Reversed creation order: max() keeps the first of equal created_at, the latest.
            named = [
                c
                for c in reversed(self._collections.values())
                if c.name == id_or_name and (owner is None or c.owner == owner)
            ]
            if named:
                return max(named, key=lambda c: c.created_at)
        raise CollectionNotFoundError(f"no vector store {id_or_name!r}")

    def get_by_id(self, collection_id: str, *, owner: str | None = None) -> Collection:
        """Find a collection by id only (``owner`` as in ``get``)."""
        with self._lock:
            coll = self._collections.get(collection_id)
        if coll is None or (owner is not None and coll.owner != owner):
            raise CollectionNotFoundError(f"no vector store {collection_id!r}")
        return coll

    def list(self, *, owner: str | None = None) -> list[CollectionInfo]:
        """All collections (or ``owner``'s), oldest first."""
        with self._lock:
            colls = [c for c in self._collections.values() if owner is None or c.owner == owner]
        return sorted((c.info() for c in colls), key=lambda i: (i.created_at, i.id))

    def holds_chunks(self) -> bool:
        """Whether any collection has a chunk (in this process's view)."""
        with self._lock:
            colls = list(self._collections.values())
        return any(c.holds_chunks() for c in colls)

    def ids(self, *, owner: str | None = None) -> list[str]:
        """Ids of all collections (or ``owner``'s)."""
        with self._lock:
            return [c.id for c in self._collections.values() if owner is None or c.owner == owner]

    def update(
        self,
        collection_id: str,
        *,
        name: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> CollectionInfo:
        """Rename a collection and/or replace its metadata."""
        with self._lock:
            coll = self._collections.get(collection_id)
            if coll is None:
                raise CollectionNotFoundError(f"no vector store {collection_id!r}")
            if name is not None and name != coll.name:
                _check_name(name)
                self._ensure_name_free(name)
            # Under the store lock so that two renames cannot both take a free name.
            return coll.update_info(name=name, metadata=metadata)

    def delete(self, collection_id: str) -> None:
        """Delete a collection and its files."""
        with self._lock:
            coll = self._collections.pop(collection_id, None)
            if coll is None:
                raise CollectionNotFoundError(f"no vector store {collection_id!r}")
            path = self.root / collection_id
            trash = self.root / f"{_TRASH_MARKER}{collection_id}-{secrets.token_hex(4)}"
            os.rename(path, trash)
            fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)
        logger.info("deleted collection %s", collection_id)

    def _ensure_name_free(self, name: str) -> None:
        if self.unique_names and any(c.name == name for c in self._collections.values()):
            raise CollectionExistsError(f"a vector store named {name!r} already exists")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or len(name) > 256:
        raise InvalidInputError("a vector store name must be 1 to 256 characters")
