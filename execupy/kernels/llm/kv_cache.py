"""`llama::update_cache.out` and `llama::custom_sdpa.out`: the KV cache read and written in place.

Semantics (the torch side and its eager reference: execupy/llm/export/custom_ops.py):

* update_cache(value [B, T, Hkv, D], cache [B, S, Hkv, D], start_pos) writes value into
  cache[:, start_pos : start_pos + T]. The cache is a mutable buffer in planned memory,
  the one input a kernel may write; `out` is a 1-element placeholder left as it is.
* custom_sdpa(query [B, T, H, D], key_cache, value_cache, start_pos, attn_mask, drop_p,
  is_causal, scale) attends to the first start_pos + T slots only, the grouped KV heads
  read as strided views (no expand, no copy of the cache), so a decode step costs
  O(position), not O(max_seq_len). One query token (a decode step) of float32 runs the
  compiled kernel of kernels/fast/attention_jit.py when the process has numba loaded already
  (a quantized program's kernels load it; importing it for this alone would add ~100 MiB to
  an fp32 program's resident memory): same arithmetic but the two products' summation order.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

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


def _bind_update_cache(parts: list, out: np.ndarray) -> Optional[Callable[[], None]]:
    """update_cache as a step on a fixed value and cache, the position read at each call (a
    decode step): the shape checks done here, once; the window still checked on every call.
    `parts` are the runtime's (is_static, value or getter) of (value, cache, start_pos, out)."""
    if len(parts) != 4 or not (parts[0][0] and parts[1][0]):
        return None
    (_, value), (_, cache), (pos_static, pos) = parts[0], parts[1], parts[2]
    if not (isinstance(value, np.ndarray) and isinstance(cache, np.ndarray)) or value.ndim != 4 or cache.ndim != 4 or \
            value.shape[0] != cache.shape[0] or value.shape[2:] != cache.shape[2:]:
        return None  # the kernel itself says what is wrong
    get_pos, seqlen, last = (lambda: pos) if pos_static else pos, value.shape[1], cache.shape[1] - value.shape[1]

    def update_cache_step() -> None:
        start = get_pos()
        if not 0 <= start <= last:
            _check_window("update_cache", start, seqlen, cache)
        cache[:, start : start + seqlen] = value

    return update_cache_step


update_cache.bind = _bind_update_cache  # the runtime binds a step with fixed arguments through it


# ExecuTorch's kernel walks the keys in blocks of this many slots (for every query length it
# sees), carrying each row's running max and sum from block to block.
KV_BLOCK = 512
_LANES = 16  # its exp-and-sum step adds 16 running lane sums, then the lanes in order, then the rest
_MANY_ROWS = 64  # from this many rows on, `_lane_sum` adds chunk by chunk


def _exp(x: np.ndarray) -> np.ndarray:
    """ExecuTorch's kernel calls the C library's expf. numpy's float32 exp differs from glibc's in
    about 40% of inputs; float64 exp rounded once is correctly rounded, one unit in the last
    place from glibc's in about 0.07% (and the C library differs from phone to phone anyway).
    Calling glibc's expf itself needs numba, whose import alone would add ~100 MiB to the
    resident set of a program that uses no other compiled kernel."""
    return np.exp(x, dtype=np.float64).astype(np.float32) if x.dtype == np.float32 else np.exp(x)


# float32(exp(x)) is 0 for every x below this, -inf included; numpy's float64 exp takes a slow
# path for -inf and for results that underflow (a prompt's masked half: 154 against 70 us).
_EXP_FLOOR = -200.0


def _exp_below_max(scores: np.ndarray, row_max: np.ndarray) -> np.ndarray:
    """_exp(scores - row_max), computed in scores' own array: the same float32 values."""
    np.subtract(scores, row_max, out=scores)
    if scores.dtype != np.float32:
        return np.exp(scores, out=scores)
    np.maximum(scores, _EXP_FLOOR, out=scores)
    np.copyto(scores, np.exp(scores, dtype=np.float64), casting="unsafe")  # rounded once, as astype does
    return scores


