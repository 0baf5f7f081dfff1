"""to_edge: decompose an exported program to core ATen and check every op has a kernel.

The edge form execupy uses is plain core ATen (torch's own decomposition table), with
no-op nodes removed. Every call must map to a runtime kernel through its out variant
(passes.resolve_out_variant). A core ATen op without a kernel (linalg_vector_norm, say)
is decomposed further with torch's own decomposition tables, restricted to the ops that
lack a kernel, until every op has one; ops with a kernel are never touched, so programs
that export without this step come out the same. A call that still has no kernel fails
here, with the op, its input dtypes and the user's source line, rather than at load
time on a device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx
from torch.export import ExportedProgram

from ..errors import ExportError
from .backend import executorch_call_delegate
from .passes import kernel_key, remove_noops, unsupported


@dataclass
class EdgeCompileConfig:
    """Options of to_edge (names follow ExecuTorch's).

    _check_ir_validity: check, at to_edge, transform and to_executorch, that every op has
        an execupy kernel. Turn it off to write programs for another runtime (ExecuTorch's)
        or to inspect graphs whose kernels are still being written; ops without a kernel
        are still decomposed where torch can, and ops with no out variant still fail at
        to_executorch.
    preserve_ops: ATen ops to keep as they are instead of decomposing them.
    """

    _check_ir_validity: bool = True
    preserve_ops: tuple = field(default_factory=tuple)


def decompose(ep: ExportedProgram, config: EdgeCompileConfig) -> ExportedProgram:
    """Core ATen, then the ops left without a kernel decomposed further where torch knows how."""
    return decompose_ops_without_kernels(to_core_aten(ep, config), config)


def to_core_aten(ep: ExportedProgram, config: EdgeCompileConfig) -> ExportedProgram:
    """Core-ATen decomposition (torch's table), minus the ops the config preserves."""
    table = torch.export.default_decompositions()
    for op in config.preserve_ops:
        table.pop(op, None)
    return _run_decompositions(ep, table)


def _run_decompositions(ep: ExportedProgram, table: Any) -> ExportedProgram:
    ep = ep.run_decompositions(table)
    remove_noops(ep.graph_module)
    return restore_inplace_mutations(ep)


# Each round decomposes the ops that lack a kernel; what they decompose into may lack one
# too (a composite op the round kept whole). Real decompositions bottom out in two or three.
MAX_DECOMPOSITION_ROUNDS = 8


def decompose_ops_without_kernels(ep: ExportedProgram, config: EdgeCompileConfig) -> ExportedProgram:
    """Decompose, round by round, every op that has no kernel and has a torch decomposition.

    The table each round runs holds only those ops, so an op with a kernel is kept as it
    is. An op is tried once. It stays when its decomposition gives it back (some apply
    only to some arguments) or leads somewhere worse, to an op with neither a kernel nor
    a decomposition (torch's reference decompositions can end in prims); check_kernels
    then refuses the op the user wrote, not a prim they never heard of.
    """
    tried: set = set(config.preserve_ops)
    for _ in range(MAX_DECOMPOSITION_ROUNDS):
        ops = [op for op in ops_without_kernels(ep) - tried if decomposition_of(op) is not None]
        if not ops:
            break
        tried |= set(ops)
        ep = _decompose_where_it_helps(ep, ops)
    return ep


def _decompose_where_it_helps(ep: ExportedProgram, ops: list) -> ExportedProgram:
    """All of ops' decompositions at once; if that strands an op, one op at a time, keeping
    the decompositions that do not."""
    result = _try_decompose(ep, ops)
    if result is not None or len(ops) == 1:
        return ep if result is None else result
    for op in ops:
        result = _try_decompose(ep, [op])
        ep = ep if result is None else result
    return ep


def _try_decompose(ep: ExportedProgram, ops: list) -> Optional[ExportedProgram]:
    """ep with ops decomposed, or None when that fails or adds an op nothing can run."""
    try:
        result = _run_decompositions(ep, {op: decomposition_of(op) for op in ops})
    except Exception:  # noqa: BLE001  a decomposition that cannot trace here is one torch lacks
        return None
    added = ops_without_kernels(result) - ops_without_kernels(ep)
    return None if any(decomposition_of(op) is None for op in added) else result


def decomposition_of(op: torch._ops.OpOverload) -> Optional[Callable]:
    """torch's decomposition of op: the core-ATen table's, else torch._decomp's full table
    (which also holds decompositions of core ATen ops, such as linalg_vector_norm)."""
    from torch._decomp import decomposition_table

    return _core_aten_decompositions().get(op) or decomposition_table.get(op)


@lru_cache(maxsize=1)
def _core_aten_decompositions() -> dict:
    return torch.export.default_decompositions().materialize()


def has_kernel(node: torch.fx.Node) -> bool:
    """Whether the node needs no kernel or its out variant has one in the kernel table."""
    from ..kernels.registry import get_kernel

    try:
        key = kernel_key(node)
    except KeyError:
        return False
    return key is None or get_kernel(key) is not None


def ops_without_kernels(ep: ExportedProgram) -> set:
    """The ATen overloads called in ep (and its control-flow branches) that have no kernel."""
    return {node.target for gm in _graph_modules(ep.graph_module) for node in gm.graph.nodes
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and not has_kernel(node)}


def restore_inplace_mutations(ep: ExportedProgram) -> ExportedProgram:
    """Turn functionalized calls of mutating custom ops back into the in-place calls.

    Export wraps an op that mutates its argument (llama::update_cache writing a KV-cache
    buffer) in `auto_functionalized`, which means "copy the buffer, mutate the copy, write
    the copy back". Undone, the op writes the buffer where it lives and the buffer's
    mutation output is the buffer itself, so the emitter writes nothing back.
    """
    hops = {torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2}
    if not any(n.target in hops for n in ep.graph.nodes):
        return ep
    from torch.export._remove_auto_functionalized_pass import unsafe_remove_auto_functionalized_pass

    return unsafe_remove_auto_functionalized_pass(ep)


def _graph_modules(gm: torch.fx.GraphModule) -> Iterable[torch.fx.GraphModule]:
    return (m for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


def check_kernels(ep: ExportedProgram, method: str = "forward") -> None:
    """Raise ExportError for the first call node whose out variant has no runtime kernel."""
    from ..runtime import get_kernel

    for gm in _graph_modules(ep.graph_module):
        for node in gm.graph.nodes:
            try:
                key = kernel_key(node)
            except KeyError as e:
                raise unsupported(node, f"cannot run in execupy ({e}); method {method!r}") from None
            if key is not None and get_kernel(key) is None:
                raise unsupported(node, f"needs kernel {key}, which execupy does not have; method {method!r}")


def check_supported_nodes(ep: ExportedProgram) -> None:
    """Structural checks the emitter needs: no while loops, no unknown higher-order ops."""
    for gm in _graph_modules(ep.graph_module):
        for node in gm.graph.nodes:
            target = node.target
            if isinstance(target, torch._ops.HigherOrderOperator) and target not in (
                torch.ops.higher_order.cond, executorch_call_delegate):
                raise unsupported(node, "is control flow execupy cannot emit (only torch.cond is supported)")


def to_edge_program(ep: ExportedProgram, config: EdgeCompileConfig, method: str) -> ExportedProgram:
    if not isinstance(ep, ExportedProgram):
        raise ExportError(f"method {method!r}: expected a torch.export.ExportedProgram, got {type(ep).__name__}")
    ep = decompose(ep, config)
    check_supported_nodes(ep)
    if config._check_ir_validity:
        check_kernels(ep, method)
    return ep


def as_method_dict(programs: Any) -> dict[str, ExportedProgram]:
    if isinstance(programs, ExportedProgram):
        return {"forward": programs}
    if isinstance(programs, dict):
        return dict(programs)
    raise ExportError(f"to_edge takes an ExportedProgram or a dict of them, got {type(programs).__name__}")
