"""The part of XNNPACK's qb4w decode mat-vec that either thread runs: the chains of a range of output
panels (imported only where numba is installed; layout and arithmetic in xnnpack_gemm.py).

The caller (xnnpack_gemm_jit.blockwise_matvec) runs the first half of a weight's panels and the
second core's thread (second_thread_jit) the second, each into its own buffer: a panel's outputs
depend on nothing else, so who computes it does not change a bit. Two arithmetics, as the CPU
decides (xnnpack_gemm.ARITHMETIC): "vnni" (blockwise_panels; with AVX512-VNNI the block sums come
from vpdpbusd (vnni_jit), elsewhere from float32 sums of the same integers, exact in any order)
and "avx2" (blockwise_panels_avx2: four lanes' float32 sums, exact, and their chains; its second
half runs through xnnpack_gemm_jit's C function).
"""
from __future__ import annotations

import numba
import numpy as np

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .fma_jit import fma32
from .quantized_jit import exact_nibble_sums
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
# xnnpack_gemm_jit's C function): its float steps are in one order, its sums exact.
AVX2_LANES = 4


@numba.njit(cache=True)
def lane_shifts(a, block, shifts):
    """shifts float32 [K / block, AVX2_LANES] = 8 * each block's sum of a over each lane's inputs
    (what the stored values' +8 adds to that lane's sums); a float32 [K] the signed q. Exact."""
    for b in range(shifts.shape[0]):
        s0 = s1 = s2 = s3 = np.float32(0)
        for i in range(b * block, (b + 1) * block, 8):
            s0 += a[i] + a[i + 1]
            s1 += a[i + 2] + a[i + 3]
            s2 += a[i + 4] + a[i + 5]
            s3 += a[i + 6] + a[i + 7]
        shifts[b, 0], shifts[b, 1] = np.float32(8) * s0, np.float32(8) * s1
        shifts[b, 2], shifts[b, 3] = np.float32(8) * s2, np.float32(8) * s3


_M4 = np.uint32(15)
_S4, _S8, _S12, _S16, _S20, _S24, _S28 = (np.uint32(4 * r) for r in range(1, 8))


@numba.njit(cache=True, fastmath=True)
def lane_nibble_sums(a, words, r0, r1, sums):
    """sums float32 [AVX2_LANES, PANEL]: lane j's sum over word rows r0..r1 of a[8r + 2j] and
    a[8r + 2j + 1] times their stored 4-bit values (words uint32 [K/8, PANEL], one panel). Every
    partial sum an integer below 2**24 (xnnpack_gemm.MAX_EXACT_BLOCK): exact in any order."""
    s0, s1, s2, s3 = sums[0], sums[1], sums[2], sums[3]
    s0[:] = 0
    s1[:] = 0
    s2[:] = 0
    s3[:] = 0
    for r in range(r0, r1):
        c = 8 * r
        x0, x1, x2, x3, x4, x5, x6, x7 = a[c], a[c + 1], a[c + 2], a[c + 3], a[c + 4], a[c + 5], a[c + 6], a[c + 7]
        row = words[r]
        for j in range(PANEL):
            v = row[j]
            s0[j] += x0 * np.float32(np.int32(v & _M4)) + x1 * np.float32(np.int32((v >> _S4) & _M4))
            s1[j] += x2 * np.float32(np.int32((v >> _S8) & _M4)) + x3 * np.float32(np.int32((v >> _S12) & _M4))
            s2[j] += x4 * np.float32(np.int32((v >> _S16) & _M4)) + x5 * np.float32(np.int32((v >> _S20) & _M4))
            s3[j] += x6 * np.float32(np.int32((v >> _S24) & _M4)) + x7 * np.float32(np.int32(v >> _S28))


@numba.njit(cache=True, nogil=True)
def blockwise_panels_avx2(a, shifts, words, scales, ksum, zf, block, p0, p1, y):
    """y [p1 - p0, PANEL] = panels p0..p1's outputs before the row's scale and the bias, in the
    "avx2" arithmetic: lanes from v0 = ksum * zp (`zf`, float32), v1..v3 = 0 * zp, one fma per
    block and lane in order, then (v0 + v1) + (v2 + v3). a float32 [K] the signed q; shifts its
    lane_shifts."""
    per = block // 8
    sums, v = np.empty((AVX2_LANES, PANEL), np.float32), np.empty((AVX2_LANES, PANEL), np.float32)
    zero = np.float32(0) * zf
    v0, v1, v2, v3 = v[0], v[1], v[2], v[3]
    for p in range(p0, p1):
        panel, panel_scales = words[p], scales[p]
        for j in range(PANEL):
            v0[j] = ksum[p * PANEL + j] * zf
            v1[j], v2[j], v3[j] = zero, zero, zero
        for b in range(shifts.shape[0]):
            lane_nibble_sums(a, panel, b * per, (b + 1) * per, sums)
            block_scales = panel_scales[b]
            for lane in range(AVX2_LANES):
                chain, lane_sums, shift = v[lane], sums[lane], shifts[b, lane]
                for j in range(PANEL):
                    chain[j] = fma32(lane_sums[j] - shift, block_scales[j], chain[j])
        out = y[p - p0]
        for j in range(PANEL):
            out[j] = (v0[j] + v1[j]) + (v2[j] + v3[j])
