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
from numba import types

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .fma_jit import fma32
from .blockwise_jit import PANEL, VNNI, activation_bytes, activation_bytes_int8, blockwise_panels, blockwise_rows
from .vnni_jit import ROWS, channel_panel_row, channel_panel_row_scaled, channel_panel_rows, channel_panel_rows_scaled
from .rows_jit import is_nan_bits, ordered_key
from .second_thread_jit import (BLOCKWISE, CALL, FIELDS, HERE, JOB, JOB_FN, JOB_SLOTS, KIND, TAKEN, THERE, _pointer,
                               cycles, join_chunks, next_chunk, open_chunks, post_chunks, post_job, publish,
                               second_half_where)
from .xnnpack_gemm import PANEL as LAID_OUT, TILE  # defined before xnnpack_gemm imports this module

assert LAID_OUT == PANEL and TILE % PANEL == 0


_M4 = np.uint32(15)


# ---------------------------------------------------------------- a few rows: one pass over the words


@numba.njit(cache=True, nogil=True)
def blockwise_matvec(ctrl, xbuf, scratch, q, zp, x_scale, words, scales, ksum, bias, block, out, share):
    """out [M, N] for a few rows, XNNPACK's steps in its order (xnnpack_gemm.py), a panel of
    PANEL outputs at a time (blockwise_jit). With `share` the second core's thread (second_thread_jit)
    may run the second half of the panels into `scratch`; a panel's bits do not depend on who
    runs it. Returns the halves taken back."""
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
    # Output channels of tile t, every row. Each block's sum runs across the tile's
    # channels (vectorizable), then joins v with one fma. Rows are sliced to the tile
    # first: indexing with c0 + j would make numba check for negative indices, which stops
    # LLVM from vectorizing (10x slower). A block's sum is an integer: a (q + 128, int16)
    # times the 4-bit weights, two inputs at a time in int16 (2 * 255 * 8 fits), added up
    # in int32; exact, so equal to the numpy reference's float32 sums (below 2**24), and
    # 15-35% faster than summing in float32. Blocks are a multiple of 16 inputs.
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


@numba.njit(cache=True, nogil=True)
def channelwise_rows(ctrl, xbuf, scratch, fn, job, q, zp, x_scale, words, wsum, w_scale, bias, out, share):
    """out [M, N] = qd8 x qc8w for a prompt's rows through vpdpbusd (AVX512-VNNI only): the exact
    sums of (q + 128) * w four rows at a time, less (zp + 128) * sum(w), then scale_sums' float
    steps, in registers for whole panels (vnni_jit.channel_panel_rows_scaled). words int32
    [P, K/4, PANEL] (channelwise_words), wsum int32 [P * PANEL]. With `share` its chunks taken
    by this thread and the second core's (fn: CHANNELWISE_CHUNKS's address; job: the second
    thread's job block, which only a sharing call may use). The same bits either way. Returns 0."""
    m, panels = q.shape[0], words.shape[0]
    xq, zr = _channelwise_activations(q, zp, words.shape[1])
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


@numba.njit(cache=True, error_model="numpy")  # a row with inf: scale inf as numpy gives, no ZeroDivisionError
def quantize_rows(x, q, scale, zero):
    # x float32 [m, k] in C order. Each row's min and max (with 0; NaN left out) over rows_jit's
    # ordered keys; the key of -0.0 is below 0.0's, and adding 0 makes it 0.0.
    m, k = x.shape
    bits = x.view(np.int32)
    ends = np.empty(2, np.int32)
    ends_float = ends.view(np.float32)
    for r in range(m):
        low, high = np.int32(0), np.int32(0)
        for i in range(k):
            b = bits[r, i]
            key = np.int32(0) if is_nan_bits(b) else ordered_key(b)
            low, high = min(low, key), max(high, key)
        ends[0], ends[1] = ordered_key(low), ordered_key(high)
        lo, hi = np.float32(ends_float[0] + np.float32(0)), np.float32(ends_float[1] + np.float32(0))
        inv = np.float32(1) if lo == hi else np.float32(np.float32(255) / np.float32(hi - lo))
        lo_scaled, hi_scaled = np.float32(lo * inv), np.float32(hi * inv)
        if np.float32(np.float32(-128) + lo_scaled) + np.float32(np.float32(127) + hi_scaled) > 0:
            z = np.float32(np.float32(-128) - lo_scaled)
        else:
            z = np.float32(np.float32(127) - hi_scaled)
        zf = np.rint(min(max(z, np.float32(-128)), np.float32(127)))
        for i in range(k):
            v = np.rint(np.float32(x[r, i] * inv)) + zf
            q[r, i] = np.int8(min(max(v, np.float32(-128)), np.float32(127)))
        scale[r] = np.float32(1) / inv
        zero[r] = np.int32(zf)


# Every compiled entry point by name (the cache test runs each and reads its dispatcher's stats;
# the helpers are compiled into the kernels that call them).
KERNELS = {"blockwise_matvec": blockwise_matvec, "blockwise_matvec_from_float": blockwise_matvec_from_float,
           "channelwise": channelwise, "scale_sums": scale_sums, "quantize_rows": quantize_rows,
           # a prompt's rows: through vpdpbusd where the CPU has it, else a tile of unpacked weights at a time
           **({"blockwise_rows_halves": blockwise_rows_halves, "channelwise_rows": channelwise_rows}
              if VNNI else {"blockwise_tiles": blockwise_tiles, "blockwise_tiles_parallel": blockwise_tiles_parallel})}
