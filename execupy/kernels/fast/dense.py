"""A float32 decode mat-vec, out = w @ x, on both cores (numba only).

numpy's BLAS (OpenBLAS) read SmolLM2's 211 float32 weights (538 MB, one token's mat-vecs) at
~38 GB/s with its two threads; the second core's thread (second_thread.py), taking the second
half of w's rows while the caller runs the first, read them at 49-71 GB/s (7.6-10.4 ms against
13-14 ms; the machine's memory bandwidth varies from hour to hour).

Loaded only when a method binds such a mat-vec (`matvec_kernel`): numba's import and first call
add ~115 MiB of resident memory, which a program without one (a small CNN) need not carry.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .. import cores
from ..cores import Site

# From this many bytes of weight on a decode mat-vec shares its rows (smaller ones stay on BLAS)
SHARE_MIN_BYTES = cores.SHARE_MIN_BYTES

MatVec = Callable[[Site, np.ndarray, np.ndarray, np.ndarray], None]
_LOADED: list[Optional[MatVec]] = []  # [the mat-vec or None], once loaded
_DECODE_WARMED: list[bool] = []  # [True] once an LLM's decode kernels are warmed up


def matvec_kernel(decode_steps: bool = True) -> Optional[MatVec]:
    """The shared mat-vec, loaded (and warmed up) on first use; None without numba or with
    EXECUPY_NUMBA=0. With `decode_steps` an LLM's other decode kernels are warmed up too, now
    (at bind) rather than inside the first prompt; a CNN's classifier does not need them."""
    if not _LOADED:
        _LOADED.append(_load())
    if decode_steps and _LOADED[0] is not None and not _DECODE_WARMED:
        from . import decode_jit

        decode_jit.warm_up()
        _DECODE_WARMED.append(True)
    return _LOADED[0]


def _load() -> Optional[MatVec]:
    from . import quantized

    if quantized.BACKEND != "numba":
        return None
    from . import second_thread_jit as ST
    from .second_thread import SECOND_THREAD

    def matvec(site: Site, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        """out = w @ x: w float32 [n, k] in C order, x [k] and out [n] contiguous. Half of w's rows
        go to the second core's thread when the rule of kernels/cores.py says it is free."""
        SECOND_THREAD.run(ST.dense_matvec_halves, (x, w, out), site)

    # numba's first call in a process sets up its typing and reads the kernel from its disk
    # cache (~0.2 s): done here, at bind, not inside the first prompt; the weight read-only, as
    # a program's constants are (numba compiles a read-only array's call apart)
    weight = np.ones((4, 16), np.float32)
    weight.flags.writeable = False
    SECOND_THREAD.dense_matvec(np.ones(16, np.float32), weight, np.empty(4, np.float32), False)
    return matvec
