"""Program: a loaded `.pte` file. Validates the file once and hands out Methods."""
from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np

from ..errors import MalformedProgramError, MethodNotFoundError
from ..schema import program as P
from ..schema.reader import PteFile, read_pte
from . import collector, heap

if TYPE_CHECKING:
    from .method import Method

# Refuse to allocate planned memory beyond this (bytes); hostile files cannot ask for more.
DEFAULT_MAX_ARENA_BYTES = int(os.environ.get("EXECUPY_MAX_ARENA_BYTES", 16 << 30))
# Programs with jumps (cond, map loops) stop after this many executed instructions per
# call, so a corrupted jump cannot hang the caller.
DEFAULT_MAX_STEPS = int(os.environ.get("EXECUPY_MAX_STEPS_PER_CALL", 2_000_000))


@dataclass
class TensorInfo:
    dtype: np.dtype
    shape: tuple[int, ...]  # upper bounds when dynamic
    dynamic: bool
    dim_order: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass
class ScalarInfo:
    kind: str  # "int" | "float" | "bool" | "str" | "none" | "list"
    value: object


@dataclass
class MethodMeta:
    name: str
    inputs: list[Union[TensorInfo, ScalarInfo]]
    outputs: list[Union[TensorInfo, ScalarInfo]]
    planned_buffer_sizes: list[int]  # one per arena (memory id 1, 2, ...)
    num_instructions: int
    operators: list[str]
    backends: list[str]


def value_info(value: P.EValue) -> Union[TensorInfo, ScalarInfo]:
    if isinstance(value, P.Tensor):
        try:
            dtype = P.numpy_dtype(value.scalar_type)
        except KeyError:
            raise MalformedProgramError(f"unsupported scalar type {value.scalar_type}") from None
        return TensorInfo(dtype, tuple(value.sizes), value.shape_dynamism != 0, tuple(value.dim_order))
    if P.is_scalar(value):
        scalar = P.scalar_value(value)
        return ScalarInfo(type(scalar).__name__, scalar)  # "int", "float", "bool" or "str"
    if isinstance(value, P.Null):
        return ScalarInfo("none", None)
    return ScalarInfo("list", list(getattr(value, "items", [])))


