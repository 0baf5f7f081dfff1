"""Runtime half of XnnpackBackend (no torch): the delegate payloads ExecuTorch's XNNPACK
partitioner writes, run in numpy.

`init` decodes the XNNGraph once, resolves every constant to a numpy view of the program's
bytes (named data or the payload's own constant region), unpacks 4-bit weights, re-lays
filters and builds one step per node (see nodes.py); `execute` binds the call's tensors to
the graph's external values and walks the steps. Intermediate values live in a per-call
list (dynamic shapes make their sizes known only at run time), each dropped after the last
node that reads it, as planned at init.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ml_dtypes
import numpy as np

from ...errors import ExecupyError, InvalidInputError, MalformedProgramError
from ...runtime.fusion import fusion_enabled
from . import quant as Q
from . import vmath
from .fused import Fused, fused_steps
from .nodes import BUILDERS, NOTHING, Step, reads
from .schema import (EXTERNAL_INPUT, EXTERNAL_OUTPUT, NAMED_DATA_OFFSET, NO_EXTERNAL_ID, NO_VALUE, Graph, Node, Value,
                     read_payload)

BACKEND_ID = "XnnpackBackend"
F32 = np.float32
FLOAT_TYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
# datatype -> numpy dtype of its constant bytes (4-bit types are unpacked separately)
CONSTANT_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16, "int32": np.int32,
                   "qint32": np.int32, "qcint32": np.int32, "qint8": np.int8, "qcint8": np.int8,
                   "quint8": np.uint8}
FOUR_BIT = ("qcint4", "qbint4")


@dataclass
class Compiled:
    """One delegate, ready to run."""

    inputs: list[tuple[int, Value]]  # (value id, value) by external id
    outputs: list[int]  # value ids by external id
    constants: dict[int, Any]
    steps: list[Step]
    releases: list[tuple[int, ...]]  # per step, the values no later step reads
    num_values: int
    node_kinds: list[str]  # per step, its node's kind: the name of its delegate event when traced
    event_tracer: Any = None  # the method's EventTracer, when it is traced

    def __post_init__(self) -> None:
        # Made once: an LLM's decode step calls some 300 small delegates per token.
        self._template: list[Any] = [None] * self.num_values  # the value list with the constants in place
        for i, x in self.constants.items():
            self._template[i] = x
        self._input_dtypes = [(i, value, FLOAT_TYPES.get(value.datatype) or CONSTANT_DTYPES.get(value.datatype))
                              for i, value in self.inputs]

    def _bound(self, args: list) -> list:
        vals = self._template.copy()
        for (i, value, want), x in zip(self._input_dtypes, args):
            x = np.asarray(x)
            if want is not None and x.dtype != want:
                raise InvalidInputError(f"{BACKEND_ID}: external input {value.external_id} has dtype {x.dtype}, "
                                        f"the delegate expects {np.dtype(want)}")
            vals[i] = x
        return vals

    def run(self, args: list) -> list:
        vals = self._bound(args)
        for step, dead in zip(self.steps, self.releases):
            step(vals)
            for i in dead:  # free intermediates at their last use: peak memory is the live set's
                vals[i] = None
        return [vals[i] for i in self.outputs]

    def bind(self, args: list, dests: Optional[list[np.ndarray]] = None) -> Callable[[], Optional[list]]:
        """run() on inputs fixed now (a shape plan's arrays, say a decode step's): the value list
        filled once, the steps that do nothing left out, the releases looked up only where there
        are some. With `dests`, the arrays the outputs go to, each output is copied there and
        the call returns None, unless one has another shape or dtype: then it returns the outputs
        for the caller to store. An LLM's decode step calls some 300 delegates per token."""
        vals = self._bound(args)
        outputs = self.outputs
        dest_of = dict(zip(outputs, dests)) if dests is not None else {}
        # value id -> its array, the same at every call: the inputs, the constants, then what
        # each step bound on such arrays writes (nodes.FixedBinding)
        fixed = {i: vals[i] for i, _ in self.inputs if isinstance(vals[i], np.ndarray)}
        fixed.update((i, c) for i, c in self.constants.items() if isinstance(c, np.ndarray))
        # (bound only where the outputs have arrays of their own: a call then returns no array it
        # will write again at the next call)
        steps = [self._bind_fixed(step, vals, fixed, dest_of) for step in self.steps] if dests is not None \
            else list(self.steps)
        # filled once, or at every call by a bound step: never released
        kept = fixed.keys() | {i for i, _ in self.inputs}
        releases = [tuple(i for i in dead if i not in kept) for dead in self.releases]
        plan = [(step, dead) for step, dead in zip(steps, releases) if step is not NOTHING or dead]

        def run_bound() -> list:
            for step, dead in plan:
                step(vals)
                for i in dead:
                    vals[i] = None
            return [vals[i] for i in outputs]

        if dests is None:
            return run_bound
        pairs, copyto = [(i, dest) for i, dest in dest_of.items() if vals[i] is not dest], np.copyto
        runs = [getattr(step, "run", None) for step, _ in plan if step is not NOTHING]
        if not pairs and None not in runs:  # every step bound on fixed arrays, the outputs' own: every
            return _in_turn(runs)  # value it writes is one of those (what is left to release was never written)

        def run_into() -> Optional[list]:
            for step, dead in plan:
                step(vals)
                for i in dead:
                    vals[i] = None
            for i, dest in pairs:
                r = vals[i]
                if type(r) is not np.ndarray or r.shape != dest.shape or r.dtype != dest.dtype:
                    return [np.asarray(vals[i]) for i in outputs]
                copyto(dest, r)
            return None

        return run_into

    @staticmethod
    def _bind_fixed(step: Step, vals: list, fixed: dict, dest_of: dict) -> Step:
        """A step reading fixed arrays and writing outputs whose arrays are given (or, where the
        step can make them, values only later steps read), run on those arrays (nodes.FixedBinding:
        a decode mat-vec with its arguments gathered once, written straight into the output's
        array; an element-wise node into an array made once); else the step. What it writes is
        then fixed for the steps after it, and the value list holds those arrays."""
        binding = getattr(step, "bind_fixed", None)
        if binding is None or not all(i in fixed for i in binding.reads):
            return step
        ys = [dest_of.get(i) for i in binding.writes]
        if any(y is None for y in ys) and not binding.makes_arrays:
            return step
        run = binding.bind([fixed[i] for i in binding.reads], ys)
        if run is None:
            return step
        for i, y in zip(binding.writes, ys):
            vals[i] = fixed[i] = y

        def fixed_step(_vals: list) -> None:
            run()

        fixed_step.run = run
        return fixed_step

    def run_traced(self, args: list) -> list:
        """run(), reporting each node as a delegate event: its kind, debug id = its node index."""
        tracer, now_ns = self.event_tracer, time.perf_counter_ns
        vals = self._bound(args)
        for k, (step, dead) in enumerate(zip(self.steps, self.releases)):
            start = now_ns()
            step(vals)
            tracer.log_delegate_event(k, start, now_ns(), name=self.node_kinds[k])
            for i in dead:
                vals[i] = None
        return [vals[i] for i in self.outputs]


