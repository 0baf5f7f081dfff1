"""Checkpoint loaders: the same random weights written as GGUF, HF and Meta load to the same
state dict, and our model's logits match an independent reference forward.

The reference for Meta/GGUF weights rotates interleaved pairs with complex numbers, as
Meta's code does; our model uses HF's half rotation on permuted q/k rows. Equal logits
therefore prove the rotary permutation in the loaders.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
from execupy.llm.config import CheckpointError, llama3_rope_freq_factors
from execupy.llm.gguf_loader import load_gguf
from execupy.llm.hf_loader import load_hf, read_safetensors
from execupy.llm.loaders import load_checkpoint
from execupy.llm.export.meta_loader import load_meta
from execupy.llm.export.models import Transformer
from tests.llm import tiny

TOKENS = [3, 17, 42, 5, 96, 0, 11, 64, 23]


def our_logits(config, state, tokens=TOKENS) -> np.ndarray:
    model = Transformer.from_state_dict(config, state, use_kv_cache=False)
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0].double().numpy()


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="module")
def llama_three_ways(tmp_path_factory):
    """One Llama (GQA, untied head) written in all three formats; the truth is Meta's layout."""
    root = tmp_path_factory.mktemp("llama")
    w = tiny.random_llama_weights(seed=0)
    loaded = {
        "meta": load_meta(tiny.write_meta(root / "meta", w)),
        "meta2": load_meta(tiny.write_meta(root / "meta2", w, shards=2)),
        "hf": load_hf(tiny.write_hf_llama(root / "hf", w)),
        "gguf": load_gguf(tiny.write_gguf(root / "m.gguf", "llama", w)),
    }
    return w, loaded


def test_all_formats_give_the_same_config_and_weights(llama_three_ways):
    _, loaded = llama_three_ways
    config, state = loaded["hf"]
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads) == (64, 2, 4, 2)
    assert (config.vocab_size, config.hidden_dim, config.head_dim) == (98, 96, 16)
    assert not config.tie_embeddings and not config.qkv_bias
    for name in ("meta", "meta2", "gguf"):
        other_config, other_state = loaded[name]
        assert other_config.replace(name="", max_seq_len=64) == config.replace(name="", max_seq_len=64), name
        assert_same_state(other_state, state)


def test_logits_match_meta_reference_with_interleaved_rope(llama_three_ways):
    w, loaded = llama_three_ways
    expected = tiny.reference_llama_logits(w, TOKENS, rope="interleaved")
    for name, (config, state) in loaded.items():
        np.testing.assert_allclose(our_logits(config, state), expected, rtol=1e-4, atol=1e-4, err_msg=name)


def test_unpermuted_weights_would_not_match(llama_three_ways):
    # Guard against a vacuous pass: running Meta-layout rows with half rotation changes the logits.
    w, loaded = llama_three_ways
    config, _ = loaded["meta"]
    wrong = dict(w)
    if "output.weight" not in wrong:
        wrong["output.weight"] = wrong["tok_embeddings.weight"]
    expected = tiny.reference_llama_logits(w, TOKENS, rope="interleaved")
    assert np.abs(our_logits(config, wrong) - expected).max() > 1e-2


def test_qwen_style_qkv_bias_and_tied_head(tmp_path):
    # Qwen2: HF layout everywhere (llama.cpp does not permute qwen2), biases on q/k/v only.
    w = tiny.random_llama_weights(seed=1, qkv_bias=True, tied=True)
    hf = load_hf(tiny.write_hf_llama(tmp_path / "hf", w, model_type="qwen2", permute=False, tied=True))
    gg = load_gguf(tiny.write_gguf(tmp_path / "q.gguf", "qwen2", w))
    for config, state in (hf, gg):
        assert config.qkv_bias and config.tie_embeddings
        assert state["output.weight"] is state["tok_embeddings.weight"]
    assert_same_state(hf[1], gg[1])
    expected = tiny.reference_llama_logits(w, TOKENS, rope="half")
    np.testing.assert_allclose(our_logits(*gg), expected, rtol=1e-4, atol=1e-4)


def test_gpt2_from_hf_and_gguf(tmp_path):
    w = tiny.random_gpt2_weights(seed=2)
    hf = load_hf(tiny.write_hf_gpt2(tmp_path / "hf", w))
    gg = load_gguf(tiny.write_gguf(tmp_path / "g.gguf", "gpt2", w))
    assert hf[0].arch == gg[0].arch == "gpt2" and hf[0].tie_embeddings and gg[0].tie_embeddings
    assert_same_state(hf[1], gg[1])
    tokens = [1, 88, 7, 7, 30, 2]
    expected = tiny.reference_gpt2_logits(w, tokens)
    np.testing.assert_allclose(our_logits(*hf, tokens=tokens), expected, rtol=1e-4, atol=1e-4)


