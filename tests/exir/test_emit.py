"""What the emitter writes, checked against the conventions of docs/format.md §11-§22."""
from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import Dim, export

from execupy.exir import to_edge
from execupy.exir import memory_planning as mp
from execupy.schema import program as P
from execupy.schema import read_pte

from . import zoo


def emitted(model: nn.Module, args: tuple, dynamic_shapes=None) -> tuple[P.Program, P.ExecutionPlan]:
    prog = to_edge(export(model, args, dynamic_shapes=dynamic_shapes)).to_executorch()
    program = read_pte(prog.buffer).program
    return program, program.execution_plan[0]


def kernel_calls(plan: P.ExecutionPlan) -> list[tuple[str, list[int]]]:
    return [(plan.operators[i.op_index].key, i.args) for i in plan.chains[0].instructions
            if isinstance(i, P.KernelCall)]


def test_linear_is_permute_then_addmm_with_out_twice():
    torch.manual_seed(0)
    _, plan = emitted(nn.Linear(4, 3), (torch.randn(2, 4),))
    calls = kernel_calls(plan)
    assert [k for k, _ in calls] == ["aten::permute_copy.out", "aten::addmm.out"]
    key, args = calls[1]
    assert args[-1] == args[-2] == plan.outputs[0]  # out, then the return slot (docs/format.md §13)
    beta, alpha = plan.values[args[3]], plan.values[args[4]]
    assert beta == P.Int(1) and alpha == P.Int(1)
    assert plan.non_const_buffer_sizes[0] == 0 and plan.non_const_buffer_sizes[1] > 0


class Accumulator(nn.Module):
    """State that starts at a value other than zero."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.full((1,), 10.0))

    def forward(self, x):
        self.total.add_(1)
        return x * self.total


def test_mutable_buffer_is_planned_and_written_back_last():
    program, plan = emitted(Accumulator(), (torch.randn(2, 3),))
    *_, (key, args) = kernel_calls(plan)
    assert key == "aten::copy_"
    buf, _, non_blocking, ret = args
    assert ret == buf and plan.values[non_blocking] == P.Bool(False)
    state = plan.values[buf]
    assert state.allocation_info is not None and state.data_buffer_idx == 1  # initial value kept (docs/format.md §7)
    assert program.mutable_data_segments[0].segment_index == 1
    assert buf not in plan.inputs and buf not in plan.outputs


def test_state_that_starts_at_zero_is_planned_memory_not_file_data():
    from execupy.runtime import Module

    x = torch.randn(2, 3)
    prog = to_edge(export(zoo.Counter(), (x,))).to_executorch()
    program = read_pte(prog.buffer).program
    plan = program.execution_plan[0]
    *_, (_, args) = kernel_calls(plan)
    state = plan.values[args[0]]
    assert state.allocation_info is not None and state.data_buffer_idx == 0  # no bytes in the file
    assert not program.mutable_data_segments and len(program.segments) == 1  # no mutable-data segment
    module = Module(prog.buffer)  # planned memory starts zeroed, so the count starts at 0
    for count in (1, 2, 3):
        torch.testing.assert_close(torch.from_numpy(module.forward(x.numpy())), x * count)


def test_weights_read_only_through_a_transpose_are_stored_transposed():
    from execupy.exir.passes import fold_constant_transposes
    from execupy.runtime import Module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.ReLU(), nn.Linear(3, 5))
    x = torch.randn(2, 4)
    prog = to_edge(export(model, (x,))).transform([fold_constant_transposes]).to_executorch()
    plan = read_pte(prog.buffer).program.execution_plan[0]
    assert [k for k, _ in kernel_calls(plan)] == ["aten::mm.out", "aten::relu.out", "aten::addmm.out"]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(Module(prog.buffer).forward(x.numpy())), model(x))


class TiedHead(nn.Module):
    """An embedding table that is also the output projection (tied weights)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def test_a_weight_read_another_way_too_is_not_stored_twice():
    from execupy.exir.passes import fold_constant_transposes

    tokens = torch.tensor([1, 5, 2])
    prog = to_edge(export(TiedHead(), (tokens,))).transform([fold_constant_transposes]).to_executorch()
    plan = read_pte(prog.buffer).program.execution_plan[0]
    assert "aten::permute_copy.out" in [k for k, _ in kernel_calls(plan)]  # left alone: still one table
    assert len({v.data_buffer_idx for v in plan.values if isinstance(v, P.Tensor) and v.data_buffer_idx > 0}) == 1


class InPlaceCache(nn.Module):
    """Writes x into its cache buffer with a mutating custom op, then reads the whole cache."""

    def __init__(self) -> None:
        super().__init__()
        from execupy.llm.export import custom_ops  # noqa: F401  (defines torch.ops.llama.*)

        self.register_buffer("cache", torch.zeros(1, 6, 1, 2), persistent=False)

    def forward(self, x, pos):
        start = pos[0].item()
        torch._check(start >= 0)
        torch._check(start < 6)
        torch.ops.llama.update_cache(x, self.cache, start)
        return self.cache.sum(dim=(0, 2, 3))


