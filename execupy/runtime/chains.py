"""Load-time fusion, rule 3: runs of float32 element-wise instructions become one step.

A run is a stretch of consecutive instructions, each an element-wise op of `CHAIN_OPS` on
float32 tensors of static shape (operands broadcast to the out tensor's shape, or scalars).
It becomes one generated Python function (`bind_chain`): no argument checks, no stores, one
step instead of many. Stretches that numba can take (kernels/fast/elementwise.py) become one
compiled loop each; the rest stay the numpy calls the portable kernels make.

Why it is exact and safe:
* The run's instructions are consecutive and nothing else runs among them, so nothing
  outside the run sees a different order of reads and writes.
* Numpy stretches write every op's planned out tensor, in order, with the same ufunc calls.
* A compiled stretch keeps values in registers and stores only those read outside it (or
  pinned: outputs, delegates, moves, implicit views). Its per-element order of reads and
  writes equals the program's whole-tensor order only if no stored value shares memory with
  what the stretch reads, or shares it exactly and is stored after its last read there;
  `_stretch_is_safe` checks that on the planned arrays, else the stretch runs in numpy.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ..kernels.fast import elementwise as ew
from ..kernels.portable.binary import operand
from ..schema import program as P

# operator -> the chain op it is (rsub's operands are swapped into a sub when read)
CHAIN_OPS: dict[str, str] = {
    "aten::add.out": "add", "aten::add.Scalar_out": "add",
    "aten::sub.out": "sub", "aten::sub.Scalar_out": "sub", "aten::rsub.Scalar_out": "rsub",
    "aten::mul.out": "mul", "aten::mul.Scalar_out": "mul",
    "aten::div.out": "div", "aten::div.Scalar_out": "div",
    "aten::neg.out": "neg", "aten::relu.out": "relu", "aten::sqrt.out": "sqrt",
    "aten::exp.out": "exp", "aten::tanh.out": "tanh", "aten::sigmoid.out": "sigmoid",
}
_WITH_ALPHA = ("add", "sub", "rsub")
# Seconds of numba compiling one process may spend on chains; after that they run in numpy
# (a cached kernel costs little of it: numba reads it back from disk).
COMPILE_BUDGET_S = float(os.environ.get("EXECUPY_CHAIN_COMPILE_S", 10))
_compile_spent = [0.0]


@dataclass(frozen=True)
class ChainOp:
    pc: int
    kind: str  # a key of ew.NUMPY_OPS
    operands: tuple[int, ...]  # value ids, in the op's order
    out: int
    readers: frozenset[int]  # pcs of the kernels that read `out`
    kept: bool  # `out` is also read by something that is not a kernel: always stored


def _float32_tensor(g, i: int) -> Optional[P.Tensor]:
    """The plan's tensor i when a chain may read or write it: float32, static, contiguous, bound at load."""
    v = g.value(i)
    if not isinstance(v, P.Tensor) or g.dtype(i) != np.float32 or v.shape_dynamism != 0 or i in g.method._slots:
        return None
    if v.dim_order and list(v.dim_order) != list(range(len(v.sizes))):
        return None
    return v


def _scalar_operand(g, i: int) -> bool:
    v = g.value(i)
    return isinstance(v, (P.Int, P.Double)) and i not in g.method._slots


def chain_op(g, node, aliases: dict) -> Optional[ChainOp]:
    """`node` as a chain op, or None when it cannot be one."""
    kind = CHAIN_OPS.get(node.op)
    if kind is None:
        return None
    arity = ew.ARITY.get(kind, 2)  # rsub: 2
    args, extra = node.args[:arity], node.args[arity:]
    if len(args) != arity:
        return None
    if kind in _WITH_ALPHA:
        if len(extra) > 1 or (extra and not (_scalar_operand(g, extra[0]) and P.scalar_value(g.value(extra[0])) == 1)):
            return None
    elif extra:
        return None
    out = _float32_tensor(g, node.out)
    if out is None or out.allocation_info is None:
        return None
    shapes = []
    for i in args:
        if i in aliases:  # a view fusion does not execute: its consumer reads it through a getter
            return None
        t = _float32_tensor(g, i)
        if t is not None:
            shapes.append(tuple(t.sizes))
        elif not _scalar_operand(g, i):
            return None
    try:
        if np.broadcast_shapes(*shapes, ()) != tuple(out.sizes):
            return None
    except ValueError:
        return None
    if kind == "rsub":  # rsub(a, b) is b - a
        kind, args = "sub", args[::-1]
    return ChainOp(node.pc, kind, tuple(args), node.out, frozenset(g.users.get(node.out, ())),
                   node.out in g.pinned)


def find_chains(g, taken: set[int], aliases: dict) -> list[list[ChainOp]]:
    """The runs of two or more consecutive chain ops among instructions no other rule took."""
    runs, run = [], []
    for pc in range(len(g.writes)):
        node = g.nodes.get(pc)
        op = chain_op(g, node, aliases) if node is not None and pc not in taken else None
        if op is not None:
            run.append(op)
            continue
        if len(run) > 1:
            runs.append(run)
        run = []
    if len(run) > 1:
        runs.append(run)
    return runs


# ---------------------------------------------------------------------------- binding


