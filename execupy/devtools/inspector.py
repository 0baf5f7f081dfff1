"""Inspector: an ETDump (ours or ExecuTorch's), joined with an ETRecord, as tables people read.

    inspector = Inspector(etdump_path="trace.etdp", etrecord="model.etrecord", debug_buffer_path="trace.bin")
    inspector.print_data_tabular()                 # per operator: count, mean/p50/p90/total ms, share, source
    inspector.find_total_for_module("layers.0")    # ms per run spent in that module and below
    inspector.to_dataframe()                       # the same table as a pandas DataFrame (pandas optional)
    gaps = inspector.calculate_numeric_gap(inputs=[x])   # intermediate outputs against torch eager

Nothing here needs torch: the ETRecord's maps are read by `devtools.etrecord`, and only the
numeric comparison, which must run the exported graph in torch eager, imports the torch side
(`devtools/aot/eager.py`) when it is called without reference outputs.

How the trace is grouped: runs of the same name (every "Execute" of a method) form one
event block; an event (a name at an instruction, the n-th such in its run) holds one
duration per run that recorded it. The per-operator table puts kernel calls (`native_call_<op>`), the events a
delegate reports from inside its call, and delegate calls that reported none, into rows of
one operator at one place in the source (one row per operator without an ETRecord).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..errors import InvalidInputError
from .etdump import ETDump, ProfileEvent, RunData, debug_tensor, read_etdump
from .etrecord import ETRecordMaps, NodeInfo, read_etrecord_maps

PathLike = Union[str, os.PathLike]
KERNEL_PREFIX = "native_call_"
WHOLE_CALL = "Method::execute"
# Events that only repeat the span of another one (a kernel's native_call_ twin) or frame the run.
FRAMING = {"OPERATOR_CALL", WHOLE_CALL, "Method::init", "Program::load_method"}


# ---------------------------------------------------------------------------- what it shows


@dataclass
class InspectorEvent:
    """One event of a block, seen in every run of the block."""

    name: str
    instruction_id: int
    delegate_debug_id: Union[int, str, None]  # set on an event a delegate reported from inside
    durations_ms: list[float] = field(default_factory=list)  # one per run
    starts_ms: list[float] = field(default_factory=list)  # from the start of its run
    debug_handles: list[int] = field(default_factory=list)
    node: Optional[NodeInfo] = None  # where the (last) debug handle comes from
    outputs: list[np.ndarray] = field(default_factory=list)  # intermediate outputs of the last run

    @property
    def is_delegated(self) -> bool:
        return self.delegate_debug_id is not None

    @property
    def op(self) -> str:
        """The operator it stands for: the kernel's name, the delegate node's, or the ETRecord's."""
        if self.name.startswith(KERNEL_PREFIX):
            return self.name[len(KERNEL_PREFIX):]
        if self.name == "OPERATOR_CALL" and self.node is not None:
            return self.node.op.removeprefix("aten.")
        return self.name


@dataclass
class EventBlock:
    name: str
    runs: int
    events: list[InspectorEvent]


@dataclass
class OperatorRow:
    """One operator at one place in the source: times of its calls, per run."""

    op: str
    count: float  # calls per run
    mean_ms: float  # per call
    p50_ms: float
    p90_ms: float
    total_ms: float  # per run
    share: float  # of the mean Method::execute time (0..1)
    module_path: Optional[str]
    source: Optional[str]  # "file:line"

    @property
    def source_short(self) -> str:
        if not self.source:
            return ""
        path, _, line = self.source.rpartition(":")
        return f"{Path(path).name}:{line}"


@dataclass
class TimelineEntry:
    """One event of one run, for drawing: times in ms from the start of the run."""

    name: str
    start_ms: float
    duration_ms: float
    delegated: bool


@dataclass
class NumericGap:
    """How far one instruction's output is from torch eager's for the same graph node."""

    instruction_id: int
    op: str
    debug_handles: list[int]
    module_path: Optional[str]
    source: Optional[str]
    l1: float  # mean |runtime - eager|
    mse: float
    snr_db: float  # 10 log10(sum eager^2 / sum (runtime - eager)^2); inf when equal
    max_abs: float
    max_ref: float  # largest |eager| value, to judge max_abs against

    def exceeds(self, atol: float, rtol: float) -> bool:
        return self.max_abs > atol + rtol * self.max_ref


# ---------------------------------------------------------------------------- the inspector


