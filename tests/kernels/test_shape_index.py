"""Shape, copy, indexing, creation and primitive kernels against torch on seeded random inputs.

Each kernel is called the way the runtime calls it (all schema arguments, `out` last,
no return slot) and its result is compared with the matching torch op: bit for bit for
data movement, within float tolerance where arithmetic happens.
"""
import math
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

from execupy.runtime import get_kernel

BF16 = np.dtype(ml_dtypes.bfloat16)
ALL_DTYPES = [np.float32, np.float16, BF16, np.float64, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_]
FLOAT_DTYPES = [np.float32, np.float16, BF16, np.float64]
NUMERIC_DTYPES = [np.float32, np.float16, BF16, np.float64, np.int64, np.int32, np.int8, np.uint8]


def dname(dtype) -> str:
    return np.dtype(dtype).name


def kernel(key: str):
    fn = get_kernel(key)
    assert fn is not None, f"{key} is not registered"
    return fn


def rand(rng, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        lo, hi = (0, 100) if dtype == np.uint8 else (-50, 50)
        return rng.integers(lo, hi, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def empty_like_torch(t: torch.Tensor) -> np.ndarray:
    """A planned-looking out buffer with torch's result shape and dtype (garbage contents)."""
    return np.full(tuple(t.shape), 7, dtype=to_numpy(t.new_zeros(())).dtype) if t.dtype != torch.bool else \
        np.ones(tuple(t.shape), np.bool_)


def assert_identical(actual: np.ndarray, expected: torch.Tensor) -> None:
    exp = to_numpy(expected)
    assert actual.shape == exp.shape, f"shape {actual.shape} != {exp.shape}"
    assert actual.dtype == exp.dtype, f"dtype {actual.dtype} != {exp.dtype}"
    assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(exp).tobytes(), f"{actual} != {exp}"


def assert_close(actual: np.ndarray, expected: torch.Tensor, rtol=1e-5, atol=1e-6) -> None:
    exp = to_numpy(expected)
    assert actual.shape == exp.shape and actual.dtype == exp.dtype, (actual.shape, actual.dtype, exp.shape, exp.dtype)
    np.testing.assert_allclose(actual.astype(np.float64), exp.astype(np.float64), rtol=rtol, atol=atol)


def run_like_torch(key: str, expected: torch.Tensor, *args):
    """Call kernel `key` with an out buffer shaped like torch's result; check it wrote in place."""
    out = empty_like_torch(expected)
    result = kernel(key)(*args, out)
    assert result is out, "a static-shape result must be written into out"
    return result


# ----------------------------------------------------------------------------- data movement, every dtype

MOVEMENT_CASES = {
    "permute": ("aten::permute_copy.out", (2, 3, 4), lambda x: ((2, 0, 1),), lambda t: t.permute(2, 0, 1)),
    "permute_neg": ("aten::permute_copy.out", (2, 3), lambda x: ((-1, 0),), lambda t: t.permute(1, 0)),
    "view": ("aten::view_copy.out", (2, 3, 4), lambda x: ((4, -1),), lambda t: t.reshape(4, -1)),
    "expand": ("aten::expand_copy.out", (3, 1), lambda x: ((2, -1, 4), False), lambda t: t.expand(2, -1, 4)),
    "squeeze_dims": ("aten::squeeze_copy.dims_out", (1, 3, 1, 2), lambda x: ((0, -2, 1),),
                     lambda t: t.squeeze((0, -2, 1))),
    "squeeze_all": ("aten::squeeze_copy.out", (1, 3, 1, 2), lambda x: (), lambda t: t.squeeze()),
    "unsqueeze": ("aten::unsqueeze_copy.out", (3, 2), lambda x: (-1,), lambda t: t.unsqueeze(-1)),
    "select": ("aten::select_copy.int_out", (3, 4, 2), lambda x: (1, -1), lambda t: t.select(1, -1)),
    "slice": ("aten::slice_copy.Tensor_out", (5, 9), lambda x: (1, -7, None, 3), lambda t: t[:, -7::3]),
    "slice_clamped": ("aten::slice_copy.Tensor_out", (5, 4), lambda x: (0, -100, 100, 2), lambda t: t[::2]),
    "slice_empty": ("aten::slice_copy.Tensor_out", (5, 4), lambda x: (1, 3, 1, 1), lambda t: t[:, 3:1]),
    "narrow": ("aten::narrow_copy.out", (4, 6), lambda x: (1, -4, 3), lambda t: t.narrow(1, -4, 3)),
    "alias": ("aten::alias_copy.out", (2, 3), lambda x: (), lambda t: t.clone()),
    "clone": ("aten::clone.out", (2, 3), lambda x: (None,), lambda t: t.clone()),
    "clone_dim_order": ("dim_order_ops::_clone_dim_order.out", (2, 3), lambda x: (False, (0, 1)), lambda t: t.clone()),
    "flip": ("aten::flip.out", (3, 4, 5), lambda x: ((0, -1),), lambda t: t.flip((0, -1))),
    "roll": ("aten::roll.out", (3, 4, 5), lambda x: ((2, -1), (0, 2)), lambda t: t.roll((2, -1), (0, 2))),
    "roll_flat": ("aten::roll.out", (3, 4), lambda x: ((5,), ()), lambda t: t.roll(5)),
    "repeat": ("aten::repeat.out", (2, 3), lambda x: ((2, 1, 3),), lambda t: t.repeat(2, 1, 3)),
    "pad": ("aten::constant_pad_nd.out", (3, 4, 5), lambda x: ((1, 2, -1, 3), 0),
            lambda t: torch.constant_pad_nd(t, (1, 2, -1, 3), 0)),
    "pad_crop_all": ("aten::constant_pad_nd.out", (2, 3), lambda x: ((-3, 1), 0),
                     lambda t: torch.constant_pad_nd(t, (-3, 1), 0)),
    "repeat_zero": ("aten::repeat.out", (2, 3), lambda x: ((0, 2),), lambda t: t.repeat(0, 2)),
    "tril": ("aten::tril.out", (2, 4, 5), lambda x: (1,), lambda t: t.tril(1)),
    "triu": ("aten::triu.out", (4, 3), lambda x: (-1,), lambda t: t.triu(-1)),
}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dname)
@pytest.mark.parametrize("case", MOVEMENT_CASES, ids=str)
def test_movement_ops_match_torch_bit_for_bit(case, dtype):
    key, shape, args, torch_fn = MOVEMENT_CASES[case]
    x = rand(np.random.default_rng(zlib.crc32(case.encode())), shape, dtype)
    expected = torch_fn(to_torch(x))
    assert_identical(run_like_torch(key, expected, x, *args(x)), expected)


@pytest.mark.parametrize("value", [0, 2.5, -1])
def test_constant_pad_fills_with_value(value):
    x = rand(np.random.default_rng(1), (2, 3), np.float32)
    expected = torch.constant_pad_nd(to_torch(x), (2, 0, 1, 1), value)
    assert_identical(run_like_torch("aten::constant_pad_nd.out", expected, x, (2, 0, 1, 1), value), expected)


def test_kernels_never_write_into_their_input():
    x = rand(np.random.default_rng(2), (3, 4), np.float32)
    x.setflags(write=False)  # constants are read-only views of the program file
    out = np.empty((4, 3), np.float32)
    kernel("aten::permute_copy.out")(x, (1, 0), out)
    np.testing.assert_array_equal(out, x.T)


def test_data_movement_rejects_a_dtype_change():
    x = np.zeros((2, 2), np.float32)
    with pytest.raises(TypeError, match="dtype"):
        kernel("aten::permute_copy.out")(x, (1, 0), np.zeros((2, 2), np.int32))


def test_select_out_of_range_raises():
    with pytest.raises(IndexError):
        kernel("aten::select_copy.int_out")(np.zeros((2, 3)), 1, 3, np.zeros(2))


# ----------------------------------------------------------------------------- casts and copies


@pytest.mark.parametrize("src", NUMERIC_DTYPES + [np.bool_], ids=dname)
@pytest.mark.parametrize("dst", [np.float32, BF16, np.float16, np.int64, np.int32, np.bool_], ids=dname)
def test_to_dim_order_copy_casts_like_torch(src, dst):
    x = rand(np.random.default_rng(3), (4, 5), src)
    if np.dtype(src).kind == "f" or src == BF16:
        x = (x * 20).astype(src)  # values beyond +-1 exercise truncation toward zero
    expected = to_torch(x).to(to_torch(np.zeros(1, dst)).dtype)
    actual = run_like_torch("dim_order_ops::_to_dim_order_copy.out", expected, x, False, (0, 1))
    assert_identical(actual, expected)


def test_to_dim_order_copy_writes_a_channels_last_out_buffer():
    """The runtime gives out as a transposed view of its planned bytes; values must still match."""
    x = rand(np.random.default_rng(4), (2, 3, 4, 5), np.float32)
    storage = np.zeros((2, 4, 5, 3), np.float32)
    out = storage.transpose(0, 3, 1, 2)  # logical NCHW view of NHWC memory, dim_order [0, 2, 3, 1]
    result = kernel("dim_order_ops::_to_dim_order_copy.out")(x, False, (0, 2, 3, 1), out)
    assert result is out
    np.testing.assert_array_equal(storage, x.transpose(0, 2, 3, 1))


def test_copy_out_broadcasts_src_into_self_shape():
    rng = np.random.default_rng(5)
    x, src = rand(rng, (3, 4), np.float32), rand(rng, (4,), np.int64)
    expected = torch.ops.aten.copy(to_torch(x), to_torch(src))
    assert_identical(run_like_torch("aten::copy.out", expected, x, src, False), expected)


def test_copy_in_place_returns_self():
    rng = np.random.default_rng(6)
    buffer, src = np.zeros((2, 3), np.float32), rand(rng, (2, 3), np.float32)
    result = kernel("aten::copy_")(buffer, src, False)
    assert result is buffer
    np.testing.assert_array_equal(buffer, src)


# ----------------------------------------------------------------------------- joins and splits


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dname)
def test_cat_stack_split_unbind(dtype):
    rng = np.random.default_rng(7)
    a, b = rand(rng, (2, 3), dtype), rand(rng, (2, 5), dtype)
    expected = torch.cat([to_torch(a), to_torch(b)], 1)
    assert_identical(run_like_torch("aten::cat.out", expected, [a, b], -1), expected)

    c = rand(rng, (2, 3), dtype)
    expected = torch.stack([to_torch(a), to_torch(c)], 1)
    assert_identical(run_like_torch("aten::stack.out", expected, [a, c], 1), expected)

    x = rand(rng, (7, 2), dtype)
    pieces = torch.split(to_torch(x), [2, 0, 5])
    outs = [empty_like_torch(p) for p in pieces]
    results = kernel("aten::split_with_sizes_copy.out")(x, (2, 0, 5), 0, outs)
    assert all(r is o for r, o in zip(results, outs))
    for r, p in zip(results, pieces):
        assert_identical(r, p)

    pieces = torch.split(to_torch(x), 3)
    results = kernel("aten::split_copy.Tensor_out")(x, 3, 0, [empty_like_torch(p) for p in pieces])
    assert len(results) == 3 and all(assert_identical(r, p) is None for r, p in zip(results, pieces))

    pieces = torch.unbind(to_torch(x), 1)
    results = kernel("aten::unbind_copy.int_out")(x, 1, [empty_like_torch(p) for p in pieces])
    for r, p in zip(results, pieces):
        assert_identical(r, p)


