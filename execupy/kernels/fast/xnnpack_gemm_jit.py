"""The numba kernels behind `execupy.kernels.fast.xnnpack_gemm` (imported only where numba is installed).

Module-level functions, not closures made inside a function: numba's disk cache never
matches a jitted function that calls another closure's dispatcher, so such a caller was
compiled again in every process (0.25-0.7 s inside the first forward call).
`tests/kernels/test_xnnpack_gemm.py` checks that a second process finds every one in the cache.
The arithmetic is documented in xnnpack_gemm.py.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .fma_jit import fma32
from .avx2_jit import AVX2, GROUP
from .blockwise_jit import (AVX2_LANES, PANEL, VNNI, activation_bytes, activation_bytes_int8, blockwise_panels,
                            blockwise_panels_avx2, blockwise_rows, lane_operands, lane_shifts, lanes_register,
                            lanes_scale, panel_outputs_rows)
from .vnni_jit import _V16, _V16F, LANES, _arrays, _splat, _vector_at
from .vnni_jit import ROWS, channel_panel_row, channel_panel_row_scaled, channel_panel_rows, channel_panel_rows_scaled
from .rows_jit import is_nan_bits, ordered_key
from .second_thread_jit import (BLOCKWISE, CALL, FIELDS, HERE, JOB, JOB_FN, JOB_SLOTS, KIND, TAKEN, THERE, _pointer,
                               cycles, join_chunks, next_chunk, open_chunks, post_chunks, post_job, publish,
                               second_half_where)
from .xnnpack_gemm import ARITHMETIC, LANES_GROUP, PANEL as LAID_OUT, TILE  # defined before xnnpack_gemm imports this module

assert LAID_OUT == PANEL and TILE % PANEL == 0 and LANES_GROUP == GROUP


_M4 = np.uint32(15)


# ---------------------------------------------------------------- a few rows: one pass over the words


@numba.njit(cache=True, nogil=True)
def blockwise_matvec(ctrl, xbuf, scratch, q, zp, x_scale, words, scales, ksum, bias, block, out, share):
    """out [M, N] for a few rows in the "vnni" arithmetic, XNNPACK's steps in its order
    (xnnpack_gemm.py), a panel of PANEL outputs at a time (blockwise_jit). With `share` the
    second core's thread (second_thread_jit) may run the second half of the panels into
    `scratch`; a panel's bits do not depend on who runs it. Returns the halves taken back."""
    m, k = q.shape
    n = out.shape[1]
    panels, blocks = words.shape[0], k // block
    middle = panels // 2
    a = np.empty(k, np.float32)
    xbytes, shifts = np.empty((k // 8, 2), np.int32), np.empty(blocks, np.float32)
    v = np.empty((panels, PANEL), np.float32)
    share = share and k < xbuf.shape[0] and (panels - middle) * PANEL <= scratch.shape[0]
    taken_back, seq, start = 0, 0, 0
    for r in range(m):
        for i in range(k):
            a[i] = np.float32(q[r, i]) + np.float32(128)  # qdu8's activations
        zr = np.float32(zp[r]) + np.float32(128)
        where = HERE
        if share:
            xbuf[k] = zr
            ctrl[JOB + 1], ctrl[JOB + 2], ctrl[JOB + 5], ctrl[JOB + 6] = scales.ctypes.data, ksum.ctypes.data, 0, block
            seq = post_job(ctrl, xbuf, a, BLOCKWISE, words.ctypes.data, k, panels * PANEL)
            start = cycles()
        activation_bytes(a, block, xbytes, shifts)
        blockwise_panels(a, xbytes, shifts, words, scales, ksum, zr, block, 0, middle, v[:middle])
        if share:
            where = second_half_where(ctrl, seq, start)
        if where == THERE:
            v[middle:] = scratch[:(panels - middle) * PANEL].reshape((panels - middle, PANEL))
        else:
            blockwise_panels(a, xbytes, shifts, words, scales, ksum, zr, block, middle, panels, v[middle:])
        taken_back += where == TAKEN
        o, flat = out[r], v.reshape(panels * PANEL)
        for j in range(n):
            o[j] = np.float32(flat[j] * x_scale[r]) + bias[j]
    return taken_back


@numba.njit(cache=True, nogil=True)
def blockwise_matvec_from_float(ctrl, xbuf, scratch, x, words, scales, ksum, bias, block, out, share):
    """blockwise_matvec of x float32 [M, K] quantized first (quantize_rows): a Convert fused into
    its FullyConnected, in one call where a decode step made three."""
    m = x.shape[0]
    q, scale, zero = np.empty(x.shape, np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
    quantize_rows(x, q, scale, zero)
    return blockwise_matvec(ctrl, xbuf, scratch, q, zero, scale, words, scales, ksum, bias, block, out, share)


# ---------------------------------------------------------------- many rows: a tile of weights at a time


@numba.njit(cache=True)
def _signed_tile(words, scales, c0, width, tile, tile_scales):
    # tile int8 [K, TILE] = the signed weights (stored - 8) of columns c0 .. c0 + width, zeros
    # after; tile_scales [K / block, TILE] their block scales: the panels' columns side by side
    tile[:] = 0
    for j0 in range(0, width, PANEL):
        p, lanes = (c0 + j0) // PANEL, min(PANEL, width - j0)
        for b in range(words.shape[1]):
            row = words[p, b]
            for r in range(8):
                dst, shift = tile[8 * b + r, j0:j0 + lanes], np.uint32(4 * r)
                for j in range(lanes):
                    dst[j] = np.int8(np.int32((row[j] >> shift) & _M4) - np.int32(8))
        for b in range(scales.shape[1]):
            tile_scales[b, j0:j0 + lanes] = scales[p, b, :lanes]


@numba.njit(cache=True)
def blockwise_tile(a, zp, x_scale, words, scales, ksum, bias, block, out, t):
    # Output channels of tile t, every row, in the "vnni" arithmetic (a = q + 128, zp + 128).
    # Each block's sum runs across the tile's channels (vectorizable), then joins v with one
    # fma. Rows are sliced to the tile first: indexing with c0 + j would make numba check for
    # negative indices, which stops LLVM from vectorizing (10x slower). A block's sum is an
    # integer: a (q + 128, int16) times the 4-bit weights, two inputs at a time in int16
    # (2 * 255 * 8 fits), added up in int32; exact, so equal to the numpy reference's float32
    # sums (below 2**24), and 15-35% faster than summing in float32. Blocks are a multiple of
    # 16 inputs.
    m, k = a.shape
    c0 = t * TILE
    width = min(TILE, out.shape[1] - c0)
    tile, tile_scales = np.empty((k, TILE), np.int8), np.empty((k // block, TILE), np.float32)
    _signed_tile(words, scales, c0, width, tile, tile_scales)
    acc = np.empty(TILE, np.int32)
    v = np.empty(width, np.float32)
    ks, bs = ksum[c0:c0 + width], bias[c0:c0 + width]
    for r in range(m):
        for j in range(width):
            v[j] = ks[j] * zp[r]
        for b in range(k // block):
            acc[:] = 0
            for i in range(b * block, (b + 1) * block, 2):
                a0, a1, row0, row1 = a[r, i], a[r, i + 1], tile[i], tile[i + 1]
                for j in range(TILE):
                    acc[j] += np.int32(a0 * np.int16(row0[j]) + a1 * np.int16(row1[j]))
            sb = tile_scales[b]
            for j in range(width):
                v[j] = fma32(np.float32(acc[j]), sb[j], v[j])
        o = out[r, c0:c0 + width]
        for j in range(width):
            o[j] = np.float32(v[j] * x_scale[r]) + bs[j]


@numba.njit(cache=True)
def blockwise_tiles(a, zp, x_scale, words, scales, ksum, bias, block, out):
    for t in range(-(-out.shape[1] // TILE)):
        blockwise_tile(a, zp, x_scale, words, scales, ksum, bias, block, out, t)


@numba.njit(parallel=True, cache=True)
def blockwise_tiles_parallel(a, zp, x_scale, words, scales, ksum, bias, block, out):
    for t in numba.prange(-(-out.shape[1] // TILE)):
        blockwise_tile(a, zp, x_scale, words, scales, ksum, bias, block, out, t)


# ---------------------------------------------------------------- qb4w in the "avx2" arithmetic (xnnpack_gemm.py)
# XNNPACK's qb4w kernels on a CPU without AVX512-VNNI: signed activations, four lanes per output.
# A decode step's second half goes to the second core's thread as a CALL job (second_thread_jit)
# naming the C function below: xbuf holds the row's q (its K bytes) and then zp (float32); the job's fields, in
# JOB order, are the addresses of the weight's words, scales and ksum, then K, the panels and the block.


@numba.njit(cache=True, nogil=True)
def blockwise_matvec_avx2(ctrl, xbuf, scratch, second_half, q, zp, x_scale, words, scales, ksum, bias, block, out,
                          share):
    """blockwise_matvec in the "avx2" arithmetic: per row, y = blockwise_panels_avx2's panels, then
    out = fma(y, x_scale, bias). With `share` the second core's thread may run the second half of
    the panels (`second_half`: blockwise_avx2_second_half()'s address) into `scratch`. Returns the
    halves taken back."""
    m, k = q.shape
    n = out.shape[1]
    panels, blocks = words.shape[0], k // block
    middle = panels // 2
    row, shifts = np.empty(k, np.int8), np.empty((blocks, AVX2_LANES), np.float32)
    y = np.empty((panels, PANEL), np.float32)
    share = share and k // 4 < xbuf.shape[0] and (panels - middle) * PANEL <= scratch.shape[0]
    taken_back, seq, start = 0, 0, 0
    for r in range(m):
        row[:] = q[r]
        zf = np.float32(zp[r])
        where = HERE
        if share:
            xbuf.view(np.int8)[:k] = row  # the second half reads q's bytes, then zp after them
            xbuf[k // 4] = zf
            ctrl[JOB], ctrl[JOB + 1], ctrl[JOB + 2] = words.ctypes.data, scales.ctypes.data, ksum.ctypes.data
            ctrl[JOB + 3], ctrl[JOB + 4], ctrl[JOB + 5] = k, panels, block
            ctrl[KIND], ctrl[JOB_FN] = CALL, second_half
            seq = publish(ctrl)
            start = cycles()
        lane_shifts(row, block, shifts)
        if not share:  # every panel in one call: the row's operands arranged once
            blockwise_panels_avx2(words, row, shifts, scales, ksum, zf, block, 0, panels, y)
        else:
            blockwise_panels_avx2(words, row, shifts, scales, ksum, zf, block, 0, middle, y[:middle])
            where = second_half_where(ctrl, seq, start)
            if where == THERE:
                y[middle:] = scratch[:(panels - middle) * PANEL].reshape((panels - middle, PANEL))
            else:
                blockwise_panels_avx2(words, row, shifts, scales, ksum, zf, block, middle, panels, y[middle:])
        taken_back += where == TAKEN
        o, flat, xs = out[r], y.reshape(panels * PANEL), x_scale[r]
        for j in range(n):
            o[j] = fma32(flat[j], xs, bias[j])
    return taken_back


@numba.njit(cache=True, nogil=True)
def blockwise_matvec_from_float_avx2(ctrl, xbuf, scratch, second_half, x, words, scales, ksum, bias, block, out,
                                     share):
    """blockwise_matvec_avx2 of x float32 [M, K] quantized first (quantize_rows), in one call."""
    m = x.shape[0]
    q, scale, zero = np.empty(x.shape, np.int8), np.empty(m, np.float32), np.empty(m, np.int32)
    quantize_rows(x, q, scale, zero)
    return blockwise_matvec_avx2(ctrl, xbuf, scratch, second_half, q, zero, scale, words, scales, ksum, bias, block,
                                 out, share)


def _blockwise_avx2_second_half(words_at, scales_at, ksum_at, k, panels, block, _6, _7, xbuf_at, xbuf_size,
                                scratch_at, scratch_size):
    # blockwise_matvec_avx2's second half on the second core's thread: its panels middle.. into scratch
    middle, blocks = panels // 2, k // block
    if k // 4 >= xbuf_size or (panels - middle) * PANEL > scratch_size:
        return
    q = numba.carray(_pointer(xbuf_at), k, np.int8)
    zf = numba.carray(_pointer(xbuf_at), k // 4 + 1, np.float32)[k // 4]
    shifts = np.empty((blocks, AVX2_LANES), np.float32)
    lane_shifts(q, block, shifts)
    blockwise_panels_avx2(numba.carray(_pointer(words_at), (panels, k // 8, PANEL), np.uint32), q, shifts,
                          numba.carray(_pointer(scales_at), (panels, blocks, PANEL), np.float32),
                          numba.carray(_pointer(ksum_at), panels * PANEL, np.float32), zf, block, middle, panels,
                          numba.carray(_pointer(scratch_at), (panels - middle, PANEL), np.float32))


_avx2_second_half = []


def blockwise_avx2_second_half():
    """The C function of blockwise_matvec_avx2's second half, compiled (or read from numba's cache)
    at its first use: only a process that runs the "avx2" arithmetic pays for it."""
    if not _avx2_second_half:
        _avx2_second_half.append(numba.cfunc(_HALF_SIGNATURE, cache=True)(_blockwise_avx2_second_half))
    return _avx2_second_half[0]


@numba.njit(cache=True, inline="always")
def _eight_inputs(x, tile, i):
    # inputs i..i + 8 of a row (int16) and the tile's rows of them (int8 [TILE] each)
    return ((x[i], x[i + 1], x[i + 2], x[i + 3], x[i + 4], x[i + 5], x[i + 6], x[i + 7]),
            (tile[i], tile[i + 1], tile[i + 2], tile[i + 3], tile[i + 4], tile[i + 5], tile[i + 6], tile[i + 7]))


@numba.njit(cache=True)
def _signed_tile_lanes(words, scales, c0, width, tile, tile_scales):
    # _signed_tile of words and scales in the lanes layout (blockwise_jit.lanes_register, lanes_scale)
    tile[:] = 0
    doubles = words.shape[1] // 2
    data = words.reshape(-1).view(np.uint8)
    for j in range(width):
        p, jj = (c0 + j) // PANEL, (c0 + j) % PANEL
        start = lanes_register(p, jj, doubles) + 2 * (jj % 4)
        for d in range(doubles):
            for t in range(4):
                for rho in range(2):
                    byte = np.int32(data[start + d * 32 * LANES_GROUP + 8 * t + rho])
                    i = 16 * d + 8 * rho + 2 * t
                    tile[i, j] = np.int8((byte & 15) - 8)
                    tile[i + 1, j] = np.int8((byte >> 4) - 8)
        for b in range(scales.shape[1]):
            tile_scales[b, j] = lanes_scale(scales, p, b, jj)


@numba.njit(cache=True)
def blockwise_tile_avx2(a, zf, x_scale, words, scales, ksum, bias, block, out, t):
    # blockwise_tile in the "avx2" arithmetic on words in the lanes layout: a int16 [M, K] the signed
    # q, zf float32 [M] the zero points. Lane l's inputs are the pairs (i, i + 1) with i mod 8 == 2 * l, so each pass over
    # eight of the tile's rows adds one pair into each lane's sums s0..s3 (int16 products in
    # int32: exact); the first pass sets them, the last one goes on into each lane's chain (one
    # fma a block). Blocks are a multiple of 16 inputs: two passes at least.
    m, k = a.shape
    c0 = t * TILE
    width = min(TILE, out.shape[1] - c0)
    tile, tile_scales = np.empty((k, TILE), np.int8), np.empty((k // block, TILE), np.float32)
    _signed_tile_lanes(words, scales, c0, width, tile, tile_scales)
    acc = np.empty((AVX2_LANES, TILE), np.int32)
    s0, s1, s2, s3 = acc[0], acc[1], acc[2], acc[3]
    v = np.empty((AVX2_LANES, width), np.float32)
    v0, v1, v2, v3 = v[0], v[1], v[2], v[3]
    ks, bs = ksum[c0:c0 + width], bias[c0:c0 + width]
    for r in range(m):
        z, x = zf[r], a[r]
        zero = np.float32(0) * z
        for j in range(width):
            v0[j] = ks[j] * z
            v1[j], v2[j], v3[j] = zero, zero, zero
        for b in range(k // block):
            (x0, x1, x2, x3, x4, x5, x6, x7), (t0, t1, t2, t3, t4, t5, t6, t7) = _eight_inputs(x, tile, b * block)
            for j in range(TILE):
                s0[j] = np.int32(x0 * np.int16(t0[j]) + x1 * np.int16(t1[j]))
                s1[j] = np.int32(x2 * np.int16(t2[j]) + x3 * np.int16(t3[j]))
                s2[j] = np.int32(x4 * np.int16(t4[j]) + x5 * np.int16(t5[j]))
                s3[j] = np.int32(x6 * np.int16(t6[j]) + x7 * np.int16(t7[j]))
            for i in range(b * block + 8, (b + 1) * block - 8, 8):
                (x0, x1, x2, x3, x4, x5, x6, x7), (t0, t1, t2, t3, t4, t5, t6, t7) = _eight_inputs(x, tile, i)
                for j in range(TILE):
                    s0[j] += np.int32(x0 * np.int16(t0[j]) + x1 * np.int16(t1[j]))
                    s1[j] += np.int32(x2 * np.int16(t2[j]) + x3 * np.int16(t3[j]))
                    s2[j] += np.int32(x4 * np.int16(t4[j]) + x5 * np.int16(t5[j]))
                    s3[j] += np.int32(x6 * np.int16(t6[j]) + x7 * np.int16(t7[j]))
            (x0, x1, x2, x3, x4, x5, x6, x7), (t0, t1, t2, t3, t4, t5, t6, t7) = _eight_inputs(x, tile, (b + 1) * block - 8)
            sb = tile_scales[b]
            # np.int32 before the float: numba's int32 + int32 is an int64, whose float LLVM does not vectorise
            for j in range(width):
                v0[j] = fma32(np.float32(np.int32(s0[j] + x0 * np.int16(t0[j]) + x1 * np.int16(t1[j]))), sb[j], v0[j])
                v1[j] = fma32(np.float32(np.int32(s1[j] + x2 * np.int16(t2[j]) + x3 * np.int16(t3[j]))), sb[j], v1[j])
                v2[j] = fma32(np.float32(np.int32(s2[j] + x4 * np.int16(t4[j]) + x5 * np.int16(t5[j]))), sb[j], v2[j])
                v3[j] = fma32(np.float32(np.int32(s3[j] + x6 * np.int16(t6[j]) + x7 * np.int16(t7[j]))), sb[j], v3[j])
        o, xs = out[r, c0:c0 + width], x_scale[r]
        for j in range(width):
            o[j] = fma32((v0[j] + v1[j]) + (v2[j] + v3[j]), xs, bs[j])


@numba.njit(cache=True)
def blockwise_tiles_avx2(a, zf, x_scale, words, scales, ksum, bias, block, out):
    for t in range(-(-out.shape[1] // TILE)):
        blockwise_tile_avx2(a, zf, x_scale, words, scales, ksum, bias, block, out, t)


@numba.njit(parallel=True, cache=True)
def blockwise_tiles_avx2_parallel(a, zf, x_scale, words, scales, ksum, bias, block, out):
    for t in numba.prange(-(-out.shape[1] // TILE)):
        blockwise_tile_avx2(a, zf, x_scale, words, scales, ksum, bias, block, out, t)


# ---------------------------------------------------------------- a prompt's rows, qb4w, "avx2" with AVX2 instructions
# Each row's operands once (lane_operands), then the panels' outputs AVX2_ROWS rows at a time
# (avx2_jit), then out = fma(y, x_scale, bias) as the mat-vec finishes its row. The parallel one
# gives each thread whole panels: a panel's outputs depend on nothing else.


@numba.njit(cache=True, nogil=True)
def _prompt_operands(q, zp, block, blocks):
    m, k = q.shape
    xs, chained = np.empty((m, k // 16, 2, 32), np.int8), np.empty((m, blocks, 2, 8), np.float32)
    row, shifts = np.empty(k, np.int8), np.empty((blocks, AVX2_LANES), np.float32)
    for r in range(m):
        row[:] = q[r]
        lane_shifts(row, block, shifts)
        lane_operands(row, shifts, xs[r], chained[r])
    return xs, chained, zp.astype(np.float32)


@numba.njit(cache=True, nogil=True)
def _finish_rows(y, x_scale, bias, out, c0, c1):
    for r in range(out.shape[0]):
        o, yr, xs = out[r], y[r], x_scale[r]
        for j in range(c0, c1):
            o[j] = fma32(yr[j], xs, bias[j])


@numba.njit(cache=True, nogil=True)
def blockwise_rows_avx2(q, zp, x_scale, words, scales, ksum, bias, block, out):
    """out float32 [M, N] for a prompt's rows q int8 [M, K] in the "avx2" arithmetic, one thread."""
    panels, n = words.shape[0], out.shape[1]
    xs, chained, zf = _prompt_operands(q, zp, block, q.shape[1] // block)
    y = np.empty((q.shape[0], panels * PANEL), np.float32)
    panel_outputs_rows(words, xs, chained, scales, ksum, zf, block, 0, panels, y)
    _finish_rows(y, x_scale, bias, out, 0, n)


@numba.njit(parallel=True, cache=True)
def blockwise_rows_avx2_parallel(q, zp, x_scale, words, scales, ksum, bias, block, out):
    """blockwise_rows_avx2 with numba's threads, a panel each in turn."""
    panels, n = words.shape[0], out.shape[1]
    xs, chained, zf = _prompt_operands(q, zp, block, q.shape[1] // block)
    y = np.empty((q.shape[0], panels * PANEL), np.float32)
    for p in numba.prange(panels):
        panel_outputs_rows(words, xs, chained, scales, ksum, zf, block, p, p + 1, y[:, p * PANEL:(p + 1) * PANEL])
        _finish_rows(y, x_scale, bias, out, p * PANEL, min(n, (p + 1) * PANEL))


# ---------------------------------------------------------------- a prompt's rows, qb4w: both cores (AVX512-VNNI only)
# The caller writes the rows' activations into the second core's thread's xbuf, as the products
# read them, posts a CALL job (second_thread_jit) naming the C function below, then computes the
# first half of the weight's panels into out while the thread computes the second half into its
# scratch, [M, N - col] from column col = middle * PANEL; the caller copies those over, or computes
# them itself (second_thread_jit's rules: a thread asleep, busy or too slow). A panel's outputs
# depend on the panel alone, so one thread and two give the same bits. Job fields, in JOB order:
# the addresses of the weight's words, scales and ksum and of the bias, then M, K, N and the block.


@numba.njit(cache=True, inline="always")
def _blockwise_activations(at, m, k, block):
    # xbytes int32 [M, K/8, 2], shifts float32 [M, K/block], zr and x_scale float32 [M], one after
    # another from address `at`: m * (k // 4 + k // block + 2) words of 4 bytes
    quads, blocks = m * (k // 4), m * (k // block)
    return (numba.carray(_pointer(at), (m, k // 8, 2), np.int32),
            numba.carray(_pointer(at + 4 * quads), (m, k // block), np.float32),
            numba.carray(_pointer(at + 4 * (quads + blocks)), m, np.float32),
            numba.carray(_pointer(at + 4 * (quads + blocks + m)), m, np.float32))


@numba.njit(cache=True, inline="always")
def _columns_from(scratch, out, col):
    # out[:, col:] = the second half's outputs, [M, N - col] in scratch
    m, n = out.shape
    width = n - col
    for r in range(m):
        o = out[r]
        for j in range(width):
            o[col + j] = scratch[r * width + j]


@numba.njit(cache=True, nogil=True)
def blockwise_rows_halves(ctrl, xbuf, scratch, second_half, q, zp, x_scale, words, scales, ksum, bias, block, out,
                          share):
    """out [M, N] = a prompt's rows q int8 [M, K] (zero points zp, scales x_scale) times a qb4w
    weight through vpdpbusd (blockwise_jit.blockwise_rows); with `share` the second half of its
    panels on the second core's thread (`second_half`: BLOCKWISE_SECOND_HALF's address). Returns
    1 when the half was taken back."""
    m, k = q.shape
    n, panels = out.shape[1], words.shape[0]
    middle = panels // 2
    col = middle * PANEL
    share = (share and middle > 0 and panels == -(-n // PANEL) and m * (k // 4 + k // block + 2) <= xbuf.shape[0]
             and m * (n - col) <= scratch.shape[0])
    if share:
        xbytes, shifts, zr, xs = _blockwise_activations(xbuf.ctypes.data, m, k, block)
    else:
        xbytes, shifts = np.empty((m, k // 8, 2), np.int32), np.empty((m, k // block), np.float32)
        zr, xs = np.empty(m, np.float32), np.empty(m, np.float32)
    for r in range(m):
        activation_bytes_int8(q[r], block, xbytes[r], shifts[r])  # qdu8's activations q + 128
        zr[r], xs[r] = np.float32(zp[r]) + np.float32(128), x_scale[r]
    v = np.empty((m, PANEL), np.float32)
    if not share:
        blockwise_rows(xbytes, shifts, zr, xs, words, scales, ksum, bias, block, 0, panels, v, out, 0)
        return 0
    ctrl[JOB], ctrl[JOB + 1], ctrl[JOB + 2] = words.ctypes.data, scales.ctypes.data, ksum.ctypes.data
    ctrl[JOB + 3], ctrl[JOB + 4], ctrl[JOB + 5], ctrl[JOB + 6], ctrl[JOB + 7] = bias.ctypes.data, m, k, n, block
    ctrl[KIND], ctrl[JOB_FN] = CALL, second_half
    seq = publish(ctrl)
    start = cycles()
    blockwise_rows(xbytes, shifts, zr, xs, words, scales, ksum, bias, block, 0, middle, v, out, 0)
    where = second_half_where(ctrl, seq, start)
    if where == THERE:
        _columns_from(scratch, out, col)
    else:
        blockwise_rows(xbytes, shifts, zr, xs, words, scales, ksum, bias, block, middle, panels, v, out, 0)
    return 1 if where == TAKEN else 0


_HALF_SIGNATURE = types.void(*[types.int64] * 12)  # second_thread_jit's CALL: the job's fields, xbuf, scratch


def _blockwise_second_half(words_at, scales_at, ksum_at, bias_at, m, k, n, block, xbuf_at, xbuf_size, scratch_at,
                           scratch_size):
    panels = -(-n // PANEL)
    middle, blocks = panels // 2, k // block
    col = middle * PANEL
    if m * (k // 4 + blocks + 2) > xbuf_size or m * (n - col) > scratch_size:
        return
    xbytes, shifts, zr, xs = _blockwise_activations(xbuf_at, m, k, block)
    blockwise_rows(xbytes, shifts, zr, xs, numba.carray(_pointer(words_at), (panels, k // 8, PANEL), np.uint32),
                   numba.carray(_pointer(scales_at), (panels, blocks, PANEL), np.float32),
                   numba.carray(_pointer(ksum_at), panels * PANEL, np.float32),
                   numba.carray(_pointer(bias_at), n, np.float32), block, middle, panels,
                   np.empty((m, PANEL), np.float32), numba.carray(_pointer(scratch_at), (m, n - col), np.float32), col)


# The second half as a C function (compiled at import, or read from numba's cache), only where the
# CPU has AVX512-VNNI: elsewhere LLVM would abort on its instructions.
if VNNI:
    BLOCKWISE_SECOND_HALF = numba.cfunc(_HALF_SIGNATURE, cache=True)(_blockwise_second_half)


# ---------------------------------------------------------------- a row's dynamic quantization, 16 lanes a step
# LLVM's vectoriser gives numba's loops 8 lanes (its preferred width on AVX-512 CPUs) and left
# quantize_rows a third of a BERT int8 linear's time (128 x 1024: 78 us of ~200); these write
# the 16-lane steps out. Each lane does what the scalar loop does to one input.

_V16I8 = ir.VectorType(ir.IntType(8), LANES)


def _reduce(builder, op: str, v):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [v.type]),
                                        f"llvm.vector.reduce.{op}.v{LANES}i32")
    return builder.call(fn, [v])


@intrinsic
def _key_bounds(typingctx, bits, vectors, ends):
    """ends[0], ends[1] = min and max of 0 and the ordered keys (rows_jit.ordered_key; a NaN's
    key taken as 0) of bits[:16 * vectors], a row's int32 bits."""
    def codegen(context, builder, sig, args):
        bits_t, _, ends_t = sig.args
        bits_arr, ends_arr = _arrays(context, builder, sig, args, (0, 2))
        zero_v = ir.Constant(_V16, None)
        magnitude, inf = ir.Constant(_V16, [0x7FFFFFFF] * LANES), ir.Constant(_V16, [0x7F800000] * LANES)
        sign_shift = ir.Constant(_V16, [31] * LANES)
        low, high = cgutils.alloca_once_value(builder, zero_v), cgutils.alloca_once_value(builder, zero_v)
        with cgutils.for_range(builder, args[1]) as loop:
            at = builder.mul(loop.index, ir.Constant(cgutils.intp_t, LANES))
            b = builder.load(_vector_at(context, builder, bits_t, bits_arr, [at]), align=4)
            key = builder.xor(b, builder.and_(builder.ashr(b, sign_shift), magnitude))
            key = builder.select(builder.icmp_signed(">", builder.and_(b, magnitude), inf), zero_v, key)
            lo, hi = builder.load(low), builder.load(high)
            builder.store(builder.select(builder.icmp_signed("<", key, lo), key, lo), low)
            builder.store(builder.select(builder.icmp_signed(">", key, hi), key, hi), high)
        for i, (op, acc) in enumerate((("smin", low), ("smax", high))):
            at = cgutils.get_item_pointer(context, builder, ends_t, ends_arr, [ir.Constant(cgutils.intp_t, i)],
                                          wraparound=False)
            builder.store(_reduce(builder, op, builder.load(acc)), at)
        return context.get_dummy_value()
    return types.void(bits, vectors, ends), codegen


@intrinsic
def _quantize_vectors(typingctx, x, q, vectors, inv, zf, flip):
    """q[i] = int8(min(max(rint(float32(x[i] * inv)) + zf, -128), 127)) ^ flip for i < 16 * vectors,
    as _quantize_row's scalar loop: max and min as numba's (a NaN passes both, as there)."""
    def codegen(context, builder, sig, args):
        x_t, q_t = sig.args[:2]
        x_arr, q_arr = _arrays(context, builder, sig, args, (0, 1))
        inv_v, zf_v = _splat(builder, args[3], _V16F), _splat(builder, args[4], _V16F)
        flip_v = _splat(builder, args[5], _V16I8)
        low, high = ir.Constant(_V16F, [-128.0] * LANES), ir.Constant(_V16F, [127.0] * LANES)
        rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F]), "llvm.rint.v16f32")
        with cgutils.for_range(builder, args[2]) as loop:
            at = builder.mul(loop.index, ir.Constant(cgutils.intp_t, LANES))
            v = builder.load(_vector_at(context, builder, x_t, x_arr, [at]), align=4)
            v = builder.fadd(builder.call(rint, [builder.fmul(v, inv_v)]), zf_v)
            v = builder.select(builder.fcmp_ordered(">", low, v), low, v)
            v = builder.select(builder.fcmp_ordered("<", high, v), high, v)
            out = builder.xor(builder.trunc(builder.fptosi(v, _V16), _V16I8), flip_v)
            q_at = cgutils.get_item_pointer(context, builder, q_t, q_arr, [at], wraparound=False)
            builder.store(out, builder.bitcast(q_at, _V16I8.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(x, q, vectors, inv, zf, flip), codegen


@numba.njit(cache=True, inline="always")
def _quantize_row(x, bits, q, flip, ends):
    """One row x float32 [K] (bits: its int32 view) quantized into q int8 [>= K], each byte xor
    `flip` (-128: q + 128 as an unsigned byte, qdu8); returns (scale, zero point). Its min and max
    (with 0; NaN left out) over rows_jit's ordered keys: the key of -0.0 is below 0.0's, and
    adding 0 makes it 0.0. 16 inputs a step (_key_bounds, _quantize_vectors), the rest one by one."""
    k = x.shape[0]
    vectors = k // LANES
    tail = vectors * LANES
    _key_bounds(bits, vectors, ends)
    low, high = ends[0], ends[1]
    for i in range(tail, k):
        b = bits[i]
        key = np.int32(0) if is_nan_bits(b) else ordered_key(b)
        low, high = min(low, key), max(high, key)
    ends[0], ends[1] = ordered_key(low), ordered_key(high)
    ends_float = ends.view(np.float32)
    lo, hi = np.float32(ends_float[0] + np.float32(0)), np.float32(ends_float[1] + np.float32(0))
    inv = np.float32(1) if lo == hi else np.float32(np.float32(255) / np.float32(hi - lo))
    lo_scaled, hi_scaled = np.float32(lo * inv), np.float32(hi * inv)
    if np.float32(np.float32(-128) + lo_scaled) + np.float32(np.float32(127) + hi_scaled) > 0:
        z = np.float32(np.float32(-128) - lo_scaled)
    else:
        z = np.float32(np.float32(127) - hi_scaled)
    zf = np.rint(min(max(z, np.float32(-128)), np.float32(127)))
    _quantize_vectors(x, q, vectors, inv, zf, flip)
    for i in range(tail, k):
        v = np.rint(np.float32(x[i] * inv)) + zf
        q[i] = np.int8(min(max(v, np.float32(-128)), np.float32(127))) ^ flip
    return np.float32(1) / inv, np.int32(zf)


@numba.njit(cache=True, error_model="numpy")  # a row with inf: scale inf as numpy gives, no ZeroDivisionError
def quantize_rows(x, q, scale, zero):
    # x float32 [m, k] in C order -> q int8 [m, k], scale, zero [m]
    bits, ends = x.view(np.int32), np.empty(2, np.int32)
    for r in range(x.shape[0]):
        scale[r], zero[r] = _quantize_row(x[r], bits[r], q[r], np.int8(0), ends)


@numba.njit(cache=True, inline="always")
def quantize_activations(x, xq, zr, x_scale, r0, r1):
    """Rows r0..r1 of quantize_rows(x), x float32 [M, K], written as channelwise_rows' activations:
    each q + 128 a byte of xq int32 [M, K/4 rounded up] (zeros past K, as given), zr = zp + 128,
    x_scale."""
    bits, ends, qbytes = x.view(np.int32), np.empty(2, np.int32), xq.view(np.int8)
    for r in range(r0, r1):
        x_scale[r], zp = _quantize_row(x[r], bits[r], qbytes[r], np.int8(-128), ends)
        zr[r] = zp + np.int32(128)


# ---------------------------------------------------------------- a prompt's rows, qc8w: both cores
# Chunks of (panel, block of rows), the caller's from the front and the second core's thread's
# from the back (second_thread_jit's chunked jobs), each written straight into out. (Shared as
# halves beside an encoder's attention on BLAS's threads, ExecuTorch's int8 BERT ran no faster:
# those threads spun beside ours. Its attention now runs on the conv GEMM's tiles and this thread.)
# The job block's fields: the addresses of the activations' words (and their rows and words a
# row), zr, x_scale, the weight's words (and panels), wsum, w_scale, bias, out (and outputs);
# the rows a chunk.
(CW_XQ_AT, CW_M, CW_QUADS, CW_ZR_AT, CW_XS_AT, CW_WORDS_AT, CW_P, CW_WSUM_AT, CW_WSCALE_AT, CW_BIAS_AT, CW_OUT_AT,
 CW_N, CW_CHUNK_ROWS) = range(FIELDS, FIELDS + 13)
CHANNELWISE_CHUNKS_PER_CALL = 16  # about this many chunks a call, shared by both threads


@numba.njit(cache=True, inline="always")
def _channelwise_activations(q, zp, quads):
    """q int8 [M, K] as vpdpbusd reads it: int32 [M, quads], byte t of word i the input 4i + t plus
    128 (qdu8; zeros past K); and each row's zero point + 128."""
    m, k = q.shape
    xq = np.zeros((m, quads), np.int32)
    xbytes = xq.view(np.uint8)  # byte t of word i is input 4i + t (x86: little-endian), as words are laid out
    for r in range(m):
        for i in range(k):
            xbytes[r, i] = np.uint8(np.int32(q[r, i]) + 128)
    zr = np.empty(m, np.int32)
    for r in range(m):
        zr[r] = np.int32(zp[r]) + np.int32(128)
    return xq, zr


@numba.njit(cache=True, nogil=True)
def channelwise_block(xq, zr, x_scale, words, wsum, w_scale, bias, out, p0, p1, r0, r1):
    """Panels p0..p1 x rows r0..r1 of channelwise_rows' out: four rows at a time, then one by one;
    the last panel, part of it past the outputs, through an int32 scratch."""
    n = out.shape[1]
    whole = n // PANEL
    for p in range(p0, min(p1, whole)):
        r = r0
        while r + ROWS <= r1:
            channel_panel_rows_scaled(words, xq, p, r, zr, x_scale, wsum, w_scale, bias, out)
            r += ROWS
        while r < r1:
            channel_panel_row_scaled(words, xq, p, r, zr, x_scale, wsum, w_scale, bias, out)
            r += 1
    if p1 <= whole:
        return
    acc = np.empty((xq.shape[0], PANEL), np.int32)
    p, c0 = whole, whole * PANEL
    r = r0
    while r + ROWS <= r1:
        channel_panel_rows(words, xq, p, acc, r)
        r += ROWS
    while r < r1:
        channel_panel_row(words, xq, p, acc, r)
        r += 1
    for r in range(r0, r1):
        xs, o = x_scale[r], out[r]
        for j in range(n - c0):
            a = np.float32(acc[r, j] - zr[r] * wsum[c0 + j])
            o[c0 + j] = fma32(np.float32(a * xs), w_scale[c0 + j], bias[c0 + j])


@numba.njit(cache=True, inline="always")
def _channelwise_chunks(job, from_back, xq, zr, x_scale, words, wsum, w_scale, bias, out):
    m, rows = xq.shape[0], job[CW_CHUNK_ROWS]
    down = -(-m // rows)
    while True:
        c = next_chunk(job, from_back)
        if c < 0:
            return
        p, r0 = c // down, (c % down) * rows
        channelwise_block(xq, zr, x_scale, words, wsum, w_scale, bias, out, p, p + 1, r0, min(m, r0 + rows))


@numba.njit(cache=True, inline="always")
def _channelwise_products(ctrl, fn, job, xq, zr, x_scale, words, wsum, w_scale, bias, out, share):
    m, panels = xq.shape[0], words.shape[0]
    if not share:
        channelwise_block(xq, zr, x_scale, words, wsum, w_scale, bias, out, 0, panels, 0, m)
        return 0
    rows = ROWS * max(1, -(-m // (ROWS * max(1, CHANNELWISE_CHUNKS_PER_CALL // panels))))
    job[CW_XQ_AT], job[CW_M], job[CW_QUADS], job[CW_ZR_AT] = xq.ctypes.data, m, xq.shape[1], zr.ctypes.data
    job[CW_XS_AT], job[CW_WORDS_AT], job[CW_P], job[CW_WSUM_AT] = x_scale.ctypes.data, words.ctypes.data, panels, wsum.ctypes.data
    job[CW_WSCALE_AT], job[CW_BIAS_AT], job[CW_OUT_AT] = w_scale.ctypes.data, bias.ctypes.data, out.ctypes.data
    job[CW_N], job[CW_CHUNK_ROWS] = out.shape[1], rows
    open_chunks(job, panels * -(-m // rows))
    seq = post_chunks(ctrl, job, fn)
    _channelwise_chunks(job, False, xq, zr, x_scale, words, wsum, w_scale, bias, out)
    join_chunks(ctrl, seq)
    return 0


@numba.njit(cache=True, nogil=True)
def channelwise_rows(ctrl, xbuf, scratch, fn, job, q, zp, x_scale, words, wsum, w_scale, bias, out, share):
    """out [M, N] = qd8 x qc8w for a prompt's rows through vpdpbusd (AVX512-VNNI only): the exact
    sums of (q + 128) * w four rows at a time, less (zp + 128) * sum(w), then scale_sums' float
    steps, in registers for whole panels (vnni_jit.channel_panel_rows_scaled). words int32
    [P, K/4, PANEL] (channelwise_words), wsum int32 [P * PANEL]. With `share` its chunks taken
    by this thread and the second core's (fn: CHANNELWISE_CHUNKS's address; job: the second
    thread's job block, which only a sharing call may use). The same bits either way. Returns 0."""
    xq, zr = _channelwise_activations(q, zp, words.shape[1])
    return _channelwise_products(ctrl, fn, job, xq, zr, x_scale, words, wsum, w_scale, bias, out, share)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def channelwise_from_float(ctrl, xbuf, scratch, fn, job, quantize_fn, x, words, wsum, w_scale, bias, out, share):
    """channelwise_rows of quantize_rows(x) for x float32 [M, K] (C order), the quantized rows
    written straight as the products' activations (quantize_activations): the same bits. With
    `share` the rows are quantized by both threads too (quantize_fn: QUANTIZE_CHUNKS' address),
    one job after the other."""
    m = x.shape[0]
    xq, zr, x_scale = np.zeros((m, words.shape[1]), np.int32), np.empty(m, np.int32), np.empty(m, np.float32)
    if share:
        job[QA_X_AT], job[QA_M], job[QA_K], job[QA_XQ_AT] = x.ctypes.data, m, x.shape[1], xq.ctypes.data
        job[QA_QUADS], job[QA_ZR_AT], job[QA_XS_AT] = xq.shape[1], zr.ctypes.data, x_scale.ctypes.data
        open_chunks(job, -(-m // QUANTIZE_CHUNK_ROWS))
        seq = post_chunks(ctrl, job, quantize_fn)
        _quantize_chunks(job, False, x, xq, zr, x_scale)
        join_chunks(ctrl, seq)
    else:
        quantize_activations(x, xq, zr, x_scale, 0, m)
    return _channelwise_products(ctrl, fn, job, xq, zr, x_scale, words, wsum, w_scale, bias, out, share)


# Quantizing a prompt's rows on both cores: chunks of QUANTIZE_CHUNK_ROWS rows. The job block's
# fields: x's address, rows and inputs; the activations' words (and words a row), zr, x_scale.
(QA_X_AT, QA_M, QA_K, QA_XQ_AT, QA_QUADS, QA_ZR_AT, QA_XS_AT) = range(FIELDS, FIELDS + 7)
QUANTIZE_CHUNK_ROWS = 8


@numba.njit(cache=True, inline="always")
def _quantize_chunks(job, from_back, x, xq, zr, x_scale):
    m = x.shape[0]
    while True:
        c = next_chunk(job, from_back)
        if c < 0:
            return
        r0 = c * QUANTIZE_CHUNK_ROWS
        quantize_activations(x, xq, zr, x_scale, r0, min(m, r0 + QUANTIZE_CHUNK_ROWS))


def _quantize_thread_chunks(job_at, _1, _2, _3, _4, _5, _6, _7, _xbuf_at, _xbuf_size, _scratch_at, _scratch_size):
    # channelwise_from_float's quantizing job on the second core's thread
    job = numba.carray(_pointer(job_at), JOB_SLOTS, np.int64)
    m = job[QA_M]
    _quantize_chunks(job, True, numba.carray(_pointer(job[QA_X_AT]), (m, job[QA_K]), np.float32),
                     numba.carray(_pointer(job[QA_XQ_AT]), (m, job[QA_QUADS]), np.int32),
                     numba.carray(_pointer(job[QA_ZR_AT]), m, np.int32),
                     numba.carray(_pointer(job[QA_XS_AT]), m, np.float32))


def _channelwise_thread_chunks(job_at, _1, _2, _3, _4, _5, _6, _7, _xbuf_at, _xbuf_size, _scratch_at, _scratch_size):
    # channelwise_rows' job on the second core's thread: its arrays again from the job block
    job = numba.carray(_pointer(job_at), JOB_SLOTS, np.int64)
    m, quads, panels, n = job[CW_M], job[CW_QUADS], job[CW_P], job[CW_N]
    _channelwise_chunks(job, True, numba.carray(_pointer(job[CW_XQ_AT]), (m, quads), np.int32),
                        numba.carray(_pointer(job[CW_ZR_AT]), m, np.int32),
                        numba.carray(_pointer(job[CW_XS_AT]), m, np.float32),
                        numba.carray(_pointer(job[CW_WORDS_AT]), (panels, quads, PANEL), np.int32),
                        numba.carray(_pointer(job[CW_WSUM_AT]), panels * PANEL, np.int32),
                        numba.carray(_pointer(job[CW_WSCALE_AT]), n, np.float32),
                        numba.carray(_pointer(job[CW_BIAS_AT]), n, np.float32),
                        numba.carray(_pointer(job[CW_OUT_AT]), (m, n), np.float32))


# The thread's part as a C function, only where the CPU has AVX512-VNNI (as BLOCKWISE_SECOND_HALF).
if VNNI:
    CHANNELWISE_CHUNKS = numba.cfunc(_HALF_SIGNATURE, cache=True)(_channelwise_thread_chunks)
    QUANTIZE_CHUNKS = numba.cfunc(_HALF_SIGNATURE, cache=True, error_model="numpy")(_quantize_thread_chunks)


@numba.njit(parallel=True, cache=True)
def channelwise(q, zp, x_scale, w, w_scale, bias, out):
    m, k = q.shape
    n = w.shape[0]
    for c in numba.prange(n):
        for r in range(m):
            acc = np.int32(0)
            for i in range(k):
                acc += np.int32(q[r, i]) * np.int32(w[c, i])
            wsum = np.int32(0)
            for i in range(k):
                wsum += np.int32(w[c, i])
            acc -= np.int32(zp[r]) * wsum
            scaled = np.float32(np.float32(acc) * x_scale[r])
            out[r, c] = fma32(scaled, w_scale[c], bias[c])

@numba.njit(cache=True)
def scale_sums(acc, x_scale, w_scale, bias, out):
    # out[r, c] = fma(acc[r, c] * x_scale[r], w_scale[c], bias[c]), as channelwise's last step
    # (numpy's float64 steps through temporaries took 1.2 ms for 128 x 1024).
    for r in range(acc.shape[0]):
        a, o, xs = acc[r], out[r], x_scale[r]
        for c in range(acc.shape[1]):
            o[c] = fma32(np.float32(a[c] * xs), w_scale[c], bias[c])


# Every compiled entry point by name (the cache test runs each and reads its dispatcher's stats;
# the helpers are compiled into the kernels that call them): those of this CPU's qb4w arithmetic.
KERNELS = {"channelwise": channelwise, "scale_sums": scale_sums, "quantize_rows": quantize_rows,
           **({"blockwise_matvec_avx2": blockwise_matvec_avx2,
               "blockwise_matvec_from_float_avx2": blockwise_matvec_from_float_avx2,
               **({"blockwise_rows_avx2": blockwise_rows_avx2, "blockwise_rows_avx2_parallel": blockwise_rows_avx2_parallel}
                  if AVX2 else
                  {"blockwise_tiles_avx2": blockwise_tiles_avx2,
                   "blockwise_tiles_avx2_parallel": blockwise_tiles_avx2_parallel})}
              if ARITHMETIC == "avx2" else
              {"blockwise_matvec": blockwise_matvec, "blockwise_matvec_from_float": blockwise_matvec_from_float}),
           # a prompt's rows: through vpdpbusd where the CPU has it, else a tile of unpacked weights at a time
           **({"channelwise_rows": channelwise_rows, "channelwise_from_float": channelwise_from_float}
              if VNNI else {}),
           **({"blockwise_rows_halves": blockwise_rows_halves} if VNNI and ARITHMETIC == "vnni" else
              {"blockwise_tiles": blockwise_tiles, "blockwise_tiles_parallel": blockwise_tiles_parallel}
              if ARITHMETIC == "vnni" else {})}
