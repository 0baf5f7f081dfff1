"""The torch model: the KV-cached forward, with core ATen ops or with the llama:: custom
ops, equals the plain full-sequence forward, token by token, for both architectures, and
it exports with mutable cache buffers and a dynamic length."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from execupy.llm.hf_loader import load_hf
from execupy.llm.export.meta_loader import load_meta
from execupy.llm.export.models import Transformer, greedy_generate
from tests.llm import tiny

PROMPT = [5, 9, 33, 2, 71, 14]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return load_meta(tiny.write_meta(root, tiny.random_llama_weights(seed=10)))
    return load_hf(tiny.write_hf_gpt2(root, tiny.random_gpt2_weights(seed=11)))


@torch.no_grad()
@pytest.mark.parametrize("custom_ops", [False, True], ids=["aten", "custom_ops"])
def test_cached_prefill_and_decode_match_full_forward(checkpoint, custom_ops):
    config, state = checkpoint
    cached = Transformer.from_state_dict(config, state, max_seq_len=32, use_custom_ops=custom_ops)
    full = Transformer.from_state_dict(config, state, use_kv_cache=False, max_seq_len=32)
    sequence = PROMPT + [40, 3, 77, 8]
    expected = full(torch.tensor([sequence]))[0]
    # Prefill the prompt in two chunks, then decode one token at a time.
    got = [cached(torch.tensor([PROMPT[:4]]), torch.tensor([0]))[0],
           cached(torch.tensor([PROMPT[4:]]), torch.tensor([4]))[0]]
    for pos in range(len(PROMPT), len(sequence)):
        got.append(cached(torch.tensor([[sequence[pos]]]), torch.tensor([pos]))[0])
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_greedy_generation_with_and_without_cache_agree(checkpoint):
    config, state = checkpoint
    cached = Transformer.from_state_dict(config, state, max_seq_len=32)
    full = Transformer.from_state_dict(config, state, use_kv_cache=False, max_seq_len=32)
    tokens, stats = greedy_generate(cached, PROMPT, 12)
    reference, _ = greedy_generate(full, PROMPT, 12)
    assert tokens == reference and len(tokens) == 12
    assert stats["prompt_tokens"] == len(PROMPT) and stats["decode_tokens"] == 11


@torch.no_grad()
@pytest.mark.parametrize("custom_ops", [False, True], ids=["aten", "custom_ops"])
def test_stale_cache_entries_beyond_the_position_are_ignored(checkpoint, custom_ops):
    # A second prompt overwrites the cache from position 0; what the first left behind must not leak.
    config, state = checkpoint
    model = Transformer.from_state_dict(config, state, max_seq_len=32, use_custom_ops=custom_ops)
    model(torch.tensor([[1] * 20]), torch.tensor([0]))
    reused = model(torch.tensor([PROMPT]), torch.tensor([0]))
    model.reset_cache()
    fresh = model(torch.tensor([PROMPT]), torch.tensor([0]))
    torch.testing.assert_close(reused, fresh, rtol=0, atol=0)


def test_last_logits_only_returns_one_row(checkpoint):
    config, state = checkpoint
    model = Transformer.from_state_dict(config, state, max_seq_len=16, last_logits_only=True)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]), torch.tensor([0]))
    assert logits.shape == (1, 1, config.vocab_size)


def test_export_sees_mutable_cache_buffers_and_dynamic_length(tmp_path):
    config, state = load_meta(tiny.write_meta(tmp_path, tiny.random_llama_weights(seed=12)))
    model = Transformer.from_state_dict(config, state, max_seq_len=32)
    seq = torch.export.Dim("seq", min=1, max=32)
    ep = torch.export.export(model, (torch.tensor([PROMPT]), torch.tensor([0])),
                             dynamic_shapes=({1: seq}, None), strict=False).run_decompositions()
    mutated = set(ep.graph_signature.buffers_to_mutate.values())
    assert mutated == {f"layers.{i}.attention.{c}_cache" for i in range(config.n_layers) for c in "kv"}
    # The exported program prefills and decodes like the eager model.
    eager = Transformer.from_state_dict(config, state, max_seq_len=32)
    with torch.no_grad():
        want = [eager(torch.tensor([PROMPT]), torch.tensor([0])), eager(torch.tensor([[7]]), torch.tensor([6]))]
    run = ep.module()
    got = [run(torch.tensor([PROMPT]), torch.tensor([0])), run(torch.tensor([[7]]), torch.tensor([6]))]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.detach().numpy(), w.numpy(), rtol=1e-5, atol=1e-5)
