"""The guardrails deployment: input rails run by Ray Serve, scaled apart from the engines.

The ingress sends the texts of a request (and, separately, retrieved passages) with the
model's current policy; this deployment embeds what the rails need (with its own ONNX
encoder, or through the shared embedding deployment: see ``guardrails.embeddings``), runs
the rails in order, and returns typed decisions. Rail outcomes and rail errors are exported
as Prometheus counters.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from ray import serve
from ray.serve.handle import DeploymentHandle

from guardrails.config import GuardrailPolicy, InjectionDetectorKind
from guardrails.detectors.injection import DEFAULT_ARTIFACT, InjectionScorer, embedding_chunks
from guardrails.detectors.injection_ensemble import load_scorer
from guardrails.detectors.topics import TopicMatcher
from guardrails.embeddings import LocalEmbeddings, RailEmbeddings, SharedEmbeddings
from guardrails.input_rail import InputGuard
from guardrails.metrics import ExportedRailMetrics
from guardrails.verdict import PolicyCode, Verdict
from retrieval.config import EmbeddingModelConfig

logger = logging.getLogger(__name__)

# Above this many characters in one call, the rails run in a worker thread.
_INLINE_RAIL_CHARS = 8192


# Verdicts remembered per replica, so a long conversation pays only for its new messages.
_VERDICT_CACHE_ENTRIES = 8192


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
                Verdict.allow("time_budget")
                if guard.policy.fail_open
                else Verdict.block("time_budget", PolicyCode.RAIL_ERROR, "the input rails ran out of time")
            )
            return verdicts + [verdict] * (len(texts) - len(verdicts))
        guard.metrics.lap()  # each rail's verdict is timed from here (gateway_rail_latency_ms)
        verdicts.append(
            guard.check_text(text, embedding, instructions=kind == "instructions", document=kind == "document")
        )
    return verdicts


class VerdictCache:
    """Bounded LRU of verdicts by (policy version, text digest). Only verdicts a rail reached
    on its own are kept: a rail error or a budget overrun is decided again next time."""

    def __init__(self, entries: int = _VERDICT_CACHE_ENTRIES):
        self._entries = entries
        self._data: OrderedDict[tuple[str, bytes], Verdict] = OrderedDict()

    @staticmethod
    def key(version: str, text: str) -> tuple[str, bytes]:
        return version, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def get(self, key: tuple[str, bytes]) -> Verdict | None:
        verdict = self._data.get(key)
        if verdict is not None:
            self._data.move_to_end(key)
        return verdict

    def put(self, key: tuple[str, bytes], verdict: Verdict) -> None:
        if verdict.code is PolicyCode.RAIL_ERROR or verdict.rail in ("time_budget", "embedding", "setup"):
            return
        self._data[key] = verdict
        self._data.move_to_end(key)
        while len(self._data) > self._entries:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


@dataclass(frozen=True)
class InputDecision:
    """The input rails' answer for one request.

    ``verdict`` is blocked (refuse the request), redacted (use ``texts``) or allowed.
    ``texts`` holds every checked text, rewritten where a rail redacted it.
    """

    verdict: Verdict
    texts: list[str] = field(default_factory=list)
    # The rails' embedding of the text ``check_input`` was asked to share, when they computed
    # one (a fresh text of one chunk): the retrieval search uses it rather than embed it again.
    vector: np.ndarray | None = None


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
        self._embeddings: RailEmbeddings = (
            LocalEmbeddings(local_encoder) if local_encoder is not None else SharedEmbeddings(embedder)
        )
        self._classifier_path = classifier_path or str(DEFAULT_ARTIFACT)
        self._classifier = load_scorer(self._classifier_path)
        self._hf_scorers: dict[str, InjectionScorer] = {}
        self._topics: dict[str, TopicMatcher] = {}
        self._guards: dict[str, tuple[GuardrailPolicy, InputGuard]] = {}
        self._verdicts = VerdictCache()
        self.metrics = ExportedRailMetrics()

    async def check_input(
        self,
        model_id: str,
        policy: GuardrailPolicy,
        texts: Sequence[str],
        all_texts: Sequence[str],
        instructions: Sequence[bool] | None = None,
        documents: Sequence[bool] | None = None,
        share_vector: str | None = None,
    ) -> InputDecision:
        """Limits over ``all_texts`` (every text of the request), then PII, injection and
        denied topics on each of ``texts``; ``instructions[i]`` marks a text from an
        instruction role (heuristics instead of the injection classifier), ``documents[i]``
        a tool result or client-sent document (the injection rail's document threshold).
        ``share_vector``: a text (the retrieval query) whose embedding to return if the rails
        compute it."""
        deadline = time.monotonic() + policy.limits.time_budget_ms / 1000
        guard = await self._guard_or_error(model_id, policy)
        if isinstance(guard, Verdict):
            return InputDecision(guard, list(texts))
        guard.metrics.lap()
        limits = guard.check_request(list(all_texts))
        if limits.blocked:
            return InputDecision(limits, list(texts))
        shared: dict[str, np.ndarray | None] = {share_vector: None} if share_vector else {}
        verdicts = await self._check_each(
            guard, texts, deadline, instructions=instructions, documents=documents, vectors=shared
        )
        blocked = next((v for v in verdicts if v.blocked), None)
        if blocked is not None:
            return InputDecision(blocked, list(texts))
        rewritten = [v.text if v.redacted and v.text is not None else t for v, t in zip(verdicts, texts)]
        redacted = next((v for v in verdicts if v.redacted), None)
        vector = shared.get(share_vector) if share_vector else None
        return InputDecision(redacted or Verdict.allow("guardrails"), rewritten, vector)

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
        vectors: dict[str, np.ndarray | None] | None = None,
    ) -> list[Verdict]:
        """Verdicts for ``texts``: remembered ones from the cache, the rest computed. The
        embeddings computed for texts named in ``vectors`` are put there."""
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
            fresh = await self._compute(guard, [texts[i] for i in todo], [flags[i] for i in todo], deadline, vectors)
            for i, verdict in zip(todo, fresh):
                verdicts[i] = verdict
                self._verdicts.put(keys[i], verdict)
        return verdicts  # type: ignore[return-value]

    async def _compute(
        self,
        guard: InputGuard,
        texts: Sequence[str],
        flags: list[str],
        deadline: float,
        vectors: dict[str, np.ndarray | None] | None = None,
    ) -> list[Verdict]:
        # The ensemble's multilingual encoder needs only the text: it runs in a thread beside
        # the MiniLM pass instead of after it (one request's latency, on an idle core).
        prime = getattr(guard.injection.scorer if guard.injection else None, "prime", None)
        primed = asyncio.ensure_future(asyncio.to_thread(prime, list(texts))) if prime is not None else None
        embeddings: list[np.ndarray | None] = [None] * len(texts)
        # The MiniLM vectors: for the rails that read them (denied topics, a MiniLM scorer), and
        # for the retrieval search, which is handed the query's vector (``vectors``) so the
        # request is embedded once, in this replica, whatever the rails need.
        wanted = [t for t in texts if vectors is not None and t in vectors]
        to_embed = list(texts) if guard.needs_embedding else wanted
        try:
            if to_embed:
                try:
                    started = time.perf_counter()
                    computed = dict(zip(to_embed, await self._embed_chunked(to_embed)))
                    guard.metrics.record_latency("embedding", time.perf_counter() - started)
                    embeddings = [computed.get(t) for t in texts]
                    for text in wanted:
                        if computed[text] is not None and len(computed[text]) == 1:
                            vectors[text] = computed[text][0]  # one chunk: the embedding of the whole text
                except Exception as exc:  # embedding service down: the rails that need it fail closed
                    guard.metrics.record_error("embedding")
                    logger.error("embedding for guardrails failed: %s", type(exc).__name__)
                    if guard.needs_embedding and not guard.policy.fail_open:
                        return [
                            Verdict.block("embedding", PolicyCode.RAIL_ERROR, "embedding service unavailable")
                        ] * len(texts)
        finally:
            if primed is not None:
                # Scoring encodes whatever priming did not (a failure here is only lost time).
                await asyncio.gather(primed, return_exceptions=True)
        # Short texts with the embedding classifier are ~0.3 ms of regex and one dot product:
        # inline. Long documents and HF classifiers (a model forward pass) go to a thread, so
        # the replica's event loop (which Serve's throughput mode shares) keeps serving.
        # With the ensemble's encoder primed above, what is left is the character model and
        # dot products: inline too.
        if (guard.runs_model_inline and prime is None) or sum(len(t) for t in texts) > _INLINE_RAIL_CHARS:
            return await asyncio.to_thread(_check_all, guard, texts, embeddings, flags, deadline)
        return _check_all(guard, texts, embeddings, flags, deadline)

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
                return Verdict.allow("setup")
            return Verdict.block("setup", PolicyCode.RAIL_ERROR, "the configured rails could not be loaded")

    async def _guard(self, model_id: str, policy: GuardrailPolicy) -> InputGuard:
        cached = self._guards.get(model_id)
        if cached is not None and cached[0] == policy:
            return cached[1]
        # The cache key of this policy's verdicts: a new policy never sees an old one's.
        version = hashlib.blake2b(policy.model_dump_json().encode(), digest_size=8).hexdigest()
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
            return load_scorer(injection.classifier_path)
        return self._classifier
