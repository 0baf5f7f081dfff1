"""XNNPACK's float32 sigmoid and rsqrt depend on the CPU: vmath.X86_VARIANT picks its AVX-512F
kernels' steps or its AVX2 ones (x86 with AVX2 and FMA, no AVX-512F) from the CPU's flags. Each
variant's compiled loop equals its numpy steps bit for bit on any CPU, and the AVX2 sigmoid and
the GELU give ExecuTorch's bits at points recorded from ExecuTorch 1.5.1's runtime on an AMD EPYC
with AVX2 + FMA and no AVX-512 (its XNNPACK runs with denormals off: FTZ and DAZ)."""
from __future__ import annotations

import numpy as np
import pytest

from execupy.backends.xnnpack import vmath
from execupy.kernels.fast import quantized

F32 = np.float32
numba_only = pytest.mark.skipif(quantized.BACKEND != "numba", reason="numba (the `fast` extra) is not in use")


def _floats(*hexes: str) -> np.ndarray:
    return np.array([float.fromhex(h) for h in hexes], F32)


def _bits(x) -> np.ndarray:
    return np.asarray(x, F32).view(np.uint32)


def _every_kind_of_float32() -> np.ndarray:
    """Normal values, the specials, subnormals, every float32 around the AVX2 sigmoid's cutoff and
    at k = -124..-126 of its 2**k, NaNs with payloads, and random bit patterns."""
    rng = np.random.default_rng(5)
    around = np.arange(np.array([-85.0], F32).view(np.int32)[0], np.array([-88.5], F32).view(np.int32)[0],
                       dtype=np.int32).view(F32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38, 2.0 ** -126,
                         -2.0 ** -126, 2.0 ** -125, 3.4028235e38, -3.4028235e38, 88.0, -88.0, 104.0], F32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA12345], np.uint32).view(F32)
    bits = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32).view(F32)
    return np.concatenate([(rng.standard_normal(5000) * 8).astype(F32), around[::7], specials, nans, bits])


def test_the_variant_follows_the_cpus_flags():
    assert vmath._x86_variant(frozenset({"sse2", "avx", "avx2", "fma", "f16c"})) == "avx2"
    assert vmath._x86_variant(frozenset({"avx", "avx2", "fma", "avx512f", "avx512bw"})) == "avx512f"
    assert vmath._x86_variant(frozenset({"avx"})) == vmath._x86_variant(None) == "avx512f"  # stand-ins
    assert vmath.X86_VARIANT == vmath._x86_variant(vmath.cpu_flags())
    avx2 = vmath.X86_VARIANT == "avx2"
    assert vmath._sigmoid is (vmath._sigmoid_avx2 if avx2 else vmath._sigmoid_avx512)
    assert vmath.SIGMOID_KERNEL.endswith("avx2_rr1_p5_div" if avx2 else "avx512f_rr2_lut32_p2_perm2_scalef_div")
    if quantized.BACKEND == "numba":
        from execupy.backends.xnnpack import vmath_jit

        assert vmath._SIGMOID is (vmath_jit.sigmoid_avx2_into if avx2 else vmath_jit.sigmoid_into)
        assert vmath._SWIGLU is (vmath_jit.swiglu_avx2_into if avx2 else vmath_jit.swiglu_into)
    if vmath._RSQRT is not None:
        from execupy.backends.xnnpack import vmath_jit

        assert vmath._RSQRT is (vmath_jit.rsqrt12_newton if avx2 else vmath_jit.rsqrt_newton)


@numba_only
def test_each_sigmoid_variants_compiled_loop_equals_its_numpy_steps():
    """Both variants, whatever this CPU runs (their steps need FMA only, which LLVM's fma gives
    everywhere); the AVX2 one NaN bits and all."""
    from execupy.backends.xnnpack import vmath_jit

    x = _every_kind_of_float32()
    u = np.roll(x, 11)
    out = np.empty_like(x)
    with np.errstate(all="ignore"):
        vmath_jit.sigmoid_avx2_into(x, out)
        np.testing.assert_array_equal(_bits(out), _bits(vmath._sigmoid_avx2(x)))
        vmath_jit.swiglu_avx2_into(x, u, out)
        np.testing.assert_array_equal(out, np.multiply(np.multiply(x, vmath._sigmoid_avx2(x)), u))
        vmath_jit.sigmoid_into(x, out)
        np.testing.assert_array_equal(out, vmath._sigmoid_avx512(x))
        vmath_jit.gelu_into(x, out)
        np.testing.assert_array_equal(_bits(out), _bits(vmath._gelu(x)))


