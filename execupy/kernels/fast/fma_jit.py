"""float32 fused multiply-add for numba kernels (imported only where numba is installed).

XNNPACK's GEMMs and vector math round a * b + c once (vfmadd). numba has no fma and, without
fast-math, LLVM never contracts a multiply and an add into one, so this emits `llvm.fma`: the
CPU's instruction where it has FMA (every AVX2 and AVX-512 CPU), vectorised with the loop;
elsewhere LLVM calls the C library's fmaf, which rounds once too. The numpy reference is
`xnnpack_gemm.fma32`.

Beside it, the two bit casts the exp-like kernels need (numba has neither): a float64 made from
its bits (2**k from an exponent field) and a float32's bits (a table index from a magic-bias sum).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c rounded once, all three float32."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def float64_from_bits(typingctx, bits):
    """The float64 whose bits are the int64 `bits` (2**k from its exponent field)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@intrinsic
def float32_bits(typingctx, x):
    """The uint32 bits of the float32 x (as numpy's view of a float32 array as uint32)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen
