"""ExecuTorch's XNNPACK-delegated LLM programs run on execupy's XnnpackBackend as on ExecuTorch's runtime.

A tiny random Llama is exported by ExecuTorch 1.5.1's export_llm with the XNNPACK backend
(fp32; 8da4w: int8 dynamic activations x 4-bit blockwise weights, group 32; and 8da4w with
a 4-bit embedding table), cached per machine (tests/et_llm.py). One loaded program runs a
prefill and three decode steps in both runtimes.

Tolerances: fp32 logits within 1e-5 of the step's largest logit magnitude (XNNPACK's f32
GEMM sums in its own order). Quantized: execupy reproduces XNNPACK's qd8 x qb4w arithmetic,
its sigmoid and rsqrt and the portable mean bit for bit, so a one-token forward is equal bit
for bit and every step within 1e-6 of the largest logit (what remains is the attention's
float sums: ExecuTorch's custom_sdpa runs its products through the BLAS sgemm torch links),
with the same argmax. And `execupy generate` on the 8da4w program (as a user runs it, in a
subprocess) continues a prompt with the tokens ExecuTorch's runtime picks greedily.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from execupy.runtime import Program
from tests.et_llm import (BOS_ID, EOS_ID, Q8DA4W, XNNPACK, executorch_custom_sdpa, export_with_executorch,
                          reference_greedy, tokenizer_size, write_tokenizer)
from tests.cpu import XNNPACK_4BIT
from tests.reference import run_reference_steps

pytestmark = [pytest.mark.reference, pytest.mark.slow]

PROGRAMS = {
    "xnnpack-fp32": XNNPACK,
    "xnnpack-8da4w-g32": Q8DA4W,
    "xnnpack-8da4w-g32-embedding4": Q8DA4W + ("quantization.embedding_quantize='4,32'",),
}
VOCAB = 98
RELATIVE_TOLERANCE = {"xnnpack-fp32": 1e-5, "xnnpack-8da4w-g32": 1e-6, "xnnpack-8da4w-g32-embedding4": 1e-6}


@pytest.fixture(scope="module", params=list(PROGRAMS))
def name(request):
    return request.param


@pytest.fixture(scope="module")
def program(name):
    return export_with_executorch(PROGRAMS[name], vocab_size=VOCAB)


def _steps() -> list[list[np.ndarray]]:
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, VOCAB, (1, 7))
    return [[prompt, np.array([0])]] + [[rng.integers(0, VOCAB, (1, 1)), np.array([7 + k])] for k in range(3)]


def test_the_program_is_delegated_to_xnnpack(program):
    plan = Program.load(program).plan("forward")
    assert [d.id for d in plan.delegates] and all(d.id == "XnnpackBackend" for d in plan.delegates)


def test_logits_match_executorch_over_prefill_and_three_decode_steps(name, program):
    steps = _steps()
    method = Program.load(program).load_method("forward")
    ours = [method.execute(inputs)[0] for inputs in steps]
    theirs = [outputs[0] for outputs in run_reference_steps(program, steps, llama_ops=True)]
    # the decode plan's et_views of the rotary tables sliced at the position: a view and a copy each
    decode = method._shape_plans[method._shape_key()].steps
    et_views = [step.__name__ for step, op in zip(decode, method._op_names) if op == "executorch_prim::et_view.default"]
    assert "view_copy_step" in et_views and "call_one_dynamic" not in et_views
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape == (1, VOCAB), f"step {k}"
        assert a.argmax() == b.argmax(), f"step {k}: argmax {a.argmax()} != ExecuTorch's {b.argmax()}"
        np.testing.assert_allclose(a, b, rtol=0, atol=RELATIVE_TOLERANCE[name] * np.abs(b).max(), err_msg=f"step {k}")


def test_fused_nodes_give_the_bits_of_the_nodes_one_by_one(name, program, monkeypatch):
    """backends/xnnpack/fused.py: the rotary embedding of q and of k, nine nodes each, runs as
    one step each, an RMSNorm's last four nodes as one, a SwiGLU's Sigmoid and two Multiply nodes
    as one; the 8da4w program's products of one input (q, k, v; gate, up) as one product.
    The logits are those of the nodes run one by one (EXECUPY_FUSION=0), bit for bit, over a
    prefill and three decode steps (the last two bound to the decode's shape plan)."""
    steps = _steps()
    method = Program.load(program).load_method("forward")
    fused = [method.execute(inputs)[0] for inputs in steps]
    names = [step.__name__ for handle in method._delegate_handles.values() for step in handle.steps]
    attentions = sum(name == "llama::custom_sdpa.out" for name in method._op_names)
    assert attentions and names.count("rotate_pairs_step") == 2 * attentions  # q's and k's of each layer
    assert names.count("sibling_products_step") == (2 * attentions if "8da4w" in name else 0)  # qkv, gate-up
    assert names.count("rms_tail_step") == 2 * attentions + 1  # two norms a layer, and the last one
    assert names.count("swiglu_step") == attentions
    monkeypatch.setenv("EXECUPY_FUSION", "0")
    method = Program.load(program).load_method("forward")
    assert not {"rotate_pairs_step", "sibling_products_step", "rms_tail_step", "swiglu_step"} & {
        step.__name__ for h in method._delegate_handles.values() for step in h.steps}
    for k, (a, inputs) in enumerate(zip(fused, steps)):
        np.testing.assert_array_equal(a, method.execute(inputs)[0], err_msg=f"step {k}")


@pytest.mark.parametrize("quantized", [n for n in PROGRAMS if "8da4w" in n])
def test_a_one_token_forward_gives_executorchs_logits_bit_for_bit(quantized):
    """Attention over a single position is exact in both runtimes (softmax of one score is 1),
    so a one-token forward checks everything else bit for bit: the qd8 x qb4w products, the
    int8 quantization of each row, XNNPACK's sigmoid and rsqrt, the portable mean. (The fp32
    program's float products are not reproduced bit for bit: XNNPACK's f32 GEMM sums in its
    own order.)"""
    program = export_with_executorch(PROGRAMS[quantized], vocab_size=VOCAB)
    steps = [[np.array([[BOS_ID]]), np.array([0])]]
    ours = Program.load(program).load_method("forward").execute(steps[0])[0]
    theirs = run_reference_steps(program, steps, llama_ops=True)[0][0]
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


def test_execupy_generate_on_an_8da4w_xnnpack_program_continues_as_executorch_does(tmp_path):
    from tokenizers import Tokenizer

    tokenizer = write_tokenizer(tmp_path / "tokenizer.json")
    program = export_with_executorch(Q8DA4W, vocab_size=tokenizer_size(tokenizer))
    prompt, new_tokens = "the quick brown fox jumps", 12
    hf = Tokenizer.from_file(str(tokenizer))
    expected = reference_greedy(program, hf.encode(prompt).ids, new_tokens)
    proc = subprocess.run([sys.executable, "-m", "execupy", "generate", str(program), "--tokenizer", str(tokenizer),
                           "--prompt", prompt, "--max-new-tokens", str(new_tokens), "--stats-json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["generated_tokens"] == len(expected)
    assert proc.stdout == hf.decode([t for t in expected if t != EOS_ID]) + "\n"


@pytest.mark.parametrize("quantized", [n for n in PROGRAMS if "8da4w" in n])
def test_with_executorchs_custom_sdpa_every_step_gives_executorchs_logits_bit_for_bit(quantized):
    """Past one position the attention's float sums differ: ExecuTorch's custom_sdpa runs its
    products through MKL's sgemm, whose order of summation is its own (docs/xnnpack-export.md).
    With ExecuTorch's own custom_sdpa put in ours' place, a prefill and three decode steps give
    ExecuTorch's logits bit for bit: every other operation of the program is reproduced exactly."""
    program = export_with_executorch(PROGRAMS[quantized], vocab_size=VOCAB)
    steps = _steps()
    with executorch_custom_sdpa():
        method = Program.load(program).load_method("forward")
        ours = [method.execute(inputs)[0] for inputs in steps]
    theirs = [outputs[0] for outputs in run_reference_steps(program, steps, llama_ops=True)]
    # the decode plan's et_views of the rotary tables sliced at the position: a view and a copy each
    decode = method._shape_plans[method._shape_key()].steps
    et_views = [step.__name__ for step, op in zip(decode, method._op_names) if op == "executorch_prim::et_view.default"]
    assert "view_copy_step" in et_views and "call_one_dynamic" not in et_views
    for k, (a, b) in enumerate(zip(ours, theirs)):
        if XNNPACK_4BIT:
            np.testing.assert_array_equal(a, b, err_msg=f"step {k}")
        else:  # the 4-bit products ExecuTorch runs here are not the ones reproduced (tests/cpu.py)
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * float(np.abs(b).max()), err_msg=f"step {k}")
