"""The last portable-library kernels against torch: pads, pixel shuffle, masked select and
scatter, var_mean, shifts, strided-view copies, distances, dropout, random creation,
fill, allclose, complex copies, anti-aliased resize, batch-norm variants, index_put_.

Each kernel is called as the runtime calls it (every schema argument, then the planned out
tensors) and compared with `torch.ops.aten` on seeded inputs, for every dtype ExecuTorch's
portable kernel accepts (named per test). Where torch lacks a dtype that ExecuTorch takes,
the expectation comes from torch in a wider dtype, converted, and the test says so.

At the end, the interfaces a user touches: a program execupy exports with these ops runs
like eager and like ExecuTorch's runtime, and programs ExecuTorch's own exporter wrote
(keeping each op whole) give in execupy what they give in ExecuTorch (`reference` tests).
Two deliberate differences from ExecuTorch 1.5's portable kernels, both ATen's behaviour:
native_dropout rescales kept values by 1 / (1 - p), and allclose treats inf and NaN (and
bool and integer tolerances) as torch.allclose does.
"""
from __future__ import annotations

import json
import math
from itertools import product
from pathlib import Path

import numpy as np
import pytest
import torch

import execupy
from execupy.errors import UnsupportedOperatorError
from execupy.runtime import Module, Program
from execupy.schema import read_pte

from ..reference import run_reference, run_worker_once, worker_case_outputs
from .test_reduce_linalg import FLOATS, INTS, aten, assert_matches, out_like, rand, run, run_out, to_np

# ExecuTorch's dtype groups: ALL / REALHBBF16 = every real dtype plus bool.
EVERY = FLOATS + INTS + [torch.int16, torch.bool]
INTEGERS = INTS + [torch.int16]


def run_outs(key: str, expected: tuple[torch.Tensor, ...], *args) -> tuple:
    """Call a several-output kernel with planned out buffers; compare each result."""
    outs = [out_like(e) for e in expected]
    results = run(key, *args, *outs)
    for result, out, want in zip(results, outs, expected):
        assert result is out, f"{key}: a same-shape result must be written into its planned out buffer"
        assert_matches(result, want, key)
    return results


def via(dtype: torch.dtype, wider: torch.dtype, fn, *tensors: torch.Tensor) -> torch.Tensor:
    """torch's answer for a dtype it does not implement: computed in `wider`, converted back."""
    return fn(*(t.to(wider) for t in tensors)).to(dtype)


# ----------------------------------------------------------------------------- pads


PAD_CASES = [  # (k, input shape, padding): batched and unbatched, growing and cropping
    (1, (2, 3, 5), [2, 3]),
    (1, (3, 5), [-1, 4]),
    (2, (2, 2, 4, 5), [1, 2, 3, 0]),
    (2, (2, 4, 5), [0, -2, 2, 1]),
    (3, (1, 2, 3, 4, 5), [1, 1, 2, 0, 0, 2]),
    (3, (2, 3, 4, 5), [2, -1, 1, 3, 1, 1]),
]


@pytest.mark.parametrize("mode", ["reflection", "replication"])
@pytest.mark.parametrize("k, shape, padding", PAD_CASES)
@pytest.mark.parametrize("dtype", EVERY, ids=str)
def test_reflection_and_replication_pads_match_torch_for_every_dtype(mode, k, shape, padding, dtype):
    """ExecuTorch: ALL dtypes. torch has no bool pads: the bool expectation is uint8's, cast."""
    op = getattr(aten, f"{mode}_pad{k}d")
    x = rand(shape, dtype, seed=k)
    expected = via(dtype, torch.uint8, lambda t: op(t, padding), x) if dtype == torch.bool else op(x, padding)
    run_out(f"aten::{mode}_pad{k}d.out", expected, to_np(x), padding)


@pytest.mark.parametrize("padding", [[3, 0], [0, 4]])
def test_reflection_pad_refuses_padding_as_wide_as_the_input(padding):
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="smaller than"):
        run("aten::reflection_pad1d.out", x, padding, np.zeros((2, 3 + sum(padding)), np.float32))


def test_replication_pad_refuses_a_rank_it_does_not_pad():
    with pytest.raises(ValueError, match="4-D or 5-D"):
        run("aten::replication_pad3d.out", np.zeros((3, 4, 5), np.float32), [1] * 6, np.zeros((1,), np.float32))


# ----------------------------------------------------------------------------- pixel shuffle


@pytest.mark.parametrize("shape, factor", [((1, 8, 2, 3), 2), ((2, 3, 18, 2, 2), 3), ((9, 1, 1), 3)])
@pytest.mark.parametrize("dtype", EVERY, ids=str)
def test_pixel_shuffle_and_unshuffle_match_torch_and_invert_each_other(shape, factor, dtype):
    """ExecuTorch: ALL dtypes (pure data movement), any number of batch dims."""
    x = rand(shape, dtype)
    shuffled = aten.pixel_shuffle(x, factor)
    got = run_out("aten::pixel_shuffle.out", shuffled, to_np(x), factor)
    back = run_out("aten::pixel_unshuffle.out", aten.pixel_unshuffle(shuffled, factor), got, factor)
    np.testing.assert_array_equal(back, to_np(x))


def test_pixel_shuffle_refuses_channels_not_divisible_by_the_square():
    with pytest.raises(ValueError, match="divisible"):
        run("aten::pixel_shuffle.out", np.zeros((1, 6, 2, 2), np.float32), 2, np.zeros((1, 1, 4, 4), np.float32))


