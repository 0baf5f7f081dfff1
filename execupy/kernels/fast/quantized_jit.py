"""The numba kernels behind `execupy.kernels.fast.quantized` (imported only where numba is installed).

They are module-level functions, not closures made inside a function: numba's disk cache
never matches a jitted function that calls another closure's dispatcher, so such a caller
was compiled again in every process (0.5 s inside the first forward call per kernel).
`tests/kernels/test_fast_kernels.py` checks that a second process finds every one in the cache.

Layouts and arithmetic are those of `PackedWeight` (quantized.py): the weight input-major in
panels of 64 output columns, `qt`: 8-bit, int8 [N/64, K, 64], or 4-bit, eight rows per uint32
word [N/64, K/8, 64]; `w = q * scale + offset` per group of rows. A panel's decode mat-vec is
written in LLVM IR on 512-bit registers where the CPU has AVX-512 (numba's own loops, kept for
every other CPU and tested equal, vectorise to 256 bits and run ~1.5-2x slower).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .vnni_jit import (LANES, PANEL, PREFETCH_BYTES, _INDICES, _V16, _V16F, _arrays, _fma, _item, _splat,
                       _vector_at, prefetch_ahead, target_has)

_M4 = np.uint32(15)
_S4, _S8, _S12, _S16, _S20, _S24, _S28 = (np.uint32(4 * r) for r in range(1, 8))
# The decode mat-vecs' explicit 512-bit registers (vnni_jit.target_has: never from a cache built for another CPU)
AVX512 = target_has("avx512f")
_V16B = ir.VectorType(ir.IntType(8), LANES)  # a panel row's sixteen int8 weights of one register


@intrinsic
def _byte_panel_sums_avx512(typingctx, qp, x, p, c0, c1, acc):
    """acc[:] = sum over input rows c0..c1 of x[c] * float32(qp[p, c, :]): one panel's PANEL
    running sums in four 512-bit registers, each row's 64 bytes (one cache line) sign-extended
    sixteen to a register (vpmovsxbd), converted and fused-multiply-added. numba's own loop over
    the same bytes vectorises to 256-bit registers and keeps the sums in memory: 7 against 12 G
    weights/s on one thread from memory, 10 against 19-21 in cache (SmolLM2's shapes)."""
    def codegen(context, builder, sig, args):
        qp_t, x_t, _, _, _, acc_t = sig.args
        q_arr, x_arr, acc_arr = _arrays(context, builder, sig, args, (0, 1, 5))
        p, c0, c1 = args[2], args[3], args[4]
        zero, one, columns = _INDICES
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, None)) for _ in columns]
        with cgutils.for_range_slice(builder, c0, c1, one) as (c, _):
            xc = _splat(builder, _item(context, builder, x_t, x_arr, [c]), _V16F)
            row = cgutils.get_item_pointer(context, builder, qp_t, q_arr, [p, c, zero], wraparound=False)
            prefetch_ahead(builder, row, BYTE_PREFETCH_BYTES - PREFETCH_BYTES)
            for acc, col in zip(accs, columns):
                at = builder.bitcast(builder.gep(row, [col]), _V16B.as_pointer())
                w = builder.sitofp(builder.sext(builder.load(at, align=1), _V16), _V16F)
                builder.store(_fma(builder, w, xc, builder.load(acc)), acc)
        for acc, col in zip(accs, columns):
            builder.store(builder.load(acc), _vector_at(context, builder, acc_t, acc_arr, [col]), align=4)
        return context.get_dummy_value()
    return types.void(qp, x, p, c0, c1, acc), codegen


@numba.njit(cache=True, fastmath=True)
def byte_panel_sums_loop(qp, x, p, c0, c1, acc):
    """_byte_panel_sums_avx512's sums as numba's own loop (a CPU without AVX-512), four input
    rows a pass: a quarter of the passes over the running sums."""
    acc[:] = 0
    panel, c = qp[p], c0
    while c + 4 <= c1:
        x0, x1, x2, x3 = x[c], x[c + 1], x[c + 2], x[c + 3]
        r0, r1, r2, r3 = panel[c], panel[c + 1], panel[c + 2], panel[c + 3]
        for j in range(PANEL):
            acc[j] += (x0 * np.float32(r0[j]) + x1 * np.float32(r1[j])) + (x2 * np.float32(r2[j]) + x3 * np.float32(r3[j]))
        c += 4
    for c in range(c, c1):
        xc, r0 = x[c], panel[c]
        for j in range(PANEL):
            acc[j] += xc * np.float32(r0[j])


# 8 KiB ahead of the row in use (128 rows of a byte panel): 12.5 G weights/s on one thread from
# memory, against 11.8 at 2 KiB and 7.2 with no prefetch (a 3072 x 576 weight)
BYTE_PREFETCH_BYTES = 8192

