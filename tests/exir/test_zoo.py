"""Every zoo model (zoo.py and zoo_functions.py), exported by execupy: our runtime and
ExecuTorch's own runtime both match torch eager on the same .pte file."""
from __future__ import annotations

import copy
import re
from functools import lru_cache

import ml_dtypes
import numpy as np
import pytest
import torch
from torch.export import export
from torch.utils import _pytree as pytree

from execupy.exir import EdgeCompileConfig, to_edge
from execupy.runtime import Module

from .. import reference
from ..reference import run_reference
from . import zoo_functions  # noqa: F401  (adds its cases to CASES)
from .zoo import CASES, Case, by_name

NAMES = [c.name for c in CASES]



def to_numpy(value):
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype == torch.bfloat16:  # numpy has no bfloat16; ml_dtypes does
        return value.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return value.detach().numpy()


@lru_cache(maxsize=None)
def exported(name: str, check_kernels: bool = True):
    """(case, eager model, example inputs, program) - exported once per test session.

    The reference tests export without checking execupy's kernels: what they test is the
    file, so they should not wait for our kernel library."""
    c = by_name(name)
    torch.manual_seed(0)
    model, args = c.build()
    ep = export(model, args, dynamic_shapes=c.dynamic_shapes)
    config = EdgeCompileConfig(_check_ir_validity=check_kernels)
    return c, model, args, to_edge(ep, compile_config=config).to_executorch()


def input_sets(c: Case, args: tuple) -> list[tuple]:
    torch.manual_seed(1)
    return [args] + c.more_inputs()


def eager_outputs(model, args: tuple, calls: int) -> list:
    """Outputs of `calls` calls in a row, on a copy so the exported model's state is untouched."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        return [model(*args) for _ in range(calls)]


def assert_same(got, expected, c: Case) -> None:
    got_leaves, expected_leaves = pytree.tree_leaves(got), pytree.tree_leaves(expected)
    assert len(got_leaves) == len(expected_leaves)
    for g, e in zip(got_leaves, expected_leaves):
        e = to_numpy(e)
        if not isinstance(e, np.ndarray):
            assert g == e
            continue
        g = np.asarray(g)
        assert g.dtype == e.dtype and g.shape == e.shape, f"{g.dtype}{g.shape} != {e.dtype}{e.shape}"
        if e.dtype.kind in "biu":
            np.testing.assert_array_equal(g, e)
        else:
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), atol=c.atol, rtol=c.rtol)


@pytest.mark.parametrize("name", NAMES)
def test_execupy_runtime_matches_eager(name):
    c, model, args, prog = exported(name)
    module = Module(prog.buffer)
    for inputs in input_sets(c, args):
        expected = eager_outputs(model, inputs, c.calls)
        for call in range(c.calls):
            got = module.forward(*[to_numpy(x) for x in inputs])
            assert pytree.tree_structure(got) == pytree.tree_structure(expected[call])
            assert_same(got, expected[call], c)
        module = Module(prog.buffer)  # fresh state for the next input set


def test_stateful_steps_match_eager():
    """Calls in a row with different inputs (prefill, then decode steps) keep state like eager."""
    for c in (c for c in CASES if c.steps() or c.calls > 1):
        c, model, args, prog = exported(c.name)
        model, module = copy.deepcopy(model), Module(prog.buffer)
        torch.manual_seed(2)
        for inputs in [args, *c.steps()]:
            with torch.no_grad():
                expected = model(*inputs)
            assert_same(module.forward(*[to_numpy(x) for x in inputs]), expected, c)


@pytest.mark.reference
@pytest.mark.parametrize("name", [c.name for c in CASES if not c.reference_lacks])
def test_reference_runtime_matches_eager(name):
    c, model, args, prog = exported(name, check_kernels=False)
    for inputs in input_sets(c, args)[:2]:
        expected = eager_outputs(model, inputs, c.calls)
        got = run_reference(prog.buffer, [to_numpy(x) for x in inputs], calls=c.calls)
        for call in range(c.calls):
            assert_same(got[call], expected[call], c)


@pytest.mark.reference
@pytest.mark.parametrize("name", [c.name for c in CASES if c.reference_lacks])
def test_reference_runtime_refuses_what_its_kernels_lack(name):
    c, _, args, prog = exported(name, check_kernels=False)
    with pytest.raises(reference.ReferenceError, match=f"Missing operator: .* {re.escape(c.reference_lacks)}"):
        run_reference(prog.buffer, [to_numpy(x) for x in args])


def test_memory_plan_reuses_bytes():
    _, _, _, prog = exported("gpt2_block")
    summary = prog.plan_summary()["forward"]
    assert 0 < summary["planned_bytes"] < summary["naive_bytes"]