class Inspector:
    """Reads an ETDump (and optionally an ETRecord and a debug buffer) and tabulates it."""

    def __init__(self, etdump_path: Union[PathLike, bytes], etrecord: Optional[PathLike] = None,
                 debug_buffer_path: Union[PathLike, bytes, None] = None, method: str = "forward"):
        """The ETDump and debug buffer may be given as paths or as their bytes (a trace just taken)."""
        self.etrecord_path, self.method = etrecord, method
        self.etdump: ETDump = read_etdump(etdump_path)
        self.maps: Optional[ETRecordMaps] = read_etrecord_maps(etrecord) if etrecord is not None else None
        self.debug_buffer = (bytes(debug_buffer_path) if isinstance(debug_buffer_path, (bytes, bytearray))
                             else Path(debug_buffer_path).read_bytes() if debug_buffer_path is not None else None)
        self._runs = self._runs_by_name()
        self.event_blocks: list[EventBlock] = [self._block(name, runs) for name, runs in self._runs.items()]

    @classmethod
    def from_tracer(cls, tracer, etrecord: Optional[PathLike] = None, method: str = "forward") -> "Inspector":
        """An Inspector over what an EventTracer recorded so far, without writing files."""
        from .etdump import write_etdump

        buffer = bytes(tracer.debug_buffer) if tracer.log_intermediate_outputs else None
        return cls(write_etdump(tracer.etdump()), etrecord, buffer, method)

    # ------------------------------------------------------------------ building the blocks

    def _runs_by_name(self) -> dict[str, list[RunData]]:
        runs: dict[str, list[RunData]] = {}
        for run in self.etdump.run_data:
            runs.setdefault(run.name, []).append(run)
        return runs

    def _block(self, name: str, runs: list[RunData], with_outputs: bool = True) -> EventBlock:
        """Events of the same name, instruction and delegate id (the n-th such in its run) are one
        event across runs; a run that took another branch simply lacks some of them. The last
        run's logged tensors go on its events when there is a debug buffer and `with_outputs`."""
        events: dict[tuple, InspectorEvent] = {}
        for run in runs:
            profiled = [e.profile_event for e in run.events if e.profile_event is not None]
            origin = min((p.start_time for p in profiled), default=0)
            seen: dict[tuple, int] = {}
            for p in profiled:
                what = (p.name, p.instruction_id, p.delegate_debug_id_int, p.delegate_debug_id_str)
                seen[what] = seen.get(what, 0) + 1
                event = events.setdefault((*what, seen[what]), self._event(p))
                event.durations_ms.append((p.end_time - p.start_time) / 1e6)
                event.starts_ms.append((p.start_time - origin) / 1e6)
        if with_outputs and self.debug_buffer is not None and runs:
            self._attach_outputs(list(events.values()), runs[-1])
        return EventBlock(name, len(runs), list(events.values()))

    def _event(self, p: ProfileEvent) -> InspectorEvent:
        delegate_id = p.delegate_debug_id_str if p.delegate_debug_id_str is not None else (
            p.delegate_debug_id_int if p.delegate_debug_id_int != -1 else None)
        handles = self._handles(p.instruction_id, delegate_id)
        node = self._node(handles[-1]) if handles else None
        return InspectorEvent(p.name, p.instruction_id, delegate_id, debug_handles=handles, node=node)

    def _handles(self, instruction_id: int, delegate_id: Union[int, str, None]) -> list[int]:
        if self.maps is None:
            return []
        if delegate_id is not None:
            inner = self.maps.delegate_map.get(self.method, {}).get(instruction_id, {}).get("delegate_map", {})
            return [int(h) for h in inner.get(str(delegate_id), [])]
        return list(self.maps.debug_handle_map.get(self.method, {}).get(instruction_id, []))

    def _node(self, handle: int) -> Optional[NodeInfo]:
        return self.maps.node_info.get(self.method, {}).get(handle) if self.maps else None

    def _attach_outputs(self, events: list[InspectorEvent], run: RunData) -> None:
        """The tensors each instruction logged, on its operator event (native_call_, else any)."""
        by_instruction: dict[int, list[np.ndarray]] = {}
        for e in run.events:
            d = e.debug_event
            if d is None or d.debug_entry is None or d.debug_entry.output or d.delegate_debug_id_int != -1:
                continue
            refs = [d.debug_entry.tensor] if d.debug_entry.tensor else (d.debug_entry.tensor_list or [])
            by_instruction.setdefault(d.instruction_id, []).extend(debug_tensor(self.debug_buffer, r) for r in refs)
        for event in events:
            if event.is_delegated or event.name in FRAMING - {"OPERATOR_CALL"}:
                continue
            if event.instruction_id in by_instruction:
                event.outputs = by_instruction.pop(event.instruction_id)

    # ------------------------------------------------------------------ tables

    def execute_block(self, name: str = "Execute") -> EventBlock:
        """The block of the method's calls ("Execute"; `execupy generate --profile` names its
        runs "Prefill" and "Decode")."""
        block = next((b for b in self.event_blocks if b.name == name), None)
        if block is None:
            raise InvalidInputError(f"the trace has no {name!r} block (blocks: "
                                    f"{[b.name for b in self.event_blocks]}); no such call was traced")
        return block

    def execute_ms(self, block_name: str = "Execute") -> float:
        """The mean time of one whole call (Method::execute), or of its events when not recorded."""
        block = self.execute_block(block_name)
        whole = [e for e in block.events if e.name == WHOLE_CALL]
        if whole:
            return float(np.mean(whole[0].durations_ms))
        return sum(float(np.mean(e.durations_ms)) for e in operator_events(block))

    def operator_table(self, block_name: str = "Execute") -> list[OperatorRow]:
        """Rows of (operator, module, source line), the most expensive first."""
        block = self.execute_block(block_name)
        groups: dict[tuple, list[InspectorEvent]] = {}
        for e in operator_events(block):
            groups.setdefault((e.op, _module(e), _source(e)), []).append(e)
        whole = self.execute_ms(block_name)
        rows = [_row(op, module, source, events, block.runs, whole)
                for (op, module, source), events in groups.items()]
        return sorted(rows, key=lambda r: -r.total_ms)

    def timeline(self, run: int = -1, block_name: str = "Execute") -> list[TimelineEntry]:
        """The operator events of one run of a block (the last by default), in the order they ran."""
        self.execute_block(block_name)  # says which blocks there are when this one is not
        one_run = self._block(block_name, [self._runs[block_name][run]], with_outputs=False)
        return [TimelineEntry(e.op, e.starts_ms[0], e.durations_ms[0], e.is_delegated)
                for e in operator_events(one_run)]

    def find_total_for_module(self, module_name: str) -> float:
        """Mean ms per run spent in operators of `module_name` and the modules under it."""
        if self.maps is None:
            raise InvalidInputError("find_total_for_module needs the ETRecord (module paths come from it)")
        return sum(r.total_ms for r in self.operator_table()
                   if r.module_path is not None and _inside(r.module_path, module_name))

    def print_data_tabular(self, file=None, limit: Optional[int] = None) -> None:
        print(format_table(self.operator_table()[:limit], self.execute_ms(), self.execute_block().runs), file=file)

    def to_dataframe(self):
        """The operator table as a pandas DataFrame (pandas is not a dependency of execupy)."""
        try:
            import pandas as pd
        except ImportError:
            raise InvalidInputError("Inspector.to_dataframe needs pandas, which is not installed "
                                    "(pip install pandas); print_data_tabular() needs nothing") from None
        return pd.DataFrame([vars(r) for r in self.operator_table()])

    # ------------------------------------------------------------------ numeric comparison

    def calculate_numeric_gap(self, reference: Optional[dict[int, Any]] = None,
                              inputs: Optional[Sequence[Any]] = None) -> list[NumericGap]:
        """Per traced instruction, in execution order: L1, MSE and SNR of its logged output
        against the eager output of its graph node. `reference` maps debug handle -> eager
        output; without it the ETRecord's graph is run in torch eager on `inputs`."""
        if self.maps is None or self.debug_buffer is None:
            raise InvalidInputError("calculate_numeric_gap needs the ETRecord and the debug buffer "
                                    "(trace with log_intermediate_outputs=True, or `execupy run --debug-buffer`)")
        if reference is None:
            if inputs is None:
                raise InvalidInputError("calculate_numeric_gap needs the reference outputs or the inputs to make them")
            from .aot.eager import eager_outputs_by_handle  # torch, imported only here

            reference = eager_outputs_by_handle(self.etrecord_path, inputs, self.method)
        gaps = []
        for e in self.execute_block().events:
            if e.outputs and e.debug_handles and not e.is_delegated:
                gap = _gap(e, reference.get(e.debug_handles[-1]))
                if gap is not None:
                    gaps.append(gap)
        return gaps


