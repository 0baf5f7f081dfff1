"""Depthwise 2-D convolution and int8 requantization: numpy (the reference) and numba (the `fast` extra).

A depthwise convolution (one input channel per output channel) is a few multiply-adds per
output pixel; numpy does it one kernel tap at a time over the whole tensor, each tap a pass
through memory with a temporary, which made it the largest cost of a MobileNet forward.
The compiled kernels keep each output pixel's sum in a register and add the taps in the
same order as the numpy reference, first tap stored and the others added, each product
rounded then added (no fused multiply-add), so the two agree bit for bit in float32 and
float64, and exactly for integers.

Two layouts:

* `depthwise_nchw(xp, w, stride, dilation, out)`: the portable `aten::convolution` layout;
  `xp` (N, C, H, W) already padded, `w` (C, KH, KW).
* `depthwise_nhwc(x, w, stride, dilation, pads, x_zero, out)`: XNNPACK's layout, `x`
  (N, H, W, C), `w` (KH, KW, C), pads (top, bottom, left, right) read as zeros without
  copying the input (a padded pixel still contributes `0 * w`, as the padded copy would,
  so NaN and -0.0 come out the same). For int8 data `w` is int32 with its zero point
  already taken off and `x_zero` is taken off each input, so the sum is exact in int32,
  as XNNPACK's.

`requantize(acc, bias, scale, zero_point, lo, hi, out)` turns such integer sums (int32, or
float holding exact integers) plus a per-channel bias into int8 with XNNPACK's fp32
requantization (execupy/backends/xnnpack/quant.py: requantize) in one pass.

The kernels run on one thread: a MobileNet's depthwise layers take a fraction of a
millisecond each, and on a machine whose other core is busy a second thread's turn can
come a whole scheduler slice (milliseconds) later (measured: 0.3 ms serial, 8 ms on two
threads while another process ran).

`BACKEND` is "numba" when numba imports and EXECUPY_NUMBA is not 0, else "numpy"; both stay
callable as `NUMPY[...]` / `NUMBA[...]` so a test can compare them on the same inputs.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .elementwise import numba_enabled

# ---------------------------------------------------------------------------- numpy reference


def _taps(shape: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int], out_hw: tuple[int, int]):
    """(kh, kw, rows slice, columns slice) of each kernel tap over a padded input, in tap order."""
    (sh, sw), (dh, dw), (oh, ow) = stride, dilation, out_hw
    for kh, kw in np.ndindex(*shape):
        yield kh, kw, slice(kh * dh, kh * dh + (oh - 1) * sh + 1, sh), slice(kw * dw, kw * dw + (ow - 1) * sw + 1, sw)


def _depthwise_nchw_numpy(xp: np.ndarray, w: np.ndarray, stride: tuple[int, int], dilation: tuple[int, int],
                          out: np.ndarray) -> np.ndarray:
    for kh, kw, rows, cols in _taps(w.shape[1:], stride, dilation, out.shape[2:]):
        term = xp[:, :, rows, cols] * w[:, kh, kw][:, None, None]
        if kh == kw == 0:
            out[...] = term
        else:
            out += term
    return out


def _depthwise_nhwc_numpy(x: np.ndarray, w: np.ndarray, stride: tuple[int, int], dilation: tuple[int, int],
                          pads: tuple[int, int, int, int], x_zero: int, out: np.ndarray) -> np.ndarray:
    top, bottom, left, right = pads
    shifted = x.astype(out.dtype) - out.dtype.type(x_zero) if x_zero else x.astype(out.dtype, copy=False)
    xp = np.pad(shifted, ((0, 0), (top, bottom), (left, right), (0, 0)))
    for kh, kw, rows, cols in _taps(w.shape[:2], stride, dilation, out.shape[1:3]):
        term = xp[:, rows, cols] * w[kh, kw]
        if kh == kw == 0:
            out[...] = term
        else:
            out += term
    return out


def _requantize_numpy(acc: np.ndarray, bias: np.ndarray, scale: np.ndarray, zero_point: int, lo: float, hi: float,
                      out: np.ndarray) -> np.ndarray:
    y = (acc + bias).astype(np.float32)  # exact integers (float64 holds every int32 sum)
    y = np.rint(y * scale) + np.float32(zero_point)
    out[...] = np.clip(y, np.float32(lo), np.float32(hi))
    return out


NUMPY: dict[str, Callable] = {"depthwise_nchw": _depthwise_nchw_numpy, "depthwise_nhwc": _depthwise_nhwc_numpy,
                              "requantize": _requantize_numpy}

# ---------------------------------------------------------------------------- numba


def _compile() -> Optional[dict[str, Callable]]:
    from . import conv_jit as K

    def requantize(acc, bias, scale, zero_point, lo, hi, out):
        channels = acc.shape[-1]
        f32 = np.float32
        K.requantize_rows(np.ascontiguousarray(acc).reshape(-1, channels), bias, scale, f32(zero_point), f32(lo), f32(hi),
                          out.reshape(-1, channels))
        return out

    def depthwise_nchw(xp, w, stride, dilation, out):
        K.nchw(xp, w, *stride, *dilation, out)
        return out

    def depthwise_nhwc(x, w, stride, dilation, pads, x_zero, out):
        kind = out.dtype.type  # the zero point and the padding's zero in the accumulator's type
        K.nhwc(x, w, *stride, *dilation, pads[0], pads[2], kind(x_zero), kind(0), out)
        return out

    return {"depthwise_nchw": depthwise_nchw, "depthwise_nhwc": depthwise_nhwc, "requantize": requantize}


NUMBA: Optional[dict[str, Callable]] = _compile() if numba_enabled() else None
BACKEND = "numba" if NUMBA is not None else "numpy"
depthwise_nchw, depthwise_nhwc, requantize = ((NUMBA or NUMPY)[name] for name in NUMPY)
