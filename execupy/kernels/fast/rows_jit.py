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
def _block_sum(a, lo, n):
    # numpy's pairwise_sum of a[lo:lo + n] for n <= 128, float32 throughout (eight running sums in
    # scalars: LLVM keeps them in registers; as an array of 8 they ran 2x slower)
    f32 = np.float32
    if n < 8:
        res = f32(0)
        for i in range(n):
            res = f32(res + a[lo + i])
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    for j in range(lo + 8, lo + n - n % 8, 8):
        r0, r1, r2, r3 = f32(r0 + a[j]), f32(r1 + a[j + 1]), f32(r2 + a[j + 2]), f32(r3 + a[j + 3])
        r4, r5, r6, r7 = f32(r4 + a[j + 4]), f32(r5 + a[j + 5]), f32(r6 + a[j + 6]), f32(r7 + a[j + 7])
    res = f32(f32(f32(r0 + r1) + f32(r2 + r3)) + f32(f32(r4 + r5) + f32(r6 + r7)))
    for i in range(lo + n - n % 8, lo + n):
        res = f32(res + a[i])
    return res


@numba.njit(cache=True)
def row_sums(x, stack, sums):
    # numpy's sum of each row of x [R, n] (its pairwise summation, added to the reduction's initial
    # 0), into sums[0] (sums float32 [64, R] and stack int64 [3, 64]: the caller's scratch). Longer than 128, a sum is that of the two
    # halves (split at half the length rounded down to a multiple of 8); the halves are walked with
    # an explicit stack (numba's disk cache and recursive functions do not mix: a recursive kernel
    # loaded from the cache crashed). The split depends on n alone, so all rows walk it together.
    n = x.shape[1]
    half = n // 2 - (n // 2) % 8
    if n - half <= 128:  # rows up to 263 long: one block or two, without the stack's bookkeeping (2x faster)
        for r in range(x.shape[0]):
            sums[0, r] = np.float32(np.float32(0) + (_block_sum(x[r], 0, n) if n <= 128 else np.float32(
                _block_sum(x[r], 0, half) + _block_sum(x[r], half, n - half))))
        return
    los, lens, stage = stack[0], stack[1], stack[2]
    los[0], lens[0], stage[0] = 0, n, 0
    depth, count = 1, 0
    while depth:
        top = depth - 1
        lo, m = los[top], lens[top]
        half = m // 2 - (m // 2) % 8
        if m <= 128:
            for r in range(x.shape[0]):
                sums[count, r] = _block_sum(x[r], lo, m)
            count += 1
            depth -= 1
        elif stage[top] < 2:  # push the left half, then the right half
            stage[top] += 1
            los[depth], lens[depth], stage[depth] = (lo, half, 0) if stage[top] == 1 else (lo + half, m - half, 0)
            depth += 1
        else:  # both halves summed: left + right
            for r in range(x.shape[0]):
                sums[count - 2, r] = np.float32(sums[count - 2, r] + sums[count - 1, r])
            count -= 1
            depth -= 1
    for r in range(x.shape[0]):
        sums[0, r] = np.float32(np.float32(0) + sums[0, r])


@numba.njit(cache=True, error_model="numpy")
def layer_norm_rows(x, weight, bias, eps, out, mean, rstd):
    # x, out [R, n]; weight, bias [n] (a zero-length array: none); mean, rstd [R]
    f32 = np.float32
    rows, n = x.shape
    count, one = f32(n), f32(1)
    squares = np.empty((rows, n), np.float32)
    stack, sums = np.empty((3, 64), np.int64), np.empty((64, rows), np.float32)
    row_sums(x, stack, sums)
    for r in range(rows):
        mean[r] = f32(sums[0, r] / count)
    for r in range(rows):
        m = mean[r]
        for i in range(n):
            c = f32(x[r, i] - m)
            out[r, i] = c
            squares[r, i] = f32(c * c)
    row_sums(squares, stack, sums)
    for r in range(rows):
        var = f32(sums[0, r] / count)
        s = f32(one / np.sqrt(f32(var + eps)))
        rstd[r] = s
        if weight.size and bias.size:  # one loop per case: LLVM vectorises each
            for i in range(n):
                out[r, i] = f32(f32(f32(out[r, i] * s) * weight[i]) + bias[i])
        elif weight.size:
            for i in range(n):
                out[r, i] = f32(f32(out[r, i] * s) * weight[i])
        elif bias.size:
            for i in range(n):
                out[r, i] = f32(f32(out[r, i] * s) + bias[i])
        else:
            for i in range(n):
                out[r, i] = f32(out[r, i] * s)


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
    stack, sums = np.empty((3, 64), np.int64), np.empty((64, rows), np.float32)
    row_sums(e, stack, sums)
    for r in range(rows):
        s = sums[0, r]
        for i in range(n):
            e[r, i] = np.float32(e[r, i] / s)
