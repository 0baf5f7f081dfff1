"""The numba kernels behind `execupy.kernels.fast.conv` (imported only where numba is installed).

Module-level functions, not closures made inside a function: numba's disk cache never
matches a jitted function that calls another closure's dispatcher (here the inlined plane
and tap helpers), so `nchw` and `nhwc` were compiled again in every process.
`tests/kernels/test_fast_conv.py` checks that a second process finds every one in the cache.
The arithmetic is documented in conv.py.
"""
from __future__ import annotations

import numba
import numpy as np

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)


@numba.njit(cache=True, inline="always")
def nchw_plane(xp, w, sh, sw, dh, dw, out, n, c):
    # Rows are sliced first so the innermost loop indexes with its own counter only: an
    # index like base + x makes numba test for negative indices, and LLVM then cannot
    # vectorize the loop.
    ow = out.shape[3]
    for y in range(out.shape[2]):
        dst = out[n, c, y]
        for kh in range(w.shape[1]):
            row = xp[n, c, y * sh + kh * dh]
            for kw in range(w.shape[2]):
                wv, base = w[c, kh, kw], kw * dw
                first = kh == 0 and kw == 0
                if sw == 1:
                    src = row[base:base + ow]
                    if first:
                        for x in range(ow):
                            dst[x] = src[x] * wv
                    else:
                        for x in range(ow):
                            dst[x] += src[x] * wv
                else:
                    for x in range(ow):
                        term = row[base + x * sw] * wv
                        dst[x] = term if first else dst[x] + term

@numba.njit(cache=True)
def nchw(xp, w, sh, sw, dh, dw, out):
    for n in range(out.shape[0]):
        for c in range(out.shape[1]):
            nchw_plane(xp, w, sh, sw, dh, dw, out, n, c)

