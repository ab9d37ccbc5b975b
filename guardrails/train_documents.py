"""Train the injection ensemble's stages for documents (retrieved passages, tool results) and
calibrate their threshold; ``train_injection`` runs this after the chat stages.

The stages learn from sentence windows labelled by whether they hold the planted instruction
(``window_labels``): first a network over each piece's USE vector, then one over [USE, e5] for
the pieces the first scores at least ``DOCUMENT_E5_FLOOR``. The threshold is calibrated on the
held-out split's documents, scored exactly as the guardrails score them.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np

from guardrails.build_injection_data import HANDWRITTEN, _groups, _unescape, planted_payloads, split_payloads
from guardrails.detectors.documents import chunk_spans, document_pieces, sentence_windows
from guardrails.detectors.encoders import E5Encoder
from guardrails.detectors.injection import embedding_chunks
from guardrails.detectors.injection_ensemble import DOCUMENT_E5_FLOOR, InjectionEnsemble
from guardrails.detectors.text_fold import fold
from guardrails.planting import TOOL_RESULT_SHARE, plant, tool_result, written_forms
from guardrails.train_injection import LabelledSet, _fit, _recall_at, _stored

logger = logging.getLogger(__name__)

# The USE stage's network's L2 penalty (0.01 and 0.1 compared on the held-out split), and the
# share of a planted instruction's characters a window must cover to be an attack (a window
# with none of it is benign; one between is left out).
DOCUMENT_STAGE_ALPHA = 0.01
PAYLOAD_SHARE = 0.5
# The e5 stage's: at 0.1 and 0.01 its held-out recall was 0.935 and 0.945 at 5%, but 0.01
# flagged more benign documents on eval2 (11.8% against 7.8%) and the independent tool results
# (4 of 48 against 2).
DOCUMENT_E5_ALPHA = 0.1
# Benign documents only the document stages learn from (``document_stage_rows``): never in a
# split, so never pasted into a chat turn for the chat stages (which had lost recall to them) nor
# among the held-out documents the threshold is calibrated on (guardrails/data/README.md).
DOCUMENT_STAGE_SETS = HANDWRITTEN / "document_stage"
# Sets measured for the document stages and not shipped, read only when named
# (``document_stage_rows(experiments=...)``, ``train_injection --document-stage-experiment``);
# a folder of files, not an ``experiments/<set>/`` of build_injection_data's, whose sets are
# chat and split data.
DOCUMENT_STAGE_EXPERIMENTS = DOCUMENT_STAGE_SETS / "experiments"
DOCUMENT_STAGE_SEED = 47


def training_pieces(text: str) -> list[tuple[str, tuple[int, int] | None]]:
    """The pieces the documents' second stage learns from, with their spans: those scoring
    reads (``document_pieces``) and, in a document scored by its windows, the whole text's
    chunks before them. Scoring never reads those chunks, but as examples they help: trained
    without them, the stage ranked eval2's planted documents worse (recall at 5% FPR 0.765
    against 0.824) and flagged more of eval5's hard benign documents (45% against 40%)."""
    pieces = document_pieces(text, embedding_chunks)
    if not sentence_windows(text):
        return pieces  # its chunks are what scoring reads
    return chunk_spans(text, embedding_chunks) + pieces


def window_labels(
    text: str, payloads: list[str], pieces: list[tuple[str, tuple[int, int] | None]] | None = None
) -> list[int | None]:
    """Each of a planted document's ``pieces`` (default: its ``training_pieces``): 1 when it
    covers at least ``PAYLOAD_SHARE`` of the planted instruction's characters, 0 when none,
    None between or when the instruction is not found (as written, or escaped in a JSON tool
    result, non-ASCII text too or not)."""
    pieces = training_pieces(text) if pieces is None else pieces
    raw = next((p for p in payloads if any(f in text for f in written_forms(p))), None)
    if raw is None:
        return [None] * len(pieces)
    found = next(f for f in written_forms(raw) if f in text)
    start = text.index(found)
    end = start + len(found)

    def share(piece: str, span: tuple[int, int] | None) -> float:
        if span is not None:
            return max(0, min(span[1], end) - max(span[0], start)) / len(found)
        # A string value is the instruction's or not (its span in the JSON text is escaped).
        return 1.0 if raw in piece else len(piece) / len(raw) if piece in raw else 0.0

    shares = [share(piece, span) for piece, span in pieces]
    return [1 if x >= PAYLOAD_SHARE else 0 if x == 0 else None for x in shares]


