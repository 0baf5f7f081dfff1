"""Method: one execution plan, bound once at load and executed many times.

Loading does all the work: it maps one zeroed arena per memory id, turns every
planned tensor into a numpy view of its arena (constants into views of the file),
checks every index and size against the file, and resolves each instruction into a
small closure ("step") holding its kernel and its arguments. Arguments that cannot
change between calls (static tensors, constant scalars) are baked into the step; only
values written at run time (dynamic-shape tensors, symbolic ints, move targets) are
read from the value table when the step runs. `execute` copies the inputs in, runs
the steps and returns copies of the outputs.

Shape plans: a method with dynamic shapes reads most of its arguments at run time, yet
its shapes depend only on its input shapes (an LLM decodes one token per call). After a
second call with the same input shapes (the first, when every input holds one element), the steps that read run-time values are bound
again with every dynamic tensor fixed at the shape it had (`ShapePlan`); later calls
with those shapes run that plan: arguments, output buffers and views resolved once. A
store that sees another shape (a shape that depends on data, not only on the inputs)
places the result as usual and the rest of the call runs the general steps; that shape
key is then never planned again. docs/fusion.md, "Shape plans", says the same for users.
"""
from __future__ import annotations

import math
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..errors import (
    ExecupyError,
    InvalidInputError,
    KernelError,
    MalformedProgramError,
    MissingBackendError,
    UnsupportedOperatorError,
)
from ..schema import program as P
from ..kernels.cores import CallSite, assumed_serial_s
from ..kernels.fast import dense
from ..kernels.fast import compiled_decode
from ..kernels.portable import linalg as portable_linalg
from ..kernels.portable import reduce as portable_reduce
from ..kernels.portable._util import same_view
from ..kernels.registry import get_kernel
from ..kernels.selection import missing_kernel_reason
from . import blas_threads, collector
from .backends import BackendContext, backend_names, get_backend
from .fusion import VIEW_OPS, fusion_enabled, plan_fusion

Step = Callable[[], Optional[int]]  # returns a jump destination, or None to fall through


@dataclass
class _Dynamic:
    """Planned storage of a dynamic-shape tensor: its upper-bound bytes and shape."""

    storage: np.ndarray  # uint8, upper-bound bytes
    dtype: np.dtype
    upper: tuple[int, ...]
    placed: Optional[np.ndarray] = None  # the view of `storage` last given to the value table


def _view(buf: np.ndarray, dtype: np.dtype, sizes: Sequence[int], dim_order: Sequence[int]) -> np.ndarray:
    """A tensor view of raw bytes laid out in `dim_order` (outermost first)."""
    physical = [sizes[d] for d in dim_order]
    arr = buf.view(dtype).reshape(physical)
    if list(dim_order) == list(range(len(dim_order))):
        return arr
    return arr.transpose(np.argsort(dim_order))


def _paired(steps: list[Step]) -> list[Step]:
    """Adjacent steps a kernel can run at once on the two cores (the first one's `pair_with`
    accepts the second: two small mat-vecs of the same row, say) merged: the first step runs the
    pair, the second does nothing, so every step keeps its pc."""
    for i in range(len(steps) - 1):
        pair_with = getattr(steps[i], "pair_with", None)
        pair = pair_with(steps[i + 1]) if pair_with is not None else None
        if pair is not None:
            steps[i], steps[i + 1] = pair, _done_by_the_step_before
    return steps


def _done_by_the_step_before() -> None:
    """The second step of a pair (see _paired)."""


@dataclass
class ShapePlan:
    """The steps of one method bound for one tuple of input shapes (see the module's docstring)."""

    frozen: dict[int, Any]  # value id -> the array (or shape-derived int) every rebound step reads
    steps: list[Step]


MAX_SHAPE_PLANS = 8  # per method: decode plus a few prefill lengths
# Symbolic ints that follow from shapes only: frozen in a shape plan (an int read from a
# tensor's data, such as `_local_scalar_dense`, stays read at run time).
_SHAPE_INT_OPS = frozenset({"aten::sym_size.int", "aten::sym_numel"})


# BLAS products -> the size that says how much a second thread can help (blas_threads.py)
_BLAS_PRODUCTS: dict[str, Callable[..., int]] = {
    "aten::mm.out": lambda a, b, *_: blas_threads.narrow(a, b),
    "aten::bmm.out": lambda a, b, *_: blas_threads.narrow(a, b),
    "aten::addmm.out": lambda bias, a, b, *_: blas_threads.narrow(a, b),
    "aten::baddbmm.out": lambda bias, a, b, *_: blas_threads.narrow(a, b),
    "aten::linear.out": lambda x, *_: x.size // x.shape[-1] if x.shape[-1] else 1,
    # attention's products are a head group's rows against the filled cache (a few MFLOP in a
    # prompt): on a busy machine OpenBLAS's second thread stalled them 20-40x, so they follow
    # the rule of a small product
    "llama::custom_sdpa.out": lambda *_: 1,
}


# Ops computed element by element and exactly rounded: their result does not depend on how their
# operands lie in memory, so they read a view fusion leaves unexecuted (a prompt's transposed
# activations) as it is (Method._arg's in_place) instead of a contiguous copy made at each call.
# A view op's copy left as a step (fusion.VIEW_OPS) reads its source so too: ExecuTorch's RoPE
# squeezes a strided slice of q for a delegate, once copied to make it contiguous, then again.
_LAYOUT_FREE = frozenset({"aten::add.out", "aten::sub.out", "aten::mul.out", "aten::div.out"})
# From this many multiply-adds (m * k * n) on, OpenBLAS packs its operands for its general kernel
# whatever their layout; below, its "direct" sgemm of untransposed operands (SkylakeX, up to
# 28 * 512**2 on one thread) and its small-matrix kernels (up to 100**3) differ by layout. Twice
# that: a product may run as two halves of its rows (runtime/blas_threads.py).
_PACKED_PRODUCT = 2 * 28 * 512 * 512


def _packed(a: np.ndarray, b: np.ndarray) -> bool:
    """a @ b is a product OpenBLAS computes alike whatever its operands' layout (_PACKED_PRODUCT)."""
    return a.ndim == b.ndim == 2 and a.shape[0] > 1 and b.shape[1] > 1 and \
        a.shape[0] * a.shape[1] * b.shape[1] >= _PACKED_PRODUCT

