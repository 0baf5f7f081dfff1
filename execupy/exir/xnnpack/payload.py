"""Write an XNNPACK delegate payload: the 32-byte header, then the XNNGraph flatbuffer.

The layout is the one ExecuTorch 1.5.1 writes (shared/design/pte-format.md §5): magic
"XH00" at offset 4, flatbuffer identifier "XN01", every constant in the program's named
data under the lowercase hex SHA-256 of its bytes (the payload's own constant region is
empty). Field ids and node layouts come from the runtime's reader
(execupy/backends/xnnpack/schema.py), so the two cannot drift apart.
"""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from typing import Optional

import flatbuffers
import numpy as np

from ...backends.xnnpack.schema import (DATATYPES, GRAPH_IDENTIFIERS, HEADER_MAGIC, NAMED_DATA_OFFSET, NO_EXTERNAL_ID,
                                        NODE_LAYOUTS)
from ...schema.writer import _Writer, align_up

DATATYPE_CODES = {name: code for code, name in DATATYPES.items()}
NODE_TAGS = {kind: (tag, names) for tag, (kind, names) in NODE_LAYOUTS.items()}
IDENTIFIER = GRAPH_IDENTIFIERS[0]  # "XN01", what ExecuTorch's exporter writes
HEADER_LENGTH = 30
FLATBUFFER_OFFSET = 32
NO_DEBUG_HANDLE = 65535


@dataclass
class XValue:
    datatype: str
    dims: list[int]
    constant_buffer_idx: int = 0
    external_id: int = NO_EXTERNAL_ID
    flags: int = 0
    # Quantization parameters: (XNNQuantParams tag, fields as (id, kind, value)).
    quant: Optional[tuple[int, list]] = None


@dataclass
class XNode:
    kind: str
    fields: dict
    output_min: float = -math.inf
    output_max: float = math.inf
    debug_handle: int = NO_DEBUG_HANDLE


@dataclass
class XGraph:
    values: list[XValue] = field(default_factory=list)
    nodes: list[XNode] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    num_externs: int = 0
    constant_keys: list[str] = field(default_factory=list)  # constant_data[1:], entry 0 is reserved
    named_data: dict[str, bytes] = field(default_factory=dict)

    def add_value(self, value: XValue) -> int:
        self.values.append(value)
        return len(self.values) - 1

    def add_constant(self, data: np.ndarray, prefix: str = "") -> int:
        """Store `data` in named data (once per distinct blob) under `prefix` + its SHA-256;
        returns its constant_buffer_idx."""
        blob = np.ascontiguousarray(data).tobytes()
        key = prefix + hashlib.sha256(blob).hexdigest()
        self.named_data.setdefault(key, blob)
        self.constant_keys.append(key)
        return len(self.constant_keys)


def serialize(graph: XGraph) -> bytes:
    fb = _flatbuffer(graph)
    header = struct.pack("<4s4sHIIIQ", b"\0" * 4, HEADER_MAGIC, HEADER_LENGTH, FLATBUFFER_OFFSET, len(fb),
                         FLATBUFFER_OFFSET + align_up(len(fb), 16), 0)
    padded = fb + b"\0" * (align_up(len(fb), 16) - len(fb))
    return header + b"\0" * (FLATBUFFER_OFFSET - len(header)) + padded


def _flatbuffer(graph: XGraph) -> bytes:
    b = flatbuffers.Builder(1024)
    w = _Writer(b, 16, 16)
    nodes = w.tables(graph.nodes, lambda n: _node(w, n))
    values = w.tables(list(enumerate(graph.values)), lambda iv: _value(w, *iv))
    inputs = w.scalars(graph.input_ids, "<u4")
    outputs = w.scalars(graph.output_ids, "<u4")
    entries = [_constant_entry(w, None)] + [_constant_entry(w, key) for key in graph.constant_keys]
    constant_data = w.tables(entries, lambda off: off)
    version = b.CreateString("0")
    root = w.table([(0, "off", version), (1, "off", nodes), (2, "off", values), (3, "Uint32", graph.num_externs),
                    (4, "off", inputs), (5, "off", outputs), (8, "off", constant_data)])
    b.Finish(root, file_identifier=IDENTIFIER)
    return bytes(b.Output())


def _constant_entry(w: _Writer, key: Optional[str]) -> int:
    if key is None:  # entry 0: the reserved dummy
        return w.table([])
    name = w.b.CreateString(key)
    return w.table([(0, "Uint64", NAMED_DATA_OFFSET), (2, "off", name)])


def _tensor_value(w: _Writer, i: int, v: XValue) -> int:
    dims = w.scalars(v.dims, "<u4")
    return w.table([(0, "Int16", DATATYPE_CODES[v.datatype]), (1, "Uint32", len(v.dims)), (2, "off", dims),
                    (3, "Uint32", v.constant_buffer_idx), (4, "Uint32", v.external_id), (5, "Uint32", v.flags),
                    (6, "Uint32", i)])


def _value(w: _Writer, i: int, v: XValue) -> int:
    tensor = _tensor_value(w, i, v)
    if v.quant is None:
        return w.table([(0, "Uint8", 1), (1, "off", tensor)])
    tag, fields = v.quant
    params = _quant_params(w, fields)
    quantized = w.table([(0, "off", tensor), (1, "Uint8", tag), (2, "off", params)])
    return w.table([(0, "Uint8", 2), (1, "off", quantized)])


def _quant_params(w: _Writer, fields: list) -> int:
    """Fields as (id, kind, value); kind "floats" is a [float] vector built first."""
    built = [(fid, "off", w.scalars(value, "<f4")) if kind == "floats" else (fid, kind, value)
             for fid, kind, value in fields]
    return w.table(built)


def _node(w: _Writer, node: XNode) -> int:
    tag, names = NODE_TAGS[node.kind]
    vectors = {name: w.scalars(node.fields.get(name[:-2], []), "<u4") for name in names if name.endswith("[]")}
    fields = []
    for fid, name in enumerate(names):
        if name.endswith("[]"):
            fields.append((fid, "off", vectors[name]))
        elif name.endswith(":f"):
            fields.append((fid, "Float32", float(node.fields.get(name[:-2], 0.0))))
        else:
            fields.append((fid, "Uint32", int(node.fields.get(name, 0))))
    member = w.table(fields)
    bounds = None
    if node.output_min != -math.inf or node.output_max != math.inf:
        bounds = w.table([(0, "Float32", node.output_min), (1, "Float32", node.output_max)])
    return w.table([(0, "Uint8", tag), (1, "off", member), (2, "Uint32", node.debug_handle), (3, "off", bounds)])