def document_training_pieces(data: LabelledSet, heldout: LabelledSet) -> tuple[list[str], np.ndarray]:
    """The pieces the document stages learn from, and their labels.

    Every piece of the training split's documents (``training_pieces``): a benign document's
    pieces are benign; a planted one's are attacks where they hold the instruction and benign
    where they hold none of it (these, the same document's other sentences, teach it most). A
    benign piece of a planted document that appears in one of the held-out split's benign
    documents (the build plants into documents of either split) is left out, so the calibration
    reads documents it never saw. The chat attacks (their first chunk, as the first stage reads
    them) are attacks too: a jailbreak pasted into a document is one, and without them the
    network learnt only planted instructions and talked the stacker out of 4 in 10 chat attacks
    scored as documents."""
    payloads = planted_payloads()
    held_benign = [t for t, y, s in zip(heldout.texts, heldout.labels, heldout.slots) if s == "document" and y == 0]
    pieces, labels = [], []
    for text, label, slot in zip(data.texts, data.labels, data.slots):
        if slot != "document":
            if label:
                pieces.append(embedding_chunks(text)[0])
                labels.append(1)
            continue
        spanned = training_pieces(text)
        marks = window_labels(text, payloads, spanned) if label else [0] * len(spanned)
        for (piece, _), mark in zip(spanned, marks):
            if mark is None or (label and mark == 0 and any(piece in t for t in held_benign)):
                continue
            pieces.append(piece)
            labels.append(mark)
    return pieces, np.array(labels)


def document_stage_rows(experiments: tuple[str, ...] = ()) -> LabelledSet:
    """The document stages' own training rows (``DOCUMENT_STAGE_SETS``, every ``*.txt`` in the
    handwritten format, then the ``experiments`` named, ``DOCUMENT_STAGE_EXPERIMENTS/<name>.txt``):
    each benign document as written and, for ``TOOL_RESULT_SHARE`` of the prose ones, as a JSON
    tool result; and each once more with a training-split payload planted in it
    (``planting.plant``), so that a hard host (an AI-use policy, a page of HTML comments) teaches
    what is benign in it without hiding an instruction planted there. The same rows every run
    (an experiment's come after the shipped ones, which it leaves unchanged)."""
    chosen = [DOCUMENT_STAGE_EXPERIMENTS / f"{name}.txt" for name in experiments]
    if missing := [str(path) for path in chosen if not path.is_file()]:
        raise FileNotFoundError(f"no document-stage experiment at {', '.join(missing)}")
    payloads = split_payloads("train")
    rng = random.Random(DOCUMENT_STAGE_SEED)
    texts, labels, groups = [], [], []
    for path in sorted(DOCUMENT_STAGE_SETS.glob("*.txt")) + chosen:
        for group, lines in _groups(path).items():
            for doc in map(_unescape, lines):
                forms = [doc]
                if doc.lstrip()[:1] not in ("{", "[") and rng.random() < TOOL_RESULT_SHARE:
                    forms.append(tool_result(doc, rng))
                rows = [(f, 0) for f in forms] + [(plant(doc, rng.choice(payloads), rng), 1)]
                texts += [t for t, _ in rows]
                labels += [y for _, y in rows]
                groups += [f"{path.stem}/{group}"] * len(rows)
    n = len(texts)
    return LabelledSet(
        texts=texts,
        labels=np.array(labels, dtype=np.int64),
        sources=["document_stage"] * n,
        groups=groups,
        categories=["document_stage"] * n,
        slots=["document"] * n,
    )


def joined(a: LabelledSet, b: LabelledSet) -> LabelledSet:
    """``a``'s rows, then ``b``'s."""
    return LabelledSet(
        **{
            f.name: np.concatenate([a.labels, b.labels])
            if f.name == "labels"
            else getattr(a, f.name) + getattr(b, f.name)
            for f in dataclasses.fields(LabelledSet)
        }
    )


def _network_fields(prefix: str, network) -> dict:
    """A fitted network as the ensemble's ``{prefix}_hidden_weights``, ``_hidden_bias``,
    ``_weights`` and ``_bias``."""
    return {
        f"{prefix}_hidden_weights": network.coefs_[0].astype(np.float32),
        f"{prefix}_hidden_bias": network.intercepts_[0].astype(np.float32),
        f"{prefix}_weights": network.coefs_[1][:, 0].astype(np.float32),
        f"{prefix}_bias": float(network.intercepts_[1][0]),
    }


