"""Kernels for fused steps (execupy.runtime.fusion) and the hot quantized ops.

The float32 kernels here (`rms_norm`, `rope`, `rope_swapped`, `silu`) do, in one call, the very
operations the portable kernels they replace do one instruction at a time, in the same
order and dtype, so they are bit-identical to the unfused plan.

The quantized kernels (`execupy.kernels.fast.quantized`) have two implementations:
numba-compiled ones, used when the optional `fast` extra (numba) is installed, and numpy
ones, always available and the reference the compiled ones are tested against.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional

import numpy as np

from ..portable.reduce import row_sums
from ..portable.unary import _sigmoid


def rms_norm(x: np.ndarray, eps, weight: np.ndarray) -> np.ndarray:
    """x * rsqrt(mean(x**2, -1, keepdim) + eps) * weight, as pow/mean/add/rsqrt/mul/mul compute it."""
    total = row_sums(np.square(x), np.float32)  # added in order, as the portable mean
    mean = np.true_divide(total, x.shape[-1] if x.ndim else 1, dtype=np.float32)
    inv = 1 / np.sqrt(mean + np.asarray(eps, np.float32))
    return np.multiply(x * inv, weight)


def rope(a: np.ndarray, b: np.ndarray, c: np.ndarray, s: np.ndarray, dim: int) -> np.ndarray:
    """cat([a*c - b*s, b*c + a*s], dim): rotate-half rotary position embedding."""
    return np.concatenate((a * c - b * s, b * c + a * s), axis=dim)


def rotate_pairs(a: np.ndarray, b: np.ndarray, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    """stack([a*c - b*s, a*s + b*c], -1): rotary position embedding on interleaved pairs (a, b),
    as multiply, subtract, add, reshape and concatenate compute it (each product rounded to
    float32, then the sum)."""
    out = np.empty(np.broadcast_shapes(a.shape, c.shape, b.shape, s.shape) + (2,), np.float32)
    np.subtract(a * c, b * s, out=out[..., 0])
    np.add(a * s, b * c, out=out[..., 1])
    return out


def compiled_decode():
    """kernels/fast/decode_jit where numba is loaded already (elementwise.numba_loaded), else None."""
    from .elementwise import numba_loaded

    if not numba_loaded():
        return None
    from . import decode_jit

    return decode_jit


ROWS_WORTH_NUMBA = 8192  # elements from which a norm or softmax loads numba for its compiled rows


def compiled_rows(size: int):
    """kernels/fast/rows_jit (layer norm and softmax rows with numpy's bits) for a tensor of `size`
    elements, else None: where numba is loaded already, or is allowed and installed and the tensor
    is large enough (an encoder's 128 x 256 norm gains ~100 us a call; a classifier's softmax over
    ten scores would not repay numba's 0.3 s and ~100 MiB). Asked at every call of the kernel:
    the loaded case costs two dict lookups (find_spec cost 11 us)."""
    if os.environ.get("EXECUPY_NUMBA", "1") == "0":
        return None
    rows = sys.modules.get(__name__ + ".rows_jit")
    if rows is not None:
        return rows
    from .elementwise import numba_enabled

    if "numba" not in sys.modules and not (size >= ROWS_WORTH_NUMBA and numba_enabled()):
        return None
    from . import rows_jit

    return rows_jit


def rope_swapped(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x*cos + cat([x[..., D/2:], x[..., :D/2]], -1)*sin, as mul, cat, mul, add compute it
    (the tables are (cos, cos) and (-sin, sin): docs/llm-graph.md)."""
    half = x.shape[-1] // 2
    swapped = np.empty_like(x)
    swapped[..., :half] = x[..., half:]
    swapped[..., half:] = x[..., :half]
    return np.add(x * cos, swapped * sin)


def silu(gate: np.ndarray) -> np.ndarray:
    """gate * sigmoid(gate), as sigmoid then mul compute it, in gate's layout (a prompt's gate is
    a linear's result transposed); numpy's exp, then the rest in one compiled pass where numba
    is loaded."""
    compiled = compiled_decode()
    if compiled is not None:
        out = np.empty_like(gate)
        run = compiled_silu(gate, out, compiled)
        if run is not None:
            run()
            return out
    return gate * _sigmoid(gate)


def compiled_silu(x: np.ndarray, out: np.ndarray, compiled=None) -> Optional[Callable[[], None]]:
    """A call writing silu(x) into out, through decode_jit.silu_of_exp, when numba is loaded and x
    and out are float32 laid out alike in one block (either order); else None. `compiled`:
    `compiled_decode()` looked up already (a step's bind: the lookup costs ~4 us)."""
    compiled = compiled if compiled is not None else compiled_decode()
    flat = same_layout_flat(x, out) if compiled is not None and x.dtype == out.dtype == np.float32 else None
    if flat is None or np.may_share_memory(x, out):
        return None
    kernel, (xs, outs) = compiled.silu_of_exp, flat

    def silu_compiled() -> None:
        np.negative(x, out=out)  # exact; then numpy's exp in place
        np.exp(out, out=out)
        kernel(xs, outs)

    return silu_compiled


def same_layout_flat(*arrays: np.ndarray) -> Optional[list[np.ndarray]]:
    """1-D views of arrays of one shape and strides that each fill one block of memory (C or F
    order), element i of each being the same index in all; None otherwise."""
    first = arrays[0]
    if not (first.flags.c_contiguous or first.flags.f_contiguous) or any(
            a.shape != first.shape or a.strides != first.strides for a in arrays[1:]):
        return None
    return [a.ravel(order="K") for a in arrays]
