"""How many threads numpy's BLAS may use for one product: its rows, and whether the other core is free.

A product with few rows (an LLM's decode: one row; a short prompt: a few) reads each weight
once for a handful of multiply-adds: it is bound by memory bandwidth, which two cores read
faster than one on an idle machine, but on a busy one OpenBLAS's threads wait for each other
at every product and a waiting thread that lost its core stalls it (SmolLM2 fp32 decode on 2
shared cores at load 3.6: 26 ms per token on one thread, 143 ms on two). So a product of
fewer than `EXECUPY_BLAS_SMALL_ROWS` rows (default 16) takes BLAS's threads only when the
process-wide rule of kernels/cores.py says the other core is free (each product step times
itself; a slow two-thread call sends every site to one thread for a few seconds), and a
larger one (a long prompt: compute-bound) uses BLAS's threads while they keep pace: it is
timed against the fastest rate (flops per second) a large product reached in this process, and
`LARGE_STALL` times slower counts as a stall for the same rule. While that rule says the other
core is busy, an `out = a @ b` of many rows runs in two halves instead (a quantized linear's
prompt always does: runtime/fusion.py), one on a worker thread and one on the caller's, each
with BLAS on one thread:
OpenBLAS's threads spin waiting for each other, so with another process on the second core each
product waits for the scheduler, while the caller waits for its half without spinning. SmolLM2,
a 113-token prompt with a shell loop spinning on one of the two cores: fp32 192-294 tok/s on
OpenBLAS's threads, 255-418 with the halves; int4 122-184 and 278-380. On the idle machine
OpenBLAS's threads were the faster (fp32 438-694 against 385-520 always in halves), hence the
rule. `EXECUPY_BLAS_HALVES=0` keeps every large product on OpenBLAS's threads. A call of a
method ends with BLAS set back to the threads it had when execupy was imported.

Only numpy's bundled OpenBLAS is steered (its thread-count functions, found with ctypes);
with another BLAS nothing changes. The count last set is remembered here, so the switch
costs a foreign call only when the count changes.
"""
from __future__ import annotations

import ctypes
import glob
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

import numpy as np

from ..kernels.cores import SECOND_CORE, CallSite

try:
    from resource import RUSAGE_SELF as _RUSAGE_SELF, getrusage as _getrusage
except ImportError:  # not a Unix
    _getrusage = None

T = TypeVar("T")

SMALL_ROWS = int(os.environ.get("EXECUPY_BLAS_SMALL_ROWS", 16))
SPLIT_MIN_ROWS = 64  # a's rows from which a large product is worth two halves
HALVES = os.environ.get("EXECUPY_BLAS_HALVES", "1") != "0"  # 0: large products on OpenBLAS's own threads

# (set, get) function names of OpenBLAS builds: numpy's wheels (scipy-openblas, 64-bit ints), others
_NAMES = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
          ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
          ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
          ("openblas_set_num_threads", "openblas_get_num_threads"))


class _OpenBLAS:
    def __init__(self, set_threads, get_threads):
        self._set, self.actual = set_threads, get_threads  # actual(): what OpenBLAS says it uses now
        self.default = max(1, int(get_threads()))
        self.current = self.default

    def use(self, threads: int) -> None:
        if threads != self.current:
            self._set(threads)
            self.current = threads


