"""Emission: an edge ExportedProgram -> an ExecutionPlan (docs/format.md §11-§22).

`MethodEmitter` walks the graph once, in node order, appending values (docs/format.md §11) and
instructions (docs/format.md §13) as it meets them: placeholders first (constants, mutable state,
user inputs), then for every call its output tensors, its argument values and one
KernelCall on its out variant. Mutated buffers are written back with `aten::copy_` at
the end of the chain (docs/format.md §18); `torch.cond` is inlined with jumps and moves (docs/format.md §19).
Planned tensors get a `Storage` whose lifetime is recorded as instructions are
written; memory_planning places them once the chain is complete.
"""
from __future__ import annotations

import hashlib
import operator
import warnings
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ..errors import ExportError
from ..schema import program as P
from ..runtime.fusion import VIEW_OPS as COPYING_VIEW_OPS
from . import memory_planning as mp
from .backend import ABSORBED, executorch_call_delegate
from .debug_info import HANDLE
from .passes import (
    ASSERT_OPS,
    SYM_OPS,
    resolve_out_variant,
    sym_upper_bound,
    unsupported,
)

ST = P.ScalarType
SCALAR_TYPES: dict[torch.dtype, int] = {
    torch.uint8: ST.BYTE, torch.int8: ST.CHAR, torch.int16: ST.SHORT, torch.int32: ST.INT,
    torch.int64: ST.LONG, torch.float16: ST.HALF, torch.float32: ST.FLOAT, torch.float64: ST.DOUBLE,
    torch.bool: ST.BOOL, torch.bfloat16: ST.BFLOAT16, torch.uint16: ST.UINT16, torch.uint32: ST.UINT32,
    torch.uint64: ST.UINT64, torch.float8_e4m3fn: ST.FLOAT8_E4M3FN, torch.float8_e5m2: ST.FLOAT8_E5M2,
}
VIEW_OPS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}
MEMORY_FORMATS = {torch.contiguous_format: 0, torch.preserve_format: 1}


def scalar_type(dtype: torch.dtype) -> int:
    try:
        return SCALAR_TYPES[dtype]
    except KeyError:
        raise ExportError(f"dtype {dtype} cannot be stored in a .pte program") from None


def tensor_bytes(t: torch.Tensor) -> Union[bytes, memoryview]:
    """Raw contiguous bytes of a real tensor, any dtype: a view of its memory, not a copy
    (the view keeps the memory alive; the writer copies it once, into the file)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else b""


def _all_zeros(t: torch.Tensor) -> bool:
    """Every bit zero (so -0.0 is not: its bytes are not zeros)."""
    raw = t.detach().contiguous().reshape(-1)
    return not raw.numel() or not bool(raw.view(torch.uint8).any())


def treespec_json(spec: pytree.TreeSpec) -> str:
    """torch's JSON pytree serialization, as the reference stores it (docs/format.md §22)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytree.treespec_dumps(spec)


class DataList:
    """A program-wide list of data blobs, entry 0 reserved (docs/format.md §6, §7)."""

    def __init__(self, dedup: bool):
        self.blobs: list[bytes] = []
        self._index: dict[bytes, int] = {}
        self._dedup = dedup

    def add(self, data: bytes) -> int:
        """1-based `data_buffer_idx` of data (the same bytes share one entry if deduplicating)."""
        key = hashlib.sha256(data).digest()
        if self._dedup and key in self._index:
            return self._index[key]
        self.blobs.append(data)
        self._index.setdefault(key, len(self.blobs))
        return len(self.blobs)


Env = dict  # fx.Node -> value index (or list of value indices for multi-output nodes)


