"""The llama:: KV-cache kernels against their torch eager definitions (execupy.llm.export.custom_ops),
and against plain masked attention over the whole cache (the core-ATen form they replace)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from execupy.kernels.llm.kv_cache import custom_sdpa, update_cache
from execupy.llm.export import custom_ops
from execupy.llm.export.models import attention

rng = np.random.default_rng(0)


def _caches(seq: int, n_kv: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((1, seq, n_kv, dim)).astype(np.float32),
            rng.standard_normal((1, seq, n_kv, dim)).astype(np.float32))


def test_update_cache_writes_only_the_window():
    cache = np.zeros((1, 10, 2, 4), np.float32)
    value = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    placeholder = np.zeros(1, np.float32)
    assert update_cache(value, cache, 4, placeholder) is placeholder
    np.testing.assert_array_equal(cache[:, 4:7], value)
    assert not cache[:, :4].any() and not cache[:, 7:].any()

    torch_cache = torch.zeros(1, 10, 2, 4)
    custom_ops.update_cache(torch.from_numpy(value), torch_cache, 4)
    np.testing.assert_array_equal(torch_cache.numpy(), cache)


@pytest.mark.parametrize("start_pos", [-1, 8, 100])
def test_update_cache_refuses_positions_outside_the_cache(start_pos):
    cache = np.zeros((1, 10, 2, 4), np.float32)
    with pytest.raises(ValueError, match="do not fit a cache of 10 slots"):
        update_cache(np.ones((1, 3, 2, 4), np.float32), cache, start_pos, np.zeros(1, np.float32))
    assert not cache.any()


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (6, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("start_pos,seqlen", [(0, 1), (0, 5), (7, 1), (7, 4), (12, 4)])
def test_custom_sdpa_matches_torch_and_masked_attention(n_heads, n_kv, start_pos, seqlen):
    dim, max_seq = 8, 16
    k_cache, v_cache = _caches(max_seq, n_kv, dim)
    query = rng.standard_normal((1, seqlen, n_heads, dim)).astype(np.float32)
    out = np.empty_like(query)
    got = custom_sdpa(query, k_cache, v_cache, start_pos, None, 0.0, True, None, out)
    assert got is out

    t = [torch.from_numpy(a) for a in (query, k_cache, v_cache)]
    expected = custom_ops.custom_sdpa(*t, start_pos, None, 0.0, True)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)
    # The whole-cache form: an additive causal mask row per absolute position.
    mask = torch.full((max_seq, max_seq), float("-inf")).triu(1)[start_pos : start_pos + seqlen]
    np.testing.assert_allclose(got, attention(*t, mask).numpy(), rtol=1e-5, atol=1e-5)


def test_custom_sdpa_ignores_slots_beyond_the_window():
    k_cache, v_cache = _caches(12, 2, 8)
    query = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    first = custom_sdpa(query, k_cache, v_cache, 3, None, 0.0, True, None, np.empty_like(query)).copy()
    k_cache[:, 5:] = 1e6  # garbage after the filled slots (an earlier, longer conversation)
    v_cache[:, 5:] = np.nan
    again = custom_sdpa(query, k_cache, v_cache, 3, None, 0.0, True, None, np.empty_like(query))
    np.testing.assert_array_equal(first, again)


def test_custom_sdpa_non_causal_and_scale():
    k_cache, v_cache = _caches(8, 2, 4)
    query = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    got = custom_sdpa(query, k_cache, v_cache, 2, None, 0.0, False, 0.5, np.empty_like(query))
    t = [torch.from_numpy(a) for a in (query, k_cache, v_cache)]
    expected = custom_ops.custom_sdpa(*t, 2, None, 0.0, False, 0.5)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_custom_sdpa_refuses_bad_windows_and_masks():
    k_cache, v_cache = _caches(8, 2, 4)
    query = np.zeros((1, 3, 2, 4), np.float32)
    out = np.empty_like(query)
    with pytest.raises(ValueError, match="do not fit a cache of 8 slots"):
        custom_sdpa(query, k_cache, v_cache, 6, None, 0.0, True, None, out)
    with pytest.raises(ValueError, match="attn_mask"):
        custom_sdpa(query, k_cache, v_cache, 0, np.zeros((3, 3), np.float32), 0.0, True, None, out)
    with pytest.raises(ValueError, match="does not fit caches"):
        custom_sdpa(np.zeros((1, 3, 3, 4), np.float32), k_cache, v_cache, 0, None, 0.0, True, None,
                    np.empty((1, 3, 3, 4), np.float32))


@pytest.mark.parametrize("start_pos,seqlen", [(600, 1), (500, 20), (0, 530)], ids=["decode", "prefill-across", "prefill-long"])
def test_custom_sdpa_over_more_than_one_key_block(start_pos, seqlen):
    """Windows past 512 slots are walked block by block (a running max and sum per row, as
    ExecuTorch's kernel does); the result is still the attention over the whole window."""
    k_cache, v_cache = _caches(640, 2, 16)
    query = rng.standard_normal((1, seqlen, 4, 16)).astype(np.float32)
    got = custom_sdpa(query, k_cache, v_cache, start_pos, None, 0.0, True, None, np.empty_like(query))
    t = [torch.from_numpy(a) for a in (query, k_cache, v_cache)]
    expected = custom_ops.custom_sdpa(*t, start_pos, None, 0.0, True)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)


def test_sdpa_exp_is_within_one_ulp_of_the_c_librarys_expf():
    """custom_sdpa's exp: float64 exp rounded once, at most one unit in the last place from the
    C library's expf (what ExecuTorch's kernel calls), and rarely even that."""
    import ctypes
    import ctypes.util

    from execupy.kernels.llm.kv_cache import _exp

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    x = np.concatenate([-rng.uniform(0, 90, 20_000), [0.0, -0.0, -np.inf, -87.33655, -103.97, 1e-8]]).astype(np.float32)
    c_library = np.array([libm.expf(float(v)) for v in x], np.float32)
    ours = _exp(x)
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - c_library.view(np.int32))
    assert ulps.max() <= 1 and np.count_nonzero(ulps) < x.size // 100


@pytest.mark.parametrize("length", [5, 16, 37, 160, 700])
def test_softmax_sums_add_in_executorchs_lane_order(length):
    """16 running lane sums over the 16-wide chunks in turn, then the lanes one by one, then the
    last length % 16 values one by one: written out as plain float32 additions."""
    from execupy.kernels.llm.kv_cache import _lane_sum

    e = rng.random((2, 3, length)).astype(np.float32) * np.float32(1000)
    want = np.empty((2, 3, 1), np.float32)
    for g in range(2):
        for r in range(3):
            row, whole = e[g, r], length - length % 16
            lanes = [np.float32(0)] * 16
            for c in range(0, whole, 16):
                lanes = [lanes[i] + row[c + i] if c else row[c + i] for i in range(16)]
            total = np.float32(0)
            for value in (lanes if whole else []) + list(row[whole:]):
                total = np.float32(total + value)
            want[g, r, 0] = total
    np.testing.assert_array_equal(_lane_sum(e), want)