# sigmoid's inputs and ExecuTorch's bits on the AVX2 CPU: values where the AVX-512 steps give one
# ulp more or less; then denormals off: for 2**k <= 2**-125 XNNPACK's t * 2**k flushes and
# e = 2**k, so sigmoid(-87) is FLT_MIN; below the cutoff 0; a subnormal x gives 1/2
AVX2_SIGMOID = [
    (_floats("0x1.5e136ep-7", "-0x1.4bea7cp-9", "0x1.283974p-6", "0x1.0302c8p-8", "-0x1.a7a56p-10", "-0x1.438894p-6"),
     _floats("0x1.015e14p-1", "0x1.ff5a0cp-2", "0x1.025070p-1", "0x1.008180p-1", "0x1.ff9618p-2", "0x1.faf1e8p-2")),
    (_floats("-0x1.5d589ep+6", "-0x1.5cp+6", "0x1.5cp+6", "-0x1.6p+6", "0x0p+0", "-0x0p+0", "0x1p-149", "-0x1p-149"),
     _floats("0x1p-126", "0x1p-126", "0x1p+0", "0x0p+0", "0x1p-1", "0x1p-1", "0x1p-1", "0x1p-1")),
    (np.array([np.inf, -np.inf], F32), np.array([1, 0], F32)),
]


@pytest.mark.parametrize("x, executorch", AVX2_SIGMOID)
@pytest.mark.filterwarnings("ignore:invalid value")
def test_the_avx2_sigmoid_gives_executorchs_bits(x, executorch):
    np.testing.assert_array_equal(_bits(vmath._sigmoid_avx2(x)), _bits(executorch))
    if quantized.BACKEND == "numba":
        from execupy.backends.xnnpack import vmath_jit

        out = np.empty_like(x)
        vmath_jit.sigmoid_avx2_into(x, out)
        np.testing.assert_array_equal(_bits(out), _bits(executorch))
    nan = np.array([0x7FA12345, 0x7FC00000], np.uint32).view(F32)  # -> x | sign | quiet, as XNNPACK's z carries it
    np.testing.assert_array_equal(_bits(vmath._sigmoid_avx2(nan)), [0xFFE12345, 0xFFC00000])


def test_gelu_is_signed_zero_where_x_over_2_is_subnormal():
    """XNNPACK's GELU with denormals off (ExecuTorch's bits on the AVX2 CPU): x / 2 below FLT_MIN
    flushes, so GELU(+-FLT_MIN) and GELU(subnormal) are +-0; GELU(2**-125) is 2**-126."""
    x = _floats("0x1p-126", "-0x1p-126", "0x1p-149", "-0x1.fffffcp-127", "0x1p-125")
    want = _floats("0x0p+0", "-0x0p+0", "0x0p+0", "-0x0p+0", "0x1p-126")
    np.testing.assert_array_equal(_bits(vmath._gelu(x)), _bits(want))
    np.testing.assert_array_equal(_bits(vmath.gelu(x)), _bits(want))


def test_the_avx_newton_step_runs_with_denormals_off():
    """rsqrt's step on the AVX path (ExecuTorch's bits on the AVX2 CPU): a subnormal a reads as
    +-0 (times the estimate's +-inf: NaN), as does 0 itself; y * y subnormal (a > 2**126) is 0,
    so y comes out 1.5 y; +inf gives 0."""
    a = np.array([1e-45, -1e-45, 0.0, 3.4028235e38, np.inf], F32)
    y = np.array([np.inf, -np.inf, np.inf, float.fromhex("0x1.0p-64"), 0.0], F32)  # estimates as vrsqrtps gives them
    got = vmath.newton_step(a, y, denormals_off=True)
    assert np.isnan(got[:3]).all() and got[3] == F32(1.5) * y[3] and got[4] == 0
    if vmath._RSQRT is not None and vmath.X86_VARIANT == "avx2":  # the CPU's own estimate, compiled
        estimate = vmath._ESTIMATE(a)
        assert np.isinf(estimate[:3]).all()
        np.testing.assert_array_equal(_bits(vmath.rsqrt(a)), _bits(vmath.newton_step(a, estimate, denormals_off=True)))
        assert np.isnan(vmath.rsqrt(a)[:3]).all() and vmath.rsqrt(a)[3] == F32(1.5) * estimate[3]
