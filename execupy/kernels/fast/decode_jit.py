"""Compiled steps of an LLM's decode: the residual add with the RMSNorm after it (or the norm
alone), and the rotary
embedding (imported only where numba is installed and loaded already); a prompt's rows run
the same arithmetic row after row (`add_rms_norm_rows`, `rope_swapped_positions`).

Their numpy forms (runtime/fusion.py: `_add_rms_norm_into`, `_rope_swapped_into`) are five to
eight ufunc calls on 576 floats, each about a microsecond of call for a few nanoseconds of
work; here each step is one call. The arithmetic is the numpy form's, operation for operation
in float32 and in the same order (the sum of squares added one element after another, as
the portable mean's cumsum adds; no fastmath, so no reassociation and no fused multiply-add),
so the results are bit-identical: tests/test_decode_kernels.py checks it.
"""
from __future__ import annotations

import numba
import numpy as np

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def add_rms_norm_row(a, b, eps, w, total, normed):
    """total = a + b; normed = total * (1 / sqrt(mean(total**2) + eps)) * w, all 1-D of one length."""
    n = total.shape[0]
    squares = np.float32(0)
    for i in range(n):
        t = a[i] + b[i]
        total[i] = t
        squares += t * t
    scale = np.float32(1) / np.sqrt(squares / np.float32(n) + eps)
    for i in range(n):
        normed[i] = total[i] * scale * w[i]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def add_rms_norm_rows(a, b, eps, w, total, normed):
    """add_rms_norm_row on each row of a, b, total, normed [R, n] (a prompt's tokens; a and b in any
    layout: a linear's result is read transposed); w [n]. Four rows at a time: their sums of
    squares are four chains of adds side by side, each in its own row's order (the bits of one
    row after another), where one row's chain waits on each add in turn."""
    rows, n = total.shape
    zero, r = np.float32(0), 0
    while r + 4 <= rows:
        a0, a1, a2, a3 = a[r], a[r + 1], a[r + 2], a[r + 3]
        b0, b1, b2, b3 = b[r], b[r + 1], b[r + 2], b[r + 3]
        t0, t1, t2, t3 = total[r], total[r + 1], total[r + 2], total[r + 3]
        s0 = s1 = s2 = s3 = zero
        for i in range(n):
            x0, x1, x2, x3 = a0[i] + b0[i], a1[i] + b1[i], a2[i] + b2[i], a3[i] + b3[i]
            t0[i], t1[i], t2[i], t3[i] = x0, x1, x2, x3
            s0 += x0 * x0
            s1 += x1 * x1
            s2 += x2 * x2
            s3 += x3 * x3
        for j, squares in enumerate((s0, s1, s2, s3)):
            scale = np.float32(1) / np.sqrt(squares / np.float32(n) + eps)
            row, out = total[r + j], normed[r + j]
            for i in range(n):
                out[i] = row[i] * scale * w[i]
        r += 4
    for q in range(r, rows):
        add_rms_norm_row(a[q], b[q], eps, w, total[q], normed[q])


@numba.njit(cache=True, nogil=True, error_model="numpy")
def rms_norm_rows(x, eps, w, normed):
    """normed = x * (1 / sqrt(mean(x**2) + eps)) * w per row of x, normed [R, n]: add_rms_norm_row's
    arithmetic without the add (a layer's first norm, after the embedding, and the final one)."""
    n = x.shape[1]
    for r in range(x.shape[0]):
        row, out = x[r], normed[r]
        squares = np.float32(0)
        for i in range(n):
            squares += row[i] * row[i]
        scale = np.float32(1) / np.sqrt(squares / np.float32(n) + eps)
        for i in range(n):
            out[i] = row[i] * scale * w[i]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def silu_of_exp(x, e):
    """e = x * (1 / (1 + e)), e holding exp(-x) made by numpy (numba's exp is libm's, which rounds
    otherwise): sigmoid's add and divide and silu's multiply in one pass, in float32, 1-D, in
    place (a separate output that might overlap e kept LLVM from vectorising the loop)."""
    one = np.float32(1)
    for i in range(x.shape[0]):
        e[i] = x[i] * (one / (one + e[i]))


@numba.njit(cache=True, nogil=True)
def rope_swapped_rows(x, cos, sin, out):
    """out[r] = x[r] * cos + swap_halves(x[r]) * sin for each row r of x [R, D]; cos, sin [D]."""
    half = x.shape[1] // 2
    for r in range(x.shape[0]):
        row, res = x[r], out[r]
        for i in range(half):
            lo, hi = row[i], row[i + half]
            res[i] = lo * cos[i] + hi * sin[i]
            res[i + half] = hi * cos[i + half] + lo * sin[i + half]


