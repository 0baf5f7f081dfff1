"""Shape plans (execupy/runtime/method.py): after two calls with the same input shapes, a
method with dynamic shapes runs steps bound for those shapes. Calls with other shapes, in
any order, and shapes that turn out to depend on the data, give what a fresh load gives.
"""
import numpy as np
import pytest

from execupy.devtools.tracer import EventTracer
from execupy.runtime import Module, Program

from .conformance import flatten, program_name, topic
from .cpu import XNNPACK_ELEMENTWISE

DYNAMIC = topic("dynamic_batch_seq")


def fresh_forward(pte, *inputs) -> list:
    """The outputs of a first call on a newly loaded program (never a shape plan)."""
    return flatten(Module(pte).forward(*inputs))


def assert_equal(ours: list, expected: list, what: str) -> None:
    assert len(ours) == len(expected), what
    for k, (a, b) in enumerate(zip(ours, expected)):
        assert a.shape == b.shape and np.array_equal(a, b, equal_nan=True), f"{what}, output {k}"


@pytest.mark.parametrize("case", DYNAMIC, ids=program_name)
def test_two_shapes_alternately_equal_a_fresh_load(case):
    module = Module(case.pte)
    rng = np.random.default_rng(0)
    shapes = [(2, 5, 16), (8, 32, 16)] * 4 + [(3, 7, 16)]
    for k, shape in enumerate(shapes):
        x = rng.standard_normal(shape, dtype=np.float32)
        assert_equal(flatten(module.forward(x)), fresh_forward(case.pte, x), f"call {k}, shape {shape}")
    # both shapes were seen often enough to be planned; the last, once, was not
    assert sorted(module.method("forward").planned_shapes) == [((2, 5, 16),), ((8, 32, 16),)]


@pytest.mark.parametrize("case", DYNAMIC, ids=program_name)
def test_no_shape_plans_under_a_tracer_or_when_turned_off(case, monkeypatch):
    x = np.ones((2, 5, 16), np.float32)
    traced = Module(case.pte, event_tracer=EventTracer())
    for _ in range(3):
        traced.forward(x)
    assert traced.method("forward").planned_shapes == []
    monkeypatch.setenv("EXECUPY_SHAPE_PLANS", "0")
    off = Module(case.pte)
    for _ in range(3):
        assert_equal(flatten(off.forward(x)), fresh_forward(case.pte, x), "plans off")
    assert off.method("forward").planned_shapes == []


def test_a_shape_read_from_the_data_leaves_the_plan(tmp_path):
    """x[:n.item()] has the same input shapes every call but an output as long as n says: the
    plan made from the first calls sees another shape, the call finishes on the general steps,
    and those input shapes are not planned again."""
    torch = pytest.importorskip("torch")
    from torch.export import export

    from execupy.exir import to_edge

    class Head(torch.nn.Module):
        def forward(self, x, n):
            k = n.item()
            torch._check(k >= 1)
            torch._check(k <= 8)
            return x[:k] * 2

    pte = tmp_path / "head.pte"
    pte.write_bytes(to_edge(export(Head(), (torch.arange(8.0), torch.tensor([3])))).to_executorch().buffer)
    module = Module(pte)
    x = np.arange(8, dtype=np.float32)
    for n in (3, 3):
        assert_equal(flatten(module.forward(x, np.array([n]))), fresh_forward(pte, x, np.array([n])), f"n={n}")
    assert module.method("forward").planned_shapes == [((8,), (1,))]
    for n in (5, 3, 2, 2, 2):
        assert_equal(flatten(module.forward(x, np.array([n]))), fresh_forward(pte, x, np.array([n])), f"n={n}")
    assert module.method("forward").planned_shapes == []


