"""Element-wise unary math: abs, neg, _conj_physical, sign, rounding, exp/log family, roots,
trigonometry, erf, isnan/isinf, nan_to_num.

Two kinds of op:

* dtype-preserving ops (abs, neg, sign, floor, ...): `out` has the input's dtype;
  rounding an integer tensor is the identity.
* float ops (exp, sqrt, sin, ...): integer and bool inputs are promoted to the float
  dtype of `out` first (ATen gives `sqrt(int_tensor)` a float32 result).

Both compute in out's dtype, float32 for float16/bfloat16 as ATen's opmath does.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import numpy as np

from ..registry import register_kernel
from ._util import compute_dtype, is_float, write
from .binary import BOOL, operand


def _finfo(dtype: np.dtype):
    """np.finfo, or ml_dtypes.finfo for its own types (bfloat16...), which numpy does not know."""
    if dtype.type.__module__ == "ml_dtypes":
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def unary(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`fn(x)` computed in out's compute dtype and stored into `out`."""
    dtype = compute_dtype(out.dtype)
    with np.errstate(all="ignore"):
        return write(out, fn(operand(x, dtype)))


def _ufunc_kernel(ufunc: np.ufunc) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """A kernel for a numpy ufunc, writing straight into `out` when no cast is needed."""

    def kernel(x: np.ndarray, out: np.ndarray) -> np.ndarray:
        dtype = compute_dtype(out.dtype)
        if dtype == out.dtype and x.dtype == dtype and x.shape == out.shape:
            with np.errstate(all="ignore"):
                ufunc(x, out=out)
            return out
        return unary(ufunc, x, out)

    return kernel


def _require_float(out: np.ndarray, name: str) -> None:
    if not is_float(out.dtype):
        raise TypeError(f"{name} needs a floating out tensor, got {out.dtype}")


# ----------------------------------------------------------------------------- erf
# numpy has no erf. Chebyshev interpolants of two smooth helpers, fitted once against
# math.erf/erfc at the first erf (not at import: numpy.polynomial costs a process 1.3 MiB
# resident), give erf to about 1e-15 (relative near 0, absolute elsewhere):
#   |x| < 1:      erf(x) = x * g(x*x),               g(t) = erf(sqrt t) / sqrt t
#   1 <= |x| < 6: erf(x) = 1 - exp(-x*x) * erfcx(x), erfcx(x) = exp(x*x) * erfc(x)
#   |x| >= 6:     erf(x) = sign(x)   (erfc(6) is below half an ulp of 1)


@functools.cache
def erf_fits() -> tuple[np.polynomial.Chebyshev, np.polynomial.Chebyshev]:
    """The interpolants of g on [0, 1] and of erfcx on [1, 6] (see above)."""
    erf = np.frompyfunc(math.erf, 1, 1)
    erfc = np.frompyfunc(math.erfc, 1, 1)

    def g(t):
        s = np.sqrt(t)  # Chebyshev nodes never touch t = 0
        return erf(s).astype(np.float64) / s

    def erfcx(x):
        return erfc(x).astype(np.float64) * np.exp(x * x)

    cheb = np.polynomial.Chebyshev
    return cheb.interpolate(g, 12, domain=[0, 1]), cheb.interpolate(erfcx, 25, domain=[1, 6])


def erf_f64(x: np.ndarray) -> np.ndarray:
    """erf in float64 (NaN stays NaN, +-inf gives +-1)."""
    erf_small, erfcx_mid = erf_fits()
    shape = np.shape(x)
    x = np.asarray(x, np.float64).reshape(-1)  # 1-d, so that masked assignment works for 0-dim input
    ax = np.abs(x)
    result = np.sign(x)  # the |x| >= 6 answer, and NaN for NaN
    small = ax < 1.0
    xs = x[small]
    result[small] = xs * erf_small(xs * xs)
    mid = (ax >= 1.0) & (ax < 6.0)
    xm = ax[mid]
    result[mid] = np.sign(x[mid]) * (1.0 - np.exp(-xm * xm) * erfcx_mid(xm))
    return result.reshape(shape)


# ----------------------------------------------------------------------------- dtype-preserving ops


_abs, _negative = _ufunc_kernel(np.abs), _ufunc_kernel(np.negative)


