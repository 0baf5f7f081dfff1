"""The compiled decode attention behind `llama::custom_sdpa` (kernels/llm/kv_cache.py) for one
query token, imported only where numba is installed and already loaded.

One pass over the filled cache rows in memory order, every query head against its KV head's
row, then one pass accumulating the values: the numpy path reads each KV head's keys as a
strided view through two small batched products per block, which with the cache cold (the
weights just streamed through) cost SmolLM2 about 58 us a layer at position 150; this reads
the same 230 KB once, sequentially.

The arithmetic is the numpy path's (ExecuTorch's kernel's): scores scaled, per-block max,
exp(score - max) rounded from float64, sums in 16 lanes over 16-wide chunks then the lanes
in order then the rest, the running sum and output rescaled by exp(old max - new max), the
output times 1 / sum. Only the two products' summation orders differ (LLVM's vector lanes
over head_dim here, BLAS's own there), so results agree within float32 rounding.

The block's exp runs through `exp_below` (a float64 polynomial LLVM vectorises: about 1 ns an
element against 3.1-6.4 through libm's scalar exp), rounded once to float32 like libm's double:
the two doubles differ by an ulp or so, which changes the float32 only when they straddle one
of its rounding boundaries (none in 60 million tries; tests/kernels/test_decode_kernels.py).
"""
from __future__ import annotations

import math

import numba
import numpy as np

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .fma_jit import float64_from_bits
from .rows_jit import is_nan_bits, ordered_key

_LANES = 16

# exp_below's constants: ln 2 in two parts (k * _LN2_HI is exact for the k used), the Taylor
# coefficients 1/i! to degree 13 (|r| <= ln2 / 2: the first term left out is below 2**-57), and
# the point below which float32(exp(x)) is 0 (exp(-105) is a third of float32's smallest denormal).
_LN2_HI, _LN2_LO, _LOG2E = 6.93147180369123816490e-01, 1.90821492927058770002e-10, 1.44269504088896338700e+00
(_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9, _C10, _C11, _C12, _C13) = (
    1.0 / math.factorial(i) for i in range(14))
_EXP_FLOOR = -105.0


# "contract": fused multiply-adds (one rounding each, so the float64 is as close as before or closer).
@numba.njit(cache=True, nogil=True, fastmath={"contract"})
def exp_below(e, m, top):
    """e[t] = float32(exp(float64(e[t] - top))) for t < m (e[t] - top <= 0, or NaN): exp(x) =
    2**k * exp(r) with x = k ln2 + r, exp(r)'s polynomial by Estrin's scheme (pairs, then pairs
    of pairs with r**2, r**4, r**8: four multiply-adds deep where Horner's rule was thirteen,
    100 -> 56 us for 57,000 elements), every step a vector operation."""
    for t in range(m):
        x = np.float64(np.float32(e[t] - top))
        clipped = x if x >= _EXP_FLOOR else _EXP_FLOOR  # -inf to the floor; NaN too, put back below
        k = np.floor(clipped * _LOG2E + 0.5)
        r = (clipped - k * _LN2_HI) - k * _LN2_LO
        r2 = r * r
        r4 = r2 * r2
        low = (_C0 + _C1 * r) + (_C2 + _C3 * r) * r2 + ((_C4 + _C5 * r) + (_C6 + _C7 * r) * r2) * r4
        high = (_C8 + _C9 * r) + (_C10 + _C11 * r) * r2 + (_C12 + _C13 * r) * r4
        p = low + high * (r4 * r4)
        v = np.float32(p * float64_from_bits((np.int64(k) + 1023) << 52))  # k in [-152, 0]: a normal 2**k
        e[t] = v if x == x else np.float32(x)


# Reassociation lets LLVM vectorise the dot products (4.8 against 23 us for SmolLM2's 9 heads
# at position 150); BLAS sums these in an order of its own too. Nothing else here reassociates.
@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _scores(q, k, n, m, scale, h0, h1, scores):
    """scores[h - h0, t] = (q[h] . k[n + t, KV head of h]) * scale for t < m and query heads
    h0..h1, the rows in memory order."""
    heads, dim = q.shape
    rep = heads // k.shape[1]
    for t in range(m):
        for h in range(h0, h1):
            qr, kr = q[h], k[n + t, h // rep]
            s = np.float32(0)
            for d in range(dim):
                s += qr[d] * kr[d]
            scores[h - h0, t] = s * scale


@numba.njit(cache=True, nogil=True)
def _lane_sum(e, m):
    """e[:m] summed as ExecuTorch's kernel does (kv_cache._lane_sum): 16 lanes, each summed over
    the 16-wide chunks in turn, then the lanes one by one, then the rest. The lanes are sixteen
    scalars, which LLVM keeps in one vector register (a scratch array of 16 it had to load and
    store each chunk, unsure whether it overlapped e: a 113-token prompt's sums 92 -> 29 us)."""
    whole = m - m % _LANES
    total = np.float32(0)
    if whole:
        l0, l1, l2, l3, l4, l5, l6, l7 = e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]
        l8, l9, l10, l11, l12, l13, l14, l15 = e[8], e[9], e[10], e[11], e[12], e[13], e[14], e[15]
        for c in range(_LANES, whole, _LANES):
            l0 += e[c]
            l1 += e[c + 1]
            l2 += e[c + 2]
            l3 += e[c + 3]
            l4 += e[c + 4]
            l5 += e[c + 5]
            l6 += e[c + 6]
            l7 += e[c + 7]
            l8 += e[c + 8]
            l9 += e[c + 9]
            l10 += e[c + 10]
            l11 += e[c + 11]
            l12 += e[c + 12]
            l13 += e[c + 13]
            l14 += e[c + 14]
            l15 += e[c + 15]
        total = l0 + l1 + l2 + l3 + l4 + l5 + l6 + l7 + l8 + l9 + l10 + l11 + l12 + l13 + l14 + l15
    for i in range(whole, m):
        total += e[i]
    return total


