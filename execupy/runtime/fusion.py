"""Load-time fusion: fewer, cheaper steps for the same instruction list.

A Method binds one step per instruction. Before it does, `plan_fusion` reads the
instruction list as a data-flow graph and rewrites it by a small table of rules; the
rules never change what a method computes, only how many Python steps and numpy calls
it takes. The rule (docs/fusion.md says the same for users):

1. **Views are not copies.** A view op (`view_copy`, `et_view`, `unsqueeze_copy`,
   `squeeze_copy`, `permute_copy`, `transpose_copy`, `slice_copy`, `select_copy`,
   `alias_copy`, `expand_copy`) whose result only feeds kernels is not executed: each consumer reads a
   numpy view of the view op's source instead (`Alias`), made contiguous as the copy
   would have been (free for a reshape; a permuted or sliced activation is copied inside
   the consumer's step, so BLAS sees the same layout and rounds the same). Steps whose bits
   cannot depend on layout read the view in place instead (`Method._arg`'s in_place: exact
   element-wise ops, SiLU, add + RMSNorm's add, a large mm on fixed operands). A view of a
   constant with constant arguments is computed once, at load. ExecuTorch also plans
   some views as a second tensor over the same bytes with no instruction: a value read
   that way is always written where the program writes it. This is allowed only when
   nothing between the view op and each consumer writes memory the source shares
   (planned-memory offsets are compared, in-place ops such as `update_cache` count as
   writes), so the consumer sees the same bytes the copy would have held. Exact.
2. **Patterns become one step** (`PATTERNS`, matched on the graph, not on instruction
   positions; every intermediate must feed only the pattern):
   * RMSNorm: `mul(mul(x, rsqrt(add(mean(pow(x, 2) | mul(x, x), [-1], keepdim), eps))), w)`.
   * RoPE (rotate-half): `cat([a*c - b*s, b*c + a*s], -1)`.
   * RoPE (swapped halves, docs/llm-graph.md): `x*cos + cat([x[.., D/2:], x[.., :D/2]], -1)*sin`.
   * Residual add + RMSNorm: `h = add(a, b)` then RMSNorm(h), one step writing both, when
     nothing else runs between them and h's other readers come after.
   * SiLU (the gate of SwiGLU): `mul(g, sigmoid(g))`.
   * Quantized linear (docs/quantized-llm.md): `mm(W, rows)` where
     `W = view(dequantize_per_channel(q, s, None, axis 0) [+ m])` of constants → one
     quantized mat-mul (`execupy.kernels.fast.quantized.qlinear`); the weight is packed
     once at load and never expanded to float32 per call (numba; the numpy fallback
     dequantizes per call as the unfused program did).
   * 8da4w's dynamic quantized linear: the same `mm` of `permute(fake_quantize_per_token(x))`
     (choose_qparams / quantize / dequantize per token; the down projections' in blocks, with
     their clone and views) → one step that rounds the activations, then multiplies.
   * Per-token activation rounding left alone (`fake_quantize_per_token`) → one compiled pass.
   Quantized linears of one input (a layer's q, k, v; gate, up) then share one weight packed
   side by side (`_join_siblings`): the first one's decode step multiplies for all of them and
   the others copy their columns out (a decode mat-vec's outputs do not depend on the columns
   beside them: the same bits); a prompt's rows take each one's own columns. Float32 linears
   of one input whose weights the file keeps one after another are joined alike, read in place
   (`_join_float_siblings`). A tensor's element read again with `item()` (`_local_scalar_dense`
   of the same view of a tensor nothing wrote since) takes the first read's value (`_reuse_scalars`).
   Each fused kernel runs the same float32 operations in the same order as the
   portable kernels it replaces, so results are bit-identical, except the quantized
   linear, which accumulates in a different order (equal within float32 rounding,
   relative 1e-5 of the row's magnitude).
3. **Runs of element-wise ops are one step** (`execupy/runtime/chains.py`): consecutive
   float32 add/sub/mul/div/neg/relu/sqrt/exp/tanh/sigmoid instructions that no rule above
   took become one generated function, numba loops for exactly rounded stretches
   (`execupy.kernels.fast.elementwise`), numpy calls into the planned tensors elsewhere.
   Bit-identical; nothing moves past another instruction.
4. Only float32 patterns fuse; a method with jumps (control flow) is not fused, nor one
   loaded with an EventTracer (tracing needs one step per instruction, so devtools sees
   the program's own instructions), nor any method when `EXECUPY_FUSION=0`
   (`Program.load_method(..., fuse=False)` does the same for one method).

`Method.steps_per_call` counts the steps a call runs after fusion. docs/fusion.md is the
user's version of this rule.
"""
from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..kernels.fast import compiled_decode
from ..kernels.portable._util import norm_dim, same_view
from ..kernels.portable.reduce import SIDE_BY_SIDE_ROWS
from ..kernels.portable.shape import clamp_slice, expanded, slice_index, wrap_index
from ..schema import program as P
from . import blas_threads
from .chains import bind_chain, find_chains


def fusion_enabled() -> bool:
    """Fusion is on unless EXECUPY_FUSION is set to 0/false/off."""
    return os.environ.get("EXECUPY_FUSION", "1").strip().lower() not in ("0", "false", "off", "no")


# ---------------------------------------------------------------------------- the graph


@dataclass
class Node:
    """One kernel instruction: its operator and the value ids it reads and writes."""

    pc: int
    op: str
    args: tuple[int, ...]  # the inputs: every argument but the out tensor and the return slot
    out: int


# Ops that write one of their arguments in place (argument positions).
_IN_PLACE = {"llama::update_cache.out": (1,), "aten::copy_": (0,), "aten::index_put_": (0,),
             "executorch_prim::et_copy_index.tensor": (0,)}


@dataclass
class Graph:
    """The instruction list as data flow, with what is needed to prove a rewrite safe."""

    method: Any
    nodes: dict[int, Node]  # pc -> kernel node
    users: dict[int, list[int]]  # value -> pcs of the kernel nodes that read it
    pinned: set[int]  # values read by something other than a kernel (outputs, moves, delegates, jumps)
    plan_outputs: set[int]
    writes: list[set[int]]  # pc -> values the instruction writes (in place included)
    extent: dict[int, tuple[int, int, int]]  # planned value -> (memory id, start, end) in bytes

    def value(self, i: int) -> Any:
        return self.method.plan.values[i]

    def is_const(self, i: int) -> bool:
        v = self.value(i)
        return isinstance(v, P.Tensor) and v.data_buffer_idx > 0 and v.allocation_info is None

    def dtype(self, i: int) -> Optional[np.dtype]:
        v = self.value(i)
        if not isinstance(v, P.Tensor):
            return None
        try:
            return P.numpy_dtype(v.scalar_type)
        except KeyError:
            return None

    def sole_user(self, i: int) -> Optional[int]:
        """The pc of the only kernel reading value i, when nothing else reads it."""
        users = self.users.get(i, [])
        if i in self.pinned or len(users) != 1:
            return None
        return users[0]

    def producer(self, i: int) -> Optional[Node]:
        pc = self.producers.get(i)
        return None if pc is None else self.nodes.get(pc)

    def overlaps(self, a: int, b: int) -> bool:
        if a == b:
            return True
        ea, eb = self.extent.get(a), self.extent.get(b)
        return ea is not None and eb is not None and ea[0] == eb[0] and ea[1] < eb[2] and eb[1] < ea[2]

    def untouched(self, value: int, after: int, upto: int, skip: frozenset = frozenset()) -> bool:
        """Nothing in pcs (after, upto] outside `skip` writes memory that `value` shares."""
        if self.is_const(value):
            return True
        if upto - after <= _SHORT_SPAN:
            return not any(pc not in skip and any(self.overlaps(value, w) for w in self.writes[pc])
                           for pc in range(after + 1, upto + 1))
        # A long span (a view read layers later): one vectorised test over every write in it.
        index = self._write_index()
        lo, hi = np.searchsorted(index.pc, (after + 1, upto + 1))
        hit = index.value[lo:hi] == value
        e = self.extent.get(value)
        if e is not None:
            hit |= (index.mem[lo:hi] == e[0]) & (index.start[lo:hi] < e[2]) & (index.end[lo:hi] > e[1])
        return all(pc in skip for pc in index.pc[lo:hi][hit].tolist())

    def add_write(self, pc: int, value: int) -> None:
        """Record that a rewrite makes instruction `pc` write `value` as well."""
        self.writes[pc].add(value)
        self._writes_by_pc = None

    def _write_index(self) -> "_Writes":
        if self._writes_by_pc is None:
            self._writes_by_pc = _Writes.of(self.writes, self.extent)
        return self._writes_by_pc

    producers: dict[int, int] = field(default_factory=dict)
    _writes_by_pc: Optional["_Writes"] = None


_SHORT_SPAN = 24  # pcs: below this a plain loop beats numpy's call overhead


@dataclass
class _Writes:
    """Every (instruction, value written) pair as arrays sorted by pc, with the value's planned
    bytes (memory id -1 for a value with none), so a span of a graph is searched at once."""

    pc: np.ndarray
    value: np.ndarray
    mem: np.ndarray
    start: np.ndarray
    end: np.ndarray

    @classmethod
    def of(cls, writes: list[set[int]], extent: dict[int, tuple[int, int, int]]) -> "_Writes":
        pairs = [(pc, w) for pc, written in enumerate(writes) for w in written]
        spans = [extent.get(w, (-1, 0, 0)) for _, w in pairs]
        columns = [np.array([p[k] for p in pairs], np.int64) for k in (0, 1)]
        columns += [np.array([s[k] for s in spans], np.int64) for k in (0, 1, 2)]
        return cls(*columns)


def _tensor_ids(plan: P.ExecutionPlan, i: int) -> list[int]:
    """The tensor values an argument stands for (a tensor list stands for its items)."""
    v = plan.values[i] if 0 <= i < len(plan.values) else None
    if isinstance(v, (P.TensorList, P.OptionalTensorList)):
        return [j for j in v.items if j >= 0]
    return [i]


