"""The two LLM custom ops on the torch side (export time): ``llama::update_cache`` and
``llama::custom_sdpa``.

Without them, a KV-cache step is ``index_put`` (which writes a whole new cache) followed by
a ``copy_`` of that back into the state, and attention runs over every cache slot with
the KV heads expanded to all query heads: per layer per token, the caches are copied
four times and attended in full. With them the cache is passed *in*:

    update_cache(value [B, T, Hkv, D], cache [B, S, Hkv, D] (mutated), start_pos)
        writes value into cache[:, start_pos : start_pos + T], nothing else.
    custom_sdpa(query [B, T, H, D], key_cache, value_cache, start_pos, attn_mask=None,
                drop_p=0.0, is_causal=False, scale=None) -> [B, T, H, D]
        attends to the first start_pos + T cache slots only; with is_causal, query t
        (at position start_pos + t) sees the slots up to its own position. Grouped KV
        heads are read in place (query head h uses KV head h // (H / Hkv)).

Names and schemas are those of ExecuTorch's llama custom ops, so a program using them
means the same thing in either runtime. The runtime kernels are in
``execupy/kernels/llm`` (numpy, torch-free); the emitter turns the functionalized
mutation back into the in-place call, so the cache buffer is written where it lives.

Importing this module defines the ops (once per process; if another library already
defined ``llama::update_cache`` / ``llama::custom_sdpa``, those are used as they are).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

_SCHEMAS = {
    "update_cache": (
        "update_cache(Tensor value, Tensor(a!) cache, SymInt start_pos) -> Tensor",
        "update_cache.out(Tensor value, Tensor(a!) cache, SymInt start_pos, *, Tensor(b!) out) -> Tensor(b!)",
    ),
    "custom_sdpa": (
        "custom_sdpa(Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask=None, "
        "float drop_p=0.0, bool is_causal=False, float? scale=None) -> Tensor",
        "custom_sdpa.out(Tensor query, Tensor key, Tensor value, SymInt start_pos, Tensor? attn_mask=None, "
        "float drop_p=0.0, bool is_causal=False, float? scale=None, *, Tensor(a!) out) -> Tensor(a!)",
    ),
}


def update_cache(value: torch.Tensor, cache: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Eager reference of llama::update_cache (returns a 1-element placeholder, as ExecuTorch's does)."""
    cache[:, start_pos : start_pos + value.shape[1]] = value
    return value.new_zeros(1)


def custom_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start_pos: int,
    attn_mask: Optional[torch.Tensor] = None, drop_p: float = 0.0, is_causal: bool = False,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Eager reference of llama::custom_sdpa, in plain torch."""
    if attn_mask is not None or drop_p != 0.0:
        raise ValueError("llama::custom_sdpa: attn_mask and dropout are not supported (use is_causal)")
    bsz, seqlen, n_heads, head_dim = query.shape
    n_kv, kv_len = key.shape[2], start_pos + seqlen
    rep = n_heads // n_kv
    q = query.reshape(bsz, seqlen, n_kv, rep, head_dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, rep, T, D]
    k = key[:, :kv_len].permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, L, D]
    v = value[:, :kv_len].permute(0, 2, 1, 3)[:, :, None]
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(head_dim))
    if is_causal:
        rows = torch.arange(seqlen)[:, None] + start_pos
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > rows, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).type_as(query)
    out = probs @ v  # [B, Hkv, rep, T, D]
    return out.permute(0, 3, 1, 2, 4).reshape(bsz, seqlen, n_heads, head_dim)


def _update_cache_fake(value, cache, start_pos):
    return value.new_empty(1)


def _custom_sdpa_fake(query, key, value, start_pos, attn_mask=None, drop_p=0.0, is_causal=False, scale=None):
    return torch.empty_like(query)


def _already_defined(name: str) -> bool:
    try:
        getattr(torch.ops.llama, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _define() -> Optional[torch.library.Library]:
    if all(_already_defined(name) for name in _SCHEMAS):
        return None
    lib = torch.library.Library("llama", "FRAGMENT")
    impls = {"update_cache": (update_cache, _update_cache_fake), "custom_sdpa": (custom_sdpa, _custom_sdpa_fake)}
    for name, (functional, out_variant) in _SCHEMAS.items():
        lib.define(functional)
        lib.define(out_variant)
        eager, fake = impls[name]
        lib.impl(name, eager, "CompositeExplicitAutograd")
        lib.impl(name, fake, "Meta")
    return lib


_LIB = _define()  # kept alive: the registrations last as long as this object
