"""Chat UIs send their own prompts through the gateway beside the user's turns: titles, tags,
follow-up suggestions, search queries, autocompletion (as user messages), and RAG templates
that carry an attached document. The shipped input rails, as the embedded model's file sets
them, must let the background tasks through as user messages, and every one of these prompts
as a system message (README "Open WebUI's own RAG and the injection rail")."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.model_file import load_model_file
from guardrails.detectors.injection import DEFAULT_ARTIFACT
from guardrails.detectors.injection_ensemble import load_scorer
from guardrails.input_rail import InputGuard

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = {p.stem: p.read_text() for p in sorted((ROOT / "tests/fixtures/chat_ui_prompts").glob("*.txt"))}
# Sent as a user message with Open WebUI's defaults; refused there today (see the README).
SYSTEM_ONLY = {"owui_rag"}


@pytest.fixture(scope="module")
def guard() -> InputGuard:
    assert DEFAULT_ARTIFACT.exists(), f"no trained artifact at {DEFAULT_ARTIFACT}; run `make models`"
    policy = load_model_file(ROOT / "configs/models/smollm2-135m-instruct.yaml").guardrails
    return InputGuard(policy, injection_scorer=load_scorer(DEFAULT_ARTIFACT))


def test_the_fixture_has_every_prompt():
    assert len(PROMPTS) == 7 and SYSTEM_ONLY <= set(PROMPTS)


@pytest.mark.parametrize("name", sorted(set(PROMPTS) - SYSTEM_ONLY))
def test_background_tasks_pass_as_user_messages(guard, name):
    verdict = guard.check_text(PROMPTS[name], None)
    assert not verdict.blocked, (name, verdict.rail, verdict.reason)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_every_prompt_passes_as_a_system_message(guard, name):
    verdict = guard.check_text(PROMPTS[name], None, instructions=True)
    assert not verdict.blocked, (name, verdict.rail, verdict.reason)


TEMPLATE_ATTACKS = sorted((ROOT / "guardrails/data/disjoint/templates").glob("attack_*.txt"))


def test_the_templates_have_their_attacks():
    assert len(TEMPLATE_ATTACKS) == 5


@pytest.mark.parametrize("path", TEMPLATE_ATTACKS, ids=lambda p: p.stem)
def test_instructions_planted_in_a_rag_template_are_refused(guard, path):
    """A RAG template with one rule or one source replaced by an attack, sent as a user message
    (guardrails/data/README.md, "The rule-template experiment": the shipped detector's 5 of 5)."""
    verdict = guard.check_text(path.read_text(), None)
    assert verdict.blocked and verdict.rail == "injection", (path.stem, verdict.rail, verdict.reason)