# Ops that read a few rows of a table (an embedding's): Program.populate_in_background leaves the
# table's pages to be read as looked up.
_ROW_LOOKUPS = ("aten::embedding.", "aten::index_select.", "aten::index.", "aten::gather.",
                "quantized_decomposed::embedding_")


def _threads_by_rows(fn: Callable, rows: Callable[..., int]) -> Callable:
    """`fn` run with the BLAS threads its rows and the other core allow (blas_threads.py)."""
    site, on_threads = CallSite(), blas_threads.product

    def product(*args):
        try:
            n = rows(*args)
        except (AttributeError, IndexError, TypeError):  # not matrices: the kernel says what is wrong
            return fn(*args)
        return on_threads(site, n, fn, *args)

    return product


def _direct_mm(a, b, out) -> Optional[Step]:
    """mm as the portable kernel runs it (np.matmul into the planned buffer) when the operands
    are what it passes to np.matmul unchanged, which a step with fixed arguments knows at bind
    time: its checks and dtype promotion are not repeated on every call."""
    arrays = (a, b, out)
    if not all(isinstance(t, np.ndarray) for t in arrays) or a.ndim != 2 or b.ndim != 2:
        return None
    if out.dtype not in (np.float32, np.float64) or any(t.dtype != out.dtype for t in arrays):
        return None
    if a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]):
        return None
    rows, matmul, on_threads, site = blas_threads.narrow(a, b), np.matmul, blas_threads.product, CallSite()
    if rows == 1 and b.shape[1] == 1 and a.dtype == np.float32 and a.flags.c_contiguous and \
            a.nbytes >= dense.SHARE_MIN_BYTES and b[:, 0].flags.c_contiguous and out[:, 0].flags.c_contiguous:
        # a decode step's float32 linear, weight first (W @ x^T): both cores, each half of W's rows
        x, y, matvec, site = b[:, 0], out[:, 0], dense.matvec_kernel(), CallSite(assumed_serial_s(a.nbytes))
        if matvec is not None:
            return lambda: matvec(site, a, x, y)

    def mm_step():
        on_threads(site, rows, matmul, a, b, out=out)

    return mm_step


def _direct_mean(x, dim, keepdim, dtype, out) -> Optional[Step]:
    """A float32 mean over the last axis, kept (an RMSNorm's, when the program leaves it alone:
    ExecuTorch's XNNPACK export runs it between delegates), in one compiled call where numba is
    loaded: the portable kernel's cumsum and divide took 7-8 us on 576 floats."""
    compiled = compiled_decode()
    if compiled is None or not isinstance(x, np.ndarray) or not isinstance(out, np.ndarray):
        return None
    if not (portable_reduce.last_dim_float32(x, dim, keepdim, dtype, out) and x.flags.c_contiguous
            and out.flags.c_contiguous and not np.may_share_memory(x, out)):
        return None
    rows, means, kernel = x.reshape(-1, x.shape[-1]), out.reshape(-1), compiled.mean_rows
    return lambda: kernel(rows, means)


# portable kernel -> a binder of the same computation for fixed arguments (None: not these)
_DIRECT: dict[Callable, Callable[..., Optional[Step]]] = {portable_linalg.mm: _direct_mm,
                                                          portable_reduce.mean_dim: _direct_mean}


def _direct_view_copy(view: Callable[..., np.ndarray], args: tuple, out: Any) -> Optional[Step]:
    """A view op's copy (squeeze_copy, slice_copy, ... fusion.VIEW_OPS) that fusion left as a step
    (its result feeds a delegate, say), on fixed arrays: the view of the source made once, at
    bind; each call copies it into the planned output, as the kernel would."""
    src = args[0]
    if not isinstance(src, np.ndarray) or not isinstance(out, np.ndarray) or len(args) < 2 or args[-1] is not out:
        return None
    try:
        v = view(src, *args[1:-1])
    except (ValueError, TypeError, IndexError):  # the kernel itself says what is wrong
        return None
    # v must be a view of src's bytes (an element selected from a 1-D array is a scalar: a copy)
    if not isinstance(v, np.ndarray) or not (v.size == 0 or np.may_share_memory(v, src)):
        return None
    if v.shape != out.shape or v.dtype != out.dtype or np.may_share_memory(v, out):
        return None
    copyto = np.copyto
    return lambda: copyto(out, v)


def _view_copy_of_read_source(view: Callable[..., np.ndarray], fn: Callable, args: list, get: Callable,
                              out: np.ndarray, store: Callable, params: tuple) -> Step:
    """A view op's copy whose source is read at each call (a delegate's output; ExecuTorch's
    rotary tables sliced at the position, et_view'd per layer) into a fixed output: the view and
    one copy, without the kernel's argument checks; a source whose view does not fit the output
    goes through the kernel, which says what is wrong."""
    copyto = np.copyto

    def view_copy_step():
        src = get()
        try:
            v = view(src, *params)
        except (ValueError, TypeError, IndexError, AttributeError):
            v = None
        if v is not None and v.shape == out.shape and v.dtype == out.dtype:
            copyto(out, v)
            return
        args[0] = src
        store(fn(*args))

    return view_copy_step


def _direct_view(view: Callable[..., np.ndarray], args: tuple, out: Any) -> Optional[Step]:
    """A view op without an out argument (et_view: its result shares its source's bytes) on fixed
    arrays: when the planned output is that very view, as memory planning lays it out, there is
    nothing left to do at each call; else the view made once is copied in."""
    src = args[0]
    if not isinstance(src, np.ndarray) or not isinstance(out, np.ndarray):
        return None
    try:
        v = view(*args)
    except (ValueError, TypeError, IndexError):  # the kernel itself says what is wrong
        return None
    if not isinstance(v, np.ndarray) or v.shape != out.shape or v.dtype != out.dtype:
        return None
    if same_view(v, out):
        return _viewed_in_place
    if np.may_share_memory(v, out) or not np.may_share_memory(v, src):
        return None
    copyto = np.copyto
    return lambda: copyto(out, v)


def _viewed_in_place() -> None:
    """A view op whose planned output is the view of its fixed source (see _direct_view)."""


def _direct_step(key: str, kernel: Callable, args: tuple, out: Any) -> Optional[Step]:
    view = VIEW_OPS.get(key)
    if view is not None:
        if args and args[-1] is out:
            return _direct_view_copy(view, args, out)
        return _direct_view(view, args, out)
    binder = _DIRECT.get(kernel)
    return None if binder is None or not args or args[-1] is not out else binder(*args)


