"""XNNPACK's float32 elementwise approximations (sigmoid, GELU, rsqrt), reproduced in numpy.

XNNPACK does not compute sigmoid as 1 / (1 + exp(-x)) rounded once, and which approximation
it runs depends on the CPU (ExecuTorch 1.5.1's XNNPACK, src/configs/unary-elementwise-config.c):
on x86 with AVX-512F its `f32-vsigmoid avx512f rr2_lut32_p2_perm2_scalef_div` kernel (a
32-entry table of 2**(i/32), a degree-2 polynomial, one division); on x86 with AVX2 (and FMA)
but no AVX-512F its `avx2 rr1_p5_div` kernel (a degree-5 polynomial, no table). Either result
can differ from the correctly rounded sigmoid, and from each other, in the last bit. A
last-bit difference matters downstream: the next dynamic int8 quantization can round an
activation the other way. The steps below are those kernels', each rounded to float32; their
fused multiply-adds are rounded once (kernels/fast/xnnpack_gemm.fma32). `SIGMOID_KERNEL` names
the one this CPU gets (other CPUs, x86 without AVX2 or not x86, get the AVX-512 steps: not
XNNPACK's kernel there).

XNNPACK runs every operator with denormals off (src/operator-run.c passes pthreadpool
PTHREADPOOL_FLAG_DISABLE_DENORMALS: MXCSR's FTZ and DAZ on x86, whatever the ISA), so a
subnormal result of a step is +-0 and a subnormal input reads as +-0. The AVX2 sigmoid and
rsqrt and the GELU below flush where that changes their result (checked against ExecuTorch on
an AVX2 CPU, over all float32 at a stride and the edge cases); the AVX-512 sigmoid and rsqrt
keep the steps verified on Intel, without those flushes.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ...kernels.fast import quantized
from ...kernels.fast.xnnpack_gemm import cpu_flags
from ...kernels.fast.xnnpack_gemm import fma32 as _fma

F32 = np.float32

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
# the AVX2 kernel's: its magic bias leaves 127 + round(z / ln 2) in n's low bits (2**that from
# a shift into the exponent field), one-constant reduction by ln 2, a degree-5 polynomial, and
# the cutoff below which its result is flushed to 0 (z < -87.34: e**z would be subnormal)
_P5_MAGIC_BIAS = F32(float.fromhex("0x1.8000FEp23"))
_MINUS_LN2 = F32(float.fromhex("-0x1.62E430p-1"))
_P5 = tuple(F32(float.fromhex(h)) for h in ("0x1.0F9F9Cp-7", "0x1.573A1Ap-5", "0x1.555A80p-3",
                                              "0x1.FFFDC6p-2", "0x1.FFFFF6p-1"))  # c5 .. c1
_P5_DENORMAL_CUTOFF = F32(float.fromhex("-0x1.5D589Ep+6"))
FLT_MIN = F32(2.0 ** -126)  # the least normal float32: below it, XNNPACK's FTZ/DAZ read and write +-0


def _ftz(v: np.ndarray) -> np.ndarray:
    """v with its subnormal values made zeros of their sign, as MXCSR.FTZ makes a step's result
    (and DAZ reads a step's input). Where the exact value rounds to FLT_MIN only through the
    subnormal spacing the CPU would flush it too (tininess after rounding); no step flushed here
    can land there."""
    return np.where(np.abs(v) < FLT_MIN, v * F32(0), v)


def _negative_quiet_nan(x: np.ndarray) -> np.ndarray:
    """x's NaN with its sign and quiet bits set: what the AVX2 sigmoid gives for a NaN x (its z =
    x | -0.0 carried through every step)."""
    return (x.view(np.uint32) | np.uint32(0x80400000)).view(F32)


def _x86_variant(flags: Optional[frozenset]) -> str:
    """"avx2" on an x86 CPU with AVX2 and FMA but no AVX-512F (XNNPACK's AVX2/FMA3 kernels run
    there), else "avx512f" (its AVX-512 kernels; the stand-in where the CPU is unknown)."""
    if flags is not None and "avx512f" not in flags and {"avx2", "fma"} <= flags:
        return "avx2"
    return "avx512f"


X86_VARIANT = _x86_variant(cpu_flags())
SIGMOID_KERNEL = {"avx512f": "f32-vsigmoid avx512f_rr2_lut32_p2_perm2_scalef_div",
                  "avx2": "f32-vsigmoid avx2_rr1_p5_div"}[X86_VARIANT]


def _elementwise(compiled: Optional[Callable], steps: Callable[[np.ndarray], np.ndarray], x) -> np.ndarray:
    """steps(x) on float32 x: through `compiled(flat x, flat out)` where numba is, else in numpy."""
    x = np.asarray(x, F32)
    if compiled is not None and x.ndim:
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        compiled(x.reshape(-1), out.reshape(-1))
        return out
    with np.errstate(all="ignore"):
        return steps(x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return _elementwise(_SIGMOID, _sigmoid, x)


def _sigmoid_avx512(x: np.ndarray) -> np.ndarray:
    """XNNPACK's sigmoid on x86 with AVX-512F (rr2_lut32_p2_perm2_scalef_div)."""
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


