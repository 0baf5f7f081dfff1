"""LLM quantization (``export-llm --quantize``, docs/quantized-llm.md) on a tiny random Llama
whose GGUF mixes Q4_1, Q4_0, Q8_0 (a tied embedding) and F16 weights, and ``execupy perplexity``.

- ``gguf`` keeps the file's blocks: the rebuilt weights equal gguf-py's dequantization bit
  for bit, and the program equals torch eager on the dequantized fp32 weights.
- every mode: our runtime equals torch eager running the quantized model (the same
  integer weights and per-token rounding) and ExecuTorch's runtime runs the same file
  (its portable + quantized kernels) with the same logits.
- perplexity through the CLI equals one computed here from eager's full-sequence logits.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from execupy.llm.export import export_llm
from execupy.llm.export.models import Transformer
from execupy.llm.export.quantize import (QuantizationWarning, gguf_blocks, int8_per_token_round_trip,
                                         keep_gguf_weights, quantize_embedding, quantize_linears)
from execupy.llm.gguf_loader import GGUFFile
from execupy.llm.loaders import load_checkpoint
from execupy.runtime import Module
from tests import reference
from tests.llm import tiny

REPO = Path(__file__).resolve().parents[2]
MAX_SEQ_LEN, MAX_PREFILL = 32, 8
TOKENS = np.array([[1, 5, 9, 33, 2, 7, 60, 11, 4, 17]])  # 10 tokens: two prefill chunks
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    w = tiny.random_llama_weights(seed=1, tied=True)
    qtypes = {n: Q.Q4_1 for n in tiny._gguf_llama_tensors(w) if n.endswith("weight") and "norm" not in n}
    qtypes.update({"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q4_0,
                   "blk.1.attn_q.weight": Q.F16})
    return tiny.write_gguf(tmp_path_factory.mktemp("quant") / "tiny.gguf", "llama", w, qtypes=qtypes)


def run_ours(pte: Path) -> np.ndarray:
    """Prefill TOKENS in chunks of MAX_PREFILL: the last position's logits."""
    forward = Module(str(pte)).method("forward")
    for start in range(0, TOKENS.shape[1], MAX_PREFILL):
        logits = forward.execute([TOKENS[:, start:start + MAX_PREFILL], np.array([start])])[0]
    return np.asarray(logits).reshape(-1)


def run_executorch(pte: Path) -> np.ndarray:
    steps = [[TOKENS[:, s:s + MAX_PREFILL], np.array([s])] for s in range(0, TOKENS.shape[1], MAX_PREFILL)]
    return reference.run_reference_steps(pte, steps, llama_ops=True)[-1][0].reshape(-1)


def eager(model: Transformer) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS), torch.tensor([0]))[0, -1].numpy()


def cached_model(checkpoint) -> Transformer:
    config, state = load_checkpoint(checkpoint)
    return Transformer.from_state_dict(config, state, max_seq_len=MAX_SEQ_LEN, use_kv_cache=True,
                                       last_logits_only=True, use_custom_ops=True)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_kept_gguf_blocks_rebuild_the_files_values_bit_for_bit(tmp_path, kind):
    values = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", gguf.quants.quantize(values, Q[kind]), raw_dtype=Q[kind])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    f = GGUFFile(path)
    blocks = gguf_blocks(f, "w")
    rebuilt = blocks.q.astype(np.float32) * blocks.scales[..., None]
    if blocks.minimum is not None:
        rebuilt = rebuilt + blocks.minimum[..., None]
    assert np.array_equal(rebuilt.reshape(6, 128), f.dequantize("w"))
    assert blocks.q.min() >= blocks.quant_min and blocks.q.max() <= blocks.quant_max


@pytest.mark.reference
@pytest.mark.parametrize("mode,embedding", [("gguf", None), ("int8", "8"), ("int4", "4,32"), ("8da4w", None),
                                            ("8da8w", "4")])