def test_cat_skips_empty_vectors_and_promotes_to_out_dtype():
    a, b = np.arange(6, dtype=np.int32).reshape(2, 3), np.array([0.5, 1.5, 2.5], np.float32).reshape(1, 3)
    empty = np.zeros((0,), np.float32)
    expected = torch.cat([to_torch(a), to_torch(empty), to_torch(b)])
    assert_identical(run_like_torch("aten::cat.out", expected, [a, empty, b], 0), expected)


def test_split_sizes_must_cover_the_dim():
    with pytest.raises(ValueError, match="add up"):
        kernel("aten::split_with_sizes_copy.out")(np.zeros((5,)), (2, 2), 0, [np.zeros(2), np.zeros(2)])


# ----------------------------------------------------------------------------- indexing


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dname)
def test_index_with_tensors_masks_and_none(dtype):
    rng = np.random.default_rng(8)
    x = rand(rng, (4, 5, 6), dtype)
    rows = rng.integers(-4, 4, size=(2, 3))
    cols = rng.integers(0, 6, size=(3,))
    mask = rng.random(5) < 0.5
    for indices in ([rows], [None, None, cols], [rows, None, cols], [None, mask], [rows, rng.integers(0, 5, (1, 3))]):
        expected = torch.ops.aten.index(to_torch(x), [None if i is None else to_torch(i) for i in indices])
        assert_identical(run_like_torch("aten::index.Tensor_out", expected, x, indices), expected)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=dname)