class MethodEmitter:
    """Emit one ExportedProgram (already in edge form) as the ExecutionPlan `name`."""

    def __init__(self, name: str, ep: ExportedProgram, constants: DataList, mutable: DataList,
                 payloads: Optional[list[bytes]] = None):
        self.name = name
        self.payloads = payloads if payloads is not None else []  # program-wide delegate payloads
        self.delegates: list[P.BackendDelegate] = []
        self.ep = ep
        self.constants = constants
        self.mutable = mutable
        self.values: list[P.EValue] = []
        self.instructions: list[P.Instruction] = []
        self.operators: list[P.Operator] = []
        self._op_index: dict[tuple[str, str], int] = {}
        self.storages: dict[int, mp.Storage] = {}  # value index -> planned storage
        self.ranges = dict(ep.range_constraints)
        # Devtools maps (nothing of them goes into the plan): instruction -> debug handles of the
        # node(s) it runs, and for DelegateCalls the backend's own map and the number of outputs.
        self.debug_handle_map: dict[int, list[int]] = {}
        self.delegate_map: dict[int, dict[str, Any]] = {}
        self.num_outs_map: dict[int, int] = {}
        self._node: Optional[torch.fx.Node] = None  # the node whose instructions are being written

    # ------------------------------------------------------------------ values

    def _add(self, value: P.EValue) -> int:
        self.values.append(value)
        return len(self.values) - 1

    def _sizes(self, val: torch.Tensor) -> tuple[list[int], int]:
        sizes = [sym_upper_bound(s, self.ranges) for s in val.shape]
        dynamic = any(not isinstance(s, int) for s in val.shape)
        return sizes, (P.TensorShapeDynamism.DYNAMIC_BOUND if dynamic else P.TensorShapeDynamism.STATIC)

    def _tensor(self, val: torch.Tensor, *, planned: bool, data_idx: int = 0) -> int:
        sizes, dynamism = self._sizes(val)
        t = P.Tensor(
            scalar_type=scalar_type(val.dtype), sizes=sizes, dim_order=list(range(len(sizes))),
            requires_grad=bool(val.requires_grad), data_buffer_idx=data_idx, shape_dynamism=dynamism,
        )
        idx = self._add(t)
        if planned:
            numel = 1
            for s in sizes:
                numel *= s
            self.storages[idx] = mp.Storage(numel * val.element_size(), tensors=[t])
        return idx

    def _constant(self, tensor: torch.Tensor) -> int:
        return self._tensor(tensor, planned=False, data_idx=self.constants.add(tensor_bytes(tensor)))

    def _scalar(self, v: Any) -> int:
        value = P.scalar_evalue(v)
        if isinstance(v, torch.dtype):
            value = P.Int(scalar_type(v))
        elif isinstance(v, torch.layout):
            value = P.Int(0 if v == torch.strided else 1)
        elif isinstance(v, torch.memory_format):
            value = P.Int(MEMORY_FORMATS.get(v, 0))
        if value is None:
            raise ExportError(f"cannot encode argument {v!r} of type {type(v).__name__}")
        return self._add(value)

    def _placeholder_scalar(self, val: Any) -> int:
        """A value a symbolic op overwrites at run time (docs/format.md §13: Int 0 / Bool false / Double 0.0)."""
        if isinstance(val, (torch.SymBool, bool)):
            return self._add(P.Bool(False))
        if isinstance(val, (torch.SymFloat, float)):
            return self._add(P.Double(0.0))
        return self._add(P.Int(0))

    def _lift(self, number: Any, node: torch.fx.Node) -> int:
        """A Python number given for a Tensor argument becomes a 0-dim constant tensor,
        typed as torch would promote it against the node's other tensor arguments."""
        tensors = [a.meta["val"] for a in node.args
                   if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        ref = ([t for t in tensors if t.dtype != torch.bool] or tensors or [None])[0]
        if ref is None:
            dtype = torch.tensor(number).dtype
        else:
            dtype = torch.result_type(torch.empty((1,), dtype=ref.dtype), number)
        return self._constant(torch.tensor(number, dtype=dtype))

    def _arg(self, v: Any, jit_type: Any, env: Env, node: torch.fx.Node) -> int:
        """Value index for one argument, creating values for non-node arguments (docs/format.md §13)."""
        if isinstance(jit_type, torch.OptionalType):
            if v is None:
                return self._add(P.Null())
            jit_type = jit_type.getElementType()
        if isinstance(v, torch.fx.Node):
            idx = env[v]
            if isinstance(idx, list):
                raise unsupported(node, f"takes the multi-output node {v.name} as one argument")
            return idx
        if isinstance(jit_type, torch.TensorType):
            if v is None:  # None for a plain Tensor argument: an empty tensor (docs/format.md §13)
                return self._add(P.Tensor(scalar_type=ST.BYTE, sizes=[0], dim_order=[0]))
            if isinstance(v, (int, float, bool)):
                return self._lift(v, node)
        if isinstance(v, (list, tuple)):
            return self._list_arg(list(v), jit_type, env, node)
        return self._scalar(v)

    def _list_arg(self, items: list, jit_type: Any, env: Env, node: torch.fx.Node) -> int:
        elem = jit_type.getElementType() if isinstance(jit_type, torch.ListType) else None
        if isinstance(elem, torch.OptionalType):
            refs = [-1 if x is None else self._arg(x, elem.getElementType(), env, node) for x in items]
            return self._add(P.OptionalTensorList(refs))
        is_tensor = isinstance(elem, torch.TensorType) or (
            elem is None and items and all(isinstance(x, torch.fx.Node)
                                           and isinstance(x.meta.get("val"), torch.Tensor) for x in items)
        )
        if is_tensor:
            return self._add(P.TensorList([self._arg(x, elem, env, node) for x in items]))
        if isinstance(elem, torch.FloatType) or (elem is None and items and all(type(x) is float for x in items)):
            return self._add(P.DoubleList([float(x) for x in items]))
        if isinstance(elem, torch.BoolType) or (elem is None and items and all(type(x) is bool for x in items)):
            return self._add(P.BoolList([bool(x) for x in items]))
        # int / SymInt lists: one Int value per element, then the IntList (docs/format.md §13).
        refs = [self._arg(x, None, env, node) if isinstance(x, torch.fx.Node) else self._add(P.Int(int(x)))
                for x in items]
        return self._add(P.IntList(refs))

    # ------------------------------------------------------------------ instructions

    def _touch(self, idx: int, pc: int) -> None:
        v = self.values[idx] if 0 <= idx < len(self.values) else None
        if isinstance(v, (P.TensorList, P.OptionalTensorList)):
            for j in v.items:
                if j >= 0:
                    self._touch(j, pc)
        elif idx in self.storages:
            self.storages[idx].touch(pc)

    def _instr(self, ins: P.Instruction, touched: Sequence[int]) -> int:
        pc = len(self.instructions)
        self.instructions.append(ins)
        handle = self._node.meta.get(HANDLE) if self._node is not None else None
        if handle is not None:
            self.debug_handle_map[pc] = [handle]
        for idx in touched:
            self._touch(idx, pc)
        return pc

    def _kernel(self, name: str, overload: str, args: list[int]) -> None:
        key = (name, overload)
        if key not in self._op_index:
            self._op_index[key] = len(self.operators)
            self.operators.append(P.Operator(name, overload))
        self._instr(P.KernelCall(self._op_index[key], args), args)
        if self.operators[self._op_index[key]].key in COPYING_VIEW_OPS:
            self._keep_view_source(args[0], args[-1])

    def _keep_view_source(self, src: int, out: int) -> None:
        """A view op's source keeps its bytes while the view's result is read, so a runtime may
        read a view of the source instead of running the copy (execupy's load-time fusion,
        docs/fusion.md; ExecuTorch plans views as shared memory too). Costs arena bytes only
        where the source would otherwise have been reused early."""
        if src in self.storages and out in self.storages:
            self.storages[src].root().outlives.append(self.storages[out])

    # ------------------------------------------------------------------ nodes

    def _outputs(self, node: torch.fx.Node) -> Union[int, list[int]]:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return self._tensor(val, planned=True)
        if isinstance(val, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in val):
            return [self._tensor(v, planned=True) for v in val]
        raise unsupported(node, f"returns {type(val).__name__}, which the emitter cannot plan")

    def emit_node(self, node: torch.fx.Node, env: Env, gm: torch.fx.GraphModule) -> None:
        self._node = node
        target = node.target
        if node.op in ("placeholder", "output", "get_attr"):
            return
        if node.op != "call_function":
            raise unsupported(node, f"is a {node.op} node, which the emitter does not handle")
        if target is operator.getitem:
            env[node] = env[node.args[0]][node.args[1]]
        elif target in ASSERT_OPS:
            return
        elif target in SYM_OPS:
            args = [self._arg(a, None, env, node) for a in node.args]
            ret = self._placeholder_scalar(node.meta.get("val"))
            self._kernel(f"executorch_prim::{SYM_OPS[target]}", "Scalar", args + [ret])
            env[node] = ret
        elif target == torch.ops.aten.sym_size.int:
            args = [self._arg(node.args[0], None, env, node), self._add(P.Int(int(node.args[1])))]
            ret = self._add(P.Int(0))
            self._kernel("aten::sym_size", "int", args + [ret])
            env[node] = ret
        elif target == torch.ops.aten._local_scalar_dense.default:  # tensor.item(): a prim op
            args = [self._arg(node.args[0], None, env, node)]
            ret = self._placeholder_scalar(node.meta.get("val"))
            self._kernel("aten::_local_scalar_dense", "", args + [ret])
            env[node] = ret
        elif target is torch.ops.higher_order.cond:
            self._emit_cond(node, env, gm)
        elif target is executorch_call_delegate:
            self._emit_delegate(node, env, gm)
        elif isinstance(target, torch._ops.OpOverload):
            self._emit_op(node, env)
        else:
            raise unsupported(node, "is not an ATen operator the emitter knows")

    def _emit_static_view(self, node: torch.fx.Node, env: Env) -> bool:
        """A static view of a planned tensor that no graph returns is just another Tensor
        value over its base's bytes: no instruction (docs/format.md §14). Returns False when it is not one."""
        base = node.args[0]
        val = node.meta.get("val")
        if (node.target not in VIEW_OPS or not isinstance(base, torch.fx.Node) or env.get(base) not in self.storages
                or any(u.op == "output" for u in node.users)
                or not all(isinstance(s, int) for s in (*val.shape, *base.meta["val"].shape))):
            return False
        idx = self._tensor(val, planned=True)
        mp.merge(self.storages[env[base]], self.storages[idx])
        env[node] = idx
        return True

    def _emit_op(self, node: torch.fx.Node, env: Env) -> None:
        if self._emit_static_view(node, env):
            return
        try:
            ov = resolve_out_variant(node.target)
        except KeyError as e:
            raise unsupported(node, f"has no out variant ({e})") from None
        outs = self._outputs(node)
        env[node] = outs
        out_list = outs if isinstance(outs, list) else [outs]
        if ov.kind == "dim_order":  # (self, *, non_blocking, dim_order, out) -> out  (docs/format.md §14)
            rank = len(node.meta["val"].shape)
            dim_order = self._add(P.IntList([self._add(P.Int(d)) for d in range(rank)]))
            args = [self._arg(node.args[0], None, env, node),
                    self._add(P.Bool(bool(node.kwargs.get("non_blocking", False)))), dim_order, outs, outs]
            self._kernel(ov.name, ov.overload, args)
            return
        given = dict(zip((a.name for a in node.target._schema.arguments), node.args))
        given.update(node.kwargs)
        args, k = [], 0
        list_out = False
        for a in ov.schema.arguments:
            if a.is_out:
                if str(a.type).startswith("List[Tensor]"):
                    args.append(self._add(P.TensorList(list(out_list))))
                    list_out = True
                else:
                    args.append(out_list[k])
                    k += 1
            elif a.name in given:
                args.append(self._arg(given[a.name], a.type, env, node))
            elif a.has_default_value():
                args.append(self._arg(a.default_value, a.type, env, node))
            else:
                raise unsupported(node, f"gives no value for argument {a.name!r} of {ov.key}")
        # The return slot (docs/format.md §13): the out tensor again, or a TensorList of the outs.
        if list_out or len(out_list) > 1:
            args.append(self._add(P.TensorList(list(out_list))))
        else:
            args.append(out_list[0])
        self._kernel(ov.name, ov.overload, args)

    def _emit_cond(self, node: torch.fx.Node, env: Env, gm: torch.fx.GraphModule) -> None:
        pred, true_ref, false_ref, operands = node.args
        outs = self._outputs(node)
        env[node] = outs
        out_list = outs if isinstance(outs, list) else [outs]
        pred_idx = self._arg(pred, None, env, node)
        operand_idx = [self._arg(o, None, env, node) for o in operands]
        # JumpFalse(pred -> false branch); true branch; JumpFalse(false -> end); false branch.
        to_false = P.JumpFalseCall(pred_idx, -1)
        self._instr(to_false, [pred_idx])
        self._emit_branch(getattr(gm, true_ref.target), operand_idx, out_list, node)
        skip = P.JumpFalseCall(-1, -1)
        self._instr(skip, [])
        to_false.destination_instruction = len(self.instructions)
        self._emit_branch(getattr(gm, false_ref.target), operand_idx, out_list, node)
        skip.cond_value_index = self._add(P.Bool(False))
        skip.destination_instruction = len(self.instructions)

    def _emit_delegate(self, node: torch.fx.Node, env: Env, gm: torch.fx.GraphModule) -> None:
        """A lowered module: one DelegateCall (inputs, then outputs); its payload is
        `payloads[index]`, which the program manager turns into a segment index."""
        lowered = getattr(gm, node.args[0].target)
        ins = [self._arg(a, None, env, node) for a in node.args[1:]]
        outs = self._outputs(node)
        env[node] = outs
        ref = P.BackendDelegateDataReference(location=P.DataLocation.SEGMENT, index=len(self.payloads))
        self.payloads.append(lowered.processed_bytes)
        self.delegates.append(P.BackendDelegate(id=lowered.backend_id, processed=ref,
                                                compile_specs=list(lowered.compile_specs)))
        args = ins + outs
        pc = self._instr(P.DelegateCall(len(self.delegates) - 1, args), args)
        # As ExecuTorch records a delegate: the handles of every op it took over, the backend's
        # own map (its debug ids -> handles) and how many values the call returns.
        self.debug_handle_map[pc] = [n.meta[HANDLE] for n in lowered.original_module.graph.nodes
                                     if n.op == "call_function" and n.meta.get(HANDLE) is not None]
        self.delegate_map[pc] = {"name": lowered.backend_id, "delegate_map": dict(lowered.debug_handle_map)}
        self.num_outs_map[pc] = len(outs)

    def _emit_branch(self, sub: torch.fx.GraphModule, operand_idx: list[int], outs: list[int],
                     cond: torch.fx.Node) -> None:
        first_value = len(self.values)
        env: Env = {}
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for p, idx in zip(placeholders, operand_idx):
            env[p] = idx
        for n in sub.graph.nodes:
            self.emit_node(n, env, sub)
        result = next(n for n in sub.graph.nodes if n.op == "output")
        self._node = cond  # the moves out of a branch are the cond's
        merged: set[int] = set()
        for r, dst in zip(pytree.tree_leaves(result.args[0]), outs):
            src = self._arg(r, None, env, result)
            self._instr(P.MoveCall(src, dst), [src, dst])
            # MoveCall moves the handle (docs/format.md §19): dst then reads src's bytes, so a result
            # computed in this branch shares dst's storage, and anything else must outlive dst.
            if src in self.storages and dst in self.storages:
                if src >= first_value and src not in merged:
                    mp.merge(self.storages[dst], self.storages[src])
                    merged.add(src)
                else:
                    self.storages[src].outlives.append(self.storages[dst])

    # ------------------------------------------------------------------ method

    def emit(self) -> P.ExecutionPlan:
        ep, sig = self.ep, self.ep.graph_signature
        gm = ep.graph_module
        env: Env = {}
        inputs: list[int] = []
        mutated = {s.target: s for s in sig.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
        buffer_values: dict[str, int] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, spec in zip(placeholders, sig.input_specs):
            if node.meta.get(ABSORBED):  # a weight that lives in a delegate payload now
                continue
            env[node] = self._emit_input(node, spec, mutated, buffer_values, inputs)
        for node in gm.graph.nodes:
            self.emit_node(node, env, gm)

        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        outputs, writebacks, writeback_nodes = [], [], []
        for arg, spec in zip(output_node.args[0], sig.output_specs):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                writebacks.append((buffer_values[spec.target], self._arg(arg, None, env, output_node)))
                writeback_nodes.append(arg.args[0] if arg.target is operator.getitem else arg)
            elif spec.kind == OutputKind.USER_OUTPUT:
                outputs.append(self._arg(arg, None, env, output_node) if arg is not None else self._add(P.Null()))
            else:
                raise ExportError(f"method {self.name!r}: output kind {spec.kind.name} is not supported "
                                  f"(e.g. mutating a user input in place); return the new value instead")
        for (buf, new), node in zip(writebacks, writeback_nodes):  # docs/format.md §18: copy the new state in, last
            self._node = node  # the copy belongs to the op that computed the new state
            if new == buf:  # written in place by an op that mutates its argument (llama::update_cache)
                continue
            self._kernel("aten::copy_", "", [buf, new, self._add(P.Bool(False)), buf])
        for idx in outputs:
            self._touch(idx, mp.FOREVER)

        arena = mp.plan(list(self.storages.values()))
        return P.ExecutionPlan(
            name=self.name,
            container_meta_type=P.ContainerMetadata(
                treespec_json(ep.call_spec.in_spec), treespec_json(ep.call_spec.out_spec)),
            values=self.values,
            inputs=inputs,
            outputs=outputs,
            chains=[P.Chain(instructions=self.instructions)],
            operators=self.operators,
            delegates=self.delegates,
            non_const_buffer_sizes=[0, arena],
        )

    def _emit_input(self, node, spec, mutated, buffer_values, inputs) -> int:
        ep = self.ep
        if spec.kind == InputKind.USER_INPUT:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                idx = self._tensor(val, planned=True)
                self.storages[idx].touch(-1)
            else:  # ints/floats/bools are specialised by export and baked in (docs/format.md §12)
                idx = self._scalar(val)
            inputs.append(idx)
            return idx
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            target = spec.target
            tensor = ep.state_dict[target] if target in ep.state_dict else ep.constants[target]
            if spec.kind == InputKind.BUFFER and target in mutated:
                # Mutable state: planned, alive for the whole program. Its initial value is
                # serialized (docs/format.md §7) unless it is all zeros, as KV caches are:
                # planned memory starts zeroed, so the file holds no zeros (a 1B model's
                # caches at 8k context would be gigabytes of them).
                data_idx = 0 if _all_zeros(tensor) else self.mutable.add(bytes(tensor_bytes(tensor)))
                idx = self._tensor(tensor, planned=True, data_idx=data_idx)
                self.storages[idx].touch(-1)
                self.storages[idx].touch(mp.FOREVER)
                buffer_values[target] = idx
                return idx
            return self._constant(tensor)
        raise ExportError(f"method {self.name!r}: input {node.name} of kind {spec.kind.name} is not supported")

    def plan_sizes(self) -> tuple[int, int]:
        """(planned arena bytes, naive sum of all planned tensors)."""
        arena = max((r.root().offset + mp.align_up(r.root().nbytes) for r in self.storages.values()), default=0)
        return arena, mp.naive_size(list(self.storages.values()))


def emit_constant_method(name: str, value: Any, constants: DataList) -> P.ExecutionPlan:
    """A constant method: a plan with no instructions returning its values (docs/format.md §21)."""
    leaves, spec = pytree.tree_flatten(value)
    values = [_constant_value(name, leaf, constants) for leaf in leaves]
    return P.ExecutionPlan(
        name=name,
        container_meta_type=P.ContainerMetadata("", treespec_json(spec)),
        values=values,
        inputs=[],
        outputs=list(range(len(values))),
        chains=[P.Chain()],
        operators=[],
        delegates=[],
        non_const_buffer_sizes=[0],
    )


def _constant_value(method: str, leaf: Any, constants: DataList) -> P.EValue:
    """One returned leaf of a constant method: a constant tensor, a dtype code or a Python scalar."""
    if isinstance(leaf, torch.Tensor):
        return P.Tensor(scalar_type=scalar_type(leaf.dtype), sizes=list(leaf.shape),
                        dim_order=list(range(leaf.dim())), data_buffer_idx=constants.add(tensor_bytes(leaf)))
    if isinstance(leaf, torch.dtype):
        return P.Int(scalar_type(leaf))
    value = None if leaf is None else P.scalar_evalue(leaf)
    if value is None:
        raise ExportError(f"constant method {method!r}: cannot store a {type(leaf).__name__}")
    return value
