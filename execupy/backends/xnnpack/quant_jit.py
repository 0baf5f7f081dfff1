"""Compiled kernels of quant.py (imported only where numba is installed): static 8-bit quantize
and element-wise add / subtract / multiply of 8-bit quantized tensors, one pass each over flat
arrays, every operation the float32 one numpy does in quant.py's steps, in the same order (no
fused multiply-adds), so the bits are the same. In numpy they are four to ten passes with
temporaries: an int8 MobileNetV2's residual Adds took 30-70 us each for 6,000-26,000 elements,
its input's quantization 84 us for 77,000; its global average pool (dequantize, mean, quantize)
40-70 us for 32,000."""
from __future__ import annotations

import numba
import numpy as np

from ...kernels.fast import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .quant import ADD, SUBTRACT


@numba.njit(cache=True, inline="always")
def _quantized(v, clamp, lo, hi, inv, zero, qlo, qhi):
    # quant.quantize after the storer's float clamp: rint(v * inv) + zero, saturated to [qlo, qhi]
    f32 = np.float32
    if clamp:
        v = lo if v < lo else v
        v = hi if v > hi else v
    q = f32(np.rint(f32(v * inv)) + zero)
    q = qlo if q < qlo else q
    return qhi if q > qhi else q


@numba.njit(cache=True, error_model="numpy")
def quantize_into(x, clamp, lo, hi, inv, zero, qlo, qhi, out):
    # float32 x [N] -> 8-bit out [N] (int8 or uint8)
    for i in range(x.size):
        out[i] = _quantized(x[i], clamp, lo, hi, inv, zero, qlo, qhi)


@numba.njit(cache=True, error_model="numpy")
def binary_into(op, a, a_zero, a_scale, b, b_zero, b_scale, clamp, lo, hi, inv, zero, qlo, qhi, out):
    # 8-bit a, b, out [N]: dequantize both ((q - zero) * scale), a op b, then _quantized
    f32 = np.float32
    for i in range(out.size):
        x = f32(f32(f32(a[i]) - a_zero) * a_scale)
        y = f32(f32(f32(b[i]) - b_zero) * b_scale)
        v = f32(x + y) if op == ADD else (f32(x - y) if op == SUBTRACT else f32(x * y))
        out[i] = _quantized(v, clamp, lo, hi, inv, zero, qlo, qhi)


@numba.njit(cache=True, error_model="numpy")
def mean_into(x, x_zero, x_scale, clamp, lo, hi, inv, zero, qlo, qhi, out):
    # 8-bit x [B, P, C] -> 8-bit out [B, C]: each channel's dequantized values ((q - zero) * scale)
    # summed in float32 pixel after pixel (numpy's order for a mean over axes other than the
    # last, with two channels or more), / P, then _quantized
    f32 = np.float32
    count, acc = f32(x.shape[1]), np.empty(x.shape[2], np.float32)
    for b in range(x.shape[0]):
        for c in range(x.shape[2]):
            acc[c] = f32(f32(x[b, 0, c]) - x_zero) * x_scale
        for p in range(1, x.shape[1]):
            for c in range(x.shape[2]):
                acc[c] += f32(f32(x[b, p, c]) - x_zero) * x_scale
        for c in range(x.shape[2]):
            out[b, c] = _quantized(f32(acc[c] / count), clamp, lo, hi, inv, zero, qlo, qhi)
