"""Element-wise binary arithmetic: add, sub, rsub, mul, div (with rounding modes), floor_divide,
remainder, fmod, pow, maximum, minimum, atan2, hypot, copysign.

Every op broadcasts its operands and computes in the dtype of `out` (float32 for the
half types), which is the promoted dtype the exporter chose, as ATen does. Python
scalars (the `Scalar` overloads, `alpha`) are converted to that dtype the way a C++
cast would: integers wrap, floats round.

This module also holds the ATen type-promotion helpers (`promote_types`,
`result_type`, `operand`) that the other element-wise families import.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from ..registry import register_kernel
from ._util import LOW_PRECISION, compute_dtype, is_float, write

BOOL = np.dtype(np.bool_)
INT64 = np.dtype(np.int64)
FLOAT32 = np.dtype(np.float32)

# ----------------------------------------------------------------------------- type promotion


def promote_types(a: np.dtype, b: np.dtype) -> np.dtype:
    """ATen's `promoteTypes`: unlike numpy, an integer meeting any float gives that float
    (int64 + float16 -> float16), and float16 with bfloat16 gives float32."""
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    if a == BOOL:
        return b
    if b == BOOL:
        return a
    fa, fb = is_float(a), is_float(b)
    if fa and not fb:
        return a
    if fb and not fa:
        return b
    if fa and fb:
        if a.itemsize == b.itemsize:  # float16 vs bfloat16 (or the float8 kinds)
            return FLOAT32 if a.itemsize <= 2 else a
        return a if a.itemsize > b.itemsize else b
    return np.promote_types(a, b)  # two integer types: numpy agrees (uint8 + int8 -> int16)


def _category(dtype: Optional[np.dtype]) -> int:
    if dtype is None:
        return -1
    return 0 if dtype == BOOL else 2 if is_float(dtype) else 1


def _combine(higher: Optional[np.dtype], lower: Optional[np.dtype]) -> Optional[np.dtype]:
    """A lower-priority operand only changes the result when it is of a higher category."""
    if higher is None:
        return lower
    if lower is None or _category(higher) >= _category(lower):
        return higher
    return promote_types(higher, lower)


def _scalar_dtype(x: Any) -> np.dtype:
    """The dtype ATen gives a wrapped Python number (floats take the default dtype, float32)."""
    if isinstance(x, (bool, np.bool_)):
        return BOOL
    if isinstance(x, (int, np.integer)):
        return INT64
    return FLOAT32


def result_type(*operands: Any) -> np.dtype:
    """ATen's `result_type`: tensors with dimensions decide first, then 0-dim tensors, then
    Python scalars; a later class only matters if it is of a higher category
    (bool < integer < float). So `uint8_tensor + 300` stays uint8, `int_tensor * 2.5`
    is float32 and `half_tensor + float32_0dim` is float16. None operands are ignored."""
    dims = zero = wrapped = None
    for x in operands:
        if x is None:
            continue
        if isinstance(x, np.ndarray):
            if x.ndim > 0:
                dims = x.dtype if dims is None else promote_types(dims, x.dtype)
            else:
                zero = x.dtype if zero is None else promote_types(zero, x.dtype)
        else:
            t = _scalar_dtype(x)
            wrapped = t if wrapped is None else promote_types(wrapped, t)
    dtype = _combine(dims, _combine(zero, wrapped))
    if dtype is None:
        raise TypeError("result_type needs at least one operand")
    return dtype


def operand(x: Any, dtype: np.dtype) -> np.ndarray:
    """Cast an array or a Python scalar to `dtype` like a C++ static_cast: out-of-range
    integers wrap (uint8: 300 -> 44) instead of raising as numpy's conversion would."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == dtype else x.astype(dtype)
    if isinstance(x, (bool, np.bool_)):
        src = BOOL
    elif isinstance(x, (int, np.integer)):
        src = INT64 if -(1 << 63) <= int(x) < (1 << 63) else np.dtype(np.uint64)
    else:
        src = np.dtype(np.float64)
    with np.errstate(all="ignore"):
        return np.asarray(x, src).astype(dtype)


# ----------------------------------------------------------------------------- the kernel shape