def test_index_put(dtype, accumulate):
    rng = np.random.default_rng(9)
    x = rand(rng, (5, 4), dtype)
    rows = np.array([0, 3, 3, -1]) if accumulate else np.array([0, 3, -1])  # duplicates only when accumulating
    values = rand(rng, (len(rows), 4), dtype)
    expected = torch.ops.aten.index_put(to_torch(x), [to_torch(rows)], to_torch(values), accumulate)
    actual = run_like_torch("aten::index_put.out", expected, x, [rows], values, accumulate)
    assert_close(actual, expected, rtol=1e-2 if dtype in (np.float16, BF16) else 1e-6)


def test_index_put_with_mask_and_broadcast_value():
    rng = np.random.default_rng(10)
    x, mask = rand(rng, (3, 4), np.float32), rng.random((3, 4)) < 0.5
    value = np.array(9.0, np.float32)
    expected = torch.ops.aten.index_put(to_torch(x), [to_torch(mask)], to_torch(value))
    assert_identical(run_like_torch("aten::index_put.out", expected, x, [mask], value, False), expected)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dname)
def test_index_select_gather_masked_fill_nonzero(dtype):
    rng = np.random.default_rng(11)
    x = rand(rng, (4, 6), dtype)
    idx = rng.integers(0, 6, size=(5,))
    expected = torch.index_select(to_torch(x), 1, to_torch(idx))
    assert_identical(run_like_torch("aten::index_select.out", expected, x, -1, idx), expected)

    gidx = rng.integers(0, 4, size=(3, 5))  # smaller than x in the non-gathered dim, as torch allows
    expected = torch.gather(to_torch(x), 0, to_torch(gidx))
    assert_identical(run_like_torch("aten::gather.out", expected, x, 0, gidx, False), expected)

    mask = rng.random((1, 6)) < 0.5
    expected = torch.masked_fill(to_torch(x), to_torch(mask), 1)
    assert_identical(run_like_torch("aten::masked_fill.Scalar_out", expected, x, mask, 1), expected)

    expected = torch.nonzero(to_torch(x))
    upper = np.zeros((x.size, 2), np.int64)  # dynamic out: planned at its upper bound
    actual = kernel("aten::nonzero.out")(x, upper)
    assert_identical(actual, expected)


