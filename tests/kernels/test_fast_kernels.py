"""The compiled kernels of the `fast` extra (numba) and their numpy counterparts give the
same results on the same inputs, and the numpy ones agree with the registered portable
quantized kernels they stand in for. The numba half runs where numba is installed (CI
installs the `fast` extra); the numpy half always runs."""
import numpy as np
import pytest

from execupy.kernels.fast import quantized as Q
from execupy.kernels.quantized.quant import dequantize_per_channel_group

needs_numba = pytest.mark.skipif(Q.NUMBA is None, reason="numba (the `fast` extra) is not installed")

# (bits, with zero points): int4 values are held one per int8, as the quantized ops take them.
WEIGHTS = [(4, False), (4, True), (8, False), (8, True)]


def grouped_weight(rng, n: int, k: int, group: int, bits: int, with_zeros: bool):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = rng.integers(lo, hi + 1, (n, k)).astype(np.int8)
    scales = (rng.random((n, k // group)) * 0.05 + 1e-3).astype(np.float32)
    zeros = rng.integers(lo // 4, hi // 4 + 1, (n, k // group)).astype(np.int8) if with_zeros else None
    return q, scales, zeros, lo, hi


def dequantized(q, scales, zeros, lo, hi, group):
    """The weight as the registered dequantize_per_channel_group kernel makes it."""
    out = np.empty(q.shape, np.float32)
    return dequantize_per_channel_group(q, scales, zeros, lo, hi, 1, group, 6, out)


@pytest.mark.parametrize("bits,with_zeros", WEIGHTS)
@pytest.mark.parametrize("m", [1, 5])
def test_numpy_qmatmul_is_x_times_the_dequantized_weight(bits, with_zeros, m):
    rng = np.random.default_rng(bits * 10 + m)
    q, s, z, lo, hi = grouped_weight(rng, 48, 96, 32, bits, with_zeros)
    x = rng.standard_normal((m, 96)).astype(np.float32)
    expected = x @ dequantized(q, s, z, lo, hi, 32).T
    np.testing.assert_allclose(Q.qmatmul_numpy(x, q, s, z, 32), expected, rtol=1e-5, atol=1e-5)


@needs_numba
@pytest.mark.parametrize("bits,with_zeros", WEIGHTS)
@pytest.mark.parametrize("m", [1, 3, Q.BLAS_MIN_ROWS, 7])  # the mat-vec path, then dequantize + BLAS
def test_numba_qmatmul_equals_numpy_within_float32_rounding(bits, with_zeros, m):
    rng = np.random.default_rng(bits + m)
    q, s, z, _, _ = grouped_weight(rng, 130, 256, 64, bits, with_zeros)
    x = rng.standard_normal((m, 256)).astype(np.float32)
    expected = Q.NUMPY["qmatmul"](x, q, s, z, 64)
    got = Q.NUMBA["qmatmul"](x, q, s, z, 64)
    assert got.shape == expected.shape and got.dtype == np.float32
    scale = np.abs(expected).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - expected) <= 1e-5 * scale + 1e-6)


def test_numpy_per_token_quantization_round_trips_within_half_a_step():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32) * np.array([[1], [10], [1e-3], [0]], np.float32)
    q, scale, zero = Q.quantize_per_token_numpy(x)
    assert q.dtype == np.int8 and scale.shape == zero.shape == (4,)
    back = (q.astype(np.float32) - zero[:, None]) * scale[:, None]
    assert np.all(np.abs(back - x) <= scale[:, None] / 2 + 1e-7)


@needs_numba
def test_numba_per_token_quantization_equals_numpy_exactly():
    rng = np.random.default_rng(4)
    for magnitude in (1.0, 1e-3, 300.0):
        x = (rng.standard_normal((6, 576)) * magnitude).astype(np.float32)
        x[0], x[1] = 0, np.abs(x[1])  # an all-zero row and a row with no negative value
        for got, expected in zip(Q.NUMBA["quantize_per_token"](x), Q.NUMPY["quantize_per_token"](x)):
            assert got.dtype == expected.dtype and np.array_equal(got, expected)


@pytest.mark.parametrize("bits,with_zeros", WEIGHTS)
def test_embedding_gathers_dequantized_rows(bits, with_zeros):
    rng = np.random.default_rng(5)
    q, s, z, lo, hi = grouped_weight(rng, 40, 64, 32, bits, with_zeros)
    ids = np.array([[3, 0, 39, 3]])
    expected = dequantized(q, s, z, lo, hi, 32)[ids.reshape(-1)]
    assert np.array_equal(Q.embedding_numpy(q, s, z, 32, ids), expected)
    if Q.NUMBA is not None:
        assert np.array_equal(Q.NUMBA["embedding"](q, s, z, 32, ids), expected)
