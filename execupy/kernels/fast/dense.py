"""A float32 decode mat-vec, out = w @ x, on both cores (numba only; None without it).

numpy's BLAS (OpenBLAS) reads a weight at ~38 GB/s with its two threads here; the second
core's thread (second_thread.py), which takes the second half of w's rows while the caller
runs the first, reads at 63-71 GB/s (SmolLM2's 211 float32 weights, 538 MB, read from memory,
one token's worth of mat-vecs: 7.6-8.6 ms against 13-14 ms).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from ..cores import SECOND_CORE, Site
from . import quantized

# Below this many weights a mat-vec stays on BLAS (the hand-over costs more than half saves).
SHARE_MIN_WEIGHTS = quantized.SHARE_MIN_WEIGHTS


def _compile() -> Optional[Callable[[Site, np.ndarray, np.ndarray, np.ndarray], None]]:
    if quantized.BACKEND != "numba":
        return None
    import numba

    from .second_thread import SECOND_THREAD

    cores = numba.config.NUMBA_NUM_THREADS  # NUMBA_NUM_THREADS=1: no second thread either

    def matvec(site: Site, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        """out = w @ x: w float32 [n, k] in C order, x [k] and out [n] contiguous. Half of w's rows
        go to the second core's thread when the rule of kernels/cores.py says it is free."""
        share = cores > 1 and SECOND_CORE.free(site)
        t0 = time.perf_counter()
        shared = SECOND_THREAD.dense_matvec(x, w, out, share)
        SECOND_CORE.took(site, 2 if shared else 1, time.perf_counter() - t0)

    return matvec


matvec = _compile()
_warm = {"done": False}


def warm_up() -> None:
    """One tiny mat-vec, when a method binds a step that will make them: numba's first call in a
    process sets up its typing and reads the kernel from its disk cache (~0.2 s), which would
    otherwise land in the first prompt."""
    if matvec is None or _warm["done"]:
        return
    _warm["done"] = True
    from .second_thread import SECOND_THREAD

    SECOND_THREAD.dense_matvec(np.ones(16, np.float32), np.ones((4, 16), np.float32), np.empty(4, np.float32), False)
