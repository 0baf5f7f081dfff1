"""Layer norm and softmax over float32 rows, compiled, with numpy's bits (imported only where numba is).

The portable `aten::native_layer_norm.out` is seven numpy passes over the tensor (mean, x - mean,
its square, their mean, the scaling, weight, bias) and softmax five, each with a temporary of the
tensor's size; a BERT-like encoder runs nine norms and four softmaxes per forward call. Here
every value is computed with the operations numpy performs, in its order, each rounded to
float32 where numpy rounds it, in fewer passes and no temporaries:

* numpy sums a float32 row pairwise (`pairwise_sum` in its loops): rows shorter than 8 from
  left to right, up to 128 in eight interleaved partial sums added as ((0+1)+(2+3))+((4+5)+(6+7))
  then the leftover tail, longer rows split in two at half the length rounded down to a multiple
  of 8; the reduction then adds that sum to its initial 0.
* `np.mean` divides that sum by the count in float32; `1.0 / np.sqrt(var + eps)` is float32 too.
* A max is exact whatever the order (NaN wins, as in `np.max`); softmax's exp stays numpy's
  (its own SIMD expf, which LLVM's would not match), called between the two kernels here.

tests/kernels/test_fast_rows.py compares the two paths bit for bit over row lengths 1 .. 300 and
some longer ones.
"""
from __future__ import annotations

import numba
import numpy as np

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)


@numba.njit(cache=True, inline="always")
def _block_sum(a, lo, n, squared):
    # numpy's pairwise_sum of a[lo:lo + n] (or of their float32 squares, `squared` a literal the
    # inlined code folds) for n <= 128, float32 throughout: eight running sums in scalars (LLVM
    # keeps them in registers; as an array of 8 they ran 2x slower). Unsigned indices: with signed
    # ones numba wraps each of the eight loads for a negative index, and the loop ran 2x slower.
    f32, u = np.float32, np.uint64
    lo, n = u(lo), u(n)
    if n < u(8):
        res = f32(0)
        for i in range(lo, lo + n):
            v = a[u(i)]
            res = f32(res + (f32(v * v) if squared else v))
        return res
    v0, v1, v2, v3 = a[lo], a[lo + u(1)], a[lo + u(2)], a[lo + u(3)]
    v4, v5, v6, v7 = a[lo + u(4)], a[lo + u(5)], a[lo + u(6)], a[lo + u(7)]
    if squared:
        v0, v1, v2, v3 = f32(v0 * v0), f32(v1 * v1), f32(v2 * v2), f32(v3 * v3)
        v4, v5, v6, v7 = f32(v4 * v4), f32(v5 * v5), f32(v6 * v6), f32(v7 * v7)
    r0, r1, r2, r3, r4, r5, r6, r7 = v0, v1, v2, v3, v4, v5, v6, v7
    end = lo + n - n % u(8)
    j = lo + u(8)
    while j < end:
        v0, v1, v2, v3 = a[j], a[j + u(1)], a[j + u(2)], a[j + u(3)]
        v4, v5, v6, v7 = a[j + u(4)], a[j + u(5)], a[j + u(6)], a[j + u(7)]
        if squared:
            v0, v1, v2, v3 = f32(v0 * v0), f32(v1 * v1), f32(v2 * v2), f32(v3 * v3)
            v4, v5, v6, v7 = f32(v4 * v4), f32(v5 * v5), f32(v6 * v6), f32(v7 * v7)
        r0, r1, r2, r3 = f32(r0 + v0), f32(r1 + v1), f32(r2 + v2), f32(r3 + v3)
        r4, r5, r6, r7 = f32(r4 + v4), f32(r5 + v5), f32(r6 + v6), f32(r7 + v7)
        j += u(8)
    res = f32(f32(f32(r0 + r1) + f32(r2 + r3)) + f32(f32(r4 + r5) + f32(r6 + r7)))
    while j < lo + n:
        v = a[j]
        res = f32(res + (f32(v * v) if squared else v))
        j += u(1)
    return res