# ----------------------------------------------------------------------------- masked select / scatter


MASK_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((1, 4), (3, 1)), ((2, 3), ())]


@pytest.mark.parametrize("shape, mask_shape", MASK_SHAPES)
@pytest.mark.parametrize("dtype", EVERY, ids=str)
def test_masked_select_broadcasts_like_torch(shape, mask_shape, dtype):
    """ExecuTorch: REALHBBF16 (every real dtype and bool). The result length depends on the data."""
    x, mask = rand(shape, dtype, seed=1), rand(mask_shape, torch.bool, seed=2)
    expected = aten.masked_select(x, mask)
    result = run("aten::masked_select.out", to_np(x), to_np(mask), np.zeros((12,), to_np(x).dtype))
    assert_matches(result, expected)


@pytest.mark.parametrize("shape, mask_shape", MASK_SHAPES)
@pytest.mark.parametrize("dtype", EVERY, ids=str)
def test_masked_scatter_fills_masked_positions_in_order_like_torch(shape, mask_shape, dtype):
    """ExecuTorch: REALHBBF16. Source elements are used in row-major order, extras ignored."""
    x, mask, source = rand(shape, dtype, seed=1), rand(mask_shape, torch.bool, seed=2), rand((20,), dtype, seed=3)
    expected = aten.masked_scatter(x, mask, source)
    run_out("aten::masked_scatter.out", expected, to_np(x), to_np(mask), to_np(source))


def test_masked_scatter_refuses_a_source_that_is_too_short():
    mask = np.ones((2, 3), np.bool_)
    with pytest.raises(ValueError, match="selects 6 elements but source has only 5"):
        run("aten::masked_scatter.out", np.zeros((2, 3), np.float32), mask, np.zeros(5, np.float32),
            np.zeros((2, 3), np.float32))


def test_masked_select_wants_a_bool_mask():
    with pytest.raises(TypeError, match="bool"):
        run("aten::masked_select.out", np.zeros(3, np.float32), np.ones(3, np.int64), np.zeros(3, np.float32))


# ----------------------------------------------------------------------------- var_mean


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_var_mean_matches_torch(dtype):
    """ExecuTorch: FLOATHBF16 in and out."""
    x = rand((3, 4, 5), dtype, seed=4)
    for dim, correction, keepdim in product([None, [1], [0, -1]], [None, 0, 2], [False, True]):
        expected = aten.var_mean.correction(x, dim, correction=correction, keepdim=keepdim)
        run_outs("aten::var_mean.correction_out", expected, to_np(x), dim, correction, keepdim)


def test_var_mean_with_too_large_a_correction_gives_inf_like_torch():
    x = rand((4,), torch.float32)
    run_outs("aten::var_mean.correction_out", aten.var_mean.correction(x, [0], correction=4), to_np(x), [0], 4, False)


# ----------------------------------------------------------------------------- shifts


def shift_operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Values over the dtype's range; counts from 0 past the bit width (and negative)."""
    bits = 8 if dtype == torch.bool else torch.iinfo(dtype).bits
    info = torch.iinfo(dtype)
    values = torch.linspace(info.min, info.max, 7, dtype=torch.float64).to(dtype).reshape(7, 1)
    low = 0 if dtype == torch.uint8 else -1
    counts = torch.tensor([low, 0, 1, 3, bits - 1, bits, bits + 2], dtype=torch.int64).clamp(max=info.max).to(dtype)
    return values, counts


@pytest.mark.parametrize("direction", ["left", "right"])
@pytest.mark.parametrize("dtype", INTEGERS, ids=str)
def test_shifts_match_torch_even_for_counts_outside_the_bit_width(direction, dtype):
    """ExecuTorch: integer types (and bool, below); counts are broadcast like any operand."""
    op = getattr(aten, f"bitwise_{direction}_shift")
    values, counts = shift_operands(dtype)
    run_out(f"aten::bitwise_{direction}_shift.Tensor_out", op.Tensor(values, counts), to_np(values), to_np(counts))
    for count in (0, 2, 5, 70):
        run_out(f"aten::bitwise_{direction}_shift.Tensor_Scalar_out", op.Tensor_Scalar(values, count),
                to_np(values), count)


@pytest.mark.parametrize("dtype_a, dtype_b", [(torch.int8, torch.int32), (torch.uint8, torch.int64)])
def test_shifts_promote_mixed_operands_like_torch(dtype_a, dtype_b):
    values, counts = rand((4, 1), dtype_a, seed=5), rand((3,), dtype_b, seed=6, low=0, high=9)
    expected = aten.bitwise_left_shift.Tensor(values, counts)
    run_out("aten::bitwise_left_shift.Tensor_out", expected, to_np(values), to_np(counts))


def test_python_shift_operators_export_and_run():
    """`a << b` exports as aten::__lshift__ (ExecuTorch 1.5 has no kernel for it; execupy does)."""
    from torch.export import export

    from execupy.exir import to_edge

    class Shifts(torch.nn.Module):
        def forward(self, a, b):
            return a << b, a >> b, a << 3, a >> 2

    a, b = rand((4, 5), torch.int32, seed=5, low=-100, high=100), rand((5,), torch.int32, seed=6, low=0, high=33)
    pte = to_edge(export(Shifts(), (a, b))).to_executorch().buffer
    assert {"aten::__lshift__.Tensor_out", "aten::__rshift__.Scalar_out"} <= set(
        Program.load(pte).method_meta("forward").operators)
    for got, expected in zip(Module(pte).forward(to_np(a), to_np(b)), Shifts()(a, b)):
        assert_matches(got, expected)