@register_kernel("aten::abs.out")
def abs_(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    if x.dtype == BOOL:
        raise TypeError("abs is not implemented for bool tensors")
    return _abs(x, out)


@register_kernel("aten::neg.out")
def neg(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    if x.dtype == BOOL:
        raise TypeError("negation of a bool tensor is not supported; use logical_not")
    return _negative(x, out)


@register_kernel("aten::_conj_physical.out")
def conj_physical(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Complex conjugate (real tensors are copied unchanged, as in ATen)."""
    if x.dtype != out.dtype:
        raise TypeError(f"_conj_physical: input dtype {x.dtype} differs from out dtype {out.dtype}")
    return write(out, np.conjugate(x) if np.iscomplexobj(x) else x)


def _sign(x: np.ndarray) -> np.ndarray:
    if x.dtype == BOOL:
        return x
    s = np.sign(x)
    if is_float(x.dtype):  # ATen: sign(NaN) = 0 (it computes (0 < x) - (x < 0))
        s = np.where(np.isnan(s), s.dtype.type(0), s)
    return s


@register_kernel("aten::sign.out", "aten::sgn.out")
def sign(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    return unary(_sign, x, out)


def _rounding(ufunc: np.ufunc) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """Rounding an integer tensor is the identity (a copy), as in ATen; bool is refused."""
    float_kernel = _ufunc_kernel(ufunc)

    def kernel(x: np.ndarray, out: np.ndarray) -> np.ndarray:
        if x.dtype == BOOL:
            raise TypeError(f"{ufunc.__name__} is not implemented for bool tensors")
        if not is_float(x.dtype):
            return write(out, x)
        return float_kernel(x, out)

    return kernel


ceil = register_kernel("aten::ceil.out")(_rounding(np.ceil))
floor = register_kernel("aten::floor.out")(_rounding(np.floor))
trunc = register_kernel("aten::trunc.out", "aten::fix.out")(_rounding(np.trunc))
round_ = register_kernel("aten::round.out")(_rounding(np.rint))  # half to even, like ATen


@register_kernel("aten::round.decimals_out")
def round_decimals(x: np.ndarray, decimals: int = 0, out: np.ndarray = None) -> np.ndarray:
    """Round half to even at `decimals` places, ATen's way: scale by 10**|decimals|, rint,
    unscale (dividing for positive decimals, multiplying for negative ones)."""
    if not is_float(x.dtype):
        raise TypeError(f"round with decimals needs a floating tensor, got {x.dtype}")
    dtype = compute_dtype(out.dtype)
    scale = operand(10.0 ** abs(int(decimals)), dtype)

    def fn(v):
        if decimals > 0:
            return np.rint(v * scale) / scale
        return np.rint(v / scale) * scale

    return unary(fn, x, out)


@register_kernel("aten::frac.out")
def frac(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    _require_float(out, "frac")
    return unary(lambda v: v - np.trunc(v), x, out)


# ----------------------------------------------------------------------------- float ops


def _rsqrt(v: np.ndarray) -> np.ndarray:
    return 1 / np.sqrt(v)


def _reciprocal(v: np.ndarray) -> np.ndarray:
    return 1 / v


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-v))  # exp overflows to inf for very negative v: 1/inf = 0, as wanted


def _erf(v: np.ndarray) -> np.ndarray:
    return erf_f64(v).astype(v.dtype, copy=False)


_FLOAT_OPS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "sqrt": np.sqrt,
    "rsqrt": _rsqrt,
    "reciprocal": _reciprocal,
    "exp": np.exp,
    "exp2": np.exp2,
    "expm1": np.expm1,
    "log": np.log,
    "log2": np.log2,
    "log10": np.log10,
    "log1p": np.log1p,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "tanh": np.tanh,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "sigmoid": _sigmoid,
    "erf": _erf,
}


def _float_kernel(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    direct = _ufunc_kernel(fn) if isinstance(fn, np.ufunc) else None

    def kernel(x: np.ndarray, out: np.ndarray) -> np.ndarray:
        _require_float(out, name)
        if direct is not None:
            return direct(x, out)
        return unary(fn, x, out)

    kernel.__name__ = name
    kernel.__qualname__ = name
    return kernel


for _name, _fn in _FLOAT_OPS.items():
    register_kernel(f"aten::{_name}.out")(_float_kernel(_name, _fn))


# ----------------------------------------------------------------------------- float classification


def _as_float32_if_low(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) if compute_dtype(x.dtype) != x.dtype else x


@register_kernel("aten::isnan.out")
def isnan(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    if not is_float(x.dtype):
        return write(out, np.zeros(x.shape, BOOL))
    return write(out, np.isnan(_as_float32_if_low(x)))


@register_kernel("aten::isinf.out")
def isinf(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    if not is_float(x.dtype):
        return write(out, np.zeros(x.shape, BOOL))
    return write(out, np.isinf(_as_float32_if_low(x)))


@register_kernel("aten::nan_to_num.out")
def nan_to_num(
    x: np.ndarray,
    nan: Optional[float] = None,
    posinf: Optional[float] = None,
    neginf: Optional[float] = None,
    out: np.ndarray = None,
) -> np.ndarray:
    """NaN -> `nan` (0), +inf -> `posinf` (largest finite of out's dtype), -inf -> `neginf`."""
    if not is_float(x.dtype):
        return write(out, x)
    info = _finfo(out.dtype)
    v = _as_float32_if_low(x)
    fills = (
        (np.isnan(v), 0.0 if nan is None else nan),
        (v == np.inf, float(info.max) if posinf is None else posinf),
        (v == -np.inf, float(info.min) if neginf is None else neginf),
    )
    result = x.astype(out.dtype)
    for mask, value in fills:
        result[mask] = operand(value, out.dtype)
    return write(out, result)