@numba.njit(cache=True, nogil=True)
def _row_max(e, m, key):
    """max(e[:m]) as numpy's max takes it (NaN if there is one), over rows_jit.ordered_key's
    int32 keys, which LLVM vectorises (a float max that must keep NaN runs a branch an
    element); of 0.0 and -0.0 it gives 0.0 (e - max and exp(e - max) are the same either way).
    key int32 [1] scratch."""
    bits = e.view(np.int32)
    top, nan = np.int32(-2 ** 31), 0
    for t in range(m):
        b = bits[t]
        top = max(top, ordered_key(b))
        nan += is_nan_bits(b)
    key[0] = ordered_key(top)
    return np.float32(np.nan) if nan else key.view(np.float32)[0]


@numba.njit(cache=True, nogil=True)
def decode_attention_heads(q, k, v, kv_len, scale, block, h0, h1, out):
    """out [h1 - h0, D] = softmax(q k^T * scale) v for the query heads h0..h1 of one token q [H, D]
    against the first kv_len rows of the caches k, v [S, Hkv, D]; query head h reads KV head
    h // (H / Hkv). Each head's arithmetic is its own, so two threads taking a share of the
    heads (second_thread_jit.attention_halves) each give the bits one thread does."""
    dim = q.shape[1]
    rep = q.shape[0] // k.shape[1]
    heads = h1 - h0
    scores = np.empty((heads, block), np.float32)
    row_max = np.empty(heads, np.float32)
    row_sum = np.empty(heads, np.float32)
    acc = np.zeros((heads, dim), np.float32)
    key = np.empty(1, np.int32)
    for n in range(0, kv_len, block):
        m = min(block, kv_len - n)
        _scores(q, k, n, m, scale, h0, h1, scores)
        for h in range(heads):
            e = scores[h]
            new_max = _row_max(e, m, key)
            if n and (row_max[h] > new_max or row_max[h] != row_max[h]):  # np.maximum, NaN included
                new_max = row_max[h]
            exp_below(e, m, new_max)
            total = _lane_sum(e, m)
            if n == 0:
                row_sum[h] = total
            else:
                rescale = np.float32(math.exp(np.float64(np.float32(row_max[h] - new_max))))
                row_sum[h] = total + rescale * row_sum[h]
                for d in range(dim):
                    acc[h, d] *= rescale
            row_max[h] = new_max
        for t in range(m):
            for h in range(heads):
                w, row, a = scores[h, t], v[n + t, (h0 + h) // rep], acc[h]
                for d in range(dim):
                    a[d] += w * row[d]
    for h in range(heads):
        inv = np.float32(1) / row_sum[h]
        for d in range(dim):
            out[h, d] = acc[h, d] * inv


@numba.njit(cache=True, nogil=True)
def causal_softmax_rows(scores, positions, scale, sums):
    """A prompt's attention weights in place, as the numpy path makes them for one block of keys:
    scores [G, R, L] scaled, 0 past row r's position positions[r] (exp(-inf)), exp(score - row max) (the
    decode kernel's exp, rounded once from float64), and sums [G, R] the rows' lane sums of
    ExecuTorch's order over all L (masked keys add zeros). The numpy path made a dozen passes
    over the [G, R, L] scores with temporaries (SmolLM2's 113-token prompt: ~0.35 ms a layer)."""
    groups, rows, width = scores.shape
    key = np.empty(1, np.int32)
    for g in range(groups):
        for r in range(rows):
            e, seen = scores[g, r], min(positions[r] + 1, width)  # keys past the position weigh exp(-inf) = 0
            for t in range(seen):
                e[t] *= scale
            e[seen:] = 0
            exp_below(e, seen, _row_max(e, seen, key))
            sums[g, r] = _lane_sum(e, width)
