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

from .xnnpack_gemm import TILE  # defined before xnnpack_gemm imports this module


@numba.njit(cache=True)
def blockwise_tile(a, zp, x_scale, tiles, scales, ksum, bias, block, out, t):
    # Output channels of tile t, every row. Each block's sum runs across the tile's
    # channels (vectorizable), then joins v with one fma. Rows are sliced to the tile
    # first: indexing with c0 + j would make numba check for negative indices, which stops
    # LLVM from vectorizing (10x slower). A block's sum is an integer: a (q + 128, int16)
    # times the 4-bit weights, two inputs at a time in int16 (2 * 255 * 8 fits), added up
    # in int32; exact, so equal to the numpy reference's float32 sums (below 2**24), and
    # 15-35% faster than summing in float32. Blocks are a multiple of 16 inputs.
    m, k = a.shape
    c0 = t * TILE
    tile = tiles[t]
    acc = np.empty(TILE, np.int32)
    v = np.empty(TILE, np.float32)
    ks, bs = ksum[c0:c0 + TILE], bias[c0:c0 + TILE]
    for r in range(m):
        for j in range(TILE):
            v[j] = ks[j] * zp[r]
        for b in range(k // block):
            acc[:] = 0
            for i in range(b * block, (b + 1) * block, 2):
                a0, a1, row0, row1 = a[r, i], a[r, i + 1], tile[i], tile[i + 1]
                for j in range(TILE):
                    acc[j] += np.int32(a0 * np.int16(row0[j]) + a1 * np.int16(row1[j]))
            sb = scales[b, c0:c0 + TILE]
            for j in range(TILE):
                v[j] = np.float32(np.float64(v[j]) + np.float64(np.float32(acc[j])) * np.float64(sb[j]))
        o = out[r, c0:c0 + TILE]
        for j in range(TILE):
            o[j] = np.float32(v[j] * x_scale[r]) + bs[j]

@numba.njit(cache=True)
def blockwise_serial(a, zp, x_scale, tiles, scales, ksum, bias, block, out):
    for t in range(tiles.shape[0]):
        blockwise_tile(a, zp, x_scale, tiles, scales, ksum, bias, block, out, t)

@numba.njit(parallel=True, cache=True)
def blockwise_parallel(a, zp, x_scale, tiles, scales, ksum, bias, block, out):
    for t in numba.prange(tiles.shape[0]):
        blockwise_tile(a, zp, x_scale, tiles, scales, ksum, bias, block, out, t)

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
# blockwise_tile is compiled into the two that call it).
KERNELS = {"blockwise_serial": blockwise_serial,
           "blockwise_parallel": blockwise_parallel, "channelwise": channelwise, "scale_sums": scale_sums,
           "quantize_rows": quantize_rows}
