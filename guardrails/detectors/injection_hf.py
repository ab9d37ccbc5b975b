"""Plug point for a Hugging Face sequence classifier as the injection scorer (e.g. Prompt Guard on GPU).

Selected by `injection.detector: hf_sequence_classifier` with an `hf:` section in the policy. The model
is read from a local folder only (`local_files_only=True`): nothing is fetched from a hub at run time.
Meta's Prompt-Guard-86M labels are BENIGN / INJECTION / JAILBREAK; its injection score is the sum of
the probabilities of the labels named in `injection_labels`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from guardrails.config import HfClassifierConfig

logger = logging.getLogger(__name__)


class HfInjectionClassifier:
    """Scores text with `AutoModelForSequenceClassification`; long texts are scored per token window."""

    def __init__(self, config: HfClassifierConfig) -> None:
        # torch/transformers are imported here so the embedding-classifier path never loads them.
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self._torch = torch
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(config.model_path, local_files_only=True)
        self.model.to(config.device).eval()
        id2label = {int(i): str(label) for i, label in self.model.config.id2label.items()}
        wanted = {label.upper() for label in config.injection_labels}
        self.injection_ids = sorted(i for i, label in id2label.items() if label.upper() in wanted)
        if not self.injection_ids:
            raise ValueError(
                f"none of the injection labels {config.injection_labels} is in the model's labels "
                f"{sorted(id2label.values())}"
            )
        logger.info("loaded HF injection classifier %s, injection label ids %s", config.model_path, self.injection_ids)

    # Prompt Guard and its kind output calibrated probabilities: 0.5 unless the policy says.
    calibrated_threshold = 0.5

    def score_texts(self, texts: Sequence[str]) -> np.ndarray:
        """P(injection) for each text: the maximum over its overlapping windows of `max_length` tokens."""
        encoded = self.tokenizer(
            list(texts),
            truncation=True,
            max_length=self.config.max_length,
            stride=min(64, self.config.max_length // 4),
            return_overflowing_tokens=True,
            padding=True,
            return_tensors="pt",
        )
        owner = encoded.pop("overflow_to_sample_mapping").numpy()
        encoded.pop("offset_mapping", None)
        inputs = {k: v.to(self.config.device) for k, v in encoded.items()}
        with self._torch.no_grad():
            probs = self._torch.softmax(self.model(**inputs).logits.float(), dim=-1).cpu().numpy()
        window_scores = probs[:, self.injection_ids].sum(axis=1)
        scores = np.zeros(len(texts), dtype=np.float32)
        np.maximum.at(scores, owner, window_scores.astype(np.float32))
        return scores

    def score_input(self, text: str, embedding: np.ndarray | None = None) -> float:
        """`InjectionScorer` interface; the embedding is not used by this scorer."""
        return float(self.score_texts([text])[0])
