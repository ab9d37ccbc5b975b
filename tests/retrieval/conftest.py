"""Shared fixtures of the retrieval tests: random unit vectors where the model isn't the point."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

VectorFactory = Callable[[int, int], np.ndarray]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)


@pytest.fixture
def unit_vectors(rng: np.random.Generator) -> VectorFactory:
    """``unit_vectors(n, dim)``: random L2-normalised float32 rows."""

    def make(n: int, dim: int) -> np.ndarray:
        x = rng.standard_normal((n, dim)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    return make
