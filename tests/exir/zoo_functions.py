"""More zoo models, built from the torch functions people call in real models: norms,
einsum, padding in every mode, attention with masks, resizing, patches, recurrent cells,
sorting, scatter and index writes, and two small front ends (audio, ViT).

Same conventions as zoo.py (each `@case` adds a Case to zoo.CASES). Many of these only
export because to_edge decomposes the ops execupy has no kernel for.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim

from .zoo import case, rand

# ---------------------------------------------------------------------------- norms and algebra


class VectorNorms(nn.Module):
    def forward(self, x):
        return (torch.linalg.vector_norm(x, dim=-1), x.norm(), x.norm(p=1, dim=0, keepdim=True),
                torch.linalg.vector_norm(x, ord=3, dim=(0, 1)), torch.linalg.vector_norm(x, ord=float("inf"), dim=1),
                F.normalize(x, dim=-1))


@case()
def vector_norms():
    return VectorNorms(), (rand(3, 4, 5),)


class MatrixNorms(nn.Module):
    def forward(self, x):
        return (torch.linalg.matrix_norm(x), torch.linalg.matrix_norm(x, ord=1), torch.linalg.matrix_norm(x, ord=float("inf")),
                torch.linalg.norm(x, dim=(-2, -1)), x.norm(p="fro", dim=(1, 2)))


@case()
def matrix_norms():
    return MatrixNorms(), (rand(2, 3, 4),)


class Einsums(nn.Module):
    def forward(self, a, b, v):
        return (torch.einsum("bij,bjk->bik", a, b), torch.einsum("bij->bji", a), torch.einsum("i,j->ij", v, v),
                torch.einsum("bij,bij->b", a, a), torch.einsum("bhi,ij->bhj", a, b[0]))


@case()
def einsum_contractions():
    return Einsums(), (rand(2, 3, 4), rand(2, 4, 3), rand(5))


class Scans(nn.Module):
    def forward(self, x, n):
        return torch.cumsum(x, dim=0), torch.cumsum(x, dim=-1, dtype=torch.float64), x.cumsum(1).flip(1), torch.cumsum(n, 0)


@case()
def cumulative_sums():
    return Scans(), (rand(3, 5), torch.randint(-5, 5, (4, 2)))


class FlipRoll(nn.Module):
    def forward(self, x):
        return torch.flip(x, dims=[0, 2]), x.flip(-1), torch.roll(x, 2, dims=1), torch.roll(x, (1, -1), dims=(0, 2)), torch.rot90(x, 1, (1, 2))


@case()
def flip_roll():
    return FlipRoll(), (rand(2, 3, 4),)


# ---------------------------------------------------------------------------- padding


class PadConstant(nn.Module):
    def forward(self, x):
        return F.pad(x, (1, 2), value=-1.0), F.pad(x, (0, 1, 2, 0), mode="constant"), F.pad(x, (1, 1, 1, 1, 1, 0), value=3.0)


@case()
def pad_constant():
    return PadConstant(), (rand(2, 3, 4),)


class PadReflect(nn.Module):
    def forward(self, x):
        return F.pad(x, (2, 1), mode="reflect"), F.pad(x.unsqueeze(0), (1, 2, 2, 1), mode="reflect")


@case()
def pad_reflect():
    return PadReflect(), (rand(2, 4, 5),)


class PadReplicate(nn.Module):
    def forward(self, x):
        return (F.pad(x, (2, 1), mode="replicate"), F.pad(x.unsqueeze(0), (1, 2, 0, 3), mode="replicate"),
                F.pad(x.unsqueeze(0).unsqueeze(0), (1, 1, 1, 0, 0, 1), mode="replicate"))


@case()
def pad_replicate():
    return PadReplicate(), (rand(2, 3, 4),)


class PadCircular(nn.Module):
    def forward(self, x):
        return F.pad(x, (2, 1), mode="circular"), F.pad(x.unsqueeze(0), (1, 2, 2, 1), mode="circular")


@case()
def pad_circular():
    return PadCircular(), (rand(2, 4, 5),)


# ---------------------------------------------------------------------------- attention


class SDPABoolMask(nn.Module):
    def forward(self, q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@case()
def sdpa_bool_mask():
    keep = torch.rand(1, 1, 5, 6) > 0.3
    keep[..., 0] = True  # every query sees at least one key
    return SDPABoolMask(), (rand(2, 2, 5, 8), rand(2, 2, 6, 8), rand(2, 2, 6, 8), keep)


class SDPAFloatMask(nn.Module):
    def forward(self, q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)


@case()
def sdpa_float_mask():
    return SDPAFloatMask(), (rand(2, 3, 4, 8), rand(2, 3, 6, 8), rand(2, 3, 6, 8), rand(4, 6))


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x, pad):
        out, weights = self.attn(x, x, x, key_padding_mask=pad)
        return out, weights


@case()
def multihead_attention_padding_mask():
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    return MHA().eval(), (rand(2, 5, 16), pad)


# ---------------------------------------------------------------------------- resizing and patches


class Bilinear(nn.Module):
    def forward(self, x):
        return (F.interpolate(x, scale_factor=2, mode="bilinear"), F.interpolate(x, size=(5, 7), mode="bilinear", align_corners=True),
                F.interpolate(x, size=(3, 3), mode="bilinear"))


@case()
def interpolate_bilinear():
    return Bilinear(), (rand(1, 2, 4, 5),)


class Bicubic(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=2, mode="bicubic"), F.interpolate(x, size=(6, 3), mode="bicubic", align_corners=True)


@case(atol=1e-4)
def interpolate_bicubic():
    return Bicubic(), (rand(1, 2, 4, 5),)


class Nearest(nn.Module):
    def forward(self, x, s):
        return F.interpolate(x, scale_factor=2, mode="nearest"), F.interpolate(s, size=7, mode="linear")


@case()
def interpolate_nearest_linear():
    return Nearest(), (rand(1, 2, 3, 4), rand(1, 2, 5))


class Patches(nn.Module):
    def forward(self, x):
        cols = F.unfold(x, kernel_size=2, stride=2)
        overlapping = F.unfold(x, kernel_size=3, padding=1, stride=(1, 2))
        return cols, overlapping, F.fold(cols, (4, 6), kernel_size=2, stride=2)


@case()
def unfold_patches():
    return Patches(), (rand(1, 2, 4, 6),)


class Windows(nn.Module):
    def forward(self, x):
        return x.unfold(3, 3, 2), x.unfold(1, 1, 1)  # Tensor.unfold: sliding windows along a dim


@case()
def tensor_unfold_windows():
    return Windows(), (rand(1, 2, 4, 6),)


class PixelShuffle(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 12, 3, padding=1)
        self.up = nn.PixelShuffle(2)
        self.down = nn.PixelUnshuffle(2)

    def forward(self, x):
        y = self.up(self.conv(x))
        return y, self.down(y)


@case()
def pixel_shuffle():
    return PixelShuffle().eval(), (rand(1, 3, 4, 4),)


# ---------------------------------------------------------------------------- normalization


def randomize(*params: torch.Tensor) -> None:
    with torch.no_grad():
        for p in params:
            p.normal_()


class GroupNorm4d(nn.Module):
    def __init__(self):
        super().__init__()
        self.group = nn.GroupNorm(3, 6)
        randomize(self.group.weight, self.group.bias)

    def forward(self, x):
        return self.group(x), F.group_norm(x, 2), F.group_norm(x, 6)


@case(atol=1e-4)
def group_norm_4d():
    return GroupNorm4d().eval(), (rand(2, 6, 3, 4),)


class InstanceNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine = nn.InstanceNorm2d(6, affine=True)
        self.plain = nn.InstanceNorm1d(4)
        randomize(self.affine.weight, self.affine.bias)

    def forward(self, x, s):
        return self.affine(x), self.plain(s)


@case(atol=1e-4)
def instance_norm():
    return InstanceNorms().eval(), (rand(2, 6, 3, 4), rand(2, 4, 7))


class Stats(nn.Module):
    def forward(self, x):
        return (torch.var(x, dim=1), x.std(dim=-1, keepdim=True, correction=0), torch.logsumexp(x, dim=0), x.std(),
                x.mean(dim=(0, 1)), torch.aminmax(x, dim=0).max, x.prod(dim=1))


@case()
def statistics():
    return Stats(), (rand(4, 6),)


class VarMean(nn.Module):
    def forward(self, x):
        var, mean = torch.var_mean(x, dim=1)
        std, mean2 = torch.std_mean(x, dim=-1, keepdim=True, correction=0)
        return var, mean, std, mean2


@case()
def var_mean_pairs():
    return VarMean(), (rand(4, 6),)


# ---------------------------------------------------------------------------- recurrent cells


class Cells(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRUCell(6, 8)
        self.lstm = nn.LSTMCell(6, 8)

    def forward(self, xs, h):
        g, c, hl = h, torch.zeros_like(h), h
        for t in range(xs.shape[1]):
            g = self.gru(xs[:, t], g)
            hl, c = self.lstm(xs[:, t], (hl, c))
        return g, hl, c


@case(atol=1e-5)
def gru_lstm_cells():
    return Cells().eval(), (rand(2, 3, 6), rand(2, 8))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(5, 7, batch_first=True)
        self.lstm = nn.LSTM(5, 6, num_layers=2, batch_first=True)

    def forward(self, x):
        g, gh = self.gru(x)
        o, (h, c) = self.lstm(x)
        return g, gh, o, h, c


@case(atol=1e-5)
def gru_lstm_layers():
    return Recurrent().eval(), (rand(2, 4, 5),)


# ---------------------------------------------------------------------------- ordering and indexing


def distinct_values(*shape) -> torch.Tensor:
    """Ties would let two runtimes pick different (equally right) indices."""
    return torch.randperm(math.prod(shape)).reshape(shape).float() / 3


class TopK(nn.Module):
    def forward(self, x):
        small, small_i = torch.topk(x, 2, dim=0, largest=False)
        top, top_i = x.topk(4, dim=-1, sorted=True)
        return small, small_i, top, top_i, x.argmin(dim=1), x.argmax(dim=0, keepdim=True)


@case()
def topk_argmin_argmax():
    return TopK(), (distinct_values(4, 6),)


class Sorting(nn.Module):
    def forward(self, x):
        s, i = torch.sort(x, dim=-1)
        sd, _ = x.sort(dim=0, descending=True)
        return s, i, sd, torch.argsort(x, dim=1, descending=True)


@case(reference_lacks="aten::sort.values")
def sort_argsort():
    return Sorting(), (distinct_values(4, 6),)


class MaskedFill(nn.Module):
    def forward(self, x, m):
        return x.masked_fill(m, 0.0), x.masked_fill(x < 0, -1.5), torch.masked_fill(x, m[0], float("-inf")).softmax(-1)


@case()
def masked_fill():
    m = torch.rand(3, 5) > 0.5
    m[:, 0] = False
    return MaskedFill(), (rand(3, 5), m)


class IndexPut(nn.Module):
    def forward(self, x, rows, cols, v):
        a = x.clone()
        a[rows] = 0.5
        b = x.index_put((rows, cols), v)
        c = x.index_put((rows,), v.unsqueeze(-1).expand(-1, x.shape[1]), accumulate=True)
        d = x.clone()
        d[x > 1] = 2.0
        return a, b, c, d


@case()
def index_put():
    return IndexPut(), (rand(4, 5), torch.tensor([0, 2, 2]), torch.tensor([1, 3, 4]), rand(3))


class ScatterGather(nn.Module):
    def forward(self, x, idx, src):
        return (torch.gather(x, 1, idx), torch.zeros(3, 5).scatter(1, idx, src), x.scatter_add(1, idx, src),
                x.scatter(1, idx, 7.0), torch.take_along_dim(x, idx, dim=1))


@case()
def scatter_gather():
    idx = torch.stack([torch.randperm(5)[:2] for _ in range(3)])  # distinct columns per row: scatter is deterministic
    return ScatterGather(), (rand(3, 5), idx, rand(3, 2))


class WhereScalars(nn.Module):
    def forward(self, x):
        return (torch.where(x > 0, 1.0, 0.0), torch.where(x > 0, x, 0.0), torch.where(x < 0, -1, x),
                torch.where(x > 0.5, 2, 3), torch.clamp_min(x, 0.1), x.clamp(max=0.2))


@case()
def where_scalars():
    return WhereScalars(), (rand(3, 4),)


class IntArith(nn.Module):
    def forward(self, a, b):
        pos = b.abs() + 1
        return (a * b - 7, a // pos, torch.remainder(a.abs(), pos), a & b, a | b, a ^ b, torch.maximum(a, b), a.clamp(-3, 3),
                torch.div(a, pos, rounding_mode="trunc"), a.sum(dim=1, dtype=torch.int64), (a * 2).to(torch.float32) / 4, -a)


@case()
def integer_arithmetic():
    return IntArith(), (torch.randint(-20, 20, (3, 4)), torch.randint(-20, 20, (3, 4)))


class BoolArith(nn.Module):
    def forward(self, m, n, x):
        return (torch.logical_and(m, n), torch.logical_or(m, n), torch.logical_xor(m, n), torch.logical_not(m), m ^ n,
                m.any(dim=1), n.all(dim=0), m.sum(dim=1), (m & ~n).to(torch.int32) * 3, x * m)


@case()
def boolean_arithmetic():
    return BoolArith(), (torch.rand(3, 4) > 0.5, torch.rand(3, 4) > 0.3, rand(3, 4))


# ---------------------------------------------------------------------------- small front ends


def dft_matrices(n_fft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Real and imaginary DFT bases (n_fft, n_fft // 2 + 1): the spectrum is one matmul."""
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    n = torch.arange(n_fft, dtype=torch.float64).unsqueeze(1)
    angle = 2 * math.pi * n * k / n_fft
    return torch.cos(angle).float(), -torch.sin(angle).float()