def build_graph(method) -> Graph:
    plan = method.plan
    nodes: dict[int, Node] = {}
    users: dict[int, list[int]] = {}
    pinned: set[int] = set(plan.outputs)
    writes: list[set[int]] = []
    producers: dict[int, int] = {}
    for pc, ins in enumerate(plan.instructions):
        written: set[int] = set()
        if isinstance(ins, P.KernelCall) and ins.args and 0 <= ins.op_index < len(plan.operators):
            op = plan.operators[ins.op_index].key
            inputs = ins.args[:-1]
            if inputs and inputs[-1] == ins.args[-1]:  # an out variant names its out tensor twice
                inputs = inputs[:-1]
            node = Node(pc, op, tuple(inputs), ins.args[-1])
            nodes[pc] = node
            for a in node.args:
                for t in _tensor_ids(plan, a):
                    users.setdefault(t, []).append(pc)
            written.update(_tensor_ids(plan, node.out))
            for k in _IN_PLACE.get(op, ()):
                if k < len(ins.args):
                    written.update(_tensor_ids(plan, ins.args[k]))
            for t in _tensor_ids(plan, node.out):
                producers[t] = pc
        elif isinstance(ins, P.DelegateCall):
            for a in ins.args:
                pinned.update(_tensor_ids(plan, a))
                written.update(_tensor_ids(plan, a))
        elif isinstance(ins, P.MoveCall):
            pinned.update((ins.move_from, ins.move_to))
            written.add(ins.move_to)
        elif isinstance(ins, P.JumpFalseCall):
            pinned.add(ins.cond_value_index)
        writes.append(written)
    extent = {}
    for i, v in enumerate(plan.values):
        if isinstance(v, P.Tensor) and v.allocation_info is not None:
            try:
                size = math.prod(v.sizes) * P.numpy_dtype(v.scalar_type).itemsize
            except KeyError:
                continue
            start = v.allocation_info.offset
            extent[i] = (v.allocation_info.memory_id, start, start + max(size, 1))
    pinned |= _shadowed(extent, producers, users, writes, set(plan.inputs))
    return Graph(method, nodes, users, pinned, set(plan.outputs), writes, extent, producers)


def _shadowed(extent: dict, producers: dict, users: dict, writes: list, inputs: set) -> set[int]:
    """Values whose bytes are also read under another id that no instruction writes: ExecuTorch
    plans a no-op view as a second tensor over the same memory, without an instruction. What
    such a value reads is what the last instruction before the read wrote there, so that
    write must stay where the program has it."""
    implicit = [i for i in extent if i not in producers and i not in inputs and users.get(i)]
    if not implicit:
        return set()
    mem, start, end = (np.array([extent[i][k] for i in implicit]) for k in range(3))
    last_write: dict[int, set[int]] = {}  # implicit value -> what the latest writer so far wrote over it
    shadowed: set[int] = set()
    reads = {}
    for v in implicit:
        for u in users[v]:
            reads.setdefault(u, []).append(v)
    for pc, written in enumerate(writes):
        for v in reads.get(pc, ()):  # a read sees the writes before its instruction
            shadowed |= last_write.get(v, set())
        hits: dict[int, set[int]] = {}
        for w in written:
            if w in extent:
                m, s, e = extent[w]
                for k in np.flatnonzero((mem == m) & (start < e) & (s < end)):
                    hits.setdefault(implicit[k], set()).add(w)
        last_write.update(hits)
    return shadowed


# ---------------------------------------------------------------------------- rule 1: views


def _reshape(x: np.ndarray, sizes) -> np.ndarray:
    return x.reshape(tuple(int(s) for s in sizes))


def _squeeze(x: np.ndarray, dims) -> np.ndarray:
    if x.ndim == 0:
        return x
    axes = tuple(sorted({d for d in (norm_dim(d, x.ndim) for d in dims) if x.shape[d] == 1}))
    return np.squeeze(x, axis=axes) if axes else x


def _slice(x: np.ndarray, dim, start=None, end=None, step=1) -> np.ndarray:
    dim = norm_dim(dim, x.ndim)
    return x[slice_index(dim, clamp_slice(x.shape[dim], start, end, step))]


def _select(x: np.ndarray, dim, index) -> np.ndarray:
    if x.ndim == 0:
        raise IndexError("select_copy: cannot select from a 0-dim tensor")
    dim = norm_dim(dim, x.ndim)
    return x[slice_index(dim, wrap_index(int(index), x.shape[dim], "select_copy"))]


# op -> the numpy view it computes (argument 0 is the source tensor, the rest its parameters)
VIEW_OPS: dict[str, Callable[..., np.ndarray]] = {
    "aten::view_copy.out": _reshape,
    "executorch_prim::et_view.default": _reshape,
    "aten::unsqueeze_copy.out": lambda x, dim: np.expand_dims(x, norm_dim(dim, x.ndim + 1)),
    "aten::squeeze_copy.dims_out": _squeeze,
    "aten::squeeze_copy.dim_out": lambda x, dim: _squeeze(x, (dim,)),
    "aten::permute_copy.out": lambda x, dims: x.transpose(tuple(norm_dim(d, x.ndim) for d in dims)),
    "aten::transpose_copy.int_out": lambda x, a, b: np.swapaxes(x, norm_dim(a, x.ndim), norm_dim(b, x.ndim)),
    "aten::slice_copy.Tensor_out": _slice,
    "aten::select_copy.int_out": _select,
    "aten::alias_copy.out": lambda x: x,
    # a broadcast is copied where it is read (contiguous); to its own shape (a decomposed bmm's
    # operands: 16 in a BERT-like encoder) it is the source itself, no copy at all
    "aten::expand_copy.out": expanded,
}


@dataclass
class Alias:
    """Value `out` is `view(values[source], *params)`, computed where it is read."""

    out: int
    source: int
    view: Callable[..., np.ndarray]
    params: tuple[int, ...]
    first_pc: int  # where the chain first read its root
    root: int
    constant: bool  # the root is a constant: with constant parameters the view is made once, at load

    def arg(self, method, contiguous: bool = True) -> tuple[bool, Any]:
        """(is_static, value_or_getter), as Method._arg gives: static when everything is."""
        static, src = method._arg(self.source, in_place=not contiguous)  # a chain of views: views all along
        params = [method._arg(p) for p in self.params]
        strided = self.view
        # Contiguous, as the copy kernel's planned output is: a strided operand can take another
        # BLAS or reduction path and round differently. A contiguous view costs no copy.
        # `contiguous=False` leaves the view as it is, for a step that reads all of it before it
        # writes anything and arranges its operands itself (a prompt's quantized linear).
        view = (lambda *a: np.ascontiguousarray(strided(*a))) if contiguous else strided
        if static and all(s for s, _ in params):
            try:
                seen = strided(src, *(p for _, p in params))
                made = np.ascontiguousarray(seen) if contiguous else seen
            except Exception:  # a malformed view: leave the error to the call, as the copy kernel would
                made = None
            # Made once: of a constant, or a true view of a planned array (whose bytes it reads
            # when the consumer runs); a copy of a planned array must be made at each read.
            if made is not None and (self.constant or np.may_share_memory(made, src)):
                return True, made
            if made is not None and np.may_share_memory(seen, src):  # the strided view made once, copied
                return False, lambda: np.ascontiguousarray(seen)  # at each read (RoPE's halves of q, k)
        # Otherwise made at each read: a reshape of a strided array is a copy, not a view.
        getters = [(lambda p=p: p) if s else p for s, p in params]
        get_src = (lambda: src) if static else src
        if not getters:
            return False, lambda: view(get_src())
        if len(getters) == 1:
            g0 = getters[0]
            return False, lambda: view(get_src(), g0())
        return False, lambda: view(get_src(), *[g() for g in getters])


def _slice_step_ok(g: Graph, node: Node) -> bool:
    if node.op != "aten::slice_copy.Tensor_out" or len(node.args) < 5:
        return True
    v = g.value(node.args[4])
    return P.is_scalar(v) and node.args[4] not in g.method._slots and int(P.scalar_value(v)) >= 1


def _viewable(g: Graph, node: Node) -> bool:
    """Structurally, the view op could be read in place by all its users."""
    if node.op not in VIEW_OPS or not node.args or node.out in g.pinned or not _slice_step_ok(g, node):
        return False
    src, out = node.args[0], node.out
    if g.dtype(src) is None or g.dtype(src) != g.dtype(out) or not isinstance(g.value(out), P.Tensor):
        return False
    users = g.users.get(out, [])
    return bool(users) and not any(_written_in_place(g.nodes[u], out) for u in users)


def _written_in_place(node: Node, value: int) -> bool:
    return any(k < len(node.args) and node.args[k] == value for k in _IN_PLACE.get(node.op, ()))


def find_aliases(g: Graph, candidates: set[int], skip: frozenset, skip_fused: frozenset,
                 read_at: dict[int, int]) -> tuple[dict[int, Alias], set[int]]:
    """One round: the candidate view ops whose source still holds its bytes wherever a user
    reads it (`read_at` moves a read into the fused step that swallowed the user), and those
    that fail. Pcs in `skip` are assumed not to run (`skip_fused` for a read in a fused step)."""
    aliases: dict[int, Alias] = {}
    failed = set()
    for pc in sorted(candidates):
        node = g.nodes[pc]
        src, out = node.args[0], node.out
        up = aliases.get(src)
        root, first = (up.root, up.first_pc) if up else (src, pc)
        if all(g.untouched(root, first, read_at[u], skip_fused) if u in read_at else g.untouched(root, first, u, skip)
               for u in g.users[out]):
            aliases[out] = Alias(out, src, VIEW_OPS[node.op], node.args[1:], first, root, g.is_const(root))
        else:
            failed.add(pc)
    return aliases, failed


# ---------------------------------------------------------------------------- rule 2: patterns


