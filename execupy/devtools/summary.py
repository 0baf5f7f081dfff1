"""What is inside a `.pte` file, told without running it (`execupy inspect`).

`summarize` reads a program and returns a plain dict: header, version, segments,
constants, named data and, per method, its inputs/outputs, operator counts,
delegates and planned memory. It is the first thing a user runs on a broken file,
so it never raises: every section is read on its own, and what cannot be read is
listed under `problems` (the file is malformed) or `warnings` (the file is fine but
this runtime cannot run all of it, e.g. an operator without a kernel). Everything
here is torch-free.

>>> info = summarize("model.pte")
>>> print(format_summary(info))
"""
from __future__ import annotations

import os
import struct
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..errors import ExecupyError
from ..schema import program as P
from ..schema.reader import FILE_IDENTIFIER, HEADER_MAGIC

Source = Union[str, os.PathLike, bytes, bytearray, memoryview]


def summarize(source: Source, *, load_methods: bool = False) -> dict[str, Any]:
    """Describe a `.pte` (path or bytes). Never raises; see `problems` / `warnings`.

    With `load_methods=True` every method is also loaded (arenas allocated, every
    instruction bound), which finds problems the file's structure alone does not show.
    """
    info: dict[str, Any] = {"file": _name(source), "problems": [], "warnings": []}
    head = _guard(info, "reading the file", lambda: _read_head(source, info))
    if head is None:
        return info
    info["header"] = _header(head, info)
    program = _guard(info, "decoding the program", lambda: _load_program(source))
    if program is None:
        return info
    prog = program.program
    info["version"] = prog.version
    info["segments"] = _guard(info, "listing segments", lambda: _segments(program)) or []
    info["constants"] = _guard(info, "reading constants", lambda: _constants(program)) or {}
    info["mutable_data"] = _guard(info, "reading mutable data", lambda: _mutable_data(program)) or []
    info["named_data"] = _guard(info, "reading named data", lambda: _named_data(program)) or []
    methods = [_guard(info, f"reading method {plan.name!r}", lambda plan=plan: _method(program, plan, info, load_methods))
               for plan in prog.execution_plan]
    info["methods"] = [m for m in methods if m is not None]
    return info


# ---------------------------------------------------------------------------- reading


def _name(source: Source) -> str:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return "<bytes>"
    return str(source)


