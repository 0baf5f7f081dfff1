"""The program managers: EdgeProgramManager (to_edge) and ExecutorchProgramManager.

    edge = to_edge(ep)                      # or {"forward": ep1, "encode": ep2}
    edge = edge.transform([my_pass])        # optional graph passes
    prog = edge.to_executorch()             # plan memory, emit, serialize
    prog.save("model.pte")
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
import torch.fx
from torch.export import ExportedProgram

from ..devtools.etrecord import NodeInfo
from ..errors import ExportError
from ..fileio import atomic_write
from ..schema import program as P
from .debug_info import assign_debug_handles, node_info_table
from .edge import EdgeCompileConfig, as_method_dict, check_kernels, check_supported_nodes, to_edge_program
from .emit import DataList, MethodEmitter, emit_constant_method
from .passes import remove_noops

if TYPE_CHECKING:
    from .backend import Partitioner

Pass = Callable[[Any], Any]


@dataclass
class ExecutorchBackendConfig:
    """Options of to_executorch (names follow ExecuTorch's where they exist).

    constant_tensor_alignment: alignment of each constant in the constant segment.
    segment_alignment: alignment of each segment in the file.
    """

    constant_tensor_alignment: int = 16
    segment_alignment: int = 128


def _takes_exported_program(p: Pass) -> bool:
    try:
        params = list(inspect.signature(p).parameters.values())
    except (TypeError, ValueError):
        return False
    if not params:
        return False
    ann = params[0].annotation
    name = ann if isinstance(ann, str) else getattr(ann, "__name__", "")
    return "ExportedProgram" in str(name)


def _apply_pass(p: Pass, ep: ExportedProgram) -> ExportedProgram:
    """Run a user pass: ExportedProgram -> ExportedProgram, or GraphModule -> GraphModule
    (a torch PassResult or None, meaning "changed in place", are accepted too)."""
    if _takes_exported_program(p):
        result = p(ep)
        return ep if result is None else result
    gm = ep.graph_module
    result = p(gm)
    new_gm = getattr(result, "graph_module", result)
    if new_gm is not None and new_gm is not gm:
        if not isinstance(new_gm, torch.fx.GraphModule):
            raise ExportError(f"pass {p!r} returned {type(result).__name__}, expected a GraphModule")
        gm.graph = new_gm.graph  # keep the ExportedProgram's module (and its state)
        for name, sub in new_gm.named_children():
            setattr(gm, name, sub)
    gm.recompile()
    return ep


class EdgeProgramManager:
    """Methods in edge form, ready for user passes and to_executorch."""

    def __init__(self, programs: dict[str, ExportedProgram], constant_methods: Optional[dict[str, Any]] = None,
                 compile_config: Optional[EdgeCompileConfig] = None):
        self._programs = programs
        for ep in programs.values():  # nodes a pass or to_backend added get theirs here
            assign_debug_handles(ep.graph_module)
        self._constant_methods = dict(constant_methods or {})
        self.compile_config = compile_config or EdgeCompileConfig()
        clash = set(programs) & set(self._constant_methods)
        if clash:
            raise ExportError(f"names used both as methods and constant methods: {sorted(clash)}")

    @property
    def methods(self) -> list[str]:
        return sorted(self._programs)

    def exported_program(self, method_name: str = "forward") -> ExportedProgram:
        if method_name not in self._programs:
            raise ExportError(f"no method {method_name!r}; methods are {self.methods}")
        return self._programs[method_name]

    def transform(self, passes: Sequence[Pass]) -> "EdgeProgramManager":
        """Apply passes to every method; returns a new manager (kernels are re-checked)."""
        programs = {}
        for name, ep in self._programs.items():
            for p in passes:
                ep = _apply_pass(p, ep)
            remove_noops(ep.graph_module)
            check_supported_nodes(ep)
            if self.compile_config._check_ir_validity:
                check_kernels(ep, name)
            programs[name] = ep
        return EdgeProgramManager(programs, self._constant_methods, self.compile_config)

    def to_executorch(self, config: Optional[ExecutorchBackendConfig] = None) -> "ExecutorchProgramManager":
        config = config or ExecutorchBackendConfig()
        constants, mutable = DataList(dedup=True), DataList(dedup=False)
        payloads: list[bytes] = []  # delegate payloads, one segment each
        plans, summary = [], {}
        debug = DebugMaps()
        for name in sorted(self._programs):  # docs/format.md §12: methods sorted by name
            ep = self._programs[name]
            if self.compile_config._check_ir_validity:
                check_kernels(ep, name)
            emitter = MethodEmitter(name, ep, constants, mutable, payloads)
            plans.append(emitter.emit())
            summary[name] = emitter.plan_sizes()
            debug.add_method(name, emitter, ep)
        for name, value in self._constant_methods.items():  # then constant methods, in given order
            plans.append(emit_constant_method(name, value, constants))
        program = P.Program(execution_plan=plans, constant_buffer=[], backend_delegate_data=[])
        return ExecutorchProgramManager(program, constants, mutable, config, dict(self._programs), summary,
                                        payloads, debug, _named_data(self._programs.values()))

    def to_backend(self, partitioner: "Partitioner") -> "EdgeProgramManager":
        """Delegate what `partitioner` tags, in every method; returns a new manager."""
        from .backend import to_backend

        programs = {name: to_backend(ep, partitioner) for name, ep in self._programs.items()}
        return EdgeProgramManager(programs, self._constant_methods, self.compile_config)


def _named_data(programs) -> dict[str, bytes]:
    """Every lowered module's named blobs, program-wide (a key names the same bytes everywhere)."""
    from .backend import get_lowered_modules

    named: dict[str, bytes] = {}
    for ep in programs:
        for lowered in get_lowered_modules(ep):
            named.update(lowered.named_data)
    return named


@dataclass
class DebugMaps:
    """What the emitter learnt about debug handles, per method (see ExecutorchProgramManager)."""

    debug_handle_map: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    delegate_map: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    num_outs_map: dict[str, dict[int, int]] = field(default_factory=dict)
    node_info: dict[str, dict[int, NodeInfo]] = field(default_factory=dict)

    def add_method(self, name: str, emitter: MethodEmitter, ep: ExportedProgram) -> None:
        self.debug_handle_map[name] = emitter.debug_handle_map
        self.delegate_map[name] = emitter.delegate_map
        self.num_outs_map[name] = emitter.num_outs_map
        self.node_info[name] = node_info_table(ep.graph_module)


class ExecutorchProgramManager:
    """The emitted program: `buffer` (the .pte bytes), `save(path)`, `plan_summary()`."""

    def __init__(self, program: P.Program, constants: DataList, mutable: DataList,
                 config: ExecutorchBackendConfig, programs: dict[str, ExportedProgram],
                 summary: dict[str, tuple[int, int]], payloads: Sequence[bytes] = (),
                 debug: Optional[DebugMaps] = None, named_data: Optional[dict[str, bytes]] = None):
        from ..schema.writer import pack_pieces, write_pte_pieces

        debug = debug or DebugMaps()
        # Devtools maps, as ExecuTorch's manager has them (generate_etrecord writes them):
        # method -> instruction index -> debug handles; method -> DelegateCall index ->
        # {"name": backend id, "delegate_map": backend debug id -> handles}; method ->
        # DelegateCall index -> number of outputs; and method -> handle -> NodeInfo.
        self.debug_handle_map = debug.debug_handle_map
        self.delegate_map = debug.delegate_map
        self.instruction_id_to_num_outs_map = debug.num_outs_map
        self.node_info = debug.node_info
        self._programs = programs
        self._summary = summary
        # Segments are kept as pieces (the weights' own memory and the padding between them):
        # save() writes them one after the other, and only `buffer` joins them.
        const_pieces, const_offsets = pack_pieces(constants.blobs, config.constant_tensor_alignment)
        segments: list = [const_pieces]
        program.constant_segment = P.SubsegmentOffsets(segment_index=0, offsets=const_offsets)
        if mutable.blobs:
            mut_pieces, mut_offsets = pack_pieces(mutable.blobs, 1)
            segments.append(mut_pieces)
            program.mutable_data_segments = [P.SubsegmentOffsets(segment_index=1, offsets=mut_offsets)]
        # Delegate payloads follow, one segment each: the emitter's index becomes a segment index.
        first_payload = len(segments)
        segments.extend(payloads)
        for plan in program.execution_plan:
            for d in plan.delegates:
                d.processed.index += first_payload
        # Named data last, one segment per blob, as ExecuTorch lays it out.
        if named_data:
            program.named_data = [P.NamedData(key, len(segments) + i) for i, key in enumerate(named_data)]
            segments.extend(named_data.values())
        self.program = program
        self._pieces = write_pte_pieces(program, segments, segment_alignment=config.segment_alignment,
                                        constant_tensor_alignment=config.constant_tensor_alignment)
        self._buffer: Optional[bytes] = None

    @property
    def buffer(self) -> bytes:
        """The whole .pte in memory (joined on first use; save() does not need it)."""
        if self._buffer is None:
            self._buffer = b"".join(self._pieces)
        return self._buffer

    @property
    def methods(self) -> list[str]:
        return [p.name for p in self.program.execution_plan]

    def exported_program(self, method_name: str = "forward") -> ExportedProgram:
        return self._programs[method_name]

    @property
    def nbytes(self) -> int:
        """The size of the .pte file."""
        return sum(memoryview(piece).nbytes for piece in self._pieces)

    def save(self, path: Union[str, os.PathLike], on_write: Optional[Callable[[int], None]] = None) -> None:
        """Write the .pte; an interrupted save leaves the previous file at `path` as it was.
        ``on_write(n)`` hears of every n bytes written (a progress bar)."""
        atomic_write(path, lambda f: self.write_to_file(f, on_write))

    def write_to_file(self, f, on_write: Optional[Callable[[int], None]] = None) -> None:
        for piece in self._pieces:
            f.write(piece)
            if on_write is not None:
                on_write(memoryview(piece).nbytes)

    def plan_summary(self) -> dict[str, dict[str, int]]:
        """Per method: planned arena bytes and the naive sum of every planned tensor."""
        return {name: {"planned_bytes": planned, "naive_bytes": naive}
                for name, (planned, naive) in self._summary.items()}


def to_edge(programs: Union[ExportedProgram, dict[str, ExportedProgram]],
            constant_methods: Optional[dict[str, Any]] = None,
            compile_config: Optional[EdgeCompileConfig] = None) -> EdgeProgramManager:
    """Decompose exported programs to core ATen and check that execupy can run every op."""
    config = compile_config or EdgeCompileConfig()
    methods = as_method_dict(programs)
    edge = {name: to_edge_program(ep, config, name) for name, ep in methods.items()}
    return EdgeProgramManager(edge, constant_methods, config)


def to_edge_transform_and_lower(
        programs: Union[ExportedProgram, dict[str, ExportedProgram]],
        partitioner: Optional[Union["Partitioner", Sequence["Partitioner"]]] = None,
        transform_passes: Optional[Sequence[Pass]] = None,
        constant_methods: Optional[dict[str, Any]] = None,
        compile_config: Optional[EdgeCompileConfig] = None) -> EdgeProgramManager:
    """ExecuTorch's one-call form: to_edge, then the passes, then each partitioner in turn.

        to_edge_transform_and_lower(export(model, args), partitioner=[XnnpackPartitioner()]).to_executorch()"""
    edge = to_edge(programs, constant_methods, compile_config)
    if transform_passes:
        edge = edge.transform(transform_passes)
    partitioners = [] if partitioner is None else [partitioner] if not isinstance(partitioner, (list, tuple)) \
        else list(partitioner)
    for p in partitioners:
        edge = edge.to_backend(p)
    return edge