def binary(ufunc: Callable, a: Any, b: Any, out: np.ndarray, dtype: Optional[np.dtype] = None) -> np.ndarray:
    """Apply `ufunc` to broadcast operands in `dtype` (default: out's compute dtype) and
    store into `out`; straight into it when nothing needs casting or reshaping."""
    if (dtype is None and type(a) is np.ndarray and type(b) is np.ndarray and a.dtype == b.dtype == out.dtype
            and a.shape == b.shape == out.shape and not LOW_PRECISION[out.dtype]):
        ufunc(a, b, out=out)  # the hot case; Method.execute already silences FP warnings
        return out
    dtype = compute_dtype(out.dtype) if dtype is None else dtype
    a, b = operand(a, dtype), operand(b, dtype)
    with np.errstate(all="ignore"):
        if dtype == out.dtype:
            return apply_into(ufunc, a, b, out)
        return write(out, ufunc(a, b))


def apply_into(ufunc: Callable, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`ufunc(a, b)` written straight into `out` when the broadcast result has out's shape
    (out's dtype must be the ufunc's result dtype), else returned as a new array."""
    if a.shape == out.shape or b.shape == out.shape:  # cheap common case; broadcast_shapes costs µs
        try:
            ufunc(a, b, out=out)
            return out
        except ValueError:  # the operands broadcast to a larger shape (dynamic shapes)
            pass
    elif np.broadcast_shapes(a.shape, b.shape) == out.shape:
        ufunc(a, b, out=out)
        return out
    return write(out, ufunc(a, b))


def _scaled(b: Any, alpha: Any, dtype: np.dtype) -> Any:
    """`alpha * b` in the compute dtype (ATen multiplies in opmath, float32 for half types)."""
    if alpha is None or (not isinstance(alpha, bool) and alpha == 1):
        return b
    with np.errstate(all="ignore"):
        return np.multiply(operand(b, dtype), operand(alpha, dtype))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TypeError(message)


def _check_alpha(alpha: Any, out: np.ndarray) -> None:
    """ATen's alpha rules: bool alpha only for bool results, no float alpha for integers."""
    if isinstance(alpha, (bool, np.bool_)):
        _require(out.dtype == BOOL, "boolean alpha is only supported for bool results")
    elif isinstance(alpha, (float, np.floating)):
        _require(is_float(out.dtype), "for integral results, alpha must not be a floating point number")


def _is_bool(x: Any) -> bool:
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, np.ndarray) and x.dtype == BOOL)


def _check_sub(a: Any, b: Any, alpha: Any, out: np.ndarray) -> None:
    _require(not (_is_bool(a) or _is_bool(b)), "subtraction with a bool operand is not supported; use logical_xor")
    _check_alpha(alpha, out)


# ----------------------------------------------------------------------------- add / sub / mul


@register_kernel("aten::add.out", "aten::add.Scalar_out")
def add(a: Any, b: Any, alpha: Any = 1, out: np.ndarray = None) -> np.ndarray:
    _check_alpha(alpha, out)
    if out.dtype == BOOL:  # bool + bool is "or" in ATen (True + True stays True)
        return binary(np.logical_or, a, b if alpha else False, out, BOOL)
    dtype = compute_dtype(out.dtype)
    return binary(np.add, a, _scaled(b, alpha, dtype), out)


@register_kernel("aten::sub.out", "aten::sub.Scalar_out")
def sub(a: Any, b: Any, alpha: Any = 1, out: np.ndarray = None) -> np.ndarray:
    _check_sub(a, b, alpha, out)
    dtype = compute_dtype(out.dtype)
    return binary(np.subtract, a, _scaled(b, alpha, dtype), out)


@register_kernel("aten::rsub.Scalar_out")
def rsub(a: Any, b: Any, alpha: Any = 1, out: np.ndarray = None) -> np.ndarray:
    """`b - alpha * a` (the Tensor is the subtrahend)."""
    _check_sub(a, b, alpha, out)
    dtype = compute_dtype(out.dtype)
    return binary(np.subtract, b, _scaled(a, alpha, dtype), out)


