"""The numba kernels behind `execupy.kernels.fast.conv` (imported only where numba is installed).

Module-level functions, not closures made inside a function: numba's disk cache never
matches a jitted function that calls another closure's dispatcher (here the inlined row
and plane helpers), so `nchw` and `nhwc` were compiled again in every process.
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

@numba.njit(cache=True, inline="always")
def nhwc_row(x, w, sh, sw, dh, dw, top, left, xz, zero, out, n, y):
    # Channels innermost, indexed by the loop's own counter (the other indices are
    # loop-invariant, so their negative-index tests leave the loop and it vectorizes).
    h, width, channels = x.shape[1], x.shape[2], x.shape[3]
    for px in range(out.shape[2]):
        for kh in range(w.shape[0]):
            r = y * sh + kh * dh - top
            for kw in range(w.shape[1]):
                col = px * sw + kw * dw - left
                first = kh == 0 and kw == 0
                if 0 <= r < h and 0 <= col < width:
                    if first:
                        for ch in range(channels):
                            out[n, y, px, ch] = (x[n, r, col, ch] - xz) * w[kh, kw, ch]
                    else:
                        for ch in range(channels):
                            out[n, y, px, ch] += (x[n, r, col, ch] - xz) * w[kh, kw, ch]
                elif first:  # a padded pixel: zero times the tap, as the padded copy computes it
                    for ch in range(channels):
                        out[n, y, px, ch] = zero * w[kh, kw, ch]
                else:
                    for ch in range(channels):
                        out[n, y, px, ch] += zero * w[kh, kw, ch]

@numba.njit(cache=True)
def nhwc(x, w, sh, sw, dh, dw, top, left, xz, zero, out):
    for n in range(out.shape[0]):
        for y in range(out.shape[1]):
            nhwc_row(x, w, sh, sw, dh, dw, top, left, xz, zero, out, n, y)

@numba.njit(cache=True)
def requantize_rows(acc, bias, scale, zero, lo, hi, out):
    for r in range(acc.shape[0]):
        a, o = acc[r], out[r]
        for c in range(acc.shape[1]):
            v = np.float32(np.float64(a[c]) + bias[c])
            o[c] = min(max(np.rint(v * scale[c]) + zero, lo), hi)


# Every compiled entry point by name (the cache test runs each and reads its dispatcher's stats).
KERNELS = {"nchw": nchw, "nhwc": nhwc, "requantize_rows": requantize_rows}