def calibrate_documents(
    staged: InjectionEnsemble, heldout: LabelledSet, target_fpr: float, *, rounds: int = 4
) -> tuple[float, float]:
    """The held-out split's document recall, and the document threshold, at ``target_fpr`` of
    its benign documents, scored exactly as the guardrails score them. Set in ``staged`` and
    calibrated again until it no longer changes (``rounds`` at most): the scores of windows a
    later stage did not read are moved onto the threshold (``document_use_shift``,
    ``window_e5_shift``), which moves only scores far under it."""
    docs = [i for i, s in enumerate(heldout.slots) if s == "document"]
    labels = heldout.labels[docs]
    recall, threshold = 0.0, staged.metadata.get("document_threshold")
    for _ in range(rounds):
        scores = np.array([staged.score_document(heldout.texts[i], None, windows=True) for i in docs])
        recall, calibrated = _recall_at(scores, labels, labels == 0, target_fpr)
        if _stored(calibrated) == threshold:
            break
        threshold = staged.metadata["document_threshold"] = _stored(calibrated)
    return recall, threshold


def train_document_stage(
    ensemble: InjectionEnsemble, data: LabelledSet, heldout: LabelledSet, target_fpr: float, *, e5: bool = True
) -> InjectionEnsemble:
    """``ensemble`` with the document stages (with ``e5``, both), and its document threshold
    calibrated on the held-out split's documents at ``target_fpr``.

    The e5 stage reads a window only when the USE stage scores it at least the floor; a window
    it does not read keeps the USE stage's score, moved onto the final threshold by the USE
    stage's own (``document_use_threshold``), so it is flagged exactly when the USE stage alone
    would flag it. That threshold is calibrated first, then the final one with the move in place
    (until it no longer changes: the move reaches only windows under the floor)."""
    pieces, y = document_training_pieces(data, heldout)
    folded = [fold(p) for p in pieces]
    x = ensemble.use_encoder().encode(folded)
    network = _fit("use", x, y, DOCUMENT_STAGE_ALPHA)
    staged = dataclasses.replace(
        ensemble,
        **_network_fields("doc", network),
        doc_e5_hidden_weights=None,
        doc_e5_hidden_bias=None,
        doc_e5_weights=None,
        doc_e5_bias=0.0,
        window_e5=None,  # fine-tuned against the stages replaced here: train_tuned_e5 --kind windows again
    )
    stale = ("document_threshold", "document_use_threshold", "document_e5_floor", "document_stage")
    stale += ("window_e5", "window_e5_base_threshold")
    staged.metadata = {k: v for k, v in ensemble.metadata.items() if k not in stale}
    docs = [i for i, s in enumerate(heldout.slots) if s == "document"]
    use_recall, use_threshold = calibrate_documents(staged, heldout, target_fpr, rounds=1)
    recall, threshold = use_recall, use_threshold
    stage: dict = {"alpha": DOCUMENT_STAGE_ALPHA, "heldout_recall_use_stage": round(use_recall, 4)}
    if e5:
        encoder = E5Encoder(threads=2)
        x5 = np.concatenate([x, encoder.encode(folded)], axis=1)
        network = _fit("use", x5, y, DOCUMENT_E5_ALPHA)
        staged = dataclasses.replace(staged, **_network_fields("doc_e5", network))
        staged._models["e5"] = encoder
        staged.metadata |= {"document_use_threshold": use_threshold, "document_threshold": use_threshold}
        staged.metadata["document_e5_floor"] = DOCUMENT_E5_FLOOR
        recall, threshold = calibrate_documents(staged, heldout, target_fpr)
        stage["e5_alpha"] = DOCUMENT_E5_ALPHA
    logger.info(
        "document stages: %d pieces (%d attacks, chat attacks included); held-out recall %.3f at %.4f "
        "(%.0f%% FPR; the USE stage alone %.3f at %.4f)",
        len(y),
        int(y.sum()),
        recall,
        threshold,
        100 * target_fpr,
        use_recall,
        use_threshold,
    )
    staged.metadata |= {
        "document_threshold": threshold,
        "document_target_fpr": target_fpr,
        "document_stage": stage
        | {
            "pieces": len(y),
            "attack_pieces": int(y.sum()),
            "calibrated_on": "held-out split documents",
            "heldout_documents": len(docs),
            "heldout_recall": round(recall, 4),
        },
    }
    return staged
