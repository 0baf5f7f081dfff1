"""fma32, the numpy fused multiply-add behind XNNPACK's GEMM reference and vector math, rounds
a * b + c once, as the CPU's vfmadd and the compiled kernels' `llvm.fma` do."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from execupy.kernels.fast.xnnpack_gemm import fma32

F32 = np.float32


def _nearest_float32(exact: Fraction) -> F32:
    """The float32 nearest `exact` (ties to the even one), by exact comparison with the neighbours."""
    guess = F32(float(exact))  # within one float32 step of the answer
    candidates = [np.nextafter(guess, F32(-np.inf)), guess, np.nextafter(guess, F32(np.inf))]
    candidates = [c for c in candidates if np.isfinite(c)]
    best = min(abs(Fraction(float(c)) - exact) for c in candidates)
    closest = [c for c in candidates if abs(Fraction(float(c)) - exact) == best]
    return next((c for c in closest if int(c.view(np.int32)) % 2 == 0), closest[0])


def _cases() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    n = 3000
    a, b = rng.standard_normal(n).astype(F32), rng.standard_normal(n).astype(F32)
    c = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(F32)
    # a * b just below and just above half a step of c = 1 + 2**-23: the float64 sum lands on a
    # float32 midpoint and rounding it again goes the wrong way (the old emulation's error)
    one_up = F32(1 + 2.0**-23)
    tricky_a = np.array([1 + 2.0**-23, 1 - 2.0**-24, -(1 + 2.0**-23), 1 + 2.0**-23], F32)
    tricky_b = np.array([2.0**-24 * (1 - 2.0**-23), 2.0**-24 * (1 + 2.0**-23), 2.0**-24 * (1 - 2.0**-23), -2.0**-70], F32)
    tricky_c = np.array([one_up, one_up, -one_up, 1.0], F32)
    return np.concatenate([a, tricky_a]), np.concatenate([b, tricky_b]), np.concatenate([c, tricky_c])


def test_fma32_rounds_the_exact_sum_once():
    a, b, c = _cases()
    got = fma32(a, b, c)
    want = np.array([_nearest_float32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a, b, c)], F32)
    np.testing.assert_array_equal(got, want)
    rounded_twice = (a.astype(np.float64) * b + c).astype(F32)
    assert (rounded_twice != want).sum() >= 2  # the midpoint cases tell the two apart


def test_fma32_keeps_zeros_infinities_and_nan():
    a = np.array([0.0, -0.0, np.inf, 1.0, np.nan, 3e38], F32)
    b = np.array([5.0, 5.0, 2.0, np.inf, 1.0, 3e38], F32)
    c = np.array([-0.0, -0.0, 1.0, -np.inf, 1.0, 1.0], F32)
    got = fma32(a, b, c)
    np.testing.assert_array_equal(got[:2], [0.0, -0.0])
    assert np.signbit(got[1]) and not np.signbit(got[0])
    assert got[2] == np.inf and np.isnan(got[3]) and np.isnan(got[4]) and got[5] == np.inf


def test_fma32_equals_the_compiled_kernels_fma():
    numba = pytest.importorskip("numba")
    from execupy.kernels.fast.fma_jit import fma32 as compiled_fma

    @numba.njit
    def each(a, b, c, out):
        for i in range(a.size):
            out[i] = compiled_fma(a[i], b[i], c[i])

    a, b, c = _cases()
    out = np.empty_like(a)
    each(a, b, c, out)
    np.testing.assert_array_equal(fma32(a, b, c), out)
