"""Spatial kernels (convolution, pooling, upsampling, grid sampling) against torch on seeded
random inputs. Kernels are fetched from the registry by their ExecuTorch operator key and
called the way the runtime calls them: positional arguments, then the planned `out`."""
import ml_dtypes
import numpy as np
import pytest
import torch

from execupy.kernels.portable.pool import pooling_output_size
from execupy.kernels.registry import get_kernel

aten = torch.ops.aten
FLOATS = [np.float32, np.float64, np.float16]


def kernel(key):
    fn = get_kernel(key)
    assert fn is not None, f"{key} is not registered"
    return fn


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def oracle(fn, *arrays, dtype):
    """torch result for numpy inputs; half inputs are evaluated in float32 (as the kernels
    compute them) and rounded once at the end."""
    wide = np.float32 if dtype == np.float16 else dtype
    tensors = [None if a is None else torch.from_numpy(a.astype(wide)) for a in arrays]
    result = fn(*tensors)
    if isinstance(result, tuple):
        return tuple(r.numpy() for r in result)
    return result.numpy().astype(dtype)


def tolerance(dtype):
    return {np.float64: 1e-10, np.float32: 1e-5, np.float16: 2e-3}[dtype]


def call_into_out(key, *args, shape, dtype):
    """Run a one-output kernel into a fresh planned buffer and check it wrote in place."""
    out = np.full(shape, 7, dtype=dtype)
    result = kernel(key)(*args, out)
    assert result is out, "a result of the planned shape must be written into out"
    return result


# ----------------------------------------------------------------------------- convolution