@register_kernel("aten::mul.out", "aten::mul.Scalar_out")
def mul(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    if out.dtype == BOOL:  # bool * bool is "and"
        return binary(np.logical_and, a, b, out, BOOL)
    return binary(np.multiply, a, b, out)


# ----------------------------------------------------------------------------- division


@register_kernel("aten::div.out", "aten::div.Scalar_out")
def div(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    """True division; integer operands were promoted to a float `out` by the exporter."""
    _require(is_float(out.dtype), f"true division needs a floating out tensor, got {out.dtype}")
    return binary(np.true_divide, a, b, out)


def _check_nonzero(b: Any, what: str) -> None:
    if np.any(np.asarray(b) == 0):
        raise ZeroDivisionError(f"integer {what} by zero")


def _int_div(a: np.ndarray, b: np.ndarray, mode: str) -> np.ndarray:
    _check_nonzero(b, "division")
    q = np.floor_divide(a, b)
    if mode == "trunc":  # floor rounds toward -inf; step back toward zero where inexact and negative
        q = q + ((q < 0) & (q * b != a)).astype(q.dtype)
    return q


@register_kernel("aten::div.out_mode", "aten::div.Scalar_mode_out")
def div_mode(a: Any, b: Any, rounding_mode: Optional[str] = None, out: np.ndarray = None) -> np.ndarray:
    if rounding_mode is None:
        return div(a, b, out)
    if rounding_mode not in ("trunc", "floor"):
        raise ValueError(f"div rounding_mode must be 'trunc', 'floor' or None, got {rounding_mode!r}")
    dtype = compute_dtype(out.dtype)
    a, b = operand(a, dtype), operand(b, dtype)
    if not is_float(dtype):
        _require(dtype != BOOL, "integer division of bool tensors is not supported")
        with np.errstate(all="ignore"):
            return write(out, _int_div(a, b, rounding_mode))
    with np.errstate(all="ignore"):
        if rounding_mode == "trunc":
            return write(out, np.trunc(np.true_divide(a, b)))
        # numpy's floor_divide is Python's: it corrects floor(a / b) with fmod exactly as ATen does
        return write(out, np.floor_divide(a, b))


@register_kernel("aten::floor_divide.out", "aten::floor_divide.Scalar_out")
def floor_divide(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    return div_mode(a, b, "floor", out)


@register_kernel("aten::remainder.Tensor_out", "aten::remainder.Scalar_out")
def remainder(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    """Floor semantics: the result takes the sign of the divisor (Python's %)."""
    if not is_float(out.dtype):
        _check_nonzero(b, "remainder")
    return binary(np.remainder, a, b, out)


@register_kernel("aten::fmod.Tensor_out", "aten::fmod.Scalar_out")
def fmod(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    """C semantics: the result takes the sign of the dividend."""
    if not is_float(out.dtype):
        _check_nonzero(b, "fmod")
    return binary(np.fmod, a, b, out)


# ----------------------------------------------------------------------------- the rest


def check_scalar_fits(value: Any, dtype: np.dtype, what: str) -> None:
    """ATen refuses (instead of wrapping) a Python int Scalar that overflows an integer
    dtype in some ops (pow, clamp). Like c10's check, unsigned types also accept
    negatives down to -max, which wrap."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) and _category(dtype) == 1:
        info = np.iinfo(dtype)
        low = -int(info.max) if info.min == 0 else int(info.min)
        if not low <= int(value) <= int(info.max):
            raise ValueError(f"{what} {value} cannot be converted to {dtype} without overflow")


@register_kernel("aten::pow.Tensor_Tensor_out", "aten::pow.Tensor_Scalar_out", "aten::pow.Scalar_out")
def pow_(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    """`a ** b`; pow.Scalar_out has a Scalar base. Integer powers with a negative exponent
    raise, as in ATen."""
    if not is_float(out.dtype):
        check_scalar_fits(b, out.dtype, "exponent")
        if np.any(np.asarray(b) < 0):
            raise ValueError("integers to negative integer powers are not allowed")
    if out.dtype == BOOL:  # ATen only gets here for a Scalar exponent 0 or 1 (fill / copy)
        _require(not isinstance(b, np.ndarray), "pow is not implemented for bool tensors")
        return write(out, operand(a, BOOL) | ~operand(b, BOOL))
    return binary(np.power, a, b, out)


@register_kernel("aten::maximum.out")
def maximum(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    return binary(np.maximum, a, b, out)  # propagates NaN like ATen


@register_kernel("aten::minimum.out")
def minimum(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    return binary(np.minimum, a, b, out)


@register_kernel("aten::atan2.out")
def atan2(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    return binary(np.arctan2, a, b, out)


@register_kernel("aten::hypot.out")
def hypot(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    _require(is_float(out.dtype), f"hypot needs floating tensors, got {out.dtype}")
    return binary(np.hypot, a, b, out)


@register_kernel("aten::copysign.out", "aten::copysign.Scalar_out")
def copysign(a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    return binary(np.copysign, a, b, out)