@dataclass
class Fused:
    """A pattern found: the pcs it replaces, where its step runs, and how to bind that step."""

    name: str
    pcs: frozenset[int]
    anchor: int  # the last pc; the fused step runs there
    inputs: tuple[int, ...]
    out: int
    bind: Callable[[Any], Callable[[], None]]  # method -> step
    fallback: Optional["Fused"] = None  # the smaller pattern to try when this one is unsafe
    weight: Optional[tuple] = None  # a quantized linear's (q, scales, mins, n, k, group)
    blocks: int = 1  # a dynamic quantized linear's: each row's activations rounded in this many blocks


def _float32(g: Graph, *values: int) -> bool:
    return all(g.dtype(v) == np.float32 for v in values)


def _scalar(g: Graph, i: int) -> Optional[float]:
    v = g.value(i)
    if P.is_scalar(v) and i not in g.method._slots:
        return P.scalar_value(v)
    return None


class _Match:
    """Walks a candidate pattern upwards from its anchor, collecting the pcs it swallows."""

    def __init__(self, g: Graph):
        self.g, self.pcs = g, set()

    def inner(self, value: int, op: str, user: int) -> Optional[Node]:
        """The node producing `value` with operator `op`, when `value` feeds only `user`."""
        g = self.g
        node = g.producer(value)
        if node is None or node.op != op:
            return None
        users = g.users.get(value, [])
        if value in g.pinned or any(u != user for u in users):
            return None
        self.pcs.add(node.pc)
        return node

    def alpha_one(self, node: Node) -> bool:
        return len(node.args) < 3 or _scalar(self.g, node.args[2]) == 1


def _get(method, i: int) -> Callable[[], Any]:
    static, v = method._arg(i)
    return (lambda: v) if static else v


def _get_as_viewed(method, i: int) -> Callable[[], Any]:
    """_get, but a view op's result as the view it is, not made contiguous (Alias.arg)."""
    alias = method._fusion.aliases.get(i) if method._fusion is not None else None
    if alias is None:
        return _get(method, i)
    static, v = alias.arg(method, contiguous=False)
    return (lambda: v) if static else v


def _match_rms_norm(g: Graph, anchor: Node) -> Optional[Fused]:
    """mul(mul(x, rsqrt(add(mean(pow(x,2)), eps))), w), either operand order at each mul."""
    if anchor.op != "aten::mul.out":
        return None
    for inner_ix in (0, 1):
        m = _Match(g)
        m.pcs.add(anchor.pc)
        normed = m.inner(anchor.args[inner_ix], "aten::mul.out", anchor.pc)
        if normed is None:
            continue
        w = anchor.args[1 - inner_ix]
        for r_ix in (1, 0):
            x, r = normed.args[1 - r_ix], normed.args[r_ix]
            rs = m.inner(r, "aten::rsqrt.out", normed.pc)
            add = rs and m.inner(rs.args[0], "aten::add.out", rs.pc)
            if not add or not m.alpha_one(add):
                continue
            mean = m.inner(add.args[0], "aten::mean.out", add.pc)
            eps = add.args[1]
            if not mean or _dims(g, mean) != (-1,) or _scalar(g, mean.args[2]) is not True or (
                    len(mean.args) > 3 and g.value(mean.args[3]) is not None and not isinstance(g.value(mean.args[3]), P.Null)):
                continue
            sq = g.producer(mean.args[0])
            if sq is None or sq.pc in m.pcs or g.sole_user(mean.args[0]) != mean.pc:
                continue
            if sq.op == "aten::pow.Tensor_Scalar_out" and sq.args[0] == x and _scalar(g, sq.args[1]) == 2:
                pass
            elif not (sq.op == "aten::mul.out" and sq.args[0] == x and sq.args[1] == x):
                continue
            m.pcs.add(sq.pc)
            if not _float32(g, x, w, eps, anchor.out) or not _static_eps(g, eps):
                continue
            return Fused("rms_norm", frozenset(m.pcs), anchor.pc, (x, eps, w), anchor.out,
                         lambda method, x=x, eps=eps, w=w: _rms_norm_step(method, x, eps, w, anchor.out))
    return None


def _match_add_rms_norm(g: Graph, anchor: Node) -> Optional[Fused]:
    """h = add(a, b); rms_norm(h): a residual add and the RMSNorm after it, one step writing
    both h and the norm. Only when every instruction between the add and the norm's last is
    part of the norm (so delaying h's write moves it past nothing) and every other reader of h
    comes after."""
    norm = _match_rms_norm(g, anchor)
    if norm is None:
        return None
    h = norm.inputs[0]
    add = g.producer(h)
    if add is None or add.op != "aten::add.out" or add.pc in norm.pcs or len(add.args) < 2 or h in g.pinned:
        return None
    a, b = add.args[:2]
    if not _Match(g).alpha_one(add) or not _float32(g, a, b, h) or not all(
            isinstance(g.value(v), P.Tensor) for v in (a, b)):
        return None
    if any(pc not in norm.pcs for pc in range(add.pc + 1, anchor.pc)) or any(
            u < anchor.pc and u not in norm.pcs for u in g.users.get(h, [])):
        return None
    _, eps, w = norm.inputs
    # h is now written at the anchor: say so, so that a view read later whose source shares h's
    # bytes is checked against this write (harmless if the pattern is dropped: h is live there).
    g.add_write(anchor.pc, h)
    return Fused("add_rms_norm", norm.pcs | {add.pc}, anchor.pc, (a, b, eps, w), anchor.out,
                 lambda method: _add_rms_norm_step(method, a, b, eps, w, h, anchor.out), fallback=norm)


def _add_rms_norm_step(method, a: int, b: int, eps: int, w: int, h: int, out: int):
    direct = _add_rms_norm_into(method, (a, b, eps, w), h, out)  # first: a shape plan's decode step binds it
    if direct is not None:
        return direct
    compiled = compiled_decode()
    if compiled is not None:  # a prompt's rows: the decode kernel's arithmetic, row after row
        return _add_rms_norm_rows_step(method, compiled.add_rms_norm_rows, (a, b, eps, w), h, out)
    ga, gb, ge, gw = (_get(method, i) for i in (a, b, eps, w))
    store_h, store = method._store_fn(h), method._store_fn(out)

    def add_rms_norm_step():
        _add_then_rms_norm(ga(), gb(), ge(), gw(), store_h, store)

    return add_rms_norm_step


def _add_then_rms_norm(xa, xb, eps, w, store_h, store) -> None:
    """h = xa + xb and its RMSNorm through numpy (kernels.fast.rms_norm), each stored."""
    from ..kernels.fast import rms_norm

    total = np.add(xa, xb)
    store_h(total)
    store(rms_norm(total, eps, w))


def _add_rms_norm_rows_step(method, kernel, inputs: tuple[int, ...], h: int, out: int):
    """The compiled rows on what the summands hold, read where they lie (a linear's result is read
    transposed: a contiguous copy of it cost a third of the step), written straight into h's and
    the norm's planned bytes when they are apart from the summands (Method._result_getter:
    no copy after); kernels.fast.rms_norm's numpy ops on anything else."""
    ga, gb = _get_as_viewed(method, inputs[0]), _get_as_viewed(method, inputs[1])
    ge, gw = _get(method, inputs[2]), _get(method, inputs[3])
    store_h, store = method._store_fn(h), method._store_fn(out)
    total_at, normed_at = method._result_getter(h), method._result_getter(out)

    def add_rms_norm_rows_step():
        xa, xb, eps, w = ga(), gb(), ge(), gw()
        rows = _as_rows(xa), _as_rows(xb)
        if rows[0] is None or rows[1] is None or not _float32_rows(w) or xa.shape != xb.shape or w.size != xa.shape[-1] \
                or xa.dtype != np.float32 or xb.dtype != np.float32:
            _add_then_rms_norm(xa, xb, eps, w, store_h, store)
            return
        total = _result_or_new(total_at, xa.shape, (xa, xb))
        normed = _result_or_new(normed_at, xa.shape, (xa, xb, total))
        n = xa.shape[-1]
        kernel(rows[0], rows[1], np.float32(eps), w.reshape(n), total.reshape(-1, n), normed.reshape(-1, n))
        store_h(total)
        store(normed)

    return add_rms_norm_rows_step


def _as_rows(x) -> Optional[np.ndarray]:
    """x [..., n] as a 2-D view [rows, n] in its own layout (a linear's result transposed, say), or
    None when that would take a copy or x is not an array."""
    if not isinstance(x, np.ndarray) or x.ndim < 2 or x.size == 0:
        return None
    if x.ndim == 2:
        return x
    if all(s == 1 for s in x.shape[:-2]) or x.flags.c_contiguous:
        return x.reshape(-1, x.shape[-1])
    return None


def _result_or_new(result_at, shape: tuple[int, ...], inputs: tuple[np.ndarray, ...]) -> np.ndarray:
    """The planned array of `shape` result_at gives (Method._result_getter), unless there is none
    or it shares memory with an input the step still reads; else a new array."""
    array = result_at(shape) if result_at is not None else None
    if array is None or any(np.may_share_memory(array, x) for x in inputs):
        return np.empty(shape, np.float32)
    return array


def _float32_rows(*arrays) -> bool:
    """Every array float32, in C order, with rows (what the compiled row kernels take)."""
    return all(isinstance(t, np.ndarray) and t.dtype == np.float32 and t.flags.c_contiguous and t.ndim >= 1
               and t.size > 0 for t in arrays)


def _scratch(method, role: str, shape: tuple[int, ...]) -> np.ndarray:
    """A float32 work array for in-place steps, one per role and shape in a method: steps run one
    at a time and keep nothing in it between calls, so all steps of a kind share it (a prompt's
    plan would otherwise hold one per layer)."""
    key = ("scratch", role, shape)
    if key not in method._load_cache:
        method._load_cache[key] = np.empty(shape, np.float32)
    return method._load_cache[key]