def test_masked_fill_broadcasts_to_the_mask_shape():
    rng = np.random.default_rng(20)
    x, mask = rand(rng, (3,), np.float32), rng.random((2, 3)) < 0.5
    expected = torch.masked_fill(to_torch(x), to_torch(mask), -2.5)
    assert_identical(run_like_torch("aten::masked_fill.Scalar_out", expected, x, mask, -2.5), expected)


def test_gather_and_index_select_check_bounds():
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(IndexError):
        kernel("aten::gather.out")(x, 1, np.array([[4]]), False, np.zeros((1, 1), np.float32))
    with pytest.raises(IndexError):
        kernel("aten::index_select.out")(x, 0, np.array([-1]), np.zeros((1, 4), np.float32))


@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=dname)
def test_scatter_variants(dtype):
    rng = np.random.default_rng(12)
    x = rand(rng, (4, 5), dtype)
    # scatter without reduction: distinct targets per column so the result is deterministic
    idx = np.stack([rng.permutation(4)[:3] for _ in range(5)], axis=1)[:, :4]
    src = rand(rng, (3, 6), dtype)
    expected = torch.scatter(to_torch(x), 0, to_torch(idx), to_torch(src))
    assert_identical(run_like_torch("aten::scatter.src_out", expected, x, 0, idx, src), expected)

    expected = torch.scatter(to_torch(x), 0, to_torch(idx), 3)
    assert_identical(run_like_torch("aten::scatter.value_out", expected, x, 0, idx, 3), expected)

    dup = rng.integers(0, 5, size=(4, 7))  # repeated targets add up
    src = rand(rng, (4, 7), dtype)
    expected = torch.scatter_add(to_torch(x), 1, to_torch(dup), to_torch(src))
    actual = run_like_torch("aten::scatter_add.out", expected, x, 1, dup, src)
    assert_close(actual, expected, rtol=2e-2 if dtype in (np.float16, BF16) else 1e-6, atol=1e-2)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64], ids=dname)
