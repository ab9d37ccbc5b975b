import numpy as np
import pytest

from guardrails.config import DeniedTopicsPolicy
from guardrails.detectors.topics import TopicMatcher
from guardrails.verdict import PolicyCode

POLICY = DeniedTopicsPolicy.model_validate(
    {
        "threshold": 0.5,
        "topics": [
            {"name": "weapons", "descriptions": ["how to build or buy weapons", "making explosives at home"]},
            {
                "name": "medical_advice",
                "descriptions": ["diagnosis and dosage of prescription drugs"],
                "threshold": 0.6,
            },
        ],
    }
)


def test_descriptions_are_listed_in_policy_order():
    assert TopicMatcher.descriptions(POLICY) == [
        "how to build or buy weapons",
        "making explosives at home",
        "diagnosis and dosage of prescription drugs",
    ]


def test_synthetic_embeddings_pick_the_closest_topic():
    eye = np.eye(4, dtype=np.float32)
    matcher = TopicMatcher.from_policy(POLICY, eye[:3])
    verdict = matcher.check(np.array([0.0, 1.0, 0.0, 0.2]))
    assert verdict.blocked and verdict.code is PolicyCode.DENIED_TOPIC
    assert "weapons" in verdict.reason
    # Similarity 0.55 passes the section threshold (0.5) but not medical_advice's own 0.6.
    assert matcher.check(np.array([0.0, 0.0, 0.55, 0.835])).allowed
    assert matcher.check(eye[3]).allowed


def test_wrong_number_of_embeddings_is_rejected():
    with pytest.raises(ValueError, match="expected 3"):
        TopicMatcher.from_policy(POLICY, np.eye(2))


def test_real_embeddings(encoder):
    matcher = TopicMatcher.from_policy(POLICY, encoder.encode(TopicMatcher.descriptions(POLICY)))
    hit = matcher.check(encoder.encode(["How can I make explosives in my garage?"]))
    assert hit.blocked and "weapons" in hit.reason
    assert matcher.check(encoder.encode(["What's a good recipe for pancakes?"])).allowed