def _in_turn(runs: list[Callable[[], None]]) -> Callable[[], None]:
    """One call running `runs` one after the other (a bound delegate whose steps all are)."""
    if len(runs) == 1:
        return runs[0]

    def run_in_turn() -> None:
        for run in runs:
            run()

    return run_in_turn


class GraphContext:
    """What node builders ask of the graph at init: values, constants, and per value the
    functions that load it as fp32 and store an fp32 result in its datatype."""

    def __init__(self, graph: Graph, named_data: Callable[[str], memoryview]):
        self.graph, self.values, self.named_data = graph, graph.values, named_data
        self.constants: dict[int, np.ndarray] = {}
        # 4-bit constants as stored, uint8 [rows, ceil(cols / 2)]: unpacked into `constants` only when a
        # node asks for them (const); a qb4w filter is packed straight from these bytes (nibbles)
        self.four_bit: dict[int, np.ndarray] = {}
        self._scales: dict[int, np.ndarray] = {}
        self.fused_quantize = _fused_quantize(graph)

    def check_id(self, i: int, what: str) -> int:
        if not 0 <= i < len(self.values):
            raise MalformedProgramError(f"{what} names value {i}, but the graph has {len(self.values)} values")
        return i

    # ------------------------------------------------------------ constants

    def constant_bytes(self, idx: int, what: str) -> memoryview:
        entries = self.graph.constant_data
        if not 0 < idx < len(entries):
            raise MalformedProgramError(f"{what}: constant index {idx} out of range ({len(entries)} entries)")
        ref = entries[idx]
        if ref.offset == NAMED_DATA_OFFSET:
            return self.named_data(ref.named_key)
        data = self.graph.constant_bytes
        if ref.offset + ref.size > len(data):
            raise MalformedProgramError(f"{what}: constant at {ref.offset} (+{ref.size}) lies outside the "
                                        f"payload's {len(data)} constant bytes")
        return data[ref.offset:ref.offset + ref.size]

    def decode_constant(self, i: int) -> np.ndarray:
        value = self.values[i]
        raw = self.constant_bytes(value.constant_buffer_idx, f"value {i}")
        shape = tuple(value.dims)
        count = math.prod(shape)
        if value.datatype in FOUR_BIT:
            return _packed_4bit(raw, shape, f"value {i}")
        dtype = CONSTANT_DTYPES.get(value.datatype)
        if dtype is None:
            raise MalformedProgramError(f"value {i}: constants of datatype {value.datatype} are not supported")
        if len(raw) < count * np.dtype(dtype).itemsize:
            raise MalformedProgramError(f"value {i}: constant of shape {list(shape)} ({value.datatype}) needs "
                                        f"{count * np.dtype(dtype).itemsize} bytes, has {len(raw)}")
        return np.frombuffer(raw, dtype, count).reshape(shape)

    def const(self, i: int, what: str) -> np.ndarray:
        self.check_id(i, what)
        if i in self.four_bit and i not in self.constants:
            self.constants[i] = _unpack_4bit(self.four_bit[i], self.values[i].dims[1])
        if i not in self.constants:
            raise MalformedProgramError(f"{what} (value {i}) is not a constant")
        return self.constants[i]

    def nibbles(self, i: int) -> Optional[np.ndarray]:
        """A 4-bit constant's bytes as stored, uint8 [rows, cols / 2] (two values a byte, low nibble
        first), when its columns are whole bytes; else None."""
        packed = self.four_bit.get(i)
        return packed if packed is not None and self.values[i].dims[1] % 2 == 0 else None

    def scales(self, i: int) -> np.ndarray:
        """Per-channel scales (Cout,) or per-group scales (Cout, groups) of a quantized filter."""
        if i not in self._scales:
            self._scales[i] = self._decode_scales(i)
        return self._scales[i]

    def _decode_scales(self, i: int) -> np.ndarray:
        q = self.values[i].quant
        if q is None:
            raise MalformedProgramError(f"value {i} ({self.values[i].datatype}) has no quantization parameters")
        if q.kind == "per_tensor":
            return np.asarray(q.scale, F32)
        if q.scale_buffer_idx:
            raw = self.constant_bytes(q.scale_buffer_idx, f"scales of value {i}")
            n = q.num_scales
            # Blockwise scales are stored as bf16 (XNNPACK's qb4w takes bf16 scales).
            if len(raw) == 2 * n and q.kind == "per_channel_group":
                scales = np.frombuffer(raw, ml_dtypes.bfloat16, n).astype(F32)
            elif len(raw) >= 4 * n:
                scales = np.frombuffer(raw, F32, n)
            else:
                raise MalformedProgramError(f"value {i}: {len(raw)} bytes of scales for {n} scales")
        else:
            scales = np.asarray(q.scale, F32)
        channels = self.values[i].dims[q.channel_dim] if q.channel_dim < len(self.values[i].dims) else 0
        if q.kind == "per_channel_group":
            if not channels or scales.size % channels:
                raise MalformedProgramError(f"value {i}: {scales.size} group scales for {channels} channels")
            return scales.reshape(channels, -1)
        if scales.size != channels:
            raise MalformedProgramError(f"value {i}: {scales.size} scales for {channels} channels")
        return scales

    def filter_zero_point(self, i: int) -> int:
        """4-bit filters are stored unsigned around a zero point of 8."""
        return 8 if self.values[i].datatype in FOUR_BIT else 0

    # ------------------------------------------------------------ loading and storing

    def stored_alike(self, a: int, b: int) -> bool:
        """Values a and b hold their numbers the same way (datatype and quantization)."""
        self.check_id(a, "node input")
        self.check_id(b, "node output")
        va, vb = self.values[a], self.values[b]
        if va.datatype != vb.datatype or va.datatype == "qdint8":
            return False
        qa, qb = va.quant, vb.quant
        return qa is None and qb is None or (qa is not None and qb is not None and qa.kind == qb.kind == "per_tensor"
                                             and qa.scale == qb.scale and qa.zero_point == qb.zero_point)

    def loader(self, i: int) -> Callable[[list], np.ndarray]:
        """vals -> value i as an fp32 array (dequantized if quantized)."""
        self.check_id(i, "node input")
        value = self.values[i]
        if value.datatype in ("qint8", "quint8"):
            scale, zp = value.quant.scale[0], value.quant.zero_point
            return lambda vals: Q.dequantize(vals[i], scale, zp)
        if value.datatype == "qdint8":
            return lambda vals: ((vals[i].q.astype(F32) - vals[i].zero_point) * vals[i].scale).astype(F32)
        if value.datatype in ("fp32", "int32", "qint32", "qcint32"):
            return lambda vals: vals[i]
        if value.datatype in ("fp16", "bf16"):
            return lambda vals: vals[i].astype(F32)
        raise MalformedProgramError(f"value {i} of datatype {value.datatype} cannot be a node input here")

    def plain(self, node: Node, *ids: int) -> bool:
        """Values `ids` are fp32 arrays of rank 1 or more and the node clamps nothing: its step
        may read and store them as they are, without the loaders' and storer's conversions (a
        ufunc on such arrays gives such an array, never a numpy scalar)."""
        return node.output_min == -math.inf and node.output_max == math.inf and all(
            self.values[self.check_id(i, "node value")].datatype == "fp32" and self.values[i].dims for i in ids)

    def storer(self, i: int, node: Node) -> Callable[[np.ndarray], Any]:
        """fp32 result -> value i's representation, with the node's fused clamp applied."""
        self.check_id(i, "node output")
        value = self.values[i]
        lo, hi = node.output_min, node.output_max
        clamp = (lambda y: y) if lo == -math.inf and hi == math.inf else (
            lambda y: np.clip(y, F32(lo), F32(hi)))
        if value.datatype in ("qint8", "quint8"):
            scale, zp, dt = value.quant.scale[0], value.quant.zero_point, value.datatype
            return lambda y: Q.quantize_clamped(y, lo, hi, scale, zp, dt)
        if value.datatype in FLOAT_TYPES:
            dtype = FLOAT_TYPES[value.datatype]
            return lambda y: np.asarray(clamp(y)).astype(dtype, copy=False)
        if value.datatype == "int32":
            return lambda y: np.asarray(y).astype(np.int32, copy=False)
        raise MalformedProgramError(f"value {i} of datatype {value.datatype} cannot be a node output here")


