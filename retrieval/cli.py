"""Load a folder of documents into a vector store of a running gateway, and search it.

    python -m retrieval.cli ingest docs/ --store handbook [--glob "**/*.md" --glob "**/*.txt"]
    python -m retrieval.cli search "how do I reset my password" --store handbook

Talks to the gateway the way any client would, through the official ``openai`` SDK:
``files.create`` then ``vector_stores.files.create`` per file (the store is created when no
store has that name; with several of that name, the most recent is used, as the gateway does).
The API key comes from ``--api-key`` or ``OPENAI_API_KEY``. Exits 1 when any file failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_GLOBS = ("**/*.md", "**/*.txt")


@dataclass(slots=True)
class IngestSummary:
    """What an ingest run did."""

    store_id: str
    files: int = 0
    chunks: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    seconds: float = 0.0
    uncounted: int = 0  # indexed files whose chunks could not be counted

    def line(self) -> str:
        chunks = f"{self.chunks} chunks" + (f" (+ {self.uncounted} files uncounted)" if self.uncounted else "")
        return (
            f"{self.files} files, {chunks}, {len(self.failures)} failures, "
            f"{self.seconds:.1f} s -> vector store {self.store_id}"
        )


def find_files(folder: Path, globs: Sequence[str]) -> list[Path]:
    """Files under ``folder`` matching any glob, each once, in a stable order."""
    found = {p for pattern in globs for p in folder.glob(pattern) if p.is_file()}
    return sorted(found)


def find_store(client, name: str):
    """The most recently created vector store called ``name``, or None."""
    matches = [s for s in client.vector_stores.list(limit=100) if s.name == name]
    return max(matches, key=lambda s: s.created_at) if matches else None


def find_or_create_store(client, name: str):
    return find_store(client, name) or client.vector_stores.create(name=name)


def ingest_folder(
    client,
    folder: Path,
    store_name: str,
    globs: Sequence[str] = DEFAULT_GLOBS,
    *,
    progress: bool = True,
) -> IngestSummary:
    """Upload every matching file under ``folder`` and add it to the store ``store_name``.

    Each file's path relative to ``folder`` becomes its filename and its ``path`` attribute.
    A file that fails (upload refused, indexing ``failed``) is recorded and the run goes on.
    """
    from tqdm import tqdm

    started = time.perf_counter()
    folder = Path(folder)
    paths = find_files(folder, globs)
    store = find_or_create_store(client, store_name)
    summary = IngestSummary(store_id=store.id)
    bar = tqdm(paths, unit="file", disable=not progress, file=sys.stderr)
    for path in bar:
        rel = path.relative_to(folder).as_posix()
        bar.set_postfix_str(rel[-40:], refresh=False)
        try:
            uploaded = client.files.create(file=(rel, path.read_bytes()), purpose="assistants")
            added = client.vector_stores.files.create(store.id, file_id=uploaded.id, attributes={"path": rel[:512]})
        except Exception as exc:  # an HTTP error for this file must not stop the others
            summary.failures.append((rel, _reason(exc)))
            continue
        if added.status != "completed":
            error = added.last_error
            summary.failures.append((rel, f"{error.code}: {error.message}" if error else added.status))
            continue
        summary.files += 1
        chunks = _count_chunks(client, store.id, uploaded.id)
        if chunks is None:
            summary.uncounted += 1
        else:
            summary.chunks += chunks
    summary.seconds = time.perf_counter() - started
    return summary


def search(client, store_name: str, query: str, top: int = 5) -> list:
    """The best ``top`` results for ``query`` in the store ``store_name``."""
    store = find_store(client, store_name)
    if store is None:
        raise LookupError(f"no vector store named {store_name!r}")
    return list(client.vector_stores.search(store.id, query=query, max_num_results=top))


def _count_chunks(client, store_id: str, file_id: str) -> int | None:
    # The vector store file object has no chunk count; its parsed content is one item per chunk.
    try:
        return sum(1 for _ in client.vector_stores.files.content(file_id, vector_store_id=store_id))
    except Exception:  # a gateway without the content route still ingests
        return None


def _reason(exc: Exception) -> str:
    message = getattr(exc, "message", None) or str(exc)
    status = getattr(exc, "status_code", None)
    return f"HTTP {status}: {message}" if status else f"{type(exc).__name__}: {message}"


def _client(args: argparse.Namespace):
    from openai import OpenAI

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "none"
    return OpenAI(base_url=args.base_url, api_key=api_key, max_retries=1, timeout=args.timeout)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m retrieval.cli", description=__doc__.split("\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", required=True, help="vector store name")
    common.add_argument("--base-url", default=DEFAULT_BASE_URL)
    common.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    common.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    sub = parser.add_subparsers(dest="command", required=True)
    ingest = sub.add_parser("ingest", parents=[common], help="upload a folder into a store")
    ingest.add_argument("folder", type=Path)
    ingest.add_argument(
        "--glob",
        action="append",
        dest="globs",
        help=f"repeatable; default {' '.join(DEFAULT_GLOBS)}",
    )
    ingest.add_argument("--no-progress", action="store_true")
    find = sub.add_parser("search", parents=[common], help="print the best chunks for a query")
    find.add_argument("query")
    find.add_argument("--top", type=int, default=5)
    return parser


def _print_hits(hits: Iterable) -> None:
    for rank, hit in enumerate(hits, start=1):
        text = " ".join(" ".join(c.text for c in hit.content).split())
        print(f"{rank}. {hit.score:.3f}  {hit.filename}  ({hit.file_id})")
        print(f"   {text[:300]}{'...' if len(text) > 300 else ''}")


def main(argv: Sequence[str] | None = None) -> int:
    from openai import APIError

    args = _parser().parse_args(argv)
    client = _client(args)
    try:
        if args.command == "ingest":
            return _ingest_command(client, args)
        return _search_command(client, args)
    except (APIError, LookupError) as exc:  # no gateway there, bad key, unknown store...
        print(f"error: {_reason(exc)}", file=sys.stderr)
        return 2


def _ingest_command(client, args: argparse.Namespace) -> int:
    if not args.folder.is_dir():
        print(f"error: {args.folder} is not a folder", file=sys.stderr)
        return 2
    summary = ingest_folder(client, args.folder, args.store, args.globs or DEFAULT_GLOBS, progress=not args.no_progress)
    for path, reason in summary.failures:
        print(f"failed: {path}: {reason}", file=sys.stderr)
    print(summary.line())
    return 1 if summary.failures else 0


def _search_command(client, args: argparse.Namespace) -> int:
    hits = search(client, args.store, args.query, args.top)
    if not hits:
        print("no results")
    _print_hits(hits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
