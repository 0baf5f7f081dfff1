"""Read a `.pte` file into Program dataclasses, checking every offset before use.

The reader is hand-written (no generated code): a `_Fb` cursor over the bytes with
bounds-checked primitives, then one small function per table. Byte vectors
(constant buffers, inline delegate data) come back as memoryview slices of the
input, so nothing large is copied. Hostile input raises MalformedProgramError,
never IndexError/struct.error, and the total number of objects decoded is
bounded by the file size so that offset tricks cannot make decoding explode.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import MalformedProgramError
from . import program as P

FILE_IDENTIFIER = b"ET12"
HEADER_MAGIC = b"eh00"


@dataclass
class ExtendedHeader:
    length: int
    program_size: int
    segment_base_offset: int
    segment_data_size: int


@dataclass
class PteFile:
    """A decoded program plus the bytes its segments live in."""

    program: P.Program
    data: memoryview  # the whole file
    header: Optional[ExtendedHeader]

    @property
    def segment_base_offset(self) -> int:
        return self.header.segment_base_offset if self.header else len(self.data)

    def segment(self, index: int) -> memoryview:
        """The bytes of `program.segments[index]`, bounds-checked against the file."""
        segs = self.program.segments
        if not 0 <= index < len(segs):
            raise MalformedProgramError(f"segment index {index} out of range (program has {len(segs)} segments)")
        seg = segs[index]
        start = self.segment_base_offset + seg.offset
        end = start + seg.size
        if seg.size and (self.header is None or end > len(self.data)):
            raise MalformedProgramError(
                f"segment {index} (offset {seg.offset}, size {seg.size}) lies outside the file "
                f"({len(self.data)} bytes, segment base {self.segment_base_offset})"
            )
        return self.data[start:end]


def read_extended_header(data: memoryview) -> Optional[ExtendedHeader]:
    if len(data) < 8:
        raise MalformedProgramError(f"file is {len(data)} bytes, too short to be a .pte")
    if bytes(data[4:8]) != FILE_IDENTIFIER:
        raise MalformedProgramError(
            f"not an ExecuTorch program: file identifier is {bytes(data[4:8])!r}, expected {FILE_IDENTIFIER!r}"
        )
    if len(data) < 16 or bytes(data[8:12]) != HEADER_MAGIC:
        return None
    (length,) = struct.unpack_from("<I", data, 12)
    if length < 24 or 8 + length > len(data):
        raise MalformedProgramError(f"extended header length {length} is invalid")
    program_size, base = struct.unpack_from("<QQ", data, 16)
    seg_size = struct.unpack_from("<Q", data, 32)[0] if length > 24 else 0
    if not (8 + length <= program_size <= len(data)) or not (program_size <= base <= len(data)):
        raise MalformedProgramError(
            f"extended header is inconsistent: program_size={program_size}, "
            f"segment_base_offset={base}, file size={len(data)}"
        )
    return ExtendedHeader(length, program_size, base, seg_size)


def read_pte(data) -> PteFile:
    """Decode a .pte from bytes, bytearray, memoryview or mmap."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    header = read_extended_header(view)
    fb_end = header.program_size if header else len(view)
    fb = _Fb(view, fb_end)
    program = _program(fb, fb.root())
    return PteFile(program, view, header)


