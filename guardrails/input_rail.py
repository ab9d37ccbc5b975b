"""Input rails in order: size limits, PII, prompt injection, denied topics.

Pure logic for the guardrails deployment. Embeddings come from the caller (the embedding service);
`InputGuard.needs_embedding` says whether to compute them, `embedding_chunks` says what to embed.
Every rail runs inside `run_rail`, so an exception blocks the request unless the policy fails open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from guardrails.config import GuardrailPolicy, InjectionDetectorKind, InjectionPolicy
from guardrails.detectors.injection import (
    DEFAULT_ARTIFACT,
    InjectionClassifier,
    InjectionDetector,
    InjectionScorer,
)
from guardrails.detectors.injection_ensemble import load_scorer
from guardrails.detectors.limits import check_limits
from guardrails.detectors.pii import check_pii
from guardrails.detectors.topics import TopicMatcher
from guardrails.metrics import RailMetrics
from guardrails.verdict import PolicyCode, Verdict, combine

logger = logging.getLogger(__name__)


def build_injection_scorer(policy: InjectionPolicy) -> InjectionScorer | None:
    """The scorer a policy asks for: the embedding classifier artifact, or a local HF classifier."""
    if not policy.enabled:
        return None
    if policy.detector is InjectionDetectorKind.HF_SEQUENCE_CLASSIFIER:
        from guardrails.detectors.injection_hf import HfInjectionClassifier

        assert policy.hf is not None  # guaranteed by InjectionPolicy validation
        return HfInjectionClassifier(policy.hf)
    return load_scorer(policy.classifier_path or DEFAULT_ARTIFACT)


def run_rail(rail: str, check: Callable[[], Verdict], *, fail_open: bool, metrics: RailMetrics) -> Verdict:
    """Run one rail; an exception is logged (type only, never the text), counted, and blocks unless fail_open."""
    try:
        verdict = check()
    except Exception as exc:  # a broken rail must not wave the request through
        metrics.record_error(rail)
        logger.error("rail %s raised %s", rail, type(exc).__name__)
        logger.debug("rail %s traceback", rail, exc_info=True)
        if fail_open:
            return Verdict.allow_failed(rail)
        verdict = Verdict.block(rail, PolicyCode.RAIL_ERROR, f"rail {rail} failed")
    metrics.record_verdict(verdict)
    return verdict


class InputGuard:
    """Applies a model's input policy to a request."""

    def __init__(
        self,
        policy: GuardrailPolicy,
        injection_scorer: InjectionScorer | None = None,
        topics: TopicMatcher | None = None,
        metrics: RailMetrics | None = None,
    ) -> None:
        self.policy = policy
        self.metrics = metrics if metrics is not None else RailMetrics()
        inj = policy.injection
        threshold = inj.threshold
        if threshold is None:
            threshold = injection_scorer.calibrated_threshold if injection_scorer is not None else 0.5
        # Documents: the policy's document threshold, else the scorer's document calibration
        # when the policy left both thresholds to the scorer, else the chat threshold.
        document_threshold = inj.document_threshold
        if document_threshold is None:
            calibrated = getattr(injection_scorer, "calibrated_document_threshold", None)
            document_threshold = calibrated if calibrated is not None and inj.threshold is None else threshold
        self.injection = (
            InjectionDetector(injection_scorer, threshold, inj.heuristics, document_threshold=document_threshold)
            if inj.enabled and (injection_scorer is not None or inj.heuristics)
            else None
        )
        self.topics = topics if policy.denied_topics.topics else None
        # Set by the deployment: names this policy in the verdict cache.
        self.cache_version = ""

    @property
    def runs_model_inline(self) -> bool:
        """Whether `check_text` runs a model itself (an HF classifier), not just regex and dot products."""
        scorer = self.injection.scorer if self.injection else None
        return scorer is not None and getattr(scorer, "runs_model", not isinstance(scorer, InjectionClassifier))

    @property
    def needs_embedding(self) -> bool:
        """Whether `check_text` needs the text's embedding (a MiniLM-based scorer or denied topics)."""
        scorer = self.injection.scorer if self.injection else None
        uses = getattr(scorer, "uses_embedding", isinstance(scorer, InjectionClassifier))
        return bool(uses) or self.topics is not None

    def check_request(self, messages: Sequence[str]) -> Verdict:
        """Size limits over every message text of the request."""
        if not self.policy.enabled:
            return Verdict.allow("limits")
        return self._run("limits", lambda: check_limits(messages, self.policy.limits))

    def check_text(
        self, text: str, embedding: np.ndarray | None = None, *, instructions: bool = False, document: bool = False
    ) -> Verdict:
        """PII, injection and topics on one text; REDACTED carries the rewritten text.

        ``instructions`` marks text from an instruction role (system, developer): the injection
        rail then runs its heuristics only (see ``InjectionPolicy.instruction_roles``).
        ``document`` marks a retrieved passage or tool result: the injection rail uses its
        document threshold (``InjectionPolicy.document_threshold``)."""
        if not self.policy.enabled:
            return Verdict.allow("guardrails")
        seen: list[Verdict] = []
        if self.policy.pii.enabled:
            seen.append(self._run("pii", lambda: check_pii(text, self.policy.pii.input)))
            if seen[-1].blocked:
                return seen[-1]
        if self.injection is not None:
            detector = self.injection
            # The rail judges what the model will read: the text after redaction ("<EMAIL>", not
            # an address). A MiniLM scorer reads the original, whose embedding it was given.
            judged = text
            if seen and seen[-1].redacted and seen[-1].text is not None and not detector.reads_embedding:
                judged = seen[-1].text
            if not instructions:
                seen.append(self._run(detector.rail, lambda: detector.check(judged, embedding, document=document)))
            elif detector.use_heuristics:
                seen.append(self._run(detector.rail, lambda: detector.check_heuristics(judged)))
            if seen and seen[-1].blocked:
                return seen[-1]
        if self.topics is not None:
            if embedding is None:
                seen.append(self._run("denied_topics", _missing_embedding))
            else:
                matcher, emb = self.topics, embedding
                seen.append(self._run(matcher.rail, lambda: matcher.check(emb)))
        return combine(seen)

    def _run(self, rail: str, check: Callable[[], Verdict]) -> Verdict:
        return run_rail(rail, check, fail_open=self.policy.fail_open, metrics=self.metrics)


def _missing_embedding() -> Verdict:
    raise ValueError("denied topics need the text's embedding")
