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

from .quantized_jit import nibble_dot
from .xnnpack_gemm import TILE  # defined before xnnpack_gemm imports this module


_M4 = np.uint32(15)


# ---------------------------------------------------------------- a few rows: one pass over the words


@numba.njit(cache=True, fastmath=True)
def _nibble_sums(a, words, b0, b1, j0, j1, acc):
    # acc[j] = sum over inputs 8 * b0 .. 8 * b1 of a[i] * (stored 4-bit weight of column j0 + j):
    # a[i] = q + 128 and the stored values (weight + 8) are integers, every partial sum one below
    # 2**24 (MAX_EXACT_BLOCK), so float32 adds them exactly in whatever order fastmath picks.
    n = j1 - j0
    acc[:] = 0
    for b in range(b0, b1):
        c = 8 * b
        x0, x1, x2, x3, x4, x5, x6, x7 = a[c], a[c + 1], a[c + 2], a[c + 3], a[c + 4], a[c + 5], a[c + 6], a[c + 7]
        row = words[b, j0:j1]
        for j in range(n):
            acc[j] += nibble_dot(row[j], x0, x1, x2, x3, x4, x5, x6, x7)


@numba.njit(cache=True)
def _unsigned_row(q, block, a, a8):
    # a = q + 128 (qdu8's activations); a8[b] = 8 * block b's sum of a, what the stored weights'
    # +8 adds to the block's sum (exact: integers below 2**24)
    for i in range(q.shape[0]):
        a[i] = np.float32(q[i]) + np.float32(128)
    for b in range(a8.shape[0]):
        total = np.float32(0)
        for i in range(b * block, (b + 1) * block):
            total += a[i]
        a8[b] = np.float32(8) * total


@numba.njit(cache=True)
def _blockwise_columns(a, a8, zp, x_scale, words, scales, ksum, bias, block, j0, j1, out):
    # out[j0:j1] for one row, XNNPACK's steps in its order (xnnpack_gemm.py): no fastmath here,
    # each step rounds to float32 where XNNPACK's does, and the fma is emulated in float64
    n = j1 - j0
    acc = np.empty(n, np.float32)
    v = np.empty(n, np.float32)
    ks, bs, o = ksum[j0:j1], bias[j0:j1], out[j0:j1]
    for j in range(n):
        v[j] = ks[j] * zp
    per_block = block // 8
    for b in range(scales.shape[0]):
        _nibble_sums(a, words, b * per_block, (b + 1) * per_block, j0, j1, acc)
        sb, shift = scales[b, j0:j1], a8[b]
        for j in range(n):  # acc - shift: the block's sum of (q + 128) * weight, an exact integer
            v[j] = np.float32(np.float64(v[j]) + np.float64(acc[j] - shift) * np.float64(sb[j]))
    for j in range(n):
        o[j] = np.float32(v[j] * x_scale) + bs[j]


@numba.njit(cache=True)
def blockwise_matvec(q, zp, x_scale, words, scales, ksum, bias, block, out):
    m, k = q.shape
    a, a8 = np.empty(k, np.float32), np.empty(k // block, np.float32)
    for r in range(m):
        _unsigned_row(q[r], block, a, a8)
        _blockwise_columns(a, a8, np.float32(zp[r]) + np.float32(128), x_scale[r], words, scales, ksum, bias, block,
                           0, out.shape[1], out[r])


@numba.njit(cache=True, parallel=True)
def blockwise_matvec_parallel(q, zp, x_scale, words, scales, ksum, bias, block, blocks, out):
    # blockwise_matvec with the outputs cut into `blocks` runs of columns, one per thread; a run
    # is a multiple of 64 columns, so no two threads write into one cache line
    m, k = q.shape
    n = out.shape[1]
    width = (-(-n // blocks) + 63) // 64 * 64
    a, a8 = np.empty(k, np.float32), np.empty(k // block, np.float32)
    for r in range(m):
        _unsigned_row(q[r], block, a, a8)
        zr = np.float32(zp[r]) + np.float32(128)
        for t in numba.prange(blocks):
            j0 = t * width
            j1 = min(n, j0 + width)
            if j0 < j1:
                _blockwise_columns(a, a8, zr, x_scale[r], words, scales, ksum, bias, block, j0, j1, out[r])


# ---------------------------------------------------------------- many rows: a tile of weights at a time


@numba.njit(cache=True)
def _signed_tile(words, c0, width, tile):
    # tile int8 [K, TILE] = the signed weights (stored - 8) of columns c0 .. c0 + width, zeros after
    tile[:] = 0
    for b in range(words.shape[0]):
        row = words[b, c0:c0 + width]
        for r in range(8):
            dst, shift = tile[8 * b + r], np.uint32(4 * r)
            for j in range(width):
                dst[j] = np.int8(np.int32((row[j] >> shift) & _M4) - np.int32(8))


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
    tile = np.empty((k, TILE), np.int8)
    _signed_tile(words, c0, width, tile)
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
            sb = scales[b, c0:c0 + width]
            for j in range(width):
                v[j] = np.float32(np.float64(v[j]) + np.float64(np.float32(acc[j])) * np.float64(sb[j]))
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
            out[r, c] = np.float32(np.float64(scaled) * np.float64(w_scale[c]) + np.float64(bias[c]))

@numba.njit(cache=True)
def scale_sums(acc, x_scale, w_scale, bias, out):
    # out[r, c] = fma(acc[r, c] * x_scale[r], w_scale[c], bias[c]), as channelwise's last step
    # (numpy's float64 round trip through temporaries took 1.2 ms for 128 x 1024).
    for r in range(acc.shape[0]):
        a, o, xs = acc[r], out[r], x_scale[r]
        for c in range(acc.shape[1]):
            o[c] = np.float32(np.float64(np.float32(a[c] * xs)) * np.float64(w_scale[c]) + np.float64(bias[c]))


@numba.njit(cache=True)
def quantize_rows(x, q, scale, zero):
    m, k = x.shape
    for r in range(m):
        lo, hi = np.float32(0), np.float32(0)
        for i in range(k):
            lo = min(lo, x[r, i])
            hi = max(hi, x[r, i])
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
KERNELS = {"blockwise_matvec": blockwise_matvec, "blockwise_matvec_parallel": blockwise_matvec_parallel,
           "blockwise_tiles": blockwise_tiles, "blockwise_tiles_parallel": blockwise_tiles_parallel, "channelwise": channelwise, "scale_sums": scale_sums,
           "quantize_rows": quantize_rows}