@numba.njit(cache=True)
def split_columns(x, sw, xz, xs):
    """xs[n, r, phase, q*C + ch] = x[n, r, q*sw + phase, ch] - xz: the input's columns split by
    stride phase, so that every kernel tap of an output row reads one contiguous run."""
    c = x.shape[3]
    for n in range(x.shape[0]):
        for r in range(x.shape[1]):
            for col in range(x.shape[2]):
                dst = xs[n, r, col % sw, (col // sw) * c:(col // sw + 1) * c]
                src = x[n, r, col]
                for ch in range(c):
                    dst[ch] = src[ch] - xz


@numba.njit(cache=True, inline="always")
def _tap(dst, src, wk, first):
    if first:
        for j in range(dst.shape[0]):
            dst[j] = src[j] * wk[j]
    else:
        for j in range(dst.shape[0]):
            dst[j] += src[j] * wk[j]


@numba.njit(cache=True, inline="always")
def epilogue(o, bias, clamp, lo, hi):
    """o (+ bias when not empty), clamped to [lo, hi] if `clamp` (NaN stays NaN, as in np.clip)."""
    if bias.shape[0]:
        for j in range(o.shape[0]):
            o[j] += bias[j]
    if clamp:
        for j in range(o.shape[0]):
            v = o[j]
            v = lo if v < lo else v
            o[j] = hi if v > hi else v


@numba.njit(cache=True)
def bias_clamp_flat(y, bias_tile, clamp, lo, hi):
    """Flat `y` in place, chunk by chunk of len(bias_tile) (the bias tiled over a few pixels,
    so that a layer of 16 channels still runs long loops): + bias when `bias_tile` is not
    empty, clamped to [lo, hi] if `clamp`."""
    step = bias_tile.shape[0] if bias_tile.shape[0] else 4096
    for j in range(0, y.shape[0], step):
        chunk = y[j:j + step]
        epilogue(chunk, bias_tile[:chunk.shape[0]], clamp, lo, hi)


@numba.njit(cache=True)
def pad_into(x, xz, top, left, channels_outer, xp):
    """xp[n, top + y, left + px, ch] = x[n, y, px, ch] - xz, x of any strides: channels in
    the outer loop when they are x's outer dimension in memory (a transposed NCHW input)."""
    n_, h, w, c = x.shape
    for n in range(n_):
        for y in range(h):
            dst = xp[n, top + y]
            if channels_outer:
                for ch in range(c):
                    for px in range(w):
                        dst[left + px, ch] = x[n, y, px, ch] - xz
            else:
                for px in range(w):
                    for ch in range(c):
                        dst[left + px, ch] = x[n, y, px, ch] - xz


@numba.njit(cache=True)
def nhwc(xs, tiled, bias_row, clamp, width, sh, sw, dh, dw, top, left, zero, lo, hi, out):
    """Depthwise conv of `xs` (split_columns' layout; `width` the unsplit input's) into `out`
    (N, OH, OW, C), then + bias when `bias_row` is not empty and clamped to [lo, hi] if `clamp`.

    Each (output row, tap) is one loop over the whole row, OW*C products against the tap's
    weights tiled across the row (`tiled`: (KH, KW, OW*C); `bias_row` the bias tiled so):
    short per-pixel loops (C can be 16) cost more in loop set-up than in arithmetic. Padded
    pixels add zero * w, as the padded copy would. (Three taps of a kernel row in one loop,
    one load and store of the output instead of three, measured no faster.)"""
    n_, h = xs.shape[0], xs.shape[1]
    kh_, kw_, row = tiled.shape
    oh, ow = out.shape[1], out.shape[2]
    c = row // ow
    zeros = np.full(row, zero, out.dtype)  # a padded run's input
    flat = out.reshape(n_, oh, row)
    for n in range(n_):
        for y in range(oh):
            o = flat[n, y]
            for i in range(kh_):
                r = y * sh + i * dh - top
                for k in range(kw_):
                    first = i == 0 and k == 0
                    wk = tiled[i, k]
                    off = k * dw - left  # input column = px * sw + off
                    phase = off % sw
                    shift = (off - phase) // sw  # split column = px + shift
                    a = min(-(off // sw), ow) if off < 0 else 0  # the first px whose column is >= 0
                    b = max(min(ow, (width - 1 - off) // sw + 1), a) if off < width else a  # past the last
                    if not 0 <= r < h:
                        b = a
                    if a > 0:
                        _tap(o[:a * c], zeros[:a * c], wk[:a * c], first)
                    if b > a:
                        _tap(o[a * c:b * c], xs[n, r, phase, (a + shift) * c:(b + shift) * c], wk[a * c:b * c], first)
                    if b < ow:
                        _tap(o[b * c:], zeros[b * c:], wk[b * c:], first)
            if bias_row.shape[0] or clamp:
                epilogue(o, bias_row, clamp, lo, hi)


@numba.njit(cache=True, inline="always")
def _shifted(t, ch, xz, shift):
    # x - x_zero in the accumulator's type for int8 data, x itself for float data
    return t[ch] - xz if shift else t[ch]


@numba.njit(cache=True, error_model="numpy")
def nhwc_3x3(x, padded, xz, shift, w, bias, clamp, sh, sw, dh, dw, top, left, lo, hi, out):
    """A 3x3 depthwise conv of `x` (N, H, W, C) into `out` (N, OH, OW, C), w (3, 3, C), then
    + bias when `bias` is not empty and clamped to [lo, hi] if `clamp`, pixel by pixel: each
    channel's nine products and the epilogue in registers, one store (`nhwc` goes tap by tap
    through the output row, a load and a store per tap, and splits a strided input by column
    phase first). The same operations in the same order as `nhwc`: the first tap's product,
    the others added in tap order, a tap outside the input reading `padded` (C values of x's
    type: 0, or x_zero for int8 data, which `shift` takes off every input as x - xz). Wide
    layers only (the caller's choice): for 16 channels the per-pixel loop is too short."""
    n_, h, width, c = x.shape
    oh, ow = out.shape[1], out.shape[2]
    has_bias = bias.shape[0] > 0
    for n in range(n_):
        for y in range(oh):
            r0 = y * sh - top
            in0, in1, in2 = 0 <= r0 < h, 0 <= r0 + dh < h, 0 <= r0 + 2 * dh < h
            for px in range(ow):
                c0 = px * sw - left
                ok0, ok1, ok2 = 0 <= c0 < width, 0 <= c0 + dw < width, 0 <= c0 + 2 * dw < width
                t0 = x[n, r0, c0] if in0 and ok0 else padded
                t1 = x[n, r0, c0 + dw] if in0 and ok1 else padded
                t2 = x[n, r0, c0 + 2 * dw] if in0 and ok2 else padded
                t3 = x[n, r0 + dh, c0] if in1 and ok0 else padded
                t4 = x[n, r0 + dh, c0 + dw] if in1 and ok1 else padded
                t5 = x[n, r0 + dh, c0 + 2 * dw] if in1 and ok2 else padded
                t6 = x[n, r0 + 2 * dh, c0] if in2 and ok0 else padded
                t7 = x[n, r0 + 2 * dh, c0 + dw] if in2 and ok1 else padded
                t8 = x[n, r0 + 2 * dh, c0 + 2 * dw] if in2 and ok2 else padded
                o = out[n, y, px]
                for ch in range(c):
                    acc = _shifted(t0, ch, xz, shift) * w[0, 0, ch]
                    acc = acc + _shifted(t1, ch, xz, shift) * w[0, 1, ch]
                    acc = acc + _shifted(t2, ch, xz, shift) * w[0, 2, ch]
                    acc = acc + _shifted(t3, ch, xz, shift) * w[1, 0, ch]
                    acc = acc + _shifted(t4, ch, xz, shift) * w[1, 1, ch]
                    acc = acc + _shifted(t5, ch, xz, shift) * w[1, 2, ch]
                    acc = acc + _shifted(t6, ch, xz, shift) * w[2, 0, ch]
                    acc = acc + _shifted(t7, ch, xz, shift) * w[2, 1, ch]
                    acc = acc + _shifted(t8, ch, xz, shift) * w[2, 2, ch]
                    if has_bias:
                        acc = acc + bias[ch]
                    if clamp:
                        acc = lo if acc < lo else acc
                        acc = hi if acc > hi else acc
                    o[ch] = acc


@numba.njit(cache=True)
def requantize_rows(acc, bias, scale, zero, lo, hi, out):
    for r in range(acc.shape[0]):
        a, o = acc[r], out[r]
        for c in range(acc.shape[1]):
            v = np.float32(a[c] + bias[c])  # in float64 for a float64 bias or int32 sums
            o[c] = min(max(np.rint(v * scale[c]) + zero, lo), hi)


# Every compiled entry point by name (the cache test runs each and reads its dispatcher's stats).
KERNELS = {"nchw": nchw, "split_columns": split_columns, "nhwc": nhwc, "nhwc_3x3": nhwc_3x3,
           "bias_clamp_flat": bias_clamp_flat,
           "pad_into": pad_into,
           "requantize_rows": requantize_rows}
