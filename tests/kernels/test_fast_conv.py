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

SHAPES = [  # channels, size, stride, dilation, kernel, padding (3x3 with 32 channels or more: pixel by pixel)
    (48, 20, 1, 1, 3, 1), (24, 17, 2, 1, 3, 1), (7, 11, 2, 2, 5, 3), (16, 6, 1, 1, 1, 0), (5, 9, 3, 1, 3, 0),
    (64, 9, 2, 1, 3, 1), (40, 10, 1, 2, 3, 2), (32, 7, 2, 1, 3, 0), (96, 5, 3, 1, 3, 1)]


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


EPILOGUES = {"none": (), "bias": "bias", "bias_relu6": ("bias", 0.0, 6.0), "clamp_only": (None, -1.0, 1.0)}


def _epilogue(name: str, channels: int, rng) -> tuple:
    """A float conv's (bias, lo, hi) arguments: a bias with a -0.0 and a NaN among its values."""
    bias = rng.standard_normal(channels).astype(np.float32)
    bias[0], bias[-1] = -0.0, np.nan if channels > 2 else bias[-1]
    spec = EPILOGUES[name]
    if spec == "bias":
        return (bias,)
    return tuple(bias if part == "bias" else part for part in spec)


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("c, size, s, d, k, p", SHAPES + [(16, 24, 1, 1, 3, 1), (8, 13, 2, 1, 3, 1)])
def test_depthwise_nhwc_float_numba_equals_numpy(c, size, s, d, k, p, epilogue):
    rng = np.random.default_rng(c + size * k)
    x = rng.standard_normal((2, size, size, c)).astype(np.float32) * 4
    x[0, 0, 0, 0], x[0, -1, -1, -1] = -0.0, np.nan  # a padded tap must treat these as the padded copy does
    w = rng.standard_normal((k, k, c)).astype(np.float32)
    w[0, 0, 0] = -1.0  # 0 * -1 = -0.0 at a padded pixel
    w[0, -1, -1] = np.inf  # 0 * inf = NaN at a padded pixel, as in the padded copy
    o = _out_size(size, k, s, d, p)
    args = (x, w, (s, s), (d, d), (p, p, p, p), 0, *_epilogue(epilogue, c, rng))
    ours, reference = FC.NUMBA["depthwise_nhwc"](*args[:6], np.empty((2, o, o, c), np.float32), *args[6:]), \
        FC.NUMPY["depthwise_nhwc"](*args[:6], np.empty((2, o, o, c), np.float32), *args[6:])
    _assert_same_floats(ours, reference)
    if epilogue in ("bias_relu6", "clamp_only"):
        numbers = reference[~np.isnan(reference)]
        assert numbers.min() >= args[7] and numbers.max() <= args[8] and (numbers == args[8]).any()


@pytest.mark.parametrize("c", [8, 48])  # tap by tap, and pixel by pixel
def test_depthwise_nhwc_float_data_with_a_zero_point_equals_numpy(c):
    """A float input whose zero point is taken off first (x - x_zero, padding reading as 0)."""
    rng = np.random.default_rng(c)
    x = rng.integers(-128, 128, (1, 9, 9, c)).astype(np.float32)
    w = rng.integers(-127, 128, (3, 3, c)).astype(np.float32)
    ours, reference = _run("depthwise_nhwc", (x, w, (2, 2), (1, 1), (1, 1, 1, 1), 7), np.empty((1, 5, 5, c), np.float32))
    np.testing.assert_array_equal(ours, reference)


def test_a_bound_depthwise_kernel_serves_inputs_of_other_widths():
    """The XNNPACK node binds its filter once; a dynamic-shape input of another width gets
    weights tiled for its own output row."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 3, 8)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    bound = FC.NUMBA["depthwise_nhwc_kernel"](w, (1, 1), (1, 1), (1, 1, 1, 1), 0, bias, 0.0, 6.0)
    for width in (9, 5, 9, 12):
        x = rng.standard_normal((1, 7, width, 8)).astype(np.float32)
        ours = bound(x, np.empty((1, 7, width, 8), np.float32))
        reference = FC.NUMPY["depthwise_nhwc"](x, w, (1, 1), (1, 1), (1, 1, 1, 1), 0, np.empty_like(ours), bias, 0.0, 6.0)
        _assert_same_floats(ours, reference)


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("channels", [3, 16, 1000])
def test_bias_clamp_numba_equals_numpy(channels, epilogue):
    rng = np.random.default_rng(channels)
    y = rng.standard_normal((5, 37, channels)).astype(np.float32) * 8
    y.reshape(-1)[:4] = [np.nan, -0.0, 0.0, np.inf]
    args = _epilogue(epilogue, channels, rng)
    args = args + (None, -np.inf, np.inf)[len(args):]
    ours, reference = FC.NUMBA["bias_clamp"](y.copy(), *args), FC.NUMPY["bias_clamp"](y.copy(), *args)
    _assert_same_floats(ours, reference)
    assert epilogue == "none" or not np.array_equal(ours, y, equal_nan=True)
    strided = y.copy()[:, ::2]  # in place on a view too
    FC.NUMBA["bias_clamp"](strided, *args)
    _assert_same_floats(strided, reference[:, ::2])


@pytest.mark.parametrize("dtype, zero", [(np.float32, 0), (np.int8, -7), (np.uint8, 128)])
@pytest.mark.parametrize("layout", ["nhwc", "transposed_nchw"])
def test_pad_into_numba_equals_numpy(dtype, zero, layout):
    """A CNN's first conv reads its input through a transpose of the NCHW tensor."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((2, 3, 11, 13)) * 60).astype(dtype)
    x = x.transpose(0, 2, 3, 1) if layout == "transposed_nchw" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    acc = np.float32 if dtype == np.float32 else np.float64
    ours = FC.NUMBA["pad_into"](x, zero, 1, 2, np.zeros((2, 14, 16, 3), acc))
    reference = FC.NUMPY["pad_into"](x, zero, 1, 2, np.zeros((2, 14, 16, 3), acc))
    np.testing.assert_array_equal(ours, reference)
    np.testing.assert_array_equal(ours[:, 1:12, 2:15], x.astype(acc) - zero)
    assert not ours[:, 0].any() and not ours[:, 12:].any() and not ours[:, :, :2].any() and not ours[:, :, 15:].any()


