"""export-llm traces two layers and repeats the second for the others (execupy/llm/export/
repeat_layers.py). The promise: the program is the one a capture of every layer writes,
byte for byte, for every kind of checkpoint, quantization and backend; a model whose layers
differ is captured whole."""
from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from execupy.llm.export import export_llm
from execupy.llm.export.repeat_layers import same_layers
from execupy.llm.loaders import load_checkpoint
from execupy.llm.export.models import Transformer
from tests.llm import tiny

REPO = Path(__file__).resolve().parents[2]
LAYERS = 4
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repeat")
    llama = tiny.random_llama_weights(0, n_layers=LAYERS)
    qwen = tiny.random_llama_weights(1, n_layers=LAYERS, qkv_bias=True, tied=True)
    # Layer 2's down projection in Q8_0, the others' in Q4_0: kept as they are, the layers differ.
    mixed = {f"blk.{i}.ffn_down.weight": Q.Q8_0 if i == 2 else Q.Q4_0 for i in range(LAYERS)}
    return {
        "gguf": tiny.write_gguf(root / "llama.gguf", "llama", llama, n_layers=LAYERS),
        "qwen2": tiny.write_hf_llama(root / "qwen2", qwen, model_type="qwen2", tied=True, n_layers=LAYERS),
        "gpt2": tiny.write_hf_gpt2(root / "gpt2", tiny.random_gpt2_weights(2, n_layers=LAYERS), n_layers=LAYERS),
        "mixed": tiny.write_gguf(root / "mixed.gguf", "llama", llama, qtypes=mixed, n_layers=LAYERS),
    }


def export_both_ways(checkpoint: Path, out: Path, **options):
    repeated = export_llm(checkpoint, out / "repeated.pte", max_seq_len=32, max_prefill_len=8, **options)
    traced = export_llm(checkpoint, out / "traced.pte", max_seq_len=32, max_prefill_len=8, repeat_layers=False,
                        **options)
    return repeated, traced


@pytest.mark.parametrize("kind,options", [
    ("gguf", {}),
    ("qwen2", {}),                                            # q/k/v biases, tied embedding
    ("gpt2", {}),                                             # LayerNorm, GELU, learned positions
    ("gguf", {"quantize": "8da4w"}),                          # layer 0 computes sizes every layer reads
    ("gguf", {"quantize": "8da4w", "backend": "xnnpack"}),
    ("gguf", {"custom_ops": False, "generate_full_logits": True}),  # the caches' mutations are graph nodes
], ids=["gguf-fp32", "qwen2-hf", "gpt2-hf", "8da4w", "xnnpack-8da4w", "core-aten-full-logits"])
def test_repeating_layers_writes_the_program_a_capture_of_every_layer_writes(checkpoints, tmp_path, kind, options):
    repeated, traced = export_both_ways(checkpoints[kind], tmp_path, **options)
    assert (repeated.layers_traced, traced.layers_traced) == (2, LAYERS)
    assert filecmp.cmp(repeated.pte_path, traced.pte_path, shallow=False)


def test_layers_that_differ_are_all_captured(checkpoints, tmp_path):
    config, state = load_checkpoint(checkpoints["mixed"])
    assert same_layers(Transformer.from_state_dict(config, state, max_seq_len=32))  # dequantized: alike
    repeated, traced = export_both_ways(checkpoints["mixed"], tmp_path, quantize="gguf")  # blocks kept: not
    assert repeated.layers_traced == traced.layers_traced == LAYERS
    assert filecmp.cmp(repeated.pte_path, traced.pte_path, shallow=False)


def test_a_layer_with_its_own_setting_is_not_repeated():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(LAYERS))
    assert same_layers(model)
    model.layers[3].window = 16  # say, a sliding-window layer among full-attention ones
    assert not same_layers(model)
    model.layers[3] = torch.nn.Linear(4, 5)
    assert not same_layers(model)


def test_cli_export_says_it_repeated_the_layers_and_writes_the_same_program(checkpoints, tmp_path):
    out = tmp_path / "cli.pte"
    done = subprocess.run([sys.executable, "-m", "execupy", "export-llm", "--gguf", str(checkpoints["gguf"]),
                           "--max-seq-len", "32", "--max-prefill-len", "8", "-o", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"repeated layer 1 for layers 2-{LAYERS - 1}" in done.stderr
    traced = export_llm(checkpoints["gguf"], tmp_path / "traced.pte", max_seq_len=32, max_prefill_len=8,
                        repeat_layers=False)
    assert filecmp.cmp(out, traced.pte_path, shallow=False)