def _find() -> Optional[_OpenBLAS]:
    """numpy's OpenBLAS, when numpy bundles one (its wheels keep it in numpy.libs)."""
    folder = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(folder, "lib*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in _NAMES:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                return _OpenBLAS(getattr(lib, set_name), getattr(lib, get_name))
    return None


_BLAS = _find()


def narrow(a, b) -> int:
    """The smaller outer size of a @ b (batch included): a mat-vec has 1 whichever side the vector is."""
    batch = a.size // (a.shape[-2] * a.shape[-1]) if a.shape[-2] and a.shape[-1] else 1
    return batch * min(a.shape[-2], b.shape[-1])


def matmul(site: CallSite, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b on the threads `narrow(a, b)` rows and the other core allow."""
    return product(site, narrow(a, b), np.matmul, a, b)


def product(site: CallSite, rows: int, fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs), a BLAS product of `rows` rows made at `site`, on the threads described above."""
    if _BLAS is None:
        return fn(*args, **kwargs)
    if rows >= SMALL_ROWS:
        halves = _halves(fn, args, kwargs)
        if halves is None:
            _BLAS.use(_BLAS.default)
            return fn(*args, **kwargs)
        a, b, out = halves
        return large(2.0 * a.shape[0] * a.shape[1] * b.shape[1], lambda: fn(*args, **kwargs),
                     lambda: in_halves(a, b, out))
    # Once the second core's own thread serves the large decode mat-vecs (kernels/fast/second_thread.py),
    # small products keep BLAS on one thread: OpenBLAS's worker spins ~0.1 s after each product
    # it shares, so a decode step's few small ones (SmolLM2's k/v linears) kept it spinning on
    # the second core beside ours (fp32 decode 14 ms a token against 11.7 in one comparison).
    threads = _BLAS.default if not SECOND_CORE.own_thread and SECOND_CORE.free(site) else 1
    _BLAS.use(threads)
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    SECOND_CORE.took(site, threads, time.perf_counter() - t0)
    return result


# A large product is a stall when it runs this many times slower than the fastest rate (flops
# per second) a large product reached in this process: its time is milliseconds, steadier
# than a mat-vec's microseconds, so a smaller margin than kernels/cores.py's STALL will do.
LARGE_STALL = 5.0
_FASTEST = [0.0]  # flops per second of the fastest large product so far
# A product that faults in pages (the first read of a memory-mapped weight: a program's first
# prompt) is slow for a reason that is not the other core; more faults than this and its time
# says nothing. (SmolLM2 fp32's first prompt faults 9,000-22,000 times; with full logits, its
# output head's first product faulted 1,638 times and took 36 ms, 30 ms the next time.)
FAULTS_UNTIMED = 64


def _faults() -> int:
    """Page faults of this process so far (minor and major); 0 where the OS does not say."""
    if _getrusage is None:
        return 0
    usage = _getrusage(_RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def large(flops: float, whole: Callable[[], T], halves: Callable[[], T]) -> T:
    """A large product (`flops` multiply-adds times 2): whole() on BLAS's threads, or halves()
    (two halves on two threads, see `both`) while the rule of kernels/cores.py says the other
    core is busy; whole() timed against the fastest rate seen feeds that rule."""
    if _BLAS is None or _BLAS.default < 2 or not HALVES:
        if _BLAS is not None:
            _BLAS.use(_BLAS.default)
        return whole()
    # the rule compares with `STALL` times a one-thread time: this "time" makes it LARGE_STALL times the expected
    site = CallSite(flops / _FASTEST[0] * LARGE_STALL / SECOND_CORE.STALL if _FASTEST[0] else 0.0)
    if site.serial_s and not SECOND_CORE.free(site):
        return halves()
    _BLAS.use(_BLAS.default)
    faults, t0 = _faults(), time.perf_counter()
    result = whole()
    seconds = time.perf_counter() - t0
    if _faults() - faults > FAULTS_UNTIMED:
        return result
    _FASTEST[0] = max(_FASTEST[0], flops / max(seconds, 1e-9))
    if site.serial_s:
        SECOND_CORE.took(site, _BLAS.default, seconds)
    return result


def in_halves(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = a @ b, a's first half of rows on this thread, the second on the worker."""
    half = a.shape[0] // 2
    both(lambda: np.matmul(a[:half], b, out=out[:half]), lambda: np.matmul(a[half:], b, out=out[half:]))
    return out


_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def both(first: Callable[[], object], second: Callable[[], object]) -> None:
    """first() on this thread and second() on the worker at the same time, BLAS on one thread
    in each (one after the other where BLAS has one thread anyway). Both must release the GIL
    for the work to overlap (BLAS and numba's nogil kernels do)."""
    if _BLAS is None or _BLAS.default < 2:
        first(), second()
        return
    _BLAS.use(1)
    at_once(first, second)


def at_once(first: Callable[[], object], second: Callable[[], object]) -> None:
    """first() on this thread and second() on the worker at the same time, BLAS left as it is:
    for two compiled kernels that call no BLAS (numba's nogil ones), on a machine with two
    cores or more (else one after the other). The worker sleeps between calls: numba's own
    thread pool kept spinning after its kernels, beside the BLAS products of a prompt's
    attention, and each slowed the other."""
    if _CORES < 2:
        first(), second()
        return
    other = _worker().submit(second)
    try:
        first()
    finally:
        other.result()


def _halves(fn: Callable, args: tuple, kwargs: dict) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(a, b, out) when fn(*args, **kwargs) is `out = a @ b` of 2-D float arrays worth halving:
    np.matmul(a, b, out=out), or the portable mm kernel's (a, b, out), whose `out` may be a
    dynamic tensor's planned storage of another shape (then the halves fill a new array,
    which the kernel would have returned too)."""
    if _BLAS.default < 2 or not HALVES:  # nothing to share, or not asked to
        return None
    if fn is np.matmul and len(args) == 2 and set(kwargs) == {"out"}:
        a, b, out = *args, kwargs["out"]
    elif fn is _mm_kernel() and len(args) == 3 and not kwargs:
        a, b, out = args
    else:
        return None
    if not all(isinstance(t, np.ndarray) and t.ndim == 2 and t.dtype == out.dtype for t in (a, b, out)):
        return None
    if out.dtype not in (np.float32, np.float64) or a.shape[0] < SPLIT_MIN_ROWS or a.shape[1] != b.shape[0]:
        return None
    if out.shape != (a.shape[0], b.shape[1]) or not out.flags.c_contiguous:
        if fn is np.matmul:
            return None
        out = np.empty((a.shape[0], b.shape[1]), out.dtype)
    return a, b, out


_WORKER: list[ThreadPoolExecutor] = []


def _worker() -> ThreadPoolExecutor:
    if not _WORKER:  # started at the first large product: a process that never makes one has no thread
        _WORKER.append(ThreadPoolExecutor(1, thread_name_prefix="execupy-blas"))
    return _WORKER[0]


def _mm_kernel() -> Optional[Callable]:
    from ..kernels.registry import get_kernel

    return get_kernel("aten::mm.out")


def restore() -> None:
    """BLAS back to the threads it had when execupy was imported (after a method's call)."""
    if _BLAS is not None and _BLAS.current != _BLAS.default:
        _BLAS.use(_BLAS.default)


def threads() -> Optional[int]:
    """The threads numpy's BLAS uses now, or None when it is not a BLAS execupy steers."""
    return None if _BLAS is None else int(_BLAS.actual())


def default_threads() -> Optional[int]:
    """The threads BLAS had when execupy was imported (what a method's call leaves it with)."""
    return None if _BLAS is None else _BLAS.default
