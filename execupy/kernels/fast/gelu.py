"""GELU (erf form) on float32 tensors, compiled: the portable kernel's arithmetic, vectorized.

The portable `aten::gelu.out` (approximate='none') computes erf in float64 with two
Chebyshev interpolants (execupy/kernels/portable/unary.py: erf_f64) and then
`v * 0.5 * (1 + erf)` in float32. In numpy that is a dozen passes over the tensor with
masks and temporaries, once the largest cost of a BERT-like encoder's forward (0.75 ms
for 128x1024 values; 0.22 ms here). The numba
kernel here runs the very same operations per element, in the same order (the mapping of
x onto the interpolant's window, Clenshaw's recurrence as numpy's chebval runs it, the
float32 tail, numpy's own exp), so it agrees with the numpy kernel bit for bit
(tests/kernels/test_fast_conv.py compares the two on a million points).

The recurrence is generated as straight-line source with the coefficients written in
(a loop over a coefficient array ran 4x slower), cached on disk like the element-wise
chains (execupy/kernels/fast/elementwise.py). One thread, as the depthwise kernels
(execupy/kernels/fast/conv.py says why). `gelu(x, out)` returns None when numba is
missing or EXECUPY_NUMBA=0; the portable kernel then keeps its numpy path.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
from numpy.polynomial import polyutils

from ..portable.unary import erf_fits
from . import elementwise


def _clenshaw(name: str, cheb: np.polynomial.Chebyshev) -> list[str]:
    """Source of `name(x) = cheb(x)`: numpy's mapdomain then chebval, operation for operation."""
    off, scl = (float(v) for v in polyutils.mapparms(cheb.domain, cheb.window))
    c = [float(v) for v in cheb.coef]
    n = len(c)
    lines = ["@numba.njit(cache=True, inline='always')", f"def {name}(x):",
             f"    x = {off!r} + {scl!r} * x", "    x2 = 2.0 * x", f"    c0 = {c[n - 2]!r}", f"    c1 = {c[n - 1]!r}"]
    lines += [f"    c0, c1 = {c[n - i]!r} - c1, c0 + c1 * x2" for i in range(3, n + 1)]
    return lines + ["    return c0 + c1 * x", "", ""]


def kernel_source() -> str:
    # Every element is first computed as if |z| < 1: no branch, so LLVM vectorizes the loop.
    # The elements with |z| >= 1 or NaN (about one in six of a unit normal's) are then listed
    # and redone with the other interpolant; their exp is numpy's (gelu() below), as in
    # erf_f64. Each element goes through exactly the operations of its own branch.
    lines = ["import math", "import numba", "import numpy as np", "",
             "SQRT_HALF, HALF, ONE = np.float32(math.sqrt(0.5)), np.float32(0.5), np.float32(1)", "", ""]
    erf_small, erfcx_mid = erf_fits()
    lines += _clenshaw("erf_small", erf_small) + _clenshaw("erfcx_mid", erfcx_mid)
    lines += ["@numba.njit(cache=True)",
              "def small(x, out, wide):",
              "    for i in range(x.shape[0]):",
              "        v = x[i]",
              "        z = np.float64(v * SQRT_HALF)",
              "        out[i] = v * HALF * (ONE + np.float32(z * erf_small(z * z)))",
              "    m = 0",
              "    for i in range(x.shape[0]):  # branch-free: a mispredicted branch costs more",
              "        wide[m] = i",
              "        m += not abs(x[i] * SQRT_HALF) < 1.0",
              "    return m",
              "",
              "",
              "@numba.njit(cache=True)",
              "def gather(x, wide, z, arg):",
              "    for j in range(wide.shape[0]):",
              "        z[j] = np.float64(x[wide[j]] * SQRT_HALF)",
              "        arg[j] = -abs(z[j]) * abs(z[j])",
              "",
              "",
              "@numba.njit(cache=True)",
              "def wide_finish(x, wide, z, expd, out):",
              "    e = np.empty(z.shape[0])",
              "    for j in range(z.shape[0]):  # as if 1 <= |z| < 6, branch-free: vectorized",
              "        az = abs(z[j])",
              "        e[j] = (1.0 if z[j] > 0 else -1.0) * (1.0 - expd[j] * erfcx_mid(az))",
              "    for j in range(z.shape[0]):",
              "        if not abs(z[j]) < 6.0:",
              "            e[j] = np.sign(z[j])  # +-1, NaN for NaN",
              "        v = x[wide[j]]",
              "        out[wide[j]] = v * HALF * (ONE + np.float32(e[j]))",
              "",
              "",
              "def kernel(x, out):",
              "    wide = np.empty(x.shape[0], np.int64)",
              "    wide = wide[:small(x, out, wide)]",
              "    if wide.size:",
              "        z, arg = np.empty(wide.size), np.empty(wide.size)",
              "        gather(x, wide, z, arg)",
              "        wide_finish(x, wide, z, np.exp(arg), out)  # numpy's exp, as erf_f64 uses",
              ""]
    return "\n".join(lines)


def _compile() -> Optional[Callable[[np.ndarray, np.ndarray], None]]:
    if not elementwise.numba_enabled():
        return None
    source = kernel_source()
    return elementwise._import_kernel(source, "gelu_" + elementwise.source_digest(source))


_KERNEL = _compile()


def gelu(x: np.ndarray, out: np.ndarray) -> Optional[np.ndarray]:
    """erf-GELU of float32 `x` into float32 `out` of the same shape (both C-contiguous);
    None (nothing written) when the compiled kernel is not available or does not apply."""
    if (_KERNEL is None or x.dtype != np.float32 or out.dtype != np.float32 or x.shape != out.shape
            or not x.flags.c_contiguous or not out.flags.c_contiguous):
        return None
    _KERNEL(x.reshape(-1), out.reshape(-1))
    return out