def test_bool_shifts_follow_cs_integer_shift_then_truth():
    """torch has no bool shifts; ExecuTorch shifts bools as C++ ints and stores nonzero-ness:
    a << b is a, and a >> b is a and not b."""
    a = np.array([[False], [True]])
    b = np.array([False, True])
    left = run("aten::bitwise_left_shift.Tensor_out", a, b, np.zeros((2, 2), np.bool_))
    right = run("aten::bitwise_right_shift.Tensor_out", a, b, np.zeros((2, 2), np.bool_))
    np.testing.assert_array_equal(left, np.broadcast_to(a, (2, 2)))
    np.testing.assert_array_equal(right, a & ~b)


def test_shifts_refuse_floats():
    with pytest.raises(TypeError, match="integer"):
        run("aten::bitwise_left_shift.Tensor_Scalar_out", np.ones(3, np.float32), 1, np.ones(3, np.float32))


# ----------------------------------------------------------------------------- strided-view copies


@pytest.mark.parametrize("dtype", EVERY, ids=str)
def test_view_copies_match_torch_bit_for_bit(dtype):
    """ExecuTorch: ALL dtypes for transpose, t, diagonal, as_strided; REALHBBF16 for unfold."""
    x = rand((3, 4, 5), dtype, seed=7)
    run_out("aten::transpose_copy.int_out", aten.transpose_copy.int(x, 0, -1), to_np(x), 0, -1)
    m = x[0]
    run_out("aten::t_copy.out", aten.t_copy(m), to_np(m))
    run_out("aten::t_copy.out", aten.t_copy(m[0]), to_np(m[0]))
    for offset, d1, d2 in [(0, 0, 1), (1, 1, 2), (-2, -1, 0), (9, 0, 1)]:
        run_out("aten::diagonal_copy.out", aten.diagonal_copy(x, offset, d1, d2), to_np(x), offset, d1, d2)
    for dim, size, step in [(0, 2, 1), (1, 3, 2), (-1, 5, 1), (2, 0, 3)]:
        run_out("aten::unfold_copy.out", aten.unfold_copy(x, dim, size, step), to_np(x), dim, size, step)
    for size, stride, offset in [((4, 3), (5, 1), 2), ((2, 2, 2), (20, 0, 6), None), ((0, 3), (1, 1), 0)]:
        run_out("aten::as_strided_copy.out", aten.as_strided_copy(x, size, stride, offset), to_np(x), size, stride,
                offset)


def test_as_strided_copy_cannot_read_past_its_input():
    x = np.arange(6, dtype=np.float32)
    with pytest.raises(IndexError, match="reaches element 6"):
        run("aten::as_strided_copy.out", x, (2, 2), (3, 2), 1, np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="not a valid view"):
        run("aten::as_strided_copy.out", x, (2,), (-1,), 3, np.zeros((2,), np.float32))


def test_unfold_copy_refuses_windows_too_many_to_hold():
    x = np.zeros(20_000, np.float32)  # 10_001 overlapping windows of 10_000: 10**8 elements
    with pytest.raises(ValueError, match="refusing"):
        run("aten::unfold_copy.out", x, 0, 10_000, 1, np.zeros((1,), np.float32))


def test_t_copy_refuses_three_dims():
    with pytest.raises(ValueError, match="at most 2"):
        run("aten::t_copy.out", np.zeros((2, 2, 2)), np.zeros((2, 2, 2)))


# ----------------------------------------------------------------------------- repeat_interleave


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_repeat_interleave_repeats_each_index(dtype):
    """ExecuTorch: int32 and int64 repeats; out has the repeats' dtype."""
    repeats = torch.tensor([2, 0, 3, 1], dtype=dtype)
    expected = aten.repeat_interleave.Tensor(repeats)
    result = run("aten::repeat_interleave.Tensor_out", to_np(repeats), None, np.zeros((10,), to_np(repeats).dtype))
    assert_matches(result, expected)
    run_out("aten::repeat_interleave.Tensor_out", expected, to_np(repeats), 6)


def test_repeat_interleave_checks_output_size_and_signs():
    with pytest.raises(ValueError, match="output_size 5"):
        run("aten::repeat_interleave.Tensor_out", np.array([1, 2]), 5, np.zeros(5, np.int64))
    with pytest.raises(ValueError, match="negative"):
        run("aten::repeat_interleave.Tensor_out", np.array([1, -2]), None, np.zeros(1, np.int64))


# ----------------------------------------------------------------------------- cdist / pdist


