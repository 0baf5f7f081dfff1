"""Test suites for bundled programs, computed by running the eager torch model.

    suite = method_test_suite(model, "forward", [(x1,), (x2,)])
    bundle = BundledProgram(to_edge(export(model, (x1,))).to_executorch(), [suite])

The expected outputs come from torch itself, not from execupy's runtime, so a bundled
program checks the exported program against the model it came from.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree

from ..devtools.bundled_program import MethodTestCase, MethodTestSuite


def method_test_suite(fn: Callable[..., Any], method_name: str, inputs: Sequence[Sequence[Any]]) -> MethodTestSuite:
    """One test case per input tuple: the inputs and what `fn(*inputs)` returns, flattened
    in the order the exported method lists its outputs."""
    cases = []
    with torch.no_grad():
        for args in inputs:
            outputs = pytree.tree_leaves(fn(*args))
            cases.append(MethodTestCase([_numpy(a) for a in args], [_numpy(o) for o in outputs]))
    return MethodTestSuite(method_name, cases)


def _numpy(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x  # an int, bool or float input
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:  # numpy has no bfloat16: go through its bits
        import ml_dtypes

        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return np.array(x.numpy())
