"""Method: one execution plan, bound once at load and executed many times.

Loading does all the work: it maps one zeroed arena per memory id, turns every
planned tensor into a numpy view of its arena (constants into views of the file),
checks every index and size against the file, and resolves each instruction into a
small closure ("step") holding its kernel and its arguments. Arguments that cannot
change between calls (static tensors, constant scalars) are baked into the step; only
values written at run time (dynamic-shape tensors, symbolic ints, move targets) are
read from the value table when the step runs. `execute` copies the inputs in, runs
the steps and returns copies of the outputs.
"""
from __future__ import annotations

import mmap
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
from ..kernels.registry import get_kernel
from ..kernels.selection import missing_kernel_reason
from .backends import BackendContext, backend_names, get_backend
from .fusion import fusion_enabled, plan_fusion

Step = Callable[[], Optional[int]]  # returns a jump destination, or None to fall through


@dataclass
class _Dynamic:
    """Planned storage of a dynamic-shape tensor: its upper-bound bytes and shape."""

    storage: np.ndarray  # uint8, upper-bound bytes
    dtype: np.dtype
    upper: tuple[int, ...]


def _view(buf: np.ndarray, dtype: np.dtype, sizes: Sequence[int], dim_order: Sequence[int]) -> np.ndarray:
    """A tensor view of raw bytes laid out in `dim_order` (outermost first)."""
    physical = [sizes[d] for d in dim_order]
    arr = buf.view(dtype).reshape(physical)
    if list(dim_order) == list(range(len(dim_order))):
        return arr
    return arr.transpose(np.argsort(dim_order))


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
    the entire cache in memory. An anonymous map in small pages costs only what is written;
    the kernel hands it out zeroed, which is the initial value of state the file does not
    store (docs/format.md §7)."""
    if size < _SMALL_ARENA:
        return np.zeros(size, np.uint8)
    memory = mmap.mmap(-1, size)
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
        self._steps: list[Step] = self._bind_all(instructions)
        self._input_setters = [self._input_setter(k, i) for k, i in enumerate(plan.inputs)]
        for i in plan.outputs:
            self._check_index(i, "output")
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
                self._dynamic[i] = _Dynamic(buf, dtype, tuple(sizes))
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
        """One step per instruction, or, with a fusion plan (runtime/fusion.py), one per fused group."""
        fusion = self._fusion
        if fusion is None:
            return [self._bind(pc, ins) for pc, ins in enumerate(instructions)]
        steps = []
        for pc, ins in enumerate(instructions):
            if pc in fusion.fused:
                steps.append(fusion.step_at(self, pc))
                self._op_names.append("fused:" + fusion.fused[pc].name)
            elif pc not in fusion.removed:
                steps.append(self._bind(pc, ins))
        return steps

    def _arg(self, i: int) -> tuple[bool, Any]:
        """(is_static, value_or_getter) for argument value i."""
        self._check_index(i, "an instruction argument")
        alias = self._fusion.aliases.get(i) if self._fusion is not None else None
        if alias is not None:  # a view op that fusion does not execute: read a view of its source
            return alias.arg(self)
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

    def _place_dynamic(self, i: int, r) -> None:
        """Resize dynamic tensor i to r's shape inside its planned bytes and copy r in."""
        d = self._dynamic[i]
        r = np.asarray(r)
        if r is self.values[i]:
            return
        shape = r.shape
        if len(shape) != len(d.upper) or any(s > u for s, u in zip(shape, d.upper)):
            raise KernelError(
                f"value {i}: result shape {shape} exceeds the planned upper bound {d.upper}"
            )
        view = d.storage[: _numel(shape) * d.dtype.itemsize].view(d.dtype).reshape(shape)
        np.copyto(view, r, casting="unsafe")
        self.values[i] = view

    def _bind(self, pc: int, ins: P.Instruction) -> Step:
        if isinstance(ins, P.KernelCall):
            return self._bind_kernel(pc, ins)
        if isinstance(ins, P.DelegateCall):
            return self._bind_delegate(pc, ins)
        values = self.values
        if isinstance(ins, P.MoveCall):
            src, dst = self._check_index(ins.move_from, "move"), self._check_index(ins.move_to, "move")
            self._op_names.append("MoveCall")

            def move():
                values[dst] = values[src]

            return move
        if isinstance(ins, P.JumpFalseCall):
            cond = self._check_index(ins.cond_value_index, "jump condition")
            dest = ins.destination_instruction
            n = len(self.plan.instructions)
            if not 0 <= dest <= n:
                raise MalformedProgramError(f"method {self.name!r}: jump at {pc} to {dest}, outside 0..{n}")
            self._op_names.append("JumpFalseCall")
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
            self._op_names.append("FreeCall")
            return lambda: None
        raise MalformedProgramError(f"method {self.name!r}: unknown instruction at {pc}")

    def _bind_kernel(self, pc: int, ins: P.KernelCall) -> Step:
        ops = self.plan.operators
        if not 0 <= ins.op_index < len(ops):
            raise MalformedProgramError(f"method {self.name!r}: instruction {pc} uses operator {ins.op_index}, "
                                        f"but the plan lists {len(ops)}")
        key = ops[ins.op_index].key
        self._op_names.append(key)
        fn = get_kernel(key)
        if fn is None:
            raise UnsupportedOperatorError(
                f"operator {key} (method {self.name!r}, instruction {pc}) {missing_kernel_reason(key)}")
        if not ins.args:
            raise MalformedProgramError(f"method {self.name!r}: instruction {pc} ({key}) has no arguments")
        if key == "executorch_prim::et_copy_index.tensor":
            # map loops: the emitter writes no return slot; all three args are inputs and the
            # grown stacked output (DYNAMIC_BOUND) replaces argument 0.
            parts = [self._arg(a) for a in ins.args]
            store = self._store_fn(ins.args[0])
        else:
            parts = [self._arg(a) for a in ins.args[:-1]]
            store = self._store_fn(ins.args[-1])
        if all(static for static, _ in parts):
            args = tuple(p for _, p in parts)
            ret = ins.args[-1]
            out = self.values[ret]
            if isinstance(self._plan_values[ret], P.Tensor) and ret not in self._slots:
                def call_static_out():  # the common case: write into a planned buffer
                    r = fn(*args)
                    if r is not out:
                        store(r)
                return call_static_out

            def call_static():
                store(fn(*args))

            return call_static
        resolved = [(static, p) for static, p in parts]

        def call_dynamic():
            store(fn(*[p if static else p() for static, p in resolved]))

        return call_dynamic

    def _bind_delegate(self, pc: int, ins: P.DelegateCall) -> Step:
        delegates = self.plan.delegates
        if not 0 <= ins.delegate_index < len(delegates):
            raise MalformedProgramError(f"method {self.name!r}: delegate index {ins.delegate_index} out of range")
        d = delegates[ins.delegate_index]
        self._op_names.append(f"delegate:{d.id}")
        backend = get_backend(d.id)
        payload = self.program.delegate_payload(d.processed)
        try:
            handle = backend.init(payload, d.compile_specs, BackendContext(self.program.named_data, self.event_tracer))
        except ExecupyError:
            raise
        except Exception as e:
            raise MalformedProgramError(f"backend {d.id!r} rejected its payload: {type(e).__name__}: {e}") from e
        parts = [self._arg(a) for a in ins.args]
        stores = [self._store_fn(a) if isinstance(self._plan_values[a], P.Tensor) else None for a in ins.args]

        def call_delegate():
            args = [p if static else p() for static, p in parts]
            outs = backend.execute(handle, args)
            if outs is not None:
                for s, r in zip(stores[len(stores) - len(outs):], outs):
                    s(r)

        return call_delegate

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
        pc = 0
        try:
            # Kernels follow IEEE semantics (inf/NaN results), as ATen does: no warnings.
            with np.errstate(all="ignore"):
                if self._has_jumps:
                    self.steps_last_call = self._run_with_jumps()
                else:
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