def test_scatter_reduce_follows_torch(dtype, reduce, include_self):
    rng = np.random.default_rng(13)
    x = rand(rng, (5, 3), dtype)
    idx = rng.integers(0, 5, size=(6, 3))
    src = rand(rng, (6, 3), dtype)
    expected = torch.scatter_reduce(to_torch(x), 0, to_torch(idx), to_torch(src), reduce, include_self=include_self)
    actual = run_like_torch("aten::scatter_reduce.two_out", expected, x, 0, idx, src, reduce, include_self)
    assert_close(actual, expected, rtol=1e-5)


def test_slice_and_select_scatter():
    rng = np.random.default_rng(14)
    x = rand(rng, (6, 4), np.float32)
    src = rand(rng, (6, 2), np.float32)
    expected = torch.slice_scatter(to_torch(x), to_torch(src), 1, -3, None, 2)
    assert_identical(run_like_torch("aten::slice_scatter.out", expected, x, src, 1, -3, None, 2), expected)
    row = rand(rng, (4,), np.float32)
    expected = torch.select_scatter(to_torch(x), to_torch(row), 0, -2)
    assert_identical(run_like_torch("aten::select_scatter.out", expected, x, row, 0, -2), expected)
    with pytest.raises(ValueError, match="does not match"):
        kernel("aten::slice_scatter.out")(x, src[:, :1], 1, -3, None, 2, np.zeros_like(x))


# ----------------------------------------------------------------------------- ordering


def with_ties_and_nans(rng, shape, dtype):
    x = rng.integers(-3, 4, size=shape).astype(np.float32)  # many ties
    if np.dtype(dtype).kind == "f" or dtype == BF16:
        x.reshape(-1)[:: 7] = np.nan
    return x.astype(dtype)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", NUMERIC_DTYPES + [np.bool_], ids=dname)
def test_sort_is_stable_with_nan_largest(dtype, descending):
    x = with_ties_and_nans(np.random.default_rng(15), (4, 9), dtype)
    values, indices = torch.sort(to_torch(x), dim=1, descending=descending, stable=True)
    outs = (empty_like_torch(values), np.zeros(tuple(indices.shape), np.int64))
    got_values, got_indices = kernel("aten::sort.values")(x, 1, descending, *outs)
    assert_identical(got_values, values)
    assert_identical(got_indices, indices)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=dname)
def test_topk_values_match_torch(dtype, largest):
    rng = np.random.default_rng(16)
    x = rand(rng, (3, 10), dtype)
    values, indices = torch.topk(to_torch(x), 4, dim=-1, largest=largest)
    outs = (empty_like_torch(values), np.zeros(tuple(indices.shape), np.int64))
    got_values, got_indices = kernel("aten::topk.values")(x, 4, -1, largest, True, *outs)
    assert_identical(got_values, values)
    # torch does not promise an order among equal values: compare through the values
    np.testing.assert_array_equal(np.take_along_axis(x, got_indices, -1), got_values)


def test_topk_treats_nan_as_largest_and_breaks_ties_by_index():
    x = np.array([[1.0, np.nan, 3.0, 3.0, -1.0]], np.float32)
    values, indices = np.zeros((1, 3), np.float32), np.zeros((1, 3), np.int64)
    kernel("aten::topk.values")(x, 3, 1, True, True, values, indices)
    expected_values, _ = torch.topk(to_torch(x), 3)
    assert_identical(values, expected_values)
    assert indices.tolist() == [[1, 2, 3]]