@pytest.mark.parametrize("c, size, s, d, k, p", SHAPES)
@pytest.mark.parametrize("storage, zero", [(np.int8, -5), (np.uint8, 128)])
@pytest.mark.parametrize("acc", [np.int32, np.float32])  # float32 where it holds every sum exactly (XNNPACK's node)
def test_depthwise_nhwc_int8_numba_equals_numpy(c, size, s, d, k, p, storage, zero, acc):
    rng = np.random.default_rng(c * k + size)
    info = np.iinfo(storage)
    x = rng.integers(info.min, info.max + 1, (1, size, size, c)).astype(storage)
    w = rng.integers(-127, 128, (k, k, c)).astype(np.int32)
    o = _out_size(size, k, s, d, p)
    w = w.astype(acc)
    ours, reference = _run("depthwise_nhwc", (x, w, (s, s), (d, d), (p, p, p, p), zero), np.empty((1, o, o, c), acc))
    np.testing.assert_array_equal(ours, reference)
    # and it is the integer convolution itself (int64, no rounding anywhere)
    xp = np.pad(x.astype(np.int64) - zero, ((0, 0), (p, p), (p, p), (0, 0)))
    exact = sum(xp[:, i * d: i * d + (o - 1) * s + 1: s, j * d: j * d + (o - 1) * s + 1: s] * w[i, j]
                for i in range(k) for j in range(k))
    np.testing.assert_array_equal(ours, exact)


# 3x3 (16 channels a vector in registers, and the channels past a multiple of 16 one by one),
# strided, a 5x5 and a float64 bias (summed, then requantized in a pass)
@pytest.mark.parametrize("c, size, s, k, bias_dtype", [(32, 12, 1, 3, np.float32), (40, 11, 2, 3, np.float32),
                                                       (16, 9, 1, 5, np.float32), (48, 8, 1, 3, np.float64)])
@pytest.mark.parametrize("storage, zero, lo, hi", [(np.int8, -3, -128, 127), (np.uint8, 128, 10, 250)])
def test_a_requantized_depthwise_conv_numba_equals_numpy(c, size, s, k, bias_dtype, storage, zero, lo, hi,
                                                         monkeypatch):
    """depthwise_nhwc_kernel(requantized=...): the int8 layer's output straight from its kernel,
    XNNPACK's requantization of the exact sums (conv.requantize's steps): the numpy reference's bits.
    A 3x3 one with a float32 bias writes int8 from nhwc_3x3_vectors' registers."""
    rng = np.random.default_rng(c + size)
    info = np.iinfo(storage)
    x = rng.integers(info.min, info.max + 1, (2, size, size, c)).astype(storage)
    w = rng.integers(-127, 128, (k, k, c)).astype(np.float32)
    bias = rng.integers(-5000, 5000, c).astype(bias_dtype)
    requantized = ((rng.random(c) * 0.004).astype(np.float32), zero, storage)
    p = k // 2
    o = _out_size(size, k, s, 1, p)
    outs = [FC.NUMPY["depthwise_nhwc_kernel"](w, (s, s), (1, 1), (p, p, p, p), 9, bias, lo, hi, requantized)(
        x, np.empty((2, o, o, c), storage))]
    if FC.BACKEND == "numba":
        from execupy.kernels.fast import conv_shared_jit as S
        from execupy.kernels.fast.second_thread import SECOND_THREAD

        vector_outs = []  # the dtypes nhwc_3x3_vectors wrote
        run = SECOND_THREAD.run
        monkeypatch.setattr(SECOND_THREAD, "run", lambda kernel, args, *rest: (
            vector_outs.append(args[-1].dtype) if kernel is S.nhwc_3x3_shared else None, run(kernel, args, *rest)))
        kernel = FC.NUMBA["depthwise_nhwc_kernel"](w, (s, s), (1, 1), (p, p, p, p), 9, bias, lo, hi, requantized)
        outs += [kernel(x, np.empty((2, o, o, c), storage)) for _ in range(3)]  # one thread, then as the rule says
        fused = bias_dtype == np.float32  # else float32 sums there, then requantized in a pass
        assert vector_outs == ([np.dtype(storage if fused else np.float32)] * 3 if k == 3 else [])
    for ours in outs[1:]:
        np.testing.assert_array_equal(ours, outs[0])
    assert outs[0].dtype == storage and len(np.unique(outs[0])) > 20  # not saturated to a few values


