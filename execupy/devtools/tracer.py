"""EventTracer: record what a method does while it runs, and save it as an ETDump.

    tracer = EventTracer(log_intermediate_outputs=True)
    module = Module("model.pte", event_tracer=tracer)     # or program.load_method(name, event_tracer=tracer)
    module.forward(x)
    tracer.save("trace.etdp", "trace.bin")              # the .bin holds the logged tensors

What is recorded follows ExecuTorch's own runtime, so its Inspector reads our traces:
a "Default" block with the load (`Program::load_method`, `Method::init`); per call an
"Execute" block with, per kernel, `native_call_<op>.<overload>` and `OPERATOR_CALL` (prim
ops such as sym_size only the latter), per delegate call `DELEGATE_CALL`, per move, jump
and free `MOVE_CALL`, `JF_CALL`, `FREE_CALL`, then `Method::execute`. Times are ns from a monotonic clock.
Our steps fuse argument fetching and the kernel call, so the two events of a kernel share
one span. With `log_intermediate_outputs`, every value an instruction writes and every
method output becomes a debug event whose tensor bytes go to the debug buffer.

Tracing costs nothing when unused: `attach` rebinds a loaded method's steps to timed
wrappers and its `execute` to a traced one, so an untraced method runs exactly the steps
it always did.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, Optional, Union

import numpy as np

from ..fileio import atomic_write
from ..schema import program as P
from .etdump import (
    DEBUG_ALIGNMENT,
    NO_CHAIN,
    DebugEvent,
    ETDump,
    Event,
    ProfileEvent,
    RunData,
    TensorRef,
    Value,
    write_etdump,
)

now_ns = time.perf_counter_ns


# The event of every other kind of instruction, as ExecuTorch names it.
_INSTRUCTION_EVENTS = {P.DelegateCall: "DELEGATE_CALL", P.MoveCall: "MOVE_CALL", P.JumpFalseCall: "JF_CALL",
                       P.FreeCall: "FREE_CALL"}

# Operators ExecuTorch runs as built-in "prim ops": they get only an OPERATOR_CALL event.
PRIM_OPS = {"aten::sym_size.int", "aten::sym_numel", "aten::_local_scalar_dense"}


def profile_name(op_key: str) -> str:
    """ExecuTorch's name for a kernel's event: `aten::add.out` -> `native_call_add.out`."""
    return "native_call_" + op_key.split("::", 1)[-1]


def event_names(op_key: str) -> tuple[str, ...]:
    """The profile events of one kernel call, innermost first, as ExecuTorch names them."""
    if op_key in PRIM_OPS or op_key.startswith("executorch_prim::"):
        return ("OPERATOR_CALL",)
    return (profile_name(op_key), "OPERATOR_CALL")


class EventTracer:
    """Collects ETDump event blocks from the methods it is attached to."""

    def __init__(self, log_intermediate_outputs: bool = False):
        self.log_intermediate_outputs = log_intermediate_outputs
        self.blocks: list[RunData] = []
        self.debug_buffer = bytearray()
        self.instruction_id = -1  # the instruction running now, for delegate events

    # ------------------------------------------------------------------ recording

    def begin_block(self, name: str) -> None:
        self.blocks.append(RunData(name=name))

    def _add(self, event: Event) -> None:
        if not self.blocks:
            self.begin_block("Default")
        self.blocks[-1].events.append(event)

    def profile(self, name: str, start: int, end: int, instruction_id: int = 0, chain_index: int = -1) -> None:
        self._add(Event(profile_event=ProfileEvent(
            name=name, chain_index=chain_index, instruction_id=instruction_id, start_time=start, end_time=end)))

    def log_delegate_event(self, delegate_debug_id: Union[int, str], start: int, end: int,
                           name: str = "", metadata: Optional[bytes] = None) -> None:
        """For backends: one event inside the running delegate call, keyed by its AOT debug id."""
        is_int = isinstance(delegate_debug_id, int)
        self._add(Event(profile_event=ProfileEvent(
            name=name, chain_index=0, instruction_id=self.instruction_id,
            delegate_debug_id_int=delegate_debug_id if is_int else -1,
            delegate_debug_id_str=None if is_int else str(delegate_debug_id),
            delegate_debug_metadata=metadata, start_time=start, end_time=end)))

    def log_value(self, value: Any, instruction_id: int, chain_index: int = 0, output: Optional[bool] = None) -> None:
        """A debug event holding `value`; tensors are copied into the debug buffer."""
        self._add(Event(debug_event=DebugEvent(
            chain_index=chain_index, instruction_id=instruction_id, debug_entry=self._entry(value, output))))

    def _entry(self, value: Any, output: Optional[bool]) -> Value:
        if isinstance(value, np.ndarray):
            return Value("Tensor", tensor=self._store(value), output=output)
        if isinstance(value, (list, tuple)) and all(isinstance(v, np.ndarray) for v in value):
            return Value("TensorList", tensor_list=[self._store(v) for v in value], output=output)
        if isinstance(value, (bool, np.bool_)):
            return Value("Bool", bool_value=bool(value), output=output)
        if isinstance(value, (int, np.integer)):
            return Value("Int", int_value=int(value), output=output)
        if isinstance(value, (float, np.floating)):
            return Value("Double", double_value=float(value), output=output)
        return Value("Null", output=output)

    def _store(self, array: np.ndarray) -> TensorRef:
        data = np.ascontiguousarray(array)
        self.debug_buffer += bytes(-len(self.debug_buffer) % DEBUG_ALIGNMENT)
        offset = len(self.debug_buffer)
        self.debug_buffer += data.tobytes()
        strides = [s // data.itemsize for s in data.strides] if data.size else [0] * data.ndim
        return TensorRef(P.scalar_type_of(data.dtype), list(data.shape), strides, offset)

    # ------------------------------------------------------------------ results

    def etdump(self) -> ETDump:
        return ETDump(version=0, run_data=[RunData(b.name, b.bundled_input_index, b.allocators,
                                                   [e for r in b.events for e in _expand(r)]) for b in self.blocks])

    def save(self, etdump_path: Union[str, os.PathLike], debug_buffer_path: Union[str, os.PathLike, None] = None) -> None:
        """Write the trace (and the debug buffer, when a path is given) atomically."""
        atomic_write(etdump_path, write_etdump(self.etdump()))
        if debug_buffer_path is not None:
            atomic_write(debug_buffer_path, bytes(self.debug_buffer))

    # ------------------------------------------------------------------ binding to a method

    def attach(self, method, load_started_ns: int) -> None:
        """Record `method`'s load and rebind its steps and `execute` to traced versions."""
        loaded = now_ns()
        self.profile("Method::init", load_started_ns, loaded)
        self.profile("Program::load_method", load_started_ns, loaded)
        plan = method.plan
        method._steps = [self._traced_step(method, pc, ins, step)
                         for pc, (ins, step) in enumerate(zip(plan.instructions, method._steps))]
        method.execute = self._traced_execute(method, method.execute)

    def _traced_execute(self, method, execute: Callable) -> Callable:
        @functools.wraps(execute)
        def traced_execute(inputs=()):
            self.begin_block("Execute")
            start = now_ns()
            outputs = execute(inputs)
            self.profile("Method::execute", start, now_ns())
            if self.log_intermediate_outputs:
                for out in outputs:
                    self.log_value(out, instruction_id=0, chain_index=NO_CHAIN, output=True)
            return outputs

        return traced_execute

    def _traced_step(self, method, pc: int, ins: P.Instruction, step: Callable) -> Callable:
        if isinstance(ins, P.KernelCall):
            key = method.plan.operators[ins.op_index].key
            names = event_names(key)
            written = [ins.args[0] if key == "executorch_prim::et_copy_index.tensor" else ins.args[-1]]
        else:
            names = (_INSTRUCTION_EVENTS[type(ins)],)
            written = []  # a delegate's own events (log_delegate_event) say what it did
        values, plan_values = method.values, method.plan.values
        log = self.log_intermediate_outputs

        @functools.wraps(step)
        def traced():
            self.instruction_id = pc
            start = now_ns()
            dest = step()
            end = now_ns()
            if log:
                for i in written:
                    self._log_written(values, plan_values, i, pc)
            self.blocks[-1].events.append((names, pc, start, end))  # expanded by _expand() in etdump()
            return dest

        return traced

    def _log_written(self, values: list, plan_values: list, i: int, pc: int) -> None:
        """One debug event per tensor a kernel wrote (a TensorList result gives several)."""
        v = plan_values[i]
        for j in (v.items if isinstance(v, P.TensorList) else [i]):
            self.log_value(values[j], instruction_id=pc)


def _expand(record) -> list:
    """The events of one record: an Event, or a timed instruction kept as a bare tuple
    (names, instruction id, start, end), because building dataclasses at every step
    would make a traced call several times slower."""
    if isinstance(record, Event):
        return [record]
    names, pc, start, end = record
    return [Event(profile_event=ProfileEvent(name=n, chain_index=0, instruction_id=pc, start_time=start, end_time=end))
            for n in names]
