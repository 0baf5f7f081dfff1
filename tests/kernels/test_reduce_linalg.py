"""Reduction, matrix-product, normalization and softmax kernels against torch (the oracle).

Each kernel is looked up by its ExecuTorch operator key, called the way the runtime calls
it (every argument, then the planned out tensors), and compared with the matching
`torch.ops.aten` op on seeded random inputs, for every dtype the kernel claims.
"""
from __future__ import annotations

from itertools import product

import ml_dtypes
import numpy as np
import pytest
import torch

from execupy.kernels.registry import get_kernel
from execupy.schema.program import scalar_type_of

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
# (atol, rtol) per dtype: a different summation order moves the last bit or two.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-12, 1e-12),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 1.6e-2),
}
aten = torch.ops.aten


# ------------------------------------------------------------------ helpers


def to_np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def out_like(t: torch.Tensor) -> np.ndarray:
    """A planned out buffer: torch's result shape and dtype, filled with garbage."""
    return np.full(tuple(t.shape), 7, dtype=to_np(t).dtype)


def code(dtype: torch.dtype) -> int:
    return scalar_type_of(to_np(torch.empty(0, dtype=dtype)).dtype)


def rand(shape, dtype: torch.dtype, seed: int = 0, low: int = -5, high: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if dtype == torch.uint8:
        low = 0
    return torch.randint(low, high, shape, generator=g, dtype=dtype)


def assert_matches(actual, expected: torch.Tensor, case: str = "") -> None:
    actual = np.asarray(actual)
    want = to_np(expected)
    assert actual.dtype == want.dtype, f"{case}: dtype {actual.dtype}, expected {want.dtype}"
    assert actual.shape == want.shape, f"{case}: shape {actual.shape}, expected {want.shape}"
    if expected.dtype.is_floating_point:
        atol, rtol = TOL[expected.dtype]
        np.testing.assert_allclose(actual.astype(np.float64), want.astype(np.float64), atol=atol, rtol=rtol,
                                   err_msg=case)
    else:
        np.testing.assert_array_equal(actual, want, err_msg=case)


def run(key: str, *args):
    """Call the kernel registered under `key` as the runtime would."""
    kernel = get_kernel(key)
    assert kernel is not None, f"no kernel registered for {key}"
    return kernel(*args)


def run_out(key: str, expected: torch.Tensor, *args) -> np.ndarray:
    """Call a one-output kernel with a planned out buffer and check it wrote into it."""
    case = f"{key}{args[1:]}"  # the arguments after the input name the case on failure
    out = out_like(expected)
    result = run(key, *args, out)
    assert result is out, f"{case}: a same-shape result must be written into the planned out buffer"
    assert_matches(result, expected, case)
    return result


DIMS = [None, (), (1,), (-1, 0), (0, 1, 2)]
KEEPDIM = (False, True)


# ------------------------------------------------------------------ sum / mean / prod


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool])
def test_sum_over_dims(dtype):
    x = rand((3, 4, 5), dtype)
    for dim, keepdim in product(DIMS, KEEPDIM):  # None and () both mean every dim
        expected = aten.sum.dim_IntList(x, list(dim) if dim is not None else None, keepdim)
        run_out("aten::sum.IntList_out", expected, to_np(x), dim, keepdim, None)


@pytest.mark.parametrize("src, dst", [(torch.int32, torch.float32), (torch.float32, torch.float64),
                                      (torch.bool, torch.int32), (torch.float16, torch.float32)])
def test_sum_with_dtype_argument_casts_first(src, dst):
    x = rand((4, 6), src, seed=1)
    expected = torch.sum(x, dim=[1], dtype=dst)
    run_out("aten::sum.IntList_out", expected, to_np(x), (1,), False, code(dst))


def test_sum_of_int8_wraps_like_aten_when_out_is_int8():
    x = torch.full((40,), 100, dtype=torch.int8)
    expected = torch.sum(x, dim=[0], dtype=torch.int8)
    run_out("aten::sum.IntList_out", expected, to_np(x), (0,), False, code(torch.int8))


def test_sum_returns_a_new_array_when_out_has_the_upper_bound_shape():
    x = rand((2, 3), torch.float32)
    out = np.zeros((5,), np.float32)  # planned for a bigger dynamic shape
    result = run("aten::sum.IntList_out", to_np(x), (1,), False, None, out)
    assert result is not out
    assert_matches(result, x.sum(1))


