"""Graph passes and operator facts the emitter relies on.

* `remove_noops`: drop asserts, `detach`, same-dtype `_to_copy` and full-range slices
  (docs/format.md §14: they leave no instruction in the reference either).
* `resolve_out_variant`: the out-variant kernel an ATen node runs as (docs/format.md §13):
  views become their `*_copy` op, casts and clones the `dim_order_ops` kernels, and
  every functional overload its `.out`-style sibling found by schema.
* `fold_constant_transposes`: store a weight the graph only ever transposes already
  transposed, so `nn.Linear` runs as one `mm` with no per-call copy of its weight.
* `sym_upper_bound`: the largest value a symbolic size can take (docs/format.md §16).
* `source_line` / `describe_node`: where a node came from, for error messages.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import torch
import torch.fx

from ..errors import ExportError

aten = torch.ops.aten

# Nodes that only check things at trace time; the runtime has nothing to do for them.
ASSERT_OPS = {
    aten._assert_scalar.default,
    aten._assert_async.msg,
    aten._assert_tensor_metadata.default,
    aten.sym_constrain_range.default,
    aten.sym_constrain_range_for_size.default,
}

# Python-level symbolic arithmetic in exported graphs -> executorch_prim::<name>.Scalar (docs/format.md §13).
SYM_OPS: dict[Any, str] = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.floordiv: "floordiv",
    operator.truediv: "truediv", operator.mod: "mod", operator.eq: "eq", operator.gt: "gt",
    operator.lt: "lt", operator.ge: "ge", operator.le: "le", operator.neg: "neg",
    torch.sym_float: "sym_float", torch.sym_int: "sym_int", math.ceil: "ceil", round: "round",
    math.trunc: "trunc", torch.sym_max: "sym_max", torch.sym_min: "sym_min", torch.sym_not: "sym_not",
    torch.sym_ite: "sym_ite",
}

# Arguments an out variant may legitimately drop: the out tensor carries them.
_TENSOR_OPTIONS = {"dtype", "layout", "device", "pin_memory", "memory_format"}


# ---------------------------------------------------------------------------- out variants


@dataclass(frozen=True)
class OutVariant:
    """How one functional node is emitted as a KernelCall."""

    name: str  # Operator.name, e.g. "aten::add"
    overload: str  # Operator.overload, e.g. "out" ("" = default overload)
    schema: Any  # torch FunctionSchema of the out variant (None for dim_order ops)
    kind: str = "aten"  # "aten" | "dim_order" (casts and clones, docs/format.md §14)

    @property
    def key(self) -> str:
        return f"{self.name}.{self.overload}" if self.overload else self.name


# The dim_order ops are ExecuTorch's own; torch does not know their schemas, so the
# emitter builds their arguments by hand: (self, *, non_blocking, dim_order, out).
TO_DIM_ORDER_COPY = OutVariant("dim_order_ops::_to_dim_order_copy", "out", None, "dim_order")
CLONE_DIM_ORDER = OutVariant("dim_order_ops::_clone_dim_order", "out", None, "dim_order")


def _is_view(op: torch._ops.OpOverload) -> bool:
    schema = op._schema
    return (
        not schema.is_mutable
        and len(schema.returns) >= 1
        and schema.returns[0].alias_info is not None
        and not schema.returns[0].alias_info.is_write
    )


def _copy_op(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """`aten.view.default` -> `aten.view_copy.default` (the functional copy of a view op)."""
    name = op._schema.name.split("::")[1]
    if name == "_unsafe_view":
        return aten.view_copy.default
    packet = getattr(aten, f"{name}_copy", None)
    overload = op._overloadname
    if packet is None or overload not in packet.overloads():
        raise KeyError(f"no copy variant for view op {op}")
    return getattr(packet, overload)


def _signature(schema) -> dict[str, str]:
    return {a.name: str(a.type) for a in schema.arguments if not a.is_out}


@lru_cache(maxsize=None)
def _find_out_overload(op: torch._ops.OpOverload) -> Optional[torch._ops.OpOverload]:
    """The overload of op's packet whose kwarg-only mutable `out` args stand for op's returns."""
    functional = _signature(op._schema)
    n_returns = len(op._schema.returns)
    best, best_score = None, -1
    for name in op.overloadpacket.overloads():
        cand = getattr(op.overloadpacket, name)
        schema = cand._schema
        outs = [a for a in schema.arguments if a.is_out]
        if not outs or not all(a.kwarg_only for a in outs):
            continue
        list_out = len(outs) == 1 and str(outs[0].type).startswith("List[Tensor]")
        if len(outs) != n_returns and not list_out:
            continue
        args = _signature(schema)
        if any(functional.get(k) != t for k, t in args.items()):
            continue  # an argument the functional op lacks, or of another type
        dropped = set(functional) - set(args)
        if dropped - _TENSOR_OPTIONS:
            continue
        score = len(args)
        if score > best_score:
            best, best_score = cand, score
    return best


@lru_cache(maxsize=None)
def resolve_out_variant(op: torch._ops.OpOverload) -> OutVariant:
    """The kernel a functional ATen overload runs as; KeyError when there is none."""
    if op in (aten._to_copy.default,):
        return TO_DIM_ORDER_COPY
    if op in (aten.clone.default,):
        return CLONE_DIM_ORDER
    if op == aten.alias.default:
        op = aten.alias_copy.default
    elif _is_view(op):
        op = _copy_op(op)
    out = _find_out_overload(op)
    if out is None:
        raise KeyError(f"{op} has no out variant")
    name = out._schema.name
    return OutVariant(name, out._schema.overload_name, out._schema)


def kernel_key(node: torch.fx.Node) -> Optional[str]:
    """The runtime kernel key a call node needs, or None for nodes that need no kernel."""
    target = node.target
    if node.op != "call_function" or target is operator.getitem or target in ASSERT_OPS:
        return None
    if target in SYM_OPS:
        return f"executorch_prim::{SYM_OPS[target]}.Scalar"
    if target == aten.sym_size.int:
        return "aten::sym_size.int"
    if target == aten._local_scalar_dense.default:
        return "aten::_local_scalar_dense"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return None  # control flow: checked through its sub-graphs
    if isinstance(target, torch._ops.OpOverload):
        return resolve_out_variant(target).key
    raise KeyError(f"{target} is not an ATen operator")


# ---------------------------------------------------------------------------- no-op removal


def _same_dtype_copy(node: torch.fx.Node) -> bool:
    src = node.args[0]
    if not isinstance(src, torch.fx.Node) or "val" not in src.meta:
        return False
    dtype = node.kwargs.get("dtype")
    fmt = node.kwargs.get("memory_format")
    same_dtype = dtype is None or dtype == src.meta["val"].dtype
    return same_dtype and fmt in (None, torch.preserve_format, torch.contiguous_format)


def _full_slice(node: torch.fx.Node) -> bool:
    src, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0)
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    if not isinstance(src, torch.fx.Node) or step != 1 or start not in (None, 0):
        return False
    size = src.meta["val"].shape[dim]
    if not isinstance(size, int) or (end is not None and not isinstance(end, int)):
        return False
    return end is None or end >= size


def remove_noops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove nodes that compute nothing (in this graph and its control-flow sub-graphs)."""
    for graph_module in gm.modules():
        if not isinstance(graph_module, torch.fx.GraphModule):
            continue
        graph = graph_module.graph
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in ASSERT_OPS and not node.users:
                graph.erase_node(node)
            elif node.target == aten.detach.default or (
                node.target == aten._to_copy.default and _same_dtype_copy(node)
            ) or (node.target == aten.slice.Tensor and _full_slice(node)):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        for node in reversed(list(graph.nodes)):  # the checks the asserts made, now unused
            if node.op == "call_function" and node.target in SYM_OPS and not node.users:
                graph.erase_node(node)
        graph.lint()
        graph_module.recompile()
    return gm