def mel_filterbank(n_freqs: int, n_mels: int) -> torch.Tensor:
    """Triangular filters evenly spaced on the bin axis (n_freqs, n_mels): enough for a test."""
    centers = torch.linspace(0, n_freqs - 1, n_mels + 2)
    bins = torch.arange(n_freqs, dtype=torch.float32).unsqueeze(1)
    left, mid, right = centers[:-2], centers[1:-1], centers[2:]
    up, down = (bins - left) / (mid - left), (right - bins) / (right - mid)
    return torch.clamp(torch.minimum(up, down), min=0.0)


class LogMel(nn.Module):
    """Framing (by an index table) + Hann window + DFT by matmul + power + log-mel by matmul."""

    def __init__(self, n_fft=32, hop=16, n_mels=8, samples=160):
        super().__init__()
        self.n_fft = n_fft
        starts = torch.arange(0, samples + 1, hop).unsqueeze(1)  # reflect padding adds n_fft samples
        self.register_buffer("frame_index", starts + torch.arange(n_fft))
        real, imag = dft_matrices(n_fft)
        self.register_buffer("window", torch.hann_window(n_fft))
        self.register_buffer("real", real)
        self.register_buffer("imag", imag)
        self.register_buffer("mel", mel_filterbank(n_fft // 2 + 1, n_mels))

    def forward(self, wave):
        padded = F.pad(wave.unsqueeze(1), (self.n_fft // 2, self.n_fft // 2), mode="reflect").squeeze(1)
        frames = padded[:, self.frame_index] * self.window
        power = (frames @ self.real) ** 2 + (frames @ self.imag) ** 2
        return torch.log(torch.clamp(power @ self.mel, min=1e-6)).transpose(1, 2)


@case(atol=1e-4, rtol=1e-3)
def audio_log_mel():
    return LogMel().eval(), (rand(2, 160),)


class ViTBlock(nn.Module):
    def __init__(self, dim=32, patch=4, heads=4, image=16):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.1)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.heads = heads
        self.head = nn.Linear(dim, 10)

    def forward(self, image):
        x = self.patch(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        x = x + self.mlp(self.ln2(x))
        return self.head(x[:, 0])


@case(atol=1e-4)
def vit_block():
    return ViTBlock().eval(), (rand(2, 3, 16, 16),)


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True, dropout=0.0)

    def forward(self, x):
        return self.layer(x)


@case(atol=1e-4)
def transformer_encoder_layer():
    return EncoderLayer().eval(), (rand(2, 5, 16),)


# ---------------------------------------------------------------------------- everyday functions


class Activations(nn.Module):
    def forward(self, x):
        return (F.softplus(x), F.elu(x), F.leaky_relu(x, 0.1), F.hardswish(x), F.hardsigmoid(x), F.mish(x), F.selu(x),
                F.logsigmoid(x), F.silu(x), F.relu6(x * 4), F.hardtanh(x), F.softsign(x), torch.erf(x), F.glu(x, dim=-1))


@case()
def more_activations():
    return Activations(), (rand(3, 8),)


class Losses(nn.Module):
    def forward(self, logits, target, a, b):
        return (F.cross_entropy(logits, target), F.mse_loss(a, b), F.l1_loss(a, b, reduction="sum"), F.smooth_l1_loss(a, b),
                F.cosine_similarity(a, b, dim=-1), F.one_hot(target, 5), F.log_softmax(logits, -1).gather(1, target[:, None]))


@case()
def losses_and_similarity():
    return Losses(), (rand(4, 5), torch.tensor([0, 3, 4, 1]), rand(4, 6), rand(4, 6))


class Pools(nn.Module):
    def forward(self, x):
        return (F.adaptive_avg_pool2d(x, (3, 2)), F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False),
                F.max_pool2d(x, 2, ceil_mode=True), F.lp_pool2d(x.abs(), 2, 2), F.avg_pool1d(x[0], 2))


@case()
def pooling_variants():
    return Pools(), (rand(2, 3, 7, 6),)


class ConvVariants(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)
        self.dilated = nn.Conv2d(4, 4, 3, dilation=2, padding=2, groups=2)
        self.strided = nn.Conv1d(4, 2, 3, stride=2, padding="valid")

    def forward(self, x):
        return self.up(x), self.dilated(x), self.strided(x.flatten(2))


@case(atol=1e-4)
def conv_variants():
    return ConvVariants().eval(), (rand(2, 4, 5, 6),)


class TensorBuilders(nn.Module):
    def forward(self, x):
        n = x.shape[-1]
        eye = torch.eye(n)
        ramp = torch.arange(n, dtype=torch.float32)
        grid_y, grid_x = torch.meshgrid(torch.arange(3), torch.arange(n), indexing="ij")
        return (x @ eye + ramp, torch.linspace(0, 1, 5), torch.full((2, n), 7.0) + x[:2], grid_y * 10 + grid_x,
                torch.outer(ramp, ramp), torch.diag_embed(x), torch.tril(x @ x.t()), torch.zeros_like(x).fill_(2.0))


@case()
def tensor_builders():
    return TensorBuilders(), (rand(3, 4),)


# ---------------------------------------------------------------------------- decomposed ops in dynamic and branching graphs


class DynamicNorm(nn.Module):
    def forward(self, x):
        return F.normalize(x, dim=0), torch.linalg.vector_norm(x, dim=-1), x.norm(p=1)


@case(dynamic_shapes=({0: Dim("rows", min=1, max=16)},), more_inputs=lambda: [(rand(9, 5),), (rand(1, 5),)])
def dynamic_vector_norm():
    return DynamicNorm(), (rand(4, 5),)


class NormInBranch(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x / torch.linalg.vector_norm(x, dim=1, keepdim=True),
                          lambda x: x - torch.linalg.matrix_norm(x), (x,))


@case(more_inputs=lambda: [(-torch.rand(3, 4) - 0.1,), (torch.rand(3, 4) + 0.1,)])
def vector_norm_in_cond_branch():
    return NormInBranch(), (rand(3, 4),)