@pytest.mark.parametrize("dtype", FLOATS)
def test_mean_over_dims(dtype):
    x = rand((3, 4, 5), dtype, seed=2)
    for dim, keepdim in product(DIMS, KEEPDIM):
        expected = aten.mean.dim(x, list(dim) if dim is not None else None, keepdim)
        run_out("aten::mean.out", expected, to_np(x), dim, keepdim, None)


def test_mean_of_ints_with_float_dtype_and_of_empty_is_nan():
    x = rand((3, 4), torch.int64)
    run_out("aten::mean.out", torch.mean(x, dim=[0], dtype=torch.float32), to_np(x), (0,), False, code(torch.float32))
    empty = torch.zeros((0, 3))
    result = run_out("aten::mean.out", torch.mean(empty, dim=[0]), to_np(empty), (0,), False, None)
    assert np.isnan(result).all()


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool])
def test_prod_over_one_dim(dtype):
    x = rand((3, 4, 5), dtype, seed=3, low=-2, high=3)
    if dtype.is_floating_point:
        x = (x / 4 + 1).to(dtype)  # keep products of five values in range
    for dim, keepdim in [(0, False), (-1, True), (1, False)]:
        run_out("aten::prod.int_out", aten.prod.dim_int(x, dim, keepdim), to_np(x), dim, keepdim, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_prod_of_everything(dtype):
    x = rand((2, 3), dtype, seed=4, low=-2, high=3)
    run_out("aten::prod.out", torch.prod(x), to_np(x), None)


# ------------------------------------------------------------------ amax / amin / any / all


def with_nans(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[::7] = float("nan")
    return x


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool])
@pytest.mark.parametrize("op", ["amax", "amin"])
def test_amax_amin_propagate_nan(dtype, op):
    x = rand((3, 4, 5), dtype, seed=5)
    if dtype.is_floating_point:
        x = with_nans(x)
    for dim, keepdim in product([(), (1,), (0, 2)], KEEPDIM):
        expected = getattr(aten, op)(x, list(dim), keepdim)
        run_out(f"aten::{op}.out", expected, to_np(x), dim, keepdim)


def test_amax_of_an_empty_dim_is_an_error():
    with pytest.raises(ValueError):
        run("aten::amax.out", np.zeros((0, 3), np.float32), (0,), False, np.zeros(3, np.float32))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.int32, torch.uint8])
@pytest.mark.parametrize("op", ["any", "all"])
def test_any_all_every_overload(dtype, op):
    x = rand((3, 4, 5), dtype, seed=6, low=0, high=2)  # ints: mostly 0/1 so both answers occur
    if dtype.is_floating_point:
        x = with_nans((x > 0.8).float())  # NaN counts as true
    f = getattr(aten, op)
    run_out(f"aten::{op}.all_out", f(x), to_np(x))
    for dim, keepdim in [(0, False), (-1, True), (1, False)]:
        run_out(f"aten::{op}.out", f.dim(x, dim, keepdim), to_np(x), dim, keepdim)
    for dims, keepdim in [(None, False), ((0, 2), True), ((), False)]:
        run_out(f"aten::{op}.dims_out", f.dims(x, dims, keepdim), to_np(x), dims, keepdim)


# ------------------------------------------------------------------ argmax / argmin / max.dim / min.dim


@pytest.mark.parametrize("dtype", FLOATS + INTS)
@pytest.mark.parametrize("op", ["argmax", "argmin"])
def test_argmax_argmin_first_extreme_and_nan(dtype, op):
    x = rand((4, 5, 6), dtype, seed=7, low=-2, high=2)  # ints: many ties
    if dtype.is_floating_point:
        x = with_nans(x)
    for dim, keepdim in [(None, False), (None, True), (0, False), (-1, True), (1, False)]:
        expected = getattr(aten, op)(x, dim, keepdim)
        run_out(f"aten::{op}.out", expected, to_np(x), dim, keepdim)