def _add_rms_norm_into(method, inputs: tuple[int, ...], h: int, out: int):
    """add + RMSNorm written straight into h's and the norm's planned arrays, when every array is
    fixed (a static plan, or a shape plan): the ufunc calls of kernels.fast.rms_norm, one by
    one, each into scratch made at bind time, so no array is allocated and nothing is copied
    after. None when something is read at run time or the arrays are not the plain case."""
    # the summands read where they lie (a prompt's: transposed): the first op, an exact add, writes
    # the contiguous total every later op reads
    parts = [method._arg(i, in_place=k < 2) for k, i in enumerate(inputs)]
    into = method._out_array(h), method._out_array(out)
    if not all(static for static, _ in parts) or any(t is None for t in into):
        return None
    (xa, xb, eps, w), (total, normed) = (p for _, p in parts), into
    arrays = (xa, xb, w, total, normed)
    if not all(isinstance(t, np.ndarray) and t.dtype == np.float32 for t in arrays) or total.ndim == 0:
        return None
    if not xa.shape == xb.shape == total.shape == normed.shape or np.may_share_memory(total, normed):
        return None
    try:
        if np.broadcast_shapes(w.shape, total.shape) != total.shape:
            return None
        eps = np.asarray(eps, np.float32)
    except (ValueError, TypeError):
        return None
    n = total.shape[-1]
    rows = total.size // n
    compiled = compiled_decode()
    if compiled is not None and rows > 1 and w.size == n and total.flags.c_contiguous and normed.flags.c_contiguous:
        a_rows, b_rows = _as_rows(xa), _as_rows(xb)  # a prompt's (a shape plan's): the general step's kernel
        if a_rows is not None and b_rows is not None and not any(
                np.may_share_memory(t, x) for t in (total, normed) for x in (xa, xb)):
            kernel, eps32, weight = compiled.add_rms_norm_rows, np.float32(eps), w.reshape(n)
            total_rows, normed_rows = total.reshape(-1, n), normed.reshape(-1, n)

            def add_rms_norm_rows_into():
                kernel(a_rows, b_rows, eps32, weight, total_rows, normed_rows)

            return add_rms_norm_rows_into
    inv = _scratch(method, "inverse", total.shape[:-1] + (1,))
    # Each row's sum of squares, added in order as the portable mean adds (reduce.row_sums), into
    # `total_of`: many rows side by side through a transposed scratch, a few by running sums.
    if rows >= SIDE_BY_SIDE_ROWS and total.flags.c_contiguous:
        square, total_of = _scratch(method, "square_t", (n, rows)), inv
        total_rows, inv_rows = total.reshape(rows, n), inv.reshape(rows)  # views of the same bytes

        def sum_squares():
            np.square(total_rows.T, out=square)
            np.add.reduce(square, axis=0, out=inv_rows)
    else:
        square, running = _scratch(method, "square", total.shape), _scratch(method, "running", total.shape)
        total_of = running[..., -1:]

        def sum_squares():
            np.square(total, out=square)
            np.cumsum(square, axis=-1, dtype=np.float32, out=running)

    if rows == 1:  # a decode step: the one row's scale in float32 scalars (four ufunc calls less)
        n32, eps32, last = np.float32(n), np.float32(eps), total_of.reshape(-1)
        if compiled is not None and w.size == n and all(t.flags.c_contiguous for t in arrays):
            kernel, flat = compiled.add_rms_norm_row, [t.reshape(-1) for t in arrays]  # views of the same bytes

            def add_rms_norm_compiled(a=flat[0], b=flat[1], w=flat[2], total=flat[3], normed=flat[4]):
                kernel(a, b, eps32, w, total, normed)

            return add_rms_norm_compiled

        def add_rms_norm_row():
            np.add(xa, xb, out=total)
            sum_squares()
            np.multiply(total, np.float32(1) / np.sqrt(last[0] / n32 + eps32), out=normed)
            np.multiply(normed, w, out=normed)

        return add_rms_norm_row

    def add_rms_norm_into():
        np.add(xa, xb, out=total)
        sum_squares()
        np.true_divide(total_of, n, out=inv, dtype=np.float32)
        np.add(inv, eps, out=inv)
        np.sqrt(inv, out=inv)
        np.true_divide(1, inv, out=inv)
        np.multiply(total, inv, out=normed)
        np.multiply(normed, w, out=normed)

    return add_rms_norm_into


def _dims(g: Graph, i: int) -> Optional[tuple]:
    v = g.value(i.args[1] if isinstance(i, Node) else i)
    if isinstance(v, P.IntList) and all(P.is_scalar(g.value(j)) and j not in g.method._slots for j in v.items):
        return tuple(P.scalar_value(g.value(j)) for j in v.items)
    return None


def _static_eps(g: Graph, eps: int) -> bool:
    return g.is_const(eps) or _scalar(g, eps) is not None


def _rms_norm_step(method, x: int, eps: int, w: int, out: int):
    """kernels.fast.rms_norm, or its compiled rows (the same bits) on float32 rows: bound to the
    arrays when they are fixed (the numpy form took 40-55 us on one token's 576 floats)."""
    from ..kernels.fast import rms_norm

    compiled = compiled_decode()
    (sx, vx), (se, ve), (sw, vw) = (method._arg(i) for i in (x, eps, w))
    result = method._out_array(out)
    if compiled is not None and sx and se and sw and _float32_rows(vx, vw, result) and vx.shape == result.shape \
            and vw.size == vx.shape[-1] and np.ndim(ve) == 0:
        n, kernel = vx.shape[-1], compiled.rms_norm_rows
        rows, weight, normed, epsilon = vx.reshape(-1, n), vw.reshape(n), result.reshape(-1, n), np.float32(ve)

        def rms_norm_compiled() -> None:
            kernel(rows, epsilon, weight, normed)

        return rms_norm_compiled
    gx, ge, gw, store = _get(method, x), _get(method, eps), _get(method, w), method._store_fn(out)

    def rms_norm_step():
        xv, e, wv = gx(), ge(), gw()
        if compiled is not None and _float32_rows(xv, wv) and wv.size == xv.shape[-1]:
            normed = np.empty(xv.shape, np.float32)
            compiled.rms_norm_rows(xv.reshape(-1, xv.shape[-1]), np.float32(e), wv.reshape(-1),
                                   normed.reshape(-1, xv.shape[-1]))
            store(normed)
            return
        store(rms_norm(xv, e, wv))

    return rms_norm_step


def _match_rope(g: Graph, anchor: Node) -> Optional[Fused]:
    """cat([a*c - b*s, b*c + a*s], dim=-1): rotate-half rotary embedding."""
    if anchor.op != "aten::cat.out" or len(anchor.args) < 2:
        return None
    parts = g.value(anchor.args[0])
    dim = _scalar(g, anchor.args[1])
    if not isinstance(parts, P.TensorList) or len(parts.items) != 2 or dim is None:
        return None
    m = _Match(g)
    m.pcs.add(anchor.pc)
    sub = m.inner(parts.items[0], "aten::sub.out", anchor.pc)
    add = m.inner(parts.items[1], "aten::add.out", anchor.pc)
    if not sub or not add or not m.alpha_one(sub) or not m.alpha_one(add):
        return None
    ac, bs = (m.inner(v, "aten::mul.out", sub.pc) for v in sub.args[:2])
    bc, as_ = (m.inner(v, "aten::mul.out", add.pc) for v in add.args[:2])
    if not all((ac, bs, bc, as_)):
        return None
    a, c = ac.args[0], ac.args[1]
    b, s = bs.args[0], bs.args[1]
    if {bc.args[0], bc.args[1]} != {b, c} or {as_.args[0], as_.args[1]} != {a, s} or len({a, b, c, s}) != 4:
        return None
    if not _float32(g, a, b, c, s, anchor.out):
        return None
    inputs = (a, b, c, s)
    return Fused("rope", frozenset(m.pcs), anchor.pc, inputs, anchor.out,
                 lambda method: _rope_step(method, inputs, int(dim), anchor.out))


def _rope_step(method, inputs, dim: int, out: int):
    from ..kernels.fast import rope

    ga, gb, gc, gs = (_get(method, i) for i in inputs)
    store = method._store_fn(out)

    def rope_step():
        store(rope(ga(), gb(), gc(), gs(), dim))

    return rope_step


def _match_rope_swapped(g: Graph, anchor: Node) -> Optional[Fused]:
    """x*cos + cat([x[..., D/2:], x[..., :D/2]], -1)*sin: rotary embedding with pre-signed
    tables (docs/llm-graph.md), either operand order of each add and mul."""
    if anchor.op != "aten::add.out" or len(anchor.args) < 2:
        return None
    for order in ((0, 1), (1, 0)):
        m = _Match(g)
        m.pcs.add(anchor.pc)
        if not m.alpha_one(anchor):
            return None
        direct = m.inner(anchor.args[order[0]], "aten::mul.out", anchor.pc)
        rotated = direct and m.inner(anchor.args[order[1]], "aten::mul.out", anchor.pc)
        if not rotated:
            continue
        for cat_ix in (0, 1):
            cat = g.producer(rotated.args[cat_ix])
            if cat is None or cat.op != "aten::cat.out" or cat.pc in m.pcs:
                continue
            sin = rotated.args[1 - cat_ix]
            x = _swapped_halves_of(g, m, cat, rotated.pc)
            if x is None or x not in direct.args[:2] or len(direct.args) < 2:
                continue
            cos = direct.args[1] if direct.args[0] == x else direct.args[0]
            if not _float32(g, x, cos, sin, direct.out, rotated.out, cat.out, anchor.out):
                continue
            inputs = (x, cos, sin)
            return Fused("rope", frozenset(m.pcs), anchor.pc, inputs, anchor.out,
                         lambda method: _rope_swapped_step(method, inputs, anchor.out))
    return None


