"""Padding kernels: constant_pad_nd, reflection_pad{1,2,3}d and replication_pad{1,2,3}d.

`pad` lists (before, after) pairs starting from the last dim, as in torch. Negative
amounts crop. Reflection and replication pads are gathers: every output position along
a padded dim reads one input position (mirrored about the edge element, or clamped to
it), so they keep values bit for bit in every dtype.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..registry import register_kernel
from ._util import check_created, write
from .shape import same_dtype


@register_kernel("aten::constant_pad_nd.out")
def constant_pad_nd(x: np.ndarray, pad: Sequence[int], value=0, out: np.ndarray = None) -> np.ndarray:
    """`pad` pairs (before, after) start at the last dim; negative amounts crop."""
    same_dtype(x, out, "constant_pad_nd")
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise ValueError(f"constant_pad_nd: pad {tuple(pad)} does not fit a rank-{x.ndim} tensor")
    shape, src, dst = list(x.shape), [slice(None)] * x.ndim, [slice(None)] * x.ndim
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        size = x.shape[d] + before + after
        if size < 0:
            raise ValueError(f"constant_pad_nd: padding {before, after} leaves dim {d} with size {size}")
        shape[d] = size
        # The part of the input that survives cropping, and where it lands in the result.
        lo, hi = max(-before, 0), x.shape[d] - max(-after, 0)
        src[d] = slice(lo, max(hi, lo))
        dst[d] = slice(max(before, 0), max(before, 0) + max(hi - lo, 0))
    shape = check_created(shape)
    result = np.full(shape, value, dtype=out.dtype) if shape != out.shape else out
    if result is out:
        out.fill(value)
    result[tuple(dst)] = x[tuple(src)]
    return write(out, result)


# ----------------------------------------------------------------------------- reflection / replication


def reflect(i: np.ndarray, size: int) -> np.ndarray:
    """Mirror about the edge elements (which are not repeated): -1 -> 1, size -> size - 2."""
    i = np.abs(i)
    return np.where(i >= size, 2 * (size - 1) - i, i)


def replicate(i: np.ndarray, size: int) -> np.ndarray:
    return np.clip(i, 0, size - 1)


def _edge_pad(x: np.ndarray, pad: Sequence[int], out: np.ndarray, k: int, source: Callable, name: str) -> np.ndarray:
    """Pad the last `k` dims of an (N, C, ...) or (C, ...) tensor; `source` maps each output
    position (shifted by the `before` amount) to the input position it copies."""
    same_dtype(x, out, name)
    pad = [int(p) for p in pad]
    if len(pad) != 2 * k or x.ndim not in (k + 1, k + 2):
        raise ValueError(f"{name}: expects {2 * k} pads and a {k + 1}-D or {k + 2}-D input, "
                         f"got pad {tuple(pad)} and shape {x.shape}")
    shape = list(x.shape)
    for i in range(k):
        d, (before, after) = x.ndim - 1 - i, pad[2 * i:2 * i + 2]
        shape[d] = x.shape[d] + before + after
        if shape[d] < 0 or (shape[d] > 0 and x.shape[d] == 0):
            raise ValueError(f"{name}: padding {before, after} does not fit dim {d} of shape {x.shape}")
        if source is reflect and not (before < x.shape[d] and after < x.shape[d]):
            raise ValueError(f"{name}: padding {before, after} must be smaller than dim {d} of shape {x.shape}")
    check_created(shape)
    y = x
    for i in range(k):
        d = x.ndim - 1 - i
        positions = np.arange(shape[d], dtype=np.int64) - pad[2 * i]
        y = np.take(y, source(positions, x.shape[d]), axis=d)
    return write(out, y)


def _register_edge_pads(mode: str, source: Callable) -> None:
    for k in (1, 2, 3):
        name = f"{mode}_pad{k}d"

        def kernel(x: np.ndarray, padding: Sequence[int], out: np.ndarray, k=k, name=name) -> np.ndarray:
            return _edge_pad(x, padding, out, k, source, name)

        kernel.__name__ = kernel.__qualname__ = name
        register_kernel(f"aten::{name}.out")(kernel)


_register_edge_pads("reflection", reflect)
_register_edge_pads("replication", replicate)
