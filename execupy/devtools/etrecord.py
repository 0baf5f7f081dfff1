"""ETRecord, the torch-free half: what a runtime-side Inspector needs from the export-side record.

An ETRecord (docs: /work/shared/design/pte-format.md §4.2) is a ZIP archive written next to a `.pte`
by `execupy.exir.etrecord.generate_etrecord`. Its JSON entries map each instruction of each method
to debug handles, and its edge programs (torch.export's JSON serialization) carry, per graph
node, the handle, the stack trace and the module hierarchy. This module reads those without torch:

    maps = read_etrecord_maps("model.etrecord")
    for handle in maps.debug_handle_map["forward"][3]:        # instruction 3 of forward
        info = maps.node_info["forward"][handle]
        print(info.op, info.file, info.line, info.module_path)

The exported programs themselves (tensors, graphs) are read back only on the torch side.
"""
from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from ..errors import MalformedProgramError

# Entry names, as ExecuTorch 1.5.1 writes and parses them.
IDENTIFIER = "ETRECORD_V0"
EXPORTED_PROGRAM = "exported_program"
EDGE_PROGRAM_PREFIX = "edge_dialect_exported_program/"
DEBUG_HANDLE_MAP = "debug_handle_map"
DELEGATE_MAP = "delegate_map"
NUM_OUTS_MAP = "instruction_id_to_num_outs_map"
EXPORT_GRAPH_ID = "export_graph_id"
# The four parts torch.export's serializer makes of one program; the graph (JSON) has no suffix.
PROGRAM_PARTS = ("", "_state_dict", "_constants", "_example_inputs")

# A frame of an fx stack trace: `File "path", line N, in function`.
FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')


@dataclass(frozen=True)
class NodeInfo:
    """Where a debug handle comes from: the graph node, its source line and its module."""

    op: str               # the node's target, e.g. "aten.addmm.default"
    file: Optional[str]   # innermost frame of the user's code (library frames skipped)
    line: Optional[int]
    module_path: Optional[str]  # nn_module_stack's innermost module, "" for the root module
    module_type: Optional[str]


@dataclass
class ETRecordMaps:
    """The JSON maps of an ETRecord, with integer keys, plus node info per method and handle."""

    debug_handle_map: dict[str, dict[int, list[int]]]
    delegate_map: dict[str, dict[int, dict[str, Any]]]
    instruction_id_to_num_outs_map: dict[str, dict[int, int]]
    node_info: dict[str, dict[int, NodeInfo]] = field(default_factory=dict)


def _is_library_frame(path: str) -> bool:
    return "/site-packages/" in path or "/dist-packages/" in path or "/torch/" in path


def source_of(stack_trace: Optional[str]) -> tuple[Optional[str], Optional[int]]:
    """(file, line) of the innermost frame outside installed libraries (torch.nn's own forwards)."""
    frames = FRAME.findall(stack_trace or "")
    if not frames:
        return None, None
    user = [f for f in frames if not _is_library_frame(f[0])]
    path, line, _ = (user or frames)[-1]
    return path, int(line)


def innermost_module(stack: Optional[dict[str, tuple[str, str]]]) -> tuple[Optional[str], Optional[str]]:
    """(path, type) of the deepest entry of an nn_module_stack (insertion order is outermost first)."""
    if not stack:
        return None, None
    path, ty = list(stack.values())[-1]
    return path, ty


def _parse_module_stack(text: str) -> dict[str, tuple[str, str]]:
    """torch.export's serialized nn_module_stack: `key,path,type` entries joined by ';'."""
    stack = {}
    for entry in text.split(";"):
        key, _, rest = entry.partition(",")
        path, _, ty = rest.rpartition(",")
        stack[key] = (path, ty)
    return stack


def node_info_from_serialized(node: dict[str, Any]) -> tuple[Optional[int], NodeInfo]:
    """(debug handle or None, info) of one node of torch.export's JSON graph."""
    meta = node.get("metadata") or {}
    file, line = source_of(meta.get("stack_trace"))
    module_path, module_type = innermost_module(_parse_module_stack(meta["nn_module_stack"])
                                                if meta.get("nn_module_stack") else None)
    handle = meta.get("debug_handle")
    return (int(handle) if handle else None), NodeInfo(
        op=str(node.get("target", "")).removeprefix("torch.ops."), file=file, line=line,
        module_path=module_path, module_type=module_type)


def _int_keys(m: dict[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in m.items()}


def _read_json(z: zipfile.ZipFile, name: str, default: Any) -> Any:
    if name not in z.namelist():
        return default
    try:
        return json.loads(z.read(name))
    # What zipfile raises for a damaged, encrypted or oddly compressed entry, and bad JSON.
    except (ValueError, zipfile.BadZipFile, EOFError, zlib.error, RuntimeError, NotImplementedError, OSError) as e:
        raise MalformedProgramError(f"ETRecord entry {name!r} is not readable JSON: {e}") from None


def _shaped(name: str, build: Callable[[], Any]) -> Any:
    """build() over JSON that should have ExecuTorch's layout; any other shape is a typed error."""
    try:
        return build()
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise MalformedProgramError(f"ETRecord entry {name!r} does not have the expected layout "
                                    f"({type(e).__name__}: {e})") from None


def _graph_nodes(program: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a serialized program's graph (cond branches and other subgraphs too)."""
    nodes: list[dict[str, Any]] = []
    pending = [(program.get("graph_module") or {}).get("graph") or {}]
    while pending:
        graph = pending.pop()
        for node in graph.get("nodes") or []:
            nodes.append(node)
            for arg in node.get("inputs") or []:
                sub = (arg.get("arg") or {}).get("as_graph") if isinstance(arg, dict) else None
                if sub and sub.get("graph"):
                    pending.append(sub["graph"])
    return nodes


def read_etrecord_maps(path: Union[str, os.PathLike]) -> ETRecordMaps:
    """The debug-handle maps and per-handle node info of the ETRecord at `path` (no torch needed)."""
    try:
        z = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        raise MalformedProgramError(f"{path}: not an ETRecord (not a ZIP archive: {e})") from None
    with z:
        if IDENTIFIER not in z.namelist():
            raise MalformedProgramError(f"{path}: not an ETRecord (no {IDENTIFIER} entry)")
        handles = _read_json(z, DEBUG_HANDLE_MAP, {})
        delegates = _read_json(z, DELEGATE_MAP, {})
        num_outs = _read_json(z, NUM_OUTS_MAP, {})
        maps = ETRecordMaps(
            debug_handle_map=_shaped(DEBUG_HANDLE_MAP, lambda: {
                m: {i: [int(x) for x in (h if isinstance(h, list) else [h])] for i, h in _int_keys(v).items()}
                for m, v in handles.items()}),
            delegate_map=_shaped(DELEGATE_MAP, lambda: {m: _int_keys(v) for m, v in delegates.items()}),
            instruction_id_to_num_outs_map=_shaped(NUM_OUTS_MAP, lambda: {m: _int_keys(v) for m, v in num_outs.items()}),
        )
        for name in z.namelist():
            if name.startswith(EDGE_PROGRAM_PREFIX) and not name.endswith(PROGRAM_PARTS[1:]):
                program = _read_json(z, name, {})
                maps.node_info[name[len(EDGE_PROGRAM_PREFIX):]] = _shaped(name, lambda: {
                    h: info for h, info in map(node_info_from_serialized, _graph_nodes(program)) if h is not None})
    return maps