def _sigmoid_avx2(x: np.ndarray) -> np.ndarray:
    """XNNPACK's sigmoid on x86 with AVX2 and FMA, no AVX-512F (avx2_rr1_p5_div): e = e**z for
    z = -|x| as 2**k (k = round(z / ln 2), shifted into an exponent field) times a degree-5
    polynomial in t = z - k ln 2, f = e / (e + 1), flushed to 0 below the cutoff, 1 - f for x >= +0.
    Denormals off: t * 2**k and e flushed (for k <= -125 t * 2**k is always subnormal, so e = 2**k:
    sigmoid(-87.3) is FLT_MIN); t is subnormal only where x is (then t * 2**k = t flushes anyway),
    and f >= FLT_MIN or 0."""
    z = -np.abs(x)
    n = _fma(z, _LOG2E, _P5_MAGIC_BIAS)
    s = (n.view(np.uint32) << np.uint32(23)).view(F32)  # the exponent field's low bits: 2**k where k >= -126
    n = n - _P5_MAGIC_BIAS
    t = _fma(n, _MINUS_LN2, z)
    c5, c4, c3, c2, c1 = _P5
    p = _fma(c5, t, c4)
    p = _fma(p, t, c3)
    p = _fma(p, t, c2)
    p = _fma(p, t, c1)
    t = _ftz(t * s)
    e = _ftz(_fma(t, p, s))
    f = e / (e + F32(1))
    f = np.where(z < _P5_DENORMAL_CUTOFF, F32(0), f)  # NaN compares false: it stays
    f = np.where(np.signbit(x), f, F32(1) - f)
    return np.where(np.isnan(x), _negative_quiet_nan(x), f).astype(F32)


_sigmoid = _sigmoid_avx2 if X86_VARIANT == "avx2" else _sigmoid_avx512


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """A SwiGLU's Sigmoid, Multiply and Multiply nodes: (g * sigmoid(g)) * u, each node's result
    rounded to float32 (a product's operands in either order give the same value), in one
    compiled call where numba is and g and u have one shape, else node by node in numpy."""
    g, u = np.require(g, F32, "C"), np.require(u, F32, "C")
    out = np.empty(g.shape, F32)
    compiled = swiglu_into(g, u, out)
    if compiled is not None:
        compiled()
        return out
    with np.errstate(all="ignore"):
        return np.multiply(np.multiply(g, sigmoid(g)), u)