P_VALUES = [0.0, 1.0, 2.0, 3.5, math.inf]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_cdist_matches_torch_with_broadcast_batches(dtype):
    """ExecuTorch: FLOATHBF16. torch has no half cdist: those expectations are float32's, rounded."""
    x1, x2 = rand((2, 1, 4, 3), dtype, seed=8), rand((3, 5, 3), dtype, seed=9)
    x1[..., 0, 0] = x2[0, 0, 0]  # some zero differences, which p = 0 does not count
    for p, mode in product(P_VALUES, [None, 2]):
        expected = via(dtype, torch.float32, lambda a, b: aten._cdist_forward(a, b, p, mode), x1, x2) \
            if dtype in (torch.float16, torch.bfloat16) else aten._cdist_forward(x1, x2, p, mode)
        run_out("aten::_cdist_forward.out", expected, to_np(x1), to_np(x2), p, mode)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_pdist_matches_torch(dtype):
    """ExecuTorch: FLOATHBF16 (half types checked against float32 torch, rounded)."""
    x = rand((5, 4), dtype, seed=10)
    for p in P_VALUES:
        expected = via(dtype, torch.float32, lambda a: aten._pdist_forward(a, p), x) \
            if dtype in (torch.float16, torch.bfloat16) else aten._pdist_forward(x, p)
        run_out("aten::_pdist_forward.out", expected, to_np(x), p)


def test_distances_computed_in_slices_equal_the_whole(monkeypatch):
    """Large inputs are done a slice of rows (pairs) at a time to bound memory: same values."""
    from execupy.kernels.portable import linalg

    x1, x2 = rand((2, 1, 9, 3), torch.float32, seed=8), rand((3, 5, 3), torch.float32, seed=9)
    whole = run_out("aten::_cdist_forward.out", aten._cdist_forward(x1, x2, 3.0, None), to_np(x1), to_np(x2), 3.0, None)
    pairs = run_out("aten::_pdist_forward.out", aten._pdist_forward(x1[0, 0], 1.0), to_np(x1[0, 0]), 1.0)
    monkeypatch.setattr(linalg, "_CHUNK", 7)
    np.testing.assert_array_equal(run("aten::_cdist_forward.out", to_np(x1), to_np(x2), 3.0, None, out_like(
        torch.empty(2, 3, 9, 5))), whole)
    np.testing.assert_array_equal(run("aten::_pdist_forward.out", to_np(x1[0, 0]), 1.0, np.zeros(36, np.float32)),
                                  pairs)


def test_distances_refuse_negative_p_and_mismatched_features():
    with pytest.raises(ValueError, match="non-negative"):
        run("aten::_pdist_forward.out", np.zeros((3, 2), np.float32), -1.0, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="M"):
        run("aten::_cdist_forward.out", np.zeros((3, 2), np.float32), np.zeros((3, 4), np.float32), 2.0, None,
            np.zeros((3, 3), np.float32))


# ----------------------------------------------------------------------------- native_dropout


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("train", [False, True, None])
def test_native_dropout_copies_in_eval_and_with_p_zero(dtype, train):
    """ExecuTorch: FLOATHBF16. Eval (or p = 0) is the identity with an all-True mask."""
    x = rand((4, 5), dtype, seed=11)
    p = 0.5 if train is False else 0.0
    run_outs("aten::native_dropout.out", aten.native_dropout(x, p, train), to_np(x), p, train)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_native_dropout_in_training_drops_with_probability_p_and_rescales(dtype):
    x = rand((200, 50), dtype, seed=12)
    p = 0.3
    out, mask = np.zeros((200, 50), to_np(x).dtype), np.zeros((200, 50), np.bool_)
    result, kept = run("aten::native_dropout.out", to_np(x), p, True, out, mask)
    assert result is out and kept is mask
    assert abs(kept.mean() - (1 - p)) < 0.03, "about 1 - p survive (6.5 standard errors of slack)"
    # kept elements are x / (1 - p) (torch's formula, rounded once), dropped ones are 0
    expected = aten.mul(x, torch.from_numpy(kept)).mul_(1 / (1 - p))
    assert_matches(result, expected)


def test_native_dropout_with_p_one_drops_everything_and_checks_p():
    x = np.ones((3, 3), np.float32)
    out, mask = run("aten::native_dropout.out", x, 1.0, True, np.full((3, 3), 7, np.float32), np.ones((3, 3), bool))
    assert not out.any() and not mask.any()
    with pytest.raises(ValueError, match="between 0 and 1"):
        run("aten::native_dropout.out", x, 1.5, True, np.zeros((3, 3), np.float32), np.zeros((3, 3), bool))


# ----------------------------------------------------------------------------- rand / randn / fill


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_rand_is_uniform_on_zero_to_one_in_every_float_dtype(dtype):
    """ExecuTorch: FLOATHBF16. Values differ each call; none reaches 1 even after rounding."""
    out = out_like(torch.empty((100, 100), dtype=dtype))
    result = run("aten::rand.out", (100, 100), out)
    values = result.astype(np.float64)
    assert result is out and values.min() >= 0 and values.max() < 1
    # bounds of 6 or more standard errors (0.003 for the mean, 0.0013 for the deviation)
    assert abs(values.mean() - 0.5) < 0.02 and abs(values.std() - math.sqrt(1 / 12)) < 0.01
    again = run("aten::rand.out", (100, 100), out_like(torch.empty((100, 100), dtype=dtype)))
    assert not np.array_equal(again, result)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_randn_is_standard_normal_in_every_float_dtype(dtype):
    out = out_like(torch.empty((100, 100), dtype=dtype))
    values = run("aten::randn.out", (100, 100), out).astype(np.float64)
    # bounds of 6 standard errors (0.01 for the mean, 0.007 for the deviation): never flaky
    assert abs(values.mean()) < 0.06 and abs(values.std() - 1) < 0.045
    assert values.min() < -2 and values.max() > 2


