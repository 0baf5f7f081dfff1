"""ETRecord, the torch side: `generate_etrecord` writes the export-side companion of a .pte.

    edge = to_edge(export(model, args))
    prog = edge.to_executorch()
    prog.save("model.pte")
    generate_etrecord("model.etrecord", edge, prog)

The file is ExecuTorch's ETRecord ZIP layout (/work/shared/design/pte-format.md §4.2), so
ExecuTorch's `parse_etrecord` and Inspector read it: an empty `ETRECORD_V0` marker, each edge
program as torch.export's four serialized parts under `edge_dialect_exported_program/<method>`
(with `debug_handle` in every node's metadata, as ExecuTorch's serializer stores it), the
optional original program under `exported_program`, and the JSON maps `debug_handle_map`,
`delegate_map` and `instruction_id_to_num_outs_map`. `execupy.devtools.etrecord` reads the maps
and the per-handle node info back without torch; `load_edge_programs` gives the programs back.
"""
from __future__ import annotations

import io
import json
import operator
import os
import zipfile
from typing import Any, Optional, Union

import sympy
import torch
import torch.fx
from torch._export.serde.schema import SCHEMA_VERSION
from torch._export.serde.serialize import SerializedArtifact, deserialize, serialize
from torch.export import ExportedProgram

from ..devtools.etrecord import (
    DEBUG_HANDLE_MAP,
    DELEGATE_MAP,
    EDGE_PROGRAM_PREFIX,
    EXPORTED_PROGRAM,
    IDENTIFIER,
    NUM_OUTS_MAP,
    PROGRAM_PARTS,
)
from ..errors import ExportError, MalformedProgramError
from ..fileio import atomic_write
from .backend import executorch_call_delegate
from .debug_info import HANDLE
from .program import EdgeProgramManager, ExecutorchProgramManager


def _handles_by_name(gm: torch.fx.GraphModule) -> dict[str, int]:
    """fx node name -> debug handle in gm's own graph; a getitem's name leads to the handle of
    the op it reads (the serializer names a multi-output op by its getitems)."""
    names = {}
    for n in gm.graph.nodes:
        source = n.args[0] if n.target is operator.getitem else n
        if isinstance(source, torch.fx.Node) and source.meta.get(HANDLE) is not None:
            names[n.name] = source.meta[HANDLE]
    return names


def _output_names(value: Any) -> list[str]:
    """Every name that a serialized node's outputs mention (tensors, lists, symbolic ints)."""
    if isinstance(value, dict):
        found = [value["name"]] if isinstance(value.get("name"), str) else []
        for k, v in value.items():
            if k != "name":
                found += _output_names(v)
        return found
    if isinstance(value, list):
        return [name for v in value for name in _output_names(v)]
    return [value] if isinstance(value, str) else []


def _add_handles(graph: dict[str, Any], gm: torch.fx.GraphModule) -> None:
    """Write `debug_handle` into the metadata of each serialized node of gm's graph, and of the
    graphs nested in it (cond branches, serialized with the name of their submodule)."""
    handles = _handles_by_name(gm)
    for node in graph.get("nodes", []):
        handle = next((handles[n] for n in _output_names(node.get("outputs")) if n in handles), None)
        if handle is not None:
            node.setdefault("metadata", {})[HANDLE] = str(handle)
        for arg in node.get("inputs", []):
            sub = (arg.get("arg") or {}).get("as_graph")
            if sub and sub.get("graph") and isinstance(getattr(gm, sub.get("name", ""), None), torch.fx.GraphModule):
                _add_handles(sub["graph"], getattr(gm, sub["name"]))


# ExecuTorch 1.5.1 reads ETRecord programs with its own copy of torch.export's serializer, at
# schema 5.4 (torch 2.13 writes 8.20): its deserializer refuses another major version and any
# field its dataclasses lack. So the JSON is written at 5.4, without the fields added since
# (found by comparing the two schemas' dataclasses), per level of the tree:
ET_SCHEMA_VERSION = {"major": 5, "minor": 4}
NEWER_FIELDS = {
    "program": ("guards_code", "torch_version"),
    "graph_module": ("metadata", "treespec_namedtuple_fields"),
    "signature": ("forward_arg_names",),
    "graph": ("sym_float_values",),
    "node": ("is_hop_single_tensor_return",),
    "named_argument": ("kind",),
}
# Argument kinds schema 5.4 does not have: a program using one cannot be written for ExecuTorch.
NEWER_ARGUMENTS = {"as_nested_tensors", "as_optional_tensor", "as_int_lists", "as_complex", "as_sym_float",
                   "as_float_lists", "as_string_to_argument", "as_sym_floats"}


def _drop(d: dict[str, Any], level: str) -> None:
    for key in NEWER_FIELDS[level]:
        d.pop(key, None)


def _downgrade_graph(graph: dict[str, Any], what: str) -> None:
    _drop(graph, "graph")
    for node in graph.get("nodes", []):
        _drop(node, "node")
        for arg in node.get("inputs", []):
            _drop(arg, "named_argument")
            newer = NEWER_ARGUMENTS.intersection(arg.get("arg") or {})
            if newer:
                raise ExportError(f"{what}: node {node.get('target')} has a {sorted(newer)[0]} argument, "
                                  "which ExecuTorch's ETRecord reader (schema 5.4) cannot read")
            sub = (arg.get("arg") or {}).get("as_graph")
            if sub and sub.get("graph"):
                _downgrade_graph(sub["graph"], what)


