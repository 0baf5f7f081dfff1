"""Read an XNNPACK delegate payload (header + XNNGraph flatbuffer) into dataclasses.

Layout facts are in shared/design/pte-format.md §5. The flatbuffer is read with the
bounds-checked cursor of `execupy.schema.reader`, so a hostile payload raises
MalformedProgramError, never IndexError or struct.error.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Optional

from ...errors import MalformedProgramError
from ...schema.reader import _Fb, _Table

HEADER_MAGIC = b"XH00"
# The exporter writes "XN01"; the runtime-side schema copy in the package declares "XN00".
GRAPH_IDENTIFIERS = (b"XN01", b"XN00")
NAMED_DATA_OFFSET = 0xFFFFFFFFFFFFFFFF
NO_EXTERNAL_ID = 0xFFFFFFFF
NO_VALUE = 0xFFFFFFFF  # a node's optional value id (a bias, say) that is absent

# XNNDatatype
DATATYPES = {
    0: "invalid", 1: "fp32", 2: "fp16", 3: "qint8", 4: "quint8", 5: "qint32", 6: "qcint8",
    7: "qcint32", 8: "qcint4", 9: "qdint8", 10: "qbint4", 11: "qpint8", 12: "int32",
    13: "pfp32", 14: "bf16",
}

# value flags
EXTERNAL_INPUT = 1
EXTERNAL_OUTPUT = 2


@dataclass
class Quant:
    """Quantization parameters of a quantized value; `kind` is the XNNQuantParams member."""

    kind: str  # "per_tensor" | "per_channel" | "per_token" | "per_channel_group"
    scale: list[float] = field(default_factory=list)  # one entry for per_tensor
    zero_point: int = 0
    channel_dim: int = 0
    group_size: int = 0
    scale_buffer_idx: int = 0  # > 0: the scales are a constant (fp32, or bf16 for groups)
    num_scales: int = 0
    num_nonbatch_dims: int = 0


@dataclass
class Value:
    datatype: str
    dims: list[int]
    constant_buffer_idx: int
    external_id: int
    flags: int
    id_out: int
    quant: Optional[Quant] = None


@dataclass
class Node:
    kind: str
    fields: dict  # the member's fields by name (ints, floats, lists of ints)
    output_min: float = float("-inf")
    output_max: float = float("inf")
    debug_handle: int = 0


@dataclass
class ConstantRef:
    offset: int
    size: int
    named_key: str


@dataclass
class Graph:
    version: str
    nodes: list[Node]
    values: list[Value]
    num_externs: int
    input_ids: list[int]
    output_ids: list[int]
    constant_data: list[ConstantRef]
    constant_bytes: memoryview  # the payload's own constant region


# ---------------------------------------------------------------- node layouts

_N1 = ["input_id", "output_id", "flags"]
_N2 = ["input1_id", "input2_id", "output_id", "flags"]
_CONV = ["padding_top", "padding_right", "padding_bottom", "padding_left", "kernel_height", "kernel_width",
         "subsampling_height", "subsampling_width", "dilation_height", "dilation_width",
         "group_input_channels", "group_output_channels", "groups", "adjustment_height",
         "adjustment_width", "input1_id", "filter_id", "bias_id", "output_id", "flags"]
_POOL = ["padding_top", "padding_right", "padding_bottom", "padding_left", "pooling_height", "pooling_width",
         "stride_height", "stride_width", "dilation_height", "dilation_width", "input_id", "output_id", "flags"]
_CAT = ["axis", "input1_id", "input2_id", "input3_id", "input4_id", "output_id", "flags", "input5_id"]

# Field names in id order; a name ending in "[]" is a vector of uint, one ending in ":f" a float.
NODE_LAYOUTS: dict[int, tuple[str, list[str]]] = {
    1: ("Add", _N2),
    2: ("FullyConnected", ["input1_id", "filter_id", "bias_id", "output_id", "flags"]),
    3: ("Softmax", _N1),
    4: ("Sigmoid", _N1),
    5: ("StaticTranspose", ["num_dims", "perm[]", "input_id", "output_id", "flags"]),
    6: ("Clamp", _N1),
    7: ("Conv2d", _CONV),
    8: ("Div", _N2),
    9: ("StaticResizeBilinear2D", ["new_height", "new_width", "input_id", "output_id", "flags"]),
    10: ("StaticConstantPad", ["pre_paddings[]", "post_paddings[]", "padding_value:f", "input_id",
                               "output_id", "flags"]),
    11: ("AvgPooling2d", _POOL),
    12: ("Minimum", _N2),
    13: ("DepthwiseConv2d", _CONV),
    14: ("MaxPooling2d", _POOL),
    15: ("Multiply", _N2),
    16: ("Subtract", _N2),
    17: ("Floor", _N1),
    18: ("Convert", _N1),
    19: ("GlobalAvgPooling2d", _N1),
    20: ("StaticReshape", ["num_dims", "new_shape[]", "input_id", "output_id", "flags"]),
    21: ("ArgMaxPooling2d", ["padding_top", "padding_right", "padding_bottom", "padding_left",
                             "pooling_height", "pooling_width", "input_id", "output_value_id",
                             "output_index_id", "flags"]),
    22: ("SquareRoot", _N1),
    23: ("Ceiling", _N1),
    24: ("Hardswish", _N1),
    25: ("LeakyReLU", ["negative_slope:f", "input_id", "output_id", "flags"]),
    26: ("Maximum", _N2),
    27: ("Negate", _N1),
    28: ("Square", _N1),
    29: ("ELU", ["alpha:f", "input_id", "output_id", "flags"]),
    30: ("Abs", _N1),
    31: ("PReLU", _N2),
    32: ("Concatenate2", _CAT),
    33: ("Concatenate3", _CAT),
    34: ("Concatenate4", _CAT),
    35: ("StaticSlice", ["num_dims", "offsets[]", "sizes[]", "input_id", "output_id", "flags"]),
    36: ("ScaledDotProductAttention", ["query_id", "key_id", "value_id", "scale_id", "mask_id",
                                       "output_id", "flags"]),
    37: ("BatchMatrixMultiply", _N2),
    38: ("Concatenate5", _CAT),
    39: ("ConvTranspose2d", _CONV),
    40: ("ReciprocalSquareRoot", _N1),
    41: ("Log", _N1),
    42: ("Gelu", _N1),
    43: ("Tanh", _N1),
    44: ("Exp", _N1),
    45: ("Sin", _N1),
    46: ("Copy", _N1),
    47: ("Cos", _N1),
}


# ---------------------------------------------------------------- decoding


def read_payload(payload: memoryview) -> Graph:
    """Decode a whole delegate payload: header, flatbuffer, constant region."""
    view = memoryview(payload).cast("B") if memoryview(payload).format != "B" else memoryview(payload)
    if len(view) < 30:
        raise MalformedProgramError(f"XNNPACK payload is {len(view)} bytes, shorter than its 30-byte header")
    if bytes(view[4:8]) != HEADER_MAGIC:
        raise MalformedProgramError(f"XNNPACK payload magic is {bytes(view[4:8])!r}, expected {HEADER_MAGIC!r}")
    header_len, fb_off, fb_size, const_off, const_size = struct.unpack_from("<HIIIQ", view, 8)
    if header_len < 30 or fb_off < header_len or fb_off + fb_size > len(view):
        raise MalformedProgramError(
            f"XNNPACK header is inconsistent: header length {header_len}, flatbuffer at {fb_off} "
            f"(+{fb_size}) in a {len(view)}-byte payload")
    if const_off + const_size > len(view) or (const_size and const_off < fb_off + fb_size):
        raise MalformedProgramError(
            f"XNNPACK constant data at {const_off} (+{const_size}) lies outside the payload ({len(view)} bytes)")
    graph_bytes = view[fb_off:fb_off + fb_size]
    if fb_size < 8 or bytes(graph_bytes[4:8]) not in GRAPH_IDENTIFIERS:
        ident = bytes(graph_bytes[4:8]) if fb_size >= 8 else b""
        raise MalformedProgramError(f"XNNGraph identifier is {ident!r}, expected one of {GRAPH_IDENTIFIERS}")
    return _graph(_Fb(graph_bytes, fb_size), view[const_off:const_off + const_size])


def _graph(fb: _Fb, constant_bytes: memoryview) -> Graph:
    t = fb.table(fb.root())
    return Graph(
        version=t.string(0),
        nodes=t.tables(1, _node),
        values=t.tables(2, _value),
        num_externs=t.scalar(3, "I"),
        input_ids=t.scalars(4, "I"),
        output_ids=t.scalars(5, "I"),
        constant_data=t.tables(8, lambda c: ConstantRef(c.scalar(0, "Q"), c.scalar(1, "Q"), c.string(2))),
        constant_bytes=constant_bytes,
    )


def _union_member(t: _Table, what: str) -> tuple[int, _Table]:
    tag = t.scalar(0, "B")
    member = t.table(1)
    if member is None:
        raise MalformedProgramError(f"{what} with tag {tag} has no member table")
    return tag, member


def _node(t: _Table) -> Node:
    tag, member = _union_member(t, "XNode")
    layout = NODE_LAYOUTS.get(tag)
    if layout is None:
        raise MalformedProgramError(f"XNode has unknown node type tag {tag}")
    kind, names = layout
    fields: dict = {}
    for fid, name in enumerate(names):
        if name.endswith("[]"):
            fields[name[:-2]] = member.scalars(fid, "I")
        elif name.endswith(":f"):
            fields[name[:-2]] = member.scalar(fid, "f", 0.0)
        else:
            fields[name] = member.scalar(fid, "I")
    node = Node(kind, fields, debug_handle=t.scalar(2, "I"))
    bounds = t.table(3)
    if bounds is not None:
        node.output_min = bounds.scalar(0, "f", 0.0)
        node.output_max = bounds.scalar(1, "f", 0.0)
    return node


def _tensor_value(t: _Table) -> Value:
    code = t.scalar(0, "h")
    if code not in DATATYPES:
        raise MalformedProgramError(f"XNNTensorValue has unknown datatype {code}")
    return Value(
        datatype=DATATYPES[code],
        dims=t.scalars(2, "I"),
        constant_buffer_idx=t.scalar(3, "I"),
        external_id=t.scalar(4, "I"),
        flags=t.scalar(5, "I"),
        id_out=t.scalar(6, "I"),
    )


_QUANT_DECODERS = {
    1: lambda q: Quant("per_channel", scale=q.scalars(0, "f"), channel_dim=q.scalar(1, "i"),
                       scale_buffer_idx=q.scalar(2, "I"), num_scales=q.scalar(3, "I")),
    2: lambda q: Quant("per_tensor", scale=[q.scalar(0, "f", 0.0)], zero_point=q.scalar(1, "i")),
    3: lambda q: Quant("per_token", num_nonbatch_dims=q.scalar(0, "i")),
    4: lambda q: Quant("per_channel_group", scale=q.scalars(0, "f"), channel_dim=q.scalar(1, "i"),
                       group_size=q.scalar(2, "i"), scale_buffer_idx=q.scalar(4, "I"),
                       num_scales=q.scalar(5, "I")),
}


def _value(t: _Table) -> Value:
    tag, member = _union_member(t, "XValue")
    if tag == 1:
        return _tensor_value(member)
    if tag != 2:
        raise MalformedProgramError(f"XValue has unknown value type tag {tag}")
    tensor = member.table(0)
    if tensor is None:
        raise MalformedProgramError("XNNQuantizedTensorValue has no tensor_value")
    value = _tensor_value(tensor)
    qtag = member.scalar(1, "B")
    decode = _QUANT_DECODERS.get(qtag)
    params = member.table(2)
    if decode is None or params is None:
        raise MalformedProgramError(f"XNNQuantizedTensorValue has unknown or missing quant params (tag {qtag})")
    value.quant = decode(params)
    return value
