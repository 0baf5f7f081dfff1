"""XnnpackPartitioner: hand the ops XNNPACK runs (fp32, fp16, and int8 from our pt2e quantizer
or export-llm's quantize modes; docs/xnnpack-export.md) to ExecuTorch's XnnpackBackend.

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
from ..backend import (TAG, BackendDetails, DelegationSpec, Partitioner, PartitionResult, PreprocessResult,
                       _constant_inputs, register_backend_details, tag_supported_runs)
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


def dequantize_per_reader(gm: torch.fx.GraphModule) -> None:
    """Give each reader of a static int8 dequantize its own copy, just before it: the reader's
    delegate then holds it and runs on the int8 values, wherever the other readers land."""
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    for node in list(gm.graph.nodes):
        if node.target is not dequantize or len(node.users) < 2:
            continue
        for user in list(node.users):
            with gm.graph.inserting_before(user):
                copy = gm.graph.node_copy(node)
            user.replace_input_with(node, copy)
        gm.graph.erase_node(node)
    gm.recompile()


def dequantize_with_reader(gm: torch.fx.GraphModule) -> None:
    """A dequantize (one reader each, above) tagged apart from its delegated reader moves into the
    reader's delegate, which then reads the int8 values across the boundary."""
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    for node in gm.graph.nodes:
        if node.target is dequantize and TAG in node.meta and len(node.users) == 1:
            reader_tag = next(iter(node.users)).meta.get(TAG)
            if reader_tag is not None:
                node.meta[TAG] = reader_tag


class XnnpackPartitioner(Partitioner):
    def __init__(self, compile_specs: list[CompileSpec] | None = None):
        self.spec = DelegationSpec(BACKEND_ID, list(compile_specs or []))

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        dequantize_per_reader(exported_program.graph_module)
        consts = constant_nodes(exported_program)

        def is_supported(node: torch.fx.Node) -> bool:
            return supported(node, lambda a: isinstance(a, torch.fx.Node) and a in consts)

        def computes_something(component: list[torch.fx.Node]) -> bool:
            # Moving data alone, or folding weights, is no work for a delegate.
            return any(n.target not in LAYOUT_ONLY and n.target is not operator.getitem and n not in consts
                       for n in component)

        gm = exported_program.graph_module
        tag_supported_runs(gm, is_supported, prefix="xnnpack_", worth=computes_something)
        dequantize_with_reader(gm)
        tags = dict.fromkeys(n.meta[TAG] for n in gm.graph.nodes if TAG in n.meta)
        return PartitionResult(exported_program, {tag: self.spec for tag in tags})


class XnnpackBackendDetails(BackendDetails):
    @staticmethod
    def preprocess(edge_program: torch.fx.GraphModule, compile_specs: list[CompileSpec]) -> PreprocessResult:
        graph = build_graph(edge_program)
        # Each XNNPACK node carries the debug handle of the op it came from (what the runtime logs).
        handles = {n.debug_handle: [n.debug_handle] for n in graph.nodes if n.debug_handle != NO_DEBUG_HANDLE}
        return PreprocessResult(serialize(graph), handles, graph.named_data)


register_backend_details(BACKEND_ID, XnnpackBackendDetails)
