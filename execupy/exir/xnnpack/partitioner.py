"""XnnpackPartitioner: hand the fp32 ops XNNPACK runs to ExecuTorch's XnnpackBackend.

    from execupy.exir import to_edge_transform_and_lower
    from execupy.exir.xnnpack import XnnpackPartitioner
    prog = to_edge_transform_and_lower(export(model, args), partitioner=[XnnpackPartitioner()]).to_executorch()

What XNNPACK can run is the table in lower.py; everything else stays on portable kernels.
The payloads are the ones ExecuTorch's own preprocess writes, so its runtime loads our files.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch.export import ExportedProgram

from ...backends.xnnpack.runtime import BACKEND_ID
from ...schema.program import CompileSpec
from ..backend import (BackendDetails, DelegationSpec, Partitioner, PartitionResult, PreprocessResult, _constant_inputs,
                       register_backend_details, tag_supported_runs)
from .lower import LAYOUT_ONLY, build_graph, supported
from .payload import NO_DEBUG_HANDLE, serialize


def constant_nodes(ep: ExportedProgram) -> set[torch.fx.Node]:
    """Weights (parameters, unmutated buffers, lifted constants) and what is computed from them alone."""
    names = set(_constant_inputs(ep))
    consts: set[torch.fx.Node] = set()
    for node in ep.graph_module.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            consts.add(node)
        elif node.op == "call_function" and node.all_input_nodes and all(a in consts for a in node.all_input_nodes):
            consts.add(node)
    return consts


class XnnpackPartitioner(Partitioner):
    def __init__(self, compile_specs: list[CompileSpec] | None = None):
        self.spec = DelegationSpec(BACKEND_ID, list(compile_specs or []))

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        consts = constant_nodes(exported_program)

        def is_supported(node: torch.fx.Node) -> bool:
            return supported(node, lambda a: isinstance(a, torch.fx.Node) and a in consts)

        def computes_something(component: list[torch.fx.Node]) -> bool:
            # Moving data alone, or folding weights, is no work for a delegate.
            return any(n.target not in LAYOUT_ONLY and n.target is not operator.getitem and n not in consts
                       for n in component)

        tags = tag_supported_runs(exported_program.graph_module, is_supported, prefix="xnnpack_",
                                  worth=computes_something)
        return PartitionResult(exported_program, {tag: self.spec for tag in tags})


class XnnpackBackendDetails(BackendDetails):
    @staticmethod
    def preprocess(edge_program: torch.fx.GraphModule, compile_specs: list[CompileSpec]) -> PreprocessResult:
        graph = build_graph(edge_program)
        # Each XNNPACK node carries the debug handle of the op it came from (what the runtime logs).
        handles = {n.debug_handle: [n.debug_handle] for n in graph.nodes if n.debug_handle != NO_DEBUG_HANDLE}
        return PreprocessResult(serialize(graph), handles, graph.named_data)


register_backend_details(BACKEND_ID, XnnpackBackendDetails)
