"""Delegation: NumpyFusedBackend takes the float32 linear/elementwise parts of a graph;
the .pte lists the delegate, its payload is our own byte format, and our runtime runs
the program to torch eager's results."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.export import export

from execupy.backends.numpy_fused import runtime as fused_runtime
from execupy.backends.numpy_fused.aot import NumpyFusedPartitioner
from execupy.exir import LoweredBackendModule, to_edge
from execupy.runtime import Module, Program
from execupy.schema import program as P

BACKEND = "NumpyFusedBackend"


class Mixed(nn.Module):
    """linear -> relu (delegated), softmax (not), linear -> * 2 + x (delegated again)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 6)

    def forward(self, x):
        h = torch.softmax(torch.relu(self.a(x)), dim=-1)
        return self.b(h) * 2.0 + x


def lower(model: nn.Module, *args: torch.Tensor):
    torch.manual_seed(0)
    edge = to_edge(export(model.eval(), args)).to_backend(NumpyFusedPartitioner())
    return edge, edge.to_executorch()


def run(prog, *args: torch.Tensor) -> np.ndarray:
    out = Module(prog.buffer).forward(*[a.numpy() for a in args])
    return out[0] if isinstance(out, (list, tuple)) else out


def delegates(prog) -> list[P.BackendDelegate]:
    return Program.load(prog.buffer).plan("forward").delegates


def payloads(prog) -> list[bytes]:
    program = Program.load(prog.buffer)
    return [bytes(program.delegate_payload(d.processed)) for d in delegates(prog)]


def test_mlp_is_one_delegate_and_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(5, 4)
    edge, prog = lower(model, x)

    calls = [n for n in edge.exported_program().graph.nodes if n.op == "call_function"
             and not n.target.__name__ == "getitem"]
    assert len(calls) == 1  # the whole MLP became one call
    assert len(delegates(prog)) == 1 and delegates(prog)[0].id == BACKEND
    plan = Program.load(prog.buffer).plan("forward")
    assert [type(i) for i in plan.chains[0].instructions] == [P.DelegateCall]
    assert plan.operators == []
    np.testing.assert_allclose(run(prog, x), model(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_mixed_partition_delegates_some_ops_and_runs_the_rest():
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(3, 6)
    edge, prog = lower(model, x)

    plan = Program.load(prog.buffer).plan("forward")
    kinds = [type(i).__name__ for i in plan.chains[0].instructions]
    assert kinds.count("DelegateCall") == 2, kinds
    assert kinds.count("KernelCall") >= 1  # softmax stays with our kernels
    assert any("softmax" in op.name for op in plan.operators)
    assert Program.load(prog.buffer).method_meta("forward").backends == [BACKEND, BACKEND]
    lowered = [m for m in edge.exported_program().graph_module.children() if isinstance(m, LoweredBackendModule)]
    assert len(lowered) == 2
    np.testing.assert_allclose(run(prog, x), model(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_weights_live_in_the_payload_not_the_constant_segment():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    x = torch.randn(2, 64)
    _, delegated = lower(model, x)
    plain = to_edge(export(model, (x,))).to_executorch()
    weight_bytes = 64 * 64 * 4
    # The weight is stored once: in the payload, not also as a program constant.
    assert len(delegated.buffer) < len(plain.buffer) + 1024
    assert max(len(p) for p in payloads(delegated)) >= weight_bytes


def test_payload_is_our_format_not_pickle():
    torch.manual_seed(0)
    _, prog = lower(Mixed(), torch.randn(3, 6))
    for data in payloads(prog):
        assert data.startswith(fused_runtime.MAGIC)
        assert b"\x80\x04" not in data[:64] and b"pickle" not in data and b"torch" not in data
        header, weights = fused_runtime.parse(data)
        assert {op["op"] for op in header["ops"]} <= set(fused_runtime.OPS)
        assert header["inputs"] and header["outputs"]


def test_corrupt_payload_is_rejected_at_init():
    with pytest.raises(ValueError, match="not a NumpyFusedBackend payload"):
        fused_runtime.NumpyFusedBackend().init(memoryview(b"\x80\x04garbage" * 4), [], None)


def test_unsupported_dtypes_are_left_alone():
    model = nn.Sequential(nn.Linear(4, 4)).to(torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64)
    _, prog = lower(model, x)
    assert delegates(prog) == []
    np.testing.assert_allclose(run(prog, x), model(x).detach().numpy(), rtol=1e-9)


@pytest.mark.parametrize("name", ["mlp_activations", "causal_attention", "gpt2_block", "llama_block"])
def test_zoo_models_with_delegates_match_eager(name):
    from .zoo import by_name

    torch.manual_seed(0)
    case = by_name(name)
    model, args = case.build()
    model.eval()
    prog = to_edge(export(model, args)).to_backend(NumpyFusedPartitioner()).to_executorch()
    assert BACKEND in Program.load(prog.buffer).method_meta("forward").backends
    out = Module(prog.buffer).forward(*[a.numpy() for a in args])
    expected = model(*args)
    expected = expected if isinstance(expected, (list, tuple)) else (expected,)
    out = out if isinstance(out, (list, tuple)) else (out,)
    for got, want in zip(out, expected):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=case.rtol, atol=case.atol)


def test_user_passes_still_run_after_to_backend():
    import torch
    from torch.export import export

    from execupy.backends.numpy_fused.aot import NumpyFusedPartitioner
    from execupy.exir import to_edge
    from execupy.runtime import Module

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 4)
    edge = to_edge(export(model, (x,))).to_backend(NumpyFusedPartitioner())
    edge = edge.transform([lambda gm: gm])
    y = Module(edge.to_executorch().buffer).forward(x.numpy())
    assert abs(y - model(x).detach().numpy()).max() < 1e-5


def test_stable_sort_keeps_reads_and_in_place_writes_of_a_buffer_in_order():
    from execupy.exir.backend import stable_topological_sort
    from execupy.llm.export import custom_ops  # noqa: F401  (defines torch.ops.llama.*)

    g = torch.fx.Graph()
    cache, value, q = g.placeholder("cache"), g.placeholder("value"), g.placeholder("q")
    read = g.call_function(torch.ops.llama.custom_sdpa.default, (q, cache, cache, 0), name="read")
    write = g.call_function(torch.ops.llama.update_cache.default, (value, cache, 0), name="write")
    query = g.call_function(torch.ops.aten.neg.default, (q,), name="query")
    read.args = (query, cache, cache, 0)  # `read` now needs `query`, which comes after it
    g.output((read, write))
    stable_topological_sort(g)
    # `read` must move after `query`; it read the cache before `write` changed it, and still does,
    # although no data edge links the two (a plain topological sort puts `write` first).
    assert [n.name for n in g.nodes] == ["cache", "value", "q", "query", "read", "write", "output"]


def test_stable_sort_leaves_a_sorted_graph_alone():
    from execupy.exir.backend import stable_topological_sort

    gm = torch.fx.symbolic_trace(lambda x, y: (x + 1, y * 2, (x + 1) * (y * 2)))
    before = [n.name for n in gm.graph.nodes]
    stable_topological_sort(gm.graph)
    assert [n.name for n in gm.graph.nodes] == before