def test_random_kernels_resize_and_refuse_integer_out():
    result = run("aten::randn.out", (2, 3), np.zeros((6,), np.float32))
    assert result.shape == (2, 3) and result.dtype == np.float32
    with pytest.raises(TypeError, match="float"):
        run("aten::rand.out", (2,), np.zeros(2, np.int32))


@pytest.mark.parametrize("dtype", EVERY, ids=str)
def test_fill_scalar_and_tensor_match_torch(dtype):
    """ExecuTorch: REALHBBF16 for self, and for the 0-dim value tensor."""
    x = rand((2, 3), dtype, seed=13)
    value = True if dtype == torch.bool else 3 if not dtype.is_floating_point else -2.5
    run_out("aten::fill.Scalar_out", aten.fill.Scalar(x, value), to_np(x), value)
    for value_dtype in (torch.float64, torch.int32, torch.bool):
        v = torch.tensor(7.75 if value_dtype.is_floating_point else True if value_dtype == torch.bool else 9,
                         dtype=value_dtype)
        run_out("aten::fill.Tensor_out", aten.fill.Tensor(x, v), to_np(x), to_np(v))


def test_fill_refuses_a_value_that_overflows_the_dtype():
    with pytest.raises(ValueError, match="overflow"):
        run("aten::fill.Scalar_out", np.zeros(2, np.int8), 300, np.zeros(2, np.int8))


# ----------------------------------------------------------------------------- allclose


@pytest.mark.parametrize("dtype", EVERY, ids=str)
def test_allclose_writes_torchs_answer_into_a_one_element_bool_tensor(dtype):
    """ExecuTorch: any dtype, same shape and dtype on both sides; out is a 1-element bool."""
    a = rand((3, 4), dtype, seed=14)
    near = a.clone() if not dtype.is_floating_point else a * (1 + 1e-6)
    far = rand((3, 4), dtype, seed=15)
    for b, rtol, atol in [(a, 1e-5, 1e-8), (near, 1e-5, 1e-8), (far, 1e-5, 1e-8), (far, 0.0, 100.0)]:
        out = np.zeros((1,), np.bool_)
        assert run("aten::allclose.out", to_np(a), to_np(b), rtol, atol, False, False, out) is out
        assert out[0] == torch.allclose(a, b, rtol, atol)
        np.testing.assert_array_equal(run("aten::allclose.Tensor", to_np(a), to_np(b), rtol, atol, False, False),
                                      [torch.allclose(a, b, rtol, atol)])


@pytest.mark.parametrize("equal_nan", [False, True])
def test_allclose_treats_infinities_and_nan_like_torch(equal_nan):
    a = torch.tensor([1.0, math.inf, -math.inf, math.nan])
    for b in (a.clone(), torch.tensor([1.0, math.inf, math.inf, math.nan])):
        out = np.zeros((), np.bool_)
        run("aten::allclose.out", to_np(a), to_np(b), 1e-5, 1e-8, equal_nan, False, out)
        assert out == torch.allclose(a, b, equal_nan=equal_nan)


def test_allclose_refuses_mismatched_tensors_and_a_wide_out():
    with pytest.raises(ValueError, match="shape"):
        run("aten::allclose.out", np.zeros(2), np.zeros(3), 1e-5, 1e-8, False, False, np.zeros(1, bool))
    with pytest.raises(ValueError, match="one-element bool"):
        run("aten::allclose.out", np.zeros(2), np.zeros(2), 1e-5, 1e-8, False, False, np.zeros(2, bool))


# ----------------------------------------------------------------------------- complex copies


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_conj_physical_and_view_as_real_copy_match_torch(dtype):
    """ExecuTorch: COMPLEXH (complex32 has no numpy dtype, so complex64 and complex128 here).
    execupy's program schema has no complex dtypes yet, so only the kernels are reachable."""
    x = torch.complex(rand((2, 3), torch.float64, seed=16), rand((2, 3), torch.float64, seed=17)).to(dtype)
    xn = x.numpy()
    conj = run("aten::_conj_physical.out", xn, np.zeros_like(xn))
    np.testing.assert_array_equal(conj, aten._conj_physical(x).resolve_conj().numpy())
    real = run("aten::view_as_real_copy.out", xn, np.zeros((2, 3, 2), xn.real.dtype))
    np.testing.assert_array_equal(real, aten.view_as_real_copy(x).numpy())


def test_view_as_real_copy_refuses_a_real_input():
    with pytest.raises(TypeError, match="complex"):
        run("aten::view_as_real_copy.out", np.zeros(2, np.float32), np.zeros((2, 2), np.float32))


# ----------------------------------------------------------------------------- anti-aliased bilinear


AA_CASES = [  # (input H, W), output size, scales: shrinking (where the filter widens), growing, mixed
    ((12, 10), (5, 3), (None, None)),
    ((4, 5), (9, 11), (None, None)),
    ((9, 4), (3, 8), (None, None)),
    ((8, 8), (4, 4), (0.5, 0.5)),
]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("size_in, size_out, scales", AA_CASES)
@pytest.mark.parametrize("align_corners", [False, True])
def test_upsample_bilinear2d_aa_matches_torch(dtype, size_in, size_out, scales, align_corners):
    """ExecuTorch: REALHBF16 — floats here; its integer path (truncating after every tap, which
    torch does not do) is checked against ExecuTorch's runtime below. torch has no half
    antialiasing: those expectations are float32's, rounded."""
    x = rand((2, 3) + size_in, dtype, seed=18)

    def resize(t):
        return aten._upsample_bilinear2d_aa(t, list(size_out), align_corners, *scales)

    expected = via(dtype, torch.float32, resize, x) if dtype in (torch.float16, torch.bfloat16) else resize(x)
    run_out("aten::_upsample_bilinear2d_aa.out", expected, to_np(x), size_out, align_corners, *scales)


