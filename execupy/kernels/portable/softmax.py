"""softmax and log_softmax along one dim, shifted by the max for numerical stability.

Half inputs are computed in float32; with `half_to_float` ATen writes that float32
result to a float32 `out`, otherwise it is rounded back to the input's type. A slice
that is all -inf gives NaN, as in ATen.
"""
from __future__ import annotations

import numpy as np

from ..fast import compiled_rows
from ..registry import register_kernel
from ._util import compute_dtype, is_float, norm_dim, write


def _shifted(x: np.ndarray, dim: int, out: np.ndarray) -> tuple[np.ndarray, int]:
    if not is_float(x.dtype):
        raise TypeError(f"softmax needs a floating input, got {x.dtype}")
    wide = np.dtype(np.float64) in (x.dtype, out.dtype)
    dtype = np.dtype(np.float64) if wide else compute_dtype(x.dtype)
    xs = x if x.dtype == dtype else x.astype(dtype)
    if xs.ndim == 0:
        xs = xs.reshape(1)
    axis = norm_dim(dim, x.ndim)
    if xs.shape[axis] == 0:
        return xs, axis
    return xs - np.max(xs, axis=axis, keepdims=True), axis


@register_kernel("aten::_softmax.out")
def softmax(x: np.ndarray, dim: int, half_to_float: bool = False, out: np.ndarray = None) -> np.ndarray:
    if _compiled_softmax(x, dim, out):
        return out
    with np.errstate(all="ignore"):
        shifted, axis = _shifted(x, dim, out)
        e = np.exp(shifted)
        return write(out, (e / np.sum(e, axis=axis, keepdims=True)).reshape(x.shape))


def _compiled_softmax(x: np.ndarray, dim: int, out: np.ndarray) -> bool:
    """Softmax along the last axis of C-ordered float32 rows into out: the max and the sums
    compiled (kernels/fast/rows_jit.py, numpy's bits), the exp numpy's, in place in out (3
    passes and no temporaries instead of 5 and 3). False where that does not apply."""
    compiled = compiled_rows(x.size)
    if (compiled is None or x.ndim == 0 or x.size == 0 or norm_dim(dim, x.ndim) != x.ndim - 1
            or x.dtype != np.float32 or out.dtype != np.float32 or out.shape != x.shape
            or not x.flags.c_contiguous or not out.flags.c_contiguous):
        return False
    rows = out.reshape(-1, x.shape[-1])
    compiled.subtract_row_max(x.reshape(rows.shape), rows)
    with np.errstate(all="ignore"):
        np.exp(rows, out=rows)
    compiled.divide_by_row_sums(rows)
    return True


@register_kernel("aten::_log_softmax.out")
def log_softmax(x: np.ndarray, dim: int, half_to_float: bool = False, out: np.ndarray = None) -> np.ndarray:
    with np.errstate(all="ignore"):
        shifted, axis = _shifted(x, dim, out)
        result = shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))
        return write(out, result.reshape(x.shape))
