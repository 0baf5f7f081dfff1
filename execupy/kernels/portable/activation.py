"""Activation functions: relu, gelu, elu, hardtanh, leaky_relu, hardswish, hardsigmoid, silu,
softplus, mish, glu, logit, threshold, and native_dropout.

Each follows ATen's formula in the same order of operations (so float32 results agree
to the last bit or two), computed in out's dtype (float32 for the half types). NaN
inputs give NaN outputs, as in ATen.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ..registry import register_kernel
from ._util import compute_dtype, is_float, norm_dim, random_generator, write
from .binary import BOOL, operand
from .unary import erf_f64, unary


def _scalar(value: Any, out: np.ndarray) -> np.ndarray:
    """A Scalar argument in out's compute dtype."""
    return operand(value, compute_dtype(out.dtype))


def _require_float(out: np.ndarray, name: str) -> None:
    if not is_float(out.dtype):
        raise TypeError(f"{name} needs a floating tensor, got {out.dtype}")


@register_kernel("aten::relu.out")
def relu(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    if x.dtype == BOOL:
        raise TypeError("relu is not implemented for bool tensors")
    if x.dtype == out.dtype == compute_dtype(out.dtype) and x.shape == out.shape:
        np.maximum(x, x.dtype.type(0), out=out)  # maximum keeps NaN, as ATen's relu does
        return out
    return unary(lambda v: np.maximum(v, v.dtype.type(0)), x, out)


@register_kernel("aten::gelu.out")
def gelu(x: np.ndarray, approximate: str = "none", out: np.ndarray = None) -> np.ndarray:
    """'none': x/2 * (1 + erf(x/sqrt 2)); 'tanh': x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))."""
    _require_float(out, "gelu")
    if approximate == "none":
        from ..fast.gelu import gelu as compiled  # numba, when installed: the same arithmetic in one pass
        if compiled(x, out) is not None:
            return out

        def fn(v):
            # erf is evaluated in float64 and rounded once; the rest in the compute dtype
            e = erf_f64(v * v.dtype.type(math.sqrt(0.5))).astype(v.dtype)
            return v * v.dtype.type(0.5) * (1 + e)

    elif approximate == "tanh":

        def fn(v):
            k = v.dtype.type(math.sqrt(2.0 / math.pi))
            inner = k * (v + v.dtype.type(0.044715) * v * v * v)
            return v.dtype.type(0.5) * v * (1 + np.tanh(inner))

    else:
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return unary(fn, x, out)


@register_kernel("aten::elu.out")
def elu(x: np.ndarray, alpha: Any = 1, scale: Any = 1, input_scale: Any = 1, out: np.ndarray = None) -> np.ndarray:
    """x > 0: x * scale; else (exp(x * input_scale) - 1) * alpha * scale."""
    _require_float(out, "elu")
    negcoef = _scalar(alpha, out) * _scalar(scale, out)
    poscoef, negiptcoef = _scalar(scale, out), _scalar(input_scale, out)
    return unary(lambda v: np.where(v > 0, v * poscoef, np.expm1(v * negiptcoef) * negcoef), x, out)


@register_kernel("aten::hardtanh.out")
def hardtanh(x: np.ndarray, min_val: Any = -1, max_val: Any = 1, out: np.ndarray = None) -> np.ndarray:
    if x.dtype == BOOL:
        raise TypeError("hardtanh is not implemented for bool tensors")
    lo, hi = _scalar(min_val, out), _scalar(max_val, out)
    return unary(lambda v: np.minimum(np.maximum(v, lo), hi), x, out)


@register_kernel("aten::leaky_relu.out")
def leaky_relu(x: np.ndarray, negative_slope: Any = 0.01, out: np.ndarray = None) -> np.ndarray:
    _require_float(out, "leaky_relu")
    slope = _scalar(negative_slope, out)
    return unary(lambda v: np.where(v > 0, v, v * slope), x, out)


@register_kernel("aten::threshold.out")
def threshold(x: np.ndarray, threshold: Any, value: Any, out: np.ndarray = None) -> np.ndarray:
    """x <= threshold: value; else x."""
    if x.dtype == BOOL:
        raise TypeError("threshold is not implemented for bool tensors")
    t, fill = _scalar(threshold, out), _scalar(value, out)
    return unary(lambda v: np.where(v <= t, fill, v), x, out)


@register_kernel("aten::hardswish.out")
def hardswish(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """x * min(max(x + 3, 0), 6) / 6."""
    _require_float(out, "hardswish")

    def fn(v):
        three, six = v.dtype.type(3), v.dtype.type(6)
        return v * np.minimum(np.maximum(v + three, v.dtype.type(0)), six) / six

    return unary(fn, x, out)


@register_kernel("aten::hardsigmoid.out")
def hardsigmoid(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """min(max(x + 3, 0), 6) / 6."""
    _require_float(out, "hardsigmoid")

    def fn(v):
        three, six = v.dtype.type(3), v.dtype.type(6)
        return np.minimum(np.maximum(v + three, v.dtype.type(0)), six) / six

    return unary(fn, x, out)


@register_kernel("aten::silu.out")
def silu(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), as x / (1 + exp(-x))."""
    _require_float(out, "silu")
    return unary(lambda v: v / (1 + np.exp(-v)), x, out)


@register_kernel("aten::softplus.out")
def softplus(x: np.ndarray, beta: Any = 1, threshold: Any = 20, out: np.ndarray = None) -> np.ndarray:
    """x * beta > threshold: x (linear, avoids overflow); else log1p(exp(x * beta)) / beta."""
    _require_float(out, "softplus")
    b, t = _scalar(beta, out), _scalar(threshold, out)

    def fn(v):
        bx = v * b
        return np.where(bx > t, v, np.log1p(np.exp(bx)) / b)

    return unary(fn, x, out)


@register_kernel("aten::mish.out")
def mish(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """x * tanh(softplus(x))."""
    _require_float(out, "mish")
    return unary(lambda v: v * np.tanh(np.log1p(np.exp(v))), x, out)


@register_kernel("aten::glu.out")
def glu(x: np.ndarray, dim: int = -1, out: np.ndarray = None) -> np.ndarray:
    """Split `x` in halves a, b along `dim`: a * sigmoid(b)."""
    _require_float(out, "glu")
    if x.ndim == 0:
        raise ValueError("glu does not support 0-dim tensors")
    d = norm_dim(dim, x.ndim)
    if x.shape[d] % 2:
        raise ValueError(f"glu halves dimension {d}, but its size {x.shape[d]} is odd")
    a, b = np.split(x, 2, axis=d)

    def fn(v):
        first = operand(a, v.dtype)
        return first * (1 / (1 + np.exp(-v)))

    return unary(fn, b, out)


@register_kernel("aten::logit.out")
def logit(x: np.ndarray, eps: Optional[float] = None, out: np.ndarray = None) -> np.ndarray:
    """log(x / (1 - x)), with x first clamped to [eps, 1 - eps] when eps is given."""
    _require_float(out, "logit")
    if eps is not None:  # ATen rounds the bounds to the tensor's dtype (bfloat16: 1 - 1e-3 is 1)
        dtype = compute_dtype(out.dtype)
        lo, hi = operand(operand(eps, out.dtype), dtype), operand(operand(1 - eps, out.dtype), dtype)

    def fn(v):
        if eps is not None:
            v = np.minimum(np.maximum(v, lo), hi)
        return np.log(v / (1 - v))

    return unary(fn, x, out)


@register_kernel("aten::native_dropout.out")
def native_dropout(x: np.ndarray, p: float, train: Optional[bool] = None, out: np.ndarray = None,
                   mask: np.ndarray = None) -> tuple[np.ndarray, np.ndarray]:
    """Training (train is True or None, p > 0): each element is kept with probability 1 - p
    and scaled by 1 / (1 - p), as ATen defines it (ExecuTorch 1.5's portable kernel keeps
    kept values unscaled); `mask` says which were kept. Otherwise: a copy, mask all True."""
    _require_float(out, "native_dropout")
    if x.dtype != out.dtype or mask.dtype != BOOL:
        raise TypeError(f"native_dropout: out must have the input dtype {x.dtype} and mask must be bool, "
                        f"got {out.dtype} and {mask.dtype}")
    if not 0 <= p <= 1:
        raise ValueError(f"native_dropout: probability must be between 0 and 1, got {p}")
    if (train is None or train) and p > 0:
        keep = random_generator().random(x.shape) >= p
        dtype = compute_dtype(x.dtype)
        scale = dtype.type(0 if p == 1 else 1 / (1 - p))
        with np.errstate(all="ignore"):
            return write(out, np.where(keep, x.astype(dtype) * scale, dtype.type(0))), write(mask, keep)
    return write(out, x), write(mask, np.ones(x.shape, BOOL))