if AVX512:
    @numba.njit(cache=True, fastmath=True, inline="always")
    def byte_panel_sums(qp, x, p, c0, c1, acc):
        _byte_panel_sums_avx512(qp, x, p, c0, c1, acc)
else:
    byte_panel_sums = byte_panel_sums_loop


@numba.njit(cache=True, fastmath=True, inline="always")
def group_sums(x, group_size, groups):
    """Each group's sum of x, once per mat-vec: what its offsets multiply."""
    sums = np.empty(groups, np.float32)
    for g in range(groups):
        sums[g] = x[g * group_size:(g + 1) * group_size].sum()
    return sums


@numba.njit(cache=True, fastmath=True)
def byte_panels(x, qp, scales, offsets, group_size, p0, p1, out):
    """out[j] = x @ w[j].T for the outputs j of panels p0..p1 below out.shape[0] (a padded
    panel's extra columns are not written): qp int8 [P, K, PANEL], scales and offsets float32
    [P, K / group_size, PANEL] (quantized.PackedWeight's 8-bit layout)."""
    n, groups = out.shape[0], scales.shape[1]
    sums = group_sums(x, group_size, groups)
    acc, total = np.empty(PANEL, np.float32), np.empty(PANEL, np.float32)
    for p in range(p0, p1):
        total[:] = 0
        for g in range(groups):
            byte_panel_sums(qp, x, p, g * group_size, (g + 1) * group_size, acc)
            sg, og, xs = scales[p, g], offsets[p, g], sums[g]
            for j in range(PANEL):
                total[j] += acc[j] * sg[j] + og[j] * xs
        first = p * PANEL
        for j in range(min(PANEL, n - first)):
            out[first + j] = total[j]


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


def _permps(builder):
    """vpermps (table, indices) -> table[indices & 15] per lane: sixteen 4-bit values to floats in one
    instruction, the shift before it leaving the higher nibbles in place (vpermps reads 4 bits)."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F, _V16]),
                                          "llvm.x86.avx512.permvar.sf.512")


_NIBBLE_FLOATS = ir.Constant(_V16F, [float(v) for v in range(16)])


@intrinsic
def _nibble_panel_avx512(typingctx, words, x, sums, scales, offsets, per, p, total):
    """total[:] = x @ w.T for panel p's PANEL outputs (nibble_panels' layout and arithmetic): per
    group, the word rows' running sums in four 512-bit registers (a nibble: a shift, vpermps, an
    fma), then total = fma(offsets, sum of x, fma(sums, scales, total)). numba's own loop
    vectorises to 256 bits, a mask and a conversion more per nibble: 13-14 against 21-26 G
    weights/s on one thread in cache, 9.7 against 12.7 GB/s from memory (SmolLM2's shapes)."""
    def codegen(context, builder, sig, args):
        w_t, x_t, s_t, sc_t, of_t, _, _, tot_t = sig.args
        w_arr, x_arr, s_arr, sc_arr, of_arr, tot_arr = _arrays(context, builder, sig, args, (0, 1, 2, 3, 4, 7))
        per, p = args[5], args[6]
        zero, one, columns = _INDICES
        perm = _permps(builder)
        totals = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, None)) for _ in columns]
        accs = [cgutils.alloca_once(builder, _V16F) for _ in columns]
        with cgutils.for_range_slice(builder, zero, builder.extract_value(sc_arr.shape, 1), one) as (g, _):
            for acc in accs:
                builder.store(ir.Constant(_V16F, None), acc)
            r0 = builder.mul(g, per)
            with cgutils.for_range_slice(builder, r0, builder.add(r0, per), one) as (r, _):
                c = builder.mul(r, ir.Constant(cgutils.intp_t, 8))
                xs = [_splat(builder, _item(context, builder, x_t, x_arr, [builder.add(c, ir.Constant(cgutils.intp_t, t))]),
                             _V16F) for t in range(8)]
                for acc, col in zip(accs, columns):
                    at = _vector_at(context, builder, w_t, w_arr, [p, r, col])
                    prefetch_ahead(builder, at)
                    w, a = builder.load(at, align=4), builder.load(acc)
                    for t in range(8):  # input 8r + t in bits 4t..4t+3
                        nibble = w if t == 0 else builder.lshr(w, ir.Constant(_V16, [4 * t] * LANES))
                        a = _fma(builder, builder.call(perm, [_NIBBLE_FLOATS, nibble]), xs[t], a)
                    builder.store(a, acc)
            xsum = _splat(builder, _item(context, builder, s_t, s_arr, [g]), _V16F)
            for acc, tot, col in zip(accs, totals, columns):
                sg = builder.load(_vector_at(context, builder, sc_t, sc_arr, [p, g, col]), align=4)
                og = builder.load(_vector_at(context, builder, of_t, of_arr, [p, g, col]), align=4)
                builder.store(_fma(builder, og, xsum, _fma(builder, builder.load(acc), sg, builder.load(tot))), tot)
        for tot, col in zip(totals, columns):
            builder.store(builder.load(tot), _vector_at(context, builder, tot_t, tot_arr, [col]), align=4)
        return context.get_dummy_value()
    return types.void(words, x, sums, scales, offsets, per, p, total), codegen


