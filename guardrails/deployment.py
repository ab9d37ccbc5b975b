"""The guardrails deployment: input rails run by Ray Serve, scaled apart from the engines.

The ingress sends the texts of a request (and, separately, retrieved passages) with the
model's current policy; this deployment embeds what the rails need (with its own ONNX
encoder, or through the shared embedding deployment: see ``retrieval.embeddings``), runs
the rails in order, and returns typed decisions. Rail outcomes and rail errors are exported
as Prometheus counters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

import numpy as np
from ray import serve
from ray.serve.handle import DeploymentHandle

from guardrails.config import GuardrailPolicy, InjectionDetectorKind
from guardrails.detectors.injection import DEFAULT_ARTIFACT, InjectionScorer, embedding_chunks
from guardrails.detectors.injection_ensemble import InjectionEnsemble, load_scorer
from guardrails.detectors.topics import TopicMatcher
from guardrails.input_rail import InputGuard, ScoredText
from guardrails.metrics import ExportedRailMetrics
from guardrails.verdict import PolicyCode, Verdict, VerdictCache, policy_version
from retrieval.config import EmbeddingModelConfig
from retrieval.embedding_deployment import EncodeGate
from retrieval.embeddings import LocalEmbeddings, SharedEmbeddings, TextEmbeddings

logger = logging.getLogger(__name__)

# Above this many characters in one call, the rails run in a worker thread.
_INLINE_RAIL_CHARS = 8192
# Chunks (of at most ~1000 characters) the multilingual encoder takes in one call at most.
_USE_BATCH_CHUNKS = 64
# ...and e5, the second stage (its cost is per token: a large batch only makes its turns wait).
_E5_BATCH_CHUNKS = 8
# The second stage is waited for until this long before the request's rails run out of time;
# then its chunks keep their first-stage scores (``_prime``), so a queue of e5 work (crafted
# turns from many requests) costs detection, not every request's time budget.
_SCORING_RESERVE_S = 0.5


def _serving(scorer: InjectionScorer) -> InjectionScorer:
    """A scorer as this deployment uses it: the ensemble's e5 vectors only as primed, in a
    thread and within the request's budget (``_prime``), never encoded by scoring, which may
    run on the event loop."""
    if isinstance(scorer, InjectionEnsemble):
        scorer.primed_only = True
    return scorer


def _check_all(
    guard: InputGuard,
    texts: Sequence[str],
    embeddings: Sequence[np.ndarray | None],
    kinds: Sequence[str],
    deadline: float,
) -> list[Verdict]:
    verdicts: list[Verdict] = []
    for text, embedding, kind in zip(texts, embeddings, kinds):
        if time.monotonic() > deadline:
            # Past the request's budget: the remaining texts are not checked, so they count
            # as failed rails (blocked unless the policy fails open).
            guard.metrics.record_error("time_budget")
            verdict = (
                Verdict.allow_failed("time_budget")
                if guard.policy.fail_open
                else Verdict.block("time_budget", PolicyCode.RAIL_ERROR, "the input rails ran out of time")
            )
            return verdicts + [verdict] * (len(texts) - len(verdicts))
        guard.metrics.lap()  # each rail's verdict is timed from here (gateway_rail_latency_ms)
        verdicts.append(
            guard.check_text(text, embedding, instructions=kind == "instructions", document=kind == "document")
        )
    return verdicts


@dataclass(frozen=True)
class InputDecision:
    """The input rails' answer for one request.

    ``verdict`` is blocked (refuse the request), redacted (use ``texts``) or allowed.
    ``texts`` holds every checked text, rewritten where a rail redacted it.
    """

    verdict: Verdict
    texts: list[str] = field(default_factory=list)


@serve.deployment(name="Guardrails", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.25})
class Guardrails:
    """Runs a model's input rails. Collaborators: the embedding deployment's handle, used
    unless ``local_encoder`` says how to load an encoder in this replica."""

    def __init__(
        self,
        embedder: DeploymentHandle | None,
        classifier_path: str | None = None,
        local_encoder: EmbeddingModelConfig | None = None,
    ):
        self._embeddings: TextEmbeddings = (
            LocalEmbeddings.shared(local_encoder) if local_encoder is not None else SharedEmbeddings(embedder)
        )
        self._classifier_path = classifier_path or str(DEFAULT_ARTIFACT)
        self._classifier = _serving(load_scorer(self._classifier_path))
        self._hf_scorers: dict[str, InjectionScorer] = {}
        self._scorers: dict[str, InjectionScorer] = {}  # artifacts a policy names by path
        self._topics: dict[str, TopicMatcher] = {}
        self._guards: dict[str, tuple[GuardrailPolicy, InputGuard]] = {}
        self._verdicts = VerdictCache()
        self._gates: dict[tuple[int, str], tuple[InjectionEnsemble, EncodeGate]] = {}
        self.metrics = ExportedRailMetrics()

    async def check_input(
        self,
        model_id: str,
        policy: GuardrailPolicy,
        texts: Sequence[str],
        all_texts: Sequence[str],
        instructions: Sequence[bool] | None = None,
        documents: Sequence[bool] | None = None,
    ) -> InputDecision:
        """Limits over ``all_texts`` (every text of the request), then PII, injection and
        denied topics on each of ``texts``; ``instructions[i]`` marks a text from an
        instruction role (heuristics instead of the injection classifier), ``documents[i]``
        a tool result or client-sent document (the injection rail's document threshold)."""
        started = time.perf_counter()
        deadline = time.monotonic() + policy.limits.time_budget_ms / 1000
        guard = await self._guard_or_error(model_id, policy)
        if isinstance(guard, Verdict):
            return InputDecision(guard, list(texts))
        guard.metrics.lap()
        limits = guard.check_request(list(all_texts))
        if limits.blocked:
            return InputDecision(limits, list(texts))
        verdicts = await self._check_each(guard, texts, deadline, instructions=instructions, documents=documents)
        # The whole call inside this replica: the ingress's input_rails stage minus this is Serve's hop.
        guard.metrics.record_latency("check_input", time.perf_counter() - started)
        blocked = next((v for v in verdicts if v.blocked), None)
        if blocked is not None:
            return InputDecision(blocked, list(texts))
        rewritten = [v.text if v.redacted and v.text is not None else t for v, t in zip(verdicts, texts)]
        redacted = next((v for v in verdicts if v.redacted), None)
        return InputDecision(redacted or Verdict.allow("guardrails"), rewritten)

    async def check_passages(self, model_id: str, policy: GuardrailPolicy, passages: Sequence[str]) -> list[Verdict]:
        """Retrieved passages go through the same rails: an instruction planted in a document
        must not reach the model unchecked. One verdict per passage."""
        deadline = time.monotonic() + policy.limits.time_budget_ms / 1000
        guard = await self._guard_or_error(model_id, policy)
        if isinstance(guard, Verdict):
            return [guard] * len(passages)
        return await self._check_each(guard, passages, deadline, documents=[True] * len(passages))

    async def check_health(self) -> None:
        """Serve's health check, and the ingress's readiness probe: the replica answers."""

    def counters(self) -> dict[str, int]:
        """Rail outcome counters, ``rail/outcome`` -> count (for tests and /metrics readers)."""
        return {f"{rail}/{outcome}": n for (rail, outcome), n in self.metrics.snapshot().items()}

    # --- internals ----------------------------------------------------------------

    async def _check_each(
        self,
        guard: InputGuard,
        texts: Sequence[str],
        deadline: float,
        instructions: Sequence[bool] | None = None,
        documents: Sequence[bool] | None = None,
    ) -> list[Verdict]:
        """Verdicts for ``texts``: remembered ones from the cache, the rest computed."""
        if not texts:
            return []
        inst = list(instructions) if instructions is not None else [False] * len(texts)
        docs = list(documents) if documents is not None else [False] * len(texts)
        # One text is judged differently as instructions, a document or a chat turn.
        flags = ["instructions" if i else "document" if d else "user" for i, d in zip(inst, docs)]
        keys = [VerdictCache.key(f"{f[0]}:" + guard.cache_version, t) for t, f in zip(texts, flags)]
        verdicts: list[Verdict | None] = [self._verdicts.get(k) for k in keys]
        todo = [i for i, v in enumerate(verdicts) if v is None]
        if todo:
            fresh = await self._compute(guard, [texts[i] for i in todo], [flags[i] for i in todo], deadline)
            for i, verdict in zip(todo, fresh):
                verdicts[i] = verdict
                self._verdicts.put(keys[i], verdict)
        return verdicts  # type: ignore[return-value]

    async def _compute(
        self, guard: InputGuard, texts: Sequence[str], flags: list[str], deadline: float
    ) -> list[Verdict]:
        # The ensemble's multilingual encoder needs only the text: it encodes while the MiniLM
        # vectors are computed (when a rail reads them), together with concurrent requests'
        # texts (``_gate``).
        scorer = guard.injection.scorer if guard.injection else None
        batched = hasattr(scorer, "prime_chunks")
        if batched:
            # What the classifier will score: the texts judged whole, or an app template's pieces.
            scored = [
                p
                for t, f in zip(texts, flags)
                for p in guard.scored_texts(t, instructions=f == "instructions", document=f == "document")
            ]
        primed = asyncio.ensure_future(self._prime(guard, scorer, scored, deadline)) if batched else None
        embeddings: list[np.ndarray | None] = [None] * len(texts)
        try:
            if guard.needs_embedding:
                # The MiniLM vectors: for the rails that read them (denied topics, a MiniLM scorer).
                try:
                    started = time.perf_counter()
                    embeddings = list(await self._embed_chunked(texts))
                    guard.metrics.record_latency("embedding", time.perf_counter() - started)
                except Exception as exc:  # embedding service down: the rails that need it fail closed
                    guard.metrics.record_error("embedding")
                    logger.error("embedding for guardrails failed: %s", type(exc).__name__)
                    if not guard.policy.fail_open:
                        block = Verdict.block("embedding", PolicyCode.RAIL_ERROR, "embedding service unavailable")
                        return [block] * len(texts)
        finally:
            if primed is not None:
                # Scoring encodes whatever priming did not (a failure here is only lost time).
                await asyncio.gather(primed, return_exceptions=True)
        # What is left is regex, the character model and dot products (~2 ms): inline. Long
        # documents, a model that runs in scoring (an HF classifier), or documents a flag may
        # send to redaction (a check, with its encoder pass, per sentence) go to a thread, so
        # the replica's event loop (which Serve's throughput mode shares) keeps serving.
        redacts = guard.redacts_documents and "document" in flags
        if (guard.runs_model_inline and not batched) or redacts or sum(len(t) for t in texts) > _INLINE_RAIL_CHARS:
            return await asyncio.to_thread(_check_all, guard, texts, embeddings, flags, deadline)
        return _check_all(guard, texts, embeddings, flags, deadline)

    async def _prime(
        self, guard: InputGuard, scorer: InjectionEnsemble, scored: list[ScoredText], deadline: float
    ) -> None:
        chunks = scorer.prime_chunks([s.text for s in scored], [s.windows for s in scored])
        if not chunks:
            return
        started = time.perf_counter()
        vectors = self._gate(scorer, "use").enqueue(chunks)  # its thread is already encoding them
        # The character model needs no encoder: it scores on this loop while USE runs in its
        # thread (ONNX Runtime releases the GIL), off the rails' critical path.
        scorer.prime_char(chunks)
        scorer.store_primed(chunks, np.stack(await vectors))
        guard.metrics.record_latency("injection_encoder", time.perf_counter() - started)
        # The e5 pass, for the chat turns' chunks the first stage did not score as clearly
        # benign and the documents' windows their USE stage did not: 20-400 ms of CPU a chunk,
        # ~14 ms a window, so in its thread too, never on the loop. The chat turns' chunks are
        # read by their fine-tuned e5 too (at most 256 tokens of each), the documents' windows
        # by theirs, each in a thread of its own.
        docs = [s for s in scored if not s.turn]
        turns = scorer.cascade_chunks([s.text for s in scored if s.turn])
        windows = scorer.cascade_chunks([s.text for s in docs], [s.windows for s in docs], document=True)
        hot = turns + windows
        if not hot:
            return
        started = time.perf_counter()
        left = deadline - time.monotonic() - _SCORING_RESERVE_S
        tuned = [("turn_e5", turns)] if turns and scorer.reads_turn_e5 else []
        tuned += [("window_e5", windows)] if windows and scorer.reads_window_e5 else []
        try:
            if left <= 0:
                raise TimeoutError
            # On time out the futures are cancelled: still queued, their chunks are never encoded.
            passes = [self._gate(scorer, "e5").enqueue(hot)]
            passes += [self._gate(scorer, name).enqueue(chunks) for name, chunks in tuned]
            vectors, *logits = await asyncio.wait_for(asyncio.gather(*passes), min(left, 3600.0))
        except TimeoutError:
            guard.metrics.record_error("injection_second_stage")
            logger.warning("injection e5 stages skipped: out of time (%d chunks keep earlier stages' scores)", len(hot))
            return
        scorer.store_primed_e5(hot, np.stack(vectors))
        for (name, chunks), found in zip(tuned, logits):
            scorer.store_primed_tuned(name, chunks, np.stack(found))
        guard.metrics.record_latency("injection_second_stage", time.perf_counter() - started)

    def _gate(self, scorer: InjectionEnsemble, encoder: str) -> EncodeGate:
        """One encode at a time per scorer and encoder, in a thread; chunks that arrive
        meanwhile are encoded together in the next call. USE's pass streams its 3.4 MB of 8-bit
        weights once per call, so under load much of a text's encoding cost is shared; e5's
        cost is per token, and its batches are small so that one long chunk does not hold up
        many short turns."""
        found = self._gates.get((id(scorer), encoder))
        if found is None or found[0] is not scorer:
            model = {"use": scorer.use_encoder, "e5": scorer.e5_encoder}.get(
                encoder, lambda: scorer.tuned_e5(encoder)
            )()

            def encode(chunks: list[str]) -> Awaitable[np.ndarray]:
                # In a worker thread, started at once: both engines release the GIL for the
                # whole pass, and the replica's event loop (which Serve's throughput mode
                # shares) keeps serving.
                return asyncio.get_running_loop().run_in_executor(None, model.encode, chunks)

            size = _USE_BATCH_CHUNKS if encoder == "use" else _E5_BATCH_CHUNKS  # e5 and the fine-tuned e5s
            found = (scorer, EncodeGate(encode, limit=1, max_size=size))
            self._gates[(id(scorer), encoder)] = found
        return found[1]

    async def _embed_chunked(self, texts: Sequence[str]) -> list[np.ndarray]:
        pieces = [embedding_chunks(t) for t in texts]
        flat = await self._embeddings.embed([p for ps in pieces for p in ps])
        out, row = [], 0
        for ps in pieces:
            out.append(np.stack(flat[row : row + len(ps)]))
            row += len(ps)
        return out

    async def _guard_or_error(self, model_id: str, policy: GuardrailPolicy) -> InputGuard | Verdict:
        """The rails for a policy, or, if they cannot be built (a classifier that does not
        load, no embedding service for the topics), the verdict failing closed implies."""
        try:
            return await self._guard(model_id, policy)
        except Exception as exc:
            self.metrics.record_error("setup")
            logger.error("guardrails for %s could not be built: %s", model_id, type(exc).__name__)
            if policy.fail_open:
                return Verdict.allow_failed("setup")
            return Verdict.block("setup", PolicyCode.RAIL_ERROR, "the configured rails could not be loaded")

    async def _guard(self, model_id: str, policy: GuardrailPolicy) -> InputGuard:
        cached = self._guards.get(model_id)
        if cached is not None and cached[0] == policy:
            return cached[1]
        # The cache key of this policy's verdicts: a new policy never sees an old one's.
        version = policy_version(policy)
        topics = None
        if policy.enabled and policy.denied_topics.topics:
            key = policy.denied_topics.model_dump_json()
            if key not in self._topics:
                descriptions = TopicMatcher.descriptions(policy.denied_topics)
                vectors = np.stack(await self._embeddings.embed(descriptions))
                self._topics[key] = TopicMatcher.from_policy(policy.denied_topics, vectors)
            topics = self._topics[key]
        guard = InputGuard(policy, injection_scorer=await self._scorer(policy), topics=topics, metrics=self.metrics)
        guard.cache_version = version
        self._guards[model_id] = (policy, guard)
        return guard

    async def _scorer(self, policy: GuardrailPolicy) -> InjectionScorer | None:
        injection = policy.injection
        if not injection.enabled:
            return None
        if injection.detector is InjectionDetectorKind.HF_SEQUENCE_CLASSIFIER:
            path = injection.hf.model_path
            if path not in self._hf_scorers:
                from guardrails.detectors.injection_hf import HfInjectionClassifier

                # Loading a model takes seconds: off the event loop.
                self._hf_scorers[path] = await asyncio.to_thread(HfInjectionClassifier, injection.hf)
            return self._hf_scorers[path]
        if injection.classifier_path and injection.classifier_path != self._classifier_path:
            # Kept per path, as the HF classifiers are: a policy edit does not reload the
            # artifact, and the scorers (and their encode gates, ``_gate``) stay bounded.
            if injection.classifier_path not in self._scorers:
                self._scorers[injection.classifier_path] = _serving(load_scorer(injection.classifier_path))
            return self._scorers[injection.classifier_path]
        return self._classifier
