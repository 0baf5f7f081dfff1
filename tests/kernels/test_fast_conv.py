"""The compiled (numba) depthwise convolution, requantization and GELU kernels equal their
numpy references bit for bit, and the kernels that use them (portable aten::convolution and
aten::gelu, XNNPACK's conv nodes) give the same results with and without them."""
from __future__ import annotations

import numpy as np
import pytest

from execupy.kernels.fast import conv as FC
from execupy.kernels.fast import gelu as fast_gelu
from execupy.kernels.portable import conv as portable_conv
from execupy.kernels.portable.activation import gelu
from execupy.kernels.portable.conv import convolution

pytestmark = pytest.mark.skipif(FC.NUMBA is None, reason="numba (the `fast` extra) is not installed")

SHAPES = [  # channels, size, stride, dilation, kernel, padding
    (48, 20, 1, 1, 3, 1), (24, 17, 2, 1, 3, 1), (7, 11, 2, 2, 5, 3), (16, 6, 1, 1, 1, 0), (5, 9, 3, 1, 3, 0)]


def _out_size(size: int, k: int, s: int, d: int, p: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _assert_same_floats(ours: np.ndarray, reference: np.ndarray) -> None:
    """Equal values, NaN where NaN, and the same sign on zeros (a NaN's payload may differ:
    LLVM may swap an addition's operands)."""
    np.testing.assert_array_equal(ours, reference)
    numbers = ~np.isnan(reference)
    np.testing.assert_array_equal(np.signbit(ours[numbers]), np.signbit(reference[numbers]))


def _run(name: str, args: tuple, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ours, reference = out.copy(), out.copy()
    FC.NUMBA[name](*args, ours)
    FC.NUMPY[name](*args, reference)
    return ours, reference


@pytest.mark.parametrize("c, size, s, d, k, p", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_depthwise_nchw_numba_equals_numpy(c, size, s, d, k, p, dtype):
    rng = np.random.default_rng(c * size + k)
    xp = np.pad(rng.standard_normal((2, c, size, size)).astype(dtype), ((0, 0), (0, 0), (p, p), (p, p)))
    w = rng.standard_normal((c, k, k)).astype(dtype)
    o = _out_size(size, k, s, d, p)
    ours, reference = _run("depthwise_nchw", (xp, w, (s, s), (d, d)), np.empty((2, c, o, o), dtype))
    _assert_same_floats(ours, reference)


@pytest.mark.parametrize("c, size, s, d, k, p", SHAPES)
def test_depthwise_nhwc_float_numba_equals_numpy(c, size, s, d, k, p):
    rng = np.random.default_rng(c + size * k)
    x = rng.standard_normal((1, size, size, c)).astype(np.float32)
    x[0, 0, 0, 0], x[0, -1, -1, -1] = -0.0, np.nan  # a padded tap must treat these as the padded copy does
    w = rng.standard_normal((k, k, c)).astype(np.float32)
    w[0, 0, 0] = -1.0  # 0 * -1 = -0.0 at a padded pixel
    w[0, -1, -1] = np.inf  # 0 * inf = NaN at a padded pixel, as in the padded copy
    o = _out_size(size, k, s, d, p)
    ours, reference = _run("depthwise_nhwc", (x, w, (s, s), (d, d), (p, p, p, p), 0), np.empty((1, o, o, c), np.float32))
    _assert_same_floats(ours, reference)


@pytest.mark.parametrize("c, size, s, d, k, p", SHAPES)
@pytest.mark.parametrize("storage, zero", [(np.int8, -5), (np.uint8, 128)])
def test_depthwise_nhwc_int8_numba_equals_numpy(c, size, s, d, k, p, storage, zero):
    rng = np.random.default_rng(c * k + size)
    info = np.iinfo(storage)
    x = rng.integers(info.min, info.max + 1, (1, size, size, c)).astype(storage)
    w = rng.integers(-127, 128, (k, k, c)).astype(np.int32)
    o = _out_size(size, k, s, d, p)
    ours, reference = _run("depthwise_nhwc", (x, w, (s, s), (d, d), (p, p, p, p), zero), np.empty((1, o, o, c), np.int32))
    np.testing.assert_array_equal(ours, reference)
    # and it is the integer convolution itself (int64, no rounding anywhere)
    xp = np.pad(x.astype(np.int64) - zero, ((0, 0), (p, p), (p, p), (0, 0)))
    exact = sum(xp[:, i * d: i * d + (o - 1) * s + 1: s, j * d: j * d + (o - 1) * s + 1: s] * w[i, j]
                for i in range(k) for j in range(k))
    np.testing.assert_array_equal(ours, exact)


@pytest.mark.parametrize("acc_dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("storage, zero, lo, hi", [(np.int8, 3, -128, 127), (np.int8, -128, -128, 40),
                                                   (np.uint8, 128, 0, 255)])
def test_requantize_numba_equals_numpy(acc_dtype, storage, zero, lo, hi):
    rng = np.random.default_rng(7)
    acc = rng.integers(-40000, 40000, (3, 5, 5, 24)).astype(acc_dtype)
    bias = rng.integers(-5000, 5000, 24).astype(np.float64)
    scale = (rng.random(24) * 4e-3).astype(np.float32)
    out = np.empty(acc.shape, storage)
    ours, reference = _run("requantize", (acc, bias, scale, zero, lo, hi), out)
    np.testing.assert_array_equal(ours, reference)
    assert ours.min() >= lo and ours.max() <= hi and len(np.unique(ours)) > 20


@pytest.mark.parametrize("groups_case", ["depthwise", "depthwise_strided", "dense"])
def test_portable_convolution_same_with_and_without_compiled_depthwise(groups_case, monkeypatch):
    rng = np.random.default_rng(3)
    c = 12
    x = rng.standard_normal((2, c, 15, 15)).astype(np.float32)
    cin_g, groups = (12, 1) if groups_case == "dense" else (1, c)
    w = rng.standard_normal((c, cin_g, 3, 3)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    stride = (2, 2) if groups_case == "depthwise_strided" else (1, 1)

    def run() -> np.ndarray:
        out = np.empty((2, c, 15 // stride[0] + (stride[0] == 2), 15 // stride[1] + (stride[1] == 2)), np.float32)
        return convolution(x, w, b, stride, (1, 1), (1, 1), False, (), groups, out).copy()

    compiled = run()
    monkeypatch.setattr(FC, "BACKEND", "numpy")
    np.testing.assert_array_equal(compiled.view(np.uint32), run().view(np.uint32))


def test_gelu_compiled_equals_numpy_on_a_million_points(monkeypatch):
    rng = np.random.default_rng(0)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1.4142135, -1.4142135, 6.0, -6.0, 8.5,
                         9.0, -9.0, 1e-30, -1e-30, 3.4e38], np.float32)
    x = np.concatenate([rng.standard_normal((1 << 20) - specials.size).astype(np.float32) * 3, specials]).reshape(-1, 1024)
    compiled = np.empty_like(x)
    gelu(x, "none", compiled)
    monkeypatch.setattr(fast_gelu, "_KERNEL", None)  # the portable kernel's numpy path
    reference = np.empty_like(x)
    gelu(x, "none", reference)
    np.testing.assert_array_equal(compiled.view(np.uint32), reference.view(np.uint32))


def test_gelu_compiled_path_declines_what_it_does_not_cover():
    x = np.ones((4, 6), np.float32)
    assert fast_gelu.gelu(x.astype(np.float64), np.empty((4, 6))) is None
    assert fast_gelu.gelu(x[:, ::2], np.empty((4, 3), np.float32)) is None  # strided input: numpy path
    assert fast_gelu.gelu(x, np.empty((4, 6), np.float32)) is not None


CACHE_PROBE = """
import numpy as np
from execupy.kernels.fast import conv as FC, conv_jit as K
x = np.ones((1, 2, 6, 6), np.float32)
FC.NUMBA["depthwise_nchw"](x, np.ones((2, 3, 3), np.float32), (1, 1), (1, 1), np.empty((1, 2, 4, 4), np.float32))
FC.NUMBA["depthwise_nhwc"](x.transpose(0, 2, 3, 1).copy(), np.ones((3, 3, 2), np.float32), (1, 1), (1, 1), (1, 1, 1, 1),
                           0, np.empty((1, 6, 6, 2), np.float32))
FC.NUMBA["requantize"](np.ones((2, 3), np.int32), np.zeros(3, np.float32), np.ones(3, np.float32), 0, -128, 127,
                       np.empty((2, 3), np.float32))
"""


def test_a_second_process_finds_every_conv_kernel_in_numbas_cache(tmp_path):
    """Compiled once per machine: the depthwise kernels call inlined helpers, which as closures
    made them miss numba's disk cache in every new process."""
    from tests.numba_cache import two_processes_cache_stats

    first, second = two_processes_cache_stats(CACHE_PROBE, tmp_path)
    assert set(first) == {"nchw", "nhwc", "requantize_rows"}
    assert all(misses > 0 for _, misses in first.values())
    assert all(hits > 0 and misses == 0 for hits, misses in second.values())
