"""How many threads numpy's BLAS may use for one product, chosen by the product's rows.

A product with few rows (an LLM's decode: one row; a short prompt: a few) reads each weight
once for a handful of multiply-adds: it is bound by memory bandwidth, which one core nearly
saturates, so a second BLAS thread gains little on a quiet machine. On a busy one it costs
a great deal: OpenBLAS's threads wait for each other at every product, and a waiting thread
that lost its core stalls the product (SmolLM2 fp32 decode on 2 shared cores at load 3.6:
26 ms per token on one thread, 143 ms on two). So a product of fewer than
`EXECUPY_BLAS_ONE_THREAD_ROWS` rows (default 16) runs on one thread, and a larger one (a long
prompt: compute-bound) on the threads BLAS had when execupy was imported; a call of a method
ends with BLAS set back to those.

Only numpy's bundled OpenBLAS is steered (its thread-count functions, found with ctypes);
with another BLAS nothing changes. The count last set is remembered here, so the switch
costs a foreign call only when the count changes (about twice per decoded token).
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Optional

import numpy as np

ONE_THREAD_ROWS = int(os.environ.get("EXECUPY_BLAS_ONE_THREAD_ROWS", 16))

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


def for_rows(rows: int) -> None:
    """Before a BLAS product with `rows` rows: one thread below ONE_THREAD_ROWS, else the default."""
    if _BLAS is not None:
        _BLAS.use(1 if rows < ONE_THREAD_ROWS else _BLAS.default)


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
