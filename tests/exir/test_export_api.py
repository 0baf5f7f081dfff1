"""The exporter's user-facing API: several methods, constant methods, passes, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.export import export

from execupy.errors import ExportError
from execupy.exir import EdgeCompileConfig, to_edge
from execupy.runtime import Module
from execupy.schema import program as P
from execupy.schema import read_pte

from ..reference import run_reference


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).relu()


class Decoder(nn.Module):
    def __init__(self, encoder: Encoder):
        super().__init__()
        self.lin = encoder.lin  # shares the weight with the encoder

    def forward(self, h, scale):
        return h @ self.lin.weight * scale


CONSTANTS = {"get_max_seq_len": 128, "use_kv_cache": True, "get_scale": 0.5, "get_name": "tiny",
             "get_dims": [4, 8], "get_table": torch.arange(3, dtype=torch.int64)}


@pytest.fixture(scope="module")
def two_methods():
    torch.manual_seed(0)
    enc = Encoder().eval()
    dec = Decoder(enc).eval()
    # (1,) not 0-dim: reference_run.py feeds inputs through np.ascontiguousarray, which makes 0-dim 1-dim.
    x, h, s = torch.randn(2, 4), torch.randn(2, 3), torch.tensor([2.0])
    programs = {"forward": export(enc, (x,)), "decode": export(dec, (h, s))}
    prog = to_edge(programs, constant_methods=CONSTANTS).to_executorch()
    return enc, dec, (x,), (h, s), prog


def test_methods_are_sorted_and_constant_methods_follow(two_methods):
    *_, prog = two_methods
    names = [p.name for p in read_pte(prog.buffer).program.execution_plan]
    assert names == ["decode", "forward", *CONSTANTS]


def test_every_method_runs_in_our_runtime(two_methods):
    enc, dec, enc_in, dec_in, prog = two_methods
    m = Module(prog.buffer)
    np.testing.assert_allclose(m.forward(enc_in[0].numpy()), enc(*enc_in).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.run_method("decode", *(t.numpy() for t in dec_in)),
                               dec(*dec_in).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_constant_methods_return_their_values(two_methods):
    *_, prog = two_methods
    m = Module(prog.buffer)
    for name, value in CONSTANTS.items():
        got = m.run_method(name)
        if isinstance(value, torch.Tensor):
            np.testing.assert_array_equal(got, value.numpy())
        else:
            assert got == value and type(got) is type(value), name


def test_shared_weight_is_stored_once(two_methods):
    *_, prog = two_methods
    pte = read_pte(prog.buffer).program
    weight_indices = {v.data_buffer_idx for plan in pte.execution_plan for v in plan.values
                      if isinstance(v, P.Tensor) and v.sizes == [3, 4]}
    assert len(weight_indices) == 1


def test_plan_summary_counts_every_method(two_methods):
    *_, prog = two_methods
    summary = prog.plan_summary()
    assert set(summary) == {"forward", "decode"}
    assert all(0 < s["planned_bytes"] <= s["naive_bytes"] for s in summary.values())


@pytest.mark.reference
def test_reference_runs_both_methods_and_constants(two_methods):
    enc, dec, enc_in, dec_in, prog = two_methods
    (out,), = run_reference(prog.buffer, [enc_in[0].numpy()])
    np.testing.assert_allclose(out, enc(*enc_in).detach().numpy(), rtol=1e-5, atol=1e-6)
    (out,), = run_reference(prog.buffer, [t.numpy() for t in dec_in], method="decode")
    np.testing.assert_allclose(out, dec(*dec_in).detach().numpy(), rtol=1e-5, atol=1e-6)
    (out,), = run_reference(prog.buffer, [], method="get_max_seq_len")
    assert int(out) == 128


# ---------------------------------------------------------------------------- passes


def relu_to_sigmoid(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.target == torch.ops.aten.relu.default:
            node.target = torch.ops.aten.sigmoid.default
    gm.recompile()
    return gm


def test_transform_applies_user_graph_passes():
    torch.manual_seed(0)
    model, x = Encoder().eval(), torch.randn(2, 4)
    edge = to_edge(export(model, (x,))).transform([relu_to_sigmoid])
    targets = {n.target for n in edge.exported_program().graph.nodes}
    assert torch.ops.aten.sigmoid.default in targets and torch.ops.aten.relu.default not in targets
    got = Module(edge.to_executorch().buffer).forward(x.numpy())
    np.testing.assert_allclose(got, torch.sigmoid(model.lin(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_transform_accepts_exported_program_passes():
    seen = []

    def record(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        seen.append(sum(1 for n in ep.graph.nodes if n.op == "call_function"))
        return ep

    edge = to_edge(export(Encoder().eval(), (torch.randn(2, 4),))).transform([record])
    assert seen == [3]  # permute, addmm, relu
    assert edge.exported_program() is not None


# ---------------------------------------------------------------------------- errors


@torch.library.custom_op("execupy_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


class UsesMystery(nn.Module):
    def forward(self, x):
        return mystery(x.to(torch.float64)) + 1  # the line the error must point at


def test_unsupported_op_fails_at_to_edge_with_op_dtypes_and_line():
    ep = export(UsesMystery(), (torch.randn(2, 3),))
    with pytest.raises(ExportError) as err:
        to_edge(ep)
    message = str(err.value)
    assert "execupy_test.mystery" in message
    assert "float64[2, 3]" in message
    assert "test_export_api.py" in message and "return mystery(x.to(torch.float64)) + 1" in message


def test_unchecked_edge_still_fails_at_to_executorch():
    ep = export(UsesMystery(), (torch.randn(2, 3),))
    edge = to_edge(ep, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    with pytest.raises(ExportError, match="execupy_test.mystery"):
        edge.to_executorch()


def test_unbounded_dynamic_dim_is_an_export_error():
    ep = export(Encoder(), (torch.randn(2, 4),), dynamic_shapes=({0: torch.export.Dim("b")},))
    with pytest.raises(ExportError, match="upper bound"):
        to_edge(ep).to_executorch()