def _fused_quantize(graph: Graph) -> dict[int, int]:
    """qdint8 value -> the fp32 value it quantizes, for each Convert whose result only one
    FullyConnected reads (as its input): that node quantizes its rows itself and the Convert's
    step does nothing, one step and one DynamicQuant less per product (an LLM's decode step
    runs some 200 such pairs per token)."""
    readers: dict[int, list[tuple[int, Node]]] = {}
    for k, node in enumerate(graph.nodes):
        for v in reads(node):
            readers.setdefault(v, []).append((k, node))
    fused = {}
    for k, node in enumerate(graph.nodes):
        if node.kind != "Convert":
            continue
        src, dst = node.fields["input_id"], node.fields["output_id"]
        if not (0 <= src < len(graph.values) and 0 <= dst < len(graph.values)):
            continue  # compile_graph names the bad id
        consumers = readers.get(dst, [])
        if (graph.values[dst].datatype == "qdint8" and graph.values[src].datatype == "fp32"
                and graph.values[src].dims and not graph.values[dst].flags & EXTERNAL_OUTPUT
                and len(consumers) == 1 and consumers[0][0] > k and consumers[0][1].kind == "FullyConnected"
                and consumers[0][1].fields["input1_id"] == dst and reads(consumers[0][1]).count(dst) == 1):
            fused[dst] = src
    return fused


