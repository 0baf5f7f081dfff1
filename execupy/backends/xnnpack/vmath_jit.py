"""Compiled kernels of vmath.py (imported only where numba is installed): its sigmoid and GELU, and the
AVX-512 rsqrt, alone and closing an RMSNorm (called only where the CPU has AVX-512F). They are
module-level functions, which numba's disk cache finds in the next process (as closures they
were compiled again in every process, 0.4 s in the first forward call)."""
from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...kernels.fast import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from ...kernels.fast.fma_jit import float32_bits, float64_from_bits
from ...kernels.fast.fma_jit import fma32 as _fma
from .vmath import (_C1, _C2, _LOG2E, _MAGIC_BIAS, _MINUS_LN2_HI, _MINUS_LN2_LO, _TABLE, GELU_BOUND,
                    GELU_DENOMINATOR, GELU_NUMERATOR)

_A11, _A9, _A7, _A5, _A3, _A1 = GELU_NUMERATOR
_B10, _B8, _B6, _B4, _B2, _B0 = GELU_DENOMINATOR


@numba.njit(cache=True, inline="always", error_model="numpy")
def _sigmoid_of(v):
    # vmath._sigmoid of one element, each operation in float32 as there. n's bits pick the table
    # entry straight from the register, and 2**floor(n) is made from its exponent field (a
    # temporary of n's bits and a float64 table of powers were two more loads and a gather an
    # element: the sigmoid over [113, 1536] 253 -> 127 us)
    z = -abs(v)
    biased = _fma(z, _LOG2E, _MAGIC_BIAS)
    entry = _TABLE[float32_bits(biased) & np.uint32(31)]
    n = np.float32(biased - _MAGIC_BIAS)
    t = _fma(n, _MINUS_LN2_HI, z)
    t = _fma(n, _MINUS_LN2_LO, t)
    p = _fma(t, _C2, _C1)
    t = np.float32(t * entry)
    p = _fma(t, p, entry)
    # scalef(p, n) = p * 2**floor(n), exact in float64, rounded once; n <= 0, and from
    # floor(n) = -151 on, p * 2**floor(n) (p < 2) rounds to 0, as it does for -inf and
    # NaN (where numpy's ldexp gets INT_MIN and so does p * 0 here, p being finite or NaN)
    whole = np.floor(n)
    inside = whole >= -151.0
    power = float64_from_bits((np.int64(whole if inside else 0.0) + 1023) << 52)  # a normal float64
    e = np.float32(np.float64(p) * (power if inside else 0.0))
    f = np.float32(e / np.float32(e + np.float32(1)))
    return f if math.copysign(1.0, v) < 0 else np.float32(np.float32(1) - f)


# error_model="numpy": the division e / (e + 1) unchecked for zero (never zero: e + 1 >= 1, or
# NaN), which lets LLVM vectorise the loop: 3.8 -> 0.9 ns an element
@numba.njit(cache=True, error_model="numpy")
def sigmoid_into(x, out):
    for i in range(x.size):
        out[i] = _sigmoid_of(x[i])


@numba.njit(cache=True, error_model="numpy")
def swiglu_into(g, u, out):
    # A SwiGLU's Sigmoid, Multiply and Multiply nodes, (g * sigmoid(g)) * u, each result rounded to
    # float32 as its node's is, in one pass (out apart from g and u): one call for three nodes'
    # passes over a prompt's [T, 1536] (303 -> 140 us with the sigmoid's one pass and the products in it)
    for i in range(g.size):
        v = g[i]
        out[i] = np.float32(v * _sigmoid_of(v)) * u[i]


@numba.njit(cache=True, error_model="numpy")
def gelu_into(x, out):
    # vmath._gelu element by element, each operation in float32 as there
    f32, bound = np.float32, GELU_BOUND
    for i in range(x.size):
        v = x[i]
        c = bound if v > bound else (-bound if v < -bound else v)  # NaN stays NaN
        c2 = f32(c * c)
        p = _fma(c2, _fma(c2, _fma(c2, _fma(c2, _A11, _A9), _A7), _A5), _A3)
        q = _fma(c2, _fma(c2, _fma(c2, _fma(c2, _B10, _B8), _B6), _B4), _B2)
        p, q = _fma(c2, p, _A1), _fma(c2, q, _B0)
        out[i] = f32(f32(v * f32(0.5)) * f32(f32(f32(c * p) / q) + f32(1)))


@intrinsic
def _estimate(typingctx, a):
    if a != types.float32:
        return None

    def codegen(context, builder, sig, args):
        vec = ir.VectorType(ir.FloatType(), 4)
        fn = builder.module.declare_intrinsic("llvm.x86.avx512.rsqrt14.ss", fnty=ir.FunctionType(
            vec, [vec, vec, vec, ir.IntType(8)]))
        v = builder.insert_element(ir.Constant(vec, ir.Undefined), args[0], ir.Constant(ir.IntType(32), 0))
        r = builder.call(fn, [v, v, ir.Constant(vec, [0.0] * 4), ir.Constant(ir.IntType(8), -1)])
        return builder.extract_element(r, ir.Constant(ir.IntType(32), 0))

    return types.float32(types.float32), codegen


@numba.njit(cache=True)
def rsqrt14(a):
    # the CPU's 14-bit estimate of 1 / sqrt(a), a float32 [N]
    out = np.empty_like(a)
    for i in range(a.size):
        out[i] = _estimate(a[i])
    return out


@numba.njit(cache=True, inline="always")
def _rsqrt_newton_one(v):
    # rsqrt14 and vmath.newton_step for one float32, each operation in float32 as there
    one, half = np.float32(1), np.float32(0.5)
    y = _estimate(v)
    y = np.float32(y - np.float32(np.float32(v * np.float32(y * y)) - one) * np.float32(half * y))
    return np.float32(0) if v == np.inf else y


@numba.njit(cache=True)
def rsqrt_newton(a):
    # XNNPACK's rsqrt of a float32 [N]
    out = np.empty_like(a)
    for i in range(a.size):
        out[i] = _rsqrt_newton_one(a[i])
    return out


@numba.njit(cache=True, error_model="numpy")
def rms_tail_rows(mean, eps, x, w, out):
    # out[r] = (x[r] * rsqrt(mean[r] + eps)) * w for x, out [R, n], mean [R], w [n]: an RMSNorm's
    # last four XNNPACK nodes (Add, ReciprocalSquareRoot, Multiply, Multiply), each rounded as there
    for r in range(x.shape[0]):
        y = _rsqrt_newton_one(np.float32(mean[r] + eps))
        for i in range(x.shape[1]):
            out[r, i] = np.float32(x[r, i] * y) * w[i]
