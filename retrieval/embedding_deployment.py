"""The embedding deployment: one SentenceEncoder per replica behind Ray Serve's ``@serve.batch``.

Callers submit one input per ``handle.embed.remote(text)`` and gather the responses; Serve's
batch queue groups concurrent inputs into one forward pass. Each input is tokenized and checked
against the model's limit *before* it joins the queue, so one over-long input fails alone (a
typed InputTooLongError) instead of failing everybody's batch, and the token count it carries
lets ``batch_size_fn`` bound a batch by tokens as well as by inputs.

The forward pass runs in a worker thread (``asyncio.to_thread``): the replica's event loop keeps
accepting and queueing requests while a batch computes, so the next batch is ready to go.

Ray 2.60's ``serve.batch`` forms the next batch while one runs and only then waits for a
``max_concurrent_batches`` slot (since ray-project/ray#53096), so under load it hands over a
string of small batches, each cut at ``batch_wait_timeout_s`` (measured: mean 2.6 inputs per
batch with 32 callers). ``EncodeGate`` fixes that on our side: it runs at most
``max_concurrent_batches`` encodes and merges the batches that queued meanwhile, within the
input and token budgets.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
from ray import serve

from retrieval.config import EmbeddingModelConfig
from retrieval.encoder import DEFAULT_MODEL_NAME, SentenceEncoder
from retrieval.errors import InputTooLongError, InvalidInputError

logger = logging.getLogger(__name__)

# Texts longer than this are tokenized in a worker thread rather than on the event loop
# (a sentence takes ~0.1 ms to tokenize; a megabyte would stall every queued request).
_INLINE_TOKENIZE_CHARS = 4096

# Names of the metrics @serve.batch exports (Prometheus adds a ``ray_`` prefix).
SERVE_BATCH_METRICS = (
    "serve_batch_wait_time_ms",
    "serve_batch_execution_time_ms",
    "serve_batch_queue_length",
    "serve_batch_utilization_percent",
    "serve_actual_batch_size",
    "serve_batches_processed",
)


@dataclass(slots=True)
class QueuedInput:
    """One queued input: token ids with special tokens, and when it joined the queue."""

    ids: list[int]
    queued_at: float


def batch_budget(config: EmbeddingModelConfig) -> tuple[int, Callable[[list], int] | None]:
    """``(max_batch_size, batch_size_fn)`` for ``serve.batch`` from the config.

    Serve compares one number, ``batch_size_fn(batch)``, with ``max_batch_size``. When the token
    budget can never bind (``max_batch_size * max_tokens <= max_batch_tokens``, true of the
    defaults) plain counting is used, and Serve's batch metrics stay in inputs. Otherwise the
    measure is ``max(tokens, ceil(inputs * max_batch_tokens / max_batch_size))`` against
    ``max_batch_tokens``: it stays within budget exactly when both the token sum and the input
    count do; Serve's ``serve_actual_batch_size`` is then in token-budget units, and
    ``Embedder.batch_stats`` still reports inputs.
    """
    if config.max_batch_size * config.max_tokens <= config.max_batch_tokens:
        return config.max_batch_size, None
    budget, per_input = config.max_batch_tokens, config.max_batch_tokens / config.max_batch_size

    def size(items: list[QueuedInput]) -> int:
        return max(sum(len(i.ids) for i in items), math.ceil(len(items) * per_input))

    return budget, size


class EncodeGate:
    """Runs at most ``limit`` encodes at once; batches that arrive meanwhile wait and are merged.

    A waiting batch joins the next encode whole (never split) while the merged inputs stay
    within ``max_size`` as measured by ``size`` (``len``, or the token measure of
    ``batch_budget``); a batch alone always runs.

    ``run`` is called when an encode starts, inside ``enqueue`` when the gate is free: a ``run``
    that returns an executor future has its thread encoding before ``enqueue`` returns, where
    a task would start it a loop step later (behind whatever else the loop has to do).
    """

    def __init__(
        self,
        run: Callable[[list[QueuedInput]], Awaitable[Sequence[np.ndarray]]],
        *,
        limit: int,
        max_size: int,
        size: Callable[[list[QueuedInput]], int] = len,
    ) -> None:
        self._run = run
        self._limit = limit
        self._max_size = max_size
        self._size = size
        self._waiting: deque[tuple[list[QueuedInput], asyncio.Future]] = deque()
        self._running: set[asyncio.Task] = set()

    async def submit(self, items: list[QueuedInput]) -> list[np.ndarray]:
        return await self.enqueue(items)

    def enqueue(self, items: list[QueuedInput]) -> asyncio.Future:
        """``submit`` without waiting: the future of ``items``' vectors. Their encode starts
        at the loop's next step (or when the one running ends)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((items, future))
        self._start()
        return future

    def _drop_abandoned(self) -> None:
        """Batches at the head whose waiter is gone (a search cancelled: its rails refused)
        are not encoded."""
        while self._waiting and self._waiting[0][1].done():
            self._waiting.popleft()

    def _start(self) -> None:
        while len(self._running) < self._limit:
            self._drop_abandoned()
            if not self._waiting:
                return
            groups = [self._waiting.popleft()]
            merged = list(groups[0][0])
            self._drop_abandoned()
            while self._waiting and self._size(merged + self._waiting[0][0]) <= self._max_size:
                items, future = self._waiting.popleft()
                groups.append((items, future))
                merged += items
                self._drop_abandoned()
            # ``run`` is called here: one that returns a started future (``run_in_executor``)
            # has its thread working before ``enqueue`` returns; a coroutine starts with the task.
            try:
                running = self._run(merged)
            except Exception as exc:  # could not even start: its waiters hear it, the rest go on
                for _, future in groups:
                    if not future.done():
                        future.set_exception(exc)
                continue
            task = asyncio.get_running_loop().create_task(self._encode(groups, running))
            self._running.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        self._start()

    async def _encode(
        self, groups: list[tuple[list[QueuedInput], asyncio.Future]], running: Awaitable[Sequence[np.ndarray]]
    ) -> None:
        try:
            vectors = await running
        except BaseException as exc:  # every waiter must hear about it, cancellation included
            for _, future in groups:
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        offset = 0
        for items, future in groups:
            if not future.done():
                future.set_result(list(vectors[offset : offset + len(items)]))
            offset += len(items)


