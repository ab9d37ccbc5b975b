"""The injection ensemble's character component: a logistic regression over hashed character
2-4-grams (scikit-learn's `HashingVectorizer`), language-agnostic by construction."""

from __future__ import annotations

import math
from array import array
from collections import Counter

import numpy as np

CHAR_FEATURES = 2**18


def char_vectorizer(norm: str | None = "l2"):
    """Hashed, L2-normalised character 2-4-gram counts within word boundaries (stateless);
    ``norm=None``: the counts, for a caller that divides by the norm itself."""
    from sklearn.feature_extraction.text import HashingVectorizer

    return HashingVectorizer(
        analyzer="char_wb",
        ngram_range=(2, 4),
        n_features=CHAR_FEATURES,
        alternate_sign=False,
        lowercase=True,
        norm=norm,
    )


class CharNgramLogit:
    """The character model's raw logit of one text: the weights of its hashed n-gram counts
    over their L2 norm, the buckets exactly as ``HashingVectorizer`` makes them (sklearn's
    signed murmurhash3 of each n-gram's UTF-8, ``abs() % n_features``).

    In Python on purpose: the vectorizer's sparse matrix cost 0.34 ms for a short text and its
    scipy steps release the GIL several times, each a chance for an encoder's thread to take it
    while the event loop waits; this is 0.07 ms and never lets go."""

    def __init__(self, weights: np.ndarray) -> None:
        from sklearn.utils import murmurhash3_32

        vectorizer = char_vectorizer(norm=None)  # its analyzer gives the n-grams
        self._n = vectorizer.n_features
        self._hash = murmurhash3_32
        self._grams = vectorizer.build_analyzer()
        # float64 copies of the weights, read one at a time as Python floats.
        self._weights = array("d", np.asarray(weights, dtype=np.float64).tobytes())

    def __call__(self, text: str) -> float:
        n = self._n
        buckets: dict[int, int] = {}
        for h, count in Counter(map(self._hash, self._grams(text))).items():
            i = (2147483647 - (n - 1)) % n if h == -2147483648 else abs(h) % n
            buckets[i] = buckets.get(i, 0) + count
        norm = math.sqrt(sum(c * c for c in buckets.values()))
        weights = self._weights
        return sum(weights[i] * c for i, c in buckets.items()) / norm if norm else 0.0
