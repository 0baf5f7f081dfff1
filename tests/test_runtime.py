"""The runtime API on real programs: metadata, input checks, state, methods, errors.

Each test runs on ExecuTorch's program (../shared, where present) and on our own
exporter's program of the same model (tests/programs.py).
"""
import numpy as np
import pytest

from execupy.errors import (
    ExecupyError,
    InvalidInputError,
    MalformedProgramError,
    MethodNotFoundError,
    UnsupportedOperatorError,
)
from execupy.runtime import Module, Program
from execupy.schema import read_pte

from .conformance import flatten, program_name, topic, with_sample

DYNAMIC = topic("dynamic_batch_seq")
NESTED = topic("nested_outputs")
MULTI = topic("multi_method")


@pytest.mark.parametrize("case", DYNAMIC, ids=program_name)
def test_method_meta_describes_dynamic_inputs(case):
    program = Program.load(case.pte)
    assert program.method_names == ["forward"]
    meta = program.method_meta("forward")
    (x,) = meta.inputs
    assert x.dtype == np.float32 and x.dynamic and x.shape == (8, 32, 16)
    assert meta.planned_buffer_sizes and meta.planned_buffer_sizes[0] > 0
    assert "aten::addmm.out" in meta.operators


@pytest.mark.parametrize("case", DYNAMIC, ids=program_name)
def test_dynamic_shapes_resize_within_bounds(case):
    m = Module(case.pte)
    rng = np.random.default_rng(0)
    for shape in [(2, 5, 16), (8, 32, 16), (1, 2, 16), (3, 7, 16)]:
        outs = m.forward(rng.standard_normal(shape, dtype=np.float32))
        assert outs[0].shape[0] == shape[0]


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.zeros((2, 5, 16), np.float64), "input 0 has dtype float64"),
        (np.zeros((2, 5), np.float32), "rank"),
        (np.zeros((9, 5, 16), np.float32), "upper bound"),
    ],
)
@pytest.mark.parametrize("case", DYNAMIC, ids=program_name)
def test_bad_inputs_name_the_argument(case, bad, message):
    method = Program.load(case.pte).load_method("forward")
    with pytest.raises(InvalidInputError, match=message):
        method.execute([bad])


@pytest.mark.parametrize("case", DYNAMIC, ids=program_name)
def test_wrong_input_count(case):
    method = Program.load(case.pte).load_method("forward")
    with pytest.raises(InvalidInputError, match="takes 1 inputs, got 2"):
        method.execute([np.zeros((2, 5, 16), np.float32)] * 2)


@pytest.mark.parametrize("case", NESTED, ids=program_name)
def test_static_shape_mismatch_is_rejected(case):
    m = Module(case.pte)
    with pytest.raises(InvalidInputError, match=r"expects \(2, 3\)"):
        m.forward(np.zeros((3, 2), np.float32), np.zeros((2, 3), np.float32))


DYNAMIC = topic("dynamic_batch_seq")


def unplanned_io(case) -> Program:
    """A corpus program with its graph inputs and outputs left out of memory planning, as
    ExecuTorch writes them with alloc_graph_input/alloc_graph_output off (its LLM export does
    this to the token input): no allocation_info, shape_dynamism unchanged."""
    pte = read_pte(case.pte.read_bytes())
    plan = pte.program.execution_plan[0]
    for i in plan.inputs + plan.outputs:
        plan.values[i].allocation_info = None
    return Program(pte)


@pytest.mark.parametrize("case", DYNAMIC, ids=program_name)
def test_unplanned_dynamic_tensors_take_any_shape_within_their_bound(case):
    planned = Program.load(case.pte)
    method = unplanned_io(case).load_method("forward")
    rng = np.random.default_rng(2)
    for shape in [(2, 5, 16), (8, 32, 16), (1, 2, 16)]:
        x = rng.standard_normal(shape, dtype=np.float32)
        outputs, expected = method.execute([x]), planned.load_method("forward").execute([x])
        assert [y.shape for y in outputs] == [y.shape for y in expected] and outputs[0].shape[0] == shape[0]
        for y, want in zip(outputs, expected):
            np.testing.assert_array_equal(y, want)
    with pytest.raises(InvalidInputError, match=r"input 0 has shape \(9, 5, 16\).*upper bound"):
        method.execute([np.zeros((9, 5, 16), np.float32)])
    with pytest.raises(InvalidInputError, match="rank 3"):
        method.execute([np.zeros((2, 5), np.float32)])


@pytest.mark.parametrize("case", NESTED, ids=program_name)
def test_unplanned_static_tensors_keep_their_shape(case):
    method = unplanned_io(case).load_method("forward")
    a, b = np.ones((2, 3), np.float32), np.full((2, 3), 2.0, np.float32)
    np.testing.assert_array_equal(method.execute([a, b])[0], a + b)
    with pytest.raises(InvalidInputError, match=r"expects \(2, 3\)"):
        method.execute([np.zeros((1, 3), np.float32), b])


