"""Prompt-injection and jailbreak detection: phrase heuristics (injection_heuristics.py) plus a classifier over sentence embeddings.

The classifier is a logistic regression over all-MiniLM-L6-v2 embeddings (384-d, L2-normalised),
stored as a tiny `.npz` (weights, bias, JSON metadata). It never embeds text itself: the caller sends
the text through the shared batched embedding service and passes the vectors in. Long texts are
embedded in chunks (`embedding_chunks`) and the highest chunk score counts, so an instruction buried
at the end of a long document is not lost to the encoder's 256-token truncation.

A Hugging Face sequence classifier (e.g. Prompt Guard) can replace the embedding classifier: see
`guardrails.detectors.injection_hf.HfInjectionClassifier`, which satisfies the same `InjectionScorer`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from guardrails.detectors import documents
from guardrails.detectors.injection_heuristics import heuristic_hits
from guardrails.detectors.networks import logit, sigmoid
from guardrails.detectors.text_fold import decoded_payloads
from guardrails.verdict import PolicyCode, Verdict

logger = logging.getLogger(__name__)

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_DIM = 384
DEFAULT_ARTIFACT = Path(__file__).resolve().parent.parent / "data" / "injection_classifier.npz"


def embedding_chunks(text: str, max_chars: int = 1000, overlap: int = 100) -> list[str]:
    """Split text into overlapping pieces that fit the encoder's 256-token window (about 1000 chars).

    The caller embeds every piece and passes the stacked matrix to `InjectionDetector.check`.
    """
    if len(text) <= max_chars:
        return [text]
    step = max_chars - overlap
    return [text[i : i + max_chars] for i in range(0, len(text) - overlap, step)]


class InjectionScorer(Protocol):
    """Anything that turns a user text (and its embedding, if the scorer uses one) into P(injection)."""

    @property
    def calibrated_threshold(self) -> float:
        """The threshold to use when the policy names none."""
        ...

    def score_input(self, text: str, embedding: np.ndarray | None) -> float: ...


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass(frozen=True)
class InjectionClassifier:
    """Logistic regression over normalised sentence embeddings."""

    weights: np.ndarray
    bias: float
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.weights.ndim != 1:
            raise ValueError(f"weights must be a vector, got shape {self.weights.shape}")

    @property
    def dim(self) -> int:
        return int(self.weights.shape[0])

    @property
    def calibrated_threshold(self) -> float:
        """The threshold training chose (cross-validated for the target benign FPR)."""
        return float(self.metadata.get("threshold", 0.5))

    def score(self, embeddings: np.ndarray) -> np.ndarray:
        """P(injection) for each row of `embeddings` (shape (n, dim) or (dim,))."""
        x = np.asarray(embeddings, dtype=np.float32)
        if x.shape[-1] != self.dim:
            raise ValueError(f"embedding dimension {x.shape[-1]} does not match classifier dimension {self.dim}")
        return _sigmoid(x @ self.weights + self.bias)

    def score_input(self, text: str, embedding: np.ndarray | None) -> float:
        """Highest chunk score; `embedding` is one vector or one row per chunk of `text`."""
        if embedding is None:
            raise ValueError("the embedding classifier needs the text's embedding")
        return float(np.max(self.score(np.atleast_2d(embedding))))

    @classmethod
    def fit(cls, embeddings: np.ndarray, labels: np.ndarray, c: float = 1.0, **metadata: Any) -> InjectionClassifier:
        """Train with scikit-learn (imported here so serving needs only numpy)."""
        from sklearn.linear_model import LogisticRegression

        model = LogisticRegression(C=c, class_weight="balanced", max_iter=2000)
        model.fit(np.asarray(embeddings, dtype=np.float32), np.asarray(labels, dtype=np.int64))
        return cls(
            weights=model.coef_[0].astype(np.float32),
            bias=float(model.intercept_[0]),
            metadata={"c": c, **metadata},
        )

    def save(self, path: str | Path) -> None:
        """Write weights, bias and metadata to an `.npz` file."""
        np.savez(
            Path(path),
            weights=self.weights.astype(np.float32),
            bias=np.float32(self.bias),
            metadata=np.array(json.dumps(self.metadata, sort_keys=True)),
        )

    @classmethod
    def load(cls, path: str | Path = DEFAULT_ARTIFACT) -> InjectionClassifier:
        """Read an artifact written by `save` (no pickle is involved)."""
        with np.load(Path(path), allow_pickle=False) as data:
            classifier = cls(
                weights=data["weights"].astype(np.float32),
                bias=float(data["bias"]),
                metadata=json.loads(str(data["metadata"])),
            )
        logger.info("loaded injection classifier %s (dim %d)", path, classifier.dim)
        return classifier


class InjectionDetector:
    """Blocks text that matches a heuristic or that the scorer rates at or above `threshold`."""

    def __init__(
        self,
        scorer: InjectionScorer | None,
        threshold: float,
        use_heuristics: bool = True,
        rail: str = "injection",
        document_threshold: float | None = None,
        document_windows: bool = True,
        document_redaction: bool = False,
    ) -> None:
        for value in (threshold, document_threshold):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"threshold must be in [0, 1], got {value}")
        if scorer is None and not use_heuristics:
            raise ValueError("an injection detector needs a scorer, heuristics, or both")
        self.scorer = scorer
        self.threshold = threshold
        # Documents (retrieved passages, tool results) are calibrated apart: see injection_ensemble.
        self.document_threshold = threshold if document_threshold is None else document_threshold
        self.use_heuristics = use_heuristics
        self.rail = rail
        # Documents also scored by sentence windows, when the scorer can (the ensemble).
        self.document_windows = document_windows
        # A flagged document loses its offending pieces instead of all of it (``check``).
        self.document_redaction = document_redaction

    @property
    def reads_embedding(self) -> bool:
        """Whether the scorer reads the MiniLM embedding of the text (then it scores only the
        text that embedding was computed from)."""
        return bool(getattr(self.scorer, "uses_embedding", isinstance(self.scorer, InjectionClassifier)))

    @property
    def redacts_documents(self) -> bool:
        """``document_redaction``, with a scorer that reads text (not a MiniLM embedding)."""
        return self.document_redaction and self.scorer is not None and not self.reads_embedding

    def check(
        self,
        text: str,
        embedding: np.ndarray | None = None,
        *,
        document: bool = False,
        redact: bool = False,
        also: tuple[str, ...] = (),
    ) -> Verdict:
        """Verdict for one text; `embedding` is one vector or one row per `embedding_chunks` piece.
        ``document`` marks a retrieved passage or tool result (its own threshold); ``redact``: a
        flagged one comes back REDACTED if it can be (``documents.redact_flagged``). ``also``: other
        forms of the text judged with it (the text before PII redaction: "send it to <EMAIL>"
        reads as harmless to a classifier never trained on placeholders)."""
        verdict = self._check(text, embedding, document=document, also=also)
        if not (verdict.blocked and document and redact and self.redacts_documents):
            return verdict
        hold = getattr(self.scorer, "holding", None)
        try:
            with hold(documents.redaction_pieces(text)) if hold else contextlib.nullcontext():
                # A piece, and what is left, get the check the document got: as a document.
                # Not also as the chat turn a piece could be on its own: a page's sentences
                # read as turns, and what was left of it read as one turn, looked like
                # jailbreaks. Of eval5's 136 hard benign pages flagged by mistake, 91 were
                # dropped so, and those redacted kept a median 0.32 of their text (now 15 and
                # 0.68), while no more payload was left behind (README, "redacted, not dropped").
                rest = documents.redact_flagged(
                    text, lambda piece: self._check(piece, None, document=True).blocked, self._continues
                )
        except Exception as exc:  # the document was judged: a failure to save it keeps the block
            logger.warning("redacting a flagged document failed: %s", type(exc).__name__)
            rest = None
        if rest is None:
            return verdict
        return Verdict.redact(
            self.rail, rest, f"{verdict.reason}: flagged pieces removed", code=PolicyCode.PROMPT_INJECTION
        )

    def _continues(self, piece: str) -> bool:
        """Whether a neighbour of a removed piece looks like the instruction's continuation: a
        lower bar, as a document or as the chat turn it could be on its own
        (``documents.NEIGHBOUR_MARGIN``, ``NEIGHBOUR_TURN_THRESHOLD``)."""
        bar = float(sigmoid(logit(np.float64(self.document_threshold)) - documents.NEIGHBOUR_MARGIN))
        return (
            self._check(piece, None, document=True, threshold=bar).blocked
            or self._check(piece, None, document=False, threshold=documents.NEIGHBOUR_TURN_THRESHOLD).blocked
        )

    def _check(
        self,
        text: str,
        embedding: np.ndarray | None,
        *,
        document: bool,
        threshold: float | None = None,
        also: tuple[str, ...] = (),
    ) -> Verdict:
        # Encoded runs (base64, hex) are folded to "[encoded]" for the scorer; what they decode
        # to, when it is text, is judged as a text of its own (text_fold.decoded_payloads), every
        # one of them; so is each of ``also``.
        payloads = decoded_payloads(text) + [t for t in also if t != text]
        hits = self._hits(text, payloads) if self.use_heuristics else []
        score = None
        if self.scorer is not None:
            # A scorer may score documents its own way (the ensemble's document stacker).
            scoring = (getattr(self.scorer, "score_document", None) if document else None) or self.scorer.score_input
            if document and self.document_windows and hasattr(self.scorer, "scoring_chunks"):
                scoring = functools.partial(self.scorer.score_document, windows=True)
            score = scoring(text, embedding)
            if payloads and not self.reads_embedding:  # a MiniLM scorer has vectors of `text` only
                score = max([score, *(scoring(p, None) for p in payloads)])
        if hits:
            return Verdict.block(self.rail, PolicyCode.PROMPT_INJECTION, f"matched heuristic {hits[0]}", score)
        if threshold is None:
            threshold = self.document_threshold if document else self.threshold
        if score is not None and score >= threshold:
            return Verdict.block(
                self.rail,
                PolicyCode.PROMPT_INJECTION,
                f"classifier score {score:.2f} >= threshold {threshold:.2f}",
                score,
            )
        return Verdict.allow(self.rail, score)

    def check_heuristics(self, text: str) -> Verdict:
        """The phrase heuristics alone (over the text and what its encoded runs decode to): for
        instruction roles, whose text the classifier was not trained on."""
        hits = self._hits(text, decoded_payloads(text))
        if hits:
            return Verdict.block(self.rail, PolicyCode.PROMPT_INJECTION, f"matched heuristic {hits[0]}")
        return Verdict.allow(self.rail)

    @staticmethod
    def _hits(text: str, payloads: list[str]) -> list[str]:
        return [h for t in (text, *payloads) for h in heuristic_hits(t)]
