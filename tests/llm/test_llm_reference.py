"""The tiny fp32 Llama export runs the same in ExecuTorch's own runtime as in ours and in torch.

The last test uses our own worker in the reference venv (tests/reference.py,
run_reference_steps), which can: prefill then two decode steps of the default export
(llama:: custom ops) in one loaded program, with ExecuTorch's own kernels of those ops.

The shared reference tool loads a program once and calls it ``calls`` times with the SAME
inputs, so it cannot feed a prefill and then a different decode step into one loaded
program. What is compared with it, all on the one exported .pte (fp32, no custom ops):

1. prefill: tokens[:T] at input_pos [0] on a fresh program -> last-position logits, in the
   reference runtime, in ours and in torch eager.
2. decode continues the cache: the reference's prefill of tokens[:T+1] at [0] (one call)
   against ours doing prefill tokens[:T] then decode tokens[T] at [T] in one loaded
   program, and against eager doing the same two steps; causal attention makes these equal.
3. the decode path itself in the reference runtime: one token at input_pos [T] on a fresh
   program (a zero cache below T), called twice in the same loaded program (the second
   call rewrites the same cache slot, so it must repeat the first), against ours and eager
   doing the same on a fresh program / fresh cache.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from execupy.llm.export.models import Transformer
from execupy.llm.runner import LLMRunner
from tests.llm.test_export_runner import MAX_PREFILL, export_tiny
from tests.reference import run_reference, run_reference_steps

pytestmark = pytest.mark.reference

T = 5  # prefill length; T + 1 still fits in one prefill call
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    result, eager = export_tiny(tmp_path_factory.mktemp("llm_reference"), custom_ops=False)
    runner = LLMRunner(result.pte_path)
    tokens = runner.tokenizer.encode("the quick brown fox jumps over")[: T + 1]
    assert len(tokens) == T + 1 and T + 1 <= MAX_PREFILL
    return result.pte_path, eager, tokens


def _inputs(tokens, pos: int) -> list[np.ndarray]:
    return [np.asarray([tokens], dtype=np.int64), np.asarray([pos], dtype=np.int64)]


def _eager_last(eager: Transformer, steps: list[tuple[list[int], int]]) -> np.ndarray:
    """Run (tokens, input_pos) steps on a fresh cache; the last position's logits of the last step."""
    eager.reset_cache()
    with torch.no_grad():
        for tokens, pos in steps:
            logits = eager(torch.tensor([tokens]), torch.tensor([pos]))
    return logits[0, -1].numpy()


def _ours(pte, steps: list[tuple[list[int], int]]) -> np.ndarray:
    """The same steps in our runtime, in one loaded program (fresh, so its cache is zero)."""
    runner = LLMRunner(pte)
    for tokens, pos in steps:
        runner.pos = pos  # _forward feeds at runner.pos; a decode on a fresh program starts at T
        logits = runner._forward(tokens)
    return np.asarray(logits).reshape(-1)


def test_prefill_logits_match_reference_and_eager(tiny):
    pte, eager, tokens = tiny
    (ref,) = run_reference(pte, _inputs(tokens[:T], 0))
    ref = ref[0]
    assert ref.shape == (1, 1, eager.config.vocab_size) and ref.dtype == np.float32
    ours = _ours(pte, [(tokens[:T], 0)])
    theirs = _eager_last(eager, [(tokens[:T], 0)])
    np.testing.assert_allclose(ref.reshape(-1), theirs, **TOL)
    np.testing.assert_allclose(ours, ref.reshape(-1), **TOL)


def test_prefill_then_decode_equals_reference_longer_prefill(tiny):
    pte, eager, tokens = tiny
    (ref,) = run_reference(pte, _inputs(tokens[: T + 1], 0))
    ref = ref[0].reshape(-1)
    steps = [(tokens[:T], 0), (tokens[T:T + 1], T)]
    ours = _ours(pte, steps)
    theirs = _eager_last(eager, steps)
    np.testing.assert_allclose(theirs, ref, **TOL)
    np.testing.assert_allclose(ours, ref, **TOL)
    # Not trivially equal: the decode step depends on what the prefill left in the cache.
    alone = _eager_last(eager, [(tokens[T:T + 1], T)])
    assert not np.allclose(alone, ref, **TOL)


def test_decode_step_runs_the_same_in_the_reference(tiny):
    pte, eager, tokens = tiny
    step = [(tokens[T:T + 1], T)]
    first, second = run_reference(pte, _inputs(*step[0]), calls=2)
    assert first[0].shape == (1, 1, eager.config.vocab_size)
    np.testing.assert_allclose(second[0], first[0], rtol=0, atol=0)
    ours = _ours(pte, step)
    theirs = _eager_last(eager, step)
    np.testing.assert_allclose(first[0].reshape(-1), theirs, **TOL)
    np.testing.assert_allclose(ours, first[0].reshape(-1), **TOL)


def test_custom_op_export_runs_in_the_reference_with_its_llama_kernels(tmp_path):
    result, eager = export_tiny(tmp_path, custom_ops=True)
    runner = LLMRunner(result.pte_path)
    tokens = runner.tokenizer.encode("the quick brown fox jumps over")[: T + 1]
    # Prefill T tokens, then decode one, then decode again at the next position: one loaded program.
    steps = [(tokens[:T], 0), (tokens[T:T + 1], T), (tokens[:1], T + 1)]
    theirs = run_reference_steps(result.pte_path, [_inputs(t, p) for t, p in steps], llama_ops=True)
    ours_runner = LLMRunner(result.pte_path)
    for k, (step_tokens, pos) in enumerate(steps):
        ours_runner.pos = pos
        ours = np.asarray(ours_runner._forward(step_tokens)).reshape(-1)
        eager_logits = _eager_last(eager, steps[: k + 1])
        np.testing.assert_allclose(theirs[k][0].reshape(-1), eager_logits, **TOL)
        np.testing.assert_allclose(ours, theirs[k][0].reshape(-1), **TOL)
