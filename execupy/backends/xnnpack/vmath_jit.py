"""The AVX-512 kernels of vmath.py's rsqrt, alone and closing an RMSNorm (imported only where numba is installed and the CPU
has AVX-512F): module-level functions, which numba's disk cache finds in the next process (as
closures they were compiled again in every process, 0.4 s in the first forward call)."""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...kernels.fast import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)


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