class Program:
    """A `.pte` program, mapped from a file or held in memory.

    >>> program = Program.load("model.pte")
    >>> method = program.load_method("forward")
    >>> outputs = method.execute([x])
    """

    def __init__(
        self,
        pte: PteFile,
        max_arena_bytes: int = DEFAULT_MAX_ARENA_BYTES,
        max_steps_per_call: int = DEFAULT_MAX_STEPS,
        _keepalive=None,
    ):
        self.pte = pte
        self.max_steps_per_call = max_steps_per_call
        self.program = pte.program
        self.max_arena_bytes = max_arena_bytes
        self._keepalive = _keepalive  # the mmap and file that constants point into
        self._released: list[tuple[int, int]] = []  # byte ranges of the mapping release_pages dropped
        self._read_in_full: list[tuple[int, int]] = []  # byte ranges of constants steps read whole
        self._base: Optional[int] = None  # the mapping's address
        self._plans = {plan.name: plan for plan in self.program.execution_plan}
        self._constant_cache: dict[int, memoryview] = {}
        self.load_s = 0.0  # mapping and reading the file (Program.load), for benchmarks

    @classmethod
    def load(cls, source: Union[str, os.PathLike, bytes, bytearray, memoryview], **kwargs) -> "Program":
        """Load from a path (memory-mapped, zero-copy) or from bytes."""
        started = time.perf_counter()
        heap.keep_freed_memory()  # a call's temporaries reuse what the last one freed (runtime/heap.py)
        with collector.paused():
            if isinstance(source, (bytes, bytearray, memoryview)):
                program = cls(read_pte(source), **kwargs)
            else:
                path = Path(source)
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size == 0:
                        raise MalformedProgramError(f"{path} is empty")
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                program = cls(read_pte(mm), _keepalive=mm, **kwargs)
        program.load_s = time.perf_counter() - started
        return program

    def release_pages(self, constant: np.ndarray) -> None:
        """Drop from resident memory the file pages under `constant`, a constant this program
        maps from its file, once a load-time step has re-laid it into a copy of its own (a packed
        quantized weight). The mapping is read-only and file-backed, so a later read of the
        constant (a tied embedding, say) pages it back in from the file; nothing is lost."""
        mm = self._keepalive
        if not isinstance(mm, mmap.mmap) or not hasattr(mm, "madvise") or constant.nbytes == 0:
            return
        span = self._span(constant)
        if span is None:
            return  # not in this program's mapping
        page = mmap.PAGESIZE
        lo, hi = -(-span[0] // page) * page, span[1] // page * page  # whole pages inside
        if hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            self._released.append((lo, hi))

    def _span(self, array: np.ndarray) -> Optional[tuple[int, int]]:
        """The byte range [start, end) of `array` in this program's mapping, or None."""
        mm = self._keepalive
        if not isinstance(mm, mmap.mmap) or not isinstance(array, np.ndarray) or array.nbytes == 0:
            return None
        if self._base is None:
            self._base = np.frombuffer(mm, np.uint8).ctypes.data
        start = array.ctypes.data - self._base
        return (start, start + array.nbytes) if 0 <= start and start + array.nbytes <= len(mm) else None

    def side_by_side(self, constants: Sequence[np.ndarray]) -> Optional[np.ndarray]:
        """One array over `constants` stacked on their first axis, read in place from this program's
        mapping, when they lie there one after another (C order, one dtype, the same row shape);
        None otherwise. Nothing is copied: memory stays at the file's size."""
        first = constants[0]
        if not all(isinstance(c, np.ndarray) and c.ndim >= 1 and c.flags.c_contiguous and c.dtype == first.dtype
                   and c.shape[1:] == first.shape[1:] for c in constants):
            return None
        spans = [self._span(c) for c in constants]
        if None in spans or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            return None
        rows = sum(c.shape[0] for c in constants)
        count = (spans[-1][1] - spans[0][0]) // first.dtype.itemsize
        return np.frombuffer(self._keepalive, first.dtype, count, spans[0][0]).reshape(rows, *first.shape[1:])

    def note_full_read(self, constant: np.ndarray) -> None:
        """A bound step reads all of `constant` at each call (a matrix product's weight, not an
        embedding table's few rows): its pages are worth mapping in ahead (populate_in_background)."""
        span = self._span(constant)
        if span is not None:
            self._read_in_full.append(span)

    def populate_in_background(self) -> Optional[threading.Thread]:
        """Map in, on another thread (runtime/heap.py; returned, or None), the pages of the constants
        bound steps read in full (note_full_read) but those `release_pages` dropped: once a
        program's methods are bound, so that its first call reads its weights without faulting them
        in, and an embedding table only read row by row stays out of memory."""
        mm = self._keepalive
        if not isinstance(mm, mmap.mmap):
            return None
        page, released = mmap.PAGESIZE, sorted(self._released)
        ranges = []
        for lo, hi in _merged((lo // page * page, -(-hi // page) * page) for lo, hi in self._read_in_full):
            for r_lo, r_hi in released:  # cut the released ranges out
                if r_lo < hi and lo < r_hi:
                    if lo < r_lo:
                        ranges.append((lo, r_lo))
                    lo = max(lo, r_hi)
            if lo < hi:
                ranges.append((lo, min(hi, len(mm))))
        return heap.populate_in_background(self._base or 0, ranges, mm)

    # ------------------------------------------------------------------ queries

    @property
    def method_names(self) -> list[str]:
        return [plan.name for plan in self.program.execution_plan]

    def plan(self, name: str) -> P.ExecutionPlan:
        try:
            return self._plans[name]
        except KeyError:
            raise MethodNotFoundError(f"program has no method {name!r}; methods: {self.method_names}") from None

    def method_meta(self, name: str) -> MethodMeta:
        plan = self.plan(name)
        vals = plan.values

        def info(i: int):
            if not 0 <= i < len(vals):
                raise MalformedProgramError(f"method {name!r}: value index {i} out of range")
            return value_info(vals[i])

        return MethodMeta(
            name=name,
            inputs=[info(i) for i in plan.inputs],
            outputs=[info(i) for i in plan.outputs],
            planned_buffer_sizes=list(plan.non_const_buffer_sizes[1:]),
            num_instructions=len(plan.instructions),
            operators=[op.key for op in plan.operators],
            backends=[d.id for d in plan.delegates],
        )

    def load_method(self, name: str = "forward", event_tracer=None, fuse: Optional[bool] = None) -> "Method":
        """Bind method `name`. An `event_tracer` (execupy.devtools.tracer.EventTracer) records
        the load and, from then on, every call; without one the method runs untraced.
        `fuse` turns load-time fusion (runtime/fusion.py) on or off; by default it is on
        unless EXECUPY_FUSION=0, and always off under an event tracer, which traces each
        instruction of the program as written."""
        from .method import Method

        if event_tracer is None:
            with collector.paused():
                return Method(self, self.plan(name), fuse=fuse)
        started = time.perf_counter_ns()
        with collector.paused():
            method = Method(self, self.plan(name), event_tracer=event_tracer, fuse=False)
        event_tracer.attach(method, load_started_ns=started)
        return method

    # ------------------------------------------------------------------ data access

    def constant_bytes(self, data_buffer_idx: int, nbytes: int) -> memoryview:
        """The bytes of constant entry `data_buffer_idx` (1-based), checked against the file."""
        prog = self.program
        if prog.constant_buffer and len(prog.constant_buffer) > 1:  # legacy inline form
            if not 0 < data_buffer_idx < len(prog.constant_buffer):
                raise MalformedProgramError(f"constant buffer index {data_buffer_idx} out of range")
            data = prog.constant_buffer[data_buffer_idx]
            if nbytes > len(data):
                raise MalformedProgramError(f"constant {data_buffer_idx} holds {len(data)} bytes, tensor needs {nbytes}")
            return data[:nbytes]
        seg = prog.constant_segment
        if seg is None:
            raise MalformedProgramError("program has constant tensors but no constant segment")
        return self._subsegment(seg, data_buffer_idx, nbytes, "constant")

    def mutable_initial_bytes(self, tensor: P.Tensor, nbytes: int) -> memoryview:
        idx = tensor.extra_tensor_info.mutable_data_segments_idx if tensor.extra_tensor_info else 0
        segs = self.program.mutable_data_segments or []
        if not 0 <= idx < len(segs):
            raise MalformedProgramError(f"mutable data segment list {idx} does not exist")
        return self._subsegment(segs[idx], tensor.data_buffer_idx, nbytes, "mutable buffer initial value")

    def _subsegment(self, seg: P.SubsegmentOffsets, idx: int, nbytes: int, what: str) -> memoryview:
        if not 0 < idx < len(seg.offsets):
            raise MalformedProgramError(f"{what} index {idx} out of range (segment lists {len(seg.offsets)})")
        data = self.pte.segment(seg.segment_index)
        start = seg.offsets[idx]
        if start + nbytes > len(data):
            raise MalformedProgramError(
                f"{what} {idx} at offset {start} needs {nbytes} bytes; its segment holds {len(data)}"
            )
        return data[start : start + nbytes]

    def delegate_payload(self, ref: P.BackendDelegateDataReference) -> memoryview:
        if ref.location == P.DataLocation.INLINE:
            if not 0 <= ref.index < len(self.program.backend_delegate_data):
                raise MalformedProgramError(f"inline delegate data index {ref.index} out of range")
            return self.program.backend_delegate_data[ref.index]
        if ref.location == P.DataLocation.SEGMENT:
            return self.pte.segment(ref.index)
        raise MalformedProgramError(f"unknown delegate data location {ref.location}")

    def named_data(self, key: str) -> memoryview:
        for entry in self.program.named_data or []:
            if entry.key == key:
                return self.pte.segment(entry.segment_index)
        raise MalformedProgramError(f"named data {key!r} not found in program")


def _merged(ranges) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching [lo, hi) ranges joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
