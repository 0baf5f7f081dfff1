"""LLM quantization as source transforms: ``nn.Linear`` (and the token embedding) swapped for
modules whose forward traces to the graph forms of ``docs/quantized-llm.md``.

    manager.source_transform([get_quant_weight_transform("8da4w", group_size=32),
                              get_quant_embedding_transform("4,32")])
    manager.source_transform([get_quant_weight_transform("gguf", checkpoint="model.gguf")])

Modes (ExecuTorch's names): ``int8`` weight-only per channel, ``int4`` weight-only grouped,
``8da4w`` / ``8da8w`` int8 dynamic per-token activations with int4 grouped / int8
per-channel weights (``int4`` / ``8da4w`` from a GGUF keep its Q4_0/Q4_1/Q8_0 blocks of
32), and ``gguf``, which keeps a GGUF file's own blocks (Q8_0, Q4_0, Q4_1,
F16, BF16) instead of quantizing again. Every form is "dequantize a constant (add a
constant minimum) (view), then the fp32 program's matmul", in ops ExecuTorch's stock
runtime has, so any runtime runs it and a fast one can fuse it.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

import torch.ao.quantization.fx._decomposed  # noqa: F401  (defines torch.ops.quantized_decomposed.*)

from execupy.errors import ExportError

QUANTIZE_MODES = ("int8", "int4", "8da4w", "8da8w", "gguf")
DEFAULT_GROUP_SIZE = 32
GGUF_GROUP = 32  # the block size of Q8_0, Q4_0 and Q4_1
# 8da4w / 8da8w round the FFN down projection's input through int8 per token in this many
# blocks, each with its own scale; every other linear per token, as ExecuTorch does. That
# input (act(gate) * up) has the heaviest tails of a Llama block: a few channels reach
# 100-2700 where the row's median is ~0.5, so one scale per token leaves the rest a few
# int8 steps. On SmolLM2-135M (whole-text perplexity, windows of 512) per-token scales cost
# +5.0% over the fp32 program and 8 blocks +1.6% (`execupy perplexity`, one BLAS thread); in
# torch eager, 1 / 2 / 4 / 8 blocks +5.4% / +2.8% / +2.5% / +1.5%. The graph gains two
# views; the weights, the ops and their count stay those of ExecuTorch's 8da4w, so its
# runtime runs the file. 1 writes ExecuTorch's graph exactly.
DOWN_PROJ_BLOCKS = 8
DOWN_PROJ = "feed_forward.w2"  # the FFN's down projection in execupy's Transformer
Transform = Callable[[nn.Module], nn.Module]

_qd = torch.ops.quantized_decomposed


class QuantizationWarning(UserWarning):
    """A layer kept in another precision than asked for, or a GGUF tensor that could not be kept exactly."""


# ---------------------------------------------------------------------------- weight forms


class DequantizedWeight(nn.Module):
    """A float weight ``[N, K]`` computed from constants: ``dequantize_per_channel(q, s)`` along
    axis 0 (one scale per row of ``q``), plus the per-row ``minimum`` when there is one,
    viewed to ``shape``. Per-channel int8 has q ``[N, K]``; the grouped forms ``[N*K/G, G]``."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, quant_min: int, quant_max: int,
                 shape: tuple[int, int], minimum: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scales", scales)
        self.register_buffer("minimum", minimum)
        self.quant_min, self.quant_max, self.shape = quant_min, quant_max, tuple(shape)

    @property
    def bits(self) -> int:
        return (self.quant_max - self.quant_min + 1).bit_length() - 1

    def forward(self) -> torch.Tensor:
        w = _qd.dequantize_per_channel(self.q, self.scales, None, 0, self.quant_min, self.quant_max, torch.int8)
        if self.minimum is not None:
            w = w + self.minimum
        return w if tuple(w.shape) == self.shape else w.view(self.shape)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of q dequantized (the gathered groups of a grouped table)."""
        w = _qd.dequantize_per_channel(self.q.index_select(0, index), self.scales.index_select(0, index), None, 0,
                                       self.quant_min, self.quant_max, torch.int8)
        return w if self.minimum is None else w + self.minimum.index_select(0, index)


class HalfWeight(nn.Module):
    """A weight stored in fp16/bf16 and widened to float32 where it is used."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self) -> torch.Tensor:
        return self.weight.to(torch.float32)