# ---------------------------------------------------------------------------- helpers


def operator_events(block: EventBlock) -> list[InspectorEvent]:
    """The events that stand for operators: kernels, a delegate's own events, delegate calls
    that reported none from inside, and prim ops (an OPERATOR_CALL with no kernel twin)."""
    kernels = {e.instruction_id for e in block.events if e.name.startswith(KERNEL_PREFIX)}
    reported = {e.instruction_id for e in block.events if e.is_delegated}
    chosen = []
    for e in block.events:
        if e.is_delegated or e.name.startswith(KERNEL_PREFIX):
            chosen.append(e)
        elif e.name == "DELEGATE_CALL" and e.instruction_id not in reported:
            chosen.append(e)
        elif e.name == "OPERATOR_CALL" and e.instruction_id not in kernels:
            chosen.append(e)
    return chosen


def _module(e: InspectorEvent) -> Optional[str]:
    return e.node.module_path if e.node else None


def _source(e: InspectorEvent) -> Optional[str]:
    return f"{e.node.file}:{e.node.line}" if e.node and e.node.file else None


def _inside(path: str, module: str) -> bool:
    return module in ("", path) or path.startswith(module + ".")


def _row(op: str, module: Optional[str], source: Optional[str], events: list[InspectorEvent], runs: int,
         whole_ms: float) -> OperatorRow:
    calls = np.array([d for e in events for d in e.durations_ms])
    total = float(calls.sum()) / max(runs, 1)
    return OperatorRow(op=op, count=len(calls) / max(runs, 1), mean_ms=float(calls.mean()),
                       p50_ms=float(np.percentile(calls, 50)), p90_ms=float(np.percentile(calls, 90)),
                       total_ms=total, share=total / whole_ms if whole_ms > 0 else 0.0,
                       module_path=module, source=source)


