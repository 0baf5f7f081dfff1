"""A zoo of small models for the exporter tests: each case builds a model and its inputs.

A `Case` says how to export (example inputs, dynamic shapes) and how to check: the
inputs to call the program with (several shapes for dynamic cases), how many calls
in a row (stateful models), and the tolerance. The models are built here, from
torch.nn pieces, so the tests need no downloads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim


@dataclass
class Case:
    name: str
    build: Callable[[], tuple[nn.Module, tuple]]  # -> (model, example inputs)
    dynamic_shapes: Any = None
    more_inputs: Callable[[], list[tuple]] = lambda: []  # other inputs to call with (dynamic shapes)
    calls: int = 1  # calls in a row with the same inputs (state carries over)
    steps: Callable[[], list[tuple]] = lambda: []  # stateful: inputs of calls made after the first, in order
    atol: float = 1e-5
    rtol: float = 1e-4
    # An operator ExecuTorch's portable runtime (1.5.1) lacks: its runtime must refuse the
    # program naming it, while execupy's runs it.
    reference_lacks: Optional[str] = None


CASES: list[Case] = []


def case(**kw):
    def wrap(build):
        CASES.append(Case(name=build.__name__, build=build, **kw))
        return build
    return wrap


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# ---------------------------------------------------------------------------- basics


@case()
def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), (rand(2, 4),)


@case()
def mlp_activations():
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4), nn.Sigmoid(),
                          nn.Linear(4, 4), nn.SiLU(), nn.Linear(4, 2), nn.GELU(approximate="tanh"))
    return model, (rand(3, 6),)


class Scalars(nn.Module):
    def forward(self, x):
        return (x * 2 + 1.5) / 3 - 0.25, 1 - x, x ** 2, torch.rsqrt(x.abs() + 1), (x > 0.1), x.clamp(-0.5, 0.5)


@case()
def scalar_arithmetic():
    return Scalars(), (rand(2, 5),)


class Unary(nn.Module):
    def forward(self, x):
        a = x.abs() + 0.1
        return torch.exp(x), torch.log(a), torch.sqrt(a), -x, torch.sin(x) + torch.cos(x), torch.floor(x * 3)


@case()
def unary_math():
    return Unary(), (rand(3, 4),)


class Reductions(nn.Module):
    def forward(self, x):
        return (x.sum(dim=1), x.mean(dim=-1, keepdim=True), x.amax(dim=0), x.argmax(dim=1),
                torch.softmax(x, dim=-1), torch.log_softmax(x, dim=0), x.var(dim=1))


@case()
def reductions_softmax():
    return Reductions(), (rand(4, 6),)


class Shapes(nn.Module):
    def forward(self, x, y):
        a = torch.cat([x, y], dim=1)
        b = a.reshape(2, 3, 4).permute(2, 0, 1).contiguous()
        c = b.transpose(0, 1).flatten(1)
        d, e = torch.split(c, [5, 7], dim=1)
        s = torch.stack([x, y * 2], dim=0)
        return c, d * 2, e.unsqueeze(0), s.squeeze(), x.t()


@case()
def shape_ops():
    return Shapes(), (rand(2, 6), rand(2, 6))


class Indexing(nn.Module):
    def forward(self, x, idx):
        return x[:, 1:5:2], x[1], x[..., -1], torch.gather(x, 1, idx), torch.index_select(x, 0, idx[:, 0])


@case()
def indexing():
    return Indexing(), (rand(3, 6), torch.tensor([[0, 2], [1, 5], [2, 3]]))


class Broadcast(nn.Module):
    def forward(self, x, b):
        return x + b, b.expand(3, 4) * 2, x.repeat(2, 1), torch.where(x > 0, x, b)


@case()
def broadcast_where():
    return Broadcast(), (rand(3, 4), rand(4))


class MatMul(nn.Module):
    def forward(self, a, b, c):
        return torch.matmul(a, b), torch.bmm(a, b), a @ c


@case()
def batched_matmul():
    return MatMul(), (rand(2, 3, 4), rand(2, 4, 5), rand(4, 2))


class TopK(nn.Module):
    def forward(self, x):
        v, i = torch.topk(x, 3, dim=-1)
        m, mi = torch.max(x, dim=0)
        return v, i, m, mi


@case()
def topk_max():
    return TopK(), (rand(4, 7),)


class Masks(nn.Module):
    def forward(self, x):
        n = x.shape[-1]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        return x.masked_fill(~causal, float("-inf")).softmax(-1), torch.cumsum(x, dim=1), torch.triu(x, 1)


@case()
def masks_cumsum():
    return Masks(), (rand(5, 5),)


class Pad(nn.Module):
    def forward(self, x):
        return F.pad(x, (1, 2, 0, 1), value=0.5), F.pad(x, (2, 2))


@case()
def padding():
    return Pad(), (rand(2, 3, 4),)


# ---------------------------------------------------------------------------- dtypes


class IntOps(nn.Module):
    def forward(self, a, b):
        # abs(): ExecuTorch 1.5.1 computes integer remainder C-style (sign of the dividend), torch floors.
        return a + b * 3, a // 2, a.abs() % 3, (a > b), a.to(torch.float32) / 2, (a * b).sum(dim=0)


@case()
def int_tensors():
    return IntOps(), (torch.randint(-10, 10, (3, 4), dtype=torch.int32), torch.randint(-10, 10, (3, 4), dtype=torch.int32))


class BoolOps(nn.Module):
    def forward(self, m, n, x):
        both, either = m & n, m | n
        return both, either, ~m, torch.where(either, x, -x), both.to(torch.float32) + x


@case()
def bool_tensors():
    return BoolOps(), (torch.rand(3, 4) > 0.5, torch.rand(3, 4) > 0.5, rand(3, 4))


class Casts(nn.Module):
    def forward(self, x):
        i = (x * 10).to(torch.int64)
        return i, i.to(torch.float64) * 0.5, x.to(torch.float16), (x > 0).to(torch.int32)


@case()
def dtype_casts():
    return Casts(), (rand(3, 4),)


@case(atol=2e-3, rtol=2e-3)
def float16_mlp():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.float16)
    return model, (rand(2, 8, dtype=torch.float16),)


# ---------------------------------------------------------------------------- vision


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def _randomize_bn(model):
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model.eval()


@case(atol=1e-4)
def cnn_bn_pool():
    return _randomize_bn(SmallCNN()), (rand(2, 3, 12, 12),)


class Separable(nn.Module):
    def __init__(self):
        super().__init__()
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False)
        self.pointwise = nn.Conv2d(6, 10, 1)
        self.pool = nn.AvgPool2d(2)

    def forward(self, x):
        return self.pool(F.relu6(self.pointwise(self.depthwise(x))))


@case(atol=1e-4)
def depthwise_separable():
    return Separable().eval(), (rand(1, 6, 8, 8),)


class ChannelsLastChain(nn.Module):
    """Convolutions with the ops between them: batch norm after a conv and after an add, relu6,
    a residual add, a per-channel constant, sigmoid, leaky relu; a middle value returned too."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn2 = nn.BatchNorm2d(8)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, 8).reshape(8, 1, 1))
        self.pointwise = nn.Conv2d(8, 6, 1)

    def forward(self, x):
        a = F.relu6(self.bn(self.conv(x)))
        b = a + self.depthwise(a)
        c = torch.sigmoid(self.bn2(b) * self.gain)
        return F.leaky_relu(self.pointwise(c), 0.1), b


