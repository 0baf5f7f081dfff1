"""Torch half of NumpyFusedBackend: the partitioner and the payload writer.

    from execupy.backends.numpy_fused.aot import NumpyFusedPartitioner
    prog = to_edge(export(model, args)).to_backend(NumpyFusedPartitioner()).to_executorch()
"""
from __future__ import annotations

import json
import struct
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

from ...errors import ExportError
from ...exir.backend import (
    BackendDetails,
    DelegationSpec,
    Partitioner,
    PartitionResult,
    PreprocessResult,
    register_backend_details,
    tag_supported_runs,
)
from ...schema.program import CompileSpec
from .runtime import BACKEND_ID, DATA_ALIGNMENT, MAGIC, OPS

aten = torch.ops.aten
# aten op -> (payload op name, names of its tensor/scalar args in order, names of its attributes)
SUPPORTED: dict[Any, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    aten.addmm.default: ("addmm", ("self", "mat1", "mat2"), ("beta", "alpha")),
    aten.mm.default: ("mm", ("self", "mat2"), ()),
    aten.linear.default: ("linear", ("input", "weight", "bias"), ()),
    aten.permute.default: ("permute", ("self",), ("dims",)),
    aten.add.Tensor: ("add", ("self", "other"), ("alpha",)),
    aten.mul.Tensor: ("mul", ("self", "other"), ()),
    aten.relu.default: ("relu", ("self",), ()),
    aten.view.default: ("view", ("self",), ("size",)),
    aten._unsafe_view.default: ("view", ("self",), ("size",)),
}
assert all(name in OPS for name, _, _ in SUPPORTED.values())


def _static_float32(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32 and all(isinstance(s, int) for s in v.shape)


def is_supported(node: torch.fx.Node) -> bool:
    """A float32, static-shape call of one of the ops above (scalars allowed as operands)."""
    if node.target not in SUPPORTED or not _static_float32(node.meta.get("val")):
        return False
    for a in node.args:
        if isinstance(a, torch.fx.Node) and not _static_float32(a.meta.get("val")):
            return False
        if isinstance(a, (list, tuple)) and not all(type(d) is int for d in a):
            return False  # symbolic sizes or dims
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in node.kwargs.values())


def computes_something(component: list[torch.fx.Node]) -> bool:
    """A group of views/permutes alone would only add a copy: leave it to the kernels."""
    return any(SUPPORTED[n.target][0] not in ("view", "permute") for n in component)


class NumpyFusedPartitioner(Partitioner):
    def __init__(self, compile_specs: list[CompileSpec] | None = None):
        self.spec = DelegationSpec(BACKEND_ID, list(compile_specs or []))

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        tags = tag_supported_runs(exported_program.graph_module, is_supported, prefix="numpy_fused_",
                                  worth=computes_something)
        return PartitionResult(exported_program, {tag: self.spec for tag in tags})


class NumpyFusedBackendDetails(BackendDetails):
    @staticmethod
    def preprocess(edge_program: torch.fx.GraphModule, compile_specs: list[CompileSpec]) -> PreprocessResult:
        return PreprocessResult(serialize(edge_program), debug_handle_map(edge_program))


register_backend_details(BACKEND_ID, NumpyFusedBackendDetails)


def serialize(gm: torch.fx.GraphModule) -> bytes:
    ids: dict[torch.fx.Node, int] = {}
    header: dict[str, Any] = {"version": 1, "inputs": [], "outputs": [], "constants": [], "ops": []}
    weights = bytearray()
    for node in gm.graph.nodes:
        if node.op == "output":
            header["outputs"] = [ids[n] for n in node.args[0]]
            continue
        ids[node] = len(ids)
        if node.op == "placeholder":
            header["inputs"].append(ids[node])
        elif node.op == "get_attr":
            t = getattr(gm, node.target).detach().to(torch.float32).contiguous()
            weights.extend(b"\0" * (-len(weights) % DATA_ALIGNMENT))
            header["constants"].append({"id": ids[node], "offset": len(weights), "shape": list(t.shape)})
            weights.extend(t.numpy().tobytes())
        elif node.op == "call_function":
            header["ops"].append(_op(node, ids))
        else:
            raise ExportError(f"{BACKEND_ID}: cannot serialize a {node.op} node ({node.name})")
    header["num_values"] = len(ids)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head = MAGIC + struct.pack("<I", len(text)) + text
    return head + b"\0" * (-len(head) % DATA_ALIGNMENT) + bytes(weights)


def debug_handle_map(gm: torch.fx.GraphModule) -> dict[int, list[int]]:
    """The payload's op index (its implicit debug id, so the payload bytes stay as they are)
    -> the debug handle of the node it came from."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    return {i: [n.meta["debug_handle"]] for i, n in enumerate(ops) if n.meta.get("debug_handle") is not None}


def _op(node: torch.fx.Node, ids: dict[torch.fx.Node, int]) -> dict:
    name, operand_names, attr_names = SUPPORTED[node.target]
    given = dict(zip((a.name for a in node.target._schema.arguments), node.args))
    given.update(node.kwargs)
    args = []
    for a in operand_names:
        v = given.get(a)
        if isinstance(v, torch.fx.Node):
            args.append(ids[v])
        elif isinstance(v, (int, float)):
            args.append({"scalar": float(v)})
        elif v is None and a == "bias":
            break  # linear without bias: the runtime's default
        else:
            raise ExportError(f"{BACKEND_ID}: argument {a}={v!r} of {node.name} is not a tensor or number")
    attrs = {}
    for a in attr_names:
        if a in given:
            v = given[a]
            attrs[a] = [int(d) for d in v] if isinstance(v, (list, tuple)) else float(v)
    return {"op": name, "args": args, "out": ids[node], "attrs": attrs}