# ---------------------------------------------------------------------------- constant folding

_TRANSPOSES = {aten.permute.default, aten.t.default, aten.transpose.int}


def fold_constant_transposes(ep: "torch.export.ExportedProgram") -> "torch.export.ExportedProgram":
    """Replace each constant that the graph only reads through one transpose by the
    transposed constant (in place; returns ep).

    Core ATen writes ``nn.Linear`` as ``mm(x, permute(W))``, which a runtime runs as a copy of
    the whole weight on every call. Folded, the file stores W already transposed and the
    call is one ``mm``. A constant with other readers (an embedding tied to the output
    head) is left alone: folding it would store the weight twice. Mutable buffers and
    weights absorbed into a delegate are not touched."""
    sig = ep.graph_signature
    targets = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    mutated = set(sig.buffers_to_mutate.values())
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        target = targets.get(node.name) if node.op == "placeholder" else None
        if target is None or target in mutated or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op != "call_function" or user.target not in _TRANSPOSES or user.args[0] is not node:
            continue
        store = ep.state_dict if target in ep.state_dict else ep.constants
        if target not in store:
            continue
        folded = user.target(store[target].detach(), *user.args[1:]).contiguous()
        store[target] = torch.nn.Parameter(folded, requires_grad=False) if isinstance(
            store[target], torch.nn.Parameter) else folded
        node.meta["val"] = user.meta["val"]
        user.replace_all_uses_with(node)
        graph.erase_node(user)
    graph.lint()
    ep.graph_module.recompile()
    return ep