@case(atol=1e-4)
def channels_last_chain():
    return _randomize_bn(ChannelsLastChain()), (rand(2, 4, 9, 7),)


class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=2, dilation=2)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return F.adaptive_avg_pool1d(torch.tanh(self.bn(self.conv(x))), 1).squeeze(-1)


@case(atol=1e-4)
def conv1d_bn():
    return _randomize_bn(Conv1dNet()), (rand(2, 4, 10),)


# ---------------------------------------------------------------------------- language


class EmbedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, tokens):
        return self.norm(self.emb(tokens))


@case()
def embedding_layernorm():
    return EmbedNorm().eval(), (torch.randint(0, 20, (2, 5)),)


class CausalAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


@case(atol=1e-5)
def causal_attention():
    return CausalAttention().eval(), (rand(2, 5, 16),)


class SDPA(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@case()
def sdpa_causal():
    return SDPA(), (rand(1, 2, 6, 8), rand(1, 2, 6, 8), rand(1, 2, 6, 8))


class GPT2Block(nn.Module):
    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalAttention(dim, heads)
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


@case(atol=1e-4)
def gpt2_block():
    return GPT2Block().eval(), (rand(1, 6, 16),)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim, max_len, theta=10000.0):
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_len).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):  # x: (b, h, t, d); rotate pairs (real, imag) halves
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, max_len=16):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.attn_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        cos, sin = rope_tables(self.head_dim, max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:t], self.sin[:t]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


@case(atol=1e-4)
def llama_block():
    return LlamaBlock().eval(), (rand(1, 7, 32),)


# ---------------------------------------------------------------------------- dynamic shapes


@case(dynamic_shapes=({0: Dim("batch", min=1, max=8)},), more_inputs=lambda: [(rand(5, 4),), (rand(1, 4),)])
def dynamic_batch():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), (rand(3, 4),)


class SeqModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(30, 8), nn.LayerNorm(8)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))
        return h.mean(dim=1), h.reshape(-1), tokens.shape[1] * 2


@case(dynamic_shapes=({1: Dim("seq", min=2, max=12)},),
      more_inputs=lambda: [(torch.randint(0, 30, (2, 9)),), (torch.randint(0, 30, (2, 2)),)])
