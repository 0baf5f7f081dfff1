"""The part of XNNPACK's qb4w decode mat-vec that either thread runs: the chains of a range of output
panels (imported only where numba is installed; layout and arithmetic in xnnpack_gemm.py).

The caller (xnnpack_gemm_jit.blockwise_matvec) runs the first half of a weight's panels and the
second core's thread (second_thread_jit) the second, each into its own buffer: a panel's outputs
depend on nothing else, so who computes it does not change a bit. Two arithmetics, as the CPU
decides (xnnpack_gemm.ARITHMETIC): "vnni" (blockwise_panels; with AVX512-VNNI the block sums come
from vpdpbusd (vnni_jit), elsewhere from float32 sums of the same integers, exact in any order)
and "avx2" (blockwise_panels_avx2: four lanes' exact sums, from vpmaddubsw where numba compiles
for AVX2 (avx2_jit), from float32 products elsewhere, and their chains; its second half runs
through xnnpack_gemm_jit's C function).
"""
from __future__ import annotations

import numba
import numpy as np

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .fma_jit import fma32
from .quantized_jit import exact_nibble_sums
from .avx2_jit import (AVX2, GROUP as LANES_GROUP, LANES as AVX2_LANES, ROWS as AVX2_ROWS, lane_activations,
                       panel_outputs_four, panel_outputs_one)
from .vnni_jit import PANEL, ROWS, VNNI, panel_chain, panel_chain_rows