def _lane_sum(e: np.ndarray) -> np.ndarray:
    """Row sums [..., 1] of e [..., L] in ExecuTorch's order: 16 lanes each summed over the
    16-wide chunks in turn, then the lanes one by one, then the last L % 16 one by one."""
    whole = e.shape[-1] - e.shape[-1] % _LANES
    chunks = e[..., :whole].reshape(*e.shape[:-1], -1, _LANES)
    if not whole:
        lanes = np.zeros((*e.shape[:-1], _LANES), e.dtype)
    elif e[..., 0].size < _MANY_ROWS:
        # A reduction over an axis that is not the innermost adds whole rows of lanes one after
        # the other (numpy's pairwise summation only runs along the inner loop): the lanes' own
        # order, in one call (a decode step's few rows).
        lanes = np.add.reduce(chunks, axis=-2)
    else:  # many rows (a prompt): that reduction's inner loop is only 16 long; add chunk by chunk
        lanes = chunks[..., 0, :].copy()
        for c in range(1, chunks.shape[-2]):
            lanes += chunks[..., c, :]
    return np.cumsum(np.concatenate([lanes, e[..., whole:]], axis=-1), axis=-1)[..., -1:]


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: np.ndarray,
            positions: Optional[np.ndarray]) -> np.ndarray:
    """softmax(q k^T * scale) v for q [G, R, D] against k, v [G, L, D], row r masked past
    positions[r] when causal, with ExecuTorch's softmax arithmetic: block by block, the
    scores scaled then maxed, exp(score - max) summed in lanes, the running sum and output
    rescaled by exp(old max - new max), and the output finally multiplied by 1 / sum. The
    two products are numpy's matmul (ExecuTorch's go through MKL's sgemm, whose order of
    summation is its own: docs/xnnpack-export.md). One causal block with numba loaded: the
    softmax between the two products is one compiled pass (the same arithmetic)."""
    softmax = _compiled_softmax() if positions is not None and k.shape[1] <= KV_BLOCK else None
    if softmax is not None and q.dtype == k.dtype == v.dtype == np.float32:
        scores = np.matmul(q, k.transpose(0, 2, 1))
        sums = np.empty(scores.shape[:2], np.float32)
        softmax(scores, positions, np.float32(scale), sums)
        return np.matmul(scores, v) * (1 / sums[..., None])
    row_max = row_sum = acc = None
    for n in range(0, k.shape[1], KV_BLOCK):
        scores = np.matmul(q, k[:, n : n + KV_BLOCK].transpose(0, 2, 1))
        scores *= scale
        if positions is not None and n + scores.shape[-1] - 1 > positions.min():  # a decode step masks nothing
            future = n + np.arange(scores.shape[-1])[None, :] > positions[:, None]  # [R, block]
            np.copyto(scores, -np.inf, where=future)
        # Every row sees key 0, so from the first block on its max is finite: masked scores
        # weigh exp(-inf) = 0. The first block has nothing to rescale (its rescale factor
        # would be exp(-inf - max) = 0, times a sum and an output of zeros).
        block_max = scores.max(axis=-1, keepdims=True)
        new_max = block_max if row_max is None else np.maximum(row_max, block_max)
        weights = _exp_below_max(scores, new_max)
        if row_max is None:
            row_max = new_max
            row_sum, acc = _lane_sum(weights), np.matmul(weights, v[:, n : n + KV_BLOCK])
            continue
        rescale = _exp(row_max - new_max)
        row_sum = _lane_sum(weights) + rescale * row_sum
        acc *= rescale
        acc += np.matmul(weights, v[:, n : n + KV_BLOCK])
        row_max = new_max
    return acc * (1 / row_sum)


def _compiled_softmax() -> Optional[Callable]:
    """attention_jit's causal softmax of a block of scores where numba is loaded already and allowed."""
    from ..fast.elementwise import numba_loaded

    if not numba_loaded():
        return None
    from ..fast.attention_jit import causal_softmax_rows

    return causal_softmax_rows


_COMPILED: list[Callable] = []  # the compiled decode attention, once loaded


