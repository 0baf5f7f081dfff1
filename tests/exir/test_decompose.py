"""to_edge keeps every op that has a kernel, decomposes the ones that do not (torch's own
decomposition tables), and refuses only what is left: the op, its dtypes, the user's line."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.export import export

from execupy.errors import ExportError
from execupy.exir import to_edge
from execupy.exir import EdgeCompileConfig
from execupy.exir.edge import decompose_ops_without_kernels, to_core_aten
from execupy.kernels.registry import KERNELS
from execupy.runtime import Module

aten = torch.ops.aten


def edge_ops(edge) -> list[str]:
    """The call targets of the forward graph, in order."""
    return [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]


class Norms(nn.Module):
    def forward(self, x):
        return torch.linalg.vector_norm(x, dim=-1), x.norm(), torch.linalg.vector_norm(x, ord=float("inf"), dim=0)


def test_vector_norm_exports_decomposed_and_runs():
    x = torch.randn(3, 5)
    edge = to_edge(export(Norms(), (x,)))
    assert not any("linalg_vector_norm" in op for op in edge_ops(edge))
    got = Module(edge.to_executorch().buffer).forward(x.numpy())
    for g, e in zip(got, Norms()(x)):
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-5)


def test_vector_norm_is_kept_once_the_kernel_table_has_it(monkeypatch):
    def vector_norm(x, ord, dim, keepdim, dtype):
        return np.linalg.norm(x, ord=ord, axis=tuple(dim) if dim else None, keepdims=keepdim)

    monkeypatch.setitem(KERNELS, "aten::linalg_vector_norm.out", vector_norm)
    edge = to_edge(export(Norms(), (torch.randn(3, 5),)))
    assert edge_ops(edge).count("aten.linalg_vector_norm.default") == 3


class HasKernels(nn.Module):
    """Core ATen ops with an execupy kernel that torch's full table would still decompose."""

    def forward(self, x):
        return torch.flip(x, [-1]), torch.cumsum(x, dim=2)


def test_ops_with_a_kernel_are_not_decomposed():
    from torch._decomp import decomposition_table

    kept = [aten.flip.default, aten.cumsum.default]
    assert all(op in decomposition_table for op in kept), "torch could decompose them"
    ops = edge_ops(to_edge(export(HasKernels(), (torch.randn(1, 2, 3, 4),))))
    assert all(str(op) in ops for op in kept), ops


def test_programs_whose_ops_all_have_kernels_are_left_as_core_aten_made_them():
    ep = export(HasKernels(), (torch.randn(1, 2, 3, 4),))
    core = to_core_aten(ep, EdgeCompileConfig())
    after = decompose_ops_without_kernels(core, EdgeCompileConfig())
    assert after is core  # not even re-traced


class CumProd(nn.Module):
    def forward(self, x):
        return torch.cumprod(x, dim=1) + 1  # the line the error must point at


def test_a_decomposition_into_ops_nothing_runs_is_refused_naming_the_users_op(monkeypatch):
    """torch decomposes cumprod into prims.prod; the refusal names cumprod, not the prim."""
    monkeypatch.delitem(KERNELS, "aten::cumprod.out", raising=False)
    with pytest.raises(ExportError) as err:
        to_edge(export(CumProd(), (torch.randn(2, 3, dtype=torch.float64),)))
    message = str(err.value)
    assert "aten.cumprod.default needs kernel aten::cumprod.out" in message and "prims" not in message
    assert "float64[2, 3]" in message
    assert "test_decompose.py" in message and "return torch.cumprod(x, dim=1) + 1" in message


@torch.library.custom_op("execupy_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@opaque.register_fake
def _(x):
    return torch.empty_like(x)


class UsesOpaque(nn.Module):
    def forward(self, x):
        return torch.linalg.vector_norm(opaque(x.to(torch.int32).float()), dim=0)


def test_an_op_without_kernel_or_decomposition_is_refused_with_op_dtypes_and_line(monkeypatch):
    monkeypatch.delitem(KERNELS, "aten::linalg_vector_norm.out", raising=False)
    ep = export(UsesOpaque(), (torch.randn(4, 2),))
    with pytest.raises(ExportError) as err:
        to_edge(ep)
    message = str(err.value)
    assert message.startswith("operator execupy_test.opaque.default cannot run in execupy")
    assert "float32[4, 2]" in message and "opaque(x.to(torch.int32).float())" in message

    unchecked = edge_ops(to_edge(ep, compile_config=EdgeCompileConfig(_check_ir_validity=False)))
    assert "execupy_test.opaque.default" in unchecked  # left for the check to refuse...
    assert not any("linalg_vector_norm" in op for op in unchecked)  # ...while the norm was decomposed


class CumProdAndNorm(nn.Module):
    def forward(self, x):
        return torch.cumprod(x, dim=0), torch.linalg.vector_norm(x, dim=0)


def test_one_decomposition_going_nowhere_does_not_hold_back_the_others(monkeypatch):
    monkeypatch.delitem(KERNELS, "aten::cumprod.out", raising=False)
    config = EdgeCompileConfig(_check_ir_validity=False)
    ops = edge_ops(to_edge(export(CumProdAndNorm(), (torch.randn(3, 2),)), compile_config=config))
    assert "aten.cumprod.default" in ops and not any("prims" in op for op in ops)
    assert not any("linalg_vector_norm" in op for op in ops)
