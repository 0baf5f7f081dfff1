"""What a backend runs and what the portable kernels run, read from a `.pte` (torch-free).

The names follow ExecuTorch's `get_delegation_info`: a `DelegationInfo` holds the number of
delegated subgraphs, the delegated and non-delegated node counts and, per op type, a
`DelegationBreakdown` of how many occurrences are delegated and how many are not.

In a `.pte` the graph is gone, so "nodes" are what the file still records: a
non-delegated node is a KernelCall instruction (its op type the operator, e.g.
`aten::cumsum.out`), a delegated node is a node inside a delegate payload (its op type
the node kind, e.g. `Conv2d` for XNNPACK), read by the backend's entry in `READERS`. A
payload no reader understands still counts as a subgraph, with its nodes unknown
(`DelegationInfo.opaque_subgraphs`). The torch side (an exported program before
emission) is `execupy.exir.delegation_info`.

>>> info = get_delegation_info("model.pte")
>>> print(info.get_summary())
>>> print(format_delegation_table(info))
"""
from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..backends.numpy_fused import runtime as numpy_fused
from ..backends.xnnpack import schema as xnn
from ..errors import ExecupyError, MalformedProgramError
from ..runtime.program import Program
from ..schema import program as P

Source = Union[str, os.PathLike, bytes, bytearray, memoryview, Program]


@dataclass
class DelegationBreakdown:
    """Occurrences of one op type inside delegates and outside them."""

    op_type: str = ""
    delegated: int = 0
    non_delegated: int = 0


@dataclass
class DelegationInfo:
    num_delegated_subgraphs: int
    num_delegated_nodes: int
    num_non_delegated_nodes: int
    delegation_by_operator: dict[str, DelegationBreakdown]
    opaque_subgraphs: int = 0  # delegates whose payload no reader here understands (nodes not counted)

    def get_summary(self) -> str:
        lines = [f"Total delegated subgraphs: {self.num_delegated_subgraphs}",
                 f"Number of delegated nodes: {self.num_delegated_nodes}",
                 f"Number of non-delegated nodes: {self.num_non_delegated_nodes}"]
        if self.opaque_subgraphs:
            lines.append(f"Subgraphs whose nodes are unknown (unreadable payload): {self.opaque_subgraphs}")
        return "\n".join(lines) + "\n"

    def get_operator_delegation_table(self) -> list[DelegationBreakdown]:
        """One row per op type, sorted by name, then a "Total" row (what ExecuTorch returns
        as a pandas DataFrame; plain rows here, no pandas needed)."""
        rows = sorted(self.delegation_by_operator.values(), key=lambda r: r.op_type)
        total = DelegationBreakdown("Total", sum(r.delegated for r in rows), sum(r.non_delegated for r in rows))
        return rows + [total]


def delegation_info_from_counts(delegated: Counter, non_delegated: Counter, subgraphs: int,
                                opaque_subgraphs: int = 0) -> DelegationInfo:
    """Build the result from op-type counts (shared by the .pte and the torch side)."""
    by_op: dict[str, DelegationBreakdown] = {}
    for op in sorted(set(delegated) | set(non_delegated)):
        by_op[op] = DelegationBreakdown(op, delegated.get(op, 0), non_delegated.get(op, 0))
    return DelegationInfo(subgraphs, sum(delegated.values()), sum(non_delegated.values()), by_op,
                          opaque_subgraphs)


def format_delegation_table(info: DelegationInfo) -> str:
    """The per-op table as aligned text."""
    rows = [("op_type", "occurrences_in_delegated_graphs", "occurrences_in_non_delegated_graphs")]
    rows += [(r.op_type, str(r.delegated), str(r.non_delegated)) for r in info.get_operator_delegation_table()]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b:>31}  {c:>35}" for a, b, c in rows)


def print_delegation_info(source: Source, method: Optional[str] = None) -> None:
    info = get_delegation_info(source, method)
    print(info.get_summary())
    print(format_delegation_table(info))


# ---------------------------------------------------------------------------- delegate contents


@dataclass
class DelegateContents:
    """What one delegate payload holds, as far as its backend's reader can tell."""

    backend_id: str
    nodes: list[str] = field(default_factory=list)  # node kinds in the payload's order
    datatypes: dict[str, int] = field(default_factory=dict)  # value datatype -> count of values
    named_weight_entries: int = 0  # constants kept in the program's named data
    named_weight_bytes: int = 0
    payload_weight_entries: int = 0  # constants kept inside the payload itself
    payload_weight_bytes: int = 0

    @property
    def node_types(self) -> dict[str, int]:
        """Node kind -> count."""
        return dict(Counter(self.nodes))

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def weight_bytes(self) -> int:
        return self.named_weight_bytes + self.payload_weight_bytes


def _xnnpack_contents(payload: memoryview, named_data: Callable[[str], memoryview]) -> DelegateContents:
    graph = xnn.read_payload(payload)
    out = DelegateContents("XnnpackBackend", [n.kind for n in graph.nodes],
                           dict(Counter(v.datatype for v in graph.values)))
    for ref in graph.constant_data[1:]:  # entry 0 is the reserved "no constant"
        if ref.offset == xnn.NAMED_DATA_OFFSET:
            out.named_weight_entries += 1
            out.named_weight_bytes += len(named_data(ref.named_key))
        else:
            if ref.offset + ref.size > len(graph.constant_bytes):
                raise MalformedProgramError(f"XNNPACK constant at {ref.offset} (+{ref.size}) lies outside the "
                                            f"payload's {len(graph.constant_bytes)} constant bytes")
            out.payload_weight_entries += 1
            out.payload_weight_bytes += ref.size
    return out