def _read_head(source: Source, info: dict) -> memoryview:
    """The first bytes (identifier, extended header); records the size. Program.load maps the rest."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source).cast("B")
        info["size"] = len(view)
        return view[:64]
    path = Path(source)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a .pte file")
    with open(path, "rb") as f:
        info["size"] = os.fstat(f.fileno()).st_size
        return memoryview(f.read(64))


def _load_program(source: Source):
    from ..runtime.program import Program

    if isinstance(source, (bytes, bytearray, memoryview)):
        return Program.load(bytes(source))
    return Program.load(source)


def _guard(info: dict, what: str, fn: Callable[[], Any], *, warning: bool = False) -> Any:
    """Run one section; a failure becomes a line in problems (or warnings) instead of an exception."""
    try:
        return fn()
    except ExecupyError as e:
        (info["warnings"] if warning else info["problems"]).append(f"{what}: {e}")
    except (OSError, ValueError, KeyError) as e:
        info["problems"].append(f"{what}: {type(e).__name__}: {e}")
    except Exception as e:  # a reader bug must still not hide what we know about the file
        info["problems"].append(f"{what}: unexpected {type(e).__name__}: {e} (please report: this is an execupy bug)")
    return None


def _header(head: memoryview, info: dict) -> dict[str, Any]:
    """The identifier and the raw `eh00` fields, read without trusting them."""
    size = info["size"]
    header: dict[str, Any] = {"file_identifier": bytes(head[4:8]).decode("latin-1") if len(head) >= 8 else None}
    if len(head) >= 8 and bytes(head[4:8]) != FILE_IDENTIFIER:
        header["expected_identifier"] = FILE_IDENTIFIER.decode()
    if len(head) >= 40 and bytes(head[8:12]) == HEADER_MAGIC:
        length, program_size, base, seg_size = struct.unpack_from("<IQQQ", head, 12)
        header["extended_header"] = {
            "length": length,
            "program_size": program_size,
            "segment_base_offset": base,
            "segment_data_size": seg_size if length > 24 else 0,
        }
        if base + (seg_size if length > 24 else 0) > size:
            info["problems"].append(
                f"extended header says segments end at byte {base + seg_size}, but the file has {size} bytes"
            )
    else:
        header["extended_header"] = None
    return header


def _segments(program) -> list[dict[str, Any]]:
    pte = program.pte
    out = []
    for i, seg in enumerate(program.program.segments):
        start = pte.segment_base_offset + seg.offset
        inside = seg.size == 0 or (pte.header is not None and start + seg.size <= len(pte.data))
        out.append({"index": i, "offset": seg.offset, "size": seg.size, "in_file": inside})
    return out


def _constants(program) -> dict[str, Any]:
    prog = program.program
    if prog.constant_buffer and len(prog.constant_buffer) > 1:
        sizes = [len(b) for b in prog.constant_buffer[1:]]
        return {"form": "inline constant_buffer", "entries": len(sizes), "bytes": sum(sizes)}
    seg = prog.constant_segment
    if seg is None:
        return {"form": "none", "entries": 0, "bytes": 0}
    entries = max(len(seg.offsets) - 1, 0)  # entry 0 is the reserved placeholder
    nbytes = len(program.pte.segment(seg.segment_index)) if prog.segments else 0
    return {"form": "segment", "segment_index": seg.segment_index, "entries": entries, "bytes": nbytes}


def _mutable_data(program) -> list[dict[str, Any]]:
    """Initial values of mutable buffers (one entry per SubsegmentOffsets, entry 0 reserved)."""
    out = []
    for k, seg in enumerate(program.program.mutable_data_segments or []):
        item: dict[str, Any] = {"index": k, "segment_index": seg.segment_index, "entries": max(len(seg.offsets) - 1, 0)}
        try:
            item["bytes"] = len(program.pte.segment(seg.segment_index))
        except ExecupyError as e:
            item["problem"] = str(e)
        out.append(item)
    return out


def _named_data(program) -> list[dict[str, Any]]:
    out = []
    for entry in program.program.named_data or []:
        item: dict[str, Any] = {"key": entry.key, "segment_index": entry.segment_index}
        try:
            item["bytes"] = len(program.pte.segment(entry.segment_index))
        except ExecupyError as e:
            item["problem"] = str(e)
        out.append(item)
    return out


# ---------------------------------------------------------------------------- methods


def _method(program, plan: P.ExecutionPlan, info: dict, load: bool) -> dict[str, Any]:
    name = plan.name
    m: dict[str, Any] = {"name": name, "num_values": len(plan.values)}
    instructions = plan.instructions
    m["num_instructions"] = len(instructions)
    m["inputs"] = [_value(plan, i) for i in plan.inputs]
    m["outputs"] = [_value(plan, i) for i in plan.outputs]
    m["instruction_kinds"] = dict(Counter(type(ins).__name__ for ins in instructions))
    m["operators"] = _operator_counts(plan, instructions)
    m["delegates"] = [_delegate(program, k, d) for k, d in enumerate(plan.delegates)]
    m["delegation"] = _delegation(m)
    m["planned_memory"] = [{"arena": k, "bytes": int(size)} for k, size in
                           enumerate(plan.non_const_buffer_sizes) if k > 0]
    m["constant_tensors"], m["constant_tensor_bytes"] = _constant_tensors(plan)
    for problem in _bad_references(m):
        info["problems"].append(f"method {name!r}: {problem}")
    for missing in _missing_kernels(m["operators"]):
        info["warnings"].append(f"method {name!r}: operator {missing} has no kernel in execupy")
    for backend_id in sorted({d["id"] for d in m["delegates"] if not d["available"]}):
        info["warnings"].append(f"method {name!r}: backend {backend_id!r} is not available in execupy")
    if load:
        loaded = _guard(info, f"loading method {name!r}", lambda: program.load_method(name), warning=True)
        m["loads"] = loaded is not None
    return m


def _value(plan: P.ExecutionPlan, i: int) -> dict[str, Any]:
    if not 0 <= i < len(plan.values):
        return {"kind": "invalid", "index": i}
    v = plan.values[i]
    if isinstance(v, P.Tensor):
        try:
            dtype = str(P.numpy_dtype(v.scalar_type))
        except KeyError:
            dtype = f"unknown scalar type {v.scalar_type}"
        return {"kind": "tensor", "index": i, "dtype": dtype, "shape": list(v.sizes),
                "dynamic": v.shape_dynamism != 0}
    if P.is_scalar(v):
        return {"kind": type(v).__name__.lower(), "index": i, "value": P.scalar_value(v)}
    return {"kind": type(v).__name__, "index": i}


def _operator_counts(plan: P.ExecutionPlan, instructions: list) -> dict[str, int]:
    counts: Counter = Counter()
    for ins in instructions:
        if isinstance(ins, P.KernelCall):
            ok = 0 <= ins.op_index < len(plan.operators)
            counts[plan.operators[ins.op_index].key if ok else f"<invalid operator index {ins.op_index}>"] += 1
    for op in plan.operators:  # listed but never called still shows, with 0
        counts.setdefault(op.key, 0)
    return dict(counts)


def _delegate(program, k: int, d: P.BackendDelegate) -> dict[str, Any]:
    from ..runtime.backends import get_backend

    ref = d.processed
    where = {P.DataLocation.INLINE: "inline", P.DataLocation.SEGMENT: "segment"}.get(ref.location, f"?{ref.location}")
    item: dict[str, Any] = {"index": k, "id": d.id, "location": where, "data_index": ref.index,
                            "compile_specs": [c.key for c in d.compile_specs]}
    try:
        item["payload_bytes"] = len(program.delegate_payload(ref))
    except ExecupyError as e:
        item["problem"] = str(e)
    backend = get_backend(d.id)
    item["available"] = bool(backend is not None and backend.is_available())
    if "problem" not in item:
        item.update(_delegate_contents(program, d))
    return item


def _delegate_contents(program, d: P.BackendDelegate) -> dict[str, Any]:
    """Node types, datatypes and weights inside the payload, for backends whose payload we read."""
    from .delegation import delegate_contents

    try:
        c = delegate_contents(program, d)
    except ExecupyError as e:
        return {"contents_problem": str(e)}
    if c is None:
        return {}
    return {"num_nodes": c.num_nodes, "node_types": c.node_types, "datatypes": c.datatypes,
            "weight_bytes": c.weight_bytes,
            "weights": {"named_data": {"entries": c.named_weight_entries, "bytes": c.named_weight_bytes},
                        "payload": {"entries": c.payload_weight_entries, "bytes": c.payload_weight_bytes}}}


def _delegation(m: dict) -> dict[str, Any]:
    """get_delegation_info's counts (devtools/delegation.py), from what the summary already read."""
    readable = [d for d in m["delegates"] if "num_nodes" in d]
    return {"num_delegated_subgraphs": len(m["delegates"]),
            "num_delegated_nodes": sum(d["num_nodes"] for d in readable),
            "num_non_delegated_nodes": sum(m["operators"].values()),
            "opaque_subgraphs": len(m["delegates"]) - len(readable)}