@numba.njit(cache=True)
def activation_bytes(a, block, xbytes, shifts):
    """From a = q + 128 (float32 [K], integers 0..255): xbytes int32 [K/8, 2], each word row's
    even inputs' bytes in [r, 0] and odd inputs' in [r, 1] (vpdpbusd's operands), and shifts
    float32 [K / block], 8 * each block's sum of a (what the stored values' +8 adds)."""
    for r in range(a.shape[0] // 8):
        even, odd = np.uint32(0), np.uint32(0)
        for t in range(4):
            even |= np.uint32(a[8 * r + 2 * t]) << np.uint32(8 * t)
            odd |= np.uint32(a[8 * r + 2 * t + 1]) << np.uint32(8 * t)
        xbytes[r, 0], xbytes[r, 1] = np.int32(even), np.int32(odd)
    for b in range(shifts.shape[0]):
        shifts[b] = np.float32(8) * a[b * block:(b + 1) * block].sum()


# q + 128 for eight int8 activations at once (their bytes as one uint64), and the two masks that
# move a uint64's bytes 0..7 to the order 0 2 4 6 1 3 5 7 (swap bytes 1,2 and 5,6, then 16-bit units 1,2)
_FLIP, _SWAP_BYTES, _SWAP_PAIRS = np.uint64(0x8080808080808080), np.uint64(0x0000FF000000FF00), np.uint64(0x00000000FFFF0000)
_EIGHT, _SIXTEEN = np.uint64(8), np.uint64(16)


@numba.njit(cache=True, inline="always")
def activation_bytes_int8(q, block, xbytes, shifts):
    """activation_bytes of a = q + 128 from the int8 row q [K] itself (C order, K a multiple of 8,
    x86's byte order): eight inputs' bytes reordered in one uint64, and each block's sum in
    integers (exact; a loop LLVM vectorises). 4x faster than through float32 a."""
    src, dst = q.view(np.uint64), xbytes.reshape(-1).view(np.uint64)
    for w in range(q.shape[0] // 8):
        x = src[w] ^ _FLIP
        t = (x ^ (x >> _EIGHT)) & _SWAP_BYTES
        x = x ^ t ^ (t << _EIGHT)
        t = (x ^ (x >> _SIXTEEN)) & _SWAP_PAIRS
        dst[w] = x ^ t ^ (t << _SIXTEEN)  # low word: the even inputs, high word: the odd ones
    for b in range(shifts.shape[0]):
        segment, total = q[b * block:(b + 1) * block], 0
        for i in range(segment.shape[0]):
            total += segment[i]
        shifts[b] = np.float32(8) * np.float32(total + 128 * block)


@numba.njit(cache=True)
def _chains_vnni(a, xbytes, shifts, words, scales, per_block, p0, p1, v):
    for p in range(p0, p1):
        panel_chain(words, xbytes, shifts, scales, per_block, p, v, p - p0)


@numba.njit(cache=True)
def _chains_float(a, xbytes, shifts, words, scales, per_block, p0, p1, v):
    sums = np.empty(PANEL, np.float32)
    for p in range(p0, p1):
        chain, panel, panel_scales = v[p - p0], words[p], scales[p]
        for b in range(shifts.shape[0]):
            exact_nibble_sums(a, panel, b * per_block, (b + 1) * per_block, sums)
            block_scales, shift = panel_scales[b], shifts[b]
            for j in range(PANEL):
                chain[j] = fma32(np.float32(sums[j] - shift), block_scales[j], chain[j])


# Chosen once: numba compiles the function a caller names into it.
_chains = _chains_vnni if VNNI else _chains_float


@numba.njit(cache=True, nogil=True)
def blockwise_panels(a, xbytes, shifts, words, scales, ksum, zr, block, p0, p1, v):
    """v [p1 - p0, PANEL] = panels p0..p1's outputs before the row's scale and the bias, in the
    "vnni" arithmetic: from ksum * (zp + 128) (`zr`), one fma per block in order (xnnpack_gemm.py)."""
    for p in range(p0, p1):
        for j in range(PANEL):
            v[p - p0, j] = ksum[p * PANEL + j] * zr
    _chains(a, xbytes, shifts, words, scales, block // 8, p0, p1, v)


@numba.njit(cache=True, nogil=True)
def blockwise_rows(xbytes, shifts, zr, x_scale, words, scales, ksum, bias, block, p0, p1, v, out, col0):
    """out[:, panels p0..p1's columns - col0] for every row of a prompt, with AVX512-VNNI only
    (panel_chain_rows: ROWS rows at a time, the rest one by one); out float32 [M, N - col0] holds
    the outputs from column col0 on. xbytes [M, K/8, 2], shifts [M, blocks] and zr [M] are each
    row's activation_bytes and zp + 128; v [M, PANEL] scratch. Each output is blockwise_panels'
    chain, then times the row's scale plus the bias, as the mat-vec finishes it: the same bits."""
    m, n, per = xbytes.shape[0], col0 + out.shape[1], block // 8
    for p in range(p0, p1):
        for r in range(m):
            for j in range(PANEL):
                v[r, j] = ksum[p * PANEL + j] * zr[r]
        r = 0
        while r + ROWS <= m:
            panel_chain_rows(words, xbytes, shifts, scales, per, p, v, r)
            r += ROWS
        while r < m:
            panel_chain(words, xbytes[r], shifts[r], scales, per, p, v, r)
            r += 1
        c0 = p * PANEL
        for r in range(m):
            o, chain, xs = out[r], v[r], x_scale[r]
            for j in range(min(PANEL, n - c0)):
                o[c0 - col0 + j] = np.float32(chain[j] * xs) + bias[c0 + j]


# ---------------------------------------------------------------- the "avx2" arithmetic (xnnpack_gemm.py)
# XNNPACK's qb4w kernels on a CPU without AVX512-VNNI keep four partial sums per output, lane j
# holding the inputs k with (k mod 8) // 2 == j, on signed activations q; y = (v0 + v1) + (v2 + v3).
# Both threads of a decode mat-vec run blockwise_panels_avx2 (the second through
# xnnpack_gemm_jit's C function) on words in the "lanes" layout (avx2_jit): its float steps are in
# one order, its sums exact.


@numba.njit(cache=True)
def lane_shifts(q, block, shifts):
    """shifts float32 [K / block, AVX2_LANES] = 8 * each block's sum of q over each lane's inputs
    (what the stored values' +8 adds to that lane's sums); q int8 [K] the signed activations. Exact."""
    for b in range(shifts.shape[0]):
        s0 = s1 = s2 = s3 = 0
        for i in range(b * block, (b + 1) * block, 8):
            s0 += np.int32(q[i]) + np.int32(q[i + 1])
            s1 += np.int32(q[i + 2]) + np.int32(q[i + 3])
            s2 += np.int32(q[i + 4]) + np.int32(q[i + 5])
            s3 += np.int32(q[i + 6]) + np.int32(q[i + 7])
        shifts[b, 0], shifts[b, 1] = np.float32(8 * s0), np.float32(8 * s1)
        shifts[b, 2], shifts[b, 3] = np.float32(8 * s2), np.float32(8 * s3)


@numba.njit(cache=True, inline="always")
def lanes_register(p, j, doubles):
    """Where output j of panel p has its register's bytes of double row 0 in the lanes layout
    (xnnpack_gemm._panel_words), a byte offset into the words: double row d is d * 32 * LANES_GROUP
    bytes on, output c = j % 4, lane t, word row 2d + rho in its byte 2 * (4t + c) + rho."""
    g = j // 4
    return ((p * (PANEL // 4 // LANES_GROUP) + g // LANES_GROUP) * doubles * LANES_GROUP + g % LANES_GROUP) * 32


@numba.njit(cache=True, inline="always")
def lanes_scale(scales, p, b, j):
    """The scale of panel p's output j in block b, from scales in the lanes layout
    (xnnpack_gemm.lanes_scales: a pair of registers' eight outputs, block after block)."""
    g, blocks = j // 4, scales.shape[1]
    return scales[p].reshape(-1)[((g // LANES_GROUP) * blocks + b) * 4 * LANES_GROUP + (g % LANES_GROUP) * 4 + j % 4]


@numba.njit(cache=True)
def panel_outputs_float(words, q, shifts, scales, ksum, zf, block, p0, p1, y):
    """avx2_jit.panel_outputs without AVX2's byte products (numba compiling for another
    target): the same sums from the lanes layout's bytes one at a time, the same float steps.
    shifts float32 [blocks, AVX2_LANES] (lane_shifts)."""
    doubles, per = q.shape[0] // 16, block // 16
    data = words.reshape(-1).view(np.uint8)
    zero = np.float32(0) * zf
    v = np.empty(AVX2_LANES, np.float32)
    for p in range(p0, p1):
        for j in range(PANEL):
            c = j % 4
            start = lanes_register(p, j, doubles)
            v[0], v[1], v[2], v[3] = ksum[p * PANEL + j] * zf, zero, zero, zero
            for b in range(shifts.shape[0]):
                for t in range(AVX2_LANES):
                    total = 0
                    for d in range(b * per, (b + 1) * per):
                        for rho in range(2):
                            byte = np.int32(data[start + d * 32 * LANES_GROUP + 2 * (4 * t + c) + rho])
                            i = 16 * d + 8 * rho + 2 * t
                            total += np.int32(q[i]) * (byte & 15) + np.int32(q[i + 1]) * (byte >> 4)
                    v[t] = fma32(np.float32(total) - shifts[b, t], lanes_scale(scales, p, b, j), v[t])
            y[p - p0, j] = (v[0] + v[1]) + (v[2] + v[3])


@numba.njit(cache=True, nogil=True)
def lane_operands(q, shifts, xs, chained):
    """A row's operands for avx2_jit's panel_outputs from its signed activations q int8 [K] (C
    order) and their lane_shifts: xs int8 [K/16, 2, 32] (lane_activations) and chained float32
    [blocks, 2, 8], the shifts as the chains hold them ([t0 x4, t1 x4], [t2 x4, t3 x4])."""
    lane_activations(q, xs)
    for b in range(shifts.shape[0]):
        for h in range(2):
            for i in range(8):
                chained[b, h, i] = shifts[b, 2 * h + i // 4]


@numba.njit(cache=True, nogil=True)
def panel_outputs_rows(words, xs, chained, scales, ksum, zf, block, p0, p1, y):
    """y [M, (p1 - p0) * PANEL]: panels p0..p1's outputs of every row before its scale and the
    bias (avx2_jit.panel_outputs), AVX2_ROWS rows at a time, then the rest one by one; xs, chained
    each row's lane_operands, zf float32 [M] the zero points."""
    m, per = xs.shape[0], block // 16
    r = 0
    while r + AVX2_ROWS <= m:
        panel_outputs_four(words, xs, chained, scales, ksum, zf, per, p0, p1, r, y)
        r += AVX2_ROWS
    while r < m:
        panel_outputs_one(words, xs, chained, scales, ksum, zf, per, p0, p1, r, y)
        r += 1


@numba.njit(cache=True, nogil=True)
def panel_outputs_bytes(words, q, shifts, scales, ksum, zf, block, p0, p1, y):
    """panel_outputs_float's outputs from AVX2's byte products (avx2_jit), the same arguments."""
    xs = np.empty((1, q.shape[0] // 16, 2, 32), np.int8)
    chained = np.empty((1, shifts.shape[0], 2, 8), np.float32)
    lane_operands(q, shifts, xs[0], chained[0])
    zfs = np.empty(1, np.float32)
    zfs[0] = zf
    panel_outputs_rows(words, xs, chained, scales, ksum, zfs, block, p0, p1, y.reshape((1, -1)))


# blockwise_panels_avx2(words, q, shifts, scales, ksum, zf, block, p0, p1, y): y [p1 - p0, PANEL] =
# panels p0..p1's outputs before the row's scale and the bias, in the "avx2" arithmetic: lanes from
# v0 = ksum * zp (`zf`, float32), v1..v3 = 0 * zp, one fma per block and lane in order, then
# (v0 + v1) + (v2 + v3); words in the lanes layout, q int8 [K] the signed activations (C order),
# shifts their lane_shifts. Chosen once, as _chains above.
blockwise_panels_avx2 = panel_outputs_bytes if AVX2 else panel_outputs_float
