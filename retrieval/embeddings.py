"""Where a stage gets its embeddings of short texts (the rails' texts, retrieval queries): its
replica's own encoder, or the shared embedding deployment.

``local`` (the default for both the guardrails and the retrieval search) encodes in the
calling replica with the int8 ONNX export of the same model the embedding deployment serves.
One Serve hop fewer and ONNX's speed on single texts took the input rails from ~47 ms to 6.8
ms added per request on the 2-core CI machine (benchmarks/bench_guardrails.py), and the
retrieval search's query from a 33 ms float32 torch pass plus a batch wait to ~3 ms
(benchmarks/overhead.py), at the price of a copy of the model (23 MB) per replica.
``shared`` sends each text to the embedding deployment, where ``@serve.batch`` groups it with
other callers' texts: worth it when replicas are many and memory is short. Documents being
indexed always go to the embedding deployment (large batches are what it is for).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Sequence
from typing import Protocol

import numpy as np
from ray.serve.handle import DeploymentHandle

from retrieval.config import EmbeddingModelConfig
from retrieval.embedding_deployment import EncodeGate, QueuedInput
from retrieval.encoder import SentenceEncoder
from retrieval.file_indexer import gather_responses

_INLINE_TOKENIZE_CHARS = 4096
_SHARED: dict[str, LocalEmbeddings] = {}
_SHARED_LOCK = threading.Lock()


class TextEmbeddings(Protocol):
    """Embeds short texts, one L2-normalised vector each, truncating over-long ones."""

    async def embed(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def start(self, texts: Sequence[str]) -> Awaitable[list[np.ndarray]]:
        """``embed``, begun before this returns as far as it can be (the search calls it
        beside other work, and awaits it later)."""
        ...


class LocalEmbeddings:
    """Encodes in this process. Requests that arrive while an encode runs are taken together
    in the next one (``EncodeGate``): nothing waits for a batch to fill, and the worker
    thread is handed work once per group. With the int8 export the encoder still runs one
    text per forward pass (see ``SentenceEncoder``), so a verdict never depends on load."""

    def __init__(self, config: EmbeddingModelConfig) -> None:
        self._encoder = SentenceEncoder.from_config(config)
        self._gate = EncodeGate(self._encode, limit=1, max_size=config.max_batch_size)

    @classmethod
    def shared(cls, config: EmbeddingModelConfig) -> LocalEmbeddings:
        """This process's encoder for ``config``: one copy of the model however many stages
        ask for it (in an ingress replica, the rails' and the search's), whose texts then
        share its encode gate."""
        key = config.model_dump_json()
        with _SHARED_LOCK:
            found = _SHARED.get(key)
            if found is None:
                found = _SHARED[key] = cls(config)
            return found

    async def embed(self, texts: Sequence[str]) -> list[np.ndarray]:
        return await self.start(texts)

    def start(self, texts: Sequence[str]) -> Awaitable[list[np.ndarray]]:
        # Tokenizing a text the rails send (at most ~1000 characters, see embedding_chunks) or a
        # short search query takes ~0.05 ms: inline, and the encode's thread starts before this
        # returns (``EncodeGate.enqueue``), not a loop step or two later. A long query (a pasted
        # document as the last user message) is tokenized whole before it is cut to the
        # window: in a thread, so the replica's event loop keeps serving.
        if not texts:
            done = asyncio.get_running_loop().create_future()
            done.set_result([])
            return done
        if sum(len(t) for t in texts) > _INLINE_TOKENIZE_CHARS:
            return asyncio.ensure_future(self._embed_long(texts))
        return self._gate.enqueue(self._tokenized(texts))

    def _tokenized(self, texts: Sequence[str]) -> list[QueuedInput]:
        now = time.perf_counter()
        return [QueuedInput(self._encoder.token_ids(t, truncate=True), now) for t in texts]

    async def _embed_long(self, texts: Sequence[str]) -> list[np.ndarray]:
        return await self._gate.enqueue(await asyncio.to_thread(self._tokenized, texts))

    def _encode(self, items: list[QueuedInput]) -> Awaitable[np.ndarray]:
        # In a worker thread, started now: ONNX Runtime releases the GIL, the replica keeps serving.
        return asyncio.get_running_loop().run_in_executor(None, self._encoder.encode_ids, [i.ids for i in items])


class SharedEmbeddings:
    """Sends each text to the embedding deployment."""

    def __init__(self, embedder: DeploymentHandle | None) -> None:
        self._embedder = embedder

    async def embed(self, texts: Sequence[str]) -> list[np.ndarray]:
        if self._embedder is None:
            raise RuntimeError("no embedding deployment configured")
        # One call per text so the embedding deployment's @serve.batch can group them.
        # truncate: a chunk of ~1000 characters of code can exceed the 256-token window.
        return await gather_responses([self._embedder.embed.remote(t, truncate=True) for t in texts])

    def start(self, texts: Sequence[str]) -> Awaitable[list[np.ndarray]]:
        return asyncio.ensure_future(self.embed(texts))