def _constant_tensors(plan: P.ExecutionPlan) -> tuple[int, int]:
    """(constant tensors, bytes they use); tensors sharing one constant entry count its bytes once."""
    count, sizes = 0, {}
    for v in plan.values:
        if isinstance(v, P.Tensor) and v.data_buffer_idx > 0 and v.allocation_info is None:
            count += 1
            try:
                n = P.numpy_dtype(v.scalar_type).itemsize
            except KeyError:
                continue
            for s in v.sizes:
                n *= s
            sizes[v.data_buffer_idx] = max(n, sizes.get(v.data_buffer_idx, 0))
    return count, sum(sizes.values())


def _bad_references(m: dict) -> list[str]:
    out = []
    for kind in ("inputs", "outputs"):
        out += [f"{kind[:-1]} refers to value {v['index']}, outside the {m['num_values']} values"
                for v in m[kind] if v["kind"] == "invalid"]
    out += [f"{n} instruction(s) use {key}" for key, n in m["operators"].items() if key.startswith("<invalid")]
    out += [f"delegate {d['index']} ({d['id']}): {d['problem']}" for d in m["delegates"] if "problem" in d]
    out += [d["contents_problem"] for d in m["delegates"] if "contents_problem" in d]
    return out


def _missing_kernels(operators: dict[str, int]) -> list[str]:
    from ..kernels.registry import get_kernel

    return [key for key in operators if not key.startswith("<") and get_kernel(key) is None]


# ---------------------------------------------------------------------------- text


def format_summary(info: dict[str, Any]) -> str:
    """The summary as text for a terminal."""
    lines = [f"file: {info.get('file')}  ({_bytes(info['size']) if 'size' in info else 'unreadable'})"]
    header = info.get("header") or {}
    if header:
        lines.append(f"identifier: {header.get('file_identifier')!r}"
                     + (f" (expected {header['expected_identifier']!r})" if "expected_identifier" in header else ""))
        eh = header.get("extended_header")
        lines.append("extended header: " + (", ".join(f"{k}={v}" for k, v in eh.items()) if eh else "none"))
    if "version" in info:
        lines.append(f"schema version: {info['version']}")
    lines += _format_data(info)
    for m in info.get("methods", []):
        lines += _format_method(m)
    for title, key in (("problems", "problems"), ("warnings", "warnings")):
        if info.get(key):
            lines.append(f"{title}:")
            lines += [f"  - {p}" for p in info[key]]
    if not info.get("problems"):
        lines.append("no problems found" + (" (see warnings)" if info.get("warnings") else ""))
    return "\n".join(lines)


