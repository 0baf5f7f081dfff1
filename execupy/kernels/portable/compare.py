"""Comparisons, allclose, where, logical and bitwise ops (and shifts), clamp.

Comparisons promote their operands with ATen's `result_type` (a Python scalar does not
widen a tensor of its own category: `uint8_tensor == -1` compares with 255, and
`half_tensor < 0.1` compares with 0.1 rounded to half) and write a bool `out`.
`where`, bitwise ops and clamp compute in out's dtype, which the exporter promoted.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..registry import register_kernel
from ._util import compute_dtype, is_float, write
from .binary import BOOL, apply_into, binary, check_scalar_fits, operand, result_type

# ----------------------------------------------------------------------------- comparisons


def compare(ufunc: Callable, a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    """`ufunc(a, b)` after ATen promotion of the operands (half types compared in float32,
    which is exact)."""
    common = result_type(a, b)
    dtype = compute_dtype(common)
    a, b = operand(operand(a, common), dtype), operand(operand(b, common), dtype)
    if out.dtype == BOOL:
        return apply_into(ufunc, a, b, out)
    return write(out, ufunc(a, b))


def _comparison(ufunc: np.ufunc) -> Callable[..., np.ndarray]:
    def kernel(a: np.ndarray, b: Any, out: np.ndarray) -> np.ndarray:
        return compare(ufunc, a, b, out)

    kernel.__name__ = kernel.__qualname__ = ufunc.__name__
    return kernel


eq = register_kernel("aten::eq.Scalar_out", "aten::eq.Tensor_out")(_comparison(np.equal))
ne = register_kernel("aten::ne.Scalar_out", "aten::ne.Tensor_out")(_comparison(np.not_equal))
lt = register_kernel("aten::lt.Scalar_out", "aten::lt.Tensor_out")(_comparison(np.less))
le = register_kernel("aten::le.Scalar_out", "aten::le.Tensor_out")(_comparison(np.less_equal))
gt = register_kernel("aten::gt.Scalar_out", "aten::gt.Tensor_out")(_comparison(np.greater))
ge = register_kernel("aten::ge.Scalar_out", "aten::ge.Tensor_out")(_comparison(np.greater_equal))


# ----------------------------------------------------------------------------- where


@register_kernel("aten::where.self_out")
def where(condition: np.ndarray, a: Any, b: Any, out: np.ndarray) -> np.ndarray:
    """`a` where `condition` holds, else `b`; all three broadcast. Values are cast to out's
    dtype before selection (so int64 -> float32 rounds once, directly)."""
    cond = condition if condition.dtype == BOOL else condition != 0
    return write(out, np.where(cond, operand(a, out.dtype), operand(b, out.dtype)))


# ----------------------------------------------------------------------------- logical ops


def _truth(x: Any) -> np.ndarray:
    """Nonzero -> True (NaN is nonzero, so it is True, as in ATen)."""
    x = np.asarray(x)
    return x if x.dtype == BOOL else x.astype(BOOL)


def _logical(ufunc: np.ufunc) -> Callable[..., np.ndarray]:
    def kernel(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        return binary(ufunc, _truth(a), _truth(b), out, BOOL)

    kernel.__name__ = kernel.__qualname__ = ufunc.__name__
    return kernel


logical_and = register_kernel("aten::logical_and.out")(_logical(np.logical_and))
logical_or = register_kernel("aten::logical_or.out")(_logical(np.logical_or))
logical_xor = register_kernel("aten::logical_xor.out")(_logical(np.logical_xor))


@register_kernel("aten::logical_not.out")
def logical_not(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    return write(out, np.logical_not(_truth(x)))


# ----------------------------------------------------------------------------- bitwise ops


def _require_integral(out: np.ndarray, name: str) -> None:
    if is_float(out.dtype):
        raise TypeError(f"{name} is only defined for integer and bool tensors, got {out.dtype}")


def _bitwise(ufunc: np.ufunc) -> Callable[..., np.ndarray]:
    def kernel(a: np.ndarray, b: Any, out: np.ndarray) -> np.ndarray:
        _require_integral(out, ufunc.__name__)
        return binary(ufunc, a, b, out, out.dtype)

    kernel.__name__ = kernel.__qualname__ = ufunc.__name__
    return kernel


bitwise_and = register_kernel("aten::bitwise_and.Scalar_out", "aten::bitwise_and.Tensor_out")(_bitwise(np.bitwise_and))
bitwise_or = register_kernel("aten::bitwise_or.Scalar_out", "aten::bitwise_or.Tensor_out")(_bitwise(np.bitwise_or))
bitwise_xor = register_kernel("aten::bitwise_xor.Scalar_out", "aten::bitwise_xor.Tensor_out")(_bitwise(np.bitwise_xor))


@register_kernel("aten::bitwise_not.out")
def bitwise_not(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """~x; on bool tensors that is logical not."""
    _require_integral(out, "bitwise_not")
    return write(out, np.invert(operand(x, out.dtype)))


def _shift(a: Any, b: Any, out: np.ndarray, left: bool, name: str) -> np.ndarray:
    """a << b or a >> b in the promoted integer dtype, with ATen's rule for shift counts
    outside [0, bits): a left shift gives 0, a right shift fills with the sign bit.
    (ExecuTorch's C++ `<<` leaves those undefined; ATen's answer is the defined one.)
    Bool operands shift as 0/1 integers and the result is nonzero-ness, as in C++."""
    common = result_type(a, b)
    if is_float(common):
        raise TypeError(f"{name} is only defined for integer and bool tensors, got {common}")
    dtype = np.dtype(np.int8) if common == BOOL else common
    a, b = np.broadcast_arrays(operand(operand(a, common), dtype), operand(operand(b, common), dtype))
    bits = dtype.itemsize * 8
    count = b.astype(np.int64)
    outside = (count < 0) | (count >= bits)
    count = np.where(outside, 0, count).astype(dtype)
    if left:
        result = np.where(outside, 0, np.left_shift(a, count))
    else:
        result = np.where(outside, np.right_shift(a, bits - 1) if dtype.kind == "i" else 0, np.right_shift(a, count))
    return write(out, result.astype(dtype, copy=False) != 0 if common == BOOL else result.astype(dtype, copy=False))


# `a << b` in Python exports as __lshift__, which ExecuTorch 1.5 has no kernel for; same op.
@register_kernel("aten::bitwise_left_shift.Tensor_out", "aten::bitwise_left_shift.Tensor_Scalar_out",
                 "aten::__lshift__.Tensor_out", "aten::__lshift__.Scalar_out")
def bitwise_left_shift(a: np.ndarray, b: Any, out: np.ndarray) -> np.ndarray:
    return _shift(a, b, out, left=True, name="bitwise_left_shift")


@register_kernel("aten::bitwise_right_shift.Tensor_out", "aten::bitwise_right_shift.Tensor_Scalar_out",
                 "aten::__rshift__.Tensor_out", "aten::__rshift__.Scalar_out")
def bitwise_right_shift(a: np.ndarray, b: Any, out: np.ndarray) -> np.ndarray:
    return _shift(a, b, out, left=False, name="bitwise_right_shift")


# ----------------------------------------------------------------------------- allclose


def tensors_close(a: np.ndarray, b: np.ndarray, rtol: float, atol: float, equal_nan: bool) -> bool:
    """torch.allclose: |a - b| <= atol + rtol * |b| everywhere; equal values (infinities
    too) are close, NaN is close to NaN only with equal_nan. (ExecuTorch 1.5's kernel
    calls equal infinities far apart, ignores equal_nan and compares integers bytewise.)"""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"allclose: tensors differ in dtype or shape ({a.dtype}{a.shape} vs {b.dtype}{b.shape})")
    wide = np.dtype(np.float64)
    return bool(np.allclose(a.astype(wide), b.astype(wide), rtol=float(rtol), atol=float(atol), equal_nan=bool(equal_nan)))


@register_kernel("aten::allclose.out")
def allclose(a: np.ndarray, b: np.ndarray, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False,
             dummy_param: bool = False, out: np.ndarray = None) -> np.ndarray:
    """ExecuTorch's out-variant of allclose: the answer goes into a one-element bool tensor."""
    if out.dtype != BOOL or out.size != 1:
        raise ValueError(f"allclose: out must be a one-element bool tensor, got {out.dtype}{out.shape}")
    out.fill(tensors_close(a, b, rtol, atol, equal_nan))
    return out