def _numpy_fused_contents(payload: memoryview, named_data: Callable[[str], memoryview]) -> DelegateContents:
    try:
        header, weights = numpy_fused.parse(payload)
        ops, constants = header["ops"], header["constants"]
        out = DelegateContents(numpy_fused.BACKEND_ID, [str(op["op"]) for op in ops],
                               {"fp32": header["num_values"]})
        for c in constants:
            count = 1
            for s in c["shape"]:
                count *= int(s)
            out.payload_weight_entries += 1
            out.payload_weight_bytes += 4 * count  # the format stores float32 only
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise MalformedProgramError(f"{numpy_fused.BACKEND_ID} payload: {type(e).__name__}: {e}") from e
    if out.payload_weight_bytes > len(weights):
        raise MalformedProgramError(f"{numpy_fused.BACKEND_ID} payload lists {out.payload_weight_bytes} bytes of "
                                    f"weights but holds {len(weights)}")
    return out


# backend id -> reader of its payload; a backend not listed is counted, but its nodes are unknown
READERS: dict[str, Callable[[memoryview, Callable[[str], memoryview]], DelegateContents]] = {
    "XnnpackBackend": _xnnpack_contents,
    numpy_fused.BACKEND_ID: _numpy_fused_contents,
}


def delegate_contents(program: Program, delegate: P.BackendDelegate) -> Optional[DelegateContents]:
    """The contents of one delegate, or None when no reader knows its backend.
    A malformed payload raises MalformedProgramError naming the backend."""
    reader = READERS.get(delegate.id)
    if reader is None:
        return None
    try:
        return reader(program.delegate_payload(delegate.processed), program.named_data)
    except ExecupyError as e:
        raise type(e)(f"{delegate.id} delegate: {e}") from e


# ---------------------------------------------------------------------------- get_delegation_info


def get_delegation_info(source: Source, method: Optional[str] = None) -> DelegationInfo:
    """Delegation counts of one method of a `.pte` (path, bytes or loaded Program), or of
    all its methods together when `method` is None."""
    program = _load(source)
    names = program.method_names if method is None else [method]  # plan() names a missing method
    delegated: Counter = Counter()
    non_delegated: Counter = Counter()
    subgraphs = opaque = 0
    for name in names:
        plan = program.plan(name)
        non_delegated += kernel_calls(plan)
        for delegate in plan.delegates:
            subgraphs += 1
            contents = delegate_contents(program, delegate)
            if contents is None:
                opaque += 1
            else:
                delegated += Counter(contents.node_types)
    return delegation_info_from_counts(delegated, non_delegated, subgraphs, opaque)


def format_delegated_graph(source: Source, method: Optional[str] = None) -> str:
    """Each method's instructions in order; a delegate call is followed by the nodes its
    payload runs, indented (the .pte counterpart of the torch side's print_delegated_graph)."""
    program = _load(source)
    lines = []
    for name in program.method_names if method is None else [method]:
        plan = program.plan(name)
        lines.append(f"method {name!r}:")
        for k, ins in enumerate(plan.instructions):
            lines += _instruction_lines(program, plan, k, ins)
    return "\n".join(lines)


def print_delegated_graph(source: Source, method: Optional[str] = None) -> None:
    print(format_delegated_graph(source, method))


def _instruction_lines(program: Program, plan: P.ExecutionPlan, k: int, ins: P.Instruction) -> list[str]:
    if isinstance(ins, P.KernelCall):
        ok = 0 <= ins.op_index < len(plan.operators)
        return [f"  {k:4d}  {plan.operators[ins.op_index].key if ok else '<invalid operator>'}"]
    if not isinstance(ins, P.DelegateCall):
        return [f"  {k:4d}  {type(ins).__name__}"]
    if not 0 <= ins.delegate_index < len(plan.delegates):
        raise MalformedProgramError(f"method {plan.name!r}: instruction {k} calls delegate {ins.delegate_index}, "
                                    f"but the method has {len(plan.delegates)}")
    delegate = plan.delegates[ins.delegate_index]
    contents = delegate_contents(program, delegate)
    lines = [f"  {k:4d}  delegate {ins.delegate_index} ({delegate.id})"
             + (": payload not readable here" if contents is None else f": {contents.num_nodes} nodes")]
    return lines + [f"            {kind}" for kind in (contents.nodes if contents else [])]


def _load(source: Source) -> Program:
    if isinstance(source, Program):
        return source
    return Program.load(bytes(source) if isinstance(source, (bytearray, memoryview)) else source)


def kernel_calls(plan: P.ExecutionPlan) -> Counter:
    """Operator key -> number of KernelCall instructions calling it."""
    calls: Counter = Counter()
    for ins in plan.instructions:
        if isinstance(ins, P.KernelCall):
            if not 0 <= ins.op_index < len(plan.operators):
                raise MalformedProgramError(f"method {plan.name!r}: a kernel call names operator {ins.op_index}, "
                                            f"but the method lists {len(plan.operators)}")
            calls[plan.operators[ins.op_index].key] += 1
    return calls
