"""The float32 exponential ExecuTorch's attention kernel (`llama::custom_sdpa`) uses: the C
library's `expf`, in float32, element by element.

With numba (the `fast` extra) `expf` calls that very function (numba's `math.exp` on a float32
compiles to the C library's expf), so the bits are the library's. Without it, numpy's own float32
exp differs from it in about 40% of inputs; the float64 exp rounded to float32 instead is
correctly rounded and differs from glibc's expf in about 0.07% of inputs, by one unit in the
last place. `BACKEND` says which is in use (EXECUPY_NUMBA=0 forces numpy).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np


def expf_numpy(x: np.ndarray) -> np.ndarray:
    """exp of a float32 array, rounded once from float64 (one ulp from glibc's expf at worst)."""
    return np.exp(x, dtype=np.float64).astype(np.float32)


def _compile() -> Optional[Callable[[np.ndarray], np.ndarray]]:
    try:
        import math

        import numba
    except ImportError:
        return None

    @numba.njit(cache=True)  # no fastmath: it would let LLVM swap expf for an approximation
    def _expf_flat(x, out):
        for i in range(x.shape[0]):
            out[i] = math.exp(x[i])

    def expf(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty(x.shape, np.float32)
        _expf_flat(x.reshape(-1), out.reshape(-1))
        return out

    return expf


expf_numba = _compile() if os.environ.get("EXECUPY_NUMBA", "1") != "0" else None
BACKEND = "numba" if expf_numba is not None else "numpy"
expf: Callable[[np.ndarray], np.ndarray] = expf_numba or expf_numpy