class BatchStats:
    """What the batch function saw: batch sizes, queue waits, time spent encoding.

    Kept by the deployment itself because Ray's metrics (``SERVE_BATCH_METRICS``) need a
    Prometheus scrape to read back, and a benchmark or test wants the numbers directly.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._sizes: Counter[int] = Counter()
            self._serve_sizes: Counter[int] = Counter()
            self._inputs = 0
            self._tokens = 0
            self._wait_s = 0.0
            self._busy_s = 0.0
            self._first_start: float | None = None
            self._last_end: float | None = None

    def record_serve_batch(self, size: int) -> None:
        with self._lock:
            self._serve_sizes[size] += 1

    def record(self, items: Sequence[QueuedInput], started: float, ended: float) -> None:
        with self._lock:
            self._sizes[len(items)] += 1
            self._inputs += len(items)
            self._tokens += sum(len(i.ids) for i in items)
            self._wait_s += sum(started - i.queued_at for i in items)
            self._busy_s += ended - started
            if self._first_start is None:
                self._first_start = started
            self._last_end = ended

    def snapshot(self, max_batch_size: int) -> dict:
        with self._lock:
            batches = sum(self._sizes.values())
            span = (
                self._last_end - self._first_start
                if self._first_start is not None and self._last_end is not None
                else 0.0
            )
            return {
                "batches": batches,
                "inputs": self._inputs,
                "tokens": self._tokens,
                # Inputs per forward pass, after EncodeGate merged what serve.batch formed.
                "batch_size_histogram": dict(sorted(self._sizes.items())),
                # Inputs per batch as serve.batch formed them (what serve_actual_batch_size sees).
                "serve_batch_size_histogram": dict(sorted(self._serve_sizes.items())),
                "mean_batch_size": self._inputs / batches if batches else 0.0,
                "max_batch_size": max_batch_size,
                "mean_fill": self._inputs / batches / max_batch_size if batches else 0.0,
                "mean_wait_ms": 1000 * self._wait_s / self._inputs if self._inputs else 0.0,
                "mean_encode_ms": 1000 * self._busy_s / batches if batches else 0.0,
                # Share of the time from the first batch's start to the last one's end that the
                # encoder was busy: near 1 under load means the replica is saturated.
                "utilisation": self._busy_s / span if span > 0 else 0.0,
                "prometheus_metrics": list(SERVE_BATCH_METRICS),
            }


# OpenMP threads that spin while they wait collapse torch when another process holds a core:
# measured here with another job on one of the 2 cores, 2 threads at batch 32 gave 33
# sentences/s spinning and 177 passive (1 thread: 178). Read when torch loads, hence the env.
OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


@serve.deployment(
    name="Embedder",
    max_ongoing_requests=1024,
    ray_actor_options={"runtime_env": {"env_vars": OMP_ENV}},
)
class Embedder:
    """Sentence embeddings with dynamic batching.

    ``max_ongoing_requests`` must stay well above ``max_batch_size * max_concurrent_batches``:
    requests beyond it wait in the caller's router and never reach the batch queue (Serve's
    default of 5 would cap every batch at 5). It also bounds how many of serve.batch's small
    batches can wait at the gate to be merged (``max_ongoing_requests // max_batch_size``):
    1024 // 32 lets 32 of them merge, enough to fill a batch under load. Overriding
    ``ray_actor_options`` replaces the default's ``runtime_env``: keep ``OMP_ENV`` in it.
    """

    def __init__(self, config: EmbeddingModelConfig) -> None:
        self._config = config
        self._encoder = SentenceEncoder.from_config(config)
        self._stats = BatchStats()
        max_batch_size, size_fn = batch_budget(config)
        self._gate = EncodeGate(
            self._encode_inputs,
            limit=config.max_concurrent_batches,
            max_size=max_batch_size,
            size=size_fn or len,
        )
        # serve.batch's own concurrency only has to let formed batches reach the gate: as many
        # as max_ongoing_requests can fill, which also keeps Serve's sizing warning quiet.
        admitted = max(config.max_concurrent_batches, _max_ongoing_requests() // config.max_batch_size)
        # Built per instance (not a class decorator) so that every serve.batch option, including
        # batch_size_fn, comes from this replica's config.
        self._batched = serve.batch(
            max_batch_size=max_batch_size,
            batch_wait_timeout_s=config.batch_wait_timeout_s,
            max_concurrent_batches=admitted,
            batch_size_fn=size_fn,
        )(self._encode_batch)
        logger.info(
            "embedder ready: %s dim=%d max_tokens=%d max_batch_size=%d token_budget=%s",
            self._encoder.model_path,
            self._encoder.dimension,
            self._encoder.max_tokens,
            config.max_batch_size,
            config.max_batch_tokens if size_fn else "unbounded",
        )

    async def check_health(self) -> None:
        """Serve's health check, and the ingress's readiness probe: the replica answers."""

    async def embed(self, text: str, *, truncate: bool | None = None, index: int = 0) -> np.ndarray:
        """The float32 vector (dimension,) of one text, L2-normalised.

        ``truncate`` overrides the config's; without truncation an over-long text raises
        InputTooLongError naming ``index`` (the caller's position of this input in its request).
        """
        if not isinstance(text, str):
            raise InvalidInputError("input must be a string", param="input")
        cut = self._config.truncate if truncate is None else truncate
        if len(text) > _INLINE_TOKENIZE_CHARS:
            ids = await asyncio.to_thread(self._encoder.token_ids, text, truncate=cut)
        else:
            ids = self._encoder.token_ids(text, truncate=cut)
        self._check_length(len(ids), index)
        return await self._batched(QueuedInput(ids, time.perf_counter()))

    async def embed_tokens(self, ids: list[int], *, truncate: bool | None = None, index: int = 0) -> np.ndarray:
        """The vector of one input given as token ids of this model's vocabulary.

        The ids are the text's own tokens: special tokens ([CLS], [SEP]) are added here and count
        towards ``max_tokens``.
        """
        vocab = self._encoder.vocab_size
        if isinstance(ids, (str, bytes)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
        ):
            raise InvalidInputError(f"token ids must be integers in [0, {vocab})", param="input")
        wrapped = self._encoder.with_special_tokens(ids)
        excess = len(wrapped) - self._encoder.max_tokens
        if excess > 0 and (self._config.truncate if truncate is None else truncate):
            wrapped = self._encoder.with_special_tokens(list(ids)[: len(ids) - excess])
        self._check_length(len(wrapped), index)
        return await self._batched(QueuedInput(wrapped, time.perf_counter()))

    async def embed_many(self, inputs: list[str | list[int]], *, start: int = 0) -> list[np.ndarray]:
        """The vectors of several inputs (texts or token-id lists) in one call: each still goes
        through the batcher, with every other caller's, so a long list costs one Serve hop, not
        one per input. ``start`` is the first input's position in the caller's request."""
        return list(
            await asyncio.gather(
                *(
                    self.embed_tokens(item, index=start + i)
                    if isinstance(item, list)
                    else self.embed(item, index=start + i)
                    for i, item in enumerate(inputs)
                )
            )
        )

    async def count_tokens(self, texts: list[str]) -> list[int]:
        """Token count of each text, special tokens included (what ``max_tokens`` limits)."""
        return await asyncio.to_thread(self._encoder.count_tokens, texts)

    def info(self) -> dict:
        """Model name and path, vector dimension and per-input token limit."""
        path = self._config.model_path
        return {
            "model": path.name if path is not None else DEFAULT_MODEL_NAME,
            "model_path": str(self._encoder.model_path),
            "dimension": self._encoder.dimension,
            "max_tokens": self._encoder.max_tokens,
            "truncate": self._config.truncate,
        }

    def batch_stats(self) -> dict:
        """Observed batching since start or the last ``reset_batch_stats`` (see BatchStats)."""
        return self._stats.snapshot(self._config.max_batch_size)

    def reset_batch_stats(self) -> None:
        self._stats.reset()

    def _check_length(self, count: int, index: int) -> None:
        if count > self._encoder.max_tokens:
            raise InputTooLongError(index, count, self._encoder.max_tokens)

    async def _encode_batch(self, items: list[QueuedInput]) -> list[np.ndarray]:
        """The ``serve.batch`` function: one batch as Serve formed it, through the gate."""
        self._stats.record_serve_batch(len(items))
        return await self._gate.submit(items)

    async def _encode_inputs(self, items: list[QueuedInput]) -> list[np.ndarray]:
        started = time.perf_counter()
        vectors = await asyncio.to_thread(self._encoder.encode_ids, [i.ids for i in items])
        self._stats.record(items, started, time.perf_counter())
        # Copies: a row view would keep the whole batch array alive in every response.
        return [row.copy() for row in vectors]


def _max_ongoing_requests(default: int = 1024) -> int:
    """This replica's ``max_ongoing_requests`` (Serve keeps it in a private field)."""
    try:
        config = serve.get_replica_context()._deployment_config
        return int(config.max_ongoing_requests)
    except Exception:  # outside a replica, or the private field moved
        return default
