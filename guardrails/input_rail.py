"""Input rails in order: size limits, PII, prompt injection, denied topics.

Pure logic for the guardrails deployment. Embeddings come from the caller (the embedding service);
`InputGuard.needs_embedding` says whether to compute them, `embedding_chunks` says what to embed.
Every rail runs inside `run_rail`, so an exception blocks the request unless the policy fails open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from guardrails.app_templates import Piece, TemplateMatcher, untagged
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

# What stands in the prompt for an app template's document the injection rail flagged.
REMOVED_DOCUMENT = "<source>[removed: the gateway's injection guardrail flagged this document]</source>"


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
            InjectionDetector(
                injection_scorer,
                threshold,
                inj.heuristics,
                document_threshold=document_threshold,
                document_windows=inj.document_windows,
                document_redaction=inj.document_redaction,
            )
            if inj.enabled and (injection_scorer is not None or inj.heuristics)
            else None
        )
        self.topics = topics if policy.denied_topics.topics else None
        # An app's templates (a chat UI's RAG message) are judged in parts: template lines,
        # documents, the user's text. A MiniLM scorer has one vector for the whole text, so
        # it judges the whole text.
        self.templates = (
            TemplateMatcher.from_policy((t.name, t.text) for t in inj.app_templates)
            if self.injection is not None and inj.app_templates and not self.injection.reads_embedding
            else None
        )
        # Set by the deployment: names this policy in the verdict cache.
        self.cache_version = ""

    @property
    def runs_model_inline(self) -> bool:
        """Whether `check_text` runs a model itself (an HF classifier), not just regex and dot products."""
        scorer = self.injection.scorer if self.injection else None
        return scorer is not None and getattr(scorer, "runs_model", not isinstance(scorer, InjectionClassifier))

    @property
    def redacts_documents(self) -> bool:
        """Whether a flagged document may be redacted (``InjectionDetector.redacts_documents``)."""
        return self.injection is not None and self.injection.redacts_documents

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
            pieces = self._pieces(judged, instructions=instructions, document=document)
            whole = pieces is None  # the embedding (of the whole text) serves only the whole text
            if pieces is None:
                pieces = [Piece(judged, "instructions" if instructions else "document" if document else "user")]
            removed: list[tuple[tuple[int, int], str]] = []  # a template's flagged documents: span, what stands there
            for piece in pieces:
                if piece.kind != "instructions":
                    doc, emb = piece.kind == "document", embedding if whole else None
                    # A context block judged whole comes after its elements: without those removed.
                    judged_piece = untagged(_without(judged, removed, within=piece.span)) if piece.block else piece.text
                    seen.append(
                        self._run(
                            detector.rail,
                            # Only a whole text is redacted (a piece's rewrite is not the
                            # message's), and judged as it came too, before the PII rail's rewrite.
                            lambda p=judged_piece, e=emb, d=doc: detector.check(
                                p, e, document=d, redact=whole, also=(text,) if whole else ()
                            ),
                        )
                    )
                elif detector.use_heuristics:
                    seen.append(self._run(detector.rail, lambda p=piece.text: detector.check_heuristics(p)))
                if (
                    seen
                    and seen[-1].blocked
                    and piece.span is not None
                    and seen[-1].code is PolicyCode.PROMPT_INJECTION
                ):
                    # A template's document is redacted or dropped, not the request, as a
                    # retrieved passage is (a rail error still refuses the request).
                    seen.pop()
                    a, b = piece.span
                    # A flagged tag (its file name) goes with its element; flagged text is redacted in it.
                    redactable = piece.part in ("whole", "text")
                    removed.append((piece.span, self._redacted_source(judged[a:b]) if redactable else REMOVED_DOCUMENT))
                elif seen and seen[-1].blocked:
                    break
            if removed and not (seen and seen[-1].blocked):
                seen.append(
                    Verdict.redact(
                        detector.rail,
                        _without(judged, removed),
                        "document(s) of an app template redacted or removed",
                        code=PolicyCode.PROMPT_INJECTION,
                    )
                )
            if seen and seen[-1].blocked:
                return seen[-1]
        if self.topics is not None:
            if embedding is None:
                seen.append(self._run("denied_topics", _missing_embedding))
            else:
                matcher, emb = self.topics, embedding
                seen.append(self._run(matcher.rail, lambda: matcher.check(emb)))
        return combine(seen)

    def scored_texts(self, text: str, *, instructions: bool = False, document: bool = False) -> list[ScoredText]:
        """The texts the injection classifier will score when checking ``text`` (for the
        guardrails deployment to encode them ahead, together with other requests'): the text as
        the rail reads it (``_judged``), whole (and as it came) or in an app template's pieces."""
        if self.injection is None or self.injection.scorer is None:
            return []
        windows = self.injection.document_windows
        original, text = text, self._judged(text)
        pieces = self._pieces(text, instructions=instructions, document=document)
        if pieces is None:
            # A whole text is judged as it came too, when the PII rail rewrites it (check_text).
            forms = [text] if text == original else [text, original]
            return [] if instructions else [ScoredText(t, document and windows, not document) for t in forms]
        return [
            ScoredText(p.text, p.kind == "document" and windows, p.kind == "user")
            for p in pieces
            if p.kind != "instructions"
        ]

    def _judged(self, text: str) -> str:
        """What the injection rail reads of ``text`` (``check_text``): the PII rail's redaction
        when it redacts, for the deployment to encode ahead exactly the texts scored."""
        assert self.injection is not None
        if not (self.policy.enabled and self.policy.pii.enabled) or self.injection.reads_embedding:
            return text
        try:
            verdict = check_pii(text, self.policy.pii.input)
        except Exception:  # check_text reports it; scoring then encodes what it needs itself
            return text
        return verdict.text if verdict.redacted and verdict.text is not None else text

    def _pieces(self, text: str, *, instructions: bool, document: bool) -> list[Piece] | None:
        """How the injection rail judges ``text``: in parts when it was written from one of
        the policy's app templates, else None (whole, as a turn, instructions or document)."""
        if self.templates is None or document:
            return None
        return self.templates.split(text, instructions=instructions)

    def _redacted_source(self, element: str) -> str:
        """What stands for a template's flagged document (a ``<source ...>`` element, or text
        between elements): its text redacted as a retrieved passage's is, in the element's own
        tags, when it can be; else ``REMOVED_DOCUMENT``."""
        detector = self.injection
        if detector is None or not detector.redacts_documents:
            return REMOVED_DOCUMENT
        head, tail = 0, len(element)
        if element.startswith("<source") and element.endswith("</source>"):
            head, tail = element.find(">") + 1, len(element) - len("</source>")
        if not 0 < tail - head:
            return REMOVED_DOCUMENT
        inner = element[head:tail]
        verdict = self._run(detector.rail, lambda: detector.check(inner, None, document=True, redact=True))
        if not verdict.redacted or verdict.text is None:
            return REMOVED_DOCUMENT
        return element[:head] + verdict.text + element[tail:]

    def _run(self, rail: str, check: Callable[[], Verdict]) -> Verdict:
        return run_rail(rail, check, fail_open=self.policy.fail_open, metrics=self.metrics)


class ScoredText(NamedTuple):
    """A text the injection classifier scores (``InputGuard.scored_texts``)."""

    text: str
    windows: bool  # its sentence windows are scored too (a document, with injection.document_windows)
    turn: bool  # judged as a chat turn: the ensemble's second stage may read it


def _without(text: str, spans: list[tuple[tuple[int, int], str]], within: tuple[int, int] | None = None) -> str:
    """``text`` with each span replaced by what stands there (overlapping ones merged, and then
    by ``REMOVED_DOCUMENT``); with ``within``, only that part of the text, and the spans inside it."""
    if within is not None:
        a, b = within
        return _without(text[a:b], [((x - a, y - a), r) for (x, y), r in spans if a <= x and y <= b])
    merged: list[list] = []
    for (a, b), replacement in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
            merged[-1][2] = REMOVED_DOCUMENT
        else:
            merged.append([a, b, replacement])
    out, pos = [], 0
    for a, b, replacement in merged:
        out += [text[pos:a], replacement]
        pos = b
    return "".join(out) + text[pos:]


def _missing_embedding() -> Verdict:
    raise ValueError("denied topics need the text's embedding")
