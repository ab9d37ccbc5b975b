"""Crash safety: a writer SIGKILLed at random moments always leaves a complete earlier state.

A subprocess applies a deterministic sequence of adds and deletes to one collection, printing
"ok <i>" after each returns, until it is killed. The store reopened afterwards must hold exactly
the documents of some prefix of that sequence, no shorter than what was acknowledged, with every
document whole (chunks, texts, vectors, attributes) and the index agreeing with the metadata.
The next writer resumes from there, so later rounds also exercise writing after a crash.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrieval.persistence import TMP_MARKER
from retrieval.store import CollectionStore

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 4

# Shared by the writer subprocess and the checks below, so both agree on the sequence.
OPS_SOURCE = """
import numpy as np

DIM = 16

def op(i):
    # Three adds, then a delete of the document added two steps before.
    return ("delete", f"doc-{i - 2}") if i % 4 == 3 else ("add", f"doc-{i}")

def doc_chunks(i):
    return [f"doc-{i} chunk {c} " + "x" * (i % 7) for c in range(1 + i % 5)]

def doc_vectors(i):
    v = np.random.default_rng(i).standard_normal((1 + i % 5, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)

def apply(coll, i):
    kind, doc_id = op(i)
    if kind == "add":
        coll.add_document(doc_id, doc_chunks(i), doc_vectors(i), source=doc_id + ".txt",
                          attributes={"i": i})
    else:
        coll.delete_document(doc_id)
"""

WRITER_SOURCE = (
    OPS_SOURCE
    + """
import sys
from pathlib import Path
from retrieval.config import IndexConfig
from retrieval.errors import CollectionNotFoundError
from retrieval.store import CollectionStore

root, kind, start = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
store = CollectionStore(root, dimension=DIM)
try:
    coll = store.get("crash")
except CollectionNotFoundError:
    config = IndexConfig(kind=kind, hnsw_m=8, compact_tombstone_ratio=0.2)
    coll = store.create("crash", index_config=config)
print("ready", flush=True)
i = start
while True:
    apply(coll, i)
    print(f"ok {i}", flush=True)
    i += 1
"""
)

ops: dict = {}
exec(OPS_SOURCE, ops)


def docs_after(count: int) -> set[str]:
    """Document ids present after the first ``count`` operations."""
    present: set[str] = set()
    for i in range(count):
        kind, doc_id = ops["op"](i)
        (present.add if kind == "add" else present.discard)(doc_id)
    return present


def check_store(root: Path, kind: str, acknowledged: int) -> int:
    """Open the store, check it is a complete state of >= ``acknowledged`` ops; return the count."""
    coll = CollectionStore(root, dimension=ops["DIM"]).get("crash")
    present = {d.doc_id for d in coll.list_documents()}
    # Killed after a commit but before printing "ok" leaves one unacknowledged op applied.
    matches = [n for n in (acknowledged, acknowledged + 1) if docs_after(n) == present]
    assert matches, f"state after {acknowledged} acknowledged ops is no prefix: {sorted(present)}"

    total_chunks = 0
    for doc in coll.list_documents():
        i = int(doc.doc_id.split("-")[1])
        assert coll.document_chunks(doc.doc_id) == ops["doc_chunks"](i)
        assert (doc.source, doc.attributes) == (doc.doc_id + ".txt", {"i": i})
        for c, vector in enumerate(ops["doc_vectors"](i)):
            top = coll.search(vector, 3)
            assert (top[0].doc_id, top[0].chunk_index) == (doc.doc_id, c)
        total_chunks += doc.chunk_count
    stats = coll.stats()
    assert stats.chunks == total_chunks
    assert stats.index_vectors == stats.chunks + stats.tombstones
    assert kind == "hnsw" or stats.tombstones == 0
    assert not [p for p in root.rglob("*") if TMP_MARKER in p.name]
    return matches[-1]


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_sigkill_during_ingest_leaves_a_complete_earlier_state(kind, tmp_path):
    seed = int(time.time())
    pick = random.Random(seed)
    root = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    applied = 0
    for _ in range(ROUNDS):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER_SOURCE, str(root), kind, str(applied)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        try:
            first = proc.stdout.readline()
            assert first == "ready\n", f"writer failed to start: {first!r} {proc.stderr.read()}"
            time.sleep(pick.uniform(0.05, 0.6))
            proc.send_signal(signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"writer died on its own (seed {seed}): {err}"
        acked = [int(line.split()[1]) for line in out.splitlines() if line.startswith("ok ")]
        acknowledged = acked[-1] + 1 if acked else applied
        applied = check_store(root, kind, acknowledged)
    assert applied > 0, f"the writer never completed an operation (seed {seed})"
