"""GELU (erf form) on float32 tensors, compiled: the portable kernel's arithmetic in one pass.

The portable `aten::gelu.out` (approximate='none') computes erf in float64 with two
Chebyshev interpolants (execupy/kernels/portable/unary.py: erf_f64) and then
`v * 0.5 * (1 + erf)` in float32. In numpy that is a dozen passes over the tensor with
masks and temporaries, the largest cost of a BERT-like encoder's forward. The numba
kernel here runs the very same operations per element, in the same order (the mapping of
x onto the interpolant's window, Clenshaw's recurrence as numpy's chebval runs it, the
float32 tail), so it agrees with the numpy kernel bit for bit except where numpy's
float64 exp and libm's might differ by an ulp, which the rounding to float32 hides
(tests/kernels/test_fast_conv.py compares the two on a million points).

The recurrence is generated as straight-line source with the coefficients written in
(a loop over a coefficient array ran 4x slower), cached on disk like the element-wise
chains (execupy/kernels/fast/elementwise.py). One thread, as the depthwise kernels
(execupy/kernels/fast/conv.py says why). `gelu(x, out)` returns None when numba is
missing or EXECUPY_NUMBA=0; the portable kernel then keeps its numpy path.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional

import numpy as np
from numpy.polynomial import polyutils

from ..portable.unary import _ERF_SMALL, _ERFCX_MID
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
    body = ["    v = x[i]",
            "    z = np.float64(v * SQRT_HALF)",
            "    az = abs(z)",
            "    if az < 1.0:",
            "        e = z * erf_small(z * z)",
            "    elif az < 6.0:",
            "        e = (1.0 if z > 0 else -1.0) * (1.0 - np.exp(-az * az) * erfcx_mid(az))",
            "    else:",
            "        e = np.sign(z)  # +-1, NaN for NaN",
            "    out[i] = v * HALF * (ONE + np.float32(e))"]
    lines = ["import math", "import numba", "import numpy as np", "",
             "SQRT_HALF, HALF, ONE = np.float32(math.sqrt(0.5)), np.float32(0.5), np.float32(1)", "", ""]
    lines += _clenshaw("erf_small", _ERF_SMALL) + _clenshaw("erfcx_mid", _ERFCX_MID)
    lines += ["@numba.njit(cache=True)", "def kernel(x, out):", "  for i in range(x.shape[0]):"]
    lines += ["  " + b for b in body] + ["", ""]
    return "\n".join(lines)


def _compile() -> Optional[Callable[[np.ndarray, np.ndarray], None]]:
    if not elementwise.numba_enabled():
        return None
    source = kernel_source()
    return elementwise._import_kernel(source, "gelu_" + hashlib.sha256(source.encode()).hexdigest()[:20])


_KERNEL = _compile()


def gelu(x: np.ndarray, out: np.ndarray) -> Optional[np.ndarray]:
    """erf-GELU of float32 `x` into float32 `out` of the same shape (both C-contiguous);
    None (nothing written) when the compiled kernel is not available or does not apply."""
    if (_KERNEL is None or x.dtype != np.float32 or out.dtype != np.float32 or x.shape != out.shape
            or not x.flags.c_contiguous or not out.flags.c_contiguous):
        return None
    _KERNEL(x.reshape(-1), out.reshape(-1))
    return out