@pytest.mark.parametrize("dtype", NUMERIC_DTYPES + [np.bool_], ids=dname)
def test_cumsum(dtype):
    x = rand(np.random.default_rng(17), (3, 6), dtype)
    expected = torch.cumsum(to_torch(x), 1)
    actual = run_like_torch("aten::cumsum.out", expected, x, -1, None)
    low = dtype in (np.float16, BF16)
    assert_close(actual, expected, rtol=1e-2 if low else 1e-5, atol=1e-2 if low else 1e-6)


def test_cumsum_with_dtype_accumulates_in_out_dtype():
    x = np.array([100, 100, 100], np.int8)
    expected = torch.cumsum(to_torch(x), 0, dtype=torch.int64)
    assert_identical(run_like_torch("aten::cumsum.out", expected, x, 0, 4), expected)


# ----------------------------------------------------------------------------- creation


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dname)
def test_full_zeros_ones_scalar_tensor(dtype):
    tdtype = to_torch(np.zeros(1, dtype)).dtype
    value = True if dtype == np.bool_ else 3
    for key, args, expected in [
        ("aten::full.out", ((2, 3), value), torch.full((2, 3), value, dtype=tdtype)),
        ("aten::full_like.out", (np.zeros((4, 1)), value, None), torch.full((4, 1), value, dtype=tdtype)),
        ("aten::zeros.out", ((3,),), torch.zeros(3, dtype=tdtype)),
        ("aten::ones.out", ((2, 2),), torch.ones(2, 2, dtype=tdtype)),
        ("aten::zeros_like.out", (np.ones((2, 1)), None), torch.zeros(2, 1, dtype=tdtype)),
        ("aten::ones_like.out", (np.ones((1, 2)), None), torch.ones(1, 2, dtype=tdtype)),
        ("aten::scalar_tensor.out", (value,), torch.scalar_tensor(value, dtype=tdtype)),
    ]:
        assert_identical(run_like_torch(key, expected, *args), expected)


def test_full_casts_a_float_fill_like_torch():
    expected = torch.full((3,), 2.75).to(torch.int32)
    assert_identical(run_like_torch("aten::full.out", expected, (3,), 2.75), expected)


@pytest.mark.parametrize(
    "start, end, step, dtype",
    [(0, 10, 1, np.int64), (3, -7, -2, np.int64), (0, 1, 0.1, np.float32), (-1.5, 2.25, 0.5, np.float64),
     (0, 5, 1, np.float32), (1, 2, 0.3, np.float16), (0, 7, 2, np.int32), (0.5, 4, 1, np.int64)],
)
def test_arange_matches_torch(start, end, step, dtype):
    expected = torch.arange(start, end, step, dtype=to_torch(np.zeros(1, dtype)).dtype)
    actual = run_like_torch("aten::arange.start_out", expected, start, end, step)
    assert_identical(actual, expected)


def test_arange_resizes_a_dynamic_out():
    upper = np.zeros((10,), np.int64)
    result = kernel("aten::arange.start_out")(2, 6, 1, upper)
    assert result is not upper and result.tolist() == [2, 3, 4, 5]


def test_empty_returns_the_planned_buffer_and_checks_dim_order():
    out = np.zeros((2, 3), np.float32)
    assert kernel("dim_order_ops::_empty_dim_order.out")((2, 3), (0, 1), out) is out
    assert kernel("aten::empty.out")((2, 3), None, out) is out
    with pytest.raises(ValueError, match="dim_order"):
        kernel("dim_order_ops::_empty_dim_order.out")((2, 3), (0, 0), out)


@pytest.mark.parametrize("key, args", [
    ("aten::full.out", ((1 << 20, 1 << 20), 0.0)),
    ("aten::zeros.out", ((-1, 3),)),
    ("dim_order_ops::_empty_dim_order.out", ((1 << 16, 1 << 16, 4), None)),
    ("aten::arange.start_out", (0, 1e12, 1)),
    ("aten::expand_copy.out", (np.zeros((1, 1), np.float32), (1 << 20, 1 << 20), False)),
    ("aten::repeat.out", (np.zeros((2, 2), np.float32), (1 << 20, 1 << 20))),
    ("aten::constant_pad_nd.out", (np.zeros((2, 2), np.float32), (1 << 20, 0, 1 << 20, 0), 0)),
])
def test_programs_cannot_ask_for_huge_tensors(key, args):
    with pytest.raises(ValueError):
        kernel(key)(*args, np.zeros((1,), np.float32))