def format_table(rows: list[OperatorRow], execute_ms: float, runs: int) -> str:
    header = ("operator", "calls", "mean ms", "p50 ms", "p90 ms", "total ms", "share", "module", "source")
    lines = [(r.op, f"{r.count:g}", f"{r.mean_ms:.4f}", f"{r.p50_ms:.4f}", f"{r.p90_ms:.4f}", f"{r.total_ms:.4f}",
              f"{100 * r.share:.1f}%", r.module_path if r.module_path is not None else "", r.source_short)
             for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    title = f"{runs} run(s), {execute_ms:.3f} ms per run (Method::execute); per run: calls, total ms"
    return "\n".join([title, fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def _gap(e: InspectorEvent, eager: Any) -> Optional[NumericGap]:
    """The gap between an event's first logged output and eager's, when both are comparable tensors."""
    if eager is None:
        return None
    ref = eager[0] if isinstance(eager, (list, tuple)) and eager else eager
    ref64, got64 = _as_float64(ref), _as_float64(e.outputs[0])
    if ref64 is None or got64 is None or ref64.size != got64.size:
        return None
    diff = got64 - ref64
    noise, signal = float(np.sum(diff * diff)), float(np.sum(ref64 * ref64))
    snr = math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    return NumericGap(
        instruction_id=e.instruction_id, op=e.op, debug_handles=e.debug_handles, module_path=_module(e),
        source=_source(e), l1=float(np.mean(np.abs(diff))) if diff.size else 0.0,
        mse=float(np.mean(diff * diff)) if diff.size else 0.0, snr_db=snr,
        max_abs=float(np.max(np.abs(diff))) if diff.size else 0.0,
        max_ref=float(np.max(np.abs(ref64))) if ref64.size else 0.0)


def _as_float64(value: Any) -> Optional[np.ndarray]:
    """A flat float64 copy of a numeric tensor (bfloat16 included); None for bools and the rest."""
    array = np.asarray(value)
    if array.dtype == np.bool_ or array.dtype.kind in "OUS":
        return None
    try:
        return array.astype(np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None


def format_gaps(gaps: list[NumericGap]) -> str:
    header = ("instr", "operator", "L1", "MSE", "SNR dB", "max |diff|", "module", "source")
    lines = [(str(g.instruction_id), g.op, f"{g.l1:.3g}", f"{g.mse:.3g}", f"{g.snr_db:.1f}", f"{g.max_abs:.3g}",
              g.module_path or "", g.source or "") for g in gaps]
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header)] + [fmt(line) for line in lines])