@pytest.mark.parametrize("case", NESTED, ids=program_name)
def test_nested_outputs_keep_their_structure(case):
    m = Module(case.pte)
    a, b = np.ones((2, 3), np.float32), np.full((2, 3), 2.0, np.float32)
    out = m.forward(a, b)
    assert isinstance(out, dict) and list(out) == ["sum", "pair", "items"]
    np.testing.assert_allclose(out["sum"], a + b)
    assert len(out["pair"]) == 2 and len(out["items"]) == 2


@pytest.mark.parametrize("case", topic("state_kv_cache"), ids=program_name)
def test_state_persists_across_calls_and_resets_on_reload(case):
    path = case.pte
    x = np.random.default_rng(1).standard_normal((1, 3, 8), dtype=np.float32)
    first = Module(path)
    y1 = first.forward(x, np.array([0, 1, 2]))
    y2 = first.forward(x, np.array([3, 4, 5]))
    fresh = Module(path).forward(x, np.array([3, 4, 5]))
    assert not np.allclose(y2, fresh), "second call must see the cache written by the first"
    np.testing.assert_allclose(Module(path).forward(x, np.array([0, 1, 2])), y1)


@pytest.mark.parametrize("case", MULTI, ids=program_name)
def test_outputs_are_copies_not_views_of_planned_memory(case):
    m = Module(case.pte)
    x = np.ones((3, 6), np.float32)
    y = m.forward(x)
    y_again = m.forward(x * 2)
    assert not np.shares_memory(y, y_again)
    assert not np.allclose(y, y_again)


# Per program: a method besides forward, its input shapes, its number of outputs.
OTHER_METHOD = {"multi_method": ("other", [(2,), (2,)], 2), "execupy-multi_method": ("encode", [(3, 6)], 1)}
SEVERAL_METHODS = [(p, *OTHER_METHOD[p.name]) for p in with_sample("multi_method", "execupy-multi_method")]


@pytest.mark.parametrize("program, method, shapes, outputs", SEVERAL_METHODS,
                         ids=[p.name for p, *_ in SEVERAL_METHODS])
def test_several_methods_and_constant_methods(program, method, shapes, outputs):
    m = Module(str(program.pte))
    assert set(m.method_names) >= {"forward", method, "get_max_seq_len"}
    assert m.run_method("get_max_seq_len") == 128
    assert len(flatten(m.run_method(method, *[np.ones(s, np.float32) for s in shapes]))) == outputs


@pytest.mark.parametrize("program", with_sample("scalar_inputs", "execupy-scalar_inputs"), ids=program_name)
def test_non_tensor_inputs_are_fixed_at_export(program):
    m = Module(str(program.pte))
    x = np.ones(2, np.float32)
    m.forward(x, 3, 0.5, True)
    with pytest.raises(InvalidInputError, match="input 1 must be 3"):
        m.forward(x, 4, 0.5, True)


@pytest.mark.parametrize("case", MULTI, ids=program_name)
def test_unknown_operator_names_op_and_instruction(case):
    pte = read_pte(case.pte.read_bytes())
    pte.program.execution_plan[0].operators[0].name = "custom::frobnicate"
    with pytest.raises(UnsupportedOperatorError, match=r"custom::frobnicate\.out .*instruction"):
        Program(pte).load_method(pte.program.execution_plan[0].name)


@pytest.mark.parametrize("case", MULTI, ids=program_name)
def test_out_of_range_value_index_is_malformed(case):
    pte = read_pte(case.pte.read_bytes())
    plan = pte.program.execution_plan[0]
    plan.chains[0].instructions[0].args[0] = 10_000
    with pytest.raises(MalformedProgramError, match="value 10000"):
        Program(pte).load_method(plan.name)


@pytest.mark.parametrize("case", MULTI, ids=program_name)
def test_missing_method_and_not_a_program(case):
    with pytest.raises(MethodNotFoundError, match="no method 'nope'"):
        Program.load(case.pte).load_method("nope")
    with pytest.raises(MalformedProgramError, match="identifier"):
        Program.load(b"\x00" * 64)
    assert issubclass(MalformedProgramError, ExecupyError)


@pytest.mark.parametrize("case", topic("cond"), ids=program_name)
def test_a_method_reports_its_load_time_and_the_steps_each_call_runs(case):
    # What a benchmark reads: load times, the instructions in the plan and those a call ran.
    program = Program.load(case.pte)
    method = program.load_method("forward")
    assert program.load_s > 0 and method.load_s > 0
    assert method.num_instructions == len(program.plan("forward").instructions)
    positive, negative = np.ones((2, 4), np.float32), -np.ones((2, 4), np.float32)
    ran = []
    for x in (positive, negative):
        method.execute([x])
        ran.append(method.steps_per_call)
    # A cond runs one branch and jumps over the other: each call runs fewer than all of them,
    # and the two branches differ in length.
    assert all(0 < n < method.num_instructions for n in ran) and ran[0] != ran[1]
    program = Program.load(topic("linear_relu")[-1].pte)
    plain = program.load_method("forward", fuse=False)
    assert plain.steps_per_call == plain.num_instructions  # no jumps, no fusion: every instruction, every call
    fused = program.load_method("forward")  # load-time fusion skips the view ops: fewer steps
    assert 0 < fused.steps_per_call < plain.num_instructions