@numba.njit(cache=True, nogil=True)
def rope_swapped_positions(x, cos, sin, out):
    """rope_swapped_rows for a prompt: out[t] = rows x[t] [H, D] against position t's tables
    cos[t], sin[t] [D], for each t of x [T, H, D]."""
    for t in range(x.shape[0]):
        rope_swapped_rows(x[t], cos[t], sin[t], out[t])


@numba.njit(cache=True, nogil=True)
def rotate_pairs_rows(a, b, cos, sin, heads, out):
    """out[r, i] = (a*cos - b*sin, a*sin + b*cos) at [r, i], row r of a, b [R, D] against table
    row r // heads of cos, sin [R / heads, D]; out [R, D, 2] (kernels.fast.rotate_pairs)."""
    for r in range(a.shape[0]):
        c, s = cos[r // heads], sin[r // heads]
        for i in range(a.shape[1]):
            x, y = a[r, i], b[r, i]
            out[r, i, 0] = x * c[i] - y * s[i]
            out[r, i, 1] = x * s[i] + y * c[i]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def mean_rows(x, out):
    """out[r] = (x[r, 0] + x[r, 1] + ...: float32, added in index order from the first element, as
    ExecuTorch's portable mean and reduce.row_sums add) / n for x [R, n], n > 0, out [R]: an
    RMSNorm's mean that the program leaves as its own instruction. Eight rows side by side, eight independent chains of adds (one row's
    chain waits on each add's latency: a 113-token prompt's mean took 69 us through numpy, 15 here)."""
    rows, n = x.shape
    count = np.float32(n)
    r = 0
    while r + 8 <= rows:
        a, b, c, d = x[r], x[r + 1], x[r + 2], x[r + 3]
        e, f, g, h = x[r + 4], x[r + 5], x[r + 6], x[r + 7]
        s0, s1, s2, s3, s4, s5, s6, s7 = a[0], b[0], c[0], d[0], e[0], f[0], g[0], h[0]
        for j in range(1, n):
            s0 += a[j]
            s1 += b[j]
            s2 += c[j]
            s3 += d[j]
            s4 += e[j]
            s5 += f[j]
            s6 += g[j]
            s7 += h[j]
        out[r], out[r + 1], out[r + 2], out[r + 3] = s0 / count, s1 / count, s2 / count, s3 / count
        out[r + 4], out[r + 5], out[r + 6], out[r + 7] = s4 / count, s5 / count, s6 / count, s7 / count
        r += 8
    for i in range(r, rows):
        total = x[i, 0]
        for j in range(1, n):
            total += x[i, j]
        out[i] = total / count


def warm_up() -> None:
    """Run each compiled decode step (and its prompt form) once on tiny arrays, at load: numba
    reads a kernel's machine code from its disk cache at the kernel's first call with each
    signature (1-13 ms each, SmolLM2's first decode step after its plan was bound took 30 ms
    against 5; a read-only weight is a signature of its own: 2.3 ms in the second token), which
    then belongs to loading, not to the first generated tokens. Called where a program's linears
    bind their compiled mat-vecs."""
    from . import second_thread_jit as ST
    from .second_thread import SECOND_THREAD

    row, weight = np.ones(16, np.float32), np.ones(16, np.float32)
    weight.flags.writeable = False  # a program's constants are read-only: numba compiles that call apart
    add_rms_norm_row(row, row, np.float32(1e-5), weight, np.empty(16, np.float32), np.empty(16, np.float32))
    rms_norm_rows(row.reshape(1, 16), np.float32(1e-5), weight, np.empty((1, 16), np.float32))
    rows = np.ones((2, 16), np.float32)  # a prompt's forms
    for b in (rows, np.ones((16, 2), np.float32).T):  # a prompt's second summand: rows, or a linear's result transposed
        add_rms_norm_rows(rows, b, np.float32(1e-5), weight, np.empty((2, 16), np.float32), np.empty((2, 16), np.float32))
    rope_swapped_positions(np.ones((2, 1, 16), np.float32), rows, rows, np.empty((2, 1, 16), np.float32))
    rope_swapped_rows(np.ones((2, 16), np.float32), row, row, np.empty((2, 16), np.float32))
    rotate_pairs_rows(np.ones((2, 16), np.float32), np.ones((2, 16), np.float32), np.ones((1, 16), np.float32),
                      np.ones((1, 16), np.float32), 2, np.empty((2, 16, 2), np.float32))
    mean_rows(np.ones((1, 16), np.float32), np.empty(1, np.float32))
    silu_of_exp(row, np.ones(16, np.float32))
    from .attention_jit import causal_softmax_rows

    causal_softmax_rows(np.ones((1, 2, 16), np.float32), np.arange(2), np.float32(0.25), np.empty((1, 2), np.float32))
    SECOND_THREAD.load_loop()
    cache = np.ones((4, 1, 16), np.float32)
    SECOND_THREAD.call(ST.attention_halves, (np.ones((2, 16), np.float32), cache, cache, 3, np.float32(0.25), 512,
                                             np.empty((2, 16), np.float32)), False)
