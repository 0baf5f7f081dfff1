"""Source transform of ``export-llm --backend xnnpack``: the dynamically quantized linears
(8da4w, 8da8w) in the rows-first form XnnpackPartitioner lowers to one qd8 x qb4w (or
qd8 x qc8w) FullyConnected each.

The portable form of a quantized linear multiplies weight-first, ``(W @ rows'^T)^T``
(docs/quantized-llm.md); XNNPACK's fully connected node computes ``rows' @ W^T``, so here
the same weight and activation round trip are multiplied as ``F.linear(rows', W)``.

XNNPACK's 4-bit blockwise filters are symmetric (value - 8) with bf16 block scales. A linear
that keeps a GGUF file's Q4_1 blocks (a float minimum per block) has no such form: it is
quantized again, symmetrically (on bf16 scales, so the delegate computes exactly that
weight, each block's scale searched for the least change), from its values, and a warning
says what that changed. ExecuTorch's own export of
such a file quantizes its dequantized values the same way.
A GGUF Q8_0 head (kept as int8 groups of 32 by 8da4w) is quantized to symmetric int4 groups
the same way: XNNPACK has no blockwise int8 filter, and on the portable side ExecuTorch's
runner spent most of a token on it (44 vs 323 tok/s on its own export). Weight-only modes
(int8, int4) keep the portable form. XNNPACK's dynamic quantization (qd8) takes one scale
per token: a down projection's activation blocks (quantize.DOWN_PROJ_BLOCKS) become one.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from execupy.exir.xnnpack.lower import QB4W_BLOCK

from .quantize import DequantizedWeight, QuantizationWarning, QuantizedLinear, grouped, int8_per_token_round_trip


class RowsFirstQuantizedLinear(QuantizedLinear):
    """``y = F.linear(int8 round trip of rows, W) (+ b)``: XNNPACK's fully connected form."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_form()
        rows = int8_per_token_round_trip(x.reshape(-1, x.shape[-1]))
        y = F.linear(rows, w, self.bias)
        return y.reshape(*x.shape[:-1], w.shape[0])


def xnnpack_form(form: nn.Module) -> Optional[str]:
    """"qb4w" / "qc8w" for a weight form XNNPACK keeps quantized, "q4_1" for GGUF 4-bit blocks
    with a minimum, "int8 groups" for GGUF Q8_0 blocks, else None."""
    if not isinstance(form, DequantizedWeight):
        return None
    n, k = form.shape
    group = form.q.shape[1]
    if form.minimum is None and tuple(form.q.shape) == (n, k) and (form.quant_min, form.quant_max) == (-128, 127):
        return "qc8w"
    four_bit = group % QB4W_BLOCK == 0 and k % group == 0 and form.q.shape[0] * group == n * k
    if four_bit and form.minimum is None and form.quant_min >= -8 and form.quant_max <= 7:
        return "qb4w"
    if four_bit and form.minimum is not None and (form.quant_min, form.quant_max) == (0, 15):
        return "q4_1"
    if four_bit and form.minimum is None and (form.quant_min, form.quant_max) == (-128, 127):
        return "int8 groups"  # GGUF Q8_0 blocks: no XNNPACK filter holds int8 in blocks
    return None


# Scales tried per block, as multiples of max|w| / 7.5: the values sit on the file's grid (a
# minimum plus steps), which the symmetric grid does not line up with, so the largest value
# is not always best matched; the search lowers the RMS change by about a sixth.
SCALE_FACTORS = torch.linspace(0.75, 1.25, 26)


def symmetric_blocks(form: DequantizedWeight) -> tuple[DequantizedWeight, float, float]:
    """Q4_1 blocks quantized again as symmetric int4 groups of the same size, from their values,
    on bf16 scales (which XNNPACK holds exactly), each block's scale the one of SCALE_FACTORS
    with the least squared change: (the form, largest absolute change, RMS change)."""
    w = form().detach()
    rows, group = form.q.shape
    blocks = w.reshape(rows, group)
    base = grouped(w, 4, group).scales
    best_err = torch.full((rows,), math.inf)
    scales = base.clone()
    for factor in SCALE_FACTORS:
        s = (base * factor).to(torch.bfloat16).float()
        change = (blocks / s[:, None]).round_().clamp_(-8, 7).mul_(s[:, None]).sub_(blocks)
        err = change.square_().sum(1)
        better = err < best_err
        best_err, scales = torch.where(better, err, best_err), torch.where(better, s, scales)
    q = torch.clamp(torch.round(blocks / scales[:, None]), -8, 7).to(torch.int8)
    again = DequantizedWeight(q, scales, -8, 7, form.shape)
    diff = again().detach() - w
    return again, float(diff.abs().max()), float(diff.pow(2).mean().sqrt())


def xnnpack_linear_forms(model: nn.Module) -> nn.Module:
    """Every dynamically quantized linear XNNPACK can run becomes a RowsFirstQuantizedLinear
    (in place; returns model)."""
    requantized: list[tuple[float, float]] = []
    from_q8: list[tuple[str, float, float]] = []
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if type(child) is not QuantizedLinear or not child.dynamic_activations:
                continue
            form = child.weight_form
            kind = xnnpack_form(form)
            if kind is None:
                continue
            if kind == "q4_1":
                form, largest, rms = symmetric_blocks(form)
                requantized.append((largest, rms))
            elif kind == "int8 groups":
                form, largest, rms = symmetric_blocks(form)
                from_q8.append((attr, largest, rms))
            setattr(parent, attr, RowsFirstQuantizedLinear(form, child.bias, dynamic_activations=True))
    if requantized:
        warnings.warn(
            f"--backend xnnpack: {len(requantized)} linears kept GGUF Q4_1 blocks (a minimum per block), which "
            f"XNNPACK's symmetric 4-bit filters cannot hold; they were quantized again as symmetric int4 groups "
            f"(largest absolute weight change {max(a for a, _ in requantized):.3g}, RMS change up to "
            f"{max(r for _, r in requantized):.3g}). Without --backend xnnpack the file's blocks are kept exactly.",
            QuantizationWarning, stacklevel=2)
    for name, largest, rms in from_q8:
        warnings.warn(
            f"--backend xnnpack: {name} kept GGUF Q8_0 blocks (int8 groups), which no XNNPACK filter holds; "
            f"it was quantized to symmetric int4 groups as ExecuTorch's 8da4w does (largest absolute weight "
            f"change {largest:.3g}, RMS {rms:.3g}; SmolLM2's head costs about +10% perplexity this way). "
            "Left on portable kernels instead, this one product took most of ExecuTorch's decode time.",
            QuantizationWarning, stacklevel=2)
    return model
