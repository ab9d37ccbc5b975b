import pytest
from pydantic import ValidationError

from guardrails.config import (
    GuardrailConfigError,
    GuardrailPolicy,
    InjectionDetectorKind,
    load_policy,
)
from guardrails.entities import EntityType, RuleAction


def test_defaults_are_safe():
    policy = load_policy(None)
    assert policy.enabled and not policy.fail_open
    assert policy.pii.input[EntityType.CREDIT_CARD] is RuleAction.BLOCK
    assert policy.pii.input[EntityType.API_KEY] is RuleAction.BLOCK
    assert policy.pii.input[EntityType.EMAIL] is RuleAction.REDACT
    assert policy.pii.output[EntityType.PHONE] is RuleAction.REDACT
    assert policy.injection.detector is InjectionDetectorKind.EMBEDDING_CLASSIFIER
    assert policy.injection.threshold is None  # the classifier's calibrated threshold
    assert policy.output.holdback_chars == 64


def test_partial_pii_map_keeps_other_defaults():
    policy = load_policy({"pii": {"input": {"email": "allow"}}})
    assert policy.pii.input[EntityType.EMAIL] is RuleAction.ALLOW
    assert policy.pii.input[EntityType.CREDIT_CARD] is RuleAction.BLOCK
    assert len(policy.pii.input) == len(EntityType)


def test_unknown_key_is_rejected_with_source_and_path():
    with pytest.raises(GuardrailConfigError) as err:
        load_policy({"injection": {"treshold": 0.3}}, source="configs/models/qwen.yaml")
    message = str(err.value)
    assert "configs/models/qwen.yaml" in message
    assert "guardrails.injection.treshold" in message
    assert "Extra inputs are not permitted" in message


def test_unknown_top_level_key_is_rejected():
    with pytest.raises(GuardrailConfigError, match="guardrails.pii_rules"):
        load_policy({"pii_rules": {}})


def test_unknown_entity_is_rejected():
    with pytest.raises(GuardrailConfigError, match="guardrails.pii.input"):
        load_policy({"pii": {"input": {"passport": "block"}}})


@pytest.mark.parametrize(
    "data",
    [
        {"injection": {"threshold": 1.5}},
        {"injection": {"threshold": -0.1}},
        {"denied_topics": {"threshold": 2}},
        {"limits": {"max_input_chars": 0}},
        {"limits": {"max_messages": -3}},
        {"output": {"holdback_chars": 0}},
    ],
)
def test_out_of_range_values_are_rejected(data):
    with pytest.raises(GuardrailConfigError):
        load_policy(data)


def test_hf_detector_needs_its_section():
    with pytest.raises(GuardrailConfigError, match="hf_sequence_classifier"):
        load_policy({"injection": {"detector": "hf_sequence_classifier"}})
    policy = load_policy(
        {"injection": {"detector": "hf_sequence_classifier", "hf": {"model_path": "/models/prompt-guard"}}}
    )
    assert policy.injection.hf.injection_labels == ["INJECTION", "JAILBREAK"]


def test_bad_regex_and_private_key_redaction_are_rejected():
    with pytest.raises(GuardrailConfigError, match="does not compile"):
        load_policy({"output": {"forbidden": [{"pattern": "(", "regex": True}]}})
    with pytest.raises(GuardrailConfigError, match="private_key"):
        load_policy({"pii": {"output": {"private_key": "redact"}}})


def test_topics_need_descriptions_and_unique_names():
    with pytest.raises(GuardrailConfigError):
        load_policy({"denied_topics": {"topics": [{"name": "x", "descriptions": []}]}})
    with pytest.raises(GuardrailConfigError, match="unique"):
        topic = {"name": "x", "descriptions": ["a"]}
        load_policy({"denied_topics": {"topics": [topic, topic]}})


def test_policy_is_frozen():
    policy = GuardrailPolicy()
    with pytest.raises(ValidationError):
        policy.fail_open = True  # type: ignore[misc]


@pytest.mark.parametrize(
    "pattern, why",
    [
        (r"(a)\1", "backreferences are not supported"),
        (r"(?P<x>a)(?P=x)", "backreferences are not supported"),
        (r"(?<!x)secret", "lookbehind is not supported"),
        (r"secret(?=x)", "lookahead is not supported"),
        (r"secret(?!x)", "lookahead is not supported"),
        (r"secret\Z", r"write \\z for the end of the text"),
        (r"a\Cb", "any byte"),
    ],
)
def test_forbidden_regex_must_compile_with_re2(pattern, why):
    with pytest.raises(GuardrailConfigError, match="does not compile") as err:
        load_policy({"output": {"forbidden": [{"pattern": pattern, "regex": True}]}}, source="m.yaml")
    assert "m.yaml: guardrails.output.forbidden.0" in str(err.value)
    assert why.replace("\\\\", "\\") in str(err.value)


def test_forbidden_literals_and_re2_regexes_load():
    policy = load_policy(
        {
            "output": {
                "forbidden": [
                    {"pattern": r"(a)\1 (?<!x) \Z"},  # a literal: any characters are fine
                    {"pattern": r"ticket-\d{4}\z", "regex": True},
                ]
            }
        }
    )
    assert [p.regex for p in policy.output.forbidden] == [False, True]