# ----------------------------------------------------------------------------- batch norm variants


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_batch_norm_legit_in_eval_uses_the_running_statistics(dtype):
    """ExecuTorch: FLOATHBF16. save_mean/save_invstd stay as planned (ATen returns them empty)."""
    x, w, b = rand((2, 3, 4, 5), dtype, seed=19), rand((3,), dtype, seed=20), rand((3,), dtype, seed=21)
    mean, var = rand((3,), dtype, seed=22), rand((3,), dtype, seed=23).abs()
    expected, _, _ = aten._native_batch_norm_legit(x, w, b, mean, var, False, 0.1, 1e-5)
    out, save_mean, save_invstd = out_like(expected), np.zeros((0,), to_np(x).dtype), np.zeros((0,), to_np(x).dtype)
    result = run("aten::_native_batch_norm_legit.out", to_np(x), to_np(w), to_np(b), to_np(mean), to_np(var), False,
                 0.1, 1e-5, out, save_mean, save_invstd)
    assert result[0] is out
    assert_matches(out, expected)
    assert result[1].size == 0 and result[2].size == 0


def test_batch_norm_legit_refuses_training_mode():
    x, c = np.zeros((2, 3, 4), np.float32), np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="training mode"):
        run("aten::_native_batch_norm_legit.out", x, None, None, c, c + 1, True, 0.1, 1e-5, np.zeros_like(x), c, c)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("affine", [False, True])
def test_batch_norm_legit_no_stats_uses_the_batch_statistics(dtype, affine):
    x = rand((4, 3, 5), dtype, seed=24)
    w, b = (rand((3,), dtype, seed=25), rand((3,), dtype, seed=26)) if affine else (None, None)
    expected = aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)
    run_outs("aten::_native_batch_norm_legit.no_stats_out", expected, to_np(x), None if w is None else to_np(w),
             None if b is None else to_np(b), True, 0.1, 1e-5)


# ----------------------------------------------------------------------------- index_put_


@pytest.mark.parametrize("dtype", EVERY, ids=str)
@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put_updates_its_input_in_place_like_torch(dtype, accumulate):
    """ExecuTorch: every dtype (its in-place kernel copies rows); duplicates add up with accumulate."""
    x = rand((5, 3), dtype, seed=27)
    index = torch.tensor([4, 0, 4] if accumulate else [4, 0, 2])
    values = rand((3, 3), dtype, seed=28)
    expected = x.clone().index_put_((index,), values, accumulate)
    target = to_np(x).copy()
    result = run("aten::index_put_", target, [to_np(index)], to_np(values), accumulate)
    assert result is target, "index_put_ returns the very tensor it updated"
    assert_matches(result, expected)


# ----------------------------------------------------------------------------- ops without kernels


EXAMPLE = Path(execupy.__file__).parent / "examples" / "mlp.pte"


@pytest.mark.parametrize("name, overload", [("aten::convolution_backward", "out"),
                                            ("aten::max_pool2d_with_indices_backward", "grad_input"),
                                            ("et_copy::_h2d_copy", "out"), ("et_copy::_d2h_copy", "out")])
def test_backward_ops_and_device_copies_fail_at_load_naming_the_op(name, overload):
    """Training-only and device-copy operators have no kernel: loading says which one."""
    pte = read_pte(EXAMPLE.read_bytes())
    plan = pte.program.execution_plan[0]
    plan.operators[0].name, plan.operators[0].overload = name, overload
    with pytest.raises(UnsupportedOperatorError, match=f"{name}.{overload}"):
        Program(pte).load_method(plan.name)


# ----------------------------------------------------------------------------- end to end


class UsesTheNewKernels(torch.nn.Module):
    """Ops that survive export as the kernels above (pads and pixel shuffle decompose)."""

    def forward(self, x, y):
        var, mean = torch.var_mean(x, dim=(2, 3), keepdim=True)
        return (var, mean, torch.cdist(x.flatten(2), y.flatten(2)), torch.diagonal(x, 1, 2, 3) + 1,
                x.unfold(3, 2, 2) * 1,
                torch.nn.functional.interpolate(x, size=(3, 5), mode="bilinear", antialias=True),
                torch.bitwise_left_shift(y.to(torch.int32), 2))


@pytest.fixture(scope="module")
def exported_program():
    from torch.export import export

    from execupy.exir import to_edge

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 4, 6, generator=g), torch.randn(2, 3, 4, 6, generator=g) * 8
    prog = to_edge(export(UsesTheNewKernels(), (x, y))).to_executorch()
    return prog.buffer, (x, y)


def test_an_exported_program_with_the_new_kernels_matches_eager(exported_program):
    pte, (x, y) = exported_program
    operators = set(Program.load(pte).method_meta("forward").operators)
    for key in ("aten::var_mean.correction_out", "aten::_cdist_forward.out", "aten::diagonal_copy.out",
                "aten::unfold_copy.out", "aten::_upsample_bilinear2d_aa.out",
                "aten::bitwise_left_shift.Tensor_Scalar_out"):
        assert key in operators, f"{key} is not in the program; the test no longer covers it"
    got = Module(pte).forward(x.numpy(), y.numpy())
    for g, e in zip(got, UsesTheNewKernels()(x, y)):
        assert g.dtype == to_np(e).dtype and g.shape == tuple(e.shape)
        np.testing.assert_allclose(g, to_np(e), rtol=1e-5, atol=1e-5)


