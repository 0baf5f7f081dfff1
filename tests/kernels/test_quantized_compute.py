"""quantized_decomposed:: embedding and compute kernels against torch references.

torch has no kernels for these ExecuTorch-only ops, so each reference is written with
torch's own quantized_decomposed dequantize ops and ATen (F.embedding, matmul, add): the
packing and the arithmetic are spelled out once in torch and once in our numpy kernels.
Every dtype ExecuTorch's kernels accept is covered: tables of int8/uint8 bytes or packed
4-/2-bit values, scales and outputs in float32 or float16, with and without zero points,
per row or per group.
"""
from __future__ import annotations

import pytest
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)
import torch.nn.functional as F

from .test_reduce_linalg import code, rand, run, run_out, to_np

qd = torch.ops.quantized_decomposed
FLOATS = [torch.float32, torch.float16]


def scales_for(rows: int, groups: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(rows, groups, generator=g) * 0.05 + 0.01
    return (s[:, 0] if groups == 1 else s).to(dtype)


def dequantized_table(values: torch.Tensor, scales: torch.Tensor, zero_points, qmin: int, qmax: int,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """torch's per-channel-group dequantize of an unpacked [rows, dim] table."""
    groups = 1 if scales.dim() == 1 else scales.shape[1]
    table = qd.dequantize_per_channel_group(values, scales.float(), None if zero_points is None else zero_points.float(),
                                            qmin, qmax, values.dtype, values.shape[1] // groups, torch.float32)
    return table.to(out_dtype)


def pack_4bit(values: torch.Tensor) -> torch.Tensor:
    """int8 in -8..7 -> uint8, even column in the high nibble (ExecuTorch's packing)."""
    v = (values + 8).to(torch.uint8)
    return (v[:, 0::2] << 4) | v[:, 1::2]


def pack_2bit(values: torch.Tensor) -> torch.Tensor:
    """int8 in -2..1 -> uint8, column 4k in the lowest two bits."""
    v = (values + 2).to(torch.uint8)
    return v[:, 0::4] | (v[:, 1::4] << 2) | (v[:, 2::4] << 4) | (v[:, 3::4] << 6)


TABLES = {  # name -> (bits, quant range, weight dtype, packer)
    "embedding_byte/int8": (8, (-128, 127), torch.int8, None),
    "embedding_byte/uint8": (8, (0, 255), torch.uint8, None),
    "embedding_4bit": (4, (-8, 7), torch.int8, pack_4bit),
    "embedding_2bit": (2, (-2, 1), torch.int8, pack_2bit),
}


@pytest.mark.parametrize("table", sorted(TABLES))
@pytest.mark.parametrize("ftype", FLOATS)
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("with_zero_points", [False, True])
@pytest.mark.parametrize("variant", ["out", "dtype_out"])
def test_quantized_embedding_matches_dequantize_then_embedding(table, ftype, groups, with_zero_points, variant):
    bits, (qmin, qmax), wtype, pack = TABLES[table]
    rows, dim = 10, 32
    values = torch.randint(qmin, qmax + 1, (rows, dim), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    values = values.to(wtype if pack is None else torch.int8)
    scales = scales_for(rows, groups, ftype, seed=2)
    zero_points = (torch.randint(qmin, qmax + 1, scales.shape, generator=torch.Generator().manual_seed(3))
                   .to(ftype) if with_zero_points else None)
    indices = torch.tensor([[0, 3, 9], [9, 9, 1]])
    expected = F.embedding(indices, dequantized_table(values, scales, zero_points, qmin, qmax, ftype))

    stored = values if pack is None else pack(values)
    args = [to_np(stored), to_np(scales), None if zero_points is None else to_np(zero_points), qmin, qmax,
            to_np(indices)]
    if variant == "dtype_out":
        args.append(code(ftype))
    name = table.split("/")[0]
    run_out(f"quantized_decomposed::{name}.{variant}", expected, *args)


def test_quantized_embedding_refuses_an_out_of_range_index_and_a_wrong_dtype():
    weight = to_np(torch.zeros(4, 8, dtype=torch.int8))
    scales = to_np(torch.ones(4))
    out = to_np(torch.zeros(1, 8))
    with pytest.raises(IndexError, match="out of range"):
        run("quantized_decomposed::embedding_byte.out", weight, scales, None, -128, 127, to_np(torch.tensor([4])), out)
    with pytest.raises(TypeError, match="does not match"):
        run("quantized_decomposed::embedding_byte.dtype_out", weight, scales, None, -128, 127,
            to_np(torch.tensor([1])), code(torch.float16), out)


@pytest.mark.parametrize("ftype", FLOATS)
def test_mixed_mm_scales_each_weight_row(ftype):
    x = rand((3, 16), torch.float32, seed=4).to(ftype)
    w = rand((16, 5), torch.int8, seed=5, low=-128, high=128)
    scales = scales_for(16, 1, ftype, seed=6)
    expected = (x.float() @ (w.float() * scales.float()[:, None])).to(ftype)
    run_out("quantized_decomposed::mixed_mm.out", expected, to_np(x), to_np(w), to_np(scales), None)


@pytest.mark.parametrize("ftype", FLOATS)
@pytest.mark.parametrize("in_features,groups", [(16, 1), (16, 4), (10, 3)])
def test_mixed_linear_per_row_and_grouped_scales(ftype, in_features, groups):
    x = rand((3, in_features), torch.float32, seed=7).to(ftype)
    w = rand((6, in_features), torch.int8, seed=8, low=-128, high=128)
    scales = scales_for(6, groups, ftype, seed=9)
    # Groups of ceil(n / groups) columns, the last one shorter when they do not divide n.
    group = -(-in_features // groups)
    per_column = scales.float().reshape(6, -1).repeat_interleave(group, dim=1)[:, :in_features]
    expected = F.linear(x.float(), w.float() * per_column).to(ftype)
    run_out("quantized_decomposed::mixed_linear.out", expected, to_np(x), to_np(w), to_np(scales), None, None)


def test_mixed_linear_refuses_zero_points_like_executorch():
    x, w, s = to_np(torch.ones(1, 4)), to_np(torch.ones(2, 4, dtype=torch.int8)), to_np(torch.ones(2))
    with pytest.raises(ValueError, match="zero points"):
        run("quantized_decomposed::mixed_linear.out", x, w, s, s, None, to_np(torch.zeros(1, 2)))


@pytest.mark.parametrize("qtype", [torch.uint8, torch.int16, torch.int32])
def test_quantized_add_equals_dequantize_add_quantize(qtype):
    a = rand((4, 8), qtype, seed=10, low=0, high=256)
    b = rand((4, 8), qtype, seed=11, low=0, high=256)
    a_q, b_q, o_q = (0.02, 128, 0, 255), (0.03, 100, 0, 255), (0.045, 120, 0, 255)
    expected = qd.quantize_per_tensor(
        qd.dequantize_per_tensor(a, a_q[0], a_q[1], 0, 255, qtype) + qd.dequantize_per_tensor(b, b_q[0], b_q[1], 0, 255, qtype),
        o_q[0], o_q[1], 0, 255, qtype)
    run_out("quantized_decomposed::add.out", expected, to_np(a), *a_q, to_np(b), *b_q, *o_q)
