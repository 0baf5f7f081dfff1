"""Write Program dataclasses to a `.pte` file (docs/format.md §2-§10).

The flatbuffer is built with the `flatbuffers` package's Builder, one small function
per table, mirroring schema/reader.py. Builders work back to front, so every function
first creates its children (strings, vectors, sub-tables) and then the table itself.

Conventions follow the reference writer so that ExecuTorch's runtime reads our files
the same way it reads its own:
* scalars equal to their schema default are omitted (readers apply defaults);
* list fields are always written, empty or not; `None` fields are left out;
* `Operator.overload` is always written (the default overload is the empty string);
* byte vectors of constants and inline delegate data are `force_align`ed;
* segment data follows the flatbuffer, announced by the `eh00` extended header.

`flatbuffers` is an export-time dependency: this module is imported on demand and is
not part of `import execupy.schema`, which stays numpy-only.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import Callable, Optional, Sequence, Union

import flatbuffers
import numpy as np

from . import program as P
from .reader import FILE_IDENTIFIER, HEADER_MAGIC

BytesLike = Union[bytes, bytearray, memoryview]
Segment = Union[BytesLike, list]  # a segment's bytes, or the pieces they are made of, in order

# The extended header the reference writes: magic, length, program_size,
# segment_base_offset, segment_data_size (docs/format.md §4).
_HEADER_LENGTH = 32


def align_up(x: int, alignment: int) -> int:
    return (x + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------------------- public API


def write_pte(program: P.Program, segment_data: Sequence[Segment], **alignments: int) -> bytes:
    """Serialize `program` and its segments into the bytes of a `.pte` file.

    `segment_data[i]` holds the bytes of `program.segments[i]` (one bytes-like, or a list of
    them laid end to end); the offsets and sizes in `program.segments` are recomputed from it
    (docs/format.md §5), the input is not modified. `alignments` are write_pte_pieces'.
    """
    return b"".join(write_pte_pieces(program, segment_data, **alignments))


def write_pte_pieces(
    program: P.Program,
    segment_data: Sequence[Segment],
    *,
    segment_alignment: int = 128,
    constant_tensor_alignment: int = 16,
    delegate_alignment: int = 16,
) -> list[BytesLike]:
    """write_pte's file as the list of pieces it is made of, in order, without joining them:
    a file of weights is written from the weights' own memory, never copied whole.

    `constant_tensor_alignment` / `delegate_alignment` are the `force_align` of the
    inline constant buffers / inline delegate payloads (16 in the reference schema)."""
    segments, blob = _layout(segment_data, segment_alignment)
    program = dataclasses.replace(program, segments=segments)
    fb = _serialize(program, constant_tensor_alignment, delegate_alignment)
    if not blob:
        return [fb]  # no segment bytes: no extended header (docs/format.md §4)
    max_align = max(16, constant_tensor_alignment, delegate_alignment)
    return _splice_header(fb, blob, max_align, segment_alignment)


def layout_segments(
    segment_data: Sequence[Segment], segment_alignment: int = 128
) -> tuple[list[P.DataSegment], bytes]:
    """Place segments one after the other, each at align_up(end, segment_alignment).

    Returns the DataSegment list (offsets relative to the segment base) and the bytes
    from the segment base to the end of the last segment (gaps zero-filled).
    """
    segments, pieces = _layout(segment_data, segment_alignment)
    return segments, b"".join(pieces)


def _layout(segment_data: Sequence[Segment], segment_alignment: int) -> tuple[list[P.DataSegment], list[BytesLike]]:
    segments, pieces, end = [], [], 0
    for data in segment_data:
        parts = data if isinstance(data, list) else [data]
        size = sum(memoryview(part).nbytes for part in parts)
        start = align_up(end, segment_alignment)
        pieces += [bytes(start - end), *parts]
        segments.append(P.DataSegment(offset=start, size=size))
        end = start + size
    return segments, [piece for piece in pieces if memoryview(piece).nbytes]


def pack_constants(blobs: Sequence[BytesLike], alignment: int = 16) -> tuple[bytes, list[int]]:
    """The constant segment (docs/format.md §6): `blobs[i]` is the data of `data_buffer_idx = i + 1`.

    Entries are concatenated with zero padding *between* them so that each starts at a
    multiple of `alignment` (none after the last). Returns the segment bytes and the
    `SubsegmentOffsets.offsets` list, whose entry 0 is the reserved placeholder (0).
    """
    pieces, offsets = pack_pieces(blobs, alignment)
    return b"".join(pieces), offsets


def pack_mutable_data(blobs: Sequence[BytesLike]) -> tuple[bytes, list[int]]:
    """The mutable-data segment (docs/format.md §7): like pack_constants but with no padding at all."""
    pieces, offsets = pack_pieces(blobs, 1)
    return b"".join(pieces), offsets


def pack_pieces(blobs: Sequence[BytesLike], alignment: int) -> tuple[list[BytesLike], list[int]]:
    """pack_constants (or, with alignment 1, pack_mutable_data) as a list of pieces: the blobs
    themselves and the padding between them, for write_pte_pieces."""
    pieces: list[BytesLike] = []
    offsets = [0]  # entry 0: the reserved empty placeholder
    end = 0
    for data in blobs:
        # Padding goes before an entry, i.e. only between entries.
        start = align_up(end, alignment)
        if start > end:
            pieces.append(bytes(start - end))
        offsets.append(start)
        pieces.append(data)
        end = start + memoryview(data).nbytes
    return pieces, offsets


# ---------------------------------------------------------------------------- file layout


def _splice_header(fb: bytes, blob: list[BytesLike], max_align: int, segment_alignment: int) -> list[BytesLike]:
    """Insert the eh00 header after the flatbuffer preamble and append the segments (docs/format.md §4)."""
    hdr_len = align_up(_HEADER_LENGTH, max_align)
    program_size = len(fb) + hdr_len
    base = align_up(program_size, segment_alignment)
    (root,) = struct.unpack_from("<I", fb, 0)
    blob_size = sum(memoryview(piece).nbytes for piece in blob)
    header = HEADER_MAGIC + struct.pack("<IQQQ", _HEADER_LENGTH, program_size, base, blob_size)
    return [
        struct.pack("<I", root + hdr_len) + fb[4:8] + header.ljust(hdr_len, b"\0") + fb[8:]
        + bytes(base - program_size),
        *blob,
    ]


def _serialize(program: P.Program, constant_alignment: int, delegate_alignment: int) -> bytes:
    w = _Writer(flatbuffers.Builder(1024), constant_alignment, delegate_alignment)
    root = w.program(program)
    w.b.Finish(root, file_identifier=FILE_IDENTIFIER)
    return bytes(w.b.Output())


# ---------------------------------------------------------------------------- tables


class _Writer:
    """One method per table; each returns the offset of the table it built."""

    def __init__(self, builder: flatbuffers.Builder, constant_alignment: int, delegate_alignment: int):
        self.b = builder
        self.constant_alignment = constant_alignment
        self.delegate_alignment = delegate_alignment

    # -- primitives

    def string(self, s: Optional[str]) -> Optional[int]:
        return None if s is None else self.b.CreateString(s)

    def scalars(self, items: Sequence, dtype: str) -> int:
        return self.b.CreateNumpyVector(np.asarray(items, dtype=dtype).reshape(-1))

    def bytes_vector(self, data: BytesLike, alignment: int = 1) -> int:
        """A [ubyte] vector whose first byte is at a multiple of `alignment` (force_align)."""
        data = memoryview(data).cast("B")
        b = self.b
        b.StartVector(1, len(data), alignment)
        b.head -= len(data)
        b.Bytes[b.head : b.head + len(data)] = data
        return b.EndVector()

    def tables(self, items: Sequence, build: Callable[[object], int]) -> int:
        offsets = [build(item) for item in items]
        b = self.b
        b.StartVector(4, len(offsets), 4)
        for off in reversed(offsets):
            b.PrependUOffsetTRelative(off)
        return b.EndVector()

    def strings(self, items: Sequence[str]) -> int:
        return self.tables(items, self.b.CreateString)

    def table(self, fields: list[tuple[int, str, object]]) -> int:
        """End a table from (field id, kind, value) triples; kind 'off' = reference field.

        Scalar kinds are Builder slot names ('Int32', 'Uint8', ...); a scalar equal to
        its default (0) is omitted like the reference writer does; None is omitted too.
        """
        b = self.b
        b.StartObject(max((fid for fid, _, _ in fields), default=-1) + 1)
        for fid, kind, value in fields:
            if value is None:
                continue
            if kind == "off":
                b.PrependUOffsetTRelativeSlot(fid, value, 0)
            elif kind in ("Float64", "Float32"):
                # Keep -0.0 and NaN, which compare equal / unequal to the default oddly.
                default = None if (value != 0.0 or math.copysign(1.0, value) < 0) else 0.0
                getattr(b, f"Prepend{kind}Slot")(fid, float(value), default)
            else:
                getattr(b, f"Prepend{kind}Slot")(fid, int(value), 0)
        return b.EndObject()

    # -- values

    def allocation(self, a: P.AllocationDetails) -> int:
        return self.table([
            (0, "Uint32", a.memory_id),
            (1, "Uint32", a.memory_offset_low),
            (2, "Uint32", a.memory_offset_high),
        ])

    def extra_info(self, e: P.ExtraTensorInfo) -> int:
        name = self.string(e.fully_qualified_name)
        return self.table([
            (0, "Uint64", e.mutable_data_segments_idx),
            (1, "off", name),
            (2, "Int8", e.location),
            (3, "Int8", e.device_type),
            (4, "Int8", e.device_index),
        ])

    def tensor(self, t: P.Tensor) -> int:
        sizes = self.scalars(t.sizes, "<i4")
        dim_order = self.scalars(t.dim_order, "u1")
        alloc = self.allocation(t.allocation_info) if t.allocation_info is not None else None
        extra = self.extra_info(t.extra_tensor_info) if t.extra_tensor_info is not None else None
        return self.table([
            (0, "Int8", t.scalar_type),
            (1, "Int32", t.storage_offset),
            (2, "off", sizes),
            (3, "off", dim_order),
            (4, "Bool", t.requires_grad),
            (5, "Uint32", t.data_buffer_idx),
            (6, "off", alloc),
            (7, "Int8", t.layout),
            (8, "Int8", t.shape_dynamism),
            (9, "off", extra),
        ])

    def value_member(self, v: P.EValue) -> int:
        if isinstance(v, P.Null):
            return self.table([])
        if isinstance(v, P.Int):
            return self.table([(0, "Int64", v.int_val)])
        if isinstance(v, P.Bool):
            return self.table([(0, "Bool", v.bool_val)])
        if isinstance(v, P.Double):
            return self.table([(0, "Float64", float(v.double_val))])
        if isinstance(v, P.Tensor):
            return self.tensor(v)
        if isinstance(v, P.String):
            return self.table([(0, "off", self.b.CreateString(v.string_val))])
        item_dtype = {
            P.IntList: "<i8", P.DoubleList: "<f8", P.BoolList: "u1", P.TensorList: "<i4",
            P.OptionalTensorList: "<i4",
        }.get(type(v))
        if item_dtype is None:
            raise TypeError(f"not an EValue: {type(v).__name__}")
        return self.table([(0, "off", self.scalars(v.items, item_dtype))])

    def evalue(self, v: P.EValue) -> int:
        member = self.value_member(v)
        return self.table([(0, "Uint8", P.EVALUE_TAGS[type(v)]), (1, "off", member)])

    # -- instructions

    def instruction_member(self, i: P.Instruction) -> int:
        if isinstance(i, P.KernelCall):
            args = self.scalars(i.args, "<i4")
            return self.table([(0, "Int32", i.op_index), (1, "off", args)])
        if isinstance(i, P.DelegateCall):
            args = self.scalars(i.args, "<i4")
            return self.table([(0, "Int32", i.delegate_index), (1, "off", args)])
        if isinstance(i, P.MoveCall):
            return self.table([(0, "Int32", i.move_from), (1, "Int32", i.move_to)])
        if isinstance(i, P.JumpFalseCall):
            return self.table([(0, "Int32", i.cond_value_index), (1, "Int32", i.destination_instruction)])
        if isinstance(i, P.FreeCall):
            return self.table([(0, "Int32", i.value_index)])
        raise TypeError(f"not an Instruction: {type(i).__name__}")

    def instruction(self, i: P.Instruction) -> int:
        member = self.instruction_member(i)
        return self.table([(0, "Uint8", P.INSTRUCTION_TAGS[type(i)]), (1, "off", member)])

    def frame(self, f: P.Frame) -> int:
        filename, name, context = self.string(f.filename), self.string(f.name), self.string(f.context)
        return self.table([(0, "off", filename), (1, "Int32", f.lineno), (2, "off", name), (3, "off", context)])

    def frame_list(self, fl: P.FrameList) -> int:
        return self.table([(0, "off", self.tables(fl.items, self.frame))])

    def chain(self, c: P.Chain) -> int:
        inputs = self.scalars(c.inputs, "<i4")
        outputs = self.scalars(c.outputs, "<i4")
        instructions = self.tables(c.instructions, self.instruction)
        stacktrace = self.tables(c.stacktrace, self.frame_list) if c.stacktrace is not None else None
        return self.table([(0, "off", inputs), (1, "off", outputs), (2, "off", instructions), (3, "off", stacktrace)])

    # -- plan

    def operator(self, o: P.Operator) -> int:
        # The overload is always written, even when empty (the reference does the same).
        name, overload = self.b.CreateString(o.name), self.b.CreateString(o.overload)
        return self.table([(0, "off", name), (1, "off", overload)])

    def compile_spec(self, c: P.CompileSpec) -> int:
        key, value = self.b.CreateString(c.key), self.bytes_vector(c.value)
        return self.table([(0, "off", key), (1, "off", value)])

    def delegate(self, d: P.BackendDelegate) -> int:
        name = self.b.CreateString(d.id)
        processed = self.table([(0, "Int8", d.processed.location), (1, "Uint32", d.processed.index)])
        specs = self.tables(d.compile_specs, self.compile_spec)
        return self.table([(0, "off", name), (1, "off", processed), (2, "off", specs)])

    def container_meta(self, m: P.ContainerMetadata) -> int:
        inp, out = self.b.CreateString(m.encoded_inp_str), self.b.CreateString(m.encoded_out_str)
        return self.table([(0, "off", inp), (1, "off", out)])

    def buffer_device(self, d: P.NonConstBufferDevice) -> int:
        return self.table([(0, "Int32", d.buffer_idx), (1, "Int8", d.device_type), (2, "Int8", d.device_index)])

    def plan(self, p: P.ExecutionPlan) -> int:
        name = self.b.CreateString(p.name)
        meta = self.container_meta(p.container_meta_type)
        values = self.tables(p.values, self.evalue)
        inputs = self.scalars(p.inputs, "<i4")
        outputs = self.scalars(p.outputs, "<i4")
        chains = self.tables(p.chains, self.chain)
        operators = self.tables(p.operators, self.operator)
        delegates = self.tables(p.delegates, self.delegate)
        sizes = self.scalars(p.non_const_buffer_sizes, "<i8")
        devices = (self.tables(p.non_const_buffer_device, self.buffer_device)
                   if p.non_const_buffer_device is not None else None)
        return self.table([
            (0, "off", name), (1, "off", meta), (2, "off", values), (3, "off", inputs),
            (4, "off", outputs), (5, "off", chains), (6, "off", operators), (7, "off", delegates),
            (8, "off", sizes), (9, "off", devices),
        ])

    # -- program

    def data_segment(self, s: P.DataSegment) -> int:
        return self.table([(0, "Uint64", s.offset), (1, "Uint64", s.size)])

    def subsegment(self, s: P.SubsegmentOffsets) -> int:
        offsets = self.scalars(s.offsets, "<u8")
        return self.table([(0, "Uint32", s.segment_index), (1, "off", offsets)])

    def named_data(self, n: P.NamedData) -> int:
        key = self.b.CreateString(n.key)
        return self.table([(0, "off", key), (1, "Uint32", n.segment_index)])

    def buffer(self, data: BytesLike, alignment: int) -> int:
        """Buffer / BackendDelegateInlineData: one force-aligned byte vector."""
        return self.table([(0, "off", self.bytes_vector(data, alignment))])

    def program(self, p: P.Program) -> int:
        plans = self.tables(p.execution_plan, self.plan)
        constant_buffer = self.tables(p.constant_buffer, lambda d: self.buffer(d, self.constant_alignment))
        delegate_data = self.tables(p.backend_delegate_data, lambda d: self.buffer(d, self.delegate_alignment))
        segments = self.tables(p.segments, self.data_segment)
        constant_segment = self.subsegment(p.constant_segment) if p.constant_segment is not None else None
        mutable = (self.tables(p.mutable_data_segments, self.subsegment)
                   if p.mutable_data_segments is not None else None)
        named = self.tables(p.named_data, self.named_data) if p.named_data is not None else None
        return self.table([
            (0, "Uint32", p.version), (1, "off", plans), (2, "off", constant_buffer),
            (3, "off", delegate_data), (4, "off", segments), (5, "off", constant_segment),
            (6, "off", mutable), (7, "off", named),
        ])
