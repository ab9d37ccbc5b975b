"""Evaluate the injection detector on the held-out split: heuristics, classifier, and both combined.

Prints, per source and overall, recall on injection rows and the false-positive rate on negative rows,
plus precision overall. "Benign chat" FPR counts only everyday chat prompts; direct harmful requests
(HarmBench) are reported apart, since flagging them is not an injection false alarm in the usual sense.

    python -m guardrails.eval_injection --artifact guardrails/data/injection_classifier.npz
"""

from __future__ import annotations

import argparse
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np

from guardrails.detectors.injection import (
    DEFAULT_ARTIFACT,
    InjectionClassifier,
    InjectionDetector,
    embedding_chunks,
)
from guardrails.detectors.injection_ensemble import InjectionEnsemble, load_scorer
from guardrails.detectors.injection_heuristics import heuristic_hits
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


DISJOINT_EVAL = DATA_DIR / "disjoint" / "eval.tsv"


@dataclass(frozen=True)
class DisjointRow:
    """One row of the disjoint eval (see guardrails/data/disjoint/README.md)."""

    label: int
    lang: str
    style: str
    slot: str
    text: str


def load_disjoint(path: Path = DISJOINT_EVAL) -> list[DisjointRow]:
    """Rows of the disjoint eval file (tab-separated, a header line, ``\\n`` for a newline)."""
    rows = []
    with path.open(encoding="utf-8") as fh:
        next(fh)
        for line in fh:
            if line.strip():
                label, lang, style, slot, text = line.rstrip("\n").split("\t")
                rows.append(DisjointRow(int(label), lang, style, slot, text.replace("\\n", "\n")))
    return rows


def detector_scores(
    scorer: InjectionClassifier | InjectionEnsemble,
    encoder: SentenceEncoder,
    texts: list[str],
    documents: list[bool] | None = None,
    windows: bool = False,
):
    """Score of every detector on every text: each component alone, the stacked first stage
    (with a second stage), the deployed ensemble (its document stacker for ``documents``; for
    chat turns the second stage where it runs), and the heuristics (0/1). Chunked exactly as at
    serving time (``windows``: documents' sentence windows too), maximum over chunks."""
    chunked = embed_chunked(encoder, texts)
    out: dict[str, list[float]] = defaultdict(list)
    for text, vectors, document in zip(texts, chunked, documents or [False] * len(texts)):
        out["heuristics"].append(float(bool(heuristic_hits(text))))
        if isinstance(scorer, InjectionClassifier):
            out["minilm"].append(float(scorer.score(vectors).max()))
            continue
        chunks = scorer.scoring_chunks(text, windows=document and windows)
        parts, first, final = scorer.stages(chunks, vectors, document=document)
        for j, name in enumerate(scorer.components):
            out[name].append(float(parts[:, j].max()))
        if scorer.cascades:  # the first stage alone, beside the deployed cascade
            out["first stage"].append(float(first.max()))
        out["ensemble"].append(float(final.max()))
    return {name: np.array(values) for name, values in out.items()}


def _at_fpr(scores: np.ndarray, benign: np.ndarray, fpr: float) -> float:
    from guardrails.train_injection import threshold_for_fpr

    return threshold_for_fpr(scores[benign], fpr)


def disjoint_report(rows: list[DisjointRow], scores: dict[str, np.ndarray], deployed: dict[str, np.ndarray]) -> str:
    """Markdown tables: recall of every detector at 1% and 5% benign FPR (threshold set on the
    benign rows of the same slot), by language and by attack style; then the deployed detector
    (heuristics OR ensemble at the calibrated thresholds) with its recall and FPR by language."""
    labels = np.array([r.label for r in rows])
    lines = []
    for slot in ("user", "document"):
        in_slot = np.array([r.slot == slot for r in rows])
        benign = in_slot & (labels == 0)
        attacks = in_slot & (labels == 1)
        if not in_slot.any():
            continue
        if benign.any():  # an attacks-only corpus gets the deployed detector's recall alone
            lines += _at_fpr_table(rows, scores, slot, benign, attacks)
        d = deployed[slot]
        lines += [
            f"\n**{slot} slot, deployed detector at its calibrated threshold**: recall / benign FPR\n",
            "| language | recall | FPR |",
            "|---|---|---|",
        ]
        for g in ["all"] + sorted({r.lang for r in rows}):
            sel = in_slot & np.array([g == "all" or r.lang == g for r in rows])
            rec = d[sel & (labels == 1)].mean() if (sel & (labels == 1)).any() else float("nan")
            fp = d[sel & (labels == 0)].mean() if (sel & (labels == 0)).any() else float("nan")
            lines.append(f"| {g} | {rec:.3f} | {fp:.3f} |")
        by_style = sorted({(r.style, r.label) for r, m in zip(rows, in_slot) if m})
        lines += ["", "| style | n | flagged |", "|---|---|---|"]
        for g, label in by_style:
            sel = in_slot & np.array([r.style == g and r.label == label for r in rows])
            kind = "attack" if label else "benign"
            lines.append(f"| {g} ({kind}) | {int(sel.sum())} | {d[sel].mean():.3f} |")
    return "\n".join(lines)