@numba.njit(cache=True)
def pairwise_plan(n):
    # numpy's pairwise summation of n values as a program: rows (lo, length) in the order numpy
    # adds them, a block of <= 128 values summed (length > 0), or the two sums last made added
    # (length 0). Longer than 128, a sum is that of its two halves, split at half the length
    # rounded down to a multiple of 8. Made once per call, walked for each row (numba's disk cache
    # and recursive functions do not mix: a recursive kernel loaded from the cache crashed).
    plan = np.zeros((n // 28 + 4, 2), np.int64)  # leaves of a split hold >= 56 values
    depth = 64
    los, lens, stage = np.empty(depth, np.int64), np.empty(depth, np.int64), np.empty(depth, np.int64)
    los[0], lens[0], stage[0] = 0, n, 0
    top, count = 1, 0
    while top:
        lo, m = los[top - 1], lens[top - 1]
        half = m // 2 - (m // 2) % 8
        if m <= 128:
            plan[count, 0], plan[count, 1] = lo, m
            count += 1
            top -= 1
        elif stage[top - 1] < 2:  # the left half, then the right half
            stage[top - 1] += 1
            los[top], lens[top], stage[top] = (lo, half, 0) if stage[top - 1] == 1 else (lo + half, m - half, 0)
            top += 1
        else:  # both halves summed: left + right
            plan[count, 0], plan[count, 1] = lo, 0
            count += 1
            top -= 1
    return plan[:count]


@numba.njit(cache=True, inline="always")
def _row_sum(a, plan, partial, squared):
    # numpy's sum of row a (or of its squares) as `plan` adds it, added to the reduction's initial
    # 0; partial is the caller's float32 scratch (one slot per level of the plan)
    f32 = np.float32
    top = 0
    for k in range(plan.shape[0]):
        if plan[k, 1]:
            partial[top] = _block_sum(a, plan[k, 0], plan[k, 1], squared)
            top += 1
        else:
            partial[top - 2] = f32(partial[top - 2] + partial[top - 1])
            top -= 1
    return f32(f32(0) + partial[0])


@numba.njit(cache=True, error_model="numpy")
def layer_norm_rows(x, weight, bias, eps, out, mean, rstd):
    # x, out [R, n]; weight, bias [n] (a zero-length array: none); mean, rstd [R]. Row by row, so
    # the row stays in L1 across its four passes (sum, centre, sum of squares, scale).
    f32 = np.float32
    rows, n = x.shape
    count, one = f32(n), f32(1)
    plan, partial = pairwise_plan(n), np.empty(64, np.float32)
    for r in range(rows):
        xr, o = x[r], out[r]
        m = f32(_row_sum(xr, plan, partial, False) / count)
        for i in range(n):
            o[i] = f32(xr[i] - m)
        var = f32(_row_sum(o, plan, partial, True) / count)
        s = f32(one / np.sqrt(f32(var + eps)))
        mean[r], rstd[r] = m, s
        if weight.size and bias.size:  # one loop per case: LLVM vectorises each
            for i in range(n):
                o[i] = f32(f32(f32(o[i] * s) * weight[i]) + bias[i])
        elif weight.size:
            for i in range(n):
                o[i] = f32(f32(o[i] * s) * weight[i])
        elif bias.size:
            for i in range(n):
                o[i] = f32(f32(o[i] * s) + bias[i])
        else:
            for i in range(n):
                o[i] = f32(o[i] * s)


MAGNITUDE, INF_BITS = np.int32(0x7FFFFFFF), np.int32(0x7F800000)


@numba.njit(cache=True, inline="always")
def ordered_key(b):
    # The int32 bits b of a float32 -> an int32 ordered as the floats are (sign-magnitude turned
    # two's complement), and back: the map is its own inverse. LLVM vectorises an integer min/max,
    # not a float one that must keep or skip NaN (3x slower). -0.0's key is just below 0.0's.
    return b ^ ((b >> np.int32(31)) & MAGNITUDE)


@numba.njit(cache=True, inline="always")
def is_nan_bits(b):
    return (b & MAGNITUDE) > INF_BITS


@numba.njit(cache=True, error_model="numpy")
def subtract_row_max(x, out):
    # out[r] = x[r] - max(x[r]) for x, out [R, n], n > 0 (np.max's value: NaN if the row has one).
    # The max is taken over ordered_key's keys, the NaNs counted apart. Of 0.0 and -0.0 the key
    # picks 0.0; x - m is the same then.
    rows, n = x.shape
    bits = x.view(np.int32)
    back = np.empty(1, np.int32)
    value = back.view(np.float32)
    for r in range(rows):
        top, nan = np.int32(-2 ** 31), 0
        for i in range(n):
            b = bits[r, i]
            top = max(top, ordered_key(b))
            nan += is_nan_bits(b)
        back[0] = ordered_key(top)
        m = np.float32(np.nan) if nan else value[0]
        for i in range(n):
            out[r, i] = np.float32(x[r, i] - m)


@numba.njit(cache=True, error_model="numpy")
def divide_by_row_sums(e):
    # e[r] /= sum(e[r]) in place, the sum numpy's (pairwise, float32), e [R, n]
    rows, n = e.shape
    plan, partial = pairwise_plan(n), np.empty(64, np.float32)
    for r in range(rows):
        row = e[r]
        s = _row_sum(row, plan, partial, False)
        for i in range(n):
            row[i] = np.float32(row[i] / s)