class _Fb:
    """Bounds-checked access to one flatbuffer."""

    def __init__(self, data: memoryview, end: int):
        self.data = data
        self.end = end
        # Every table/vector element decoded costs one unit; a valid file never needs
        # more units than it has bytes, so this bounds the work on hostile input.
        self.budget = 4 * end + 4096

    def _spend(self, n: int = 1) -> None:
        self.budget -= n
        if self.budget < 0:
            raise MalformedProgramError("flatbuffer references more objects than the file can hold")

    def _check(self, pos: int, size: int, what: str) -> None:
        if pos < 0 or size < 0 or pos + size > self.end:
            raise MalformedProgramError(f"{what} at byte {pos} (+{size}) lies outside the program ({self.end} bytes)")

    def u32(self, pos: int) -> int:
        self._check(pos, 4, "offset")
        return struct.unpack_from("<I", self.data, pos)[0]

    def root(self) -> int:
        return self.u32(0)

    def table(self, pos: int) -> "_Table":
        self._spend()
        self._check(pos, 4, "table")
        vt = pos - struct.unpack_from("<i", self.data, pos)[0]
        self._check(vt, 4, "vtable")
        vt_len, _ = struct.unpack_from("<HH", self.data, vt)
        if vt_len < 4 or vt_len % 2:
            raise MalformedProgramError(f"vtable at byte {vt} has invalid length {vt_len}")
        self._check(vt, vt_len, "vtable")
        n = (vt_len - 4) // 2
        slots = struct.unpack_from(f"<{n}H", self.data, vt + 4)
        return _Table(self, pos, slots)

    def indirect(self, pos: int) -> int:
        """Follow a uoffset stored at pos."""
        return pos + self.u32(pos)

    def vector(self, pos: int, elem_size: int) -> tuple[int, int]:
        """(start, count) of the vector whose uoffset is stored at pos."""
        vpos = self.indirect(pos)
        count = self.u32(vpos)
        self._check(vpos + 4, count * elem_size, "vector")
        return vpos + 4, count

    def string(self, pos: int) -> str:
        start, count = self.vector(pos, 1)
        try:
            return bytes(self.data[start : start + count]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MalformedProgramError(f"string at byte {start} is not UTF-8") from e


class _Table:
    __slots__ = ("fb", "pos", "slots")

    def __init__(self, fb: _Fb, pos: int, slots: tuple[int, ...]):
        self.fb, self.pos, self.slots = fb, pos, slots

    def _field(self, fid: int) -> int:
        off = self.slots[fid] if fid < len(self.slots) else 0
        return self.pos + off if off else 0

    def scalar(self, fid: int, fmt: str, default=0):
        p = self._field(fid)
        if not p:
            return default
        self.fb._check(p, struct.calcsize(fmt), "scalar field")
        return struct.unpack_from("<" + fmt, self.fb.data, p)[0]

    def has(self, fid: int) -> bool:
        return bool(self._field(fid))

    def string(self, fid: int, default: Optional[str] = "") -> Optional[str]:
        p = self._field(fid)
        return self.fb.string(p) if p else default

    def table(self, fid: int) -> Optional[_Table]:
        p = self._field(fid)
        return self.fb.table(self.fb.indirect(p)) if p else None

    def scalars(self, fid: int, fmt: str) -> list:
        p = self._field(fid)
        if not p:
            return []
        size = struct.calcsize(fmt)
        start, count = self.fb.vector(p, size)
        self.fb._spend(count // 8)
        return list(struct.unpack_from(f"<{count}{fmt}", self.fb.data, start))

    def bytes_view(self, fid: int) -> memoryview:
        p = self._field(fid)
        if not p:
            return memoryview(b"")
        start, count = self.fb.vector(p, 1)
        return self.fb.data[start : start + count]

    def tables(self, fid: int, decode: Callable[[_Table], object]) -> list:
        p = self._field(fid)
        if not p:
            return []
        start, count = self.fb.vector(p, 4)
        self.fb._spend(count)
        return [decode(self.fb.table(self.fb.indirect(start + 4 * i))) for i in range(count)]

    def strings(self, fid: int) -> list[str]:
        p = self._field(fid)
        if not p:
            return []
        start, count = self.fb.vector(p, 4)
        self.fb._spend(count)
        return [self.fb.string(start + 4 * i) for i in range(count)]


# ---------------------------------------------------------------------------- tables


def _opt_table(t: _Table, fid: int, decode):
    sub = t.table(fid)
    return decode(sub) if sub is not None else None


def _allocation(t: _Table) -> P.AllocationDetails:
    return P.AllocationDetails(t.scalar(0, "I"), t.scalar(1, "I"), t.scalar(2, "I"))


def _extra_info(t: _Table) -> P.ExtraTensorInfo:
    return P.ExtraTensorInfo(
        mutable_data_segments_idx=t.scalar(0, "Q"),
        fully_qualified_name=t.string(1, None),
        location=t.scalar(2, "b"),
        device_type=t.scalar(3, "b"),
        device_index=t.scalar(4, "b"),
    )


def _tensor(t: _Table) -> P.Tensor:
    return P.Tensor(
        scalar_type=t.scalar(0, "b"),
        storage_offset=t.scalar(1, "i"),
        sizes=t.scalars(2, "i"),
        dim_order=t.scalars(3, "B"),
        requires_grad=bool(t.scalar(4, "B")),
        data_buffer_idx=t.scalar(5, "I"),
        allocation_info=_opt_table(t, 6, _allocation),
        layout=t.scalar(7, "b"),
        shape_dynamism=t.scalar(8, "b"),
        extra_tensor_info=_opt_table(t, 9, _extra_info),
    )


_VALUE_DECODERS: dict[int, Callable[[_Table], P.EValue]] = {
    1: lambda t: P.Null(),
    2: lambda t: P.Int(t.scalar(0, "q")),
    3: lambda t: P.Bool(bool(t.scalar(0, "B"))),
    4: lambda t: P.Double(t.scalar(0, "d", 0.0)),
    5: _tensor,
    6: lambda t: P.String(t.string(0)),
    7: lambda t: P.IntList(t.scalars(0, "q")),
    8: lambda t: P.DoubleList(t.scalars(0, "d")),
    9: lambda t: P.BoolList([bool(b) for b in t.scalars(0, "B")]),
    10: lambda t: P.TensorList(t.scalars(0, "i")),
    11: lambda t: P.OptionalTensorList(t.scalars(0, "i")),
}


def _evalue(t: _Table) -> P.EValue:
    tag = t.scalar(0, "B")
    if tag == 0:
        return P.Null()  # NONE: an unset value behaves like None
    decode = _VALUE_DECODERS.get(tag)
    if decode is None:
        raise MalformedProgramError(f"unknown EValue type tag {tag}")
    member = t.table(1)
    if member is None:
        raise MalformedProgramError(f"EValue with tag {tag} has no value table")
    return decode(member)


_INSTRUCTION_DECODERS: dict[int, Callable[[_Table], P.Instruction]] = {
    1: lambda t: P.KernelCall(t.scalar(0, "i"), t.scalars(1, "i")),
    2: lambda t: P.DelegateCall(t.scalar(0, "i"), t.scalars(1, "i")),
    3: lambda t: P.MoveCall(t.scalar(0, "i"), t.scalar(1, "i")),
    4: lambda t: P.JumpFalseCall(t.scalar(0, "i"), t.scalar(1, "i")),
    5: lambda t: P.FreeCall(t.scalar(0, "i")),
}


def _instruction(t: _Table) -> P.Instruction:
    tag = t.scalar(0, "B")
    decode = _INSTRUCTION_DECODERS.get(tag)
    member = t.table(1)
    if decode is None or member is None:
        raise MalformedProgramError(f"instruction has unknown or missing arguments (tag {tag})")
    return decode(member)


def _frame(t: _Table) -> P.Frame:
    return P.Frame(t.string(0, None), t.scalar(1, "i"), t.string(2, None), t.string(3, None))


def _chain(t: _Table) -> P.Chain:
    return P.Chain(
        inputs=t.scalars(0, "i"),
        outputs=t.scalars(1, "i"),
        instructions=t.tables(2, _instruction),
        stacktrace=t.tables(3, lambda f: P.FrameList(f.tables(0, _frame))) if t.has(3) else None,
    )


def _delegate(t: _Table) -> P.BackendDelegate:
    ref = t.table(1)
    return P.BackendDelegate(
        id=t.string(0),
        processed=P.BackendDelegateDataReference(ref.scalar(0, "b"), ref.scalar(1, "I")) if ref else
        P.BackendDelegateDataReference(),
        compile_specs=t.tables(2, lambda c: P.CompileSpec(c.string(0), bytes(c.bytes_view(1)))),
    )


def _plan(t: _Table) -> P.ExecutionPlan:
    meta = t.table(1)
    return P.ExecutionPlan(
        name=t.string(0),
        container_meta_type=P.ContainerMetadata(meta.string(0), meta.string(1)) if meta else P.ContainerMetadata(),
        values=t.tables(2, _evalue),
        inputs=t.scalars(3, "i"),
        outputs=t.scalars(4, "i"),
        chains=t.tables(5, _chain),
        operators=t.tables(6, lambda o: P.Operator(o.string(0), o.string(1))),
        delegates=t.tables(7, _delegate),
        non_const_buffer_sizes=t.scalars(8, "q"),
        non_const_buffer_device=t.tables(9, lambda d: P.NonConstBufferDevice(
            d.scalar(0, "i"), d.scalar(1, "b"), d.scalar(2, "b"))) if t.has(9) else None,
    )


def _subsegment(t: _Table) -> P.SubsegmentOffsets:
    return P.SubsegmentOffsets(t.scalar(0, "I"), t.scalars(1, "Q"))


def _program(fb: _Fb, root: int) -> P.Program:
    t = fb.table(root)
    return P.Program(
        version=t.scalar(0, "I"),
        execution_plan=t.tables(1, _plan),
        constant_buffer=t.tables(2, lambda b: b.bytes_view(0)),
        backend_delegate_data=t.tables(3, lambda b: b.bytes_view(0)),
        segments=t.tables(4, lambda s: P.DataSegment(s.scalar(0, "Q"), s.scalar(1, "Q"))),
        constant_segment=_opt_table(t, 5, _subsegment),
        mutable_data_segments=t.tables(6, _subsegment) if t.has(6) else None,
        named_data=t.tables(7, lambda n: P.NamedData(n.string(0), n.scalar(1, "I"))) if t.has(7) else None,
    )
