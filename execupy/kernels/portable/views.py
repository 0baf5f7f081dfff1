"""Copies of the strided views: transpose, t, diagonal, unfold, as_strided, view_as_real,
and the pixel (un)shuffle rearrangements.

In ATen these are views that share storage; ExecuTorch has no views at run time, so each
writes a fresh tensor. numpy builds the same view (its strides are the ATen strides times
the item size) and `write` copies it into `out`. Pure data movement: every dtype, and
the result dtype must equal the input's (unfold_copy alone converts, as ExecuTorch's does).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..registry import register_kernel
from ._util import check_created, norm_dim, write
from .shape import same_dtype


@register_kernel("aten::transpose_copy.int_out")
def transpose_copy(x: np.ndarray, dim0: int, dim1: int, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "transpose_copy")
    if x.ndim == 0:
        norm_dim(dim0, 0), norm_dim(dim1, 0)  # only 0 and -1 are valid dims of a scalar
        return write(out, x)
    return write(out, np.swapaxes(x, norm_dim(dim0, x.ndim), norm_dim(dim1, x.ndim)))


@register_kernel("aten::t_copy.out")
def t_copy(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Transpose of a matrix; 0-D and 1-D tensors are copied unchanged."""
    same_dtype(x, out, "t_copy")
    if x.ndim > 2:
        raise ValueError(f"t_copy: expects a tensor of at most 2 dims, got shape {x.shape}")
    return write(out, x.T)


@register_kernel("aten::diagonal_copy.out")
def diagonal_copy(x: np.ndarray, offset: int = 0, dim1: int = 0, dim2: int = 1,
                  out: np.ndarray = None) -> np.ndarray:
    """The diagonal of the (dim1, dim2) planes, moved to the last dim (offset > 0: above it)."""
    same_dtype(x, out, "diagonal_copy")
    if x.ndim < 2:
        raise ValueError(f"diagonal_copy: expects at least 2 dims, got shape {x.shape}")
    d1, d2 = norm_dim(dim1, x.ndim), norm_dim(dim2, x.ndim)
    if d1 == d2:
        raise ValueError(f"diagonal_copy: dim1 and dim2 are both dim {d1}")
    offset = int(offset)
    # numpy raises for an offset beyond the matrix; ATen gives an empty diagonal.
    if offset >= x.shape[d2] or -offset >= x.shape[d1]:
        rest = [s for i, s in enumerate(x.shape) if i not in (d1, d2)]
        return write(out, np.zeros(rest + [0], x.dtype))
    return write(out, np.diagonal(x, offset, d1, d2))


@register_kernel("aten::unfold_copy.out")
def unfold_copy(x: np.ndarray, dimension: int, size: int, step: int, out: np.ndarray) -> np.ndarray:
    """Every window of `size` elements along `dimension`, `step` apart: that dim becomes the
    window count and a new last dim of length `size` holds each window."""
    lifted = x.reshape(1) if x.ndim == 0 else x
    dim = norm_dim(dimension, x.ndim)
    size, step = int(size), int(step)
    if not 0 <= size <= lifted.shape[dim] or step <= 0:
        raise ValueError(f"unfold_copy: size {size} and step {step} do not fit dim {dim} of shape {x.shape}")
    windows = np.lib.stride_tricks.sliding_window_view(lifted, size, axis=dim)
    windows = windows[(slice(None),) * dim + (slice(None, None, step),)]
    check_created(windows.shape)  # overlapping windows can be far larger than x
    return write(out, windows.reshape(windows.shape[1:]) if x.ndim == 0 else windows)


@register_kernel("aten::as_strided_copy.out")
def as_strided_copy(x: np.ndarray, size: Sequence[int], stride: Sequence[int],
                    storage_offset: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    """Reads x's elements (in row-major order, as its storage) at offset + sum(index * stride).

    Every element addressed must lie inside x: a program cannot read past its tensor.
    """
    same_dtype(x, out, "as_strided_copy")
    size, stride = check_created(size), tuple(int(s) for s in stride)
    offset = 0 if storage_offset is None else int(storage_offset)
    if len(size) != len(stride) or any(s < 0 for s in stride) or offset < 0:
        raise ValueError(f"as_strided_copy: size {size}, stride {stride} and offset {offset} are not a valid view")
    if 0 in size:
        return write(out, np.zeros(size, x.dtype))
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= x.size:
        raise IndexError(f"as_strided_copy: the view reaches element {last} of a tensor of {x.size}")
    flat = np.ascontiguousarray(x).reshape(-1)[offset:]
    view = np.lib.stride_tricks.as_strided(flat, size, [s * x.itemsize for s in stride], writeable=False)
    return write(out, view)


@register_kernel("aten::view_as_real_copy.out")
def view_as_real_copy(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """A complex tensor as (..., 2) floats holding (real, imaginary)."""
    if not np.issubdtype(x.dtype, np.complexfloating):
        raise TypeError(f"view_as_real_copy: input must be complex, got {x.dtype}")
    return write(out, np.stack([x.real, x.imag], axis=-1))


# ----------------------------------------------------------------------------- pixel (un)shuffle


def _check_factor(factor: int, name: str) -> int:
    if int(factor) <= 0:
        raise ValueError(f"{name}: factor must be positive, got {factor}")
    return int(factor)


@register_kernel("aten::pixel_shuffle.out")
def pixel_shuffle(x: np.ndarray, upscale_factor: int, out: np.ndarray) -> np.ndarray:
    """(*, C*r*r, H, W) -> (*, C, H*r, W*r): each group of r*r channels tiles an r x r block."""
    same_dtype(x, out, "pixel_shuffle")
    r = _check_factor(upscale_factor, "pixel_shuffle")
    if x.ndim < 3 or x.shape[-3] % (r * r):
        raise ValueError(f"pixel_shuffle: channels of shape {x.shape} are not divisible by {r}*{r}")
    *batch, c, h, w = x.shape
    blocks = x.reshape(*batch, c // (r * r), r, r, h, w)
    n = len(batch)
    order = list(range(n)) + [n, n + 3, n + 1, n + 4, n + 2]  # (C, H, r, W, r)
    return write(out, blocks.transpose(order).reshape(*batch, c // (r * r), h * r, w * r))


@register_kernel("aten::pixel_unshuffle.out")
def pixel_unshuffle(x: np.ndarray, downscale_factor: int, out: np.ndarray) -> np.ndarray:
    """(*, C, H*r, W*r) -> (*, C*r*r, H, W): the inverse of pixel_shuffle."""
    same_dtype(x, out, "pixel_unshuffle")
    r = _check_factor(downscale_factor, "pixel_unshuffle")
    if x.ndim < 3 or x.shape[-2] % r or x.shape[-1] % r:
        raise ValueError(f"pixel_unshuffle: height and width of shape {x.shape} are not divisible by {r}")
    *batch, c, h, w = x.shape
    blocks = x.reshape(*batch, c, h // r, r, w // r, r)
    n = len(batch)
    order = list(range(n)) + [n, n + 2, n + 4, n + 1, n + 3]  # (C, r, r, H, W)
    return write(out, blocks.transpose(order).reshape(*batch, c * r * r, h // r, w // r))
