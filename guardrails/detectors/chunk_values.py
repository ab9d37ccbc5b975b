"""Where the injection ensemble's per-chunk values come from (``ChunkValues``, a mixin of
``InjectionEnsemble``): USE and e5 vectors, the fine-tuned e5s' logits and the character
model's scores are primed ahead by the guardrails deployment (which encodes concurrent
requests' chunks in one call), held within ``InjectionEnsemble.holding``, or computed now; and
the encoders themselves, each loaded once."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from guardrails.detectors.encoders import E5Encoder, Primed, UseEncoder, fill_missing
from guardrails.detectors.tuned_e5 import TunedE5


class ChunkValues:
    """The primed, held and computed values by chunk text; expects ``score_char``,
    ``_char_logit`` and the fine-tuned e5s' adapters (``turn_e5``, ``window_e5``) of the class
    it is mixed into."""

    def init_chunk_values(self) -> None:
        self._models: dict[str, Any] = {}  # the encoders, by name (``_loaded``)
        self._encoders_lock = threading.Lock()
        # Computed ahead by chunk text, used once by scoring: USE vectors (``store_primed``),
        # character-model P(injection) (``prime_char``), e5 vectors and the fine-tuned e5s'
        # logits (``store_primed_e5``, ``store_primed_tuned``, by field name).
        self._primed = Primed()
        self._primed_char = Primed()
        self._primed_e5 = Primed()
        self._primed_tuned = {"turn_e5": Primed(), "window_e5": Primed()}
        self._thread = threading.local()  # ``InjectionEnsemble.holding``
        # Set by the guardrails deployment, which primes the e5 vectors it allows
        # (``cascade_chunks``): scoring then never encodes e5 itself.
        self.primed_only = False
        # e5's intra-op threads (``load_scorer``): offline scoring may use every core.
        self.e5_threads = 1

    def store_primed_e5(self, chunks: list[str], vectors: np.ndarray) -> None:
        """Keep e5 vectors of ``chunks`` (from ``cascade_chunks``) for scoring."""
        self._primed_e5.put(chunks, vectors)

    def store_primed_tuned(self, name: str, chunks: list[str], logits: np.ndarray) -> None:
        """Keep the logits of ``chunks`` (from ``cascade_chunks``: chat turns' for
        ``turn_e5``, documents' for ``window_e5``) of that fine-tuned e5, for scoring."""
        self._primed_tuned[name].put(chunks, [float(v) for v in np.ravel(logits)])

    def store_primed(self, chunks: list[str], vectors: np.ndarray) -> None:
        """Keep USE vectors of ``chunks`` for scoring; vectors not used by then are dropped at
        a later call once too many wait (``Primed``)."""
        self._primed.put(chunks, vectors)

    def prime_char(self, chunks: list[str]) -> None:
        """Score ``chunks`` (from ``prime_chunks``) with the character model now, for scoring
        to use: the guardrails run it while USE encodes the same chunks in a thread."""
        if self._char_logit is None or not chunks:
            return
        self._primed_char.put(chunks, self.score_char(chunks).tolist())

    def _char_scores(self, chunks: list[str]) -> np.ndarray:
        found = self._primed_char.take(chunks)
        if any(f is None for f in found):
            return self.score_char(chunks)
        return np.asarray(found, dtype=np.float64)

    def _use_vectors(self, chunks: list[str]) -> np.ndarray:
        return np.stack(
            fill_missing(self._primed.take(chunks), chunks, lambda missing: self.use_encoder().encode(missing))
        )

    def _e5_vectors(self, chunks: list[str]) -> list[np.ndarray | None]:
        """The chunks' e5 vectors (``_ahead``)."""
        return self._ahead(self._primed_e5, chunks, "e5_held", lambda missing: self.e5_encoder().encode(missing))

    def _tuned_logits(self, name: str, chunks: list[str]) -> list[float | None]:
        """The chunks' logits by the fine-tuned e5 of field ``name`` (``_ahead``)."""
        return self._ahead(
            self._primed_tuned[name],
            chunks,
            f"{name}_held",
            lambda missing: self.tuned_e5(name).logits(missing).tolist(),
        )

    def _ahead(self, primed: Primed, chunks: list[str], held: str, compute) -> list:
        """Each chunk's value: primed, held (within ``holding``, in ``self._thread.<held>``), or
        computed now; with ``primed_only`` (the guardrails deployment, where scoring may run on
        the event loop) None for a chunk not primed, which then keeps its earlier stage's score
        (but within ``holding`` computed)."""
        found = primed.take(chunks)
        if values := getattr(self._thread, held, None):
            found = [v if v is not None else values.get(c) for c, v in zip(chunks, found)]
        if self.primed_only and not getattr(self._thread, "encodes_e5", False):
            return found
        return fill_missing(found, chunks, compute)

    def tuned_e5(self, name: str) -> TunedE5:
        """The fine-tuned e5 of field ``name`` (``turn_e5``, ``window_e5``)."""
        return self._loaded(name, lambda: TunedE5(getattr(self, name), threads=self.e5_threads))

    def e5_encoder(self) -> E5Encoder:
        return self._loaded("e5", lambda: E5Encoder(threads=self.e5_threads))

    def use_encoder(self) -> UseEncoder:
        return self._loaded("use", UseEncoder)

    def _loaded(self, key: str, load):
        """The model ``load`` makes, made once (two threads' first calls load one)."""
        with self._encoders_lock:
            if key not in self._models:
                self._models[key] = load()
        return self._models[key]
