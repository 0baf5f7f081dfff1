"""to_edge: decompose an exported program to core ATen and check every op has a kernel.

The edge form execupy uses is plain core ATen (torch's own decomposition table), with
no-op nodes removed. Every call must map to a runtime kernel through its out variant
(passes.resolve_out_variant); a call that does not fails here, with the op, its input
dtypes and the user's source line, rather than at load time on a device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

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
        or to inspect graphs whose kernels are still being written; ops with no out variant
        still fail at to_executorch.
    preserve_ops: ATen ops to keep as they are instead of decomposing them.
    """

    _check_ir_validity: bool = True
    preserve_ops: tuple = field(default_factory=tuple)


def decompose(ep: ExportedProgram, config: EdgeCompileConfig) -> ExportedProgram:
    """Core-ATen decomposition (torch's table), minus the ops the config preserves."""
    table = torch.export.default_decompositions()
    for op in config.preserve_ops:
        table.pop(op, None)
    ep = ep.run_decompositions(table)
    remove_noops(ep.graph_module)
    return restore_inplace_mutations(ep)


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