def swiglu_into(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> Optional[Callable[[], None]]:
    """swiglu's compiled loop as a call on fixed arrays writing into out (float32 arrays of one
    shape in C order, out apart from g and u), or None where it does not fit."""
    arrays = (g, u, out)
    if _SWIGLU is None or not all(a.dtype == F32 and a.shape == g.shape and a.flags.c_contiguous for a in arrays) \
            or not g.ndim or np.may_share_memory(out, g) or np.may_share_memory(out, u):
        return None
    flat_g, flat_u, flat_out, kernel = g.reshape(-1), u.reshape(-1), out.reshape(-1), _SWIGLU

    def swiglu_into_out() -> None:  # (the loop's own return value dropped: a bound call returns None)
        kernel(flat_g, flat_u, flat_out)

    return swiglu_into_out


# ---------------------------------------------------------------- GELU
# XNNPACK's f32 GELU (its `f32-vgelu rational_12_10_div` kernels) is x/2 * (1 + r(x)) with r a
# rational interpolant of erf(x / sqrt 2), an odd degree-11 numerator over an even degree-10
# denominator in x, evaluated by Horner's rule in fused multiply-adds on x clamped to +-5.16
# (where r reaches +-1). Its result is not the correctly rounded GELU; repeating its steps
# gives ExecuTorch's XNNPACK bits, and a compiled loop of them is ~10x cheaper than the
# float64 erf the portable kernel rounds once.
GELU_BOUND = F32(5.1638283730e+00)  # the bound where the CPU has FMA (x86-64 with AVX2 or AVX-512)
GELU_NUMERATOR = tuple(F32(c) for c in (4.5835321316e-08, 1.2609783880e-05, 3.2973114867e-04, 9.3065137044e-03,
                                        6.6972173750e-02, 7.9788452387e-01))  # x^11 .. x^1
GELU_DENOMINATOR = tuple(F32(c) for c in (1.1988805682e-06, 7.2267655923e-05, 1.8622842617e-03, 2.8431978077e-02,
                                          2.5060352683e-01, 1.0))  # x^10 .. x^0


def gelu(x: np.ndarray) -> np.ndarray:
    """XNNPACK's float32 GELU of x (any shape), compiled where numba is, else in numpy."""
    return _elementwise(_GELU, _gelu, x)


def _gelu(x: np.ndarray) -> np.ndarray:
    c = np.clip(x, -GELU_BOUND, GELU_BOUND)  # NaN stays NaN, as in XNNPACK's min/max order
    c2 = c * c
    p, q = GELU_NUMERATOR[0], GELU_DENOMINATOR[0]
    for a, b in zip(GELU_NUMERATOR[1:], GELU_DENOMINATOR[1:]):
        p, q = _fma(c2, p, a), _fma(c2, q, b)
    # denormals off: x / 2 below FLT_MIN is +-0 (so GELU(x) is +-0 for |x| < 2**-125, a subnormal
    # x included); a subnormal c, c * c or c * p leaves the rest as it is (1 + r(x) = 1 there)
    return (_ftz(x * F32(0.5)) * ((c * p) / q + F32(1))).astype(F32)


def _compiled(name: str) -> Optional[Callable]:
    """vmath_jit's loop `name` (each node's steps element by element: a SwiGLU's sigmoid took 40 us
    in numpy's dozen passes), or None without numba or with EXECUPY_NUMBA=0. The loops are module
    level, where numba's disk cache finds them in the next process."""
    if quantized.BACKEND != "numba":
        return None
    from . import vmath_jit

    return getattr(vmath_jit, name)


# here, below the constants vmath_jit imports; the sigmoid's loops are the CPU's variant's
_SIGMOID = _compiled("sigmoid_avx2_into" if X86_VARIANT == "avx2" else "sigmoid_into")
_SWIGLU = _compiled("swiglu_avx2_into" if X86_VARIANT == "avx2" else "swiglu_into")
_GELU = _compiled("gelu_into")


def compiled_into(fn: Callable, x: np.ndarray, out: np.ndarray) -> Optional[Callable[[], None]]:
    """For sigmoid or gelu with a compiled loop, and x and out float32 of one shape in C order, apart:
    a call writing fn(x) into out (the compiled loop on the flat arrays); else None."""
    compiled = _SIGMOID if fn is sigmoid else _GELU if fn is gelu else None
    if compiled is None or not (x.dtype == out.dtype == F32 and x.shape == out.shape and x.ndim
                                and x.flags.c_contiguous and out.flags.c_contiguous) or np.may_share_memory(x, out):
        return None
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)

    def compiled_into_out() -> None:  # (the loop returns out: a bound call returns None)
        compiled(flat_x, flat_out)

    return compiled_into_out

# ---------------------------------------------------------------- reciprocal square root
# XNNPACK's f32 rsqrt starts from the CPU's estimate and takes one Newton-Raphson step,
# x1 = x0 - (a * (x0 * x0) - 1) * (0.5 * x0), each operation rounded to float32 (no fused
# multiply-add, on purpose; denormals off: newton_step), and gives 0 where a is +inf. The
# estimate is the CPU's:
# vrsqrt14ps (14 bits) on x86 with AVX-512F (its `avx512f_rsqrt` kernel), vrsqrtps (12 bits,
# from the CPU maker's own table: its bits can differ between makers) on x86 with AVX but no
# AVX-512F (its `avx_rsqrt` kernel). So the estimate is asked of the CPU itself, through numba, where numba
# compiles for a CPU with that instruction; otherwise (no numba, or another numba target) the
# correctly rounded 1 / sqrt stands in (it differs from XNNPACK's in the last bit at times).


