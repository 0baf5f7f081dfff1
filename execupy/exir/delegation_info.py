"""Delegation counts of an exported program after `to_backend` (the torch side of
`execupy.devtools.delegation`, which reads the same counts from a `.pte`).

    edge = to_edge(export(model, args)).to_backend(NumpyFusedPartitioner())
    info = get_delegation_info(edge)            # or edge.exported_program(), or its graph_module
    print(info.get_summary())
    print_delegated_graph(edge.exported_program().graph_module)

A non-delegated node is a call_function node of the top graph other than a delegate call
and the `getitem`s that unpack a delegate's outputs (neither becomes a kernel call); a
delegated node is a call_function node of a lowered module's original subgraph. A node's
op type is its operator's name, e.g. `aten::linear` or `aten::add.Tensor`.
"""
from __future__ import annotations

import operator
from collections import Counter
from typing import Any, Optional, Union

import torch
import torch.fx
from torch.export import ExportedProgram

from ..devtools.delegation import DelegationInfo, delegation_info_from_counts
from ..errors import ExportError
from .backend import LoweredBackendModule, executorch_call_delegate
from .program import EdgeProgramManager

Lowered = Union[EdgeProgramManager, ExportedProgram, torch.fx.GraphModule]


def get_delegation_info(program: Lowered, method: Optional[str] = None) -> DelegationInfo:
    """Counts for one graph, or for every method of an EdgeProgramManager when `method` is None."""
    delegated: Counter = Counter()
    non_delegated: Counter = Counter()
    subgraphs = 0
    for gm in _graph_modules(program, method):
        for node in gm.graph.nodes:
            lowered = _lowered_module(gm, node)
            if lowered is not None:
                subgraphs += 1
                delegated += Counter(op_type(n) for n in lowered.original_module.graph.nodes
                                     if n.op == "call_function")
            elif node.op == "call_function" and not _plumbing(node):
                non_delegated[op_type(node)] += 1
    return delegation_info_from_counts(delegated, non_delegated, subgraphs)


def op_type(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    return getattr(target, "__name__", str(target))


def format_delegated_graph(graph_module: torch.fx.GraphModule) -> str:
    """The graph's nodes, each delegate call followed by its subgraph's nodes, indented."""
    lines = []
    for node in graph_module.graph.nodes:
        lines.append(_node_line(node))
        lowered = _lowered_module(graph_module, node)
        if lowered is not None:
            lines.append(f"    {lowered.backend_id} runs:")
            lines += [f"        {_node_line(n)}" for n in lowered.original_module.graph.nodes]
    return "\n".join(lines)


def print_delegated_graph(graph_module: torch.fx.GraphModule) -> None:
    print(format_delegated_graph(graph_module))


# ---------------------------------------------------------------------------- helpers


def _graph_modules(program: Lowered, method: Optional[str]) -> list[torch.fx.GraphModule]:
    if isinstance(program, EdgeProgramManager):
        names = program.methods if method is None else [method]
        return [program.exported_program(name).graph_module for name in names]
    if isinstance(program, ExportedProgram):
        return [program.graph_module]
    if isinstance(program, torch.fx.GraphModule):
        return [program]
    raise ExportError(f"get_delegation_info takes an EdgeProgramManager, ExportedProgram or GraphModule, "
                      f"not {type(program).__name__}")


def _lowered_module(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[LoweredBackendModule]:
    """The lowered module a delegate call node runs, or None for any other node."""
    if node.op != "call_function" or node.target is not executorch_call_delegate:
        return None
    attr = node.args[0]
    lowered: Any = getattr(gm, attr.target, None) if isinstance(attr, torch.fx.Node) else None
    if not isinstance(lowered, LoweredBackendModule):
        raise ExportError(f"delegate call {node.name} does not name a lowered module")
    return lowered


def _plumbing(node: torch.fx.Node) -> bool:
    """A getitem that unpacks a delegate call's outputs."""
    return node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
        and node.args[0].target is executorch_call_delegate


def _node_line(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in node.args)
        name = "executorch_call_delegate" if node.target is executorch_call_delegate else op_type(node)
        return f"{node.name} = {name}({args})"
    return f"{node.op} {node.name}" + (f" ({node.target})" if node.op == "get_attr" else "")