def dynamic_sequence():
    return SeqModel().eval(), (torch.randint(0, 30, (2, 4)),)


@case(dynamic_shapes=({1: Dim("seq", min=2, max=16)},), more_inputs=lambda: [(rand(1, 11, 16),)], atol=1e-4)
def dynamic_gpt2_block():
    return GPT2Block().eval(), (rand(1, 5, 16),)


# ---------------------------------------------------------------------------- control flow and state


class CondModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: self.lin(x).relu(), lambda x: torch.cos(x) * 2 + 1, (x,))


@case(more_inputs=lambda: [(-torch.rand(2, 4) - 0.1,), (torch.rand(2, 4) + 0.1,)])
def cond_branches():
    return CondModel().eval(), (rand(2, 4),)


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count.add_(1)
        return x * self.count


@case(calls=3)
def mutable_counter():
    return Counter(), (rand(2, 3),)


class KVCache(nn.Module):
    def __init__(self, max_len=8, dim=4):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, max_len, dim))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, pos):
        # x: (1, 1, dim); pos: (1,) int64 position to write
        self.k_cache.index_put_((torch.tensor([0]), pos), self.proj(x)[0])
        return self.k_cache.sum(dim=1) + 0


@case(calls=3)
def kv_cache_buffer():
    return KVCache().eval(), (rand(1, 1, 4), torch.tensor([2]))


class SliceCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 6))

    def forward(self, x):
        self.cache[:, 1:3] = x
        self.cache.mul_(0.5)
        return self.cache.clone()


@case(calls=2)
def slice_assign_buffer():
    return SliceCache(), (rand(2, 2),)


# ---------------------------------------------------------------------------- outputs


class Nested(nn.Module):
    def forward(self, x, y):
        return {"sum": x + y, "pair": (x * y, [x - y, y])}, x


@case()
def nested_outputs():
    return Nested(), (rand(2, 2), rand(2, 2))


class Passthrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        y = x + 1
        return x, y, x, self.w


@case()
def passthrough_outputs():
    return Passthrough(), (rand(3),)


class ScalarInput(nn.Module):
    def forward(self, x, n: int):
        return x * n + 1


@case()
def scalar_input():
    return ScalarInput(), (rand(2, 3), 3)


class SharedWeights(nn.Module):
    """Two identical constants: their bytes are stored once."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(4, 4))
        self.b = nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return x @ self.a + x @ self.b


@case()
def shared_constants():
    return SharedWeights(), (rand(2, 4),)


class CachedAttention(nn.Module):
    """Llama-style attention over a KV cache held in mutable buffers (prefill, then decode)."""

    def __init__(self, dim=16, heads=2, max_len=8):
        super().__init__()
        self.heads, self.head_dim, self.max_len = heads, dim // heads, max_len
        self.wqkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, heads, max_len, dim // heads))
        self.register_buffer("v_cache", torch.zeros(1, heads, max_len, dim // heads))

    def forward(self, x, input_pos):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in self.wqkv(x).split(c, dim=-1))
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        mask = torch.arange(self.max_len).unsqueeze(0) <= input_pos.unsqueeze(1)
        att = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.wo(att.transpose(1, 2).reshape(b, t, c))


@case(dynamic_shapes=({1: Dim("seq", min=1, max=8)}, {0: Dim("seq", min=1, max=8)}),
      steps=lambda: [(rand(1, 1, 16), torch.tensor([3])), (rand(1, 2, 16), torch.tensor([4, 5]))], atol=1e-5)
def kv_cache_attention():
    return CachedAttention().eval(), (rand(1, 3, 16), torch.tensor([0, 1, 2]))


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.group = nn.GroupNorm(2, 4)
        self.plain = nn.LayerNorm(5, elementwise_affine=False)

    def forward(self, x):
        return self.group(x), self.plain(x)


@case(atol=1e-5)
def group_and_plain_norm():
    return Norms().eval(), (rand(2, 4, 5),)


@case(atol=3e-2, rtol=3e-2)
def bfloat16_linear():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(torch.bfloat16), (rand(2, 8, dtype=torch.bfloat16),)


class CondTwoOutputs(nn.Module):
    def forward(self, x, y):
        def big(x, y):
            return x + y, x * 0 + y.sum()

        def small(x, y):
            return x - y, x.abs()

        a, b = torch.cond(x.mean() > y.mean(), big, small, (x, y))
        return a * 2, b, x  # x read after the cond: its bytes must survive both branches


@case(more_inputs=lambda: [(rand(3, 3) - 5, rand(3, 3)), (rand(3, 3) + 5, rand(3, 3))])
def cond_two_outputs():
    return CondTwoOutputs(), (rand(3, 3), rand(3, 3))


def by_name(name: str) -> Case:
    return next(c for c in CASES if c.name == name)