CONV_CASES = [
    # input shape, weight shape, stride, padding, dilation, groups
    ((2, 4, 16), (6, 4, 3), [2], [1], [2], 1),
    ((2, 4, 16), (6, 2, 5), [1], [2], [1], 2),
    ((1, 3, 9, 11), (8, 3, 3, 3), [1, 1], [1, 1], [1, 1], 1),
    ((2, 4, 9, 11), (8, 4, 3, 2), [2, 1], [1, 0], [1, 2], 1),
    ((2, 6, 10, 7), (6, 2, 3, 3), [1, 2], [0, 1], [2, 1], 3),
    ((2, 8, 9, 9), (8, 1, 3, 3), [2, 2], [1, 1], [1, 1], 8),  # depthwise
    ((1, 4, 7, 7), (12, 1, 3, 3), [1, 1], [1, 1], [1, 1], 4),  # depthwise, channel multiplier 3
    ((1, 1, 6, 6), (5, 1, 2, 2), [1, 1], [0, 0], [1, 1], 1),  # one input channel
    ((1, 3, 5, 6, 7), (4, 3, 2, 3, 2), [1, 2, 1], [1, 0, 1], [1, 1, 2], 1),  # 3-D
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("xs,ws,stride,padding,dilation,groups", CONV_CASES)
def test_convolution_matches_torch(xs, ws, stride, padding, dilation, groups, dtype):
    rng = np.random.default_rng(len(xs) * 100 + ws[0])
    x, w, b = randn(rng, xs, dtype), randn(rng, ws, dtype), randn(rng, (ws[0],), dtype)
    for bias in (b, None):
        expected = oracle(lambda x, w, b: aten.convolution(x, w, b, stride, padding, dilation, False, [0], groups),
                          x, w, bias, dtype=dtype)
        actual = call_into_out("aten::convolution.out", x, w, bias, stride, padding, dilation, False, [0], groups,
                               shape=expected.shape, dtype=dtype)
        np.testing.assert_allclose(actual, expected, rtol=tolerance(dtype), atol=tolerance(dtype))


TRANSPOSED_CASES = [
    # input shape, weight shape (Cin, Cout/groups, *K), stride, padding, dilation, output_padding, groups
    ((2, 4, 7), (4, 3, 3), [2], [1], [1], [1], 1),
    ((2, 4, 7), (4, 2, 3), [3], [1], [1], [2], 2),
    ((2, 4, 5, 6), (4, 3, 3, 3), [2, 2], [1, 1], [1, 1], [1, 1], 1),
    ((2, 4, 5, 6), (4, 2, 3, 2), [2, 1], [0, 1], [2, 2], [1, 0], 2),
    ((1, 6, 4, 4), (6, 1, 4, 4), [2, 2], [1, 1], [1, 1], [0, 0], 6),  # depthwise upsampling
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("xs,ws,stride,padding,dilation,output_padding,groups", TRANSPOSED_CASES)
def test_transposed_convolution_matches_torch(xs, ws, stride, padding, dilation, output_padding, groups, dtype):
    rng = np.random.default_rng(7 + len(xs))
    x, w, b = randn(rng, xs, dtype), randn(rng, ws, dtype), randn(rng, (ws[1] * groups,), dtype)
    expected = oracle(lambda x, w, b: aten.convolution(x, w, b, stride, padding, dilation, True, output_padding,
                                                       groups), x, w, b, dtype=dtype)
    actual = call_into_out("aten::convolution.out", x, w, b, stride, padding, dilation, True, output_padding, groups,
                           shape=expected.shape, dtype=dtype)
    np.testing.assert_allclose(actual, expected, rtol=tolerance(dtype), atol=tolerance(dtype))


def test_integer_convolution_is_exact():
    rng = np.random.default_rng(3)
    x = rng.integers(-5, 6, (1, 2, 6, 6)).astype(np.int32)
    w = rng.integers(-3, 4, (4, 2, 3, 3)).astype(np.int32)
    expected = aten.convolution(torch.from_numpy(x).double(), torch.from_numpy(w).double(), None,
                                [1, 1], [1, 1], [1, 1], False, [0], 1).numpy()
    actual = call_into_out("aten::convolution.out", x, w, None, [1, 1], [1, 1], [1, 1], False, [0], 1,
                           shape=expected.shape, dtype=np.int32)
    np.testing.assert_array_equal(actual, expected.astype(np.int32))


def test_convolution_propagates_nan_only_to_its_receptive_field():
    x = np.zeros((1, 1, 5, 5), np.float32)
    x[0, 0, 0, 0] = np.nan
    w = np.ones((1, 1, 3, 3), np.float32)
    y = kernel("aten::convolution.out")(x, w, None, [1, 1], [0, 0], [1, 1], False, [0], 1,
                                        np.empty((1, 1, 3, 3), np.float32))
    assert np.isnan(y[0, 0, 0, 0]) and np.count_nonzero(np.isnan(y)) == 1


def test_convolution_rejects_channel_mismatch():
    with pytest.raises(ValueError, match="channels"):
        kernel("aten::convolution.out")(np.zeros((1, 3, 5, 5), np.float32), np.zeros((2, 2, 3, 3), np.float32),
                                        None, [1, 1], [0, 0], [1, 1], False, [0], 1, np.empty((1, 2, 3, 3), np.float32))


# ----------------------------------------------------------------------------- pooling


def test_pooling_output_size_follows_aten_including_ceil_mode():
    for size in range(1, 12):
        for kernel_size in range(1, 5):
            for stride in range(1, 4):
                for pad in range(0, kernel_size // 2 + 1):
                    for ceil_mode in (False, True):
                        if size + 2 * pad < kernel_size:
                            continue
                        x = torch.zeros(1, 1, size)
                        expected = torch.nn.functional.max_pool1d(x, kernel_size, stride, pad,
                                                                  ceil_mode=ceil_mode).shape[-1]
                        assert pooling_output_size(size, kernel_size, pad, stride, 1, ceil_mode) == expected


AVG_CASES = [
    # kernel, stride, padding, ceil_mode, count_include_pad, divisor_override
    ([3, 3], [2, 2], [1, 1], False, False, None),
    ([2, 2], [], [0, 0], False, True, None),
    ([3], [2], [1], True, True, None),
    ([3, 3], [2, 2], [1, 1], True, False, None),
    ([2, 3], [2, 2], [1, 1], True, True, 5),
    ([4, 2], [3, 1], [2, 0], True, False, None),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kernel_size,stride,padding,ceil_mode,include_pad,divisor", AVG_CASES)
def test_avg_pool2d_matches_torch(kernel_size, stride, padding, ceil_mode, include_pad, divisor, dtype):
    x = randn(np.random.default_rng(11), (2, 3, 7, 9), dtype)
    args = (kernel_size, stride, padding, ceil_mode, include_pad, divisor)
    expected = oracle(lambda t: aten.avg_pool2d(t, *args), x, dtype=dtype)
    actual = call_into_out("aten::avg_pool2d.out", x, *args, shape=expected.shape, dtype=dtype)
    np.testing.assert_allclose(actual, expected, rtol=tolerance(dtype), atol=tolerance(dtype))


MAX_CASES = [
    # kernel, stride, padding, dilation, ceil_mode
    ([3, 3], [2, 2], [1, 1], [1, 1], False),
    ([2, 2], [], [0, 0], [1, 1], True),
    ([3, 2], [2, 3], [1, 1], [2, 1], True),
    ([3, 3], [1, 1], [1, 1], [2, 2], False),
    ([2], [1], [1], [3], True),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kernel_size,stride,padding,dilation,ceil_mode", MAX_CASES)
def test_max_pool2d_with_indices_matches_torch(kernel_size, stride, padding, dilation, ceil_mode, dtype):
    x = randn(np.random.default_rng(5), (2, 3, 7, 9), dtype)
    x[0, 0, 2, 3:5] = np.nan  # NaN wins, the last NaN of a window gives the index
    x[1, 1, :3, :3] = -np.inf  # windows with nothing above the padding value
    x[1, 2, 4, :] = x[1, 2, 5, :]  # ties keep the first position
    args = (kernel_size, stride, padding, dilation, ceil_mode)
    values, indices = oracle(lambda t: aten.max_pool2d_with_indices(t, *args), x, dtype=dtype)
    out, idx = np.empty(values.shape, dtype), np.empty(indices.shape, np.int64)
    got_values, got_indices = kernel("aten::max_pool2d_with_indices.out")(x, *args, out, idx)
    assert got_values is out and got_indices is idx
    np.testing.assert_array_equal(got_values, values.astype(dtype))
    np.testing.assert_array_equal(got_indices, indices)


def test_max_pool2d_accepts_unbatched_and_integer_input():
    x = np.random.default_rng(9).integers(-100, 100, (3, 6, 6)).astype(np.int64)
    values, indices = aten.max_pool2d_with_indices(torch.from_numpy(x), [3, 3], [2, 2], [1, 1])
    out, idx = np.empty(values.shape, np.int64), np.empty(values.shape, np.int64)
    kernel("aten::max_pool2d_with_indices.out")(x, [3, 3], [2, 2], [1, 1], [1, 1], False, out, idx)
    np.testing.assert_array_equal(out, values.numpy())
    np.testing.assert_array_equal(idx, indices.numpy())


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("output_size", [(1, 1), (2, 3), (4, 5), (7, 9), (5, 4)])
def test_adaptive_pooling_matches_torch(output_size, dtype):
    x = randn(np.random.default_rng(2), (2, 3, 7, 9), dtype)
    x[0, 1, 3, 3] = np.nan
    expected = oracle(lambda t: aten._adaptive_avg_pool2d(t, output_size), x, dtype=dtype)
    actual = call_into_out("aten::_adaptive_avg_pool2d.out", x, output_size, shape=expected.shape, dtype=dtype)
    np.testing.assert_allclose(actual, expected, rtol=tolerance(dtype), atol=tolerance(dtype))

    values, indices = oracle(lambda t: aten.adaptive_max_pool2d(t, output_size), x, dtype=dtype)
    out, idx = np.empty(values.shape, dtype), np.empty(indices.shape, np.int64)
    kernel("aten::adaptive_max_pool2d.out")(x, output_size, out, idx)
    np.testing.assert_array_equal(out, values.astype(dtype))
    np.testing.assert_array_equal(idx, indices)


def test_3d_pooling_matches_torch():
    x = randn(np.random.default_rng(4), (1, 2, 5, 6, 7), np.float32)
    expected = aten.avg_pool3d(torch.from_numpy(x), [2, 3, 2], [2, 2, 1], [1, 1, 0], True, False).numpy()
    actual = call_into_out("aten::avg_pool3d.out", x, [2, 3, 2], [2, 2, 1], [1, 1, 0], True, False, None,
                           shape=expected.shape, dtype=np.float32)
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)
    values, indices = aten.max_pool3d_with_indices(torch.from_numpy(x), [3, 2, 2], [2, 1, 2], [1, 0, 1])
    out, idx = np.empty(values.shape, np.float32), np.empty(values.shape, np.int64)
    kernel("aten::max_pool3d_with_indices.out")(x, [3, 2, 2], [2, 1, 2], [1, 0, 1], [1], False, out, idx)
    np.testing.assert_array_equal(out, values.numpy())
    np.testing.assert_array_equal(idx, indices.numpy())


def test_integer_avg_pool2d_truncates_like_aten():
    x = np.random.default_rng(10).integers(-50, 50, (1, 2, 5, 5)).astype(np.int64)
    expected = aten.avg_pool2d(torch.from_numpy(x), [2, 2], [2, 2], [1, 1], False, True, None).numpy()
    actual = call_into_out("aten::avg_pool2d.out", x, [2, 2], [2, 2], [1, 1], False, True, None,
                           shape=expected.shape, dtype=np.int64)
    np.testing.assert_array_equal(actual, expected)


def test_bfloat16_spatial_kernels_compute_in_float32():
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(14)
    x, w = randn(rng, (1, 4, 6, 6), bf16), randn(rng, (4, 2, 3, 3), bf16)
    tx, tw = (torch.from_numpy(a.astype(np.float32)).bfloat16() for a in (x, w))
    expected = aten.convolution(tx, tw, None, [1, 1], [1, 1], [1, 1], False, [0], 2).float().numpy()
    actual = call_into_out("aten::convolution.out", x, w, None, [1, 1], [1, 1], [1, 1], False, [0], 2,
                           shape=expected.shape, dtype=bf16)
    np.testing.assert_allclose(actual.astype(np.float32), expected, rtol=1e-2, atol=1e-2)
    expected = aten.upsample_bilinear2d.vec(tx, None, False, [2.0, 2.0]).float().numpy()
    actual = call_into_out("aten::upsample_bilinear2d.vec_out", x, None, False, [2.0, 2.0], shape=expected.shape,
                           dtype=bf16)
    np.testing.assert_allclose(actual.astype(np.float32), expected, rtol=1e-2, atol=1e-2)


def test_pooling_rejects_oversized_padding():
    with pytest.raises(ValueError, match="half"):
        kernel("aten::avg_pool2d.out")(np.zeros((1, 1, 5, 5), np.float32), [2, 2], [1, 1], [2, 2], False, True, None,
                                       np.empty((1, 1, 8, 8), np.float32))


# ----------------------------------------------------------------------------- upsampling

SIZES = [((10, 14), None), ((7, 9), None), ((3, 4), None), (None, (2.0, 2.0)), (None, (1.5, 2.3)),
         (None, (0.6, 0.3))]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("output_size,scales", SIZES)
def test_nearest_upsampling_matches_torch(output_size, scales, dtype):
    x = randn(np.random.default_rng(1), (2, 3, 5, 7), dtype)
    for key, op in (("aten::upsample_nearest2d.vec_out", aten.upsample_nearest2d.vec),
                    ("aten::_upsample_nearest_exact2d.vec_out", aten._upsample_nearest_exact2d.vec)):
        expected = oracle(lambda t: op(t, output_size, scales), x, dtype=dtype)
        actual = call_into_out(key, x, output_size, scales, shape=expected.shape, dtype=dtype)
        np.testing.assert_array_equal(actual, expected)  # a gather: bit for bit


def test_nearest_upsampling_keeps_integers():
    x = np.arange(12, dtype=np.int64).reshape(1, 1, 3, 4)
    actual = call_into_out("aten::upsample_nearest2d.out", x, [6, 8], None, None, shape=(1, 1, 6, 8),
                           dtype=np.int64)
    np.testing.assert_array_equal(actual, x.repeat(2, axis=2).repeat(2, axis=3))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("output_size,scales", SIZES)
def test_bilinear_and_bicubic_upsampling_match_torch(output_size, scales, align_corners, dtype):
    x = randn(np.random.default_rng(6), (2, 3, 5, 7), dtype)
    for key, op in (("aten::upsample_bilinear2d.vec_out", aten.upsample_bilinear2d.vec),
                    ("aten::upsample_bicubic2d.vec_out", aten.upsample_bicubic2d.vec)):
        expected = oracle(lambda t: op(t, output_size, align_corners, scales), x, dtype=dtype)
        actual = call_into_out(key, x, output_size, align_corners, scales, shape=expected.shape, dtype=dtype)
        np.testing.assert_allclose(actual, expected, rtol=tolerance(dtype), atol=10 * tolerance(dtype))


def test_sized_overloads_take_per_dim_scales():
    x = randn(np.random.default_rng(8), (1, 2, 5, 7), np.float32)
    t = torch.from_numpy(x)
    expected = aten.upsample_bilinear2d(t, [9, 11], False, 1.9, 1.7).numpy()
    actual = call_into_out("aten::upsample_bilinear2d.out", x, [9, 11], False, 1.9, 1.7, shape=expected.shape,
                           dtype=np.float32)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    expected = aten.upsample_linear1d(t[0], [13], True, None).numpy()
    actual = call_into_out("aten::upsample_linear1d.out", x[0], [13], True, None, shape=expected.shape,
                           dtype=np.float32)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- grid sampling


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", [0, 1, 2], ids=["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode", [0, 1, 2], ids=["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_sampler_2d_matches_torch(mode, padding_mode, align_corners, dtype):
    rng = np.random.default_rng(12)
    x = randn(rng, (2, 3, 5, 7), dtype)
    grid = (rng.random((2, 4, 6, 2)) * 2.6 - 1.3).astype(dtype)  # reaches outside [-1, 1]
    grid[0, 0, 0] = [np.nan, 0.2]
    grid[0, 0, 1] = [np.inf, 0.2]
    grid[1, 3, 5] = [3e9, -0.4]
    expected = oracle(lambda a, g: aten.grid_sampler_2d(a, g, mode, padding_mode, align_corners), x, grid,
                      dtype=dtype)
    actual = call_into_out("aten::grid_sampler_2d.out", x, grid, mode, padding_mode, align_corners,
                           shape=expected.shape, dtype=dtype)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)  # NaNs must coincide too


def test_grid_sampler_2d_half_computes_in_float32():
    rng = np.random.default_rng(13)
    x = randn(rng, (1, 2, 4, 5), np.float16)
    grid = (rng.random((1, 3, 3, 2)) * 2 - 1).astype(np.float16)
    expected = oracle(lambda a, g: aten.grid_sampler_2d(a, g, 0, 0, False), x, grid, dtype=np.float16)
    actual = call_into_out("aten::grid_sampler_2d.out", x, grid, 0, 0, False, shape=expected.shape,
                           dtype=np.float16)
    np.testing.assert_allclose(actual, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("exact", [False, True])
def test_nearest_index_rules_per_rank_follow_torch(k, exact):
    """Random sizes and scale factors, including ones close to 1 and 2 where 2-D nearest
    takes its copy/halve shortcuts and the other ranks do not."""
    rng = np.random.default_rng(20 + k)
    name = f"_upsample_nearest_exact{k}d" if exact else f"upsample_nearest{k}d"
    op = getattr(aten, name).vec
    for _ in range(25):
        n = int(rng.integers(1, 20))
        scale = float(rng.choice([rng.uniform(0.3, 3.5), rng.uniform(0.98, 1.05), rng.uniform(1.98, 2.1)]))
        if int(n * scale) < 1:
            continue
        x = np.arange(n, dtype=np.float32).reshape((1, 1) + (1,) * (k - 1) + (n,))
        scales = [1.0] * (k - 1) + [scale]
        for output_size, factors in ((None, scales), (list(x.shape[2:-1]) + [int(n * scale)], None)):
            expected = op(torch.from_numpy(x), output_size, factors).numpy()
            actual = call_into_out(f"aten::{name}.vec_out", x, output_size, factors, shape=expected.shape,
                                   dtype=np.float32)
            np.testing.assert_array_equal(actual, expected, err_msg=f"n={n} scale={scale}")
