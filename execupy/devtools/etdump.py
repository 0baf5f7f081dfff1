"""ETDump: ExecuTorch's runtime trace (`.etdp`), written and read without torch or flatbuffers.

An ETDump is a size-prefixed flatbuffer with file identifier `ED00` (docs: pte-format §4.1):
a list of runs ("event blocks"), each a list of events. A profile event names what ran
(an operator, a delegate call, the whole method) with start and end times in ns; a debug
event holds one value an instruction produced, tensors by reference to bytes in a separate
debug buffer (`Tensor.offset`); an allocation event counts bytes taken from an allocator.

    dump = read_etdump("trace.etdp")                 # ETDump dataclasses, checked as read
    for event in dump.run_data[-1].events: ...
    array = debug_tensor(buffer, event.debug_event.debug_entry.tensor)
    atomic_write("copy.etdp", write_etdump(dump))

The reader reuses the bounds-checked cursor of execupy/schema/reader.py; anything malformed
raises MalformedETDumpError. The writer is a small forward builder (below): a table is
written before its children, whose offsets are patched in once they are placed, so offsets
always point forward as the format requires. It needs only the standard library, because
the runtime must write traces without the export-time `flatbuffers` package.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from ..errors import MalformedETDumpError, MalformedProgramError
from ..schema import program as P
from ..schema.reader import _Fb, _Table

FILE_IDENTIFIER = b"ED00"
DEBUG_ALIGNMENT = 64  # where each tensor's bytes start in the debug buffer
NO_CHAIN = (1 << 64) - 1  # the chain index ExecuTorch gives method-level debug events (-1 as ulong)

# ValueType of the schema: the kind of a debug entry.
VALUE_TYPES = ("Null", "Int", "Bool", "Float", "Double", "Tensor", "TensorList", "String")


# ---------------------------------------------------------------------------- dataclasses


@dataclass
class TensorRef:
    """A tensor whose bytes live in the debug buffer at `offset`; strides in elements."""

    scalar_type: int
    sizes: list[int]
    strides: list[int]
    offset: int


@dataclass
class Value:
    """One debug entry. `kind` is a name from VALUE_TYPES; the field of that kind is set."""

    kind: str = "Null"
    tensor: Optional[TensorRef] = None
    tensor_list: Optional[list[TensorRef]] = None
    int_value: Optional[int] = None
    float_value: Optional[float] = None
    double_value: Optional[float] = None
    bool_value: Optional[bool] = None
    output: Optional[bool] = None  # set on a method output


@dataclass
class ProfileEvent:
    name: str = ""
    chain_index: int = 0
    instruction_id: int = -1
    delegate_debug_id_int: int = -1
    delegate_debug_id_str: Optional[str] = None
    delegate_debug_metadata: Optional[bytes] = None
    start_time: int = 0  # ns
    end_time: int = 0  # ns


@dataclass
class DebugEvent:
    chain_index: int = 0
    instruction_id: int = -1
    debug_entry: Optional[Value] = None
    delegate_debug_id_int: int = -1
    delegate_debug_id_str: Optional[str] = None
    name: Optional[str] = None


@dataclass
class AllocationEvent:
    allocator_id: int = 0
    allocation_size: int = 0


@dataclass
class Event:
    """Exactly one of the three is set."""

    profile_event: Optional[ProfileEvent] = None
    allocation_event: Optional[AllocationEvent] = None
    debug_event: Optional[DebugEvent] = None


@dataclass
class RunData:
    name: str = ""
    bundled_input_index: int = -1
    allocators: Optional[list[str]] = None
    events: list[Event] = field(default_factory=list)


@dataclass
class ETDump:
    version: int = 0
    run_data: list[RunData] = field(default_factory=list)

    def profile_events(self, block: Optional[str] = None) -> list[ProfileEvent]:
        """Every profile event, in order, of the runs named `block` (all runs when None)."""
        return [e.profile_event for r in self.run_data if block in (None, r.name)
                for e in r.events if e.profile_event is not None]

    def debug_events(self, block: Optional[str] = None) -> list[DebugEvent]:
        return [e.debug_event for r in self.run_data if block in (None, r.name)
                for e in r.events if e.debug_event is not None]


# ---------------------------------------------------------------------------- reading


def read_etdump(source: Union[str, os.PathLike, bytes, bytearray, memoryview]) -> ETDump:
    """Decode an ETDump from a path or its bytes; MalformedETDumpError says what is wrong."""
    data = _read_bytes(source)
    view = memoryview(data).cast("B")
    if len(view) < 12:
        raise MalformedETDumpError(f"ETDump is {len(view)} bytes, too short for its size prefix and identifier")
    (size,) = struct.unpack_from("<I", view, 0)
    if size + 4 > len(view) or size < 8:
        raise MalformedETDumpError(f"ETDump size prefix says {size} bytes, but {len(view) - 4} follow it")
    if bytes(view[8:12]) != FILE_IDENTIFIER:
        raise MalformedETDumpError(f"not an ETDump: file identifier is {bytes(view[8:12])!r}, expected {FILE_IDENTIFIER!r}")
    fb = _Fb(view[4:4 + size], size)
    try:
        return _etdump(fb.table(fb.root()))
    except MalformedProgramError as e:  # the shared cursor names its errors for programs
        raise MalformedETDumpError(f"malformed ETDump: {e}") from None


def _read_bytes(source) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    with open(source, "rb") as f:
        return f.read()


def _opt(t: _Table, fid: int, decode: Callable[[_Table], Any]):
    sub = t.table(fid)
    return decode(sub) if sub is not None else None


def _tensor(t: _Table) -> TensorRef:
    return TensorRef(t.scalar(0, "b"), t.scalars(1, "q"), t.scalars(2, "q"), t.scalar(3, "q"))


def _value(t: _Table) -> Value:
    tag = t.scalar(0, "b")
    if not 0 <= tag < len(VALUE_TYPES):
        raise MalformedETDumpError(f"debug value has unknown ValueType {tag}")
    bool_of = lambda b: bool(b.scalar(0, "B"))  # noqa: E731
    return Value(
        kind=VALUE_TYPES[tag],
        tensor=_opt(t, 1, _tensor),
        tensor_list=_opt(t, 2, lambda tl: tl.tables(0, _tensor)),
        int_value=_opt(t, 3, lambda i: i.scalar(0, "q")),
        float_value=_opt(t, 4, lambda f: f.scalar(0, "f", 0.0)),
        double_value=_opt(t, 5, lambda d: d.scalar(0, "d", 0.0)),
        bool_value=_opt(t, 6, bool_of),
        output=_opt(t, 7, bool_of),
    )


def _profile(t: _Table) -> ProfileEvent:
    return ProfileEvent(
        name=t.string(0),
        chain_index=t.scalar(1, "i"),
        instruction_id=t.scalar(2, "i", -1),
        delegate_debug_id_int=t.scalar(3, "i", -1),
        delegate_debug_id_str=t.string(4, None),
        delegate_debug_metadata=bytes(t.bytes_view(5)) if t.has(5) else None,
        start_time=t.scalar(6, "Q"),
        end_time=t.scalar(7, "Q"),
    )


def _debug(t: _Table) -> DebugEvent:
    return DebugEvent(
        chain_index=t.scalar(0, "Q"),
        instruction_id=t.scalar(1, "i", -1),
        debug_entry=_opt(t, 2, _value),
        delegate_debug_id_int=t.scalar(3, "i", -1),
        delegate_debug_id_str=t.string(4, None),
        name=t.string(5, None),
    )


def _event(t: _Table) -> Event:
    event = Event(
        profile_event=_opt(t, 0, _profile),
        allocation_event=_opt(t, 1, lambda a: AllocationEvent(a.scalar(0, "i"), a.scalar(1, "Q"))),
        debug_event=_opt(t, 2, _debug),
    )
    present = sum(x is not None for x in (event.profile_event, event.allocation_event, event.debug_event))
    if present != 1:
        raise MalformedETDumpError(f"an ETDump event must hold exactly one of profile/allocation/debug, it holds {present}")
    return event


def _run(t: _Table) -> RunData:
    return RunData(
        name=t.string(0),
        bundled_input_index=t.scalar(1, "i", -1),
        allocators=t.tables(2, lambda a: a.string(0)) if t.has(2) else None,
        events=t.tables(3, _event),
    )


def _etdump(t: _Table) -> ETDump:
    return ETDump(version=t.scalar(0, "I"), run_data=t.tables(1, _run))


def debug_tensor(buffer: Union[bytes, memoryview], ref: TensorRef) -> np.ndarray:
    """The tensor `ref` points at in a debug buffer, as a numpy array (a copy)."""
    try:
        dtype = P.numpy_dtype(ref.scalar_type)
    except KeyError:
        raise MalformedETDumpError(f"debug tensor has unsupported scalar type {ref.scalar_type}") from None
    if any(s < 0 for s in ref.sizes):
        raise MalformedETDumpError(f"debug tensor has a negative size in {ref.sizes}")
    nbytes = math.prod(ref.sizes) * dtype.itemsize  # Python ints: hostile sizes cannot wrap around
    if ref.offset < 0 or ref.offset + nbytes > len(buffer):
        raise MalformedETDumpError(
            f"debug tensor of {nbytes} bytes at offset {ref.offset} lies outside the debug buffer ({len(buffer)} bytes)")
    flat = np.frombuffer(buffer, np.uint8, nbytes, ref.offset).view(dtype)
    return flat.reshape(ref.sizes).copy()


# ---------------------------------------------------------------------------- writing


def write_etdump(dump: ETDump) -> bytes:
    """The bytes of a size-prefixed `ED00` flatbuffer holding `dump`."""
    out = _Builder()
    return out.finish(lambda: out.table([(0, "I", dump.version, 0), (1, "tables", (dump.run_data, _w_run), None)]))


def _w_run(out: "_Builder", r: RunData) -> int:
    allocators = None if r.allocators is None else (r.allocators, lambda o, name: o.table([(0, "str", name, None)]))
    return out.table([
        (0, "str", r.name, None),
        (1, "i", r.bundled_input_index, -1),
        (2, "tables", allocators, None),
        (3, "tables", (r.events, _w_event), None),
    ])


def _w_event(out: "_Builder", e: Event) -> int:
    allocation = e.allocation_event
    return out.table([
        (0, "table", e.profile_event and (lambda: _w_profile(out, e.profile_event)), None),
        (1, "table", allocation and (lambda: out.table([
            (0, "i", allocation.allocator_id, 0), (1, "Q", allocation.allocation_size, 0)])), None),
        (2, "table", e.debug_event and (lambda: _w_debug(out, e.debug_event)), None),
    ])


def _w_profile(out: "_Builder", p: ProfileEvent) -> int:
    return out.table([
        (0, "str", p.name, None),
        (1, "i", p.chain_index, 0),
        (2, "i", p.instruction_id, -1),
        (3, "i", p.delegate_debug_id_int, -1),
        (4, "str", p.delegate_debug_id_str, None),
        (5, "vec:B", None if p.delegate_debug_metadata is None else list(p.delegate_debug_metadata), None),
        (6, "Q", p.start_time, 0),
        (7, "Q", p.end_time, 0),
    ])


def _w_debug(out: "_Builder", d: DebugEvent) -> int:
    return out.table([
        (0, "Q", d.chain_index, 0),
        (1, "i", d.instruction_id, -1),
        (2, "table", d.debug_entry and (lambda: _w_value(out, d.debug_entry)), None),
        (3, "i", d.delegate_debug_id_int, -1),
        (4, "str", d.delegate_debug_id_str, None),
        (5, "str", d.name, None),
    ])


def _w_tensor(out: "_Builder", t: TensorRef) -> int:
    return out.table([(0, "b", t.scalar_type, None), (1, "vec:q", list(t.sizes), None),
                      (2, "vec:q", list(t.strides), None), (3, "q", t.offset, 0)])


def _w_value(out: "_Builder", v: Value) -> int:
    if v.kind not in VALUE_TYPES:
        raise MalformedETDumpError(f"debug value kind {v.kind!r} is not one of {VALUE_TYPES}")

    def scalar(fmt: str, x) -> Optional[Callable[[], int]]:
        return None if x is None else (lambda: out.table([(0, fmt, x, None)]))

    return out.table([
        (0, "b", VALUE_TYPES.index(v.kind), 0),
        (1, "table", v.tensor and (lambda: _w_tensor(out, v.tensor)), None),
        (2, "table", None if v.tensor_list is None else
         (lambda: out.table([(0, "tables", (v.tensor_list, _w_tensor), None)])), None),
        (3, "table", scalar("q", v.int_value), None),
        (4, "table", scalar("f", v.float_value), None),
        (5, "table", scalar("d", v.double_value), None),
        (6, "table", scalar("B", None if v.bool_value is None else int(v.bool_value)), None),
        (7, "table", scalar("B", None if v.output is None else int(v.output)), None),
    ])


class _Builder:
    """Writes a flatbuffer front to back: parents first, children after, offsets patched in.

    A field is (id, kind, value, default): kind is a struct format of a scalar, "str",
    "vec:<fmt>" (a vector of scalars), "table" (value: a function writing the sub-table and
    returning its position) or "tables" (value: (items, write(builder, item) -> position)).
    Fields whose value is None or equal to `default` are left out, as flatbuffers does.
    Alignment is counted from the start of the file, size prefix included.
    """

    def __init__(self):
        self.buf = bytearray(12)  # size prefix, root offset, identifier

    def finish(self, write_root: Callable[[], int]) -> bytes:
        self.buf[8:12] = FILE_IDENTIFIER
        root = write_root()
        self._patch(4, root)
        self._pad_to(8)
        struct.pack_into("<I", self.buf, 0, len(self.buf) - 4)
        return bytes(self.buf)

    def _pad_to(self, alignment: int, extra: int = 0) -> None:
        """Pad so that the position after `extra` more bytes is a multiple of `alignment`."""
        self.buf += bytes(-(len(self.buf) + extra) % alignment)

    def _patch(self, at: int, target: int) -> None:
        struct.pack_into("<I", self.buf, at, target - at)

    def table(self, fields: list[tuple[int, str, Any, Any]]) -> int:
        present = [(fid, kind, value) for fid, kind, value, default in fields
                   if value is not None and value is not False and value != default]
        size_of = lambda kind: struct.calcsize("<" + kind) if kind[0] not in "stv" else 4  # noqa: E731
        present.sort(key=lambda f: -size_of(f[1]))  # largest first: no padding between fields
        n_slots = max((fid for fid, _, _ in present), default=-1) + 1
        vtable_len = 4 + 2 * n_slots
        self._pad_to(4)
        vtable = len(self.buf)
        self.buf += bytes(vtable_len)
        # the table starts after the vtable, placed so its largest field is aligned
        largest = size_of(present[0][1]) if present else 4
        self._pad_to(max(4, largest), 4)
        table = len(self.buf)
        self.buf += struct.pack("<i", table - vtable)
        slots, pending = [0] * n_slots, []
        for fid, kind, value in present:
            self._pad_to(size_of(kind))
            slots[fid] = len(self.buf) - table
            if kind[0] in "stv":
                pending.append((len(self.buf), kind, value))
                self.buf += bytes(4)
            else:
                self.buf += struct.pack("<" + kind, value)
        struct.pack_into(f"<HH{n_slots}H", self.buf, vtable, vtable_len, len(self.buf) - table, *slots)
        for at, kind, value in pending:
            self._patch(at, self._child(kind, value))
        return table

    def _child(self, kind: str, value) -> int:
        if kind == "table":
            return value()
        if kind == "str":
            return self._vector("B", list(value.encode("utf-8")), terminator=True)
        if kind.startswith("vec:"):
            return self._vector(kind[4:], value)
        items, write = value  # "tables": a vector of offsets, then each table
        start = self._vector("I", [0] * len(items))
        for k, item in enumerate(items):
            self._patch(start + 4 + 4 * k, write(self, item))
        return start

    def _vector(self, fmt: str, items: list, terminator: bool = False) -> int:
        self._pad_to(max(4, struct.calcsize("<" + fmt)), 4)
        start = len(self.buf)
        self.buf += struct.pack(f"<I{len(items)}{fmt}", len(items), *items)
        if terminator:
            self.buf += b"\0"
        return start