@pytest.mark.parametrize("dtype", FLOATS + INTS)
@pytest.mark.parametrize("op, key", [("max", "aten::max.dim_max"), ("min", "aten::min.dim_min")])
def test_max_min_dim_values_and_indices(dtype, op, key):
    x = rand((4, 5, 6), dtype, seed=8, low=-2, high=2)
    if dtype.is_floating_point:
        x = with_nans(x)
    for dim, keepdim in [(0, False), (-1, True), (1, False)]:
        values, indices = getattr(aten, op).dim(x, dim, keepdim)
        out_v, out_i = out_like(values), out_like(indices)
        got_v, got_i = run(key, to_np(x), dim, keepdim, out_v, out_i)
        assert got_v is out_v and got_i is out_i
        assert_matches(got_v, values, f"{key} dim={dim} keepdim={keepdim}")
        assert_matches(got_i, indices, f"{key} dim={dim} keepdim={keepdim}")


# ------------------------------------------------------------------ var / std / logsumexp


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["var", "std"])
def test_var_std_with_correction(dtype, op):
    x = rand((3, 4, 5), dtype, seed=9)
    for dim, correction, keepdim in product([None, (1,), (-1, 0)], [None, 0, 1, 2.5], KEEPDIM):
        expected = getattr(aten, op).correction(x, list(dim) if dim else None, correction=correction, keepdim=keepdim)
        run_out(f"aten::{op}.correction_out", expected, to_np(x), dim, correction, keepdim)


def test_var_with_correction_at_least_n_is_inf_or_nan_like_aten():
    x = rand((3, 2), torch.float32, seed=10)
    x[0] = 1.0  # zero spread: 0 / 0 = NaN; the other rows give inf
    run_out("aten::var.correction_out", aten.var.correction(x, [1], correction=2), to_np(x), (1,), 2, False)


@pytest.mark.parametrize("dtype", FLOATS)
def test_logsumexp_stable_and_infinite_slices(dtype):
    x = (rand((3, 4, 5), dtype, seed=11) * 30).to(dtype)  # exp would overflow without the shift
    x[0] = float("-inf")
    x[1, 0, 0] = float("inf")
    for dim, keepdim in [((1,), False), ((0, 2), True), ((-1,), False)]:
        run_out("aten::logsumexp.out", aten.logsumexp(x, list(dim), keepdim), to_np(x), dim, keepdim)


# ------------------------------------------------------------------ matrix products


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int64])
def test_mm_and_bmm(dtype):
    a, b = rand((5, 7), dtype, seed=12), rand((7, 3), dtype, seed=13)
    run_out("aten::mm.out", aten.mm(a, b), to_np(a), to_np(b))
    a, b = rand((4, 5, 7), dtype, seed=14), rand((4, 7, 3), dtype, seed=15)
    run_out("aten::bmm.out", aten.bmm(a, b), to_np(a), to_np(b))


