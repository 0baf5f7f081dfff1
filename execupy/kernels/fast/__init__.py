"""Kernels for fused steps (execupy.runtime.fusion) and the hot quantized ops.

The float32 kernels here (`rms_norm`, `rope`, `rope_swapped`, `silu`) do, in one call, the very
operations the portable kernels they replace do one instruction at a time, in the same
order and dtype, so they are bit-identical to the unfused plan.

The quantized kernels (`execupy.kernels.fast.quantized`) have two implementations:
numba-compiled ones, used when the optional `fast` extra (numba) is installed, and numpy
ones, always available and the reference the compiled ones are tested against.
"""
from __future__ import annotations

import numpy as np

from ..portable.reduce import row_sums
from ..portable.unary import _sigmoid


def rms_norm(x: np.ndarray, eps, weight: np.ndarray) -> np.ndarray:
    """x * rsqrt(mean(x**2, -1, keepdim) + eps) * weight, as pow/mean/add/rsqrt/mul/mul compute it."""
    total = row_sums(np.square(x), np.float32)  # added in order, as the portable mean
    mean = np.true_divide(total, x.shape[-1] if x.ndim else 1, dtype=np.float32)
    inv = 1 / np.sqrt(mean + np.asarray(eps, np.float32))
    return np.multiply(x * inv, weight)


def rope(a: np.ndarray, b: np.ndarray, c: np.ndarray, s: np.ndarray, dim: int) -> np.ndarray:
    """cat([a*c - b*s, b*c + a*s], dim): rotate-half rotary position embedding."""
    return np.concatenate((a * c - b * s, b * c + a * s), axis=dim)


def rope_swapped(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x*cos + cat([x[..., D/2:], x[..., :D/2]], -1)*sin, as mul, cat, mul, add compute it
    (the tables are (cos, cos) and (-sin, sin): docs/llm-graph.md)."""
    half = x.shape[-1] // 2
    swapped = np.empty_like(x)
    swapped[..., :half] = x[..., half:]
    swapped[..., half:] = x[..., :half]
    return np.add(x * cos, swapped * sin)


def silu(gate: np.ndarray) -> np.ndarray:
    """gate * sigmoid(gate), as sigmoid then mul compute it."""
    return gate * _sigmoid(gate)