class QuantizedLinear(nn.Module):
    """``y = x @ W^T (+ b)`` with ``W = weight()``, in the fp32 program's weight-first form
    (``W @ x^T``, the transpose on the activations); ``dynamic_activations`` rounds the
    activations through int8 per token first (8da4w / 8da8w), each token's row in
    ``activation_blocks`` equal blocks with their own scale (see DOWN_PROJ_BLOCKS)."""

    def __init__(self, weight: nn.Module, bias: Optional[torch.Tensor], dynamic_activations: bool = False,
                 activation_blocks: int = 1) -> None:
        super().__init__()
        self.weight_form = weight
        self.bias = bias
        self.dynamic_activations = dynamic_activations
        self.activation_blocks = activation_blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_form()
        rows = x.reshape(-1, x.shape[-1])
        if self.dynamic_activations:
            rows = int8_per_token_round_trip(rows, self.activation_blocks)
        y = (w @ rows.transpose(0, 1)).transpose(0, 1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], w.shape[0])


def int8_per_token_round_trip(rows: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """Each row quantized to int8 with its own asymmetric scale and zero point, and back;
    with ``blocks`` > 1 each row is cut into that many equal blocks, each a "token" of its own
    (two views around the same three ops: the linear after it is unchanged)."""
    shape = rows.shape
    if blocks > 1:
        rows = rows.reshape(-1, shape[-1] // blocks)
    scales, zero_points = _qd.choose_qparams_per_token_asymmetric(rows, torch.int8)
    q = _qd.quantize_per_token(rows, scales, zero_points, -128, 127, torch.int8)
    rows = _qd.dequantize_per_token(q, scales, zero_points, -128, 127, torch.int8, torch.float32)
    return rows.reshape(shape) if blocks > 1 else rows


# ---------------------------------------------------------------------------- quantizing float weights


def _symmetric(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``w`` quantized symmetrically to ``bits``: scale = max|row| / ((qmax - qmin) / 2),
    torchao's symmetric rule. Returns (q int8, scales float32 [rows])."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    w = w.detach().float()
    scales = w.abs().amax(dim=1) / ((qmax - qmin) / 2)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row dequantizes to 0 anyway
    q = torch.clamp(torch.round(w / scales[:, None]), qmin, qmax).to(torch.int8)
    return q, scales


def per_channel_int8(w: torch.Tensor) -> DequantizedWeight:
    q, scales = _symmetric(w, 8)
    return DequantizedWeight(q, scales, -128, 127, tuple(w.shape))


def grouped(w: torch.Tensor, bits: int, group_size: int) -> DequantizedWeight:
    n, k = w.shape
    q, scales = _symmetric(w.reshape(n * k // group_size, group_size), bits)
    return DequantizedWeight(q, scales, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1, (n, k))


@dataclass(frozen=True)
class _Mode:
    weight_bits: int
    grouped: bool
    dynamic_activations: bool


_MODES = {
    "int8": _Mode(8, False, False),
    "int4": _Mode(4, True, False),
    "8da4w": _Mode(4, True, True),
    "8da8w": _Mode(8, False, True),
}


def get_quant_weight_transform(mode: str, group_size: int | None = None,
                               checkpoint: str | os.PathLike | None = None,
                               say: Callable[[str], None] | None = None,
                               down_proj_blocks: int = DOWN_PROJ_BLOCKS) -> Transform:
    """The source transform for ``--quantize mode``. ``checkpoint``: the .gguf, for ``gguf``, and
    for int4 / 8da4w, which keep its Q4_0/Q4_1/Q8_0 blocks (see quantize_linears); ``say`` gets an info line."""
    check_mode(mode, group_size, checkpoint)
    if mode == "gguf":
        return lambda model: keep_gguf_weights(model, checkpoint)
    return lambda model: quantize_linears(model, mode, group_size or DEFAULT_GROUP_SIZE, checkpoint, say,
                                          down_proj_blocks)


def check_mode(mode: str, group_size: int | None, checkpoint: str | os.PathLike | None = None) -> None:
    if mode not in QUANTIZE_MODES:
        raise ExportError(f"--quantize {mode!r} is not a mode (choose from {', '.join(QUANTIZE_MODES)})")
    if group_size is not None and (group_size <= 0 or group_size & (group_size - 1)):
        raise ExportError(f"--group-size {group_size} must be a power of two")
    if mode == "gguf":
        if checkpoint is None or not os.fspath(checkpoint).endswith(".gguf"):
            raise ExportError("--quantize gguf keeps a GGUF file's own weights; it needs a .gguf checkpoint")
        if group_size is not None:
            raise ExportError("--quantize gguf keeps the file's blocks of 32; --group-size does not apply")


def quantize_linears(model: nn.Module, mode: str, group_size: int = DEFAULT_GROUP_SIZE,
                     checkpoint: str | os.PathLike | None = None,
                     say: Callable[[str], None] | None = None,
                     down_proj_blocks: int = DOWN_PROJ_BLOCKS) -> nn.Module:
    """Swap every ``nn.Linear`` for a QuantizedLinear of ``mode`` (in place; returns model).
    With dynamic activations the down projections round their input in ``down_proj_blocks``
    blocks per token (DOWN_PROJ_BLOCKS says why).

    Groups of 32 from a GGUF ``checkpoint`` (int4 / 8da4w with ``group_size`` 32) keep the
    file's own blocks where its tensor is Q4_0 / Q4_1 (4-bit) or Q8_0 (int8 groups of 32,
    with a QuantizationWarning naming the layer): rounding them a second time onto a
    symmetric 4-bit grid that does not line up with theirs about doubles SmolLM2's
    perplexity, and rounding its Q8_0 output head to 4 bits alone costs +10%. A tied
    embedding then reads the head's kept table instead of its own fp32 copy."""
    spec = _MODES[mode]
    keeps_blocks = spec.grouped and group_size == GGUF_GROUP
    kept = gguf_kept_forms(model, checkpoint) if keeps_blocks else {}
    if say is not None and checkpoint is not None and os.fspath(checkpoint).endswith(".gguf"):
        say(_kept_summary(kept, len(list(_linears(model))), keeps_blocks))
    tied = _tied_embedding(model)
    for name, parent, attr, linear in _linears(model):
        k = linear.in_features
        if name in kept:
            form = kept[name]
            if form.bits == 8:
                warnings.warn(f"{name}: kept as int8 groups of {GGUF_GROUP} (the GGUF's Q8_0 blocks), not rounded to "
                              f"int4: {linear.out_features * k / 2 / 2**20:.1f} MiB more than int4 packed two "
                              "per byte", QuantizationWarning, stacklevel=2)
        elif spec.grouped and k % group_size == 0:
            form = grouped(linear.weight, spec.weight_bits, group_size)
        else:
            if spec.grouped:
                warnings.warn(f"{name}: {k} in-features are not a multiple of group size {group_size}; "
                              "quantized to int8 per channel instead", QuantizationWarning, stacklevel=2)
            form = per_channel_int8(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        blocks = _activation_blocks(name, k, down_proj_blocks) if spec.dynamic_activations else 1
        setattr(parent, attr, QuantizedLinear(form, bias, spec.dynamic_activations, blocks))
    if tied is not None and "output" in kept:
        share_embedding_table(model, kept["output"], tied)
    return model


def check_down_proj_blocks(blocks: int) -> None:
    if blocks < 1:
        raise ExportError(f"--down-proj-blocks {blocks} must be at least 1")


def _activation_blocks(name: str, in_features: int, blocks: int) -> int:
    """Blocks per token for linear ``name``'s int8 activations: ``blocks`` for a down projection
    whose in-features they divide evenly (else the largest count below that does), 1 elsewhere."""
    if not name.endswith(DOWN_PROJ):
        return 1
    return max(b for b in range(1, blocks + 1) if in_features % b == 0)


def _kept_summary(kept: dict[str, DequantizedWeight], linears: int, keeps_blocks: bool) -> str:
    if not keeps_blocks:
        return f"0 of {linears} linears keep the GGUF file's blocks (only int4/8da4w with --group-size {GGUF_GROUP} can)"
    eight = sorted(name for name, form in kept.items() if form.bits == 8)
    line = f"{len(kept) - len(eight)} of {linears} linears keep the GGUF file's 4-bit blocks"
    return line + (f", {len(eight)} its Q8_0 blocks as int8 groups of {GGUF_GROUP} ({', '.join(eight)})" if eight else "")


def _tied_embedding(model: nn.Module) -> Optional[torch.Tensor]:
    """The float table a plain token embedding shares with the output linear, else None."""
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if type(emb) is nn.Embedding and type(out) is nn.Linear and out.weight is emb.weight:
        return emb.weight.detach()
    return None


def share_embedding_table(model: nn.Module, form: DequantizedWeight, table: Optional[torch.Tensor] = None) -> None:
    """The token embedding reads ``form``'s grouped table (the tied output's own constants,
    stored once) when its groups are rows of ``[V*D/G, G]`` and, given ``table``, when they
    rebuild those float values exactly."""
    if form.q.dim() != 2 or form.q.shape[1] != GGUF_GROUP:
        return
    with torch.no_grad():
        if table is not None and not torch.equal(form(), table):
            return
    model.tok_embeddings = GroupedTableEmbedding(form)


def _linears(model: nn.Module):
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                yield (f"{parent_name}.{attr}" if parent_name else attr), parent, attr, child


# ---------------------------------------------------------------------------- embeddings


def _define_embedding_ops() -> Optional[torch.library.Library]:
    """ExecuTorch's quantized-embedding ops on the torch side (torch itself does not define them)."""
    try:
        _qd.embedding_byte, _qd.embedding_4bit  # noqa: B018
        return None
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("quantized_decomposed", "FRAGMENT")
    args = ("Tensor weight, Tensor weight_scales, Tensor? weight_zero_points, int weight_quant_min, "
            "int weight_quant_max, Tensor indices")
    for name, unpack in (("embedding_byte", lambda w: w.float()), ("embedding_4bit", _unpack_4bit)):
        lib.define(f"{name}({args}) -> Tensor")
        lib.define(f"{name}.out({args}, *, Tensor(a!) out) -> Tensor(a!)")

        def eager(weight, scales, zero_points, qmin, qmax, indices, unpack=unpack):
            values = unpack(weight)
            groups = 1 if scales.dim() == 1 else scales.shape[1]
            per_group = values.reshape(values.shape[0], groups, -1)
            if zero_points is not None:
                per_group = per_group - zero_points.reshape(values.shape[0], groups, 1).float()
            table = (per_group * scales.reshape(values.shape[0], groups, 1).float()).reshape(values.shape)
            return table[indices].to(scales.dtype)

        def fake(weight, scales, zero_points, qmin, qmax, indices, name=name):
            dim = weight.shape[1] * (2 if name == "embedding_4bit" else 1)
            return scales.new_empty((*indices.shape, dim))

        lib.impl(name, eager, "CompositeExplicitAutograd")
        lib.impl(name, fake, "Meta")
    return lib


def _unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    high = (packed >> 4).to(torch.int8) - 8
    low = (packed & 0x0F).to(torch.int8) - 8
    return torch.stack((high, low), dim=-1).reshape(packed.shape[0], -1).float()


def _pack_4bit(q: torch.Tensor) -> torch.Tensor:
    """int8 [rows, cols] in -8..7 -> uint8 [rows, cols/2], the even column in the high nibble (ExecuTorch's packing)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] << 4) | u[:, 1::2]


_LIB = _define_embedding_ops()


class QuantizedEmbedding(nn.Module):
    """``embedding_byte`` / ``embedding_4bit`` lookups: symmetric, per row or per group of columns."""

    def __init__(self, weight: torch.Tensor, bits: int, group_size: int | None) -> None:
        super().__init__()
        v, d = weight.shape
        g = group_size or d
        q, scales = _symmetric(weight.reshape(v * d // g, g), bits)
        q = q.reshape(v, d)
        self.bits = bits
        self.register_buffer("weight", q if bits == 8 else _pack_4bit(q))
        self.register_buffer("scales", scales.reshape(v, d // g) if group_size else scales)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return _qd.embedding_byte(self.weight, self.scales, None, -128, 127, tokens)
        return _qd.embedding_4bit(self.weight, self.scales, None, -8, 7, tokens)


def parse_embedding_quantize(text: str) -> tuple[int, Optional[int]]:
    """``"8"``, ``"4"`` or ``"4,32"`` -> (bits, group size or None)."""
    bits_text, _, group_text = text.partition(",")
    try:
        bits, group = int(bits_text), (int(group_text) if group_text else None)
    except ValueError:
        raise ExportError(f"--embedding-quantize {text!r}: expected BITS or BITS,GROUP (e.g. 8 or 4,32)") from None
    if bits not in (4, 8) or (group is not None and group <= 0):
        raise ExportError(f"--embedding-quantize {text!r}: bits must be 8 or 4 and the group size positive")
    return bits, group


def get_quant_embedding_transform(spec: str) -> Transform:
    """The source transform for ``--embedding-quantize BITS[,GROUP]`` (ExecuTorch's name)."""
    bits, group = parse_embedding_quantize(spec)
    return lambda model: quantize_embedding(model, bits, group)


def quantize_embedding(model: nn.Module, bits: int, group_size: int | None) -> nn.Module:
    emb = model.tok_embeddings
    dim = emb.weight.shape[1]
    if group_size is not None and dim % group_size:
        raise ExportError(f"--embedding-quantize: the embedding width {dim} is not a multiple of "
                          f"group size {group_size}")
    if bits == 4 and dim % 2:
        raise ExportError(f"--embedding-quantize 4: the embedding width {dim} must be even (two values per byte)")
    model.tok_embeddings = QuantizedEmbedding(emb.weight.detach(), bits, group_size)
    return model


# ---------------------------------------------------------------------------- GGUF blocks kept


@dataclass
class GGUFBlocks:
    """One GGUF tensor as groups of 32: q int8 [rows, K/32, 32], scales float32 [rows, K/32],
    minimum float32 [rows, K/32] or None; dequantized value = q * scale (+ minimum)."""

    q: np.ndarray
    scales: np.ndarray
    minimum: Optional[np.ndarray]
    quant_min: int
    quant_max: int


def _fp16(block_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(block_bytes).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """GGML's 4-bit layout: byte j of a block holds element j (low nibble) and element j + 16 (high)."""
    return np.concatenate((packed & 0x0F, packed >> 4), axis=-1).astype(np.int8)


def gguf_blocks(f, name: str) -> Optional[GGUFBlocks]:
    """The tensor's blocks when its type is one we keep exactly (Q8_0, Q4_0, Q4_1), else None."""
    kind = f.tensor_type(name)
    rows = f.tensors[name].shape[0]
    if kind not in ("Q8_0", "Q4_0", "Q4_1"):
        return None
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    blocks = f.raw(name).reshape(rows, -1, size)
    d = _fp16(blocks[..., 0:2])
    if kind == "Q8_0":
        return GGUFBlocks(np.ascontiguousarray(blocks[..., 2:]).view(np.int8), d, None, -128, 127)
    if kind == "Q4_0":
        return GGUFBlocks(_nibbles(blocks[..., 2:]) - 8, d, None, -8, 7)
    return GGUFBlocks(_nibbles(blocks[..., 4:]), d, _fp16(blocks[..., 2:4]), 0, 15)


def _permute_rows(blocks: GGUFBlocks, n_heads: int) -> GGUFBlocks:
    from execupy.llm.config import interleaved_to_half

    perm = lambda a: None if a is None else interleaved_to_half(a, n_heads)  # noqa: E731
    return GGUFBlocks(perm(blocks.q), perm(blocks.scales), perm(blocks.minimum), blocks.quant_min, blocks.quant_max)


def _blocks_weight(blocks: GGUFBlocks) -> DequantizedWeight:
    rows, groups, g = blocks.q.shape
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(rows * groups, -1))  # noqa: E731
    minimum = None if blocks.minimum is None else t(blocks.minimum)
    return DequantizedWeight(t(blocks.q), t(blocks.scales).reshape(-1), blocks.quant_min, blocks.quant_max,
                             (rows, groups * g), minimum)


def _requantized_weight(name: str, kind: str, w: np.ndarray) -> DequantizedWeight:
    """A type we do not keep as is: grouped int8 of the dequantized values, with the cost said."""
    form = grouped(torch.from_numpy(w), 8, GGUF_GROUP)
    err = float((form().numpy() - w).__abs__().max())
    warnings.warn(f"{name}: GGUF type {kind} is stored as int8 groups of {GGUF_GROUP} re-quantized from its values; "
                  f"largest absolute change {err:.3g} (max |w| {float(np.abs(w).max()):.3g})",
                  QuantizationWarning, stacklevel=3)
    return form


class GroupedTableEmbedding(nn.Module):
    """An embedding that reads a grouped table ``[V*D/G, G]`` (the tied output weight's own
    constant): the token's D/G groups are gathered with index_select and dequantized."""

    def __init__(self, table: DequantizedWeight) -> None:
        super().__init__()
        self.table = table
        self.dim = table.shape[1]
        self.groups = self.dim // table.q.shape[1]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        starts = tokens.reshape(-1, 1) * self.groups
        index = (starts + torch.arange(self.groups, dtype=torch.long)).reshape(-1)
        return self.table.rows(index).reshape(*tokens.shape, self.dim)


def _gguf_module_tensors(f) -> dict[str, str]:
    """The file's 2-D weights by module name (``layers.3.attention.wq`` -> its GGUF tensor name)."""
    from execupy.llm.gguf_loader import _canonical_name, _LLAMA_BLOCK

    modules: dict[str, str] = {}
    if f.metadata["general.architecture"] == "gpt2":
        return modules  # a fused qkv tensor: no block maps onto one linear
    for gguf_name in f.tensors:
        name = _canonical_name(gguf_name, _LLAMA_BLOCK)
        if name is not None and name.endswith(".weight") and len(f.tensors[gguf_name].shape) == 2:
            modules[name[: -len(".weight")]] = gguf_name
    return modules


def _linear_sources(model: nn.Module, forms: dict[str, nn.Module]):
    """(name, parent, attr, linear, form) for each linear with a form; a tied output reads the embedding's."""
    for name, parent, attr, linear in _linears(model):
        source = "tok_embeddings" if name == "output" and "output" not in forms else name
        if source in forms:
            yield name, parent, attr, linear, forms[source]


def keep_gguf_weights(model: nn.Module, checkpoint: str | os.PathLike) -> nn.Module:
    """Every linear (and the token embedding) of a model loaded from ``checkpoint`` takes the
    GGUF's own blocks: Q8_0/Q4_0/Q4_1 exactly, F16/BF16 as half, F32 as is, others re-quantized."""
    from execupy.llm.gguf_loader import GGUFFile

    f = GGUFFile(checkpoint)
    if f.metadata["general.architecture"] == "gpt2":
        raise ExportError("--quantize gguf: GPT-2 GGUFs (a fused qkv tensor) are not supported; use --quantize int8")
    forms = {module: _gguf_form(f, gguf_name, module, model.config)
             for module, gguf_name in _gguf_module_tensors(f).items()}
    for _, parent, attr, linear, form in _linear_sources(model, forms):
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(parent, attr, QuantizedLinear(form, bias))
    emb = forms.get("tok_embeddings")
    if isinstance(emb, DequantizedWeight):
        share_embedding_table(model, emb)  # the same buffers as a tied output
    return model


def gguf_kept_forms(model: nn.Module, checkpoint: str | os.PathLike | None) -> dict[str, DequantizedWeight]:
    """Linear name -> the file's own blocks, for the linears of ``model`` whose GGUF tensor is
    Q4_0 / Q4_1 (Q4_0 is symmetric int4 with q - 8; Q4_1 the grouped form with a minimum) or
    Q8_0 (grouped int8). Empty for a checkpoint that is not a .gguf."""
    if checkpoint is None or not os.fspath(checkpoint).endswith(".gguf"):
        return {}
    from execupy.llm.gguf_loader import GGUFFile

    f = GGUFFile(checkpoint)
    modules = _gguf_module_tensors(f)
    forms = {module: _blocks_weight(_gguf_blocks_in_model_order(f, gguf_name, module, model.config))
             for module, gguf_name in modules.items() if f.tensor_type(gguf_name) in ("Q4_0", "Q4_1", "Q8_0")}
    return {name: form for name, _, _, _, form in _linear_sources(model, forms)}


def _gguf_blocks_in_model_order(f, gguf_name: str, module: str, config) -> Optional[GGUFBlocks]:
    """gguf_blocks with llama.cpp's interleaved q/k rows put back in the model's order."""
    blocks = gguf_blocks(f, gguf_name)
    heads = _permuted_heads(f, module, config)
    return _permute_rows(blocks, heads) if blocks is not None and heads else blocks


def _permuted_heads(f, module: str, config) -> Optional[int]:
    """The head count of a q/k projection whose rows the file interleaves, else None."""
    from execupy.llm.gguf_loader import _PERMUTED_QK_ARCHS

    if f.metadata["general.architecture"] not in _PERMUTED_QK_ARCHS:
        return None
    return {"attention.wq": config.n_heads, "attention.wk": config.n_kv_heads}.get(module.split(".", 2)[-1])


def _gguf_form(f, gguf_name: str, module: str, config) -> nn.Module:
    kind = f.tensor_type(gguf_name)
    blocks = _gguf_blocks_in_model_order(f, gguf_name, module, config)
    if blocks is not None:
        return _blocks_weight(blocks)
    from execupy.llm.config import interleaved_to_half

    w = f.dequantize(gguf_name)
    if heads := _permuted_heads(f, module, config):
        w = interleaved_to_half(w, heads)
    if kind in ("F16", "BF16"):
        return HalfWeight(torch.from_numpy(w).to(torch.float16 if kind == "F16" else torch.bfloat16))
    if kind == "F32":
        return FloatWeight(torch.from_numpy(w))
    return _requantized_weight(gguf_name, kind, w)


class FloatWeight(nn.Module):
    """A float weight as it is: the weight form of a float linear multiplied weight-first."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self) -> torch.Tensor:
        return self.weight