def shape_plans_enabled() -> bool:
    """Shape plans are on unless EXECUPY_SHAPE_PLANS is set to 0/false/off."""
    return os.environ.get("EXECUPY_SHAPE_PLANS", "1").strip().lower() not in ("0", "false", "off", "no")


def _expected_shape(shape: tuple[int, ...], t: P.Tensor) -> Optional[str]:
    """What value `t` expects when a tensor of `shape` cannot take its place; None when it can.

    The tensor's shape_dynamism decides, whether or not its memory is planned: ExecuTorch's
    LLM export leaves the token input unplanned yet DYNAMIC_BOUND. DYNAMIC_UNBOUND is held to
    the upper bound as well, as ExecuTorch's runtime does."""
    upper = tuple(t.sizes)
    if len(shape) != len(upper):
        return f"rank {len(upper)}, shape {upper}"
    if t.shape_dynamism == P.TensorShapeDynamism.STATIC:
        return None if shape == upper else str(upper)
    if any(s > u for s, u in zip(shape, upper)):
        return f"at most {upper}, the upper bound the program was exported with"
    return None


def _zeroed_arena(size: int) -> np.ndarray:
    """Zeroed planned memory that becomes resident only where it is written.

    Not np.zeros: numpy asks for transparent huge pages on large arrays, so the first write
    into each KV cache (one 1.5 MiB cache per layer and head kind for SmolLM2 at 2048
    context) would make a whole 2 MiB page resident, and a few prompt tokens would hold
    the entire cache in memory. A private anonymous map in small pages costs only what is
    written (reading an unwritten page maps the kernel's one zero page; a shared map, mmap's
    default, would allocate it: a prompt's attention reading the whole cache made all of it
    resident); the kernel hands it out zeroed, which is the initial value of state the file
    does not store (docs/format.md §7)."""
    if size < _SMALL_ARENA:
        return np.zeros(size, np.uint8)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(memory, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(memory, np.uint8)


_SMALL_ARENA = 1 << 20


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


class Method:
    """An executable method of a Program. Create it with `Program.load_method(name)`."""

    def __init__(self, program, plan: P.ExecutionPlan, event_tracer=None, fuse: Optional[bool] = None):
        started = time.perf_counter()
        self.program = program
        self.plan = plan
        self.event_tracer = event_tracer  # handed to delegates at init, for their own events
        self.name = plan.name
        self.max_steps_per_call = program.max_steps_per_call  # bound on executed instructions with jumps
        self._plan_values = plan.values
        self._check_backends()
        n = len(plan.values)
        self.values: list[Any] = [None] * n
        self._dynamic: dict[int, _Dynamic] = {}
        self._unplanned: set[int] = set()
        self._allocated = 0
        self._arenas = self._allocate_arenas(plan.non_const_buffer_sizes)
        self._slots = self._runtime_written_values()
        for i, v in enumerate(plan.values):
            self.values[i] = self._materialize(i, v)
        instructions = plan.instructions
        if len(plan.chains) > 1:
            raise MalformedProgramError(f"method {self.name!r} has {len(plan.chains)} chains; only one is supported")
        self._has_jumps = any(isinstance(ins, P.JumpFalseCall) for ins in instructions)
        self._op_names: list[str] = []
        self._fusion = self._plan_fusion(fusion_enabled() if fuse is None else fuse)
        self._frozen: Optional[dict[int, Any]] = None  # set while a shape plan is being bound
        self._reads_slots = False  # whether the step being bound reads or writes a run-time value
        self._delegate_handles: dict[int, Any] = {}  # pc -> the backend's handle, initialised once
        self._load_cache: dict[Any, Any] = {}  # work a rebinding reuses (packed weights), by key
        self._step_pcs: list[int] = []
        self._step_reads_slots: list[bool] = []
        self._steps: list[Step] = self._bind_all(instructions)
        self._input_setters = [self._input_setter(k, i) for k, i in enumerate(plan.inputs)]
        for i in plan.outputs:
            self._check_index(i, "output")
        self._tensor_inputs = [i for i in plan.inputs if isinstance(plan.values[i], P.Tensor)]
        self._shape_ints = self._shape_derived_ints()
        # key (input shapes) -> plan, or None for a key whose shapes turned out to depend on data
        self._shape_plans: Optional[dict[tuple, Optional[ShapePlan]]] = (
            {} if self._can_plan_shapes() else None)
        self._calls_by_key: dict[tuple, int] = {}
        self._installed: Optional[ShapePlan] = None  # the plan whose arrays the value table holds
        self._diverged = False  # a shape plan's store saw a shape other than the plan's
        self.steps_last_call = 0  # bound steps the last execute ran (see steps_per_call)
        self.load_s = time.perf_counter() - started  # binding this method, for benchmarks

    # ------------------------------------------------------------------ measurements

    @property
    def num_instructions(self) -> int:
        """Instructions in the program's plan for this method."""
        return len(self.plan.instructions)

    @property
    def steps_per_call(self) -> int:
        """Bound steps one call runs: the plan's instructions as bound at load (fewer where
        load-time fusion merged some), or, for a method with jumps (never fused), the count of
        its last call."""
        return self.steps_last_call if self._has_jumps else len(self._steps)

    @property
    def planned_shapes(self) -> list[tuple]:
        """The input shapes (one tuple per tensor input) that calls run with a shape plan."""
        return [key for key, plan in (self._shape_plans or {}).items() if plan is not None]

    # ------------------------------------------------------------------ loading

    def _check_backends(self) -> None:
        """A missing backend is reported before anything else: it is the actionable problem."""
        for d in self.plan.delegates:
            backend = get_backend(d.id)
            if backend is None or not backend.is_available():
                state = "not registered" if backend is None else "not available on this machine"
                raise MissingBackendError(
                    f"method {self.name!r} delegates to backend {d.id!r}, which is {state} in execupy "
                    f"(registered backends: {backend_names() or 'none'})"
                )

    def _check_index(self, i: int, what: str) -> int:
        if not isinstance(i, int) or not 0 <= i < len(self.values):
            raise MalformedProgramError(
                f"method {self.name!r}: {what} refers to value {i}, but the plan has {len(self.values)} values"
            )
        return i

    def _allocate_arenas(self, sizes: list[int]) -> list[np.ndarray]:
        arenas = []
        for size in sizes[1:]:
            if size < 0:
                raise MalformedProgramError(f"method {self.name!r}: negative planned buffer size {size}")
            self._budget(size, "planned memory")
            arenas.append(_zeroed_arena(size))
        return arenas

    def _budget(self, nbytes: int, what: str) -> None:
        self._allocated += nbytes
        limit = self.program.max_arena_bytes
        if self._allocated > limit:
            raise MalformedProgramError(
                f"method {self.name!r}: {what} needs {self._allocated} bytes in all, over the limit of {limit} "
                f"(raise Program.load(..., max_arena_bytes=N) if the program is genuine)"
            )

    def _runtime_written_values(self) -> set[int]:
        """Values whose Python object may change during execute (read at call time)."""
        plan = self.plan
        slots: set[int] = set()
        for ins in plan.instructions:
            if isinstance(ins, P.KernelCall) and ins.args:
                ret = ins.args[-1]
                if 0 <= ret < len(plan.values) and not isinstance(plan.values[ret], (P.Tensor, P.TensorList)):
                    slots.add(ret)  # symbolic ints written by sym_size / executorch_prim ops
            elif isinstance(ins, P.MoveCall):
                slots.add(ins.move_to)
        for i in plan.inputs:
            if 0 <= i < len(plan.values) and not isinstance(plan.values[i], P.Tensor):
                slots.add(i)
        for i, v in enumerate(plan.values):
            if isinstance(v, P.Tensor) and (v.shape_dynamism != 0 or (v.allocation_info is None and v.data_buffer_idx == 0)):
                slots.add(i)
        return slots

    def _materialize(self, i: int, v: P.EValue) -> Any:
        if isinstance(v, P.Tensor):
            return self._tensor(i, v)
        if P.is_scalar(v):
            return P.scalar_value(v)
        # Null is None; lists are resolved when instructions are bound (they point at other values).
        return None

    def _tensor(self, i: int, t: P.Tensor) -> np.ndarray:
        where = f"method {self.name!r} value {i}"
        if t.extra_tensor_info is not None and t.extra_tensor_info.location == P.TensorDataLocation.EXTERNAL:
            raise MalformedProgramError(f"{where}: tensor data lives in an external .ptd file, which is not supported")
        try:
            dtype = P.numpy_dtype(t.scalar_type)
        except KeyError:
            raise MalformedProgramError(f"{where}: unsupported scalar type {t.scalar_type}") from None
        sizes = list(t.sizes)
        if any(s < 0 for s in sizes):
            raise MalformedProgramError(f"{where}: negative size in {sizes}")
        dim_order = list(t.dim_order) if t.dim_order else list(range(len(sizes)))
        if sorted(dim_order) != list(range(len(sizes))):
            raise MalformedProgramError(f"{where}: dim_order {list(t.dim_order)} does not fit sizes {sizes}")
        if t.storage_offset != 0:
            raise MalformedProgramError(f"{where}: storage_offset {t.storage_offset} is not supported (must be 0)")
        nbytes = _numel(sizes) * dtype.itemsize

        if t.allocation_info is not None:
            mem, off = t.allocation_info.memory_id, t.allocation_info.offset
            if not 1 <= mem <= len(self._arenas):
                raise MalformedProgramError(f"{where}: memory_id {mem} but the plan has {len(self._arenas)} arenas")
            arena = self._arenas[mem - 1]
            if off + nbytes > arena.size:
                raise MalformedProgramError(
                    f"{where}: {nbytes} bytes at offset {off} overflow arena {mem} ({arena.size} bytes)"
                )
            buf = arena[off : off + nbytes]
            if t.data_buffer_idx > 0:  # mutable buffer with a serialized initial value
                buf[:] = np.frombuffer(self.program.mutable_initial_bytes(t, nbytes), np.uint8)
            view = _view(buf, dtype, sizes, dim_order)
            if t.shape_dynamism != 0:
                self._dynamic[i] = _Dynamic(buf, dtype, tuple(sizes), view)
            return view

        if t.data_buffer_idx > 0:  # constant: a read-only view into the file
            data = self.program.constant_bytes(t.data_buffer_idx, nbytes)
            if nbytes == 0:
                return np.zeros(sizes, dtype)
            return _view(np.frombuffer(data, np.uint8), dtype, sizes, dim_order)

        # Neither planned nor constant: caller-provided input, a None tensor, or an
        # output whose memory the kernel provides (dynamic unbound).
        self._unplanned.add(i)
        self._budget(nbytes, "unplanned tensors")
        return np.zeros(sizes, dtype)

    # ------------------------------------------------------------------ binding

    def _plan_fusion(self, fuse: bool):
        if not fuse:
            return None
        try:
            return plan_fusion(self)
        except Exception:  # a malformed plan: binding it unfused names what is wrong, with a typed error
            return None

    def _bind_all(self, instructions: Sequence[P.Instruction]) -> list[Step]:
        """One step per instruction, or, with a fusion plan (runtime/fusion.py), one per fused group.
        Records, per step, its pc and whether it reads run-time values (a shape plan rebinds those)."""
        fusion = self._fusion
        steps = []
        for pc, ins in enumerate(instructions):
            if fusion is not None and pc in fusion.removed:
                continue
            self._reads_slots = False
            steps.append(self._bind_step(pc, ins))
            self._op_names.append(self._step_name(pc, ins))
            self._step_pcs.append(pc)
            self._step_reads_slots.append(self._reads_slots)
        return steps

    def _bind_step(self, pc: int, ins: P.Instruction) -> Step:
        fusion = self._fusion
        if fusion is not None and pc in fusion.fused:
            return fusion.step_at(self, pc)
        return self._bind(pc, ins)

    def _step_name(self, pc: int, ins: P.Instruction) -> str:
        """The step's name in errors and profiles (the instruction was checked when it was bound)."""
        if self._fusion is not None and pc in self._fusion.fused:
            return "fused:" + self._fusion.fused[pc].name
        if isinstance(ins, P.KernelCall):
            return self.plan.operators[ins.op_index].key
        if isinstance(ins, P.DelegateCall):
            return f"delegate:{self.plan.delegates[ins.delegate_index].id}"
        return type(ins).__name__

    def _arg(self, i: int, in_place: bool = False) -> tuple[bool, Any]:
        """(is_static, value_or_getter) for argument value i. `in_place`: a view op fusion does not
        execute is read as the view it is (for a step whose result does not depend on its
        operands' memory layout), not as the contiguous copy the view op would have made."""
        self._check_index(i, "an instruction argument")
        alias = self._fusion.aliases.get(i) if self._fusion is not None else None
        if alias is not None:  # a view op that fusion does not execute: read a view of its source
            return alias.arg(self, contiguous=not in_place)
        v = self._plan_values[i]
        values = self.values
        if isinstance(v, P.IntList):
            parts = [self._arg(self._check_list_item(j, i, P.Int)) for j in v.items]
            return self._list_arg(parts, tuple)
        if isinstance(v, (P.DoubleList, P.BoolList)):
            return True, tuple(v.items)
        if isinstance(v, P.TensorList):
            parts = [self._arg(self._check_list_item(j, i, P.Tensor)) for j in v.items]
            return self._list_arg(parts, list)
        if isinstance(v, P.OptionalTensorList):
            parts = [(True, None) if j == -1 else self._arg(self._check_list_item(j, i, P.Tensor)) for j in v.items]
            return self._list_arg(parts, list)
        if i in self._slots:
            if self._frozen is not None and i in self._frozen:
                return True, self._frozen[i]
            self._reads_slots = True
            return False, lambda: values[i]
        return True, values[i]

    def _check_list_item(self, j: int, i: int, kind: type) -> int:
        self._check_index(j, f"list value {i}")
        if not isinstance(self._plan_values[j], kind):
            raise MalformedProgramError(
                f"method {self.name!r}: list value {i} refers to value {j}, which is not {kind.__name__}"
            )
        return j

    @staticmethod
    def _list_arg(parts: list, make: Callable) -> tuple[bool, Any]:
        if all(static for static, _ in parts):
            return True, make(p for _, p in parts)
        getters = [(lambda p=p: p) if static else p for static, p in parts]
        return False, lambda: make(g() for g in getters)

    def _store_fn(self, ret: int) -> Callable[[Any], None]:
        """How a kernel's result reaches value `ret`."""
        self._check_index(ret, "an instruction result")
        v = self._plan_values[ret]
        values = self.values
        if isinstance(v, P.TensorList):
            stores = [self._store_fn(self._check_list_item(j, ret, P.Tensor)) for j in v.items]

            def store_list(results):
                if not isinstance(results, (list, tuple)) or len(results) != len(stores):
                    raise KernelError(f"kernel returned {type(results).__name__}, expected {len(stores)} tensors")
                for s, r in zip(stores, results):
                    s(r)

            return store_list
        if ret in self._slots:
            self._reads_slots = True
            if self._frozen is not None and ret in self._frozen:
                return self._frozen_store(ret, v)
        if not isinstance(v, P.Tensor):
            def store_scalar(r):
                values[ret] = r
            return store_scalar
        if ret in self._dynamic:
            return lambda r: self._place_dynamic(ret, r)
        if ret in self._unplanned:
            dtype = P.numpy_dtype(v.scalar_type)

            def store_unplanned(r):
                r = np.asarray(r, dtype)
                expected = _expected_shape(r.shape, v)
                if expected:
                    raise KernelError(f"value {ret}: the result has shape {r.shape}; the program expects {expected}")
                values[ret] = r

            return store_unplanned

        def store_static(r):
            out = values[ret]
            if r is not out:
                if np.shape(r) != out.shape:
                    raise KernelError(f"kernel produced shape {np.shape(r)}, planned shape is {out.shape}")
                np.copyto(out, r, casting="unsafe")

        return store_static

    def _out_array(self, ret: int) -> Optional[np.ndarray]:
        """The array a step may write value `ret` into directly, when it is fixed: a planned
        static tensor, or a dynamic one a shape plan fixed. None: use `_store_fn`."""
        frozen = self._frozen or {}
        if ret in frozen:
            out = frozen[ret]
        elif ret in self._slots or not isinstance(self._plan_values[ret], P.Tensor):
            return None
        else:
            out = self.values[ret]
        return out if isinstance(out, np.ndarray) else None

    def _frozen_store(self, ret: int, v: P.EValue) -> Callable[[Any], None]:
        """The store of a shape plan: into the array the plan fixed for `ret`. Another shape (or
        another value of a shape-derived int) is placed as the general step would and marks the
        call diverged, so that the rest of it runs the general steps."""
        expected = self._frozen[ret]
        values = self.values
        if not isinstance(v, P.Tensor):
            def store_frozen_scalar(r):
                if r != expected or type(r) is not type(expected):
                    values[ret] = r
                    self._diverged = True
            return store_frozen_scalar
        place = self._store_dynamic_fn(ret, v)

        def store_frozen(r):
            if r is expected:
                return
            if np.shape(r) == expected.shape:
                np.copyto(expected, r, casting="unsafe")
            else:
                place(r)
                self._diverged = True

        return store_frozen

    def _store_dynamic_fn(self, ret: int, v: P.Tensor) -> Callable[[Any], None]:
        """The general store of a run-time tensor (dynamic or unplanned)."""
        if ret in self._dynamic:
            return lambda r: self._place_dynamic(ret, r)
        frozen, self._frozen = self._frozen, None
        try:
            return self._store_fn(ret)
        finally:
            self._frozen = frozen

    def _place_dynamic(self, i: int, r) -> None:
        """Resize dynamic tensor i to r's shape inside its planned bytes and copy r in. The array
        already there is kept when it has that shape, so a call like the last one writes into the
        same arrays (and a shape plan's arrays stay those the value table holds)."""
        d = self._dynamic[i]
        r = np.asarray(r)
        current = self.values[i]
        if r is current:
            return
        shape = r.shape
        if current is d.placed and current.shape == shape and current.flags.c_contiguous:
            np.copyto(current, r, casting="unsafe")  # not after a move made the value another's array
            return
        if len(shape) != len(d.upper) or any(s > u for s, u in zip(shape, d.upper)):
            raise KernelError(
                f"value {i}: result shape {shape} exceeds the planned upper bound {d.upper}"
            )
        view = d.storage[: _numel(shape) * d.dtype.itemsize].view(d.dtype)
        if r.ndim == 2 and r.flags.f_contiguous and not r.flags.c_contiguous:
            # A transposed result (a prompt's linear: mm(W, rows) computed as (rows.T @ W.T).T)
            # keeps its layout: the copy is a plain one, and the transpose that reads it next is
            # contiguous again (two transposing copies of every linear's output saved)
            view = view.reshape(shape[::-1]).T
        else:
            view = view.reshape(shape)
        np.copyto(view, r, casting="unsafe")
        self.values[i] = d.placed = view

    def _result_getter(self, ret: int) -> Optional[Callable[..., Optional[np.ndarray]]]:
        """For a step that writes a result of a shape known only when it runs (a prompt's): a
        function giving, for that shape, the array in value `ret`'s planned bytes that the store
        of that result would copy into (C order, or with `transposed` a 2-D one's transpose in
        C order, as `_place_dynamic` keeps such a result), placed in the value table now, so
        the store finds it there and copies nothing; None when the shape does not fit them.
        None for a value that is not a dynamic tensor, or while a shape plan is being bound."""
        if ret not in self._dynamic or self._frozen is not None:
            return None
        d, values = self._dynamic[ret], self.values

        def result_array(shape: tuple[int, ...], transposed: bool = False) -> Optional[np.ndarray]:
            current, transposed = values[ret], transposed and len(shape) == 2
            if current is d.placed and current.shape == shape and (
                    current.flags.f_contiguous if transposed else current.flags.c_contiguous):
                return current
            if len(shape) != len(d.upper) or any(s > u for s, u in zip(shape, d.upper)):
                return None  # the store says what is wrong
            flat = d.storage[: _numel(shape) * d.dtype.itemsize].view(d.dtype)
            values[ret] = d.placed = flat.reshape(shape[::-1]).T if transposed else flat.reshape(shape)
            return d.placed

        return result_array

    def _bind(self, pc: int, ins: P.Instruction) -> Step:
        if isinstance(ins, P.KernelCall):
            return self._bind_kernel(pc, ins)
        if isinstance(ins, P.DelegateCall):
            return self._bind_delegate(pc, ins)
        values = self.values
        if isinstance(ins, P.MoveCall):
            src, dst = self._check_index(ins.move_from, "move"), self._check_index(ins.move_to, "move")

            def move():
                values[dst] = values[src]

            return move
        if isinstance(ins, P.JumpFalseCall):
            cond = self._check_index(ins.cond_value_index, "jump condition")
            dest = ins.destination_instruction
            n = len(self.plan.instructions)
            if not 0 <= dest <= n:
                raise MalformedProgramError(f"method {self.name!r}: jump at {pc} to {dest}, outside 0..{n}")
            static, get = self._arg(cond)

            def jump_false():
                c = get if static else get()
                if isinstance(c, np.ndarray):
                    if c.dtype != np.bool_:
                        raise KernelError(f"jump condition has dtype {c.dtype}, expected bool")
                    c = bool(c.all())
                return None if c else dest

            return jump_false
        if isinstance(ins, P.FreeCall):
            self._check_index(ins.value_index, "free")
            return lambda: None
        raise MalformedProgramError(f"method {self.name!r}: unknown instruction at {pc}")

    def _bind_kernel(self, pc: int, ins: P.KernelCall) -> Step:
        ops = self.plan.operators
        if not 0 <= ins.op_index < len(ops):
            raise MalformedProgramError(f"method {self.name!r}: instruction {pc} uses operator {ins.op_index}, "
                                        f"but the plan lists {len(ops)}")
        key = ops[ins.op_index].key
        fn = kernel = get_kernel(key)
        if fn is None:
            raise UnsupportedOperatorError(
                f"operator {key} (method {self.name!r}, instruction {pc}) {missing_kernel_reason(key)}")
        if not ins.args:
            raise MalformedProgramError(f"method {self.name!r}: instruction {pc} ({key}) has no arguments")
        if key in _BLAS_PRODUCTS and blas_threads.default_threads() is not None:
            fn = _threads_by_rows(fn, _BLAS_PRODUCTS[key])
        if key == "executorch_prim::et_copy_index.tensor":
            # map loops: the emitter writes no return slot; all three args are inputs and the
            # grown stacked output (DYNAMIC_BOUND) replaces argument 0.
            parts = [self._arg(a) for a in ins.args]
            store = self._store_fn(ins.args[0])
        else:
            parts = [self._arg(a, key in _LAYOUT_FREE or key in VIEW_OPS) for a in ins.args[:-1]]
            if key == "aten::mm.out":
                parts = self._product_operands(ins.args[:-1], parts)
            store = self._store_fn(ins.args[-1])
        if self._frozen is None and not key.startswith(_ROW_LOOKUPS):  # (a shape plan's constants were noted at load)
            for static, p in parts:  # constants read whole at each call: worth mapping in ahead
                if static and isinstance(p, np.ndarray):
                    self.program.note_full_read(p)
        bind = getattr(kernel, "bind", None)  # a kernel's own step for arguments fixed at bind (kv_cache.py)
        fixed_out = self._out_array(ins.args[-1]) if bind is not None else None
        direct = bind(parts, fixed_out) if fixed_out is not None else None
        if direct is not None:
            return direct
        if all(static for static, _ in parts):
            return self._bind_kernel_static(key, kernel, fn, parts, ins.args[-1], store)
        if self._frozen is not None and key in VIEW_OPS and all(static for static, _ in parts[1:]):
            source = self._fixed_in_plan(ins.args[0])
            if source is not None:  # a view of an array the plan fixes: bound as a view of a constant
                parts[0] = (True, source)
                return self._bind_kernel_static(key, kernel, fn, parts, ins.args[-1], store)
        resolved = [(static, p) for static, p in parts]
        getters = [(k, p) for k, (static, p) in enumerate(parts) if not static]
        if len(getters) == 1:  # one value read at run time (a position, say): fill in its slot only
            args = [p for _, p in parts]
            (k, get), = getters
            out = self._out_array(ins.args[-1])
            if k == 0 and key in VIEW_OPS and out is not None:  # with an out argument, or et_view's result
                params = tuple(args[1:-1]) if args[-1] is out else tuple(args[1:])
                return _view_copy_of_read_source(VIEW_OPS[key], fn, args, get, out, store, params)

            def call_one_dynamic():
                args[k] = get()
                store(fn(*args))

            return call_one_dynamic

        def call_dynamic():
            store(fn(*[p if static else p() for static, p in resolved]))

        return call_dynamic

    def _product_operands(self, args: Sequence[int], parts: list) -> list:
        """mm's operands as bound (a, b, out): a transposed view fusion leaves unexecuted (a prompt's
        activations, W @ x^T) read where it lies, without a copy per call, when the product is one
        OpenBLAS packs (it copies either layout into the same panels and runs the same kernel: the
        same bits); else made contiguous, as the view op would have, as `parts` are."""
        if len(args) != 3 or self._fusion is None or args[1] not in self._fusion.aliases:
            return parts  # no view in between: the rows are read as they are anyway
        in_place = [self._arg(a, in_place=True) for a in args]
        if not in_place[0][0] or not isinstance(in_place[0][1], np.ndarray):
            return parts
        (_, a), (static, b) = in_place[:2]
        if static:  # a shape plan's fixed operands: decided now
            return in_place if isinstance(b, np.ndarray) and _packed(a, b) else parts
        get, contiguous = b, np.ascontiguousarray

        def rows_in_place():  # decided per call: a prompt's length on the general path
            x = get()
            return x if isinstance(x, np.ndarray) and _packed(a, x) else contiguous(x)

        return [in_place[0], (False, rows_in_place), in_place[2]]

    def _bind_kernel_static(self, key: str, kernel: Callable, fn: Callable, parts: list, ret: int,
                            store: Callable) -> Step:
        """A kernel call whose arguments are all fixed now."""
        args = tuple(p for _, p in parts)
        frozen = self._frozen or {}
        out = frozen.get(ret, self.values[ret])
        if isinstance(self._plan_values[ret], P.Tensor) and (ret not in self._slots or ret in frozen):
            direct = _direct_step(key, kernel, args, out)
            if direct is not None:
                return direct

            def call_static_out():  # the common case: write into a planned buffer
                r = fn(*args)
                if r is not out:
                    store(r)
            return call_static_out

        def call_static():
            store(fn(*args))

        return call_static

    def _fixed_in_plan(self, i: int) -> Optional[np.ndarray]:
        """While a shape plan is bound: the array value i is at every call of the plan (one the
        plan froze, or a planned tensor of static shape, whose stores copy into it; a view fusion
        reads in place, when it is one fixed view of such an array: strided, a contiguous copy of
        it would be made at each read), else None (an unplanned or non-tensor value)."""
        alias = self._fusion.aliases.get(i) if self._fusion is not None else None
        if alias is not None:
            static, v = alias.arg(self, contiguous=False)
            return v if static and isinstance(v, np.ndarray) else None
        if i in self._frozen:
            v = self._frozen[i]
        elif i in self._dynamic or i in self._unplanned or not isinstance(self._plan_values[i], P.Tensor):
            return None
        else:
            v = self.values[i]
        return v if isinstance(v, np.ndarray) else None

    def _bind_delegate(self, pc: int, ins: P.DelegateCall) -> Step:
        delegates = self.plan.delegates
        if not 0 <= ins.delegate_index < len(delegates):
            raise MalformedProgramError(f"method {self.name!r}: delegate index {ins.delegate_index} out of range")
        d = delegates[ins.delegate_index]
        backend = get_backend(d.id)
        if pc not in self._delegate_handles:  # a shape plan rebinds the call with the handle made at load
            self._delegate_handles[pc] = self._init_delegate(backend, d)
        handle = self._delegate_handles[pc]
        parts = [self._arg(a) for a in ins.args]
        stores = [self._store_fn(a) if isinstance(self._plan_values[a], P.Tensor) else None for a in ins.args]
        bind = getattr(backend, "bind", None)  # a backend's own call on arguments fixed now (a shape plan's)
        run = None
        if bind is not None and all(static for static, _ in parts):
            outs = [self._out_array(a) if isinstance(self._plan_values[a], P.Tensor) else None for a in ins.args]
            run = bind(handle, [p for _, p in parts], outs)
        if run is not None:
            def call_bound_delegate():
                outs = run()  # None: the backend wrote them into the arrays it was given
                if outs is not None:
                    for s, r in zip(stores[len(stores) - len(outs):], outs):
                        s(r)

            call_bound_delegate.run = run  # (what the backend bound: tests look)
            return call_bound_delegate

        def call_delegate():
            args = [p if static else p() for static, p in parts]
            outs = backend.execute(handle, args)
            if outs is not None:
                for s, r in zip(stores[len(stores) - len(outs):], outs):
                    s(r)

        return call_delegate

    def _init_delegate(self, backend, d: P.BackendDelegate) -> Any:
        payload = self.program.delegate_payload(d.processed)
        try:
            return backend.init(payload, d.compile_specs, BackendContext(self.program.named_data, self.event_tracer))
        except ExecupyError:
            raise
        except Exception as e:
            raise MalformedProgramError(f"backend {d.id!r} rejected its payload: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ inputs

    def _input_setter(self, k: int, i: int) -> Callable[[Any], None]:
        self._check_index(i, f"input {k}")
        v = self._plan_values[i]
        values = self.values
        if not isinstance(v, P.Tensor):
            expected = self.values[i]

            def set_scalar(x):
                if isinstance(expected, float) and isinstance(x, (int, float)) and not isinstance(x, bool):
                    same = abs(float(x) - expected) <= 1e-6 * max(1.0, abs(expected))
                else:
                    same = type(x) is type(expected) and x == expected
                if not same:
                    raise InvalidInputError(
                        f"input {k} must be {expected!r}: non-tensor inputs are fixed when the program is exported"
                    )

            return set_scalar
        dtype = P.numpy_dtype(v.scalar_type)

        def check(x) -> np.ndarray:
            arr = x if isinstance(x, np.ndarray) else np.asarray(x)
            if arr.dtype != dtype:
                raise InvalidInputError(f"input {k} has dtype {arr.dtype}, but method {self.name!r} expects {dtype}")
            expected = _expected_shape(arr.shape, v)
            if expected:
                raise InvalidInputError(f"input {k} has shape {arr.shape}; method {self.name!r} expects {expected}")
            return arr

        if i in self._dynamic:
            def set_dynamic(x):
                self._place_dynamic(i, check(x))
            return set_dynamic
        if i in self._unplanned:
            def set_unplanned(x):  # no planned bytes: the value is the caller's array, as ExecuTorch shares it
                values[i] = check(x)
            return set_unplanned

        def set_static(x):
            np.copyto(values[i], check(x))

        return set_static

    # ------------------------------------------------------------------ shape plans

    def _can_plan_shapes(self) -> bool:
        """Shape plans need a straight run of kernels: no jumps or moves (a move makes two
        values one array), no tracer (which names each step as bound at load), and at least one
        step that reads run-time values."""
        if not shape_plans_enabled() or self.event_tracer is not None or self._has_jumps:
            return False
        if any(isinstance(ins, P.MoveCall) for ins in self.plan.instructions):
            return False
        return any(self._step_reads_slots)

    def _shape_derived_ints(self) -> set[int]:
        """Symbolic ints written from shapes alone: sym_size and the arithmetic of such ints."""
        plan, derived = self.plan, set()
        for ins in plan.instructions:
            if not isinstance(ins, P.KernelCall) or not ins.args or ins.args[-1] not in self._slots:
                continue
            if isinstance(plan.values[ins.args[-1]], (P.Tensor, P.TensorList)):
                continue
            key = plan.operators[ins.op_index].key
            reads = [a for a in ins.args[:-1] if a in self._slots]
            if key in _SHAPE_INT_OPS or (key.startswith("executorch_prim::") and all(a in derived for a in reads)):
                derived.add(ins.args[-1])
        return derived

    def _shape_key(self) -> tuple:
        values = self.values
        return tuple(values[i].shape for i in self._tensor_inputs)

    def _plan_shapes(self, key: tuple) -> None:
        """After a general call with input shapes `key`: on the second such call, bind a shape plan
        (a prompt's length may never come back; binding takes about two general calls' time). A
        call whose inputs hold one element each, an LLM's decode step, binds on the first: every
        token after it has the same shapes."""
        plans = self._shape_plans
        if key in plans:
            return
        calls = self._calls_by_key
        calls[key] = calls.get(key, 0) + 1
        if calls[key] < (1 if all(math.prod(shape) == 1 for shape in key) else 2):
            if len(calls) > 4 * MAX_SHAPE_PLANS:  # many shapes seen once each: forget them
                calls.clear()
            return
        if sum(p is not None for p in plans.values()) >= MAX_SHAPE_PLANS:
            oldest = next(k for k, p in plans.items() if p is not None)
            del plans[oldest]
        values = self.values
        frozen = {i: values[i] for i in self._dynamic}
        frozen.update((i, values[i]) for i in self._shape_ints)
        self._frozen = frozen
        try:
            steps = [self._bind_step(pc, self.plan.instructions[pc]) if reads else step
                     for step, pc, reads in zip(self._steps, self._step_pcs, self._step_reads_slots)]
        except Exception:  # cannot be bound with fixed shapes: keep running the general steps
            plans[key] = None
            return
        finally:
            self._frozen = None
        plans[key] = self._installed = ShapePlan(frozen, _paired(steps))

    def _install(self, plan: ShapePlan) -> None:
        """Put the plan's arrays in the value table (the general steps read them there)."""
        if self._installed is not plan:
            values, dynamic = self.values, self._dynamic
            for i, v in plan.frozen.items():
                values[i] = v
                if i in dynamic:
                    dynamic[i].placed = v
            self._installed = plan
        self._diverged = False

    def _abandon(self, key: tuple) -> None:
        """A store saw a shape other than the plan's: the shapes depend on data; plan no more."""
        self._shape_plans[key] = None
        self._installed = None

    # ------------------------------------------------------------------ execution

    @property
    def num_inputs(self) -> int:
        return len(self.plan.inputs)

    def execute(self, inputs: Sequence[Any] = ()) -> list[Any]:
        """Run the method on positional inputs; returns the flat list of outputs (copies)."""
        if len(inputs) != len(self._input_setters):
            raise InvalidInputError(
                f"method {self.name!r} takes {len(self._input_setters)} inputs, got {len(inputs)}"
            )
        for setter, x in zip(self._input_setters, inputs):
            setter(x)
        plans = self._shape_plans
        key = plan = None
        if plans is not None:
            key = self._shape_key()
            plan = plans.get(key)
        if plans is None or plan is not None:
            return self._run(plans, key, plan)
        with collector.paused():  # a call with no shape plan yet, which will bind one
            return self._run(plans, key, plan)

    def _run(self, plans, key, plan: Optional[ShapePlan]) -> list[Any]:
        pc = 0
        try:
            # Kernels follow IEEE semantics (inf/NaN results), as ATen does: no warnings.
            with np.errstate(all="ignore"):
                if plan is not None:
                    self._install(plan)
                    for pc, step in enumerate(plan.steps):
                        step()
                        if self._diverged:
                            break
                    if self._diverged:  # the rest of the call runs the general steps
                        self._abandon(key)
                        for pc in range(pc + 1, len(self._steps)):
                            self._steps[pc]()
                elif self._has_jumps:
                    self.steps_last_call = self._run_with_jumps()
                else:
                    self._installed = None
                    for pc, step in enumerate(self._steps):
                        step()
        except ExecupyError as e:
            if isinstance(e, KernelError) and not str(e).startswith("method "):
                raise KernelError(f"method {self.name!r}, instruction {pc} ({self._op_names[pc]}): {e}") from e
            raise
        except Exception as e:
            raise KernelError(
                f"method {self.name!r}, instruction {pc} ({self._op_names[pc]}) failed: {type(e).__name__}: {e}"
            ) from e
        finally:
            blas_threads.restore()
        if plans is not None and plan is None:
            self._plan_shapes(key)
        return [self._output(i) for i in self.plan.outputs]

    def _run_with_jumps(self) -> int:
        """Run from pc 0 to the end, following jumps; returns the number of steps run."""
        steps, n = self._steps, len(self._steps)
        pc, budget = 0, self.max_steps_per_call
        while pc < n:
            budget -= 1
            if budget < 0:
                raise KernelError(f"method {self.name!r} ran more than {self.max_steps_per_call} instructions; "
                                  f"the program's jumps do not terminate")
            try:
                dest = steps[pc]()
            except ExecupyError:
                raise
            except Exception as e:
                raise KernelError(
                    f"method {self.name!r}, instruction {pc} ({self._op_names[pc]}) failed: {type(e).__name__}: {e}"
                ) from e
            pc = pc + 1 if dest is None else dest
        return self.max_steps_per_call - budget

    def _output(self, i: int) -> Any:
        v = self.values[i]
        if isinstance(v, np.ndarray):
            return v.copy()
        return v

    def __repr__(self) -> str:
        return f"<Method {self.name!r}: {len(self.plan.inputs)} inputs, {len(self._steps)} instructions>"
