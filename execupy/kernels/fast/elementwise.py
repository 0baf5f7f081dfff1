"""Kernels for chains of float32 element-wise ops (the `elementwise` rule of execupy.runtime.fusion).

A chain is a run of instructions such as `x = x * a; x = x + b; ...`. Bound one by one, each
costs a Python step and a kernel's argument checks, which for small tensors is nearly all
of its time. Here a chain runs in two ways, chosen per stretch of it:

* `NUMPY_OPS`: each op is the very numpy ufunc call the portable kernel makes, written into
  the op's planned out tensor. Same operations, same buffers, same order: bit-identical.
* `compile_chain`: a stretch of exactly rounded ops (add, sub, mul, div, neg, relu, sqrt) on
  tensors of one shape becomes a single numba loop over the elements, each element going
  through the whole stretch in registers; only values read outside the stretch are stored.
  IEEE float32 arithmetic rounds each of these ops the same in numba and numpy, so the
  result is bit-identical too. exp, tanh and sigmoid stay numpy calls (numba's `exp` is libm's,
  which rounds differently from numpy's).

The numba source is generated, written to a file named by its hash under the kernel cache
(`EXECUPY_KERNEL_CACHE`, default ~/.cache/execupy/kernels) and compiled with numba's disk
cache, so the next load of the same chain reads the machine code back instead of compiling.
Numba is the optional `fast` extra; `EXECUPY_NUMBA=0` turns it off here as everywhere.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

_ZERO = np.float32(0)
_ONE = np.float32(1)


def _relu(x: np.ndarray, out: np.ndarray) -> None:
    np.maximum(x, _ZERO, out=out)  # maximum keeps NaN, as the portable relu does


def _sigmoid(x: np.ndarray, out: np.ndarray) -> None:
    """1 / (1 + exp(-x)) in float32, the portable sigmoid's operations, written into `out`."""
    np.negative(x, out)
    np.exp(out, out)
    np.add(_ONE, out, out)
    np.true_divide(_ONE, out, out)


# op -> numpy call (operands..., out) doing what the portable kernel does for float32 tensors
NUMPY_OPS: dict[str, Callable[..., object]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "neg": np.negative, "relu": _relu, "sqrt": np.sqrt, "exp": np.exp, "tanh": np.tanh, "sigmoid": _sigmoid,
}
ARITY = {name: 2 if name in ("add", "sub", "mul", "div") else 1 for name in NUMPY_OPS}

# op -> the same operation on one float32 element in numba source; exactly rounded ops only
NUMBA_OPS: dict[str, str] = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}", "neg": "-{0}",
    "relu": "({0} if not {0} <= 0 else _ZERO)",  # NaN stays NaN, -0.0 becomes +0.0, as np.maximum does
    "sqrt": "np.sqrt({0})",
}

MAX_KERNEL_OPS = int(os.environ.get("EXECUPY_CHAIN_MAX_OPS", 64))  # numba's compile time grows with the loop body
MIN_KERNEL_OPS = 3  # below this a numba call costs about what the numpy calls it replaces do

Ref = tuple[str, int]  # ("t", k): the k-th op's result; ("a", j): input array j; ("c", j): constant j


def numba_enabled() -> bool:
    """Numba compiles chains when it is installed and EXECUPY_NUMBA is not 0 (read at each load)."""
    return os.environ.get("EXECUPY_NUMBA", "1") != "0" and importlib.util.find_spec("numba") is not None


def numba_loaded() -> bool:
    """numba is allowed and imported already (by a quantized or float mat-vec's kernels). Steps
    that gain microseconds from a compiled kernel use one then, but never load numba (0.3 s and
    ~115 MiB resident) for that alone."""
    return "numba" in sys.modules and numba_enabled()


def kernel_source(ops: Sequence[tuple[str, Sequence[Ref]]], periods: Sequence[int], outputs: Sequence[int]) -> str:
    """A numba module whose `kernel(n, c, a0.., o0..)` runs `ops` on each of n elements.

    Input j is read at element i (period 0), 0 (period 1) or i % period (a trailing broadcast);
    constant j is c[j]; op k's result is stored to o<m> when k == outputs[m]."""
    def read(ref: Ref) -> str:
        kind, j = ref
        if kind == "t":
            return f"t{j}"
        if kind == "c":
            return f"c[{j}]"
        p = periods[j]
        return f"a{j}[i]" if p == 0 else f"a{j}[0]" if p == 1 else f"a{j}[i % {p}]"

    params = ", ".join(["n", "c"] + [f"a{j}" for j in range(len(periods))] + [f"o{m}" for m in range(len(outputs))])
    lines = ["import numba", "import numpy as np", "", "_ZERO = np.float32(0)", "", "",
             "@numba.njit(cache=True, error_model='numpy', nogil=True)", f"def kernel({params}):",
             "    for i in range(n):"]
    lines += [f"        t{k} = {NUMBA_OPS[name].format(*(read(r) for r in refs))}" for k, (name, refs) in enumerate(ops)]
    lines += [f"        o{m}[i] = t{k}" for m, k in enumerate(outputs)]
    return "\n".join(lines) + "\n"


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("EXECUPY_KERNEL_CACHE", Path.home() / ".cache" / "execupy" / "kernels"))


_LOADED: dict[str, Callable] = {}  # source hash -> numba dispatcher, for this process


def compile_chain(source: str, args: Sequence[object]) -> Callable:
    """The numba kernel of `source` (kernel_source), compiled for the types of `args`.

    The source goes to <cache>/chain_<hash>.py so numba's cache can find the machine code
    again in the next process; where the cache cannot be written it is compiled in memory."""
    import numba

    digest = source_digest(source)
    kernel = _LOADED.get(digest)
    if kernel is None:
        kernel = _import_kernel(source, digest)
        _LOADED[digest] = kernel
    types = tuple(numba.typeof(a) for a in args)
    try:
        kernel.compile(types)
    except Exception:  # an unreadable cache entry (another numba, a broken file): compile afresh
        kernel = _LOADED[digest] = _compile_in_memory(source, digest)
        kernel.compile(types)
    return kernel


def source_digest(source: str) -> str:
    """The name a generated kernel's source is cached under. hashlib is imported here, as
    numba is, only when a kernel is compiled: it loads OpenSSL (3 MiB resident)."""
    import hashlib

    return hashlib.sha256(source.encode()).hexdigest()[:20]


def _import_kernel(source: str, digest: str) -> Callable:
    from ...fileio import atomic_write

    path = kernel_cache_dir() / f"chain_{digest}.py"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != source:
            atomic_write(path, source)
        spec = importlib.util.spec_from_file_location(f"execupy_chain_{digest}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # numba's cache finds the kernel's globals through its module
        spec.loader.exec_module(module)
        return module.kernel
    except OSError:  # a read-only home: compile without the disk cache
        return _compile_in_memory(source, digest)


def _compile_in_memory(source: str, digest: str) -> Callable:
    namespace: dict = {}
    exec(compile(source.replace("cache=True", "cache=False"), f"<chain {digest}>", "exec"), namespace)
    return namespace["kernel"]