@numba.njit(cache=True, fastmath=True)
def nibble_panel_loop(words, x, sums, scales, offsets, per, p, total):
    """_nibble_panel_avx512's product as numba's own loop (a CPU without AVX-512)."""
    acc = np.empty(PANEL, np.float32)
    total[:] = 0
    panel = words[p]
    for g in range(scales.shape[1]):
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


if AVX512:
    @numba.njit(cache=True, fastmath=True, inline="always")
    def nibble_panel(words, x, sums, scales, offsets, per, p, total):
        _nibble_panel_avx512(words, x, sums, scales, offsets, per, p, total)
else:
    nibble_panel = nibble_panel_loop


@numba.njit(cache=True, fastmath=True)
def nibble_panels(x, words, scales, offsets, group_size, p0, p1, out):
    """out[j] = x @ w[j].T for the outputs j of panels p0..p1 below out.shape[0] (a padded
    panel's extra columns are not written): words uint32 [P, K/8, PANEL], scales and offsets
    float32 [P, K / group_size, PANEL] (quantized.PackedWeight); group_size % 8 == 0."""
    n, per = out.shape[0], group_size // 8
    sums = group_sums(x, group_size, scales.shape[1])
    total = np.empty(PANEL, np.float32)
    for p in range(p0, p1):
        nibble_panel(words, x, sums, scales, offsets, per, p, total)
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


@numba.njit(cache=True, fastmath=True, nogil=True)  # nogil: a prompt's two halves dequantize at once
def dequantize_byte_panels(qp, scales, offsets, group_size, j0, j1, dst):
    """dst [K, j1 - j0] = columns j0..j1 of the float32 transposed weight, from an 8-bit weight
    in panels (byte_panels' layout), a panel's 64 columns at a time with constant bounds where
    it lies whole in j0..j1 (as dequantize_panels)."""
    width = j1 - j0
    for c in range(qp.shape[1]):
        g, d = c // group_size, dst[c]
        for p in range(j0 // PANEL, -(-j1 // PANEL)):
            q, sg, og = qp[p, c], scales[p, g], offsets[p, g]
            first = p * PANEL - j0  # dst's column of the panel's column 0
            if first >= 0 and first + PANEL <= width:
                for i in range(PANEL):
                    d[first + i] = np.float32(q[i]) * sg[i] + og[i]
            else:
                for i in range(max(-first, 0), min(width - first, PANEL)):
                    d[first + i] = np.float32(q[i]) * sg[i] + og[i]


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
def pack_nibbles(q, shift, words):
    """words [K / 8, N] of q int8 [N, K]: input row 8i + r of the weight (q[:, 8i + r] + shift,
    its low 4 bits) at bits 4r of word [i, n], in one pass; the numpy form (quantized.nibble_words)
    takes a dozen passes over the weight."""
    for b in range(words.shape[0]):
        for j in range(q.shape[0]):
            row = q[j]
            w = np.uint32(0)
            for r in range(8):
                w |= np.uint32((np.int32(row[8 * b + r]) + shift) & 15) << np.uint32(4 * r)
            words[b, j] = w


@numba.njit(cache=True)
def pack_byte_panels(q, qp):
    """qp int8 [P, K, PANEL] = q int8 [N, K] in panels of PANEL output columns (quantized.panels of
    q.T, the columns past N zero), in one pass where numpy's transpose and panels copy it twice."""
    n = q.shape[0]
    qp[:] = 0
    for p in range(qp.shape[0]):
        for i in range(min(PANEL, n - p * PANEL)):
            row = q[p * PANEL + i]
            for c in range(q.shape[1]):
                qp[p, c, i] = row[c]


# Every compiled kernel by name (the cache test runs each and reads its dispatcher's stats).
KERNELS = {"dequantize_byte_panels": dequantize_byte_panels, "dequantize_panels": dequantize_panels,
           "fake_quantize_per_token": fake_quantize_per_token, "pack_nibbles": pack_nibbles,
           "pack_byte_panels": pack_byte_panels}