@pytest.mark.reference
def test_executorchs_runtime_agrees_on_the_same_program(exported_program):
    pte, (x, y) = exported_program
    ours = Module(pte).forward(x.numpy(), y.numpy())
    (theirs,) = run_reference(pte, [x.numpy(), y.numpy()])
    assert len(theirs) == len(ours)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- programs ExecuTorch wrote

# Each case is exported by ExecuTorch's own exporter and run in its runtime (a worker in the
# reference venv); execupy then runs the same .pte on the same inputs. `forward` is the
# body of a lambda over the inputs; `keep` lists the ATen ops ExecuTorch must not decompose
# (so the program calls the kernel under test, named by `op`); `check` is "same" (ExecuTorch's
# outputs), or for random ops what execupy's outputs must look like.
ET_CASES = {
    "reflection_pad1d": dict(forward="x: F.pad(x, (2, 1), mode='reflect')", inputs="(torch.randn(2, 3, 5),)",
                             keep=["aten.reflection_pad1d.default"]),
    "reflection_pad2d": dict(forward="x: F.pad(x, (2, 1, 0, 3), mode='reflect')", inputs="(torch.randn(2, 3, 4, 5),)",
                             keep=["aten.reflection_pad2d.default"]),
    "reflection_pad3d": dict(forward="x: F.pad(x, (1, 1, 2, 0, 1, 2), mode='reflect')",
                             inputs="(torch.randn(1, 2, 3, 4, 5),)", keep=["aten.reflection_pad3d.default"]),
    "replication_pad1d": dict(forward="x: F.pad(x, (3, 1), mode='replicate')", inputs="(torch.randn(2, 3, 5),)",
                              keep=["aten.replication_pad1d.default"]),
    "replication_pad2d": dict(forward="x: F.pad(x, (2, 1, 0, 3), mode='replicate')",
                              inputs="(torch.randn(2, 3, 4, 5),)", keep=["aten.replication_pad2d.default"]),
    "replication_pad3d": dict(forward="x: F.pad(x, (1, 1, 2, 0, 1, 2), mode='replicate')",
                              inputs="(torch.randn(1, 2, 3, 4, 5),)", keep=["aten.replication_pad3d.default"]),
    "pixel_shuffle": dict(forward="x: F.pixel_shuffle(x, 2)", inputs="(torch.randn(2, 8, 3, 4),)",
                          keep=["aten.pixel_shuffle.default"]),
    "pixel_unshuffle": dict(forward="x: F.pixel_unshuffle(x, 2)", inputs="(torch.randn(2, 3, 4, 6),)",
                            keep=["aten.pixel_unshuffle.default"]),
    "masked_select": dict(forward="x, m: torch.masked_select(x, m)", inputs="(torch.randn(3, 4), torch.rand(4) > 0.5)"),
    "masked_scatter": dict(forward="x, m, s: x.masked_scatter(m, s)",
                           inputs="(torch.randn(3, 4), torch.rand(3, 4) > 0.5, torch.randn(12))"),
    "var_mean": dict(forward="x: torch.var_mean(x, dim=(0, 2), correction=0, keepdim=True)",
                     inputs="(torch.randn(3, 4, 5),)", op="aten::var_mean.correction_out"),
    "bitwise_left_shift": dict(forward="a, b: (torch.bitwise_left_shift(a, b), torch.bitwise_left_shift(a, 3))",
                               inputs="(torch.randint(-100, 100, (4, 5), dtype=torch.int32), "
                                      "torch.randint(0, 8, (5,), dtype=torch.int32))", op="aten::bitwise_left_shift.Tensor_out"),
    "bitwise_right_shift": dict(forward="a, b: (torch.bitwise_right_shift(a, b), torch.bitwise_right_shift(a, 2))",
                                inputs="(torch.randint(-100, 100, (4, 5), dtype=torch.int64), "
                                       "torch.randint(0, 9, (4, 1), dtype=torch.int64))",
                                op="aten::bitwise_right_shift.Tensor_out"),
    "diagonal_copy": dict(forward="x: torch.diagonal(x, 1, 0, 2) * 1", inputs="(torch.randn(4, 3, 5),)"),
    "unfold_copy": dict(forward="x: x.unfold(1, 3, 2) * 1", inputs="(torch.randn(4, 9, 2),)"),
    "t_copy": dict(forward="x: x.t() * 1", inputs="(torch.randn(4, 3),)", keep=["aten.t.default"]),
    "transpose_copy": dict(forward="x: x.transpose(0, 2) * 1", inputs="(torch.randn(4, 3, 2),)",
                           keep=["aten.transpose.int"], op="aten::transpose_copy.int_out"),
    "as_strided_copy": dict(forward="x: torch.as_strided(x, (3, 3), (4, 1), 1) * 1", inputs="(torch.randn(4, 4),)"),
    "repeat_interleave": dict(forward="r: torch.repeat_interleave(r, output_size=7)",
                              inputs="(torch.tensor([2, 0, 4, 1]),)", keep=["aten.repeat_interleave.Tensor"],
                              op="aten::repeat_interleave.Tensor_out"),
    "_cdist_forward": dict(forward="a, b: torch.cdist(a, b, p=1.5)", inputs="(torch.randn(2, 4, 3), torch.randn(2, 5, 3))"),
    "_pdist_forward": dict(forward="x: F.pdist(x, p=3.0)", inputs="(torch.randn(5, 3),)",
                           keep=["aten._pdist_forward.default"]),
    "fill": dict(forward="x: torch.ops.aten.fill.Scalar(x, 2.5)", inputs="(torch.randn(2, 3),)",
                 keep=["aten.fill.Scalar"], op="aten::fill.Scalar_out"),
    "_upsample_bilinear2d_aa": dict(forward="x: F.interpolate(x, size=(3, 5), mode='bilinear', antialias=True)",
                                    inputs="(torch.randn(1, 2, 7, 9),)"),
    "_upsample_bilinear2d_aa_uint8": dict(forward="x: F.interpolate(x, size=(3, 5), mode='bilinear', antialias=True)",
                                          inputs="(torch.randint(0, 256, (1, 2, 7, 9), dtype=torch.uint8),)",
                                          op="aten::_upsample_bilinear2d_aa.out"),
    "_upsample_bilinear2d_aa_int32": dict(forward="x: F.interpolate(x, size=(3, 11), mode='bilinear', antialias=True,"
                                                  " align_corners=True)",
                                          inputs="(torch.randint(-1000, 1000, (2, 1, 7, 5), dtype=torch.int32),)",
                                          op="aten::_upsample_bilinear2d_aa.out"),
    "_native_batch_norm_legit": dict(forward="x: F.batch_norm(x, None, None, training=True)",
                                     inputs="(torch.randn(4, 3, 5),)", op="aten::_native_batch_norm_legit.no_stats_out"),
    "rand": dict(forward="x: torch.rand(64, 64) + x", inputs="(torch.zeros(64, 64),)", check="uniform"),
    "native_dropout": dict(forward="x: F.dropout(x, 0.5, training=True)", inputs="(torch.rand(64, 64) + 1,)",
                           check="dropout"),
}

