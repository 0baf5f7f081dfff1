"""Programs ExecuTorch's own ``export_llm`` writes run in our runtime and under ``execupy generate``.

A tiny random Llama is exported by ExecuTorch 1.5.1 (KV cache, custom sdpa, dynamic shape,
portable kernels), fp32 and int8, and cached per machine (see tests/et_llm.py). These
programs differ from ours where it matters: the token input is not memory-planned yet
DYNAMIC_BOUND, and the metadata methods are ExecuTorch's (get_max_seq_len is the most
tokens per call, get_max_context_len the cache length; no get_max_prefill_len, no chat
template).

Tolerance: our logits must be within 1e-4 of ExecuTorch's, relative to the largest logit
magnitude of the step, on one loaded program over a prefill and three decode steps (fp32
kernels in both runtimes, summing in different orders; observed differences are ~1e-6).
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from execupy.runtime import Program, get_kernel
from tests.et_llm import (
    BOS_ID,
    EOS_ID,
    MAX_CONTEXT_LENGTH,
    MAX_SEQ_LENGTH,
    PORTABLE_FP32,
    PORTABLE_INT8,
    PORTABLE_INT8_EMBEDDING8,
    export_with_executorch,
    reference_greedy,
    tokenizer_size,
    write_tokenizer,
)
from tests.reference import run_reference_steps

pytestmark = [pytest.mark.reference, pytest.mark.slow]

# name: (export_llm flags, the quantized ops ExecuTorch puts in the program)
PROGRAMS = {"portable-fp32": (PORTABLE_FP32, set()),
            "portable-int8": (PORTABLE_INT8, set()),
            "portable-int8-embedding8": (PORTABLE_INT8_EMBEDDING8, {"quantized_decomposed::embedding_byte.dtype_out"})}
RELATIVE_TOLERANCE = 1e-4
PROMPT = "the quick brown fox jumps"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("et_llm") / "tokenizer.json")


@pytest.fixture(scope="module", params=list(PROGRAMS))
def name(request):
    return request.param


@pytest.fixture(scope="module")
def program(name, tokenizer):
    """One of ExecuTorch's programs, its vocabulary the size of the test's tokenizer."""
    return export_with_executorch(PROGRAMS[name][0], vocab_size=tokenizer_size(tokenizer))


def test_the_program_has_an_unplanned_bounded_token_input_and_the_quantized_ops_we_expect(name, program):
    meta = Program.load(program).method_meta("forward")
    assert {op for op in meta.operators if op.startswith("quantized_decomposed::")} == PROGRAMS[name][1]
    missing = [op for op in meta.operators if get_kernel(op) is None]
    assert not missing, f"execupy has no kernel for {missing}"
    plan = Program.load(program).plan("forward")
    tokens = plan.values[plan.inputs[0]]
    assert tokens.allocation_info is None and tokens.shape_dynamism != 0
    assert list(tokens.sizes) == [1, MAX_SEQ_LENGTH - 1]


def test_logits_match_executorch_over_prefill_and_three_decode_steps(program, tokenizer):
    vocab = tokenizer_size(tokenizer)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, vocab, (1, 7))
    steps = [[prompt, np.array([0])]] + [[rng.integers(0, vocab, (1, 1)), np.array([7 + k])] for k in range(3)]
    method = Program.load(program).load_method("forward")  # one program: the cache carries over
    ours = [method.execute(inputs)[0] for inputs in steps]
    theirs = [outputs[0] for outputs in run_reference_steps(program, steps, llama_ops=True)]
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape == (1, vocab), f"step {k}"
        scale = np.abs(b).max()
        np.testing.assert_allclose(a, b, rtol=0, atol=RELATIVE_TOLERANCE * scale, err_msg=f"step {k}")
    # The decode steps depend on the cache: the same token at the same position after a
    # different history gives other logits.
    fresh = Program.load(program).load_method("forward")
    fresh.execute([rng.integers(0, vocab, (1, 7)), np.array([0])])
    assert not np.allclose(fresh.execute(steps[1])[0], ours[1], atol=1e-3)


def test_execupy_generate_continues_the_prompt_as_executorch_does(program, tokenizer):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tokenizer))
    expected = reference_greedy(program, hf.encode(PROMPT).ids, NEW_TOKENS)
    proc = subprocess.run([sys.executable, "-m", "execupy", "generate", str(program), "--tokenizer",
                           str(tokenizer), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--stats-json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["generated_tokens"] == len(expected)
    assert stats["stop_reason"] == ("eos" if expected[-1] == EOS_ID else "max_new_tokens")
    text = hf.decode([t for t in expected if t != EOS_ID])
    assert proc.stdout == text + "\n"


def test_the_runner_reads_executorchs_metadata(program, tokenizer):
    from execupy.llm.runner import LLMRunner

    meta = LLMRunner(program, tokenizer).meta
    assert (meta.max_seq_len, meta.max_prefill_len) == (MAX_CONTEXT_LENGTH, MAX_SEQ_LENGTH - 1)
    assert (meta.bos_id, meta.eos_ids, meta.vocab_size) == (BOS_ID, (EOS_ID,), tokenizer_size(tokenizer))
    assert meta.chat_template is None