@pytest.mark.parametrize("start, end, step", [(0, 10, 0), (0, 10, -1), (0, float("inf"), 1)])
def test_arange_rejects_bad_ranges(start, end, step):
    with pytest.raises(ValueError):
        kernel("aten::arange.start_out")(start, end, step, np.zeros((1,), np.float32))


# ----------------------------------------------------------------------------- dynamic shapes


def test_kernels_return_a_new_array_when_the_shape_changes():
    """A dynamic out arrives at its previous (or upper-bound) shape; the result must not be squeezed into it."""
    x = rand(np.random.default_rng(18), (3, 5), np.float32)
    stale = np.zeros((8, 5), np.float32)
    result = kernel("aten::slice_copy.Tensor_out")(x, 0, 1, None, 1, stale)
    assert result is not stale
    np.testing.assert_array_equal(result, x[1:])
    result = kernel("aten::cat.out")([x, x], 0, stale)
    np.testing.assert_array_equal(result, np.concatenate([x, x]))


# ----------------------------------------------------------------------------- primitive ops


def test_sym_size_and_numel():
    x = np.zeros((2, 7, 3))
    assert kernel("aten::sym_size.int")(x, 1) == 7
    assert kernel("aten::sym_size.int")(x, -1) == 3
    assert kernel("aten::sym_numel")(x) == torch.zeros(2, 7, 3).numel()


@pytest.mark.parametrize("a, b", [(7, 2), (-7, 2), (7, -2), (3.5, 2), (6, 1.5), (0, 5)])
def test_prim_binary_ops_follow_symint_semantics(a, b):
    for name, fn in [("add", lambda a, b: a + b), ("sub", lambda a, b: a - b), ("mul", lambda a, b: a * b),
                     ("floordiv", lambda a, b: a // b), ("mod", lambda a, b: a % b),
                     ("truediv", lambda a, b: a / b), ("eq", lambda a, b: a == b), ("gt", lambda a, b: a > b),
                     ("lt", lambda a, b: a < b), ("ge", lambda a, b: a >= b), ("le", lambda a, b: a <= b),
                     ("sym_max", torch.sym_max), ("sym_min", torch.sym_min)]:
        got = kernel(f"executorch_prim::{name}.Scalar")(a, b)
        want = fn(a, b)
        assert got == want and type(got) is type(want), (name, a, b, got, want)


@pytest.mark.parametrize("a", [2.5, -2.5, 3.5, -0.4, 7, True])
def test_prim_unary_ops(a):
    assert kernel("executorch_prim::neg.Scalar")(a) == -a
    assert kernel("executorch_prim::sym_float.Scalar")(a) == float(a)
    assert kernel("executorch_prim::sym_int.Scalar")(a) == torch.sym_int(a)
    assert kernel("executorch_prim::ceil.Scalar")(a) == math.ceil(a)
    assert kernel("executorch_prim::trunc.Scalar")(a) == math.trunc(a)
    assert kernel("executorch_prim::round.Scalar")(a) == round(a)
    assert kernel("executorch_prim::sym_not.Scalar")(a) is (not a)


def test_prim_division_by_zero_raises():
    with pytest.raises(ZeroDivisionError):
        kernel("executorch_prim::floordiv.Scalar")(3, 0)


def test_et_view_is_a_reshape_sharing_memory():
    x = np.arange(12, dtype=np.float32)
    view = kernel("executorch_prim::et_view.default")(x, (3, 4))
    assert view.shape == (3, 4) and np.shares_memory(view, x)


def test_et_copy_index_stacks_map_results():
    """Three loop iterations build the stacked output row by row, as a `map` does."""
    rng = np.random.default_rng(19)
    rows = [rand(rng, (2, 3), np.float32) for _ in range(3)]
    acc = np.zeros((5, 2, 3), np.float32)  # planned at the upper bound
    fn = kernel("executorch_prim::et_copy_index.tensor")
    for i, row in enumerate(rows):
        acc = fn(acc, row, i)
    assert_identical(acc, torch.stack([to_torch(r) for r in rows]))
