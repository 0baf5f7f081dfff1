"""float32 fused multiply-add for numba kernels (imported only where numba is installed).

XNNPACK's GEMMs and vector math round a * b + c once (vfmadd). numba has no fma and, without
fast-math, LLVM never contracts a multiply and an add into one, so this emits `llvm.fma`: the
CPU's instruction where it has FMA (every AVX2 and AVX-512 CPU), vectorised with the loop;
elsewhere LLVM calls the C library's fmaf, which rounds once too. The numpy reference is
`xnnpack_gemm.fma32`.
"""
from __future__ import annotations

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
