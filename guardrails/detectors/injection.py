"""Prompt-injection and jailbreak detection: phrase heuristics plus a classifier over sentence embeddings.

The classifier is a logistic regression over all-MiniLM-L6-v2 embeddings (384-d, L2-normalised),
stored as a tiny `.npz` (weights, bias, JSON metadata). It never embeds text itself: the caller sends
the text through the shared batched embedding service and passes the vectors in. Long texts are
embedded in chunks (`embedding_chunks`) and the highest chunk score counts, so an instruction buried
at the end of a long document is not lost to the encoder's 256-token truncation.

A Hugging Face sequence classifier (e.g. Prompt Guard) can replace the embedding classifier: see
`guardrails.detectors.injection_hf.HfInjectionClassifier`, which satisfies the same `InjectionScorer`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from guardrails.verdict import PolicyCode, Verdict

logger = logging.getLogger(__name__)

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_DIM = 384
DEFAULT_ARTIFACT = Path(__file__).resolve().parent.parent / "data" / "injection_classifier.npz"

# High-precision phrases only: the classifier handles paraphrases, these catch the canonical attacks
# even when the classifier is unsure. Each was checked against the benign evaluation prompts.
_HEURISTICS: dict[str, re.Pattern[str]] = {
    "ignore_instructions": re.compile(
        r"\b(?:ignore|disregard|forget|override|bypass)\b[^.\n]{0,40}?"
        r"\b(?:previous|prior|above|earlier|preceding|initial|original|system|foregoing|following)\s+"
        r"(?:instructions?|prompts?|directions?|directives?|rules|guidelines|commands?|constraints)",
        re.IGNORECASE,
    ),
    "do_anything_now": re.compile(
        r"(?-i:\bDAN\b)[^\n]{0,60}?\bdo anything now\b|(?-i:\bDo Anything Now\b)|"
        r"\b(?:you are|you're|act as|pretend to be|become)\s+(?:now\s+)?(?-i:DAN|STAN|DUDE)\b",
        re.IGNORECASE,
    ),
    "mode_switch": re.compile(
        r"\b(?:ChatGPT|AI|assistant|chatbot|language model)\s+with\s+(?:developer|dev|god|DAN|jailbreak)\s+mode\b"
        r"|\b(?:developer|DAN|jailbreak|god)\s+mode\s+(?:enabled|activated)\b"
        r"(?=[\s\S]*\b(?:OpenAI|ChatGPT|content polic|restrictions|uncensored|unfiltered|guidelines)\b)",
        re.IGNORECASE,
    ),
    "unrestricted_persona": re.compile(
        r"\b(?:you are|you're|act as|pretend (?:to be|you are)|from now on,? you)\b[^.\n]{0,60}?"
        r"\b(?:unfiltered|uncensored|unrestricted|amoral|without (?:any )?(?:restrictions|filters|limitations|"
        r"ethical|moral))",
        re.IGNORECASE,
    ),
    "rules_release": re.compile(
        r"\b(?:you (?:are|will) no longer|you (?:don't|do not) have to|you are not bound by|you are free from|"
        r"(?:have|has) been freed from)\b[^.\n]{0,40}?\b(?:rules|restrictions|guidelines|policies|polic|filters|"
        r"OpenAI|ethic)",
        re.IGNORECASE,
    ),
    "system_prompt_exfiltration": re.compile(
        r"\b(?:reveal|print|output|repeat|display|leak|show me|tell me|give me|spell check|translate)\b[^.\n]{0,40}?"
        r"\b(?:your|the)\s+(?:system\s+prompt|initial\s+(?:instructions|prompt)|hidden\s+(?:instructions|prompt)|"
        r"original\s+instructions|pre-?prompt|previous\s+instructions)",
        re.IGNORECASE,
    ),
    # Indirect injection: text inside a pasted document that speaks to the model reading it.
    "addressed_to_model": re.compile(
        r"\b(?:note|message|instructions?|command)\s+(?:to|for)\s+(?:the\s+|any\s+)?(?:AI|assistant|language model|"
        r"LLM|chatbot|model)\b|\bif you are an? (?:AI|language model|LLM|assistant|chatbot)\b|"
        r"\b(?:AI|LLM|language model)s?\s+(?:assistants?\s+|agents?\s+)?(?:reading|processing|summari[sz]ing) this\b",
        re.IGNORECASE,
    ),
    "chat_template_tokens": re.compile(r"<\|im_start\|>\s*system|<<SYS>>|<\|system\|>|<\|start_header_id\|>system"),
}


def heuristic_hits(text: str) -> list[str]:
    """Names of the heuristics that match `text` (empty when none)."""
    return [name for name, pattern in _HEURISTICS.items() if pattern.search(text)]


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
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if scorer is None and not use_heuristics:
            raise ValueError("an injection detector needs a scorer, heuristics, or both")
        self.scorer = scorer
        self.threshold = threshold
        self.use_heuristics = use_heuristics
        self.rail = rail

    def check(self, text: str, embedding: np.ndarray | None = None) -> Verdict:
        """Verdict for one user text; `embedding` is one vector or one row per `embedding_chunks` piece."""
        hits = heuristic_hits(text) if self.use_heuristics else []
        score = self.scorer.score_input(text, embedding) if self.scorer is not None else None
        if hits:
            return Verdict.block(self.rail, PolicyCode.PROMPT_INJECTION, f"matched heuristic {hits[0]}", score)
        if score is not None and score >= self.threshold:
            return Verdict.block(
                self.rail,
                PolicyCode.PROMPT_INJECTION,
                f"classifier score {score:.2f} >= threshold {self.threshold:.2f}",
                score,
            )
        return Verdict.allow(self.rail, score)
