"""Creation kernels: full, zeros, ones, empty (and their _like forms), fill, arange,
scalar_tensor, and the random rand and randn.

Sizes come from the program, possibly computed at run time, so every requested shape
is validated with `check_created` before anything is allocated (a hostile program must
not be able to ask for terabytes). The dtype is always `out.dtype`.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..registry import register_kernel
from ._util import check_created, is_float, random_generator, write
from .binary import check_scalar_fits
from .shape import same_dtype


def filled(shape: Sequence[int], value, out: np.ndarray) -> np.ndarray:
    """A tensor of `shape` filled with `value` (cast to out.dtype), written into out if it fits."""
    shape = check_created(shape)
    with np.errstate(all="ignore"):  # C-style conversion, like ATen's scalar cast (may overflow)
        value = np.asarray(value).astype(out.dtype)
    if shape == out.shape:
        out.fill(value)
        return out
    return np.full(shape, value, dtype=out.dtype)


@register_kernel("aten::full.out")
def full(size: Sequence[int], fill_value, out: np.ndarray) -> np.ndarray:
    return filled(size, fill_value, out)


@register_kernel("aten::full_like.out")
def full_like(x: np.ndarray, fill_value, memory_format: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    return filled(x.shape, fill_value, out)


@register_kernel("aten::zeros.out")
def zeros(size: Sequence[int], out: np.ndarray) -> np.ndarray:
    return filled(size, 0, out)


@register_kernel("aten::ones.out")
def ones(size: Sequence[int], out: np.ndarray) -> np.ndarray:
    return filled(size, 1, out)


@register_kernel("aten::zeros_like.out")
def zeros_like(x: np.ndarray, memory_format: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    return filled(x.shape, 0, out)


@register_kernel("aten::ones_like.out")
def ones_like(x: np.ndarray, memory_format: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    return filled(x.shape, 1, out)


@register_kernel("aten::fill.Scalar_out")
def fill_scalar(x: np.ndarray, value, out: np.ndarray) -> np.ndarray:
    """A tensor shaped like x, all `value` (an integer that overflows x's dtype is an error)."""
    same_dtype(x, out, "fill")
    check_scalar_fits(value, x.dtype, "fill value")
    return filled(x.shape, value, out)


@register_kernel("aten::fill.Tensor_out")
def fill_tensor(x: np.ndarray, value: np.ndarray, out: np.ndarray) -> np.ndarray:
    """fill with the one element of a 0-dim `value` tensor, cast to x's dtype."""
    same_dtype(x, out, "fill")
    if value.ndim != 0:
        raise ValueError(f"fill: the value tensor must be 0-dim, got shape {value.shape}")
    return filled(x.shape, value, out)


def uninitialized(shape: Sequence[int], out: np.ndarray) -> np.ndarray:
    """`empty`: contents are undefined, so the planned buffer is returned untouched."""
    shape = check_created(shape)
    return out if shape == out.shape else np.zeros(shape, out.dtype)


@register_kernel("aten::empty.out")
def empty(size: Sequence[int], memory_format: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    return uninitialized(size, out)


@register_kernel("aten::empty_like.out")
def empty_like(x: np.ndarray, memory_format: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    return uninitialized(x.shape, out)


@register_kernel("dim_order_ops::_empty_dim_order.out")
def empty_dim_order(size: Sequence[int], dim_order: Optional[Sequence[int]] = None,
                    out: np.ndarray = None) -> np.ndarray:
    if dim_order is not None and sorted(dim_order) != list(range(len(size))):
        raise ValueError(f"_empty_dim_order: dim_order {tuple(dim_order)} does not fit size {tuple(size)}")
    return uninitialized(size, out)


@register_kernel("aten::scalar_tensor.out")
def scalar_tensor(s, out: np.ndarray) -> np.ndarray:
    return filled((), s, out)


def arange_length(start, end, step) -> int:
    """torch's element count: ceil((end - start) / step), computed in double."""
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    if not all(math.isfinite(float(v)) for v in (start, end, step)):
        raise ValueError(f"arange: bounds must be finite, got start={start} end={end} step={step}")
    if (step > 0 and end < start) or (step < 0 and end > start):
        raise ValueError(f"arange: upper bound {end} and lower bound {start} inconsistent with step sign {step}")
    return int(math.ceil((float(end) - float(start)) / float(step)))


@register_kernel("aten::arange.start_out")
def arange_start(start, end, step=1, out: np.ndarray = None) -> np.ndarray:
    (n,) = check_created((arange_length(start, end, step),))
    ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (start, end, step))
    if ints and not is_float(out.dtype):
        values = start + step * np.arange(n, dtype=np.int64)
    else:
        # torch computes start + i * step in double for float outputs and casts.
        values = float(start) + float(step) * np.arange(n, dtype=np.float64)
    return write(out, values)


@register_kernel("aten::arange.out")
def arange(end, out: np.ndarray) -> np.ndarray:
    return arange_start(0, end, 1, out)


# ----------------------------------------------------------------------------- random


def _random_dtype(out: np.ndarray, name: str) -> np.dtype:
    if not is_float(out.dtype) or out.dtype.itemsize < 2:
        raise TypeError(f"{name}: out must be float16, bfloat16, float32 or float64, got {out.dtype}")
    return out.dtype


@register_kernel("aten::rand.out")
def rand(size: Sequence[int], out: np.ndarray) -> np.ndarray:
    """Uniform on [0, 1): multiples of 2**-(mantissa bits + 1), so every value is exact in
    out's dtype and rounding can never reach 1.0 (also in float16 and bfloat16)."""
    import ml_dtypes  # its finfo knows bfloat16; imported here, not by every process (2.5 MiB)

    bits = ml_dtypes.finfo(_random_dtype(out, "rand")).nmant + 1
    shape = check_created(size)
    steps = random_generator().integers(0, 1 << bits, size=shape, dtype=np.int64)
    return write(out, np.ldexp(steps.astype(np.float64), -bits))


@register_kernel("aten::randn.out")
def randn(size: Sequence[int], out: np.ndarray) -> np.ndarray:
    """Standard normal samples, drawn in float64 and rounded to out's dtype."""
    _random_dtype(out, "randn")
    return write(out, random_generator().standard_normal(check_created(size)))
