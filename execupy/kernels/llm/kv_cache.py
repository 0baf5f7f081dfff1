"""`llama::update_cache.out` and `llama::custom_sdpa.out`: the KV cache read and written in place.

Semantics (the torch side and its eager reference: execupy/llm/export/custom_ops.py):

* update_cache(value [B, T, Hkv, D], cache [B, S, Hkv, D], start_pos) writes value into
  cache[:, start_pos : start_pos + T]. The cache is a mutable buffer in planned memory,
  the one input a kernel may write; `out` is a 1-element placeholder left as it is.
* custom_sdpa(query [B, T, H, D], key_cache, value_cache, start_pos, attn_mask, drop_p,
  is_causal, scale) attends to the first start_pos + T slots only, the grouped KV heads
  read as strided views (no expand, no copy of the cache), so a decode step costs
  O(position), not O(max_seq_len).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..portable._util import as_compute, compute_dtype
from ..registry import register_kernel


def _check_window(name: str, start_pos: int, seqlen: int, cache: np.ndarray) -> None:
    if not 0 <= start_pos <= cache.shape[1] - seqlen:
        raise ValueError(f"{name}: positions {start_pos}..{start_pos + seqlen - 1} do not fit a cache of "
                         f"{cache.shape[1]} slots")


@register_kernel("llama::update_cache.out")
def update_cache(value: np.ndarray, cache: np.ndarray, start_pos: int, out: np.ndarray) -> np.ndarray:
    if value.ndim != 4 or cache.ndim != 4 or value.shape[0] != cache.shape[0] or value.shape[2:] != cache.shape[2:]:
        raise ValueError(f"update_cache: value {value.shape} does not match cache {cache.shape} "
                         f"([B, T, Hkv, D] into [B, S, Hkv, D])")
    _check_window("update_cache", start_pos, value.shape[1], cache)
    cache[:, start_pos : start_pos + value.shape[1]] = value
    return out


@register_kernel("llama::custom_sdpa.out")
def custom_sdpa(query: np.ndarray, key: np.ndarray, value: np.ndarray, start_pos: int,
                attn_mask: Optional[np.ndarray], drop_p: float, is_causal: bool, scale: Optional[float],
                out: np.ndarray) -> np.ndarray:
    if attn_mask is not None or drop_p != 0.0:
        raise ValueError("custom_sdpa: attn_mask and dropout are not supported (use is_causal)")
    bsz, seqlen, n_heads, head_dim = query.shape
    n_kv = key.shape[2]
    if key.shape != value.shape or key.shape[0] != bsz or key.shape[3] != head_dim or n_heads % n_kv:
        raise ValueError(f"custom_sdpa: query {query.shape} does not fit caches {key.shape} / {value.shape}")
    _check_window("custom_sdpa", start_pos, seqlen, key)
    kv_len, rep = start_pos + seqlen, n_heads // n_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    result = out if out.shape == query.shape else np.empty(query.shape, out.dtype)
    # fp16/bf16 caches: numpy has no fast half matmul, so the filled window is read in float32
    # (a copy of start_pos + T slots, not of the cache) and the result rounded back on writing.
    dtype = compute_dtype(query.dtype)
    for b in range(bsz):
        # Rows of one KV head's group: [Hkv, rep * T, D] (query head h = kv * rep + r).
        q = query[b].reshape(seqlen, n_kv, rep, head_dim).transpose(1, 2, 0, 3).reshape(n_kv, rep * seqlen, head_dim)
        q = as_compute(q, dtype)
        k = as_compute(key[b, :kv_len], dtype).transpose(1, 0, 2)  # [Hkv, L, D], a strided view (fp32: a view)
        v = as_compute(value[b, :kv_len], dtype).transpose(1, 0, 2)
        scores = np.matmul(q, k.transpose(0, 2, 1))  # [Hkv, rep * T, L]
        scores *= scale
        if is_causal and seqlen > 1:
            future = np.arange(kv_len)[None, :] > (start_pos + np.arange(seqlen))[:, None]  # [T, L]
            scores.reshape(n_kv, rep, seqlen, kv_len)[:, :, future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        o = np.matmul(scores, v)  # [Hkv, rep * T, D]
        result[b] = o.reshape(n_kv, rep, seqlen, head_dim).transpose(2, 0, 1, 3).reshape(seqlen, n_heads, head_dim)
    return result  # out itself, or (another length) a new array the runtime copies into place