def redaction_report(rows: list[DisjointRow], detector: InjectionDetector) -> str:
    """What the gateway does with each document (``injection.document_redaction``): passed,
    redacted (with the share of its characters kept) or dropped, by label."""
    docs = [r for r in rows if r.slot == "document"]
    if not docs:
        return ""
    lines = [
        "\n**documents as the gateway treats them** (redaction on): passed / redacted / dropped\n",
        "| | n | passed | redacted | dropped | characters kept when redacted |",
        "|---|---|---|---|---|---|",
    ]
    for label, kind in ((0, "benign"), (1, "planted")):
        counts, kept = {"passed": 0, "redacted": 0, "dropped": 0}, []
        for r in (r for r in docs if r.label == label):
            verdict = detector.check(r.text, None, document=True, redact=True)
            outcome = "dropped" if verdict.blocked else "redacted" if verdict.redacted else "passed"
            counts[outcome] += 1
            if verdict.redacted:
                kept.append(len(verdict.text or "") / len(r.text))
        n = sum(counts.values())
        share = f"{np.mean(kept):.0%}" if kept else "-"
        lines.append(f"| {kind} | {n} | " + " | ".join(str(c) for c in counts.values()) + f" | {share} |")
    return "\n".join(lines)


def _at_fpr_table(rows: list[DisjointRow], scores: dict[str, np.ndarray], slot: str, benign, attacks) -> list[str]:
    """Recall of every detector with its threshold set where 1% and 5% of the slot's benign
    rows are flagged, by language and by attack style."""
    lines: list[str] = []
    flagged = {}
    for name, s in scores.items():
        for fpr in (0.01, 0.05):
            t = 0.5 if name == "heuristics" else _at_fpr(s, benign, fpr)
            flagged[(name, fpr)] = s >= t
    head = "| | n | " + " | ".join(f"{name} @1% / @5%" for name in scores) + " |"
    lines += [
        f"\n**{slot} slot**: recall at 1% / 5% benign FPR ({int(benign.sum())} benign, "
        f"{int(attacks.sum())} attacks; heuristics have one operating point)\n",
        head,
        "|" + "---|" * (len(scores) + 2),
    ]
    keys = [("all", attacks)]
    keys += [(f"lang {g}", attacks & np.array([r.lang == g for r in rows])) for g in sorted({r.lang for r in rows})]
    styles = sorted({r.style for r, a in zip(rows, attacks) if a})
    keys += [(f"style {g}", attacks & np.array([r.style == g for r in rows])) for g in styles]
    for key, mask in keys:
        if not mask.any():
            continue
        cells = [f"{flagged[(n, 0.01)][mask].mean():.2f} / {flagged[(n, 0.05)][mask].mean():.2f}" for n in scores]
        lines.append(f"| {key} | {int(mask.sum())} | " + " | ".join(cells) + " |")
    fp_at_5 = {n: float(flagged[(n, 0.05)][benign].mean()) for n in scores}
    lines.append(
        "| benign FPR at the @5% point | "
        + str(int(benign.sum()))
        + " | "
        + " | ".join(f"{fp_at_5[n]:.3f}" for n in scores)
        + " |"
    )
    return lines


