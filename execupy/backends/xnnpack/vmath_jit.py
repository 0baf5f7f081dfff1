"""Compiled kernels of vmath.py (imported only where numba is installed): its sigmoids (XNNPACK's
AVX-512F kernel's steps and its AVX2 kernel's: vmath.X86_VARIANT picks the CPU's) and GELU, and
rsqrt, alone and closing an RMSNorm, from the CPU's own estimate (vrsqrt14ps, called only where
numba compiles for AVX-512F; vrsqrtps, only where it compiles for AVX). They are module-level
functions, which numba's disk cache finds in the next process (as closures they were compiled
again in every process, 0.4 s in the first forward call)."""
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
from .vmath import (_C1, _C2, _LOG2E, _MAGIC_BIAS, _MINUS_LN2, _MINUS_LN2_HI, _MINUS_LN2_LO, _P5,
                    _P5_DENORMAL_CUTOFF, _P5_MAGIC_BIAS, _TABLE, FLT_MIN, GELU_BOUND, GELU_DENOMINATOR,
                    GELU_NUMERATOR)

_A11, _A9, _A7, _A5, _A3, _A1 = GELU_NUMERATOR
_B10, _B8, _B6, _B4, _B2, _B0 = GELU_DENOMINATOR
_P5_C5, _P5_C4, _P5_C3, _P5_C2, _P5_C1 = _P5


@intrinsic
def _shifted_into_exponent(typingctx, n):
    """The float32 whose bits are n's shifted left by 23 (vmath._sigmoid_avx2's 2**k; numba's
    integer shift would widen the uint32)."""
    if n != types.float32:
        return None

    def codegen(context, builder, sig, args):
        bits = builder.bitcast(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(bits, ir.Constant(ir.IntType(32), 23)), ir.FloatType())

    return types.float32(types.float32), codegen


@intrinsic
def _negative_quiet_nan(typingctx, v):
    """vmath._negative_quiet_nan of one float32 (LLVM leaves a NaN's bits through the steps unsaid)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        bits = builder.or_(builder.bitcast(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 0x80400000))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(types.float32), codegen


@numba.njit(cache=True, inline="always")
def _ftz(v):
    # vmath._ftz of one float32: a subnormal v made a zero of its sign
    return np.float32(v * np.float32(0)) if abs(v) < FLT_MIN else v


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


@numba.njit(cache=True, inline="always", error_model="numpy")
def _sigmoid_avx2_of(v):
    # vmath._sigmoid_avx2 (XNNPACK's sigmoid on x86 with AVX2, no AVX-512F) of one element, each
    # operation in float32 as there
    f32 = np.float32
    z = -abs(v)
    n = _fma(z, _LOG2E, _P5_MAGIC_BIAS)
    s = _shifted_into_exponent(n)
    n = f32(n - _P5_MAGIC_BIAS)
    t = _fma(n, _MINUS_LN2, z)
    p = _fma(_fma(_fma(_fma(_P5_C5, t, _P5_C4), t, _P5_C3), t, _P5_C2), t, _P5_C1)
    e = _ftz(_fma(_ftz(f32(t * s)), p, s))  # denormals off, as XNNPACK runs it
    f = f32(e / f32(e + f32(1)))
    if z < _P5_DENORMAL_CUTOFF:
        f = f32(0)
    if v != v:
        return _negative_quiet_nan(v)
    return f if math.copysign(1.0, v) < 0 else f32(f32(1) - f)


@numba.njit(cache=True, error_model="numpy")
def sigmoid_avx2_into(x, out):
    for i in range(x.size):
        out[i] = _sigmoid_avx2_of(x[i])


@numba.njit(cache=True, error_model="numpy")
def swiglu_avx2_into(g, u, out):
    # swiglu_into with the AVX2 kernel's sigmoid
    for i in range(g.size):
        v = g[i]
        out[i] = np.float32(v * _sigmoid_avx2_of(v)) * u[i]


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
        out[i] = f32(_ftz(f32(v * f32(0.5))) * f32(f32(f32(c * p) / q) + f32(1)))


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


@intrinsic
def _estimate12(typingctx, a):
    # the CPU's 12-bit estimate of 1 / sqrt(a): vrsqrtps on 8 lanes (XNNPACK's avx_rsqrt kernel's
    # instruction), a in lane 0
    if a != types.float32:
        return None

    def codegen(context, builder, sig, args):
        vec = ir.VectorType(ir.FloatType(), 8)
        fn = builder.module.declare_intrinsic("llvm.x86.avx.rsqrt.ps.256", fnty=ir.FunctionType(vec, [vec]))
        v = builder.insert_element(ir.Constant(vec, [1.0] * 8), args[0], ir.Constant(ir.IntType(32), 0))
        return builder.extract_element(builder.call(fn, [v]), ir.Constant(ir.IntType(32), 0))

    return types.float32(types.float32), codegen


@numba.njit(cache=True)
def rsqrt12(a):
    # the CPU's 12-bit estimate of 1 / sqrt(a), a float32 [N]
    out = np.empty_like(a)
    for i in range(a.size):
        out[i] = _estimate12(a[i])
    return out


@numba.njit(cache=True, inline="always")
def _rsqrt_newton_one(v):
    # rsqrt14 and vmath.newton_step for one float32, each operation in float32 as there
    one, half = np.float32(1), np.float32(0.5)
    y = _estimate(v)
    y = np.float32(y - np.float32(np.float32(v * np.float32(y * y)) - one) * np.float32(half * y))
    return np.float32(0) if v == np.inf else y


@numba.njit(cache=True, inline="always")
def _rsqrt12_newton_one(v):
    # rsqrt12 and vmath.newton_step(denormals_off=True) for one float32 (XNNPACK's rsqrt on AVX
    # without AVX-512F: the same step from the 12-bit estimate, a and y * y flushed)
    one, half = np.float32(1), np.float32(0.5)
    a = _ftz(v)
    y = _estimate12(v)
    y = np.float32(y - np.float32(np.float32(a * _ftz(np.float32(y * y))) - one) * np.float32(half * y))
    return np.float32(0) if v == np.inf else y


@numba.njit(cache=True)
def rsqrt_newton(a):
    # XNNPACK's rsqrt of a float32 [N]
    out = np.empty_like(a)
    for i in range(a.size):
        out[i] = _rsqrt_newton_one(a[i])
    return out


@numba.njit(cache=True)
def rsqrt12_newton(a):
    # XNNPACK's rsqrt of a float32 [N] on AVX without AVX-512F
    out = np.empty_like(a)
    for i in range(a.size):
        out[i] = _rsqrt12_newton_one(a[i])
    return out


@numba.njit(cache=True, error_model="numpy")
def rms_tail_rows(mean, eps, x, w, out):
    # out[r] = (x[r] * rsqrt(mean[r] + eps)) * w for x, out [R, n], mean [R], w [n]: an RMSNorm's
    # last four XNNPACK nodes (Add, ReciprocalSquareRoot, Multiply, Multiply), each rounded as there
    for r in range(x.shape[0]):
        y = _rsqrt_newton_one(np.float32(mean[r] + eps))
        for i in range(x.shape[1]):
            out[r, i] = np.float32(x[r, i] * y) * w[i]


@numba.njit(cache=True, error_model="numpy")
def rms_tail_rows12(mean, eps, x, w, out):
    # rms_tail_rows with the rsqrt of AVX without AVX-512F
    for r in range(x.shape[0]):
        y = _rsqrt12_newton_one(np.float32(mean[r] + eps))
        for i in range(x.shape[1]):
            out[r, i] = np.float32(x[r, i] * y) * w[i]