def _compile_rsqrt():
    try:
        from ...kernels.fast.vnni_jit import target_has

        estimate = "rsqrt14" if X86_VARIANT == "avx512f" else "rsqrt12"
        if not target_has("avx512f" if estimate == "rsqrt14" else "avx"):
            return None, None, None
        from . import vmath_jit  # module level: numba's disk cache finds its kernels (closures missed it)
    except ImportError:
        return None, None, None
    if estimate == "rsqrt14":
        return vmath_jit.rsqrt14, vmath_jit.rsqrt_newton, vmath_jit.rms_tail_rows
    return vmath_jit.rsqrt12, vmath_jit.rsqrt12_newton, vmath_jit.rms_tail_rows12


_ESTIMATE, _RSQRT, _RMS_TAIL = _compile_rsqrt()


def warm_up() -> None:
    """The compiled sigmoid and RMSNorm tail called once on tiny rows (the weight read-only, as a
    program's constants are; numba compiles that form apart): numba reads each from its disk
    cache at its first call, at load then (the XNNPACK backend's init), not inside a prompt."""
    if _warmed:
        return
    _warmed.append(True)
    x, weight = np.ones((2, 8), F32), np.ones(8, F32)
    weight.flags.writeable = False
    sigmoid(x)
    swiglu(x, x)
    rms_tail(np.ones((2, 1), F32), np.ones(1, F32), x, weight)


_warmed: list[bool] = []


def newton_step(a: np.ndarray, y: np.ndarray, denormals_off: bool = False) -> np.ndarray:
    """XNNPACK's refinement of the estimate y of 1 / sqrt(a) (0 where a is inf), in numpy. With
    `denormals_off` (the AVX path's step, rsqrt12_newton) as XNNPACK runs it: a subnormal a reads
    as +-0 (NaN then, where y is +-inf) and a subnormal y * y (a > 2**126) is 0, so y comes out
    1.5 y; the other products cannot be subnormal."""
    with np.errstate(all="ignore"):
        square = y * y
        if denormals_off:
            a, square = _ftz(a), _ftz(square)
        y = y - (a * square - F32(1)) * (F32(0.5) * y)
        return np.where(a == np.inf, F32(0), y).astype(F32)


def rsqrt(x: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(x, F32)
    if _RSQRT is None:
        with np.errstate(all="ignore"):
            return (F32(1) / np.sqrt(a)).astype(F32)
    return _RSQRT(a.reshape(-1)).reshape(a.shape)


def rms_tail_into(mean: np.ndarray, eps: np.ndarray, x: np.ndarray, w: np.ndarray,
                  out: np.ndarray) -> Optional[Callable[[], None]]:
    """rms_tail's compiled loop as a call on fixed arrays writing into out (float32 [..., n] in C
    order, x's shape), or None where rms_tail would not take it."""
    n = x.shape[-1] if x.ndim else 0
    if not (_RMS_TAIL is not None and n and mean.shape == x.shape[:-1] + (1,) and w.shape == (n,) and eps.size == 1
            and x.dtype == mean.dtype == w.dtype == eps.dtype == out.dtype == F32 and out.shape == x.shape
            and x.flags.c_contiguous and mean.flags.c_contiguous and w.flags.c_contiguous and out.flags.c_contiguous) \
            or any(np.may_share_memory(out, t) for t in (mean, eps, x, w)):
        return None
    means, eps_row, kernel = mean.reshape(-1), eps.reshape(-1)[:1], _RMS_TAIL
    rows, out_rows = x.reshape(-1, n), out.reshape(-1, n)

    def rms_tail_into_out() -> None:
        kernel(means, eps_row[0], rows, w, out_rows)  # eps read at each call, as rms_tail reads it

    return rms_tail_into_out


def rms_tail(mean: np.ndarray, eps: np.ndarray, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(x * rsqrt(mean + eps)) * w as XNNPACK's Add, ReciprocalSquareRoot and two Multiply nodes
    compute it: one compiled loop where rsqrt asks the CPU's estimate through numba (x [..., n]
    and mean [..., 1] float32 rows in C order, w [n], eps one value), else those four operations
    in numpy."""
    out = np.empty(x.shape, F32)
    compiled = rms_tail_into(mean, eps, x, w, out)
    if compiled is not None:
        compiled()
        return out
    return np.multiply(np.multiply(x, rsqrt(np.add(mean, eps))), w)