@register_kernel("aten::allclose.Tensor")
def allclose_tensor(a: np.ndarray, b: np.ndarray, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False,
                    dummy_param: bool = False) -> np.ndarray:
    """The functional form returns a new one-element bool tensor (what ATen mode builds)."""
    return np.array([tensors_close(a, b, rtol, atol, equal_nan)])


# ----------------------------------------------------------------------------- clamp


def _clamp(x: Any, lo: Any, hi: Any, out: np.ndarray) -> np.ndarray:
    """min(max(x, lo), hi) in out's compute dtype: NaN in x stays NaN, lo > hi gives hi."""
    if lo is None and hi is None:
        raise ValueError("clamp needs at least one of min and max")
    if out.dtype == BOOL:
        raise TypeError("clamp is not implemented for bool tensors")
    dtype = compute_dtype(out.dtype)
    for bound in (lo, hi):
        check_scalar_fits(bound, out.dtype, "clamp bound")
    v = operand(x, dtype)
    with np.errstate(all="ignore"):
        if lo is not None:
            v = np.maximum(v, operand(lo, dtype))
        if hi is not None:
            v = np.minimum(v, operand(hi, dtype))
    return write(out, v)


@register_kernel("aten::clamp.out", "aten::clamp.Tensor_out")
def clamp(x: np.ndarray, min: Any = None, max: Any = None, out: np.ndarray = None) -> np.ndarray:
    """Scalar or Tensor bounds (either may be None); tensor bounds broadcast with x."""
    return _clamp(x, min, max, out)


@register_kernel("aten::clamp_min.out", "aten::clamp_min.Tensor_out")
def clamp_min(x: np.ndarray, min: Any, out: np.ndarray) -> np.ndarray:
    return _clamp(x, min, None, out)


@register_kernel("aten::clamp_max.out", "aten::clamp_max.Tensor_out")
def clamp_max(x: np.ndarray, max: Any, out: np.ndarray) -> np.ndarray:
    return _clamp(x, None, max, out)
