"""Several Retriever replicas, possibly on several nodes, over one storage directory.

The directory is a shared POSIX filesystem path (NFS, EFS, Filestore, a ReadWriteMany volume):
the on-disk layout (``retrieval.persistence``) already relies on what such a filesystem gives,
an atomic rename and fsync, and this module adds the one thing more it needs, a lock:

- **One writer at a time.** Every write (a store created, renamed or deleted, a file stored or
  deleted, a document committed, a failed ingest recorded) runs under an exclusive POSIX lock
  (``fcntl.lockf``, which NFSv4 and EFS implement across clients) on ``<root>/.writer.lock``.
  The lock is held only for the commit: reading, chunking and embedding a document happen before.
- **Readers catch up.** Each write ends by bumping ``<root>/generation``. Every call into a
  replica first reads that small file (open and read: NFS's close-to-open consistency makes it
  current) and, when it changed, reloads what changed (``CollectionStore.refresh``,
  ``FileStore.refresh``, ``FailedFiles.reload``) under a shared lock, so never in the middle of
  another replica's write. A writer does the same under its exclusive lock before writing, so it
  always writes on top of the latest state.
- **Crashes lose nothing committed.** Every file is written to a temporary name and renamed; a
  writer killed mid-write releases its lock (the kernel, or the NFS server's lease, drops it)
  and leaves only files no manifest names. Those look exactly like another writer's work in
  progress, so only a process holding the exclusive lock deletes them (at replica start).

POSIX locks belong to a process, not a thread: a thread lock orders this process's own writers
and reloads, and the file lock orders processes.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from retrieval.persistence import atomic_write

logger = logging.getLogger(__name__)

LOCK_NAME = ".writer.lock"
GENERATION_NAME = "generation"


class SharedStorage:
    """The lock and generation counter of one storage directory; ``reload`` brings this
    process's in-memory state up to date with the directory."""

    def __init__(self, root: Path, reload: Callable[[], None] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.root / LOCK_NAME
        self._generation_path = self.root / GENERATION_NAME
        self._reload = reload
        self._thread_lock = threading.RLock()
        self._depth = 0  # nesting of write() in the thread holding _thread_lock
        self._seen: str | None = None
        self.reloads = 0  # how often this process caught up with another's write

    def set_reload(self, reload: Callable[[], None]) -> None:
        self._reload = reload

    # -- the generation ------------------------------------------------------------------

    def generation(self) -> str:
        try:
            return self._generation_path.read_text()
        except FileNotFoundError:
            return "0"

    def mark_current(self) -> None:
        """Record that the in-memory state matches the directory now (after opening it)."""
        self._seen = self.generation()

    def sync(self) -> bool:
        """Reload if another process wrote since we last looked; True if it did. One small file
        read when nothing changed."""
        if self.generation() == self._seen:
            return False
        with self._thread_lock, self._file_lock(fcntl.LOCK_SH):
            return self._catch_up()

    def _catch_up(self) -> bool:
        current = self.generation()
        if current == self._seen:
            return False
        if self._reload is not None:
            self._reload()
        self._seen = current
        self.reloads += 1
        logger.debug("%s: reloaded at generation %s", self.root, current)
        return True

    # -- writing -------------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[None]:
        """Hold the exclusive lock, with this process's state caught up, for one write; bump the
        generation when it ends (also after a failed write, which may have half-happened).
        Re-entrant within a thread."""
        with self._thread_lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            with self._file_lock(fcntl.LOCK_EX):
                self._catch_up()
                self._depth = 1
                try:
                    yield
                finally:
                    self._depth = 0
                    self._bump()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The exclusive lock without a write: for opening the storage and collecting garbage."""
        with self._thread_lock, self._file_lock(fcntl.LOCK_EX):
            yield

    def _bump(self) -> None:
        try:
            number = int(self.generation()) + 1
        except ValueError:
            number = 1
        atomic_write(self._generation_path, str(number).encode())
        self._seen = str(number)

    @contextmanager
    def _file_lock(self, kind: int) -> Iterator[None]:
        # Opened per use: POSIX drops every lock a process holds on a file when any of its
        # descriptors for that file closes, so there is never a second one open.
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, kind)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


class WriteLocked:
    """``target`` with the named methods run inside ``storage.write()``; every other attribute is
    the target's own. Lets code written for one process (``FileIndexer``, which commits a
    document after embedding it) write shared storage without knowing it."""

    def __init__(self, target: Any, storage: SharedStorage, methods: frozenset[str]) -> None:
        self._target = target
        self._storage = storage
        self._methods = methods

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name not in self._methods:
            return attr

        @functools.wraps(attr)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._storage.write():
                return attr(*args, **kwargs)

        return locked


COLLECTION_WRITES = frozenset({"add_document", "delete_document", "update_attributes", "update_info"})
STORE_WRITES = frozenset({"create", "update", "delete"})
FILE_WRITES = frozenset({"create", "delete"})
FAILED_WRITES = frozenset({"add", "discard", "discard_file", "discard_store"})