def test_every_mode_matches_eager_and_runs_in_executorch(tiny_gguf, tmp_path, mode, embedding):
    if reason := reference.skip_reason():
        pytest.skip(reason)
    result = export_llm(tiny_gguf, tmp_path / f"{mode}.pte", max_seq_len=MAX_SEQ_LEN, max_prefill_len=MAX_PREFILL,
                        quantize=mode, embedding_quantize=embedding)
    model = cached_model(tiny_gguf)
    if embedding:
        bits, _, group = embedding.partition(",")
        quantize_embedding(model, int(bits), int(group) if group else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantizationWarning)
        model = (keep_gguf_weights(model, tiny_gguf) if mode == "gguf"
                 else quantize_linears(model, mode, 32, checkpoint=tiny_gguf))
    want, ours, theirs = eager(model), run_ours(result.pte_path), run_executorch(result.pte_path)
    scale = np.abs(want).max()
    # 8da*: an activation on a rounding boundary may round the other way in one of the
    # three (float64 scales, a different division order), one int8 step of one token.
    tol = (2e-2 if mode.startswith("8da") else 1e-4) * scale
    np.testing.assert_allclose(ours, want, rtol=0, atol=tol)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=tol)
    if mode == "gguf":  # the file's weight values: the fp32 model of the dequantized weights, up to summation order
        np.testing.assert_allclose(ours, eager(cached_model(tiny_gguf)), rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("mode", ["int4", "8da4w"])
def test_4bit_modes_keep_the_files_blocks_in_groups_of_32(tiny_gguf, mode):
    model = cached_model(tiny_gguf)  # the file's weights, dequantized to fp32
    want = {name: linear.weight.detach().clone() for name, linear in model.named_modules()
            if isinstance(linear, torch.nn.Linear)}
    table = model.tok_embeddings.weight.detach().clone()
    lines = []
    with pytest.warns(QuantizationWarning, match=r"^output: kept as int8 groups of 32 \(the GGUF's Q8_0 blocks\), "
                                                 r"not rounded to int4: [0-9.]+ MiB more"):
        quantize_linears(model, mode, 32, checkpoint=tiny_gguf, say=lines.append)
    form = lambda name: model.get_submodule(name).weight_form  # noqa: E731
    for name in ("layers.0.attention.wq", "layers.1.attention.wk", "layers.0.feed_forward.w1", "output"):
        torch.testing.assert_close(form(name)(), want[name], rtol=0, atol=1e-6)  # the file's values, not re-rounded
    assert form("layers.0.attention.wq").minimum is None and form("layers.0.feed_forward.w1").minimum is not None
    assert [form(n).bits for n in ("layers.0.attention.wq", "layers.0.feed_forward.w1", "output")] == [4, 4, 8]
    # The F16 tensor has no blocks to keep: quantized onto the symmetric 4-bit grid.
    assert form("layers.1.attention.wq").minimum is None and form("layers.1.attention.wq").bits == 4
    assert not torch.allclose(form("layers.1.attention.wq")(), want["layers.1.attention.wq"], rtol=0, atol=1e-6)
    assert lines == [f"{len(want) - 2} of {len(want)} linears keep the GGUF file's 4-bit blocks, "
                     "1 its Q8_0 blocks as int8 groups of 32 (output)"]
    # The tied embedding now reads the head's int8 table: the same constants, the same values.
    assert model.tok_embeddings.table is form("output")
    tokens = torch.tensor([[3, 0, 17]])
    torch.testing.assert_close(model.tok_embeddings(tokens), table[tokens], rtol=0, atol=0)


def test_another_group_size_quantizes_the_gguf_weights_again(tiny_gguf):
    model = cached_model(tiny_gguf)
    w1 = model.layers[0].feed_forward.w1.weight.detach().clone()
    lines = []
    quantize_linears(model, "int4", 16, checkpoint=tiny_gguf, say=lines.append)
    assert not torch.allclose(model.layers[0].feed_forward.w1.weight_form(), w1, rtol=0, atol=1e-6)
    assert lines[0].startswith("0 of ")


def test_a_layer_whose_width_does_not_divide_into_groups_is_kept_int8_with_a_warning():
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 24))
    x = torch.randn(3, 64)
    with pytest.warns(QuantizationWarning, match=r"^1: 8 in-features are not a multiple of group size 32"):
        quantize_linears(model, "int4", 32)
    assert tuple(model[0].weight_form.q.shape) == (8 * 64 // 32, 32)  # grouped int4
    assert tuple(model[1].weight_form.q.shape) == (24, 8)  # per-channel int8
    assert model(x).shape == (3, 24)


def test_8da4w_down_projections_round_their_input_in_blocks_per_token(tiny_gguf):
    model = cached_model(tiny_gguf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantizationWarning)
        quantize_linears(model, "8da4w", 32, checkpoint=tiny_gguf, down_proj_blocks=4)
    blocks = {name: m.activation_blocks for name, m in model.named_modules() if hasattr(m, "activation_blocks")}
    assert {b for name, b in blocks.items() if name.endswith("feed_forward.w2")} == {4}
    assert {b for name, b in blocks.items() if not name.endswith("feed_forward.w2")} == {1}
    # Blocks are rounded as tokens of their own: a channel 100x the rest costs only its block.
    rows = torch.randn(3, 64)
    rows[:, 5] *= 100
    by_block = int8_per_token_round_trip(rows, 4)
    each = torch.cat([int8_per_token_round_trip(part) for part in rows.split(16, dim=1)], dim=1)
    assert torch.equal(by_block, each)
    error = lambda r: float((r - rows)[:, 16:].abs().max())  # noqa: E731  (outside the outlier's block)
    assert error(by_block) < error(int8_per_token_round_trip(rows)) / 10


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execupy", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_cli_rejects_gguf_mode_without_a_gguf_and_a_bad_group_size(tmp_path):
    done = _cli("export-llm", "--hf", str(tmp_path), "--quantize", "gguf", "-o", str(tmp_path / "m.pte"))
    assert done.returncode != 0 and "needs a .gguf checkpoint" in done.stderr
    done = _cli("export-llm", "--hf", str(tmp_path), "--quantize", "int4", "--group-size", "24",
                "-o", str(tmp_path / "m.pte"))
    assert done.returncode != 0 and "--group-size 24 must be a power of two" in done.stderr
    assert "Traceback" not in done.stderr
    done = _cli("export-llm", "--hf", str(tmp_path), "--quantize", "int4", "--down-proj-blocks", "2",
                "-o", str(tmp_path / "m.pte"))
    assert done.returncode != 0 and "--down-proj-blocks applies to the int8 activations" in done.stderr
    done = _cli("export-llm", "--hf", str(tmp_path), "--quantize", "8da4w", "--down-proj-blocks", "0",
                "-o", str(tmp_path / "m.pte"))
    assert done.returncode != 0 and "--down-proj-blocks 0 must be at least 1" in done.stderr
    done = _cli("export-llm", "--hf", str(tmp_path), "--quantize", "8da4w", "--down-proj-blocks", "4",
                "--backend", "xnnpack", "-o", str(tmp_path / "m.pte"))
    assert done.returncode != 0 and "XNNPACK's dynamically quantized linears take one int8 scale" in done.stderr


def eager_perplexity(model: Transformer, tokens: list[int], ctx: int, windows: int) -> tuple[float, int]:
    """llama-perplexity's count from full-sequence logits: windows of ``ctx``, the logits after
    token j score token j + 1 for j in the second half."""
    nll, n = 0.0, 0
    for w in range(windows):
        window = torch.tensor([tokens[w * ctx:(w + 1) * ctx]])
        with torch.no_grad():
            logp = torch.log_softmax(model(window)[0].double(), dim=-1)
        for j in range(ctx // 2, ctx - 1):
            nll -= float(logp[j, window[0, j + 1]])
            n += 1
    return math.exp(nll / n), n


@pytest.mark.parametrize("full_logits", [True, False])
def test_cli_perplexity_equals_llama_cpp_style_count_from_eager_logits(tmp_path, full_logits):
    from execupy.llm.tokenizer import load_tokenizer
    from tests.llm.test_export_runner import _write_tiny_model

    text = (REPO / "execupy/llm/data/us_constitution.txt").read_text()[:4000]
    (tmp_path / "text.txt").write_text(text)
    folder = _write_tiny_model(tmp_path / "hf")  # a tiny random Llama with its own BPE tokenizer
    result = export_llm(folder, tmp_path / "tiny.pte", max_seq_len=32, max_prefill_len=6,
                        generate_full_logits=full_logits)
    # Windows of 16 fed 6 tokens a call: calls straddle the scored half's start at token 8.
    chunks = [] if full_logits else ["--chunks", "3"]  # the whole text, or a token per call for 3 windows
    done = _cli("perplexity", str(result.pte_path), "--text", str(tmp_path / "text.txt"), "--ctx", "16", *chunks)
    assert done.returncode == 0, done.stderr
    assert ("each scored token costs a call" in done.stderr) != full_logits
    ppl, count, windows = re.search(r"PPL = ([0-9.]+) over (\d+) tokens \((\d+) windows", done.stdout).groups()

    tokens = load_tokenizer(result.tokenizer_path).encode(text)
    assert int(windows) == (len(tokens) // 16 if full_logits else 3)
    config, state = load_checkpoint(folder)
    full = Transformer.from_state_dict(config, state, max_seq_len=64, use_kv_cache=False)
    want, n = eager_perplexity(full, tokens, 16, int(windows))
    assert int(count) == n == 7 * int(windows)
    assert float(ppl) == pytest.approx(want, rel=1e-4)


def test_a_gguf_type_not_kept_as_is_is_requantized_to_int8_groups_with_its_cost_said(tmp_path):
    from types import SimpleNamespace

    from execupy.llm.export.quantize import _gguf_form

    values = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    path = tmp_path / "q5.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(values, Q.Q5_0), raw_dtype=Q.Q5_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    f = GGUFFile(path)
    with pytest.warns(QuantizationWarning, match=r"blk.0.ffn_up.weight: GGUF type Q5_0 is stored as int8 groups "
                                                 r"of 32 .* largest absolute change"):
        form = _gguf_form(f, "blk.0.ffn_up.weight", "layers.0.feed_forward.w3", SimpleNamespace(n_heads=1, n_kv_heads=1))
    file_values = f.dequantize("blk.0.ffn_up.weight")
    with torch.no_grad():
        rebuilt = form().numpy()
    step = np.abs(file_values).reshape(-1, 32).max(axis=1) / 127.5  # one int8 step per group
    assert np.all(np.abs(rebuilt - file_values).reshape(-1, 32) <= step[:, None] * 0.501)  # half a step, and rounding