def _plain_expressions(value: Any) -> None:
    """Symbolic sizes as schema 5.4 writes them: "s31", "2*s31", where torch 2.13 writes sympy's
    srepr ("Symbol('s31', positive=True, integer=True)"); 5.4 finds a symbol's range by that text."""
    if isinstance(value, dict):
        expr = value.get("as_expr")
        if isinstance(expr, dict) and isinstance(expr.get("expr_str"), str):
            expr["expr_str"] = str(sympy.sympify(expr["expr_str"]))
        for v in value.values():
            _plain_expressions(v)
    elif isinstance(value, list):
        for v in value:
            _plain_expressions(v)


def _as_executorch_schema(program: dict[str, Any], what: str) -> None:
    """Rewrite torch.export's JSON (in place) as ExecuTorch's serializer schema 5.4 has it."""
    _plain_expressions(program)
    _drop(program, "program")
    program["schema_version"] = dict(ET_SCHEMA_VERSION)
    gm = program["graph_module"]
    _drop(gm, "graph_module")
    for entry in gm.get("module_call_graph", []):
        if entry.get("signature"):
            _drop(entry["signature"], "signature")
    _downgrade_graph(gm["graph"], what)


def _serialize(ep: ExportedProgram, what: str) -> SerializedArtifact:
    if any(n.target is executorch_call_delegate for n in ep.graph_module.graph.nodes):
        raise ExportError(f"{what} holds delegated subgraphs, which torch.export cannot serialize; "
                          "give generate_etrecord the edge manager from before to_backend (its debug "
                          "handles are the ones the delegates kept)")
    artifact = serialize(ep)
    program = json.loads(artifact.exported_program)
    _add_handles(program["graph_module"]["graph"], ep.graph_module)
    _as_executorch_schema(program, what)
    return SerializedArtifact(json.dumps(program).encode("utf-8"), artifact.state_dict, artifact.constants,
                              artifact.example_inputs)


def _write_program(z: zipfile.ZipFile, base: str, ep: ExportedProgram) -> None:
    artifact = _serialize(ep, base)
    parts = (artifact.exported_program, artifact.state_dict, artifact.constants, artifact.example_inputs)
    for suffix, data in zip(PROGRAM_PARTS, parts):
        z.writestr(base + suffix, data)


def _edge_programs(edge: Union[EdgeProgramManager, ExportedProgram, dict[str, ExportedProgram]]
                   ) -> dict[str, ExportedProgram]:
    if isinstance(edge, EdgeProgramManager):
        return {m: edge.exported_program(m) for m in edge.methods}
    if isinstance(edge, ExportedProgram):
        return {"forward": edge}
    return dict(edge)


def generate_etrecord(et_record: Union[str, os.PathLike],
                      edge_dialect_program: Union[EdgeProgramManager, ExportedProgram, dict[str, ExportedProgram]],
                      executorch_program: ExecutorchProgramManager,
                      exported_program: Optional[ExportedProgram] = None) -> None:
    """Write the ETRecord of `executorch_program` (made from `edge_dialect_program`) to `et_record`."""
    programs = _edge_programs(edge_dialect_program)
    missing = set(executorch_program.debug_handle_map) - set(programs)
    if missing:
        raise ExportError(f"the edge programs lack methods {sorted(missing)} of the executorch program")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(IDENTIFIER, "")
        if exported_program is not None:
            _write_program(z, EXPORTED_PROGRAM, exported_program)
        for method, ep in programs.items():
            _write_program(z, EDGE_PROGRAM_PREFIX + method, ep)
        z.writestr(DEBUG_HANDLE_MAP, json.dumps(executorch_program.debug_handle_map))
        z.writestr(DELEGATE_MAP, json.dumps(executorch_program.delegate_map))
        z.writestr(NUM_OUTS_MAP, json.dumps(executorch_program.instruction_id_to_num_outs_map))
    atomic_write(et_record, buf.getvalue())


def load_edge_programs(et_record: Union[str, os.PathLike]) -> dict[str, ExportedProgram]:
    """The edge programs of an ETRecord, method -> ExportedProgram (nodes keep their debug handles)."""
    programs = {}
    try:
        with zipfile.ZipFile(et_record) as z:
            names = set(z.namelist())
            for name in sorted(names):
                if name.startswith(EDGE_PROGRAM_PREFIX) and not name.endswith(PROGRAM_PARTS[1:]):
                    parts = [z.read(name + suffix) for suffix in PROGRAM_PARTS]
                    programs[name[len(EDGE_PROGRAM_PREFIX):]] = _deserialize(SerializedArtifact(*parts))
    except (zipfile.BadZipFile, KeyError) as e:
        raise MalformedProgramError(f"{et_record}: not a complete ETRecord ({e})") from None
    return programs


def _deserialize(artifact: SerializedArtifact) -> ExportedProgram:
    """Read a program written at ExecuTorch's schema with torch's reader (the fields torch added
    since have defaults)."""
    program = json.loads(artifact.exported_program)
    program["schema_version"] = {"major": SCHEMA_VERSION[0], "minor": SCHEMA_VERSION[1]}
    ep = deserialize(SerializedArtifact(json.dumps(program).encode("utf-8"), artifact.state_dict,
                                        artifact.constants, artifact.example_inputs))
    handles = {}
    for node in program["graph_module"]["graph"].get("nodes", []):
        handle = (node.get("metadata") or {}).get(HANDLE)
        for name in _output_names(node.get("outputs"))[:1]:
            if handle:
                handles[name] = int(handle)
    for n in ep.graph_module.graph.nodes:  # a multi-output op is named by its getitems there
        names = [n.name] + [u.name for u in n.users if u.target is operator.getitem]
        handle = next((handles[name] for name in names if name in handles), None)
        if handle is not None and n.target is not operator.getitem:
            n.meta[HANDLE] = handle
    return ep