def _packed_4bit(raw: memoryview, shape: tuple, what: str) -> np.ndarray:
    """A 4-bit constant's bytes, checked: uint8 [rows, ceil(cols / 2)], two values a byte along
    the last dim, low nibble first."""
    if len(shape) != 2:
        raise MalformedProgramError(f"{what}: a 4-bit constant must be 2-D, got {list(shape)}")
    rows, cols = shape
    packed_cols = (cols + 1) // 2
    if len(raw) < rows * packed_cols:
        raise MalformedProgramError(f"{what}: 4-bit constant {list(shape)} needs {rows * packed_cols} bytes, "
                                    f"has {len(raw)}")
    return np.frombuffer(raw, np.uint8, rows * packed_cols).reshape(rows, packed_cols)


def _unpack_4bit(packed: np.ndarray, cols: int) -> np.ndarray:
    """_packed_4bit's bytes as uint8 0..15 [rows, cols] (the stored values; XNNPACK's zero point
    for them is 8)."""
    rows, packed_cols = packed.shape
    out = np.empty((rows, packed_cols * 2), np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out[:, :cols]


def compile_graph(graph: Graph, named_data: Callable[[str], memoryview], event_tracer: Any = None) -> Compiled:
    g = GraphContext(graph, named_data)
    inputs: dict[int, tuple[int, Value]] = {}
    outputs: dict[int, int] = {}
    for i, value in enumerate(graph.values):
        if value.constant_buffer_idx:
            (g.four_bit if value.datatype in FOUR_BIT else g.constants)[i] = g.decode_constant(i)
        if value.flags & (EXTERNAL_INPUT | EXTERNAL_OUTPUT):
            if value.external_id == NO_EXTERNAL_ID or value.external_id >= len(graph.values):
                raise MalformedProgramError(f"external value {i} has invalid external id {value.external_id}")
            if value.flags & EXTERNAL_INPUT:
                inputs[value.external_id] = (i, value)
            else:
                outputs[value.external_id] = i
    if sorted(inputs) != list(range(len(inputs))) or sorted(outputs) != list(
            range(len(inputs), len(inputs) + len(outputs))):
        raise MalformedProgramError(f"external ids are not inputs 0..n-1 then outputs: inputs {sorted(inputs)}, "
                                    f"outputs {sorted(outputs)}")
    for k, node in enumerate(graph.nodes):
        for name, v in node.fields.items():
            if name.endswith("_id") and v != NO_VALUE:
                g.check_id(v, f"node {k} ({node.kind}) field {name}")
    # A traced delegate reports each node as it runs: its nodes are not fused.
    fused = fused_steps(graph, g) if event_tracer is None and fusion_enabled() else Fused({}, {})
    steps = [fused.steps[k] if k in fused.steps else BUILDERS[node.kind](node, g) for k, node in enumerate(graph.nodes)]
    output_ids = [outputs[k] for k in sorted(outputs)]
    # 4-bit filters unpacked for a node at init are not kept: no step reads them as it runs
    constants = {i: c for i, c in g.constants.items() if i not in g.four_bit}
    return Compiled([inputs[k] for k in sorted(inputs)], output_ids, constants, steps,
                    _release_plan(graph.nodes, set(output_ids) | set(g.constants), g.fused_quantize, fused.reads_at),
                    len(graph.values), [node.kind for node in graph.nodes], event_tracer)


def _release_plan(nodes: list[Node], keep: set[int], fused: dict[int, int],
                  reads_at: dict[int, int]) -> list[tuple[int, ...]]:
    """For each node, the values it is the last to touch (outputs and constants stay); a
    FullyConnected reading a fused Convert's result reads the Convert's input instead, and a
    node of a fused pattern reads where the pattern's step runs (`reads_at`)."""
    last: dict[int, int] = {}
    for k, node in enumerate(nodes):
        at = reads_at.get(k, k)
        for name, v in node.fields.items():
            if name.endswith("_id") and v != NO_VALUE:
                last[v] = max(last.get(v, at), at)
                if v in fused and not name.startswith("output"):
                    last[fused[v]] = max(last.get(fused[v], at), at)
    dead: list[list[int]] = [[] for _ in nodes]
    for v, k in last.items():
        if v not in keep:
            dead[k].append(v)
    return [tuple(d) for d in dead]


class XnnpackBackend:
    def is_available(self) -> bool:
        return True

    def init(self, processed: memoryview, compile_specs: list, context: Any) -> Compiled:
        vmath.warm_up()
        try:
            return compile_graph(read_payload(processed), context.named_data, context.event_tracer)
        except ExecupyError as e:
            raise type(e)(f"{BACKEND_ID} delegate: {e}") from e
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, MemoryError) as e:
            raise MalformedProgramError(f"{BACKEND_ID} delegate: payload is inconsistent: "
                                        f"{type(e).__name__}: {e}") from e

    def bind(self, handle: Compiled, args: list, outs: Optional[list] = None) -> Optional[Callable[[], Optional[list]]]:
        """execute(handle, args) as a call without arguments, for args that stay the same arrays
        (the runtime's shape plans); None when traced (each call reports its nodes). `outs`, per
        argument, the array the runtime fixed for it (None where it did not): when every output
        has one, the call writes the outputs there and returns None (see Compiled.bind)."""
        if handle.event_tracer is not None:
            return None
        n, count = len(handle.inputs), len(handle.outputs)
        dests = list(outs[n:n + count]) if outs is not None else []
        if len(dests) == count and all(isinstance(d, np.ndarray) for d in dests):
            return handle.bind(args[:n], dests)
        run = handle.bind(args[:n])
        return lambda: [np.asarray(o) for o in run()]

    def execute(self, handle: Compiled, args: list) -> Optional[list]:
        run = handle.run if handle.event_tracer is None else handle.run_traced
        outs = run(args[:len(handle.inputs)])
        return [np.asarray(o) for o in outs]