def _swapped_halves_of(g: Graph, m: _Match, cat: Node, user: int) -> Optional[int]:
    """x, when `cat` is cat([slice(x, -1, D/2, D), slice(x, -1, 0, D/2)], -1) read only by `user`."""
    parts = g.value(cat.args[0])
    if not isinstance(parts, P.TensorList) or len(parts.items) != 2 or g.sole_user(cat.out) != user:
        return None
    slices = [g.producer(v) for v in parts.items]
    if any(s is None or s.op != "aten::slice_copy.Tensor_out" or len(s.args) < 5 or g.sole_user(s.out) != cat.pc
           for s in slices) or slices[0].args[0] != slices[1].args[0]:
        return None
    x = slices[0].args[0]
    sizes = getattr(g.value(x), "sizes", None)
    if not sizes or sizes[-1] % 2 or _scalar(g, cat.args[1]) not in (-1, len(sizes) - 1):
        return None
    d = sizes[-1]
    bounds = []
    for s in slices:
        dim, start, end, step = (_scalar(g, a) for a in s.args[1:5])
        if dim not in (-1, len(sizes) - 1) or step != 1 or start is None or end is None:
            return None
        bounds.append(clamp_slice(d, start, end, 1))
    if bounds != [slice(d // 2, d, 1), slice(0, d // 2, 1)]:
        return None
    m.pcs.update((cat.pc, slices[0].pc, slices[1].pc))
    return x


def _rope_swapped_step(method, inputs, out: int):
    from ..kernels.fast import rope_swapped

    direct = _rope_swapped_into(method, inputs, out)  # first: a shape plan's decode step binds it
    if direct is not None:
        return direct
    gx, gc, gs = (_get(method, i) for i in inputs)
    store = method._store_fn(out)

    compiled = compiled_decode()

    def rope_swapped_step():
        x, cos, sin = gx(), gc(), gs()
        if compiled is not None and _float32_rows(x, cos, sin) and x.ndim >= 2 and x.shape[-1] % 2 == 0 \
                and cos.shape == sin.shape == x.shape[:-2] + (1, x.shape[-1]):
            d, heads = x.shape[-1], x.shape[-2]  # a prompt's rows, each position's tables for all its heads
            out = np.empty(x.shape, np.float32)
            compiled.rope_swapped_positions(x.reshape(-1, heads, d), cos.reshape(-1, d), sin.reshape(-1, d),
                                            out.reshape(-1, heads, d))
            store(out)
            return
        store(rope_swapped(x, cos, sin))

    return rope_swapped_step


def _rope_swapped_into(method, inputs, out: int):
    """kernels.fast.rope_swapped's operations written into the planned output and scratch made
    at bind time, when every array is fixed and the output shares memory with no input."""
    parts = [method._arg(i) for i in inputs]
    result = method._out_array(out)
    if not all(static for static, _ in parts) or result is None:
        return None
    x, cos, sin = (p for _, p in parts)
    arrays = (x, cos, sin, result)
    if not all(isinstance(t, np.ndarray) and t.dtype == np.float32 for t in arrays) or x.ndim == 0:
        return None
    if x.shape != result.shape or x.shape[-1] % 2 or any(np.may_share_memory(t, result) for t in (x, cos, sin)):
        return None
    try:
        if np.broadcast_shapes(x.shape, cos.shape, sin.shape) != x.shape:
            return None
    except ValueError:
        return None
    half, d = x.shape[-1] // 2, x.shape[-1]
    compiled = compiled_decode()
    if (compiled is not None and cos.size == sin.size == d and x.flags.c_contiguous and result.flags.c_contiguous
            and cos.flags.c_contiguous and sin.flags.c_contiguous):  # one position's tables for every row: decode
        kernel, rows, table_cos, table_sin = compiled.rope_swapped_rows, x.reshape(-1, d), cos.reshape(d), sin.reshape(d)
        rows_out = result.reshape(-1, d)

        def rope_swapped_compiled():
            kernel(rows, table_cos, table_sin, rows_out)

        return rope_swapped_compiled
    swapped = _scratch(method, "swapped", x.shape)
    low, high = x[..., :half], x[..., half:]
    to_low, to_high = swapped[..., :half], swapped[..., half:]

    def rope_swapped_into():
        np.copyto(to_low, high)
        np.copyto(to_high, low)
        np.multiply(x, cos, out=result)
        np.multiply(swapped, sin, out=swapped)
        np.add(result, swapped, out=result)

    return rope_swapped_into


def _match_silu(g: Graph, anchor: Node) -> Optional[Fused]:
    """mul(g, sigmoid(g)): SiLU, the gate of SwiGLU. (Fusing the up-projection's mul as well
    would move the gate's read after the up-projection, which often reuses the gate's bytes.)"""
    if anchor.op != "aten::mul.out":
        return None
    for sig_ix in (1, 0):
        m = _Match(g)
        m.pcs.add(anchor.pc)
        gate = anchor.args[1 - sig_ix]
        sig = m.inner(anchor.args[sig_ix], "aten::sigmoid.out", anchor.pc)
        if sig is None or sig.args[0] != gate or not _float32(g, gate, anchor.out):
            continue
        return Fused("silu", frozenset(m.pcs), anchor.pc, (gate,), anchor.out,
                     lambda method: _silu_step(method, gate, anchor.out))
    return None


def _silu_step(method, gate: int, out: int):
    """kernels.fast.silu's ufunc calls written into the planned output when gate's array and
    out's are fixed and apart (no array made or copied per call), else silu on what gate holds."""
    from ..kernels.fast import compiled_silu
    from ..kernels.fast.elementwise import NUMPY_OPS

    # the gate read where it lies (a prompt's: transposed): sigmoid's first op (negate, exact) makes
    # the contiguous array its exp runs on, so the bits are the contiguous copy's
    static, x = method._arg(gate, in_place=True)
    result = method._out_array(out)
    if not static or not all(isinstance(t, np.ndarray) and t.dtype == np.float32 for t in (x, result)) or \
            x.shape != result.shape or np.may_share_memory(x, result):
        return _silu_as_laid_out(method, gate, out)
    compiled = compiled_silu(x, result)  # numba loaded, x and result laid out alike: numpy's exp, one pass
    if compiled is not None:
        return compiled
    sigmoid = NUMPY_OPS["sigmoid"]

    def silu_into():
        sigmoid(x, result)
        np.multiply(x, result, out=result)

    return silu_into


def _silu_as_laid_out(method, gate: int, out: int):
    """silu on whatever the gate holds, read where it lies: a prompt's gate is the linear's result
    transposed, and numpy's element-wise ops keep that layout in what they make (the same
    operations on each element: the same bits), so neither the gate nor the result goes
    through a transposing copy, and the up-projection's multiply reads two arrays of one layout
    (SmolLM2, 113 tokens: 478 + 231 us a layer for silu and that multiply, 235 + 113 after, with
    the compiled pass and the result written into its planned bytes)."""
    from ..kernels.fast import compiled_silu, silu

    get, store, result_at = _get_as_viewed(method, gate), method._store_fn(out), method._result_getter(out)
    decode = compiled_decode() if result_at is not None else None

    def silu_step():
        x = get()
        if decode is not None and isinstance(x, np.ndarray) and x.dtype == np.float32:
            # straight into the planned bytes, in x's layout (then the store has nothing to copy)
            result = result_at(x.shape, transposed=x.ndim == 2 and not x.flags.c_contiguous)
            compiled = compiled_silu(x, result, decode) if result is not None else None
            if compiled is not None:
                compiled()
                store(result)
                return
        store(silu(x))

    return silu_step


def _unary_step(method, module: str, kernel: str, x: int, out: int):
    """A fused step out = kernel(x), the kernel looked up in `module` when the step is bound."""
    fn = getattr(importlib.import_module(module), kernel)
    gx, store = _get(method, x), method._store_fn(out)

    def unary_step():
        store(fn(gx()))

    return unary_step


_CHOOSE_PER_TOKEN = "quantized_decomposed::choose_qparams_per_token_asymmetric.out"
_QUANTIZE_PER_TOKEN = "quantized_decomposed::quantize_per_token.out"
_DEQUANTIZE_PER_TOKEN = "quantized_decomposed::dequantize_per_token.out"
_INT8, _FLOAT32 = 1, 6  # ScalarType codes


def _match_fake_quantize_per_token(g: Graph, anchor: Node) -> Optional[Fused]:
    """dequantize_per_token(quantize_per_token(x, s, z), s, z) with (s, z) the
    choose_qparams_per_token_asymmetric of x, int8, float64 scales: the dynamic activations of
    8da4w/8da8w linears (docs/quantized-llm.md), one compiled pass per row instead of three kernels."""
    if anchor.op != _DEQUANTIZE_PER_TOKEN or len(anchor.args) < 7:
        return None
    q, s, z = anchor.args[:3]
    quant, choose = g.producer(q), g.producer(s)
    if (quant is None or quant.op != _QUANTIZE_PER_TOKEN or len(quant.args) < 6 or tuple(quant.args[1:3]) != (s, z)
            or choose is None or choose.op != _CHOOSE_PER_TOKEN or g.producer(z) is not choose
            or not choose.args or choose.args[0] != quant.args[0]):
        return None
    x, pcs = quant.args[0], {anchor.pc, quant.pc, choose.pc}
    if any(v in g.pinned or any(u not in pcs for u in g.users.get(v, [])) for v in (q, s, z)):
        return None
    int8_range = [_scalar(g, a) for a in quant.args[3:6]] + [_scalar(g, a) for a in anchor.args[3:7]]
    if int8_range != [-128, 127, _INT8, -128, 127, _INT8, _FLOAT32]:
        return None
    if not (_float32(g, x, anchor.out) and g.dtype(s) == np.float64 and g.dtype(z) == np.int64):
        return None
    return Fused("fake_quantize_per_token", frozenset(pcs), anchor.pc, (x,), anchor.out,
                 lambda method: _fake_quantize_step(method, x, anchor.out))


def _fake_quantize_step(method, x: int, out: int):
    """The compiled kernel straight from x's array into out's when both are fixed (a shape plan),
    else fake_quantize_per_token on whatever x holds."""
    from ..kernels.fast import quantized

    bind = quantized.bind_fake_quantize_per_token
    static, rows = method._arg(x)
    result = method._out_array(out)
    if bind is not None and static and all(isinstance(t, np.ndarray) and t.dtype == np.float32 and t.flags.c_contiguous
                                           for t in (rows, result)):
        if rows.shape == result.shape and rows.ndim and not np.may_share_memory(rows, result):
            return bind(rows, result)
    return _unary_step(method, "execupy.kernels.fast.quantized", "fake_quantize_per_token", x, out)


_DEQUANTIZE = "quantized_decomposed::dequantize_per_channel.out"
_VIEW_COPY = "aten::view_copy.out"


def _match_quantized_linear(g: Graph, anchor: Node) -> Optional[Fused]:
    """mm(W, xT) where W = view_copy([add(] dequantize_per_channel(q, s, None, axis 0) [, m)])
    of constants only (docs/quantized-llm.md): one quantized mat-mul on the packed weight."""
    if anchor.op != "aten::mm.out" or len(anchor.args) != 2:
        return None
    m = _Match(g)
    m.pcs.add(anchor.pc)
    w, rows = anchor.args
    node = g.producer(w)
    if node is None:  # ExecuTorch's planner made the weight's view a second tensor over the same bytes
        w = _planned_view_source(g, w, anchor.pc)
        if w is None:
            return None
        node = g.producer(w)
    if node is not None and node.op == _VIEW_COPY:
        node = m.inner(w, _VIEW_COPY, anchor.pc)
        w = node.args[0]
    mins = None
    add = g.producer(w)
    if add is not None and add.op == "aten::add.out":
        add = m.inner(w, "aten::add.out", node.pc if node is not None and node.op == _VIEW_COPY else anchor.pc)
        if add is None or not m.alpha_one(add) or not g.is_const(add.args[1]):
            return None
        w, mins = add.args[0], add.args[1]
    user = add.pc if mins is not None else (node.pc if node is not None and node.op == _VIEW_COPY else anchor.pc)
    dq = m.inner(w, _DEQUANTIZE, user)
    if dq is None or len(dq.args) < 7:
        return None
    q, scales, zeros, axis = dq.args[:4]
    if not (g.is_const(q) and g.is_const(scales) and isinstance(g.value(zeros), P.Null) and _scalar(g, axis) == 0):
        return None
    n, k = g.value(anchor.args[0]).sizes
    qshape = list(g.value(q).sizes)
    if len(qshape) != 2 or qshape[0] * qshape[1] != n * k or not _float32(g, rows, anchor.out, dq.out):
        return None
    group = qshape[1] if qshape[0] != n else k  # [N*K/G, G] groups, or [N, K] one scale per row
    groups = n * k // group if group and not k % group else 0
    if not groups or math.prod(g.value(scales).sizes) != groups or not _float32(g, scales) or (
            mins is not None and (math.prod(g.value(mins).sizes) != groups or not _float32(g, mins))):
        return None
    weight = (q, scales, mins, n, k, group)
    plain = Fused("quantized_linear", frozenset(m.pcs), anchor.pc, (rows,), anchor.out,
                  lambda method: _quantized_linear_step(method, weight, rows, anchor.out), weight=weight)
    rounded = _fake_quantized_rows(g, rows, anchor.pc, k)
    if rounded is None:
        return plain
    x, pcs, blocks = rounded
    return Fused("dynamic_quantized_linear", frozenset(m.pcs | pcs), anchor.pc, (x,), anchor.out,
                 lambda method: _dynamic_linear_step(method, weight, x, anchor.out, blocks), fallback=plain,
                 weight=weight, blocks=blocks)


def _fake_quantized_rows(g: Graph, rows: int, pc: int, k: int) -> Optional[tuple[int, set[int], int]]:
    """(x, pcs, blocks) when `rows`, read at pc alone, is an 8da4w linear's activations:
    permute(fake_quantize_per_token(x), [1, 0]), x [T, K] rounded to int8 per token and transposed
    for mm(W, rows); or x rounded in `blocks` blocks per token (docs/quantized-llm.md's down
    projections): view(fake_quantize_per_token(view(clone(x), [T * blocks, K / blocks])), [T, K])."""
    permute = g.producer(rows)
    if permute is None or permute.op != "aten::permute_copy.out" or g.sole_user(rows) != pc:
        return None
    if _dims(g, permute) not in ((1, 0), (-1, -2), (1, -2), (-1, 0)) or len(g.value(rows).sizes) != 2:
        return None
    pcs, rounded = {permute.pc}, permute.args[0]
    node = g.producer(rounded)
    if node is not None and node.op == _VIEW_COPY and g.sole_user(rounded) == permute.pc:  # blocks viewed back
        pcs.add(node.pc)
        rounded, node = node.args[0], g.producer(node.args[0])
    f = _match_fake_quantize_per_token(g, node) if node is not None else None
    if f is None or g.sole_user(rounded) not in pcs:
        return None
    pcs |= f.pcs
    x, sizes = f.inputs[0], g.value(f.inputs[0]).sizes
    if len(sizes) != 2 or not sizes[1] or k % sizes[1]:
        return None
    blocks = k // sizes[1]
    if blocks == 1:
        return x, pcs, 1
    # [T * blocks, K / blocks] = view(clone(x)): the clone made the view's input contiguous
    view = g.producer(x)
    if view is None or view.op != _VIEW_COPY or any(u not in f.pcs for u in g.users.get(x, [])) or x in g.pinned:
        return None
    clone = g.producer(view.args[0])
    if (clone is None or clone.op != "dim_order_ops::_clone_dim_order.out" or g.sole_user(view.args[0]) != view.pc
            or len(g.value(clone.args[0]).sizes) != 2
            or not (isinstance(g.value(clone.args[2]), P.Null) or _dims(g, clone.args[2]) == (0, 1))):
        return None
    return clone.args[0], pcs | {view.pc, clone.pc}, blocks


def _planned_view_source(g: Graph, v: int, pc: int) -> Optional[int]:
    """The value whose bytes `v` views when no instruction writes `v`: the last one written
    before `pc` over exactly v's bytes, read by nothing else, with `v` read only at `pc`."""
    if g.users.get(v) != [pc] or v in g.plan_outputs or v not in g.extent:
        return None
    for at in range(pc - 1, -1, -1):
        hit = [w for w in g.writes[at] if g.overlaps(w, v)]
        if hit:
            (src,) = hit if len(hit) == 1 else (None,)
            if src is None or g.extent.get(src) != g.extent[v] or g.users.get(src):
                return None
            g.pinned.discard(src)  # pinned only because v reads it, and v is read by this pattern alone
            return src
    return None


def _packed_weight(method, weight: tuple):
    """The weight (q, scales, mins, n, k, group) laid out for the quantized kernels, once per method."""
    from ..kernels.fast.quantized import pack

    q, scales, mins, n, k, group = weight
    packed = method._load_cache.get(("packed", q))
    if packed is None:  # packed once per method: a shape plan rebinds this step with the same weight
        values = method.values
        packed = method._load_cache[("packed", q)] = pack(values[q].reshape(n, k), values[scales], None, group,
                                                          None if mins is None else values[mins])
        method.program.release_pages(values[q])  # the packed copy is what the step reads from now on
    return packed


def _rows_times(packed, columns: Optional[slice] = None) -> Callable[[np.ndarray], np.ndarray]:
    """x [T, K] -> x @ w.T [T, N] (only `columns` of it when given) for a packed weight: the
    compiled mat-vec for a few rows (it chooses its own threads; all columns), else the columns
    in halves, one per core, each with BLAS on one thread. As fast as OpenBLAS's own threads on
    SmolLM2's 113-token prompt (int4: 0.20-0.22 s either way), and those would spin for 0.1 s
    after it, beside the second core's thread of the first decode steps (9.5 ms a token then, 6.7 after)."""
    from ..kernels.fast.quantized import BLAS_MIN_ROWS, qlinear, qlinear_columns

    j0, j1 = (0, packed.shape[0]) if columns is None else (columns.start, columns.stop)
    both, middle = blas_threads.both, (j0 + j1) // 2

    def rows_times(x: np.ndarray) -> np.ndarray:
        if x.shape[0] < BLAS_MIN_ROWS:
            return qlinear(x, packed)[:, j0:j1]
        x, y = np.ascontiguousarray(x, np.float32), np.empty((x.shape[0], j1 - j0), np.float32)
        both(lambda: qlinear_columns(x, packed, j0, middle, y[:, :middle - j0]),
             lambda: qlinear_columns(x, packed, middle, j1, y[:, middle - j0:]))
        return y

    return rows_times


def _quantized_linear_step(method, weight: tuple, rows: int, out: int):
    from ..kernels.fast.quantized import bind_matvec

    packed = _packed_weight(method, weight)
    direct = _quantized_matvec_into(method, bind_matvec, packed, rows, out) if bind_matvec is not None else None
    if direct is not None:
        return direct
    # The rows as viewed: a prompt's [K, T] is the transpose of the norm's [T, K], which the step
    # reads as it is (a copy made contiguous here would be transposed straight back)
    get_rows, store, rows_times = _get_as_viewed(method, rows), method._store_fn(out), _rows_times(packed)

    def quantized_linear_step():
        store(rows_times(get_rows().T).T)  # mm(W, rows) = (rows.T @ W.T).T

    return quantized_linear_step


def _dynamic_linear_step(method, weight: tuple, x: int, out: int, blocks: int = 1):
    """An 8da4w linear, mm(W, fake_quantize_per_token(x).T): the activations rounded (each row in
    `blocks` blocks), then multiplied as the quantized linear does, the steps it replaces in one
    (a decode step on fixed arrays binds both compiled kernels to them)."""
    from ..kernels.fast import quantized

    packed = _packed_weight(method, weight)
    n, k = packed.shape
    row, result = _decode_row(method, x, True), method._out_array(out)
    # The bound form rounds x into a buffer of its own before the mat-vec writes: out may be x's
    # memory (the planner may give it x's bytes, which the graph's fake-quantize chain read last)
    if (quantized.bind_matvec is not None and row is not None and _float32_rows(result)
            and row.shape == (1, k) and result.shape == (n, 1)):
        return _bound_fake_quantized_matvec(row, packed, result.reshape(1, n), blocks)
    get_x, store, rows_times, rounded = _get(method, x), method._store_fn(out), _rows_times(packed), _activations(True, blocks)

    def dynamic_quantized_linear_step():
        store(rows_times(rounded(get_x())).T)

    return dynamic_quantized_linear_step


def _bound_fake_quantized_matvec(rows: np.ndarray, packed, result: np.ndarray, blocks: int = 1) -> Callable[[], None]:
    """The compiled decode steps an 8da4w linear was, bound to fixed arrays, as one step: the
    activations rounded in float32 (in `blocks` blocks) into a buffer of its own, then the float mat-vec."""
    from ..kernels.fast.quantized import bind_fake_quantize_per_token, bind_matvec

    rounded = np.empty(rows.shape, np.float32)
    fake_quantize = bind_fake_quantize_per_token(rows.reshape(blocks, -1), rounded.reshape(blocks, -1))
    matvec = bind_matvec(rounded, packed, result)

    def fake_quantized_matvec() -> None:
        fake_quantize()
        matvec()

    return fake_quantized_matvec


def _quantized_matvec_into(method, bind_matvec: Callable, packed, rows: int, out: int):
    """The decode mat-vec reading fixed rows [K, 1] and writing the fixed output [N, 1] in place
    (a decode shape plan), its arguments gathered once; None for anything else."""
    static, x = method._arg(rows)
    result = method._out_array(out)
    n, k = packed.shape
    if not static or not all(isinstance(t, np.ndarray) and t.dtype == np.float32 and t.flags.c_contiguous
                             for t in (x, result)):
        return None
    if x.shape != (k, 1) or result.shape != (n, 1) or np.may_share_memory(x, result):
        return None
    return bind_matvec(x.reshape(1, k), packed, result.reshape(1, n))  # views of the same bytes


PATTERNS: tuple[Callable[[Graph, Node], Optional[Fused]], ...] = (
    _match_add_rms_norm, _match_rms_norm, _match_rope, _match_rope_swapped, _match_silu, _match_quantized_linear,
    _match_fake_quantize_per_token,
)


def _safe(g: Graph, aliases: dict[int, Alias], f: Fused, skip: frozenset) -> bool:
    """The pattern's inputs still hold what they held when the pattern first read them.
    An input first read late (a quantized linear's activations, made after its weight is
    dequantized) is checked from that read, not from the pattern's first pc."""
    for i in f.inputs:
        start = min([pc for pc in g.users.get(i, []) if pc in f.pcs] or f.pcs)
        for t in _tensor_ids(g.method.plan, i):
            a = aliases.get(t)
            root, first = (a.root, min(a.first_pc, start)) if a else (t, start)
            if not g.untouched(root, first, f.anchor, skip):
                return False
    return True


# ---------------------------------------------------------------------------- the plan


@dataclass
class FusionPlan:
    aliases: dict[int, Alias]
    removed: set[int]  # pcs not executed at all
    fused: dict[int, Fused]  # anchor pc -> the pattern whose step runs there

    def step_at(self, method, pc: int) -> Optional[Callable[[], None]]:
        f = self.fused.get(pc)
        return None if f is None else f.bind(method)


# ---------------------------------------------------------------------------- sibling linears


@dataclass
class _Joint:
    """The first sibling's product as bound: on fixed arrays (`row` [1, K] and `buffer` [1, N] of
    every sibling's outputs side by side), or per call (`last`: the input and product of the last call)."""

    row: Optional[np.ndarray]
    buffer: Optional[np.ndarray]
    last: list


@dataclass
class _Siblings:
    """Quantized linears of one input (a layer's q, k and v; gate and up), in program order."""

    members: list[Fused]
    joint: Optional[_Joint] = None  # what the first member's latest binding made

    @property
    def dynamic(self) -> bool:
        return self.members[0].name == "dynamic_quantized_linear"


def _join_siblings(g: Graph, patterns: dict[int, Fused], aliases: dict[int, Alias], removed: frozenset) -> None:
    """Quantized linears that read one array (views of the same value, nothing writing it from the
    first one's read to the last one's step) become one product over their weights side by side:
    the first step multiplies for all of them and the others copy their columns out. One pass over
    a bigger weight (SmolLM2's q, k and v: 960 x 576) runs on both cores where 192 x 576 alone ran
    on one, and an 8da4w layer rounds its activations once. A decode mat-vec's outputs do not
    depend on the columns beside them: the same bits."""
    groups: dict[tuple, list[Fused]] = {}
    for f in sorted(patterns.values(), key=lambda f: f.anchor):
        if f.weight is not None:
            alias = aliases.get(f.inputs[0])
            groups.setdefault((f.name, alias.root if alias else f.inputs[0], f.weight[4:], f.blocks), []).append(f)
    for (_, root, _, _), members in groups.items():
        if len(members) < 2:
            continue
        first, last = min(min(f.pcs) for f in members), members[-1].anchor
        if not g.untouched(root, first, last - 1, removed):
            continue
        siblings = _Siblings(members)
        for i, f in enumerate(members):
            patterns[f.anchor] = Fused(f.name, f.pcs, f.anchor, f.inputs, f.out,
                                       lambda method, i=i, s=siblings: _sibling_step(method, s, i), weight=f.weight,
                                       blocks=f.blocks)


def _sibling_step(method, siblings: _Siblings, i: int):
    f = siblings.members[i]
    packed = _joint_weight(method, siblings)
    if packed is None:  # their weights take different layouts: each its own product
        own = _dynamic_linear_step if siblings.dynamic else _quantized_linear_step
        return own(method, f.weight, f.inputs[0], f.out, *([f.blocks] if siblings.dynamic else []))
    start = sum(m.weight[3] for m in siblings.members[:i])
    columns = slice(start, start + f.weight[3])
    if i == 0:
        return _joint_step(method, siblings, packed, columns)
    joint = siblings.joint  # bound just before, in the same pass over the steps (same inputs: same pass)
    row, result = _decode_row(method, f.inputs[0], siblings.dynamic), method._out_array(f.out)
    if (joint is not None and joint.buffer is not None and row is not None and same_view(row, joint.row)
            and _float32_rows(result) and result.size == f.weight[3]):
        part = joint.buffer[0, columns].reshape(result.shape)

        def sibling_columns() -> None:
            np.copyto(result, part)

        return sibling_columns
    get, store = _get_input(method, f.inputs[0], siblings.dynamic), method._store_fn(f.out)
    last = joint.last if joint is not None else []
    rows_times, rounded = _rows_times(packed, columns), _activations(siblings.dynamic, f.blocks)

    def sibling_columns_or_own() -> None:
        x = get()
        if last and isinstance(x, np.ndarray) and same_view(x, last[0]):  # the first sibling's product
            store(last[1][:, columns].T)
            return
        store(rows_times(rounded(x)).T)  # a prompt's rows (or another input): its own columns

    return sibling_columns_or_own


def _activations(dynamic: bool, blocks: int = 1) -> Callable[[np.ndarray], np.ndarray]:
    """A linear's input as rows [T, K]: x rounded per token (dynamic; each row in `blocks`
    blocks), or rows [K, T] transposed."""
    from ..kernels.fast.quantized import fake_quantize_per_token

    if not dynamic:
        return lambda rows: rows.T
    if blocks == 1:
        return fake_quantize_per_token
    return lambda x: fake_quantize_per_token(x.reshape(x.shape[0] * blocks, -1)).reshape(x.shape)


def _joint_weight(method, siblings: _Siblings):
    """The siblings' weights packed as one, [sum of N, K] (None when their values need different
    layouts: 4-bit words and bytes); once per method, their own pages released."""
    from ..kernels.fast.quantized import nibble_shift, pack

    key = ("packed siblings", siblings.members[0].weight[0])
    if key in method._load_cache:
        return method._load_cache[key]
    values, weights = method.values, [f.weight for f in siblings.members]
    qs = [values[q].reshape(n, k) for q, _, _, n, k, _ in weights]
    has_mins = {mins is not None for _, _, mins, _, _, _ in weights}
    packed = None
    if len({nibble_shift(q) for q in qs}) == 1 and len(has_mins) == 1:
        scales = np.concatenate([values[s].reshape(n, -1) for _, s, _, n, _, _ in weights])
        mins = np.concatenate([values[m].reshape(n, -1) for _, _, m, n, _, _ in weights]) if True in has_mins else None
        packed = pack(np.concatenate(qs), scales, None, weights[0][5], mins)
        for q in qs:
            method.program.release_pages(q)
    method._load_cache[key] = packed
    return packed


def _joint_step(method, siblings: _Siblings, packed, first: slice):
    """The first sibling's step: a decode mat-vec multiplies for every sibling, whose steps copy
    their columns out; a prompt's rows take this sibling's columns only (BLAS on slices of
    columns gains nothing side by side, and the copies would cost)."""
    from ..kernels.fast import quantized

    f = siblings.members[0]
    n_all, k = packed.shape
    row, result = _decode_row(method, f.inputs[0], siblings.dynamic), method._out_array(f.out)
    if (row is not None and quantized.bind_matvec is not None and _float32_rows(result)
            and result.size == f.weight[3] and row.shape == (1, k)):
        buffer = np.empty((1, n_all), np.float32)
        products = (_bound_fake_quantized_matvec(row, packed, buffer, f.blocks) if siblings.dynamic
                    else quantized.bind_matvec(row, packed, buffer))
        own = buffer[0, first].reshape(result.shape)
        siblings.joint = _Joint(row, buffer, [])

        def sibling_products() -> None:
            products()
            np.copyto(result, own)

        return sibling_products
    get, store, last = _get_input(method, f.inputs[0], siblings.dynamic), method._store_fn(f.out), []
    every, mine, rounded = _rows_times(packed), _rows_times(packed, first), _activations(siblings.dynamic, f.blocks)
    siblings.joint = _Joint(None, None, last)

    def sibling_products_per_call() -> None:
        x = get()
        rows = rounded(x)
        if rows.shape[0] >= quantized.BLAS_MIN_ROWS:
            last.clear()
            store(mine(rows).T)
            return
        y = every(rows)
        last[:] = [x, y]
        store(y[:, first].T)

    return sibling_products_per_call


def _get_input(method, i: int, dynamic: bool) -> Callable[[], Any]:
    """A linear's input as its step reads it: x [T, K] (dynamic), or rows [K, T] as viewed."""
    return _get(method, i) if dynamic else _get_as_viewed(method, i)


def _decode_row(method, i: int, dynamic: bool) -> Optional[np.ndarray]:
    """A linear's input as one fixed row [1, K] (float32, C order), else None."""
    static, a = method._arg(i)
    if not static or not _float32_rows(a) or a.ndim != 2 or (a.shape[0] if dynamic else a.shape[1]) != 1:
        return None
    return a.reshape(1, -1)


# ---------------------------------------------------------------------------- float32 linears side by side


@dataclass
class _FloatSiblings:
    """float32 linears of one input whose weights the file keeps one after another (a layer's q, k
    and v; gate and up), in program order, with their weights as one array read in place; `joint`
    is what the first one's latest binding made: (the input column it reads, all their outputs)."""

    members: list[Node]
    weight: np.ndarray  # [sum of N, K]
    starts: list[int]  # each member's first row in `weight`
    joint: Optional[tuple[np.ndarray, np.ndarray]] = None


def _join_float_siblings(g: Graph, patterns: dict[int, Fused], aliases: dict[int, Alias], removed: frozenset) -> None:
    """mm(W, xT) of float32 constant weights [N, K] reading one array (views of one value, nothing
    writing it from the first one to the last), whose weights lie one after another in the file
    (`Program.side_by_side`: no copy, memory stays at the file's size): a decode step's first one
    multiplies by all of them in one pass on both cores, the others copy their rows out. Each
    output row is the same kernel's dot product as alone: the same bits. Only weights the decode
    mat-vec shares anyway (dense.SHARE_MIN_BYTES) are joined; smaller ones stay on BLAS, which rounds
    otherwise."""
    from ..kernels.fast import dense

    method, groups = g.method, {}
    for pc in sorted(g.nodes):
        node = g.nodes[pc]
        if pc in patterns or pc in removed or node.op != "aten::mm.out" or len(node.args) != 2:
            continue
        w, rows = node.args
        if (g.is_const(w) and _float32(g, w, rows, node.out) and len(g.value(w).sizes) == 2
                and method.values[w].nbytes >= dense.SHARE_MIN_BYTES):
            alias = aliases.get(rows)
            groups.setdefault((alias.root if alias else rows, g.value(w).sizes[1]), []).append(node)
    for (root, _), nodes in groups.items():
        for run in _runs_side_by_side(method, nodes):
            if len(run) < 2 or not g.untouched(root, run[0].pc, run[-1].pc - 1, removed):
                continue
            weights = [method.values[node.args[0]] for node in run]
            starts = [sum(w.shape[0] for w in weights[:i]) for i in range(len(run))]
            siblings = _FloatSiblings(run, method.program.side_by_side(weights), starts)
            for i, node in enumerate(run):
                patterns[node.pc] = Fused("float_linear", frozenset({node.pc}), node.pc, (node.args[1],), node.out,
                                          lambda method, i=i, s=siblings: _float_sibling_step(method, s, i))


def _runs_side_by_side(method, nodes: list[Node]) -> list[list[Node]]:
    """`nodes` cut into runs whose weights follow each other in the file."""
    runs = [[nodes[0]]]
    for node in nodes[1:]:
        before = method.values[runs[-1][-1].args[0]]
        if method.program.side_by_side([before, method.values[node.args[0]]]) is not None:
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs


def _float_sibling_step(method, siblings: _FloatSiblings, i: int):
    """A decode step (fixed column [K, 1], fixed output): the first sibling's mat-vec over every
    weight, or a later one's rows of it; anything else (a prompt), the mm as bound alone."""
    from ..kernels.cores import CallSite, assumed_serial_s
    from ..kernels.fast import dense

    node, start = siblings.members[i], siblings.starts[i]
    static, x = method._arg(node.args[1])
    result = method._out_array(node.out)
    n, k = method.values[node.args[0]].shape
    decode = (static and isinstance(x, np.ndarray) and x.dtype == np.float32 and x.shape == (k, 1)
              and x[:, 0].flags.c_contiguous and _float32_rows(result) and result.shape == (n, 1)
              and not np.may_share_memory(x, result))
    if i == 0:
        siblings.joint = None
        matvec = dense.matvec_kernel()
        if not decode or matvec is None:
            return method._bind(node.pc, method.plan.instructions[node.pc])
        weight, column, y = siblings.weight, x[:, 0], result.reshape(-1)
        site = CallSite(assumed_serial_s(weight.nbytes))
        products = np.empty(weight.shape[0], np.float32)
        mine = products[:n]
        siblings.joint = (x, products)

        def float_sibling_products() -> None:
            matvec(site, weight, column, products)
            np.copyto(y, mine)

        return float_sibling_products
    if not decode or siblings.joint is None or not same_view(x, siblings.joint[0]):
        return method._bind(node.pc, method.plan.instructions[node.pc])
    part, y = siblings.joint[1][start:start + n], result.reshape(-1)

    def float_sibling_rows() -> None:
        np.copyto(y, part)

    return float_sibling_rows


# ---------------------------------------------------------------------------- scalars read again

_SCALAR_READS = frozenset({"aten::_local_scalar_dense"})


def _reuse_scalars(g: Graph, patterns: dict[int, Fused], aliases: dict[int, Alias], removed: frozenset) -> None:
    """`item()` of the same element of a tensor nothing wrote since the last such read takes that
    read's value: ExecuTorch's LLM programs select and read the position once per layer (SmolLM2:
    61 reads a token, ~3 us each)."""
    first: dict[tuple, Node] = {}
    for pc in sorted(g.nodes):
        node = g.nodes[pc]
        if node.op not in _SCALAR_READS or len(node.args) != 1 or pc in patterns or pc in removed:
            continue
        key = _element_read(g, aliases, node.args[0])
        seen = first.get(key) if key is not None else None
        alias = aliases.get(node.args[0])
        read = alias.root if alias is not None else node.args[0]
        if (seen is not None and g.untouched(read, seen.pc, pc - 1, removed)
                and g.untouched(seen.out, seen.pc, pc - 1, removed)):
            patterns[pc] = Fused("same_scalar", frozenset({pc}), pc, node.args, node.out,
                                 lambda method, read=seen.out, out=node.out: _same_scalar_step(method, read, out))
        elif key is not None:
            first[key] = node


def _element_read(g: Graph, aliases: dict[int, Alias], i: int) -> Optional[tuple]:
    """What value i reads: itself, or for a view fusion leaves unexecuted, its source and the view
    with its constant parameters (None when a parameter is read at run time)."""
    alias = aliases.get(i)
    if alias is None:
        return (i,)
    params = [_dims(g, p) if isinstance(g.value(p), P.IntList) else _scalar(g, p) for p in alias.params]
    if None in params:
        return None
    source = _element_read(g, aliases, alias.source)
    return None if source is None else (source, alias.view, tuple(params))


def _same_scalar_step(method, read: int, out: int):
    get, store = _get(method, read), method._store_fn(out)

    def same_scalar() -> None:
        store(get())

    return same_scalar


def find_patterns(g: Graph) -> dict[int, Fused]:
    """Every pattern in the graph, by structure alone; later anchors first, none overlapping."""
    found: dict[int, Fused] = {}
    taken: set[int] = set()
    for pc in sorted(g.nodes, reverse=True):
        if pc in taken:
            continue
        for match in PATTERNS:
            f = match(g, g.nodes[pc])
            if f is not None and not (f.pcs & taken):
                found[pc] = f
                taken |= f.pcs
                break
    return found


def plan_fusion(method) -> Optional[FusionPlan]:
    """The rewrite of `method`'s instructions, or None when there is nothing to fuse.

    Optimistic: assume every candidate view op and pattern is taken (so their inner
    instructions write nothing), drop those whose inputs could change before they are read,
    and repeat until nothing is dropped: what is left is safe together."""
    plan = method.plan
    if any(isinstance(ins, P.JumpFalseCall) for ins in plan.instructions):
        return None
    g = build_graph(method)
    candidates = {pc for pc, node in g.nodes.items() if _viewable(g, node)}
    patterns = find_patterns(g)
    while True:
        inner = {pc for f in patterns.values() for pc in f.pcs if pc != f.anchor}
        views = candidates - inner  # a view a pattern swallowed (RoPE's slices) is read by that step
        removed = views | inner
        read_at = {pc: f.anchor for f in patterns.values() for pc in f.pcs}
        # A fused step reads all its inputs before it writes: its own write cannot clobber them.
        skip = frozenset(removed | set(patterns))
        aliases, failed = find_aliases(g, views, frozenset(removed), skip, read_at)
        unsafe = [a for a, f in patterns.items() if not _safe(g, aliases, f, skip)]
        if not failed and not unsafe:
            break
        candidates -= failed
        for a in unsafe:
            if patterns[a].fallback is None:
                del patterns[a]
            else:
                patterns[a] = patterns[a].fallback
    _join_siblings(g, patterns, aliases, frozenset(removed))
    _join_float_siblings(g, patterns, aliases, frozenset(removed))
    _reuse_scalars(g, patterns, aliases, frozenset(removed))
    for run in find_chains(g, removed | set(patterns), aliases):  # rule 3, on what is left
        anchor = run[-1].pc
        patterns[anchor] = Fused("elementwise", frozenset(op.pc for op in run), anchor, (), run[-1].out,
                                 lambda method, run=run: bind_chain(method, run))
        removed |= {op.pc for op in run[:-1]}
    if not aliases and not patterns:
        return None
    return FusionPlan(aliases, removed, patterns)
