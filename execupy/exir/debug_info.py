"""Debug handles: every node of an edge graph gets an integer that leads back to its source.

ExecuTorch's devtools join a runtime trace (instruction ids) with the exporter's maps
(instruction id -> debug handles) and the edge graph (debug handle -> node, stack trace,
module hierarchy). Handles live in `node.meta["debug_handle"]`, numbered from 1 in graph
order per method; nodes a later pass adds get the next free numbers, so handles already
given (to nodes a delegate took over, say) never change. Nothing of this goes into the .pte.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..devtools.etrecord import NodeInfo, innermost_module, source_of
from .backend import executorch_call_delegate

HANDLE = "debug_handle"


def _all_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of gm and of every graph module under it (cond branches, delegated subgraphs)."""
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]


def assign_debug_handles(gm: torch.fx.GraphModule) -> None:
    """Give every call node that has no handle yet the next free one. Not getitems: they only
    pick an output of the op before them (torch.export's serializer folds them into it); not
    delegate calls: the handles of the ops they took over stand for them."""
    nodes = [n for n in _all_nodes(gm) if n.op == "call_function"
             and n.target is not operator.getitem and n.target is not executorch_call_delegate]
    next_handle = max((n.meta.get(HANDLE) or 0 for n in nodes), default=0) + 1
    for n in nodes:
        if n.meta.get(HANDLE) is None:
            n.meta[HANDLE] = next_handle
            next_handle += 1


def op_name(target) -> str:
    """The target as torch.export's serializer names it, less "torch.ops." ("aten.add.Tensor",
    "higher_order.cond", "_operator.add"), so both readers of an ETRecord agree."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.__name__}"
    return f"{target.__module__}.{target.__name__}"


def node_info(node: torch.fx.Node) -> NodeInfo:
    file, line = source_of(node.meta.get("stack_trace"))
    module_path, module_type = innermost_module(node.meta.get("nn_module_stack"))
    return NodeInfo(op=op_name(node.target), file=file, line=line,
                    module_path=module_path, module_type=module_type)


def node_info_table(gm: torch.fx.GraphModule) -> dict[int, NodeInfo]:
    """Debug handle -> where its node comes from, for every handled node under gm."""
    return {n.meta[HANDLE]: node_info(n) for n in _all_nodes(gm) if n.meta.get(HANDLE) is not None}
