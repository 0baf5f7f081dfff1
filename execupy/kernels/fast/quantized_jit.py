"""The numba kernels behind `execupy.kernels.fast.quantized` (imported only where numba is installed).

They are module-level functions, not closures made inside a function: numba's disk cache
never matches a jitted function that calls another closure's dispatcher, so such a caller
was compiled again in every process (0.5 s inside the first forward call per kernel).
`tests/kernels/test_fast_kernels.py` checks that a second process finds every one in the cache.

Layouts and arithmetic are those of `PackedWeight` (quantized.py): the weight input-major
`qt`: int8 rows [K, N], four int8 rows per int32 word [K/4, N] or eight 4-bit rows per uint32
word in panels [N/64, K/8, 64] (`rows_per_word` 1, 4, 8), `w = q * scale + offset` per group of rows.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .vnni_jit import PANEL, prefetch_ahead

_M4 = np.uint32(15)
_S4, _S8, _S12, _S16, _S20, _S24, _S28 = (np.uint32(4 * r) for r in range(1, 8))
_B8, _B16, _B24 = np.int32(8), np.int32(16), np.int32(24)


@numba.njit(cache=True, fastmath=True)
def _int8_columns(x, qt, scales, offsets, group_size, c0, c1, out):
    # out[j] = sum_g (s[g, j] * sum_{c in g} x[c] q[c, j] + o[g, j] * sum_{c in g} x[c]) over input
    # rows c0..c1 (a range may start or end inside a group: each part adds its own rows' sums).
    # The innermost loops run over contiguous outputs through 1-D row views, which LLVM
    # vectorises (2-D indexing there kept it scalar, 10x slower); four input rows per pass
    # quarter the traffic on the running sums.
    n = out.shape[0]
    total = np.zeros(n, np.float32)
    acc = np.empty(n, np.float32)
    for g in range(c0 // group_size, -(-c1 // group_size)):
        acc[:] = 0
        c, end = max(c0, g * group_size), min(c1, (g + 1) * group_size)
        start = c
        while c + 4 <= end:
            x0, x1, x2, x3 = x[c], x[c + 1], x[c + 2], x[c + 3]
            r0, r1, r2, r3 = qt[c], qt[c + 1], qt[c + 2], qt[c + 3]
            for j in range(n):
                acc[j] += (x0 * np.float32(r0[j]) + x1 * np.float32(r1[j])
                           + x2 * np.float32(r2[j]) + x3 * np.float32(r3[j]))
            c += 4
        while c < end:
            xc, r0 = x[c], qt[c]
            for j in range(n):
                acc[j] += xc * np.float32(r0[j])
            c += 1
        xs, sg, og = x[start:end].sum(), scales[g], offsets[g]
        for j in range(n):
            total[j] += acc[j] * sg[j] + og[j] * xs
    out[:] = total


@numba.njit(cache=True, fastmath=True, inline="always")
def _word_dot(v, x0, x1, x2, x3):
    # x0..x3 times the four signed bytes of an int32 word (row 4i + r in byte r): a shift up and an
    # arithmetic shift down per byte, in the lane (the casts keep numba's shifts 32-bit)
    return (x0 * np.float32(np.int32(np.int32(v << _B24) >> _B24)) + x1 * np.float32(np.int32(np.int32(v << _B16) >> _B24))
            + x2 * np.float32(np.int32(np.int32(v << _B8) >> _B24)) + x3 * np.float32(np.int32(v >> _B24)))


@numba.njit(cache=True, fastmath=True)
def _word_columns(x, qt, scales, offsets, group_size, wide, c0, c1, out):
    # _int8_columns on four int8 rows per int32 word (group_size % 4 == 0): one 32-bit load and
    # four shift pairs where four byte rows took four loads and a byte-widening shuffle each
    # (2x on SmolLM2's 576..1536-column shapes). `wide` weights (the 49152-column head) take four
    # words per pass, which quarters the passes over running sums that no longer sit in L1.
    n = out.shape[0]
    total = np.zeros(n, np.float32)
    acc = np.empty(n, np.float32)
    for g in range(c0 // group_size, -(-c1 // group_size)):
        acc[:] = 0
        lo, hi = max(c0, g * group_size), min(c1, (g + 1) * group_size)
        b, end = lo // 4, hi // 4
        while wide and b + 4 <= end:
            c = 4 * b
            w0, w1, w2, w3 = qt[b], qt[b + 1], qt[b + 2], qt[b + 3]
            for j in range(n):
                acc[j] += (_word_dot(w0[j], x[c], x[c + 1], x[c + 2], x[c + 3])
                           + _word_dot(w1[j], x[c + 4], x[c + 5], x[c + 6], x[c + 7])
                           + _word_dot(w2[j], x[c + 8], x[c + 9], x[c + 10], x[c + 11])
                           + _word_dot(w3[j], x[c + 12], x[c + 13], x[c + 14], x[c + 15]))
            b += 4
        while b < end:
            c = 4 * b
            x0, x1, x2, x3, row = x[c], x[c + 1], x[c + 2], x[c + 3], qt[b]
            for j in range(n):
                acc[j] += _word_dot(row[j], x0, x1, x2, x3)
            b += 1
        xs, sg, og = x[lo:hi].sum(), scales[g], offsets[g]
        for j in range(n):
            total[j] += acc[j] * sg[j] + og[j] * xs
    out[:] = total


@numba.njit(cache=True, fastmath=True, inline="always")
def nibble_dot(v, x0, x1, x2, x3, x4, x5, x6, x7):
    # x0..x7 times the eight 4-bit values of a uint32 word (row 8i + r in bits 4r..4r+3), a shift
    # and a mask each in the lane; the word stays uint32 (explicit casts): numba would widen the
    # shifts to int64 and halve the lanes
    return (x0 * np.float32(np.int32(v & _M4)) + x1 * np.float32(np.int32((v >> _S4) & _M4))
            + x2 * np.float32(np.int32((v >> _S8) & _M4)) + x3 * np.float32(np.int32((v >> _S12) & _M4))
            + x4 * np.float32(np.int32((v >> _S16) & _M4)) + x5 * np.float32(np.int32((v >> _S20) & _M4))
            + x6 * np.float32(np.int32((v >> _S24) & _M4)) + x7 * np.float32(np.int32(v >> _S28)))


@intrinsic
def _prefetch_row(typingctx, words, p, r):
    """Ask for the row PREFETCH_BYTES past words[p, r] (uint32 panels [P, R, PANEL]): its four
    cache lines, eight rows ahead (vnni_jit.prefetch_ahead)."""
    def codegen(context, builder, sig, args):
        words_t = sig.args[0]
        array = context.make_array(words_t)(context, builder, args[0])
        at = cgutils.get_item_pointer(context, builder, words_t, array,
                                      [args[1], args[2], ir.Constant(cgutils.intp_t, 0)], wraparound=False)
        for line in range(0, 4 * PANEL, 64):
            prefetch_ahead(builder, at, line)
        return context.get_dummy_value()
    return types.void(words, p, r), codegen


@numba.njit(cache=True, fastmath=True)
def nibble_panels(x, words, scales, offsets, group_size, p0, p1, out):
    """out[j] = x @ w[j].T for the outputs j of panels p0..p1 below out.shape[0] (a padded
    panel's extra columns are not written): words uint32 [P, K/8, PANEL], scales and offsets
    float32 [P, K / group_size, PANEL] (quantized.PackedWeight); group_size % 8 == 0."""
    n, per = out.shape[0], group_size // 8
    groups = scales.shape[1]
    sums = np.empty(groups, np.float32)  # each group's sum of x, for its offsets
    for g in range(groups):
        sums[g] = x[g * group_size:(g + 1) * group_size].sum()
    acc, total = np.empty(PANEL, np.float32), np.empty(PANEL, np.float32)
    for p in range(p0, p1):
        total[:] = 0
        panel = words[p]
        for g in range(groups):
            acc[:] = 0
            for r in range(g * per, (g + 1) * per):
                _prefetch_row(words, p, r)
                c = 8 * r
                x0, x1, x2, x3, x4, x5, x6, x7 = x[c], x[c + 1], x[c + 2], x[c + 3], x[c + 4], x[c + 5], x[c + 6], x[c + 7]
                row = panel[r]
                for j in range(PANEL):
                    acc[j] += nibble_dot(row[j], x0, x1, x2, x3, x4, x5, x6, x7)
            sg, og, xs = scales[p, g], offsets[p, g], sums[g]
            for j in range(PANEL):
                total[j] += acc[j] * sg[j] + og[j] * xs
        first = p * PANEL
        for j in range(min(PANEL, n - first)):
            out[first + j] = total[j]


@numba.njit(cache=True, fastmath=True)
def exact_nibble_sums(a, words, b0, b1, acc):
    # acc[j] = sum over inputs 8 * b0 .. 8 * b1 of a[i] * (stored 4-bit weight of column j): with
    # a[i] = q + 128 and the stored values (weight + 8) integers, every partial sum one below
    # 2**24 (xnnpack_gemm.MAX_EXACT_BLOCK), float32 adds them exactly in whatever order fastmath picks.
    acc[:] = 0
    for b in range(b0, b1):
        c = 8 * b
        x0, x1, x2, x3, x4, x5, x6, x7 = a[c], a[c + 1], a[c + 2], a[c + 3], a[c + 4], a[c + 5], a[c + 6], a[c + 7]
        row = words[b]
        for j in range(acc.shape[0]):
            acc[j] += nibble_dot(row[j], x0, x1, x2, x3, x4, x5, x6, x7)


# Above this many outputs a word weight's running sums leave L1 and `_word_columns` takes four
# words per pass (at 8192 columns and more that was faster, at 4096 and fewer slower).
WIDE_COLUMNS = 4096


@numba.njit(cache=True)
def _columns(x, qt, scales, offsets, group_size, rows_per_word, c0, c1, out):
    """out = x @ w.T over the weight's input rows c0..c1 (multiples of rows_per_word), for one
    row x: the decode mat-vec's halves of an 8-bit weight (second_thread_jit)."""
    if rows_per_word == 4:
        _word_columns(x, qt, scales, offsets, group_size, out.shape[0] > WIDE_COLUMNS, c0, c1, out)
    else:
        _int8_columns(x, qt, scales, offsets, group_size, c0, c1, out)


@numba.njit(cache=True, fastmath=True, nogil=True)  # nogil: a prompt's two halves dequantize at once
def dequantize_columns(qt, scales, offsets, group_size, rows_per_word, j0, j1, dst):
    """dst [K, j1 - j0] = columns j0..j1 of the float32 transposed weight (8-bit: rows_per_word 1 or 4)."""
    if rows_per_word == 1:
        for c in range(qt.shape[0]):
            g = c // group_size
            q, sg, og, row = qt[c, j0:j1], scales[g, j0:j1], offsets[g, j0:j1], dst[c]
            for j in range(j1 - j0):
                row[j] = np.float32(q[j]) * sg[j] + og[j]
        return
    for b in range(qt.shape[0]):  # rows_per_word 4
        g = 4 * b // group_size  # a word's four rows share a group (group_size % 4 == 0)
        q, sg, og = qt[b, j0:j1], scales[g, j0:j1], offsets[g, j0:j1]
        d0, d1, d2, d3 = dst[4 * b], dst[4 * b + 1], dst[4 * b + 2], dst[4 * b + 3]
        for j in range(j1 - j0):
            v, s, o = q[j], sg[j], og[j]
            d0[j] = np.float32(np.int32(np.int32(v << _B24) >> _B24)) * s + o
            d1[j] = np.float32(np.int32(np.int32(v << _B16) >> _B24)) * s + o
            d2[j] = np.float32(np.int32(np.int32(v << _B8) >> _B24)) * s + o
            d3[j] = np.float32(np.int32(v >> _B24)) * s + o


@numba.njit(cache=True, fastmath=True, inline="always")
def _eight_rows(v, s, o, d0, d1, d2, d3, d4, d5, d6, d7, j):
    # column j of the eight rows a word holds, dequantized (constant shifts: 4x a loop per row)
    d0[j] = np.float32(np.int32(v & _M4)) * s + o
    d1[j] = np.float32(np.int32((v >> _S4) & _M4)) * s + o
    d2[j] = np.float32(np.int32((v >> _S8) & _M4)) * s + o
    d3[j] = np.float32(np.int32((v >> _S12) & _M4)) * s + o
    d4[j] = np.float32(np.int32((v >> _S16) & _M4)) * s + o
    d5[j] = np.float32(np.int32((v >> _S20) & _M4)) * s + o
    d6[j] = np.float32(np.int32((v >> _S24) & _M4)) * s + o
    d7[j] = np.float32(np.int32(v >> _S28)) * s + o


@numba.njit(cache=True, fastmath=True, nogil=True)
def dequantize_panels(words, scales, offsets, group_size, j0, j1, dst):
    """dequantize_columns of a 4-bit weight in panels (nibble_panels' layout). Row by row of
    dst, a panel's 64 columns at a time with constant bounds where the panel lies whole in
    j0..j1 (a loop with computed bounds in the middle ran 5x slower: 3 against 15 G weights/s)."""
    width = j1 - j0
    for b in range(words.shape[1]):
        g = 8 * b // group_size  # a word's eight rows share a group (group_size % 8 == 0)
        d0, d1, d2, d3 = dst[8 * b], dst[8 * b + 1], dst[8 * b + 2], dst[8 * b + 3]
        d4, d5, d6, d7 = dst[8 * b + 4], dst[8 * b + 5], dst[8 * b + 6], dst[8 * b + 7]
        for p in range(j0 // PANEL, -(-j1 // PANEL)):
            q, sg, og = words[p, b], scales[p, g], offsets[p, g]
            first = p * PANEL - j0  # dst's column of the panel's column 0
            if first >= 0 and first + PANEL <= width:
                for i in range(PANEL):
                    _eight_rows(q[i], sg[i], og[i], d0, d1, d2, d3, d4, d5, d6, d7, first + i)
            else:
                for i in range(max(-first, 0), min(width - first, PANEL)):
                    _eight_rows(q[i], sg[i], og[i], d0, d1, d2, d3, d4, d5, d6, d7, first + i)


@numba.njit(cache=True)
def _token_qparams(row):
    # choose_qparams_per_token_asymmetric's arithmetic for one row, in float32: (scale, zero point)
    eps = np.float32(np.finfo(np.float32).eps)
    lo = np.float32(0)
    hi = np.float32(0)
    for c in range(row.shape[0]):
        lo = min(lo, row[c])
        hi = max(hi, row[c])
    s = max(np.float32((hi - lo) / np.float32(255)), eps)
    dmin, dmax = np.float32(lo / s), np.float32(hi / s)
    if (np.float32(-128) + dmin) + (np.float32(127) + dmax) > 0:
        z = np.float32(-128) - dmin
    else:
        z = np.float32(127) - dmax
    return s, np.round(min(max(z, np.float32(-128)), np.float32(127)))


@numba.njit(cache=True)
def fake_quantize_per_token(x, out):
    """Step for step the numpy kernels' arithmetic: range and scale in float32, then the
    quantize and dequantize in float64 (the graph's scales are float64), no fastmath."""
    m, k = x.shape
    for r in range(m):
        s, z = _token_qparams(x[r])
        z64, s64 = np.float64(z), np.float64(s)
        inv = 1.0 / s64
        for c in range(k):
            v = min(max(np.round(np.float64(x[r, c]) * inv + z64), -128.0), 127.0)
            out[r, c] = np.float32((v - z64) * s64)


@numba.njit(cache=True)
def pack_rows(q, shift, bits, words):
    """words [K / per, N] (per = 32 // bits) of q int8 [N, K]: input row per * i + r of the weight
    (q[:, per * i + r] + shift, its low `bits` bits) at bits bits * r of word [i, n], in one pass;
    the numpy forms (quantized.nibble_words, _pack_bytes) take a dozen passes over the weight."""
    per = 32 // bits
    mask = np.int32((1 << bits) - 1)
    for b in range(words.shape[0]):
        for j in range(q.shape[0]):
            row = q[j]
            w = np.uint32(0)
            for r in range(per):
                w |= np.uint32((np.int32(row[per * b + r]) + shift) & mask) << np.uint32(bits * r)
            words[b, j] = w


# Every compiled kernel by name (the cache test runs each and reads its dispatcher's stats).
KERNELS = {"dequantize_columns": dequantize_columns, "dequantize_panels": dequantize_panels,
           "fake_quantize_per_token": fake_quantize_per_token, "pack_rows": pack_rows}
