"""quantized_decomposed:: kernels against torch's reference ops on seeded random inputs.

The torch ops live in `torch.ao.quantization.fx._decomposed` (importing it registers
`torch.ops.quantized_decomposed`). Quantized integers must match exactly, including
round-half-to-even ties and clamping; dequantized floats to the last bit or two.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)

from .test_reduce_linalg import assert_matches, code, out_like, rand, run, run_out, to_np

qd = torch.ops.quantized_decomposed
QTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32]
FLOAT_INPUTS = [torch.float32, torch.float16, torch.bfloat16]


def qrange(dtype: torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dtype)
    return info.min, info.max


def spread(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Values a few quantization steps wide, beyond the int8 range at the edges."""
    return (rand(shape, torch.float32, seed=seed) * 2).to(dtype)


# ------------------------------------------------------------------ per tensor


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("ftype", FLOAT_INPUTS)
def test_quantize_per_tensor_rounds_half_to_even_and_clamps(qtype, ftype):
    qmin, qmax = qrange(qtype)
    scale, zp = 0.0125, (3 if qtype != torch.uint8 else 128)
    x = spread((4, 16), ftype, seed=1)
    x.view(-1)[:8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3e4, -3e4]).to(ftype) * scale  # ties, clamps
    expected = qd.quantize_per_tensor(x, scale, zp, qmin, qmax, qtype)
    run_out("quantized_decomposed::quantize_per_tensor.out", expected, to_np(x), scale, zp, qmin, qmax, code(qtype))


def test_quantize_per_tensor_clamps_to_exact_int32_bounds():
    # torch clamps in float32, where 2**31 - 1 rounds up to 2**31 and the cast then overflows;
    # the kernel clamps in float64 so the bounds hold exactly (as ExecuTorch's kernel does).
    x = np.array([np.inf, -np.inf, 3e38, -3e38], np.float32)
    info = np.iinfo(np.int32)
    q = run("quantized_decomposed::quantize_per_tensor.out", x, 0.5, 0, int(info.min), int(info.max),
            code(torch.int32), np.zeros(4, np.int32))
    assert q.tolist() == [info.max, info.min, info.max, info.min]


def test_quantize_per_tensor_honours_a_narrow_quant_range():
    x = spread((64,), seed=2)
    expected = qd.quantize_per_tensor(x, 0.01, -4, -127, 127, torch.int8)
    assert int(expected.min()) == -127
    run_out("quantized_decomposed::quantize_per_tensor.out", expected, to_np(x), 0.01, -4, -127, 127, code(torch.int8))


def test_quantize_per_tensor_tensor_args():
    x = spread((3, 8), seed=3)
    scale, zp = torch.tensor([0.02], dtype=torch.float64), torch.tensor([-7], dtype=torch.int64)
    expected = qd.quantize_per_tensor.tensor(x, scale, zp, -128, 127, torch.int8)
    run_out("quantized_decomposed::quantize_per_tensor.Tensor_out", expected, to_np(x), to_np(scale), to_np(zp),
            -128, 127, code(torch.int8))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.float64])
def test_dequantize_per_tensor(qtype, out_dtype):
    qmin, qmax = qrange(qtype)
    q = torch.randint(max(qmin, -1000), min(qmax, 1000) + 1, (4, 8), generator=torch.Generator().manual_seed(4)).to(qtype)
    expected = qd.dequantize_per_tensor(q, 0.03, 5, qmin, qmax, qtype, out_dtype=out_dtype)
    run_out("quantized_decomposed::dequantize_per_tensor.out", expected, to_np(q), 0.03, 5, qmin, qmax, code(qtype),
            None if out_dtype is None else code(out_dtype))
    scale, zp = torch.tensor([0.03], dtype=torch.float64), torch.tensor([5])
    expected = qd.dequantize_per_tensor.tensor(q, scale, zp, qmin, qmax, qtype, out_dtype=out_dtype)
    run_out("quantized_decomposed::dequantize_per_tensor.Tensor_out", expected, to_np(q), to_np(scale), to_np(zp),
            qmin, qmax, code(qtype), None if out_dtype is None else code(out_dtype))


def test_dequantize_rejects_an_input_of_another_dtype():
    q = np.zeros((2, 2), np.uint8)
    with pytest.raises(TypeError):
        run("quantized_decomposed::dequantize_per_tensor.out", q, 0.1, 0, -128, 127, code(torch.int8), None,
            np.zeros((2, 2), np.float32))


def test_quantize_rejects_a_range_outside_the_dtype():
    with pytest.raises(ValueError):
        run("quantized_decomposed::quantize_per_tensor.out", np.zeros(3, np.float32), 0.1, 0, -129, 127,
            code(torch.int8), np.zeros(3, np.int8))


def test_quantize_then_dequantize_is_within_half_a_step():
    x = spread((5, 7), seed=5) / 4
    scale = 0.01
    q = run("quantized_decomposed::quantize_per_tensor.out", to_np(x), scale, 0, -128, 127, code(torch.int8),
            np.zeros((5, 7), np.int8))
    back = run("quantized_decomposed::dequantize_per_tensor.out", q, scale, 0, -128, 127, code(torch.int8), None,
               np.zeros((5, 7), np.float32))
    inside = np.abs(to_np(x)) < 127 * scale
    assert inside.any()
    assert np.all(np.abs(back - to_np(x))[inside] <= scale / 2 + 1e-7)