class _Source:
    """The generated step: lines of calls on objects held in its namespace."""

    def __init__(self):
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = {}

    def name(self, obj: Any, prefix: str) -> str:
        key = f"{prefix}{len(self.namespace)}"
        self.namespace[key] = obj
        return key

    def call(self, fn: Any, args: list[Any]) -> None:
        f = self.name(fn, "f")
        self.lines.append(f"    {f}({', '.join(a if isinstance(a, str) else self.name(a, 'x') for a in args)})")

    def function(self) -> Callable[[], None]:
        text = "def chain_step():\n" + ("\n".join(self.lines) or "    pass") + "\n"
        exec(compile(text, "<execupy elementwise chain>", "exec"), self.namespace)
        return self.namespace["chain_step"]


def bind_chain(method, ops: list[ChainOp]) -> Callable[[], None]:
    """One step running `ops` in order: compiled stretches where numba can, numpy calls elsewhere."""
    source = _Source()
    use_numba = ew.numba_enabled()
    k = 0
    while k < len(ops):
        taken = _bind_stretch(method, ops, k, source) if use_numba else 0
        if not taken:
            op = ops[k]
            source.call(ew.NUMPY_OPS[op.kind], [_numpy_operand(method, i) for i in op.operands] + [method.values[op.out]])
            taken = 1
        k += taken
    return source.function()


def _numpy_operand(method, i: int) -> np.ndarray:
    v = method.values[i]
    return v if isinstance(v, np.ndarray) else operand(v, np.dtype(np.float32))  # as the portable kernel casts


@dataclass
class _Stretch:
    """Ops for one compiled loop, with where each operand comes from."""

    shape: tuple[int, ...]
    ops: list[tuple[str, list[ew.Ref]]]
    inputs: list[np.ndarray]  # flat
    periods: list[int]
    input_ids: dict[int, int]  # value id -> input index
    last_read: dict[int, int]  # input index -> index of the last op reading it
    consts: list[np.float32]
    temps: dict[int, int]  # value id -> op index producing it


def _period(arr: np.ndarray, shape: tuple[int, ...]) -> Optional[int]:
    """How a flat loop over `shape` reads `arr`: every element (0), element 0 (1), i % period."""
    if arr.shape == shape:
        return 0
    if arr.size == 1:
        return 1
    dims = arr.shape
    while dims and dims[0] == 1:
        dims = dims[1:]
    if len(dims) <= len(shape) and tuple(shape[len(shape) - len(dims):]) == dims:
        return math.prod(dims)
    return None


def _grow(method, s: _Stretch, op: ChainOp) -> bool:
    """Add `op` to the stretch when a compiled loop can run it."""
    out = method.values[op.out]
    if op.kind not in ew.NUMBA_OPS or out.shape != s.shape or op.out in s.temps or len(s.ops) >= ew.MAX_KERNEL_OPS:
        return False
    refs: list[ew.Ref] = []
    for i in op.operands:
        if i in s.temps:
            refs.append(("t", s.temps[i]))
            continue
        v = method.values[i]
        if not isinstance(v, np.ndarray):
            s.consts.append(operand(v, np.dtype(np.float32)).reshape(1)[0])
            refs.append(("c", len(s.consts) - 1))
            continue
        j = s.input_ids.get(i)
        if j is None:
            period = _period(v, s.shape)
            if period is None or not v.flags.c_contiguous:
                return False
            j = s.input_ids[i] = len(s.inputs)
            s.inputs.append(v.reshape(-1))
            s.periods.append(period)
        s.last_read[j] = len(s.ops)
        refs.append(("a", j))
    s.temps[op.out] = len(s.ops)
    s.ops.append((op.kind, refs))
    return True


def _bind_stretch(method, ops: list[ChainOp], start: int, source: _Source) -> int:
    """Bind a compiled loop for ops[start:...]; returns how many ops it runs (0: none)."""
    first = method.values[ops[start].out]
    if first.size == 0 or not first.flags.c_contiguous:
        return 0
    s = _Stretch(first.shape, [], [], [], {}, {}, [], {})
    end = start
    while end < len(ops) and _grow(method, s, ops[end]):
        end += 1
    if end - start < ew.MIN_KERNEL_OPS:
        return 0
    pcs = {op.pc for op in ops[start:end]}
    stored = [k for k, op in enumerate(ops[start:end]) if op.kept or not op.readers <= pcs]
    outputs = [method.values[ops[start + k].out].reshape(-1) for k in stored]
    if not _stretch_is_safe(s, stored, outputs):
        return 0
    consts = np.array(s.consts or [0], np.float32)
    args = [first.size, consts, *s.inputs, *outputs]
    if _compile_spent[0] > COMPILE_BUDGET_S:
        return 0
    started = time.perf_counter()
    try:
        kernel = ew.compile_chain(ew.kernel_source(s.ops, s.periods, stored), args)
    except Exception:  # numba refused the source: these ops run in numpy, as unfused
        return 0
    finally:
        _compile_spent[0] += time.perf_counter() - started
    source.call(kernel, [str(first.size)] + args[1:])
    return end - start


def _stretch_is_safe(s: _Stretch, stored: list[int], outputs: list[np.ndarray]) -> bool:
    """The loop reads what the instructions read: no stored value shares memory with another,
    and one that shares an input's memory covers exactly that input, read element for
    element, and is produced at or after the input's last read."""
    for a in range(len(outputs)):
        for b in range(a):
            if np.may_share_memory(outputs[a], outputs[b]):
                return False
    for j, arr in enumerate(s.inputs):
        for k, out in zip(stored, outputs):
            if not np.may_share_memory(arr, out):
                continue
            same = arr.ctypes.data == out.ctypes.data and arr.size == out.size
            if not same or s.periods[j] != 0 or s.last_read[j] > k:
                return False
    return True