@pytest.mark.parametrize("dtype", FLOATS)
def test_addmm_scales_and_broadcasts_bias(dtype):
    a, b = rand((5, 7), dtype, seed=17), rand((7, 3), dtype, seed=18)
    for (beta, alpha), bias_shape in product([(1, 1), (0.5, 2.0), (0, 1)], [(3,), (5, 3), (1, 3)]):
        bias = rand(bias_shape, dtype, seed=16)
        if beta == 0:
            bias = torch.full(bias_shape, float("nan"), dtype=dtype)  # ignored entirely when beta == 0
        expected = aten.addmm(bias, a, b, beta=beta, alpha=alpha)
        run_out("aten::addmm.out", expected, to_np(bias), to_np(a), to_np(b), beta, alpha)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_baddbmm(dtype):
    bias, a, b = rand((4, 1, 3), dtype, seed=19), rand((4, 5, 7), dtype, seed=20), rand((4, 7, 3), dtype, seed=21)
    expected = aten.baddbmm(bias, a, b, beta=0.5, alpha=1.5)
    run_out("aten::baddbmm.out", expected, to_np(bias), to_np(a), to_np(b), 0.5, 1.5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear(dtype, with_bias):
    x, w = rand((2, 3, 8), dtype, seed=22), rand((4, 8), dtype, seed=23)
    bias = rand((4,), dtype, seed=24) if with_bias else None
    expected = aten.linear(x, w, bias)
    run_out("aten::linear.out", expected, to_np(x), to_np(w), None if bias is None else to_np(bias))


def test_mm_rejects_wrong_rank():
    with pytest.raises(ValueError):
        run("aten::mm.out", np.zeros((2, 3, 4), np.float32), np.zeros((4, 2), np.float32), np.zeros((2, 2), np.float32))


# ------------------------------------------------------------------ normalization


def run_three(key: str, expected: tuple, *args) -> None:
    outs = [out_like(e) for e in expected]
    results = run(key, *args, *outs)
    assert isinstance(results, tuple) and len(results) == 3
    for got, want in zip(results, expected):
        assert_matches(got, want)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("normalized_shape", [(8,), (4, 8)])
@pytest.mark.parametrize("affine", [True, False])
def test_native_layer_norm_returns_out_mean_rstd(dtype, normalized_shape, affine):
    x = (rand((2, 4, 8), dtype, seed=25) * 3 + 1).to(dtype)
    w = rand(normalized_shape, dtype, seed=26) if affine else None
    b = rand(normalized_shape, dtype, seed=27) if affine else None
    expected = aten.native_layer_norm(x, list(normalized_shape), w, b, 1e-5)
    run_three("aten::native_layer_norm.out", expected, to_np(x), normalized_shape,
              None if w is None else to_np(w), None if b is None else to_np(b), 1e-5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(4, 6), (2, 6, 3), (2, 6, 4, 4)])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_no_training_uses_running_stats(dtype, shape, affine):
    x = rand(shape, dtype, seed=28)
    mean, var = rand((6,), dtype, seed=29), (rand((6,), dtype, seed=30).abs() + 0.5).to(dtype)
    w = rand((6,), dtype, seed=31) if affine else None
    b = rand((6,), dtype, seed=32) if affine else None
    expected = aten._native_batch_norm_legit_no_training(x, w, b, mean, var, 0.1, 1e-5)
    run_three("aten::_native_batch_norm_legit_no_training.out", expected, to_np(x),
              None if w is None else to_np(w), None if b is None else to_np(b), to_np(mean), to_np(var), 0.1, 1e-5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("groups", [1, 2, 6])
@pytest.mark.parametrize("affine", [True, False])
def test_native_group_norm(dtype, groups, affine):
    x = rand((2, 6, 3, 4), dtype, seed=33)
    w = rand((6,), dtype, seed=34) if affine else None
    b = rand((6,), dtype, seed=35) if affine else None
    expected = aten.native_group_norm(x, w, b, 2, 6, 12, groups, 1e-5)
    run_three("aten::native_group_norm.out", expected, to_np(x), None if w is None else to_np(w),
              None if b is None else to_np(b), 2, 6, 12, groups, 1e-5)


# ------------------------------------------------------------------ softmax


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["_softmax", "_log_softmax"])
def test_softmax_and_log_softmax(dtype, op):
    x = (rand((3, 4, 5), dtype, seed=36) * 20).to(dtype)  # large logits: needs the max shift
    x[0, 0] = float("-inf")  # an all -inf slice along dim -1 gives NaN
    for dim in (0, -1, 1):
        expected = getattr(aten, op)(x, dim, False)
        run_out(f"aten::{op}.out", expected, to_np(x), dim, False)


@pytest.mark.parametrize("op", ["_softmax", "_log_softmax"])
def test_softmax_half_to_float_writes_float32(op):
    # torch's CPU kernel refuses half_to_float; its meaning is the float32 op on the widened input.
    x = rand((3, 5), torch.float16, seed=37)
    expected = getattr(aten, op)(x.float(), -1, False)
    run_out(f"aten::{op}.out", expected, to_np(x), -1, True)


def test_softmax_of_a_rank0_tensor_is_one():
    x = torch.tensor(3.0)
    run_out("aten::_softmax.out", aten._softmax(x, 0, False), to_np(x), 0, False)


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 113])  # running sums below SIDE_BY_SIDE_ROWS, side by side from it
def test_row_sums_add_each_row_in_index_order(rows):
    """ExecuTorch's portable mean adds one element after another; numpy's np.sum adds pairwise."""
    from execupy.kernels.portable.reduce import row_sums

    x = (np.random.default_rng(rows).standard_normal((rows, 777)) * 1000).astype(np.float32)
    want = np.empty((rows, 1), np.float32)
    for r in range(rows):
        total = x[r, 0]
        for value in x[r, 1:]:
            total = np.float32(total + value)
        want[r, 0] = total
    assert np.array_equal(row_sums(x, np.float32), want)
    assert np.array_equal(row_sums(x.reshape(1, rows, 777), np.float32), want.reshape(1, rows, 1))
