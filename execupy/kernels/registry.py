"""The kernel table: a plain dict keyed by ExecuTorch operator names.

It sits below the runtime: kernel modules register into it, the runtime looks kernels
up in it, and neither imports the other.

Kernel calling convention (the whole contract between runtime and kernels):

* A kernel is registered under the operator key of its out variant, exactly as the
  program names it: `aten::add.out`, `aten::topk.values`, `aten::copy_`,
  `executorch_prim::add.Scalar`.
* It is called with every argument of the instruction except the last one, which is
  the return slot. Arguments arrive as Python/numpy objects: Tensor -> np.ndarray
  (current shape), Int -> int, Double -> float, Bool -> bool, Null -> None,
  String -> str, IntList -> tuple[int], DoubleList/BoolList -> tuple,
  TensorList -> list[np.ndarray], OptionalTensorList -> list[np.ndarray | None].
* It returns the result: an array for one output, a tuple/list of arrays for several
  (TensorList return), a Python scalar for symbolic-int ops.
* It should write into the planned `out` array and return that very object when the
  result has out's shape (this is the allocation-free fast path). When the shape
  differs (dynamic shapes) it returns a new array, and the runtime copies it into the
  tensor's planned storage after checking its upper bound. Correctness never depends
  on a kernel writing in place; speed does.
* Constant tensors are read-only views into the program file: never write into an input.

A later, faster kernel library overrides an entry by registering the same key again
(`override=True`); lookups are by key alone, dtypes are checked by the kernels.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

Kernel = Callable[..., Any]

KERNELS: dict[str, Kernel] = {}
# Which module's import registered each key (what a kernel list records, see selection.py).
ORIGINS: dict[str, str] = {}
_loaded = False
_importing: Optional[str] = None  # the kernel module being imported by _load_builtin_kernels


def register_kernel(*keys: str, override: bool = False) -> Callable[[Kernel], Kernel]:
    """Decorator: register `fn` under one or more operator keys."""

    def wrap(fn: Kernel) -> Kernel:
        for key in keys:
            if key in KERNELS and not override and KERNELS[key] is not fn:
                raise ValueError(f"kernel {key} registered twice ({KERNELS[key].__module__} and {fn.__module__})")
            KERNELS[key] = fn
            ORIGINS[key] = _importing or fn.__module__
        return fn

    return wrap


def _load_builtin_kernels() -> None:
    """Import the kernel modules once: all built-in ones, or those of the active kernel list."""
    global _loaded
    if not _loaded:
        _loaded = True
        from .selection import modules_to_import

        for name in modules_to_import():
            import_kernel_module(name)


def import_kernel_module(name: str) -> None:
    """Import one kernel module, recording it as the origin of the keys it registers."""
    import importlib

    global _importing
    outer, _importing = _importing, _importing or name
    try:
        importlib.import_module(name)
    finally:
        _importing = outer


def get_kernel(key: str) -> Optional[Kernel]:
    _load_builtin_kernels()
    return KERNELS.get(key)


def kernel_names() -> list[str]:
    _load_builtin_kernels()
    return sorted(KERNELS)
