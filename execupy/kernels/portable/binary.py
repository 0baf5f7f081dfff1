"""Element-wise binary arithmetic: add, sub, mul, div, remainder, fmod, pow, maximum, minimum.

Every op broadcasts its operands and computes in the dtype of `out` (float32 for the
half types), which is the promoted dtype the exporter chose, as ATen does.
"""
from __future__ import annotations

import numpy as np

from ...runtime.registry import register_kernel
from ._util import as_compute, compute_dtype, is_float, write


def binary(ufunc, a, b, out: np.ndarray) -> np.ndarray:
    dtype = compute_dtype(out.dtype)
    if out.dtype == np.bool_ and ufunc in (np.add, np.multiply):
        ufunc = np.logical_or if ufunc is np.add else np.logical_and
        dtype = np.dtype(np.bool_)
    a, b = as_compute(a, dtype), as_compute(b, dtype)
    shape = np.broadcast_shapes(np.shape(a), np.shape(b))
    if shape == out.shape and dtype == out.dtype:
        with np.errstate(all="ignore"):
            ufunc(a, b, out=out)
        return out
    with np.errstate(all="ignore"):
        return write(out, ufunc(a, b))


def _scaled(b, alpha):
    return b if alpha == 1 else np.multiply(b, alpha)


@register_kernel("aten::add.out", "aten::add.Scalar_out")
def add(a, b, alpha=1, out=None):
    return binary(np.add, a, _scaled(b, alpha), out)


@register_kernel("aten::sub.out", "aten::sub.Scalar_out")
def sub(a, b, alpha=1, out=None):
    return binary(np.subtract, a, _scaled(b, alpha), out)


@register_kernel("aten::rsub.Scalar_out")
def rsub(a, b, alpha=1, out=None):
    return binary(np.subtract, b, _scaled(a, alpha), out)


@register_kernel("aten::mul.out", "aten::mul.Scalar_out")
def mul(a, b, out):
    return binary(np.multiply, a, b, out)


@register_kernel("aten::div.out", "aten::div.Scalar_out")
def div(a, b, out):
    return binary(np.true_divide, a, b, out)


def _int_div(a, b, mode):
    a, b = np.asarray(a), np.asarray(b)
    if np.any(b == 0):
        raise ZeroDivisionError("integer division by zero")
    q = np.floor_divide(a, b)
    if mode == "trunc":  # floor_divide rounds toward -inf; move toward zero where signs differ
        q = q + ((q < 0) & (q * b != a))
    return q


@register_kernel("aten::div.out_mode", "aten::div.Scalar_mode_out")
def div_mode(a, b, rounding_mode=None, out=None):
    if rounding_mode is None:
        return div(a, b, out)
    if not is_float(out.dtype):
        dtype = out.dtype
        return write(out, _int_div(as_compute(a, dtype), as_compute(b, dtype), rounding_mode))
    dtype = compute_dtype(out.dtype)
    with np.errstate(all="ignore"):
        q = np.true_divide(as_compute(a, dtype), as_compute(b, dtype))
        q = np.trunc(q) if rounding_mode == "trunc" else np.floor(q)
    return write(out, q)


@register_kernel("aten::floor_divide.out", "aten::floor_divide.Scalar_out")
def floor_divide(a, b, out):
    return div_mode(a, b, "floor", out)


@register_kernel("aten::remainder.Tensor_out", "aten::remainder.Scalar_out")
def remainder(a, b, out):
    # Python/floor semantics: the result takes the sign of the divisor (as torch does).
    if not is_float(out.dtype) and np.any(np.asarray(b) == 0):
        raise ZeroDivisionError("integer remainder by zero")
    return binary(np.remainder, a, b, out)


@register_kernel("aten::fmod.Tensor_out", "aten::fmod.Scalar_out")
def fmod(a, b, out):
    if not is_float(out.dtype) and np.any(np.asarray(b) == 0):
        raise ZeroDivisionError("integer fmod by zero")
    return binary(np.fmod, a, b, out)


@register_kernel("aten::pow.Tensor_Tensor_out", "aten::pow.Tensor_Scalar_out")
def pow_(a, b, out):
    return binary(np.power, a, b, out)


@register_kernel("aten::pow.Scalar_out")
def pow_scalar(a, b, out):
    return binary(np.power, a, b, out)


@register_kernel("aten::maximum.out")
def maximum(a, b, out):
    return binary(np.maximum, a, b, out)  # propagates NaN like torch


@register_kernel("aten::minimum.out")
def minimum(a, b, out):
    return binary(np.minimum, a, b, out)


@register_kernel("aten::atan2.out")
def atan2(a, b, out):
    return binary(np.arctan2, a, b, out)