def _format_data(info: dict) -> list[str]:
    lines = []
    segs = info.get("segments")
    if segs is not None:
        lines.append(f"segments: {len(segs)}")
        for s in segs:
            flag = "" if s["in_file"] else "  OUTSIDE THE FILE"
            lines.append(f"  [{s['index']}] offset {s['offset']}, {_bytes(s['size'])}{flag}")
    c = info.get("constants")
    if c:
        lines.append(f"constants: {c['entries']} entries, {_bytes(c['bytes'])} ({c['form']})")
    for md in info.get("mutable_data", []):
        size = _bytes(md["bytes"]) if "bytes" in md else md.get("problem")
        lines.append(f"mutable buffer initial values: {md['entries']} entries in segment {md['segment_index']}, {size}")
    for n in info.get("named_data", []):
        size = _bytes(n["bytes"]) if "bytes" in n else n.get("problem")
        lines.append(f"named data {n['key']!r}: segment {n['segment_index']}, {size}")
    return lines


def _format_method(m: dict) -> list[str]:
    lines = [f"method {m['name']!r}: {m['num_instructions']} instructions, {m['num_values']} values"
             + ("" if "loads" not in m else ("; loads" if m["loads"] else "; does NOT load"))]
    for kind in ("inputs", "outputs"):
        lines.append(f"  {kind}:" + ("" if m[kind] else " none"))
        lines += [f"    {k}: {_format_value(v)}" for k, v in enumerate(m[kind])]
    if m["instruction_kinds"]:
        lines.append("  instructions: " + ", ".join(f"{k} {n}" for k, n in sorted(m["instruction_kinds"].items())))
    if m["operators"]:
        lines.append("  operators:")
        lines += [f"    {n:5d}  {key}" for key, n in sorted(m["operators"].items(), key=lambda kv: (-kv[1], kv[0]))]
    if m["delegates"]:
        dg = m["delegation"]
        lines.append(f"  delegation: {dg['num_delegated_subgraphs']} delegated subgraph(s) holding "
                     f"{dg['num_delegated_nodes']} node(s); {dg['num_non_delegated_nodes']} kernel call(s) outside"
                     + (f"; {dg['opaque_subgraphs']} subgraph(s) not readable here" if dg["opaque_subgraphs"] else ""))
    for d in m["delegates"]:
        size = _bytes(d["payload_bytes"]) if "payload_bytes" in d else d.get("problem")
        lines.append(f"  delegate {d['index']}: {d['id']} ({d['location']} {d['data_index']}, {size})"
                     + ("" if d["available"] else "  [backend not available]"))
        lines += _format_delegate_contents(d)
    planned = ", ".join(f"arena {a['arena']}: {_bytes(a['bytes'])}" for a in m["planned_memory"]) or "none"
    lines.append(f"  planned memory: {planned}")
    lines.append(f"  constant tensors: {m['constant_tensors']} ({_bytes(m['constant_tensor_bytes'])})")
    return lines


def _format_delegate_contents(d: dict) -> list[str]:
    if "node_types" not in d:
        return []
    nodes = ", ".join(f"{k} {n}" for k, n in sorted(d["node_types"].items(), key=lambda kv: (-kv[1], kv[0])))
    types = ", ".join(f"{k} {n}" for k, n in sorted(d["datatypes"].items()))
    w = d["weights"]
    where = [f"{label}: {w[k]['entries']} constants, {_bytes(w[k]['bytes'])}"
             for k, label in (("named_data", "named data"), ("payload", "in the payload")) if w[k]["entries"]]
    return [f"    nodes ({d['num_nodes']}): {nodes or 'none'}",
            f"    value datatypes: {types or 'none'}",
            f"    weights: {_bytes(d['weight_bytes'])}" + (f" ({', '.join(where)})" if where else "")]


def _format_value(v: dict) -> str:
    if v["kind"] == "tensor":
        return f"tensor {v['dtype']} {v['shape']} {'dynamic (upper bound)' if v['dynamic'] else 'static'}"
    if "value" in v:
        return f"{v['kind']} = {v['value']!r}"
    return f"{v['kind']} (value {v['index']})"


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