def test_a_3x3_int8_filter_too_large_for_exact_float32_sums_is_not_summed_in_vectors(monkeypatch):
    """nhwc_3x3_vectors sums int8 data from -x_zero * the taps' sum through x * w: exact only while
    (|x_zero| + max |x|) * sum |w| < 2**24. A filter past that takes the other path: numpy's bits."""
    assert FC._vector_sums_exact(np.full((3, 3, 16), 127, np.float32), np.dtype(np.int8), -128)
    huge = np.full((3, 3, 16), 8000, np.float32)  # 256 * 9 * 8000 > 2**24
    assert not FC._vector_sums_exact(huge, np.dtype(np.int8), -128)
    rng = np.random.default_rng(3)
    x = rng.integers(-128, 128, (1, 6, 6, 16)).astype(np.int8)
    bias = np.zeros(16, np.float32)
    requantized = (np.full(16, 1e-6, np.float32), 0, np.int8)
    args = (huge, (1, 1), (1, 1), (1, 1, 1, 1), -128, bias, -128, 127, requantized)
    expected = FC.NUMPY["depthwise_nhwc_kernel"](*args)(x, np.empty((1, 6, 6, 16), np.int8))
    if FC.BACKEND == "numba":
        from execupy.kernels.fast import conv_shared_jit as S
        from execupy.kernels.fast.second_thread import SECOND_THREAD

        kernels = []
        run = SECOND_THREAD.run
        monkeypatch.setattr(SECOND_THREAD, "run", lambda kernel, a, *rest: (kernels.append(kernel), run(kernel, a, *rest)))
        got = FC.NUMBA["depthwise_nhwc_kernel"](*args)(x, np.empty((1, 6, 6, 16), np.int8))
        assert S.nhwc_3x3_shared not in kernels
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("acc_dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("bias_dtype", [np.float64, np.float32])
@pytest.mark.parametrize("storage, zero, lo, hi", [(np.int8, 3, -128, 127), (np.int8, -128, -128, 40),
                                                   (np.uint8, 128, 0, 255)])
def test_requantize_numba_equals_numpy(acc_dtype, bias_dtype, storage, zero, lo, hi):
    rng = np.random.default_rng(7)
    acc = rng.integers(-40000, 40000, (3, 5, 5, 24)).astype(acc_dtype)
    bias = rng.integers(-5000, 5000, 24).astype(bias_dtype)
    scale = (rng.random(24) * 4e-3).astype(np.float32)
    out = np.empty(acc.shape, storage)
    ours, reference = _run("requantize", (acc, bias, scale, zero, lo, hi), out)
    np.testing.assert_array_equal(ours, reference)
    assert ours.min() >= lo and ours.max() <= hi and len(np.unique(ours)) > 20
    # a float32 bias gives the float64 one's bits (the XNNPACK conv's fast case)
    np.testing.assert_array_equal(ours, FC.NUMPY["requantize"](acc.astype(np.float64), bias.astype(np.float64), scale,
                                                               zero, lo, hi, np.empty(acc.shape, storage)))


# rows past the last tile of 6: none, 1, 2, 3 (with an odd panel), 4, 5; a last panel of 16, 8, 1,
# 5, 12 or 13 columns (stored as whole vectors, whole halves and masked lanes)
GEMM_SHAPES = [(1, 27, 16), (5, 8, 48), (6, 16, 8), (7, 3, 17), (13, 96, 16), (100, 48, 288), (25, 160, 1000),
               (14, 8, 48), (15, 40, 33), (23, 24, 64), (8, 20, 12), (9, 12, 29)]


@pytest.mark.parametrize("m, k, n", GEMM_SHAPES)
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_gemm_kernel_numba_equals_numpy_within_rounding(m, k, n, epilogue):
    """A 1x1 conv's product + XNNPACK's epilogue: the tiles sum from the bias up with fmas, BLAS
    in its own order; the same values within float32 rounding, NaN where NaN, clamped alike."""
    rng = np.random.default_rng(m * k + n)
    rows = rng.standard_normal((m, k)).astype(np.float32)
    if m > 1:
        rows[m // 2, 0] = np.nan  # a NaN row stays NaN through the clamp
    w = rng.standard_normal((k, n)).astype(np.float32)
    args = _epilogue(epilogue, n, rng)
    args = args + (None, -np.inf, np.inf)[len(args):]
    ours, reference = FC.NUMBA["gemm_kernel"](w, *args)(rows), FC.NUMPY["gemm_kernel"](w, *args)(rows)
    assert ours.shape == reference.shape == (m, n) and ours.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(reference))
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    numbers = ours[~np.isnan(ours)]
    if epilogue in ("bias_relu6", "clamp_only") and numbers.size > 100:
        assert numbers.min() >= args[1] and numbers.max() <= args[2] and (numbers == args[2]).any()


@pytest.mark.parametrize("m, k, n", GEMM_SHAPES + [(6400, 8, 48), (4, 4, 5)])
@pytest.mark.parametrize("storage, zero, lo, hi", [(np.int8, -3, -128, 127), (np.uint8, 128, 0, 255)])
@pytest.mark.parametrize("data", [np.uint8, np.int8])
def test_gemm_kernel_of_an_int8_conv_equals_numpy_bit_for_bit(m, k, n, storage, zero, lo, hi, data, monkeypatch):
    """Integer data whose sums float32 holds (XNNPACK's int8 convs): the same exact sums in any
    order, so the float outputs and the requantized int8 ones are numpy's bits; the rows are
    read as they are, the filter shifted by its zero point. Where the CPU has VNNI and K is a
    multiple of 4, the requantized product runs as int8 tiles (vpdpbusd, int8 data read as
    x + 128): checked that it did."""
    from execupy.kernels.fast import conv_shared_jit as S
    from execupy.kernels.fast.vnni_jit import VNNI

    rng = np.random.default_rng(m + k * n)
    info = np.iinfo(data)
    rows = rng.integers(info.min, info.max + 1, (m, k)).astype(data)
    w = rng.integers(-128, 128, (k, n)).astype(np.float32)
    w[0, 0], w[-1, -1] = -128, 127  # the int8 range's ends
    sums = FC.NUMBA["gemm_kernel"](w, None, -np.inf, np.inf)(rows)
    np.testing.assert_array_equal(sums, rows.astype(np.int64) @ w.astype(np.int64))
    bias = rng.integers(-5000, 5000, n).astype(np.float32)
    scale = (rng.random(n) * (4e-4 if data == np.uint8 else 2e-3)).astype(np.float32)  # int8 data's sums are smaller
    requantized = (scale, zero, storage)
    int8_calls = []
    if VNNI:
        monkeypatch.setattr(S, "int8_shared", lambda *args, kernel=S.int8_shared: int8_calls.append(1) or kernel(*args))
    ours = FC.NUMBA["gemm_kernel"](w, bias, lo, hi, requantized)(rows)
    reference = FC.NUMPY["gemm_kernel"](w, bias, lo, hi, requantized)(rows)
    assert ours.dtype == reference.dtype == storage
    np.testing.assert_array_equal(ours, reference)
    assert ours.min() >= lo and ours.max() <= hi and len(np.unique(ours)) > min(20, m * n // 4)
    assert bool(int8_calls) == (VNNI and k % 4 == 0)


@pytest.mark.parametrize("data, x_zero", [(np.int8, -5), (np.uint8, 131), (np.int8, 0)])
@pytest.mark.parametrize("m, quads, n", [(37, 9, 16), (6, 2, 48), (25, 40, 100)])
def test_int8_windows_kernel_numba_equals_numpy(data, x_zero, m, quads, n):
    """Windows read four bytes at a time (an int8 conv's pixels of 4 channels, or 4 pixels of a
    row), x_zero taken off every input: the VNNI tiles' bytes are numpy's gather and matmul's."""
    from execupy.kernels.fast.vnni_jit import VNNI

    rng = np.random.default_rng(m + quads)
    info = np.iinfo(data)
    x = rng.integers(info.min, info.max + 1, 4000).astype(data)
    bases = rng.integers(0, 4000 - 4 * 60, m).astype(np.int64)  # windows overlap, as a conv's do
    offsets = rng.integers(0, 4 * 60, quads).astype(np.int64)
    w = rng.integers(-128, 128, (4 * quads, n)).astype(np.float32)
    bias, scale = rng.integers(-3000, 3000, n).astype(np.float32), (rng.random(n) * 2e-3).astype(np.float32)
    args = (w, bias, -128, 127, (scale, 4, np.int8), x_zero)
    reference = FC.NUMPY["int8_windows_kernel"](*args)(x, bases, offsets)
    ours = FC.NUMBA["int8_windows_kernel"](*args)
    if not VNNI:
        assert ours is None
        return
    np.testing.assert_array_equal(ours(x, bases, offsets), reference)
    assert len(np.unique(reference)) > 20


def test_int8_convs_give_the_same_bytes_with_and_without_the_vnni_tiles(monkeypatch):
    """ExecuTorch's int8 XNNPACK programs (the conformance corpus) and one of ours: each conv's
    int32 tiles (1x1 convs, an image's 3x3 conv read as rows of 4 pixels) give the bytes of the
    float32 tiles they replace (monkeypatched off: vnni_jit.VNNI read as False)."""
    from execupy.kernels.fast import conv_shared_jit as S, vnni_jit
    from execupy.runtime import Module
    from tests.conformance import cases, flatten, load_inputs

    programs = [(c.pte, load_inputs(c, c.manifest["runs"][0])) for c in cases("quant_xnnpack")
                if "conv" in c.name or "cnn" in c.name or "mobilenet" in c.name]
    if not programs:
        pytest.skip("ExecuTorch's conformance corpus is not here")
    calls = []
    if vnni_jit.VNNI:
        monkeypatch.setattr(S, "int8_shared", lambda *args, kernel=S.int8_shared: calls.append(1) or kernel(*args))
    with_tiles = [flatten(Module(pte).forward(*inputs)) for pte, inputs in programs]
    assert bool(calls) == vnni_jit.VNNI
    monkeypatch.setattr(vnni_jit, "VNNI", False)
    without = [flatten(Module(pte).forward(*inputs)) for pte, inputs in programs]
    for ours, theirs in zip(with_tiles, without, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("size, channels, k, stride, dilation", [(12, 3, 3, 2, 1), (9, 8, 3, 1, 2), (7, 5, 2, 1, 1)])
@pytest.mark.parametrize("requantize", [False, True])
def test_windows_kernel_reads_a_convs_windows_in_place(size, channels, k, stride, dilation, requantize):
    """An im2col convolution without the im2col: rows gathered from the padded input by offsets.
    The same as the numpy gather (bit for bit on int8 data), and the convolution itself."""
    rng = np.random.default_rng(size * channels)
    xp = rng.integers(-20, 20, (2, size, size, channels)).astype(np.float32)
    w = rng.integers(-9, 10, (k * k * channels, 16 + channels)).astype(np.float32)  # rows in (KH, KW, Cin) order
    o = _out_size(size, k, stride, dilation, 0)
    sn, sh = size * size * channels, size * channels
    bases = (np.arange(2)[:, None, None] * sn + np.arange(o)[None, :, None] * stride * sh
             + np.arange(o)[None, None, :] * stride * channels).reshape(-1).astype(np.int64)
    offsets = (np.arange(k)[:, None, None] * dilation * sh + np.arange(k)[None, :, None] * dilation * channels
               + np.arange(channels)[None, None, :]).reshape(-1).astype(np.int64)
    n = w.shape[1]
    args = (np.zeros(n, np.float32), -128, 127, ((rng.random(n) * 0.01).astype(np.float32), 3, np.int8)) if requantize \
        else (None, -np.inf, np.inf)
    ours = FC.NUMBA["windows_kernel"](w, *args)(xp, bases, offsets)
    np.testing.assert_array_equal(ours, FC.NUMPY["windows_kernel"](w, *args)(xp, bases, offsets))
    if not requantize:
        exact = sum(xp[:, i * dilation: i * dilation + (o - 1) * stride + 1: stride,
                       j * dilation: j * dilation + (o - 1) * stride + 1: stride] @ w.reshape(k, k, channels, n)[i, j]
                    for i in range(k) for j in range(k))
        np.testing.assert_array_equal(ours.reshape(2, o, o, n), exact)


def test_a_bias_float32_cannot_hold_must_stay_float64():
    """float32 sums + a float32 bias is the float64 sum rounded once (the same bits) as long as the
    bias is a float32 value; 2**24 + 1 is not, and rounding it first changes the result."""
    acc, bias = np.array([[1.0]], np.float32), np.array([2.0 ** 24 + 1])
    scale = np.array([1.0], np.float32)
    exact = FC.NUMBA["requantize"](acc, bias, scale, 0, -1e9, 1e9, np.empty((1, 1), np.float64))
    rounded = FC.NUMBA["requantize"](acc, bias.astype(np.float32), scale, 0, -1e9, 1e9, np.empty((1, 1), np.float64))
    assert exact[0, 0] == 2.0 ** 24 + 2 and rounded[0, 0] == 2.0 ** 24


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
FC.NUMBA["depthwise_nhwc"](x.transpose(0, 2, 3, 1).copy(), np.ones((3, 3, 2), np.float32), (2, 2), (1, 1), (1, 1, 1, 1),
                           0, np.empty((1, 3, 3, 2), np.float32))  # strided: its input split by column phase
FC.NUMBA["bias_clamp"](np.ones((4, 3), np.float32), np.ones(3, np.float32), 0.0, 6.0)
FC.NUMBA["depthwise_nhwc"](np.ones((1, 5, 5, 32), np.float32), np.ones((3, 3, 32), np.float32), (1, 1), (1, 1),
                           (1, 1, 1, 1), 3, np.empty((1, 5, 5, 32), np.float32))  # float data with a zero point: pixel by pixel
FC.NUMBA["pad_into"](np.ones((1, 2, 2, 3), np.float32), 0, 1, 1, np.zeros((1, 4, 4, 3), np.float32))
FC.NUMBA["depthwise_nhwc"](np.ones((1, 5, 5, 16), np.float32), np.ones((3, 3, 16), np.float32), (1, 1), (1, 1),
                           (1, 1, 1, 1), 0, np.empty((1, 5, 5, 16), np.float32))  # 16 channels a vector
"""

SHARED_CACHE_PROBE = """
import numpy as np
from execupy.kernels.fast import conv as FC, conv_shared_jit as K
w = np.ones((3, 20), np.float32)
FC.NUMBA["gemm_kernel"](w, None, 0.0, 6.0)(np.ones((7, 3), np.float32))
FC.NUMBA["gemm_kernel"](w, np.zeros(20, np.float32), -128, 127, (np.ones(20, np.float32), 0, np.int8))(np.ones((7, 3), np.uint8))
FC.NUMBA["gemm_kernel"](np.ones((4, 20), np.float32), np.zeros(20, np.float32), -128, 127,
                        (np.ones(20, np.float32), 0, np.int8))(np.ones((7, 4), np.int8))  # int8 tiles, where VNNI
bases, offsets = np.arange(7, dtype=np.int64), np.arange(3, dtype=np.int64)
FC.NUMBA["windows_kernel"](w, None, 0.0, 6.0)(np.ones(10, np.float32), bases, offsets)
FC.NUMBA["windows_kernel"](w, np.zeros(20, np.float32), -128, 127, (np.ones(20, np.float32), 0, np.int8))(
    np.ones(10, np.float32), bases, offsets)
FC.NUMBA["depthwise_nhwc"](np.ones((1, 5, 5, 16), np.float32), np.ones((3, 3, 16), np.float32), (1, 1), (1, 1),
                           (1, 1, 1, 1), 0, np.empty((1, 5, 5, 16), np.float32))  # 16 channels a vector
"""


def test_a_second_process_finds_every_conv_kernel_in_numbas_cache(tmp_path):
    """Compiled once per machine: the depthwise kernels call inlined helpers, which as closures
    made them miss numba's disk cache in every new process."""
    from tests.numba_cache import two_processes_cache_stats

    first, second = two_processes_cache_stats(CACHE_PROBE, tmp_path)
    assert set(first) == {"nchw", "split_columns", "nhwc", "nhwc_3x3", "bias_clamp_flat", "pad_into", "requantize_rows"}
    assert all(misses > 0 for _, misses in first.values())
    assert all(hits > 0 and misses == 0 for hits, misses in second.values())


def test_a_second_process_finds_the_gemm_and_shared_conv_kernels_in_numbas_cache(tmp_path):
    from tests.numba_cache import two_processes_cache_stats

    first, second = two_processes_cache_stats(SHARED_CACHE_PROBE, tmp_path)
    from execupy.kernels.fast.vnni_jit import VNNI

    assert set(first) == {"windows_shared", "nhwc_3x3_shared"} | ({"int8_shared"} if VNNI else set())
    assert all(misses > 0 for _, misses in first.values())
    assert all(hits > 0 and misses == 0 for hits, misses in second.values())


# ---------------------------------------------------------------- both cores: chunks of rows (or panels)

def _thread_part(cfunc, job: np.ndarray, xbuf: np.ndarray) -> None:
    """Run a chunked job's C function here, as the second core's thread runs it: it takes every
    chunk left, from the back."""
    import ctypes

    call = ctypes.CFUNCTYPE(None, *[ctypes.c_int64] * 12)(cfunc.address)
    call(job.ctypes.data, 0, 0, 0, 0, 0, 0, 0, xbuf.ctypes.data, xbuf.size, 0, 0)


def _windows_case(m: int, k: int, n: int, requantize: bool, seed: int = 0):
    from execupy.kernels.fast import gemm_jit as G

    rng = np.random.default_rng(seed)
    x = rng.integers(-60, 60, m * k).astype(np.float32)
    w = G.panels(rng.integers(-9, 10, (k, n)).astype(np.float32))
    bias = rng.integers(-500, 500, w.shape[0] * 16).astype(np.float32)
    scale = (rng.random(w.shape[0] * 16) * 0.01).astype(np.float32)
    f32 = np.float32
    consts = (f32(3), f32(-128), f32(127)) if requantize else (f32(0), f32(-50), f32(50))
    args = (x, np.arange(0, m * k, k, dtype=np.int64), np.arange(k, dtype=np.int64), w, bias, scale, *consts, requantize)
    return args, (lambda: np.empty((m, n), np.int8 if requantize else np.float32))


@pytest.mark.skipif(not getattr(FC, "BACKEND", "") == "numba", reason="numba only")
@pytest.mark.parametrize("m, k, n", [(100, 8, 48), (6400, 3, 16), (7, 16, 300), (25, 160, 1280), (13, 5, 17)])
@pytest.mark.parametrize("requantize", [False, True])
def test_the_second_threads_part_of_a_gemm_computes_what_one_thread_does(m, k, n, requantize):
    """The C function the second core's thread runs rebuilds the call from the job block alone;
    taking every chunk (rows here, panels for a wide filter over few rows) it writes the same
    bits as the plain one-thread call."""
    from execupy.kernels.fast import conv_shared_jit as S, gemm_jit as G

    if S.WINDOWS_CHUNKS is None:
        pytest.skip("no FMA: the GEMM tiles do not run")
    args, new_out = _windows_case(m, k, n, requantize)
    expected, ours = new_out(), new_out()
    G.windows_product(*args, expected)
    job, xbuf = np.zeros(S.JOB_SLOTS, np.int64), np.zeros(8, np.float32)
    S.windows_job(job, xbuf, *args, ours, 1)
    _thread_part(S.WINDOWS_CHUNKS, job, xbuf)
    np.testing.assert_array_equal(ours, expected)
    assert len(np.unique(expected)) > 10


def _int8_case(m: int, k: int, n: int, seed: int = 0):
    """int8_block's arguments but out (int8 data: its bytes flipped), and a new out."""
    from execupy.kernels.fast import gemm_jit as G

    rng, f32 = np.random.default_rng(seed), np.float32
    w = G.int8_panels(rng.integers(-128, 128, (k, n)).astype(np.int8))
    width = w.shape[0] * 16
    args = (rng.integers(-128, 128, m * k).astype(np.int8), np.arange(0, m * k, k, dtype=np.int64),
            np.arange(0, k, 4, dtype=np.int64), w, rng.integers(-5000, 5000, width).astype(np.int32),
            rng.integers(-500, 500, width).astype(f32), (rng.random(width) * 0.002).astype(f32), f32(3), f32(-128),
            f32(127), np.int32(-0x7F7F7F80))
    return args, (lambda: np.empty((m, n), np.int8))


@pytest.mark.skipif(not getattr(FC, "BACKEND", "") == "numba", reason="numba only")
@pytest.mark.parametrize("m, k, n", [(100, 8, 48), (6400, 4, 16), (7, 16, 300), (25, 160, 1280), (13, 12, 17)])
def test_the_second_threads_part_of_an_int8_gemm_computes_what_one_thread_does(m, k, n):
    """The int8 tiles (VNNI) in chunks: the thread's C function, taking every chunk, writes the
    one-thread call's bytes."""
    from execupy.kernels.fast import conv_shared_jit as S, gemm_jit as G

    if S.INT8_CHUNKS is None:
        pytest.skip("no VNNI: the int8 tiles do not run")
    args, new_out = _int8_case(m, k, n)
    expected, ours = new_out(), new_out()
    G.int8_block(*args, expected, 0, m, 0, args[3].shape[0])
    job, xbuf = np.zeros(S.JOB_SLOTS, np.int64), np.zeros(8, np.float32)
    S.int8_job(job, xbuf, *args, ours)
    _thread_part(S.INT8_CHUNKS, job, xbuf)
    np.testing.assert_array_equal(ours, expected)
    assert len(np.unique(expected)) > 10


@pytest.mark.skipif(not getattr(FC, "BACKEND", "") == "numba", reason="numba only")
@pytest.mark.parametrize("transpose_b", [True, False])
@pytest.mark.parametrize("h, m, k, n", [(4, 128, 64, 128), (3, 7, 5, 20), (2, 30, 16, 100)])
def test_a_batch_of_products_is_one_job_whose_chunks_give_each_products_bits(transpose_b, h, m, k, n):
    """An encoder's attention (queries @ keys.T, probabilities @ values): each B laid out as the
    tiles' panels (batch_panels: panels() of each), the batch one job; the thread's C function,
    taking every chunk, writes each product's one-thread bits, and those are BLAS's within float32
    rounding."""
    from execupy.kernels.fast import conv_shared_jit as S, gemm_jit as G

    if S.WINDOWS_CHUNKS is None:
        pytest.skip("no FMA: the GEMM tiles do not run")
    rng = np.random.default_rng(h * m + n)
    a = rng.standard_normal((h, m, k)).astype(np.float32)
    b = rng.standard_normal((h, n, k) if transpose_b else (h, k, n)).astype(np.float32)
    matrices = [b[i].T if transpose_b else b[i] for i in range(h)]
    p = -(-n // 16)
    w = np.full((h * p, k, 16), np.nan, np.float32)
    G.batch_panels(b, transpose_b, w)
    np.testing.assert_array_equal(w, np.concatenate([G.panels(np.ascontiguousarray(B)) for B in matrices]))
    f32, zeros = np.float32, np.zeros(p * 16, np.float32)
    bases, offsets = np.arange(0, m * k, k, dtype=np.int64), np.arange(k, dtype=np.int64)
    expected = np.stack([np.empty((m, n), np.float32) for _ in range(h)])
    for i in range(h):
        G.windows_product(a[i].reshape(-1), bases, offsets, w[i * p:(i + 1) * p], zeros, zeros, f32(0), f32(-np.inf),
                          f32(np.inf), False, expected[i])
    np.testing.assert_allclose(expected, np.matmul(a, np.stack(matrices)), rtol=1e-5, atol=1e-5)
    ours = np.full((h * m, n), np.nan, np.float32)
    job, xbuf = np.zeros(S.JOB_SLOTS, np.int64), np.zeros(8, np.float32)
    S.windows_job(job, xbuf, a.reshape(-1), bases, offsets, w, zeros, zeros, f32(0), f32(-np.inf), f32(np.inf), False,
                  ours, h)
    _thread_part(S.WINDOWS_CHUNKS, job, xbuf)
    np.testing.assert_array_equal(ours.reshape(h, m, n), expected)
    product = FC.batch_product_kernel(transpose_b)  # the kernel the nodes call: both cores where the rule allows
    for _ in range(5):
        np.testing.assert_array_equal(product(a, b), expected)


@pytest.mark.skipif(not getattr(FC, "BACKEND", "") == "numba", reason="numba only")
@pytest.mark.parametrize("dtype, requantized", [(np.float32, False), (np.int8, False), (np.uint8, False),
                                                (np.int8, True), (np.uint8, True)])
@pytest.mark.parametrize("size, c, stride", [(20, 16, 1), (11, 40, 2), (5, 288, 1)])
def test_the_second_threads_part_of_a_depthwise_conv_computes_what_one_thread_does(dtype, requantized, size, c, stride):
    from execupy.kernels.fast import conv_jit as K, conv_shared_jit as S

    rng = np.random.default_rng(size * c)
    x = (rng.standard_normal((2, size, size, c)) * 3).astype(np.float32) if dtype == np.float32 \
        else rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, (2, size, size, c)).astype(dtype)
    w = rng.standard_normal((3, 3, c)).astype(np.float32)
    o = _out_size(size, 3, stride, 1, 1)
    xz = 0 if dtype == np.float32 else 5
    padded, f32 = np.full(c, xz, dtype), np.float32
    if requantized:  # integer sums (integer weights), requantized into x's own type
        w, bias = np.rint(w * 40), rng.integers(-900, 900, c).astype(np.float32)
        scale, zero, lo, hi = (rng.random(c) * 0.01).astype(f32), f32(7), np.iinfo(dtype).min, np.iinfo(dtype).max
        out_dtype = dtype
    else:
        bias, scale, zero, lo, hi, out_dtype = rng.standard_normal(c).astype(f32), np.empty(0, f32), f32(0), -4, 4, f32
    args = (x, padded, f32(xz), w, bias, scale, zero, f32(lo), f32(hi), stride, stride, 1, 1, 1, 1)
    expected, ours = np.empty((2, o, o, c), out_dtype), np.empty((2, o, o, c), out_dtype)
    K.nhwc_3x3_vectors(*args, expected)
    kind = S.KINDS[np.dtype(dtype), np.dtype(out_dtype)]
    job, xbuf = np.zeros(S.JOB_SLOTS, np.int64), np.zeros(8, np.float32)
    S.nhwc_3x3_job(job, xbuf, kind, *args, ours)
    _thread_part(S.NHWC_3X3_CHUNKS[kind], job, xbuf)
    np.testing.assert_array_equal(ours.view(np.uint8), expected.view(np.uint8))


@pytest.mark.skipif(not getattr(FC, "BACKEND", "") == "numba", reason="numba only")
def test_convs_shared_with_the_second_thread_give_one_threads_bits():
    """The real thread, awake: each call's chunks split between the two as they come (the split
    differs from call to call), the outputs always the one-thread call's."""
    from execupy.kernels.fast import conv_jit as K, conv_shared_jit as S, gemm_jit as G
    from execupy.kernels.fast.second_thread import SECOND_THREAD

    if S.WINDOWS_CHUNKS is None:
        pytest.skip("no FMA: the GEMM tiles do not run")
    cases = [_windows_case(m, k, n, q, seed=m) for m, k, n, q in [(600, 8, 48, False), (30, 16, 300, True)]]
    int8_case = _int8_case(600, 16, 48)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 24, 24, 32)).astype(np.float32)
    w, bias, f32 = rng.standard_normal((3, 3, 32)).astype(np.float32), np.zeros(32, np.float32), np.float32
    dw_args = (x, np.zeros(32, np.float32), f32(0), w, bias, np.empty(0, f32), f32(0), f32(-np.inf), f32(np.inf),
               1, 1, 1, 1, 1, 1)
    dw_expected = np.empty((1, 24, 24, 32), np.float32)
    K.nhwc_3x3_vectors(*dw_args, dw_expected)
    for _ in range(30):
        for args, new_out in cases:
            expected, ours = new_out(), new_out()
            G.windows_product(*args, expected)
            SECOND_THREAD.call(S.windows_shared, (S.WINDOWS_CHUNKS.address, SECOND_THREAD.job, *args, ours, 1), True)
            np.testing.assert_array_equal(ours, expected)
        if S.INT8_CHUNKS is not None:
            args, new_out = int8_case
            expected, ours = new_out(), new_out()
            G.int8_block(*args, expected, 0, args[1].shape[0], 0, args[3].shape[0])
            SECOND_THREAD.call(S.int8_shared, (S.INT8_CHUNKS.address, SECOND_THREAD.job, *args, ours), True)
            np.testing.assert_array_equal(ours, expected)
        ours = np.empty_like(dw_expected)
        SECOND_THREAD.call(S.nhwc_3x3_shared, (S.NHWC_3X3_CHUNKS[0].address, SECOND_THREAD.job, 0, *dw_args, ours), True)
        np.testing.assert_array_equal(ours.view(np.uint32), dw_expected.view(np.uint32))