def test_in_place_op_on_a_buffer_needs_no_write_back():
    from execupy.runtime import Program

    args = (torch.ones(1, 2, 1, 2), torch.tensor([0]))
    program, plan = emitted(InPlaceCache(), args, dynamic_shapes=({1: Dim("t", min=1, max=4)}, None))
    keys = [k for k, _ in kernel_calls(plan)]
    assert "llama::update_cache.out" in keys and "aten::_local_scalar_dense" in keys
    assert "aten::copy_" not in keys  # the op wrote the buffer where it lives
    method = Program.load(to_edge(export(InPlaceCache(), args, dynamic_shapes=({1: Dim("t", min=1, max=4)}, None)))
                          .to_executorch().buffer).load_method("forward")
    first = method.execute([torch.ones(1, 2, 1, 2).numpy(), torch.tensor([0]).numpy()])[0]
    second = method.execute([torch.full((1, 3, 1, 2), 5.0).numpy(), torch.tensor([3]).numpy()])[0]
    assert first.tolist() == [2, 2, 0, 0, 0, 0]
    assert second.tolist() == [2, 2, 0, 10, 10, 10]  # the state kept the first call's slots


class Views(nn.Module):
    def forward(self, x):
        y = (x + 1).view(6) * 2  # an inner static view: no instruction
        return y, y.view(2, 3)  # a returned view: a real view_copy


def test_static_inner_view_aliases_and_output_view_copies():
    _, plan = emitted(Views(), (torch.randn(2, 3),))
    keys = [k for k, _ in kernel_calls(plan)]
    assert keys.count("aten::view_copy.out") == 1
    add_out = kernel_calls(plan)[0][1][-1]
    mul_self = kernel_calls(plan)[1][1][0]
    assert add_out != mul_self  # two values ...
    assert plan.values[add_out].allocation_info == plan.values[mul_self].allocation_info  # ... one storage


def test_cond_is_jumps_and_moves():
    _, plan = emitted(zoo.CondModel().eval(), (torch.randn(2, 4),))
    instructions = plan.chains[0].instructions
    jumps = [(pc, i) for pc, i in enumerate(instructions) if isinstance(i, P.JumpFalseCall)]
    moves = [pc for pc, i in enumerate(instructions) if isinstance(i, P.MoveCall)]
    (first_pc, first), (skip_pc, skip) = jumps
    assert first.destination_instruction == skip_pc + 1  # false branch starts after the skip jump
    assert skip.destination_instruction == len(instructions)
    assert plan.values[skip.cond_value_index] == P.Bool(False)
    assert plan.values[first.cond_value_index].scalar_type == P.ScalarType.BOOL
    assert moves == [skip_pc - 1, len(instructions) - 1]


class Flatten(nn.Module):
    def forward(self, x):
        return (x * 2).reshape(-1), x.shape[1] * 2


def test_dynamic_tensor_stores_upper_bound_and_sym_size_feeds_ints():
    _, plan = emitted(Flatten(), (torch.randn(2, 4),), ({1: Dim("seq", min=2, max=12)},))
    x = plan.values[plan.inputs[0]]
    assert x.sizes == [2, 12] and x.shape_dynamism == P.TensorShapeDynamism.DYNAMIC_BOUND
    keys = [k for k, _ in kernel_calls(plan)]
    assert "aten::sym_size.int" in keys and "executorch_prim::mul.Scalar" in keys
    assert isinstance(plan.values[plan.outputs[-1]], P.Int)  # tokens.shape[1] * 2 is an Int output


def test_identical_constants_share_bytes():
    _, plan = emitted(zoo.SharedWeights(), (torch.randn(2, 4),))
    weights = [v for v in plan.values if isinstance(v, P.Tensor) and v.data_buffer_idx and v.sizes == [4, 4]]
    assert len(weights) == 2 and weights[0].data_buffer_idx == weights[1].data_buffer_idx


# ---------------------------------------------------------------------------- memory planning

intervals = st.lists(st.tuples(st.integers(1, 200), st.integers(-1, 30), st.integers(0, 30)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(intervals)
def test_plan_never_overlaps_live_tensors(specs):
    storages = []
    for nbytes, start, length in specs:
        s = mp.Storage(nbytes, tensors=[P.Tensor()])
        s.touch(start)
        s.touch(start + length)
        storages.append(s)
    arena = mp.plan(storages)
    for s in storages:
        assert s.offset % 16 == 0 and s.offset + s.nbytes <= arena
        assert s.tensors[0].allocation_info.offset == s.offset
    for a in storages:
        for b in storages:
            if a is not b and a.start <= b.end and b.start <= a.end:
                assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
    assert arena <= mp.naive_size(storages)
