"""Evaluate the injection detector on the held-out split: heuristics, classifier, and both combined.

Prints, per source and overall, recall on injection rows and the false-positive rate on negative rows,
plus precision overall. "Benign chat" FPR counts only everyday chat prompts; direct harmful requests
(HarmBench) are reported apart, since flagging them is not an injection false alarm in the usual sense.

    python -m guardrails.eval_injection --artifact guardrails/data/injection_classifier.npz
"""

from __future__ import annotations

import argparse
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np

from guardrails.detectors.injection import (
    DEFAULT_ARTIFACT,
    InjectionClassifier,
    heuristic_hits,
)
from guardrails.train_injection import DATA_DIR, embed_chunked, load_rows
from retrieval.encoder import Backend, SentenceEncoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rates:
    """Confusion counts with the derived rates; None where the rate is undefined."""

    tp: int
    fp: int
    fn: int
    tn: int

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def recall(self) -> float | None:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else None

    @property
    def fpr(self) -> float | None:
        return self.fp / (self.fp + self.tn) if self.fp + self.tn else None


def rates(flagged: np.ndarray, labels: np.ndarray) -> Rates:
    """Confusion counts of boolean predictions against 0/1 labels."""
    return Rates(
        tp=int(np.sum(flagged & (labels == 1))),
        fp=int(np.sum(flagged & (labels == 0))),
        fn=int(np.sum(~flagged & (labels == 1))),
        tn=int(np.sum(~flagged & (labels == 0))),
    )


def _fmt(value: float | None) -> str:
    return "  -  " if value is None else f"{value:5.3f}"


def report(predictions: dict[str, np.ndarray], labels: np.ndarray, sources: list[str], categories: list[str]) -> str:
    """Text table: per source, then overall and benign-chat-only figures, for each predictor."""
    lines = []
    names = list(predictions)
    header = f"{'source':34} {'n':>4} " + " ".join(f"{name:>20}" for name in names)
    lines += [header, f"{'':34} {'':>4} " + " ".join(f"{'recall / FPR':>20}" for _ in names)]
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, source in enumerate(sources):
        by_source[source].append(i)
    for source, idx in sorted(by_source.items()):
        ix = np.array(idx)
        cells = []
        for name in names:
            r = rates(predictions[name][ix], labels[ix])
            cells.append(f"{'recall ' + _fmt(r.recall) if labels[ix].any() else 'FPR ' + _fmt(r.fpr):>20}")
        lines.append(f"{source:34} {len(idx):>4} " + " ".join(cells))
    keep = np.array([c != "harmful_request" for c in categories])
    lines.append("")
    for name in names:
        r = rates(predictions[name][keep], labels[keep])
        lines.append(
            f"{name:12} injection vs benign chat: precision {_fmt(r.precision)} recall {_fmt(r.recall)} "
            f"FPR {_fmt(r.fpr)} (tp {r.tp} fp {r.fp} fn {r.fn} tn {r.tn})"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval", type=Path, default=DATA_DIR / "injection_eval.jsonl")
    parser.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    parser.add_argument("--threshold", type=float, default=None, help="default: the artifact's chosen threshold")
    parser.add_argument(
        "--backend",
        choices=get_args(Backend),
        default="onnx-int8",
        help="encoder runtime; the guardrails' default is onnx-int8 (needs --model-dir from make models)",
    )
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    data = load_rows(args.eval)
    classifier = InjectionClassifier.load(args.artifact)
    threshold = args.threshold if args.threshold is not None else float(classifier.metadata["threshold"])
    chunked = embed_chunked(SentenceEncoder(args.model_dir, backend=args.backend), data.texts)
    scores = np.array([float(classifier.score(e).max()) for e in chunked])
    heuristics = np.array([bool(heuristic_hits(t)) for t in data.texts])
    predictions = {
        "heuristics": heuristics,
        "classifier": scores >= threshold,
        "combined": heuristics | (scores >= threshold),
    }
    print(f"eval split {args.eval.name}: {len(data.texts)} rows, threshold {threshold:.3f}\n")
    print(report(predictions, data.labels, data.sources, data.categories))
    benign = np.array([c == "benign_chat" for c in data.categories])
    print("\ncombined, threshold sweep (benign chat FPR / injection recall):")
    for t in (0.5, 0.6, 0.7, 0.8, 0.9, threshold):
        flagged = heuristics | (scores >= t)
        print(f"  t={t:.3f}  FPR {np.mean(flagged[benign]):.3f}  recall {np.mean(flagged[data.labels == 1]):.3f}")
    fp_rows = [i for i in np.flatnonzero(predictions["combined"] & (data.labels == 0)) if benign[i]]
    print(
        f"\nbenign chat false positives (combined): {len(fp_rows)} rows, sources "
        f"{sorted({data.sources[i] for i in fp_rows})}"
    )


if __name__ == "__main__":
    main()
