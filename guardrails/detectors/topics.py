"""Denied topics: cosine similarity between the text's embedding and each topic's description embeddings.

The deployment embeds `TopicMatcher.descriptions(policy)` once at start-up through the embedding
service, builds the matcher with `from_policy`, and then passes each request's embedding to `check`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from guardrails.config import DeniedTopicsPolicy
from guardrails.verdict import PolicyCode, Verdict


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.atleast_2d(np.asarray(x, dtype=np.float32))
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


@dataclass(frozen=True)
class DeniedTopicIndex:
    """One topic: its name, threshold and the embeddings of its descriptions (one row each)."""

    name: str
    threshold: float
    embeddings: np.ndarray


class TopicMatcher:
    """Blocks text whose embedding is at least `threshold`-similar to any description of a denied topic."""

    def __init__(self, topics: list[DeniedTopicIndex], rail: str = "denied_topics") -> None:
        self.topics = [DeniedTopicIndex(t.name, t.threshold, _normalise(t.embeddings)) for t in topics]
        self.rail = rail

    @staticmethod
    def descriptions(policy: DeniedTopicsPolicy) -> list[str]:
        """All descriptions in policy order; embed these and pass the matrix to `from_policy`."""
        return [d for topic in policy.topics for d in topic.descriptions]

    @classmethod
    def from_policy(cls, policy: DeniedTopicsPolicy, description_embeddings: np.ndarray) -> TopicMatcher:
        """Build from a policy and the embeddings of `descriptions(policy)`, row for row."""
        expected = len(cls.descriptions(policy))
        if expected and len(description_embeddings) != expected:
            raise ValueError(f"expected {expected} description embeddings, got {len(description_embeddings)}")
        topics, row = [], 0
        for topic in policy.topics:
            n = len(topic.descriptions)
            threshold = topic.threshold if topic.threshold is not None else policy.threshold
            topics.append(DeniedTopicIndex(topic.name, threshold, description_embeddings[row : row + n]))
            row += n
        return cls(topics)

    def similarities(self, embedding: np.ndarray) -> dict[str, float]:
        """Highest cosine similarity per topic over all rows (chunks) of `embedding`."""
        query = _normalise(embedding)
        return {t.name: float(np.max(query @ t.embeddings.T)) for t in self.topics}

    def check(self, embedding: np.ndarray) -> Verdict:
        """Block on the most similar topic that reaches its threshold; the reason names the topic."""
        best: tuple[float, DeniedTopicIndex] | None = None
        for topic, sim in zip(self.topics, self.similarities(embedding).values(), strict=True):
            if sim >= topic.threshold and (best is None or sim > best[0]):
                best = (sim, topic)
        if best is None:
            return Verdict.allow(self.rail)
        sim, topic = best
        return Verdict.block(
            self.rail, PolicyCode.DENIED_TOPIC, f"denied topic '{topic.name}' (similarity {sim:.2f})", sim
        )
