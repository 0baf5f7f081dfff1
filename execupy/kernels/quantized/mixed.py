"""quantized_decomposed:: compute kernels with int8 operands: mixed_mm, mixed_linear, add.

* mixed_mm(x [m, n], w int8 [n, p], scales [n]) = x @ (w * scales[:, None]): one scale per
  row of the weight, i.e. per reduction index.
* mixed_linear(x [m, n], w int8 [p, n], scales [p] or [p, groups]) = x @ (w * s)^T, the
  weight quantized per output row, or per group of ceil(n / groups) columns of each row
  (the last group may be shorter). Zero points are not supported, as in ExecuTorch.
* add: dequantize both operands, add in float32, requantize (round half to even, clamp);
  operands and out share one integer dtype and shape.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...schema.program import numpy_dtype
from ..portable._util import write
from ..registry import register_kernel

_HALF_OR_FLOAT = (np.dtype(np.float32), np.dtype(np.float16))


def _check_operands(name: str, x: np.ndarray, w: np.ndarray, scales: np.ndarray,
                    zero_points: Optional[np.ndarray]) -> None:
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"{name}: input and weight must be 2-D, got {x.shape} and {w.shape}")
    if w.dtype != np.int8:
        raise TypeError(f"{name}: weight dtype must be int8, got {w.dtype}")
    if x.dtype not in _HALF_OR_FLOAT or scales.dtype != x.dtype:
        raise TypeError(f"{name}: input {x.dtype} and scales {scales.dtype} must both be float32 or both float16")
    if zero_points is not None:
        raise ValueError(f"{name}: weight zero points are not supported (ExecuTorch's kernel refuses them too)")


@register_kernel("quantized_decomposed::mixed_mm.out")
def mixed_mm(x: np.ndarray, w: np.ndarray, scales: np.ndarray, zero_points: Optional[np.ndarray],
             out: np.ndarray) -> np.ndarray:
    _check_operands("mixed_mm", x, w, scales, zero_points)
    if scales.ndim != 1 or x.shape[1] != w.shape[0] or scales.shape[0] != w.shape[0]:
        raise ValueError(f"mixed_mm: shapes {x.shape} @ {w.shape} with scales {scales.shape} do not fit")
    dequantized = w.astype(np.float32) * scales.astype(np.float32)[:, None]
    return write(out, x.astype(np.float32) @ dequantized)


@register_kernel("quantized_decomposed::mixed_linear.out")
def mixed_linear(x: np.ndarray, w: np.ndarray, scales: np.ndarray, zero_points: Optional[np.ndarray],
                 dtype: Optional[int], out: np.ndarray) -> np.ndarray:
    _check_operands("mixed_linear", x, w, scales, zero_points)
    if dtype is not None and numpy_dtype(dtype) != out.dtype:
        raise TypeError(f"mixed_linear: dtype {numpy_dtype(dtype)} does not match out's {out.dtype}")
    p, n = w.shape
    if x.shape[1] != n or scales.ndim not in (1, 2) or scales.shape[0] != p:
        raise ValueError(f"mixed_linear: shapes {x.shape} x {w.shape}^T with scales {scales.shape} do not fit")
    per_column = scales.astype(np.float32).reshape(p, -1)
    group = -(-n // per_column.shape[1])           # ceil(n / groups) columns per scale
    if -(-n // group) != per_column.shape[1]:
        raise ValueError(f"mixed_linear: {per_column.shape[1]} groups do not fit {n} columns")
    per_column = np.repeat(per_column, group, axis=1)[:, :n]
    return write(out, x.astype(np.float32) @ (w.astype(np.float32) * per_column).T)


@register_kernel("quantized_decomposed::add.out")
def quantized_add(a: np.ndarray, a_scale: float, a_zero_point: int, a_quant_min: int, a_quant_max: int,
                  b: np.ndarray, b_scale: float, b_zero_point: int, b_quant_min: int, b_quant_max: int,
                  out_scale: float, out_zero_point: int, out_quant_min: int, out_quant_max: int,
                  out: np.ndarray) -> np.ndarray:
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype != out.dtype:
        raise ValueError(f"quantized add: a {a.dtype}{a.shape}, b {b.dtype}{b.shape} and out {out.dtype} must agree")
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"quantized add: operands must be integers, got {a.dtype}")
    for what, lo, hi in (("a", a_quant_min, a_quant_max), ("b", b_quant_min, b_quant_max),
                         ("out", out_quant_min, out_quant_max)):
        if not 0 <= lo <= hi <= 255:
            raise ValueError(f"quantized add: {what} quant range [{lo}, {hi}] must lie in [0, 255]")
    # float32 scales and int32 zero points, as ExecuTorch's kernel narrows them.
    total = ((a.astype(np.float32) - np.float32(a_zero_point)) * np.float32(a_scale)
             + (b.astype(np.float32) - np.float32(b_zero_point)) * np.float32(b_scale))
    q = np.rint(total * (np.float32(1.0) / np.float32(out_scale))) + out_zero_point
    return write(out, np.clip(q, out_quant_min, out_quant_max).astype(out.dtype))