# ---------------------------------------------------------------------------- symbolic sizes


def sym_upper_bound(value: Any, ranges: dict) -> int:
    """Largest value of an int or SymInt, from the export's range constraints."""
    if isinstance(value, int):
        return value
    expr = value.node.expr
    if getattr(expr, "is_number", False):
        return int(expr)
    from torch.utils._sympy.value_ranges import bound_sympy

    shape_env = value.node.shape_env
    var_ranges = dict(getattr(shape_env, "var_to_range", {}) or {})
    var_ranges.update(ranges)
    upper = bound_sympy(expr, var_ranges).upper
    if not getattr(upper, "is_number", False) or not upper.is_integer or bool(upper > 2**31 - 1):
        raise ExportError(
            f"dynamic size {expr} has no upper bound; give torch.export.Dim a max= so memory can be planned"
        )
    return int(upper)


# ---------------------------------------------------------------------------- diagnostics

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def source_line(node: torch.fx.Node) -> str:
    """'file.py:12 in forward: y = ...' for the user's line that produced node."""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.splitlines()
    frames = []
    for i, line in enumerate(lines):
        m = _FRAME.search(line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.search(lines[i + 1]) else ""
            frames.append((m.group(1), m.group(2), m.group(3), code))
    if not frames:
        return "unknown source line"
    user = [f for f in frames if "/torch/" not in f[0]]
    path, lineno, fn, code = (user or frames)[-1]
    return f"{path}:{lineno} in {fn}: {code}" if code else f"{path}:{lineno} in {fn}"


def describe_value(v: Any) -> str:
    if isinstance(v, torch.fx.Node):
        v = v.meta.get("val")
    if isinstance(v, torch.Tensor):
        dtype = str(v.dtype).replace("torch.", "")
        return f"{dtype}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(describe_value(x) for x in v) + "]"
    return type(v).__name__


def input_dtypes(node: torch.fx.Node) -> str:
    parts = [describe_value(a) for a in node.args if isinstance(a, (torch.fx.Node, list, tuple))]
    return ", ".join(parts) or "no tensor inputs"


def unsupported(node: torch.fx.Node, why: str) -> ExportError:
    return ExportError(
        f"operator {node.target} {why}; inputs: {input_dtypes(node)}; at {source_line(node)}"
    )


__all__ = [
    "ASSERT_OPS", "SYM_OPS", "OutVariant", "TO_DIM_ORDER_COPY", "CLONE_DIM_ORDER",
    "resolve_out_variant", "kernel_key", "remove_noops", "fold_constant_transposes", "sym_upper_bound",
    "source_line", "unsupported",
]