def latency(artifact: Path, model_dir: Path | None, texts: list[str], rounds: int = 3) -> str:
    """Per-text time of the input rails in one guardrails replica's process, as served: the
    MiniLM int8 embedding of each chunk (one thread) plus `InputGuard.check_text` (PII,
    heuristics, the ensemble with its USE encoder and character n-grams). The Serve hop from
    the ingress (~3 ms here) comes on top; benchmarks/bench_guardrails.py measures the whole path."""
    import time

    from guardrails.config import GuardrailPolicy
    from guardrails.input_rail import InputGuard

    encoder = SentenceEncoder(model_dir, backend="onnx-int8", num_threads=1)
    guard = InputGuard(GuardrailPolicy(), injection_scorer=load_scorer(artifact))
    rows = []  # (wall, cpu, embedding wall, embedding cpu) per text, seconds
    for _ in range(rounds):
        for text in texts:
            wall, cpu = time.perf_counter(), time.thread_time()
            vectors = encoder.encode(embedding_chunks(text), truncate=True)
            mid_wall, mid_cpu = time.perf_counter(), time.thread_time()
            guard.check_text(text, vectors)
            rows.append((time.perf_counter() - wall, time.thread_time() - cpu, mid_wall - wall, mid_cpu - cpu))
    t = np.array(rows) * 1000
    # CPU time of this thread is what the rails cost; wall time adds whatever else the
    # machine's cores were doing (on a shared CI machine, often most of it).
    return (
        f"input rails per text ({len(texts)} texts x {rounds} rounds), p50 / p90 in ms:\n"
        f"  wall {np.median(t[:, 0]):.2f} / {np.percentile(t[:, 0], 90):.2f}"
        f"  (MiniLM embedding {np.median(t[:, 2]):.2f}, rest {np.median(t[:, 0] - t[:, 2]):.2f})\n"
        f"  cpu  {np.median(t[:, 1]):.2f} / {np.percentile(t[:, 1], 90):.2f}"
        f"  (MiniLM embedding {np.median(t[:, 3]):.2f}, rest {np.median(t[:, 1] - t[:, 3]):.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval", type=Path, default=DATA_DIR / "injection_eval.jsonl")
    parser.add_argument("--disjoint", type=Path, default=DISJOINT_EVAL)
    parser.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    parser.add_argument("--threshold", type=float, default=None, help="default: the artifact's chosen threshold")
    parser.add_argument(
        "--backend",
        choices=get_args(Backend),
        default="onnx-int8",
        help="encoder runtime; the guardrails' default is onnx-int8 (needs --model-dir from make models)",
    )
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--skip-split", action="store_true", help="only the disjoint eval")
    parser.add_argument(
        "--no-document-windows",
        dest="document_windows",
        action="store_false",
        help="score documents whole, not by sentence windows too (the policy's option, on by default)",
    )
    parser.add_argument("--latency", action="store_true", help="only time the input rails on the disjoint eval's texts")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.latency:
        texts = [r.text for r in load_disjoint(args.disjoint) if r.slot == "user"]
        print(latency(args.artifact, args.model_dir, texts))
        return
    scorer = load_scorer(args.artifact, e5_threads=os.cpu_count() or 1)  # offline: every core
    threshold = args.threshold if args.threshold is not None else scorer.calibrated_threshold
    doc_threshold = getattr(scorer, "calibrated_document_threshold", threshold)
    encoder = SentenceEncoder(args.model_dir, backend=args.backend)
    main_name = "ensemble" if isinstance(scorer, InjectionEnsemble) else "minilm"

    if not args.skip_split:
        data = load_rows(args.eval)
        document = np.array([slot == "document" for slot in data.slots])
        s = detector_scores(scorer, encoder, data.texts, list(document), windows=args.document_windows)
        heur = s["heuristics"] >= 0.5
        flagged = s[main_name] >= np.where(document, doc_threshold, threshold)
        predictions = {"heuristics": heur, main_name: flagged, "combined": heur | flagged}
        print(
            f"held-out split {args.eval.name}: {len(data.texts)} rows, threshold {threshold:.3f}"
            f" (documents {doc_threshold:.3f})\n"
        )
        print(report(predictions, data.labels, data.sources, data.categories))

    rows = load_disjoint(args.disjoint)
    document = np.array([r.slot == "document" for r in rows])
    scores = detector_scores(scorer, encoder, [r.text for r in rows], list(document), windows=args.document_windows)
    combined = (scores["heuristics"] >= 0.5) | (scores[main_name] >= np.where(document, doc_threshold, threshold))
    scores["combined"] = np.maximum(scores["heuristics"], scores[main_name])
    deployed = {"user": combined, "document": combined}
    print(
        f"\ndisjoint eval {args.disjoint.name}: {len(rows)} rows; threshold {threshold:.3f}, "
        f"documents {doc_threshold:.3f}"
    )
    print(disjoint_report(rows, scores, deployed))
    if isinstance(scorer, InjectionEnsemble):
        # Scoring encodes e5 where the guardrails deployment primes it (``cascade_chunks``) or
        # lets redaction encode it (``InjectionEnsemble.holding``).
        detector = InjectionDetector(
            scorer,
            threshold,
            document_threshold=doc_threshold,
            document_windows=args.document_windows,
            document_redaction=True,
        )
        print(redaction_report(rows, detector))


if __name__ == "__main__":
    main()
