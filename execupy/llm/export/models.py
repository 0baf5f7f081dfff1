"""Decoder-only transformers in plain torch: the Llama family and GPT-2 (nanoGPT style).

One ``Transformer`` class configured by a ``ModelConfig`` covers Llama 2/3/3.1/3.2,
SmolLM2, TinyLlama, Mistral, Qwen2.5 (q/k/v bias) and GPT-2. It reads the canonical
state dict every checkpoint loader produces (execupy.llm.config).

Calling convention, the one the exporter captures::

    logits = model(tokens, input_pos)   # tokens [1, T] int64, input_pos [1] int64 (start position)

With ``use_kv_cache=True`` each attention layer keeps its keys and values in registered
buffers ``k_cache``/``v_cache`` of shape [1, max_seq_len, n_kv_heads, head_dim] updated in
place (``cache[:, positions] = k``, an index_put_), so ``torch.export`` sees mutable
buffers; one call can prefill T tokens or decode one. Attention then runs over the whole
cache with a causal mask row per query position, which keeps every shape static except T
(no data-dependent slicing) and every op in core ATen: the form any ExecuTorch runtime
loads. Inside, activations are 2-D ``[T, dim]`` (batch 1), so every linear is one
``mm`` (or ``addmm``) and the only reshapes are the four per attention layer that give the
heads their own axis and take it away again. With ``use_custom_ops=True`` the cache is instead written and read in place by
``llama::update_cache`` and ``llama::custom_sdpa`` (execupy.llm.export.custom_ops), which attend
to the filled slots only: the fast form. With ``use_kv_cache=False`` the model is the
plain full-sequence forward, the independent reference for the cached ones.

RoPE is the HF half rotation; loaders permute Meta/GGUF q/k weights to it. It is written
``x * cos + swap_halves(x) * sin`` with tables that already hold both halves (and the
sign), looked up once per call, so each rotation is two slices, a cat, two muls and an add.
"""

from __future__ import annotations