def test_gguf_quantized_tensors_are_dequantized(tmp_path):
    w = tiny.random_llama_weights(seed=3)
    types = gguf.GGMLQuantizationType
    qtypes = {"blk.0.attn_q.weight": types.Q8_0, "blk.0.attn_k.weight": types.Q4_0, "blk.0.attn_v.weight": types.Q4_1,
              "blk.1.attn_q.weight": types.F16, "blk.1.ffn_up.weight": types.BF16}
    config, state = load_gguf(tiny.write_gguf(tmp_path / "q.gguf", "llama", w, qtypes=qtypes))
    _, exact = load_gguf(tiny.write_gguf(tmp_path / "f.gguf", "llama", w))
    for gguf_name, qtype in qtypes.items():
        name = {"blk.0.attn_q.weight": "layers.0.attention.wq.weight", "blk.0.attn_k.weight": "layers.0.attention.wk.weight",
                "blk.0.attn_v.weight": "layers.0.attention.wv.weight", "blk.1.attn_q.weight": "layers.1.attention.wq.weight",
                "blk.1.ffn_up.weight": "layers.1.feed_forward.w3.weight"}[gguf_name]
        got, want = state[name], exact[name]
        assert got.dtype == np.float32 and got.shape == want.shape
        error = np.abs(got - want).max()
        assert 0 < error < 0.1 * np.abs(want).max(), (qtype, error)  # lossy, but close


def _random_k_quant_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks with finite f16 scales (gguf-py cannot quantize K types)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        raw[..., -2:] = scale  # d is the last field
    else:
        raw[..., 0:2] = scale  # d, dmin lead the block
        raw[..., 2:4] = scale
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_gguf_k_quants_load_in_torch_layout(tmp_path, name):
    qtype = gguf.GGMLQuantizationType[name]
    w = tiny.random_llama_weights(seed=4, hidden_dim=256)
    blocks = _random_k_quant_blocks(qtype, rows=64, cols=256, seed=5)  # ffn_down: [dim, hidden]
    path = tiny.write_gguf(tmp_path / "k.gguf", "llama", w, qtypes={"blk.0.ffn_down.weight": (blocks, qtype)},
                           hidden_dim=256)
    config, state = load_gguf(path)
    got = state["layers.0.feed_forward.w2.weight"]
    assert got.shape == (64, 256) and config.hidden_dim == 256
    np.testing.assert_array_equal(got, gguf.quants.dequantize(blocks, qtype))
    assert np.isfinite(got).all() and got.std() > 0


def test_safetensors_bf16_and_f16_widen_exactly(tmp_path):
    from safetensors.torch import save_file

    x = torch.randn(5, 7)
    save_file({"b": x.bfloat16(), "h": x.half(), "f": x}, str(tmp_path / "t.safetensors"))
    got = read_safetensors(tmp_path / "t.safetensors")
    np.testing.assert_array_equal(got["b"], x.bfloat16().float().numpy())
    np.testing.assert_array_equal(got["h"], x.half().float().numpy())
    np.testing.assert_array_equal(got["f"], x.numpy())


def test_load_checkpoint_dispatches_and_rejects_unknown(tmp_path, llama_three_ways):
    w, _ = llama_three_ways
    config, _ = load_checkpoint(tiny.write_gguf(tmp_path / "a.gguf", "llama", w))
    assert config.arch == "llama"
    with pytest.raises(CheckpointError, match="not a .gguf file"):
        load_checkpoint(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    w = tiny.random_llama_weights(seed=6)
    del w["layers.1.feed_forward.w3.weight"]
    with pytest.raises(CheckpointError, match="layers.1.feed_forward.w3.weight"):
        load_hf(tiny.write_hf_llama(tmp_path / "hf", w))


def test_llama3_rope_factors_follow_the_three_bands():
    factors = np.array(llama3_rope_freq_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192))
    assert factors.shape == (64,)
    assert factors[0] == 1.0 and factors[-1] == 8.0  # short wavelengths untouched, long ones slowed 8x
    assert np.all(np.diff(factors) >= 0)  # monotone blend in between


def test_llama3_rope_scaling_from_hf_config_and_gguf_rope_freqs_agree(tmp_path):
    # HF says it in config.json, llama.cpp as a rope_freqs tensor of divisors; both must give the same model.
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    w = tiny.random_llama_weights(seed=7)
    hf = load_hf(tiny.write_hf_llama(tmp_path / "hf", w, extra_config={"rope_scaling": scaling}))
    factors = np.array(hf[0].rope_freq_factors, dtype=np.float32)
    assert factors.shape == (8,) and factors.max() == 8.0 and factors.min() < 8.0
    gg = load_gguf(tiny.write_gguf(tmp_path / "s.gguf", "llama", {**w, "rope_freqs.weight": factors}))
    np.testing.assert_allclose(gg[0].rope_freq_factors, hf[0].rope_freq_factors, rtol=1e-6)
    np.testing.assert_allclose(our_logits(*gg), our_logits(*hf), rtol=1e-4, atol=1e-4)
    plain = load_hf(tiny.write_hf_llama(tmp_path / "plain", w))
    assert np.abs(our_logits(*plain) - our_logits(*hf)).max() > 1e-3  # the scaling does change the model