# ------------------------------------------------------------------ per channel


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ftype", FLOAT_INPUTS)
def test_quantize_per_channel(axis, scale_dtype, ftype):
    x = spread((4, 6, 5), ftype, seed=6)
    channels = x.shape[axis]
    scales = (torch.rand(channels, generator=torch.Generator().manual_seed(7)) * 0.05 + 0.005).to(scale_dtype)
    zps = torch.arange(channels, dtype=torch.int64) - 2
    expected = qd.quantize_per_channel(x, scales, zps, axis % 3, -128, 127, torch.int8)
    run_out("quantized_decomposed::quantize_per_channel.out", expected, to_np(x), to_np(scales), to_np(zps), axis,
            -128, 127, code(torch.int8))


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("with_zero_points", [True, False])
@pytest.mark.parametrize("out_dtype", [None, torch.float16])
def test_dequantize_per_channel(axis, with_zero_points, out_dtype):
    q = rand((6, 8), torch.int8, seed=8, low=-128, high=128)
    channels = q.shape[axis]
    scales = torch.rand(channels, generator=torch.Generator().manual_seed(9)) * 0.05 + 0.005
    zps = torch.arange(channels, dtype=torch.int64) if with_zero_points else None
    expected = qd.dequantize_per_channel(q, scales, zps, axis, -127, 127, torch.int8, out_dtype=out_dtype)
    run_out("quantized_decomposed::dequantize_per_channel.out", expected, to_np(q), to_np(scales),
            None if zps is None else to_np(zps), axis, -127, 127, code(torch.int8),
            None if out_dtype is None else code(out_dtype))


# ------------------------------------------------------------------ choose_qparams


@pytest.mark.parametrize("shift", [0.0, 3.0, -3.0])  # mixed signs, all positive, all negative
@pytest.mark.parametrize("qtype, qmin, qmax", [(torch.int8, -128, 127), (torch.uint8, 0, 255)])
def test_choose_qparams_matches_torch_exactly(shift, qtype, qmin, qmax):
    x = spread((4, 32), seed=10) + shift
    eps = float(torch.finfo(torch.float32).eps)
    scale, zp = qd.choose_qparams.tensor(x, qmin, qmax, eps, qtype)
    outs = (out_like(scale), out_like(zp))
    got = run("quantized_decomposed::choose_qparams.Tensor_out", to_np(x), qmin, qmax, eps, code(qtype), *outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    np.testing.assert_array_equal(got[0], to_np(scale))
    np.testing.assert_array_equal(got[1], to_np(zp))


def test_choose_qparams_of_zeros_uses_eps_as_the_scale():
    x = torch.zeros(8)
    scale, zp = qd.choose_qparams.tensor(x, -128, 127, 1e-3, torch.int8)
    got = run("quantized_decomposed::choose_qparams.Tensor_out", to_np(x), -128, 127, 1e-3, code(torch.int8),
              out_like(scale), out_like(zp))
    np.testing.assert_array_equal(got[0], to_np(scale))
    np.testing.assert_array_equal(got[1], to_np(zp))


def test_choose_qparams_per_token_asymmetric():
    x = spread((2, 5, 16), seed=11)
    x[0, 0] = x[0, 0].abs() + 1  # a row with no negative values
    x[1, 1] = 0.0  # an all-zero row: the scale falls back to eps
    scale, zp = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
    got = run("quantized_decomposed::choose_qparams_per_token_asymmetric.out", to_np(x), code(torch.int8),
              out_like(scale), out_like(zp))
    assert_matches(got[0], scale)
    assert_matches(got[1], zp)


# ------------------------------------------------------------------ per token / per group


def test_quantize_and_dequantize_per_token():
    x = spread((2, 5, 16), seed=12)
    scale, zp = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
    q_torch = qd.quantize_per_token(x, scale, zp, -128, 127, torch.int8)
    q = run_out("quantized_decomposed::quantize_per_token.out", q_torch, to_np(x), to_np(scale), to_np(zp),
                -128, 127, code(torch.int8))
    for out_dtype in (torch.float32, torch.float16):
        expected = qd.dequantize_per_token(q_torch, scale, zp, -128, 127, torch.int8, out_dtype)
        run_out("quantized_decomposed::dequantize_per_token.out", expected, q, to_np(scale), to_np(zp),
                -128, 127, code(torch.int8), code(out_dtype))


@pytest.mark.parametrize("with_zero_points", [True, False])
@pytest.mark.parametrize("group_size", [4, 8, 64])  # 64 > columns: one group per row, as torch allows
def test_dequantize_per_channel_group(with_zero_points, group_size):
    q = rand((6, 8), torch.int8, seed=13, low=-8, high=8)
    groups = 6 * 8 // min(group_size, 8)
    scales = torch.rand(groups, 1, generator=torch.Generator().manual_seed(14)) * 0.1 + 0.01
    zps = rand((groups, 1), torch.int32, seed=15, low=-2, high=3) if with_zero_points else None
    expected = qd.dequantize_per_channel_group(q, scales, zps, -8, 7, torch.int8, group_size, torch.float32)
    run_out("quantized_decomposed::dequantize_per_channel_group.out", expected, to_np(q), to_np(scales),
            None if zps is None else to_np(zps), -8, 7, code(torch.int8), group_size, code(torch.float32))