import math
import time
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from execupy.llm.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 whatever the model dtype, as the reference implementations do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(config: ModelConfig, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) angle: two [max_seq_len, head_dim/2] tables."""
    half = config.head_dim // 2
    inv_freq = 1.0 / config.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / config.head_dim)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float64)
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), inv_freq)
    return torch.from_numpy(np.cos(angles).astype(np.float32)), torch.from_numpy(np.sin(angles).astype(np.float32))


def rope_rotation_tables(config: ModelConfig, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The [max_seq_len, head_dim] tables apply_rope multiplies by: (cos, cos) and (-sin, sin)."""
    cos, sin = rope_tables(config, max_seq_len)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half rotation: the pair (x[i], x[i + d/2]) is rotated by angle i.

    x: [1, T, H, D]; cos, sin: [1, T, 1, D] rows of rope_rotation_tables (sin signed)."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos + swapped * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, max_seq_len: int, use_kv_cache: bool, use_custom_ops: bool) -> None:
        super().__init__()
        c = config
        gpt2 = c.arch == "gpt2"
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.use_rope = not gpt2
        self.use_kv_cache = use_kv_cache
        self.use_custom_ops = use_custom_ops
        qkv_bias = gpt2 or c.qkv_bias
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=gpt2)
        if use_kv_cache:
            shape = (1, max_seq_len, c.n_kv_heads, c.head_dim)
            # Not persistent: the cache is state, not a weight, and stays out of state_dict().
            self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
        sin: torch.Tensor, start_pos: int | None = None,
    ) -> torch.Tensor:
        seqlen = x.shape[0]  # x: [T, dim]
        q = self.wq(x).view(1, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(1, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(1, seqlen, self.n_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.use_custom_ops:
            torch.ops.llama.update_cache(k, self.k_cache, start_pos)
            torch.ops.llama.update_cache(v, self.v_cache, start_pos)
            out = torch.ops.llama.custom_sdpa(q, self.k_cache, self.v_cache, start_pos, None, 0.0, True)
        else:
            if self.use_kv_cache:
                self.k_cache[:, positions] = k  # in-place index_put_: a mutable buffer in the export
                self.v_cache[:, positions] = v
                k, v = self.k_cache, self.v_cache
            out = attention(q, k, v, mask)
        return self.wo(out.reshape(seqlen, self.n_heads * self.head_dim))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads, in plain ATen ops.

    q: [B, T, H, D]; k, v: [B, S, Hkv, D]; mask: [T, S] additive (0 or -inf). Returns [B, T, H, D].
    """
    bsz, _, n_heads, head_dim = q.shape
    n_kv_heads, kv_len = k.shape[2], k.shape[1]
    if n_kv_heads != n_heads:  # each KV head serves n_heads / n_kv_heads query heads
        rep = n_heads // n_kv_heads
        k = k[:, :, :, None, :].expand(bsz, kv_len, n_kv_heads, rep, head_dim).reshape(bsz, kv_len, n_heads, head_dim)
        v = v[:, :, :, None, :].expand(bsz, kv_len, n_kv_heads, rep, head_dim).reshape(bsz, kv_len, n_heads, head_dim)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, *, D]
    scores = q @ k.transpose(2, 3) * (1.0 / math.sqrt(head_dim)) + mask.to(q.dtype)
    probs = torch.softmax(scores.float(), dim=-1).type_as(q)
    return (probs @ v).transpose(1, 2)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.gpt2 = c.arch == "gpt2"
        self.w1 = nn.Linear(c.dim, c.hidden_dim, bias=self.gpt2)
        if not self.gpt2:  # made before w2: the program keeps gate and up side by side (one decode product)
            self.w3 = nn.Linear(c.dim, c.hidden_dim, bias=False)
        self.w2 = nn.Linear(c.hidden_dim, c.dim, bias=self.gpt2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gpt2:
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


def _norm(config: ModelConfig) -> nn.Module:
    if config.arch == "gpt2":
        return nn.LayerNorm(config.dim, eps=config.norm_eps)
    return RMSNorm(config.dim, config.norm_eps)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, max_seq_len: int, use_kv_cache: bool, use_custom_ops: bool) -> None:
        super().__init__()
        self.attention_norm = _norm(config)
        self.attention = Attention(config, max_seq_len, use_kv_cache, use_custom_ops)
        self.ffn_norm = _norm(config)
        self.feed_forward = FeedForward(config)

    def forward(self, x, positions, mask, cos, sin, start_pos=None):
        h = x + self.attention(self.attention_norm(x), positions, mask, cos, sin, start_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A decoder-only LM; ``forward(tokens [1, T], input_pos [1]) -> logits [1, T or 1, vocab]``."""

    def __init__(
        self,
        config: ModelConfig,
        max_seq_len: int | None = None,
        use_kv_cache: bool = True,
        last_logits_only: bool = False,
        use_custom_ops: bool = False,
    ) -> None:
        super().__init__()
        if use_custom_ops:
            if not use_kv_cache:
                raise ValueError("use_custom_ops needs use_kv_cache (the ops read and write the cache)")
            from execupy.llm.export import custom_ops  # noqa: F401  (defines torch.ops.llama.*)
        self.config = config
        # The context this instance supports (cache size); defaults to the trained
        # context capped at 2048 so that long-context models do not allocate huge caches.
        self.max_seq_len = max_seq_len or min(config.max_seq_len, 2048)
        if config.arch == "gpt2" and self.max_seq_len > config.max_seq_len:
            raise ValueError(f"GPT-2 has only {config.max_seq_len} learned positions")
        self.use_kv_cache = use_kv_cache
        self.use_custom_ops = use_custom_ops
        self.last_logits_only = last_logits_only
        # The last row's logits as `W @ column` (see _logits); a delegate that runs nn.Linear's
        # own form (XNNPACK's fully connected node) turns this off with head_as_linear().
        self.column_head = True
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        if config.arch == "gpt2":
            self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(config, self.max_seq_len, use_kv_cache, use_custom_ops) for _ in range(config.n_layers)
        )
        self.norm = _norm(config)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if not use_custom_ops:  # custom_sdpa masks by position itself
            self.register_buffer("causal_mask", torch.empty(self.max_seq_len, self.max_seq_len), persistent=False)
        if config.arch != "gpt2":
            self.register_buffer("rope_cos", torch.empty(self.max_seq_len, config.head_dim), persistent=False)
            self.register_buffer("rope_sin", torch.empty(self.max_seq_len, config.head_dim), persistent=False)
        if not self.tok_embeddings.weight.is_meta:
            self._fill_buffers()

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: dict[str, np.ndarray], **kwargs) -> "Transformer":
        """Build a model and load a canonical numpy state dict (from any loader) into it.

        The model is built on the meta device and the weights are assigned, not copied:
        randomly initialising 100M+ parameters only to overwrite them took seconds."""
        with torch.device("meta"):
            model = cls(config, **kwargs)
        model = model.to_empty(device="cpu")
        model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, assign=True)
        if config.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        model._fill_buffers()
        return model.eval()

    @torch.no_grad()
    def _fill_buffers(self) -> None:
        """The state that is not a weight: empty KV caches, the causal mask, the RoPE tables."""
        self.reset_cache()
        if hasattr(self, "causal_mask"):
            self.causal_mask.copy_(torch.full(self.causal_mask.shape, float("-inf")).triu(1))
        if hasattr(self, "rope_cos"):
            cos, sin = rope_rotation_tables(self.config, self.max_seq_len)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        if tokens.shape[0] != 1:
            raise ValueError(f"tokens must be [1, T] (batch 1), got {list(tokens.shape)}")
        seqlen = tokens.shape[1]
        steps = torch.arange(seqlen, dtype=torch.long, device=tokens.device)
        start_pos = mask = None
        if self.use_kv_cache:
            if input_pos is None:
                raise ValueError("a model with a KV cache needs input_pos (the start position)")
            positions = input_pos.reshape(1) + steps
            if self.use_custom_ops:
                start_pos = input_pos.reshape(-1)[0].item()  # an int the ops take (a SymInt in the export)
                torch._check(start_pos >= 0)
                torch._check(start_pos < self.max_seq_len)
            else:
                mask = self.causal_mask[positions]  # [T, max_seq_len]: row p lets keys <= p through
        else:
            positions = steps
            mask = self.causal_mask[:seqlen, :seqlen]
        h = self.tok_embeddings(tokens.reshape(seqlen))  # [T, dim]: rows, so each linear is one mm
        cos = sin = None
        if self.config.arch == "gpt2":
            h = h + self.pos_embeddings(positions)
        else:  # looked up once here, shared by every layer
            cos = self.rope_cos[positions].to(h.dtype).view(1, seqlen, 1, -1)
            sin = self.rope_sin[positions].to(h.dtype).view(1, seqlen, 1, -1)
        for layer in self.layers:
            h = layer(h, positions, mask, cos, sin, start_pos)
        if self.last_logits_only:
            h = h[-1:]
        return self._logits(self.norm(h))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[N, dim] -> [1, N, vocab]. One row (the export's last_logits_only) is multiplied as
        ``W @ column``, every row (generate_full_logits) as ``(W @ h^T)^T``: no transposed
        weight, which for tied embeddings would be a second copy of the embedding table. A
        swapped-in (quantized) head runs its own forward."""
        if self.column_head and type(self.output) is nn.Linear and self.output.bias is None:
            if self.last_logits_only:
                return (self.output.weight @ h.reshape(-1, 1)).reshape(1, 1, -1)
            return (self.output.weight @ h.transpose(0, 1)).transpose(0, 1).unsqueeze(0)  # every row, weight-first
        return self.output(h).unsqueeze(0)

    def reset_cache(self) -> None:
        for layer in self.layers:
            if self.use_kv_cache:
                layer.attention.k_cache.zero_()
                layer.attention.v_cache.zero_()


@torch.no_grad()
def greedy_generate(
    model: Transformer, prompt: list[int], max_new_tokens: int, eos_ids: Iterable[int] = ()
) -> tuple[list[int], dict[str, float]]:
    """Eager reference decoding: the argmax token each step. Returns (new tokens, timing stats).

    With a KV cache: one prefill call, then one call per new token. Without: the whole
    sequence is recomputed every step (slow, but shares no state between steps).
    """
    eos = set(eos_ids)
    tokens = list(prompt)
    new: list[int] = []
    t0 = time.perf_counter()
    if model.use_kv_cache:
        logits = model(torch.tensor([tokens]), torch.tensor([0]))
    else:
        logits = model(torch.tensor([tokens]))
    t_prefill = time.perf_counter() - t0
    while len(new) < max_new_tokens:
        nxt = int(logits[0, -1].argmax())
        new.append(nxt)
        tokens.append(nxt)
        if nxt in eos or len(new) == max_new_tokens:
            break
        if model.use_kv_cache:
            logits = model(torch.tensor([[nxt]]), torch.tensor([len(tokens) - 1]))
        else:
            logits = model(torch.tensor([tokens]))
    t_decode = time.perf_counter() - t0 - t_prefill
    stats = {
        "prompt_tokens": len(prompt),
        "prefill_s": t_prefill,
        "prefill_tokens_per_s": len(prompt) / t_prefill if t_prefill else float("inf"),
        "decode_tokens": len(new) - 1,
        "decode_s": t_decode,
        "decode_tokens_per_s": (len(new) - 1) / t_decode if t_decode else float("inf"),
    }
    return new, stats
