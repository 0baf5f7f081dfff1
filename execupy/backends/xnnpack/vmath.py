"""XNNPACK's float32 elementwise approximations, reproduced in numpy.

XNNPACK does not compute sigmoid as 1 / (1 + exp(-x)) rounded once: on x86 with AVX-512
(what ExecuTorch 1.5.1 runs here) it uses a 32-entry table of 2**(i/32), a degree-2
polynomial and one division (its `f32-vsigmoid avx512f rr2_lut32_p2_perm2_scalef_div`
kernel), whose result can differ from the correctly rounded sigmoid in the last bit. A
last-bit difference matters downstream: the next dynamic int8 quantization can round an
activation the other way. The steps below are that kernel's, each rounded to float32;
its fused multiply-adds are computed in float64 (exact product) and rounded once to float32.
"""
from __future__ import annotations

import numpy as np

F32, F64 = np.float32, np.float64

_TABLE = np.array([float.fromhex(h) for h in (
    "0x1.000000p+0", "0x1.059B0Ep+0", "0x1.0B5586p+0", "0x1.11301Ep+0", "0x1.172B84p+0", "0x1.1D4874p+0",
    "0x1.2387A6p+0", "0x1.29E9E0p+0", "0x1.306FE0p+0", "0x1.371A74p+0", "0x1.3DEA64p+0", "0x1.44E086p+0",
    "0x1.4BFDAEp+0", "0x1.5342B6p+0", "0x1.5AB07Ep+0", "0x1.6247ECp+0", "0x1.6A09E6p+0", "0x1.71F75Ep+0",
    "0x1.7A1148p+0", "0x1.82589Ap+0", "0x1.8ACE54p+0", "0x1.93737Cp+0", "0x1.9C4918p+0", "0x1.A5503Cp+0",
    "0x1.AE89FAp+0", "0x1.B7F770p+0", "0x1.C199BEp+0", "0x1.CB720Ep+0", "0x1.D5818Ep+0", "0x1.DFC974p+0",
    "0x1.EA4AFAp+0", "0x1.F50766p+0")], F32)
_MAGIC_BIAS = F32(float.fromhex("0x1.800000p18"))
_LOG2E = F32(float.fromhex("0x1.715476p0"))
_MINUS_LN2_HI = F32(float.fromhex("-0x1.62E430p-1"))
_MINUS_LN2_LO = F32(float.fromhex("0x1.05C61p-29"))
_C2 = F32(0.5)
_C1 = F32(float.fromhex("0x1.0000F6p0"))


def _fma(a, b, c) -> np.ndarray:
    return (np.asarray(a, F64) * np.asarray(b, F64) + np.asarray(c, F64)).astype(F32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return _sigmoid(np.asarray(x, F32))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    z = -np.abs(x)
    n = _fma(z, _LOG2E, _MAGIC_BIAS)
    table = _TABLE[n.view(np.uint32) & 31]
    n = n - _MAGIC_BIAS
    t = _fma(n, _MINUS_LN2_HI, z)
    t = _fma(n, _MINUS_LN2_LO, t)
    p = _fma(t, _C2, _C1)
    t = t * table
    p = _fma(t, p, table)
    e = np.ldexp(p, np.floor(n).astype(np.int32)).astype(F32)  # scalef(p, n) = p * 2**floor(n)
    f = e / (e + F32(1))
    return np.where(np.signbit(x), f, F32(1) - f).astype(F32)


# ---------------------------------------------------------------- reciprocal square root
# XNNPACK's f32 rsqrt on AVX-512 starts from the CPU's 14-bit estimate (vrsqrt14ps) and takes
# one Newton-Raphson step, x1 = x0 - (a * (x0 * x0) - 1) * (0.5 * x0), each operation rounded
# to float32 (no fused multiply-add, on purpose). The estimate's bits are the CPU's own, so
# they are asked of the CPU itself through numba when it has AVX-512F; otherwise the
# correctly rounded 1 / sqrt stands in (it differs from XNNPACK's in the last bit at times).


def _compile_rsqrt14():
    try:
        import numba
        from llvmlite import binding, ir
        from numba import types
        from numba.extending import intrinsic
    except ImportError:
        return None
    if not binding.get_host_cpu_features().get("avx512f", False):
        return None

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
        out = np.empty_like(a)
        flat, res = a.ravel(), out.ravel()
        for i in range(flat.size):
            res[i] = _estimate(flat[i])
        return out

    return rsqrt14


_RSQRT14 = _compile_rsqrt14()


def rsqrt(x: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(x, F32)
    with np.errstate(all="ignore"):
        if _RSQRT14 is None:
            return (F32(1) / np.sqrt(a)).astype(F32)
        y = _RSQRT14(a)
        y = y - (a * (y * y) - F32(1)) * (F32(0.5) * y)
        return np.where(a == np.inf, F32(0), y).astype(F32)