_ET_WORKER = r"""
import json, sys, traceback
from pathlib import Path
import numpy as np, torch, torch.nn.functional as F
from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
from executorch.extension.pybindings.portable_lib import _load_for_executorch

cases, folder = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
report = {}
for name, case in cases.items():
    try:
        torch.manual_seed(0)
        args, fn = eval(case["inputs"]), eval("lambda " + case["forward"])

        class Case(torch.nn.Module):
            def forward(self, *inputs):
                return fn(*inputs)

        config = EdgeCompileConfig(_check_ir_validity=False, preserve_ops=[eval("torch.ops." + k) for k in case["keep"]])
        program = to_edge_transform_and_lower(torch.export.export(Case(), args), compile_config=config).to_executorch()
        (folder / f"{name}.pte").write_bytes(program.buffer)
        outputs = _load_for_executorch(str(folder / f"{name}.pte")).forward(args)
        np.savez(folder / f"{name}.npz", **{f"in{i}": a.numpy() for i, a in enumerate(args)},
                 **{f"out{i}": o.numpy() for i, o in enumerate(outputs)})
        report[name] = [f"{o.name}.{o.overload}" for o in program.executorch_program.execution_plan[0].operators]
    except Exception as e:
        report[name] = "".join(traceback.format_exception_only(e)).strip()[-500:]
(folder / "report.json").write_text(json.dumps(report, indent=1))
"""


def executorch_case(name: str) -> dict:
    case = dict(keep=[], op=f"aten::{name}.out", check="same") | ET_CASES[name]
    return case


@pytest.fixture(scope="module")
def executorch_programs() -> tuple[Path, dict]:
    """Export and run every case in the reference venv once (about a minute); the results are
    cached in ~/.cache/execupy-conformance under a hash of the cases, the worker and the venv."""
    cases = json.dumps({name: executorch_case(name) for name in ET_CASES}, sort_keys=True)
    return run_worker_once(_ET_WORKER, cases, "portable-more")


def check_random(kind: str, inputs: list[np.ndarray], got: np.ndarray) -> None:
    if kind == "uniform":
        assert got.min() >= 0 and got.max() < 1 and abs(got.mean() - 0.5) < 0.03  # 6.6 standard errors
    else:  # dropout with p = 0.5: each value is dropped, or kept and doubled (ATen's 1 / (1 - p))
        kept = got != 0
        assert abs(kept.mean() - 0.5) < 0.05  # 6.4 standard errors
        np.testing.assert_allclose(got[kept], 2 * inputs[0][kept], rtol=1e-6)


@pytest.mark.reference
@pytest.mark.parametrize("name", ET_CASES)
def test_programs_executorch_wrote_run_the_same_in_execupy(executorch_programs, name):
    folder, report = executorch_programs
    case = executorch_case(name)
    assert isinstance(report[name], list), f"ExecuTorch could not export or run the case: {report[name]}"
    assert case["op"] in report[name], f"the program does not call {case['op']}: {report[name]}"
    inputs, expected, got = worker_case_outputs(folder, name)
    assert len(got) == len(expected)
    for ours, theirs in zip(got, expected):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (ours.dtype, ours.shape, theirs.dtype,
                                                                          theirs.shape)
        if case["check"] != "same":
            check_random(case["check"], inputs, ours)
        elif ours.dtype.kind in "biu":
            np.testing.assert_array_equal(ours, theirs)
        else:
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