@pytest.mark.parametrize("flags", ["portable", "xnnpack-8da4w"])
def test_executorch_llm_prefill_and_decode_alternately_equal_unplanned(monkeypatch, flags):
    """ExecuTorch's own LLM export (the token count and the position read with item()): chunks
    of 3 prompt tokens between single-token decodes give the logits of a method without plans.
    Its XNNPACK export's plans call each delegate bound to the plan's arrays."""
    from .et_llm import PORTABLE_FP32, Q8DA4W, export_with_executorch

    pte = export_with_executorch(PORTABLE_FP32 if flags == "portable" else Q8DA4W)
    program = Program.load(pte)
    planned = program.load_method("forward")
    monkeypatch.setenv("EXECUPY_SHAPE_PLANS", "0")
    plain = program.load_method("forward")
    rng = np.random.default_rng(1)
    pos = 0
    for k in range(12):
        tokens = rng.integers(0, 98, size=(1, 3 if k % 3 == 0 else 1), dtype=np.int64)
        inputs = [tokens, np.array([pos], np.int64)]
        assert_equal(planned.execute(inputs), plain.execute(inputs), f"call {k} at position {pos}")
        pos += tokens.shape[1]
    assert sorted(planned.planned_shapes) == [((1, 1), (1,)), ((1, 3), (1,))]
    assert plain.planned_shapes == []
    delegates = [step.__name__ for plan in planned._shape_plans.values() for step in plan.steps
                 if "delegate" in step.__name__]
    assert (flags == "portable") == (delegates == []) and set(delegates) <= {"call_bound_delegate"}
    if flags == "xnnpack-8da4w":
        # and in the decode plan every delegate's nodes run on arrays fixed at bind (the plan's, and
        # arrays made once for what only the delegate reads): products, RMSNorm tails, rotary pairs,
        # element-wise nodes, none through a value list per call (backends/xnnpack/runtime.py)
        decode = planned._shape_plans[((1, 1), (1,))].steps
        bound = [step.run.__name__ for step in decode if step.__name__ == "call_bound_delegate"]
        assert bound and "run_bound" not in bound, bound
        if XNNPACK_ELEMENTWISE:  # the RMSNorm tail's compiled loop (XNNPACK's rsqrt of this CPU; tests/cpu.py)
            assert "run_into" not in bound, bound
    # et_view's result is its source's bytes as memory planning lays them out: a plan whose
    # arrays are fixed has nothing to do for it at each call (the attention's output, which the
    # XNNPACK export leaves between delegates; the portable one's views are fusion's aliases)
    views = [step.__name__ for plan in planned._shape_plans.values()
             for name, step in zip(planned._op_names, plan.steps) if name == "executorch_prim::et_view.default"]
    assert (flags == "portable") != ("_viewed_in_place" in views)


def test_a_view_of_a_strided_slice_copies_that_fixed_view_once(tmp_path):
    """(x * 2)[..., :1].squeeze(-1) returned: fusion reads the slice as a view (strided: half the
    last axis), and the squeeze, an output, is a step. Once a plan fixes x * 2's array, the squeeze
    copies the fixed view of its slice in one step (no contiguous copy of the slice made first),
    and gives what a fresh load gives."""
    torch = pytest.importorskip("torch")
    from torch.export import Dim, export

    from execupy.exir import to_edge

    class Halves(torch.nn.Module):
        def forward(self, x):
            return (x * 2)[..., :1].squeeze(-1)

    pte = tmp_path / "halves.pte"
    example = (torch.ones(1, 3, 4, 2),)
    program = export(Halves(), example, dynamic_shapes=({1: Dim("tokens", min=1, max=16)},))
    pte.write_bytes(to_edge(program).to_executorch().buffer)
    method = Module(pte).method("forward")
    rng = np.random.default_rng(5)
    for k in range(4):
        x = rng.standard_normal((1, 5, 4, 2), dtype=np.float32)
        assert_equal(flatten(method.execute([x])), fresh_forward(pte, x), f"call {k}")
    plan = method._shape_plans[((1, 5, 4, 2),)]
    squeeze = [step.__name__ for name, step in zip(method._op_names, plan.steps) if name.startswith("aten::squeeze")]
    assert squeeze == ["<lambda>"]  # _direct_view_copy's copy of the view fixed at bind