def _compiled_decode() -> Optional[Callable]:
    """The compiled decode attention (kernels/fast/attention_jit) where numba is loaded already and
    allowed, on this thread alone: the same compiled copy a bound step runs, so both give the same bits."""
    if _COMPILED:
        return _COMPILED[0]
    from ..fast.elementwise import numba_loaded

    if not numba_loaded():
        return None
    from ..fast.second_thread import SECOND_THREAD

    _COMPILED.append(functools.partial(SECOND_THREAD.decode_attention, site=None))
    return _COMPILED[0]


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
    compiled = _compiled_decode() if seqlen == 1 else None  # (an fp32 program: one dict lookup, no numba)
    if (compiled is not None and query.dtype == key.dtype == value.dtype == result.dtype == np.float32
            and key.flags.c_contiguous and value.flags.c_contiguous and result.flags.c_contiguous):
        for b in range(bsz):  # the layout compiled at load; the query [H, D] made contiguous
            compiled(np.ascontiguousarray(query[b, 0]), key[b], value[b], kv_len, np.float32(scale), KV_BLOCK,
                     result[b, 0])
        return result
    # fp16/bf16 caches: numpy has no fast half matmul, so the filled window is read in float32
    # (a copy of start_pos + T slots, not of the cache) and the result rounded back on writing.
    dtype = compute_dtype(query.dtype)
    # Query row r of a KV head's group is position start_pos + r % T (head h = kv * rep + r // T).
    positions = start_pos + np.arange(rep * seqlen) % seqlen if is_causal else None
    for b in range(bsz):
        # Rows of one KV head's group: [Hkv, rep * T, D] (query head h = kv * rep + r).
        q = query[b].reshape(seqlen, n_kv, rep, head_dim).transpose(1, 2, 0, 3).reshape(n_kv, rep * seqlen, head_dim)
        k = as_compute(key[b, :kv_len], dtype).transpose(1, 0, 2)  # [Hkv, L, D], a strided view (fp32: a view)
        v = as_compute(value[b, :kv_len], dtype).transpose(1, 0, 2)
        o = _attend(as_compute(q, dtype), k, v, np.asarray(scale, dtype), positions)  # [Hkv, rep * T, D]
        result[b] = o.reshape(n_kv, rep, seqlen, head_dim).transpose(2, 0, 1, 3).reshape(seqlen, n_heads, head_dim)
    return result  # out itself, or (another length) a new array the runtime copies into place


def _bind_custom_sdpa(parts: list, out: np.ndarray) -> Optional[Callable[[], None]]:
    """custom_sdpa as a decode step (batch 1, one query token, float32 arrays fixed at bind, the
    position read at each call) through the compiled attention, its heads shared with the second
    core (kernels/fast/second_thread.py); None for anything else, or without numba loaded.
    `parts` are the runtime's (is_static, value or getter) of the kernel's arguments, `out` last."""
    if len(parts) != 9 or _compiled_decode() is None or not all(static for static, _ in parts[:3] + parts[4:]):
        return None
    (_, query), (_, key), (_, value), (pos_static, pos) = parts[:4]
    attn_mask, drop_p, scale = parts[4][1], parts[5][1], parts[7][1]
    arrays = (query, key, value, out)
    if attn_mask is not None or drop_p != 0.0 or not all(
            isinstance(t, np.ndarray) and t.dtype == np.float32 and t.flags.c_contiguous for t in arrays):
        return None
    if query.ndim != 4 or query.shape[:2] != (1, 1) or out.shape != query.shape or key.shape != value.shape or \
            key.ndim != 4 or key.shape[0] != 1 or key.shape[3] != query.shape[3] or query.shape[2] % key.shape[2] or \
            any(np.may_share_memory(out, t) for t in arrays[:3]):
        return None  # the kernel itself says what is wrong, or takes the general path
    from ..cores import CallSite
    from ..fast.second_thread import SECOND_THREAD

    q, keys, values, result = query[0, 0], key[0], value[0], out[0, 0]
    get_pos, last, site = (lambda: pos) if pos_static else pos, key.shape[1] - 1, CallSite()
    scale = np.float32(1.0 / math.sqrt(query.shape[3]) if scale is None else scale)
    attend = SECOND_THREAD.decode_attention

    def custom_sdpa_step() -> None:
        start = get_pos()
        if not 0 <= start <= last:
            _check_window("custom_sdpa", start, 1, key)
        attend(q, keys, values, start + 1, scale, KV_BLOCK, result, site)

    return custom_sdpa_step


custom_sdpa.bind = _bind_custom_sdpa  # the runtime binds a decode step through it
