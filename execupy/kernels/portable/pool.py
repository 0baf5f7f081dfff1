"""Pooling: avg_pool2d/3d, max_pool2d/3d_with_indices, adaptive average and max pooling (2-D, 3-D).

Every kernel treats the trailing 2 (or 3) dims as spatial and any leading dims as batch,
so unbatched (C, H, W) inputs work like ATen's.

Fixed-window pooling pads the input once and reduces a strided view of it
(`sliding_window_view`, then stride and dilation by slicing) one kernel tap at a time:
each step is a whole-output array operation, nothing is copied per window. Adaptive
pooling has windows of varying length, so it gathers each window's positions (padded to
the longest window, the extra positions masked out).

ATen conventions reproduced here:
* output length (`pooling_output_shape`): floor or ceil of the window count, and in
  ceil mode the last window must start inside the input or the left padding;
* avg_pool divisor: the window clipped to the padded input (count_include_pad), the
  window clipped to the input (otherwise), or `divisor_override`;
* max_pool: a NaN wins over any number (the last NaN of the window gives the index),
  ties keep the first position, and indices are flat offsets into the input's spatial
  plane (h * W + w). Half types compute in float32.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..registry import register_kernel
from ._util import compute_dtype, is_float, write

INT64 = np.dtype(np.int64)


def _params(values: Sequence[int], k: int, name: str, default: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """One value for all dims, one per dim, or (empty) the default."""
    values = tuple(int(v) for v in values) if values is not None else ()
    if not values and default is not None:
        return tuple(default)
    if len(values) == 1:
        return values * k
    if len(values) != k:
        raise ValueError(f"pooling: {name} must have 1 or {k} entries, got {values}")
    return values


def pooling_output_size(size: int, kernel: int, pad: int, stride: int, dilation: int, ceil_mode: bool) -> int:
    """ATen's `pooling_output_shape` for one spatial dim."""
    span = size + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1  # the last window would start entirely in the right padding
    return out


def _check_input(x: np.ndarray, k: int, name: str) -> None:
    if x.ndim not in (k + 1, k + 2):
        raise ValueError(f"{name}: expected a {k + 1}-D or {k + 2}-D input, got shape {x.shape}")
    if any(s == 0 for s in x.shape[-k:]):
        raise ValueError(f"{name}: empty spatial dims in input of shape {x.shape}")


def _geometry(x: np.ndarray, k: int, kernel_size, stride, padding, dilation, ceil_mode: bool, name: str):
    kernel = _params(kernel_size, k, "kernel_size")
    stride = _params(stride, k, "stride", default=kernel)
    padding = _params(padding, k, "padding")
    dilation = _params(dilation, k, "dilation")
    if any(v <= 0 for v in kernel + stride + dilation) or any(p < 0 for p in padding):
        raise ValueError(f"{name}: invalid kernel {kernel}, stride {stride}, padding {padding} or dilation {dilation}")
    if any(2 * p > d * (kk - 1) + 1 for p, kk, d in zip(padding, kernel, dilation)):
        raise ValueError(f"{name}: padding {padding} must be at most half of the effective kernel size")
    spatial = x.shape[-k:]
    out = tuple(pooling_output_size(s, kk, p, st, d, ceil_mode)
                for s, kk, p, st, d in zip(spatial, kernel, padding, stride, dilation))
    if any(o <= 0 for o in out):
        raise ValueError(f"{name}: output size {out} is too small for input {x.shape}")
    return kernel, stride, padding, dilation, out


def _windows(x: np.ndarray, k: int, kernel, stride, padding, dilation, out, fill) -> np.ndarray:
    """View (..., *out, *kernel) of `x` padded with `fill`: [..., o, t] = x[o*stride - pad + t*dilation]."""
    spatial = x.shape[-k:]
    # right padding large enough for the last (ceil mode) window
    right = [max(0, (o - 1) * st + d * (kk - 1) + 1 - s - p)
             for o, st, d, kk, s, p in zip(out, stride, dilation, kernel, spatial, padding)]
    pads = [(0, 0)] * (x.ndim - k) + list(zip(padding, right))
    xp = np.pad(x, pads, constant_values=fill) if any(padding) or any(right) else x
    extents = [d * (kk - 1) + 1 for d, kk in zip(dilation, kernel)]
    view = sliding_window_view(xp, extents, axis=tuple(range(x.ndim - k, x.ndim)))
    lead = (slice(None),) * (x.ndim - k)
    picks = tuple(slice(0, (o - 1) * st + 1, st) for o, st in zip(out, stride))
    taps = tuple(slice(None, None, d) for d in dilation)
    return view[lead + picks + taps]


# ----------------------------------------------------------------------------- average


def _avg_pool(x, k, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, out, name):
    _check_input(x, k, name)
    kernel, stride, padding, dilation, osize = _geometry(x, k, kernel_size, stride, padding, (1,), ceil_mode, name)
    if divisor_override is not None and int(divisor_override) == 0:
        raise ValueError(f"{name}: divisor_override must be non-zero")
    floating = is_float(out.dtype)
    dtype = compute_dtype(out.dtype) if floating else INT64
    xc = x.astype(dtype, copy=False)
    win = _windows(xc, k, kernel, stride, padding, dilation, osize, 0)
    total = _window_sum(win, k)
    divisor = _avg_divisor(x.shape[-k:], kernel, stride, padding, osize, count_include_pad, divisor_override)
    if floating:
        return write(out, total / divisor.astype(dtype))
    # integer average: C++ division truncates toward zero
    q = np.abs(total) // divisor
    return write(out, np.where(total < 0, -q, q))


def _window_sum(win: np.ndarray, k: int) -> np.ndarray:
    """Sum over the last k (tap) axes, one tap at a time: numpy reduces a few short strided
    axes far slower than it adds whole strided planes."""
    taps = list(np.ndindex(*win.shape[-k:]))
    total = win[(Ellipsis, *taps[0])].copy()
    for tap in taps[1:]:
        total += win[(Ellipsis, *tap)]
    return total


def _avg_divisor(spatial, kernel, stride, padding, osize, count_include_pad, divisor_override) -> np.ndarray:
    """Per output position, what ATen divides the window sum by (outer product of per-dim counts)."""
    if divisor_override is not None:
        return np.full(osize, int(divisor_override), dtype=INT64)
    divisor = np.ones((), dtype=INT64)
    for s, kk, st, p, o in zip(spatial, kernel, stride, padding, osize):
        start = np.arange(o, dtype=INT64) * st - p
        end = np.minimum(start + kk, s + p)  # the window clipped to the padded input
        if count_include_pad:
            count = end - start
        else:
            count = np.minimum(end, s) - np.maximum(start, 0)
        divisor = np.multiply.outer(divisor, count)
    return divisor


@register_kernel("aten::avg_pool2d.out")
def avg_pool2d(input: np.ndarray, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,),
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Optional[int] = None,
               out: np.ndarray = None) -> np.ndarray:
    return _avg_pool(input, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, out,
                     "avg_pool2d")


@register_kernel("aten::avg_pool3d.out")
def avg_pool3d(input: np.ndarray, kernel_size: Sequence[int], stride: Sequence[int] = (), padding: Sequence[int] = (0,),
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Optional[int] = None,
               out: np.ndarray = None) -> np.ndarray:
    return _avg_pool(input, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, out,
                     "avg_pool3d")


# ----------------------------------------------------------------------------- max


def _lowest(dtype: np.dtype):
    return -np.inf if is_float(dtype) else np.iinfo(dtype).min


def _max_dtype(dtype: np.dtype) -> np.dtype:
    if dtype == np.bool_:
        raise TypeError("max pooling does not support bool tensors")
    return compute_dtype(dtype)


def _window_max(win: np.ndarray, k: int, floating: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Max and arg-max over the last k (tap) axes of `win`, scanning taps in row-major order
    with ATen's rule: take a tap when it is greater than the best so far or is NaN. So the
    first maximum wins, a NaN beats every number and a later NaN replaces an earlier one.
    One pass per tap over the output keeps memory flat (no flattened window copy).
    Returns (values, flat tap positions, all_lowest) where all_lowest marks windows whose
    max is the padding value (their index must be the first valid element instead)."""
    taps = list(np.ndindex(*win.shape[-k:]))
    values = win[(Ellipsis, *taps[0])].copy()
    pos = np.zeros(values.shape, dtype=INT64)
    take = np.empty(values.shape, dtype=bool)
    for t, tap in enumerate(taps[1:], start=1):
        v = win[(Ellipsis, *tap)]
        np.greater(v, values, out=take)
        if floating:
            take |= np.isnan(v)
        np.copyto(values, v, where=take)
        np.copyto(pos, t, where=take)
    return values, pos, values == _lowest(win.dtype)


def _flat_index(coords: Sequence[np.ndarray], spatial: Sequence[int]) -> np.ndarray:
    """Row-major offset into the spatial plane from per-dim coordinate arrays."""
    index = np.zeros((), dtype=INT64)
    for c, s in zip(coords, spatial):
        index = index * s + c
    return index


def _first_valid(starts: Sequence[np.ndarray], spatial: Sequence[int], dilation: Sequence[int]) -> np.ndarray:
    """Per output position, the flat index of the first in-bounds tap of its window
    (a window starting in the left padding first lands inside at a multiple of dilation)."""
    firsts = [np.where(s >= 0, s, s + (-s + d - 1) // d * d) for s, d in zip(starts, dilation)]
    grids = np.meshgrid(*firsts, indexing="ij")
    return _flat_index(grids, spatial)


def _max_pool(x, k, kernel_size, stride, padding, dilation, ceil_mode, out, indices, name):
    _check_input(x, k, name)
    kernel, stride, padding, dilation, osize = _geometry(x, k, kernel_size, stride, padding, dilation, ceil_mode, name)
    dtype = _max_dtype(out.dtype)
    floating = is_float(dtype)
    xc = x.astype(dtype, copy=False)
    win = _windows(xc, k, kernel, stride, padding, dilation, osize, _lowest(dtype))
    values, pos, all_lowest = _window_max(win, k, floating)
    # window tap -> input coordinate along each dim
    taps = np.unravel_index(pos, kernel)
    starts = [np.arange(o, dtype=INT64) * st - p for o, st, p in zip(osize, stride, padding)]
    lead = x.ndim - k
    coords = []
    for i in range(k):
        shape = [1] * (lead + k)
        shape[lead + i] = osize[i]
        coords.append(starts[i].reshape(shape) + taps[i] * dilation[i])
    index = _flat_index(coords, x.shape[-k:])
    # windows holding only the lowest value report their first real element, like ATen
    index = np.where(all_lowest, _first_valid(starts, x.shape[-k:], dilation), index)
    return write(out, values), write(indices, index)


@register_kernel("aten::max_pool2d_with_indices.out")
def max_pool2d_with_indices(input: np.ndarray, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,), ceil_mode: bool = False,
                            out: np.ndarray = None, indices: np.ndarray = None) -> tuple[np.ndarray, np.ndarray]:
    """Returns (values, int64 indices): the op's two outputs, a TensorList return."""
    return _max_pool(input, 2, kernel_size, stride, padding, dilation, ceil_mode, out, indices,
                     "max_pool2d_with_indices")


@register_kernel("aten::max_pool3d_with_indices.out")
def max_pool3d_with_indices(input: np.ndarray, kernel_size: Sequence[int], stride: Sequence[int] = (),
                            padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,), ceil_mode: bool = False,
                            out: np.ndarray = None, indices: np.ndarray = None) -> tuple[np.ndarray, np.ndarray]:
    return _max_pool(input, 3, kernel_size, stride, padding, dilation, ceil_mode, out, indices,
                     "max_pool3d_with_indices")


# ----------------------------------------------------------------------------- adaptive


def _adaptive_windows(size: int, osize: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For one dim: gather positions (osize, longest) clipped into range, a validity mask,
    and each window's start. Window o covers [floor(o*size/osize), ceil((o+1)*size/osize))."""
    o = np.arange(osize, dtype=INT64)
    start = (o * size) // osize
    end = -((-(o + 1) * size) // osize)
    longest = int((end - start).max())
    pos = start[:, None] + np.arange(longest, dtype=INT64)
    valid = pos < end[:, None]
    return np.minimum(pos, size - 1), valid, start


def _adaptive_gather(x: np.ndarray, k: int, output_size: Sequence[int], name: str):
    """Windows (..., O1, L1, O2, L2, ...) of x and the matching validity mask."""
    _check_input(x, k, name)
    osize = _params(output_size, k, "output_size")
    if any(o <= 0 for o in osize):
        raise ValueError(f"{name}: output_size must be positive, got {osize}")
    lead = x.ndim - k
    win, valid = x, np.ones((), dtype=bool)
    parts = [_adaptive_windows(s, o) for s, o in zip(x.shape[-k:], osize)]
    for i, (pos, ok, _) in enumerate(parts):
        # axis of dim i after the earlier dims each became two axes
        win = np.take(win, pos, axis=lead + 2 * i)
        valid = np.multiply.outer(valid, ok)
    return win, valid, parts, osize


def _adaptive_avg(x, k, output_size, out, name):
    dtype = compute_dtype(out.dtype) if is_float(out.dtype) else None
    if dtype is None:
        raise TypeError(f"{name}: expected a floating point tensor, got {out.dtype}")
    win, valid, parts, osize = _adaptive_gather(x.astype(dtype, copy=False), k, output_size, name)
    win = np.where(valid, win, 0)
    total = win.sum(axis=tuple(range(-2 * k + 1, 0, 2)), dtype=dtype)
    count = np.ones((), dtype=INT64)
    for _, ok, _ in parts:
        count = np.multiply.outer(count, ok.sum(axis=1))
    return write(out, total / count.astype(dtype))


def _adaptive_max(x, k, output_size, out, indices, name):
    dtype = _max_dtype(out.dtype)
    win, valid, parts, osize = _adaptive_gather(x.astype(dtype, copy=False), k, output_size, name)
    win = np.where(valid, win, _lowest(dtype))
    lead = x.ndim - k
    # (..., O1, L1, O2, L2) -> (..., O1, O2, L1, L2)
    order = list(range(lead)) + [lead + 2 * i for i in range(k)] + [lead + 2 * i + 1 for i in range(k)]
    lengths = [p[0].shape[1] for p in parts]
    values, pos, all_lowest = _window_max(win.transpose(order), k, is_float(dtype))
    taps = np.unravel_index(pos, lengths)
    coords = []
    for i, (_, _, start) in enumerate(parts):
        shape = [1] * (lead + k)
        shape[lead + i] = osize[i]
        coords.append(start.reshape(shape) + taps[i])
    index = _flat_index(coords, x.shape[-k:])
    index = np.where(all_lowest, _first_valid([p[2] for p in parts], x.shape[-k:], (1,) * k), index)
    return write(out, values), write(indices, index)


@register_kernel("aten::_adaptive_avg_pool2d.out", "aten::adaptive_avg_pool2d.out")
def adaptive_avg_pool2d(input: np.ndarray, output_size: Sequence[int], out: np.ndarray) -> np.ndarray:
    return _adaptive_avg(input, 2, output_size, out, "adaptive_avg_pool2d")


@register_kernel("aten::_adaptive_avg_pool3d.out", "aten::adaptive_avg_pool3d.out")
def adaptive_avg_pool3d(input: np.ndarray, output_size: Sequence[int], out: np.ndarray) -> np.ndarray:
    return _adaptive_avg(input, 3, output_size, out, "adaptive_avg_pool3d")


@register_kernel("aten::adaptive_max_pool2d.out")
def adaptive_max_pool2d(input: np.ndarray, output_size: Sequence[int], out: np.ndarray,
                        indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _adaptive_max(input, 2, output_size, out, indices, "adaptive_max_pool2d")


@register_kernel("aten::adaptive_max_pool3d.out")
def adaptive_max_pool3d(input: np.ndarray, output_size: Sequence[int], out: np.ndarray,
                        indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _adaptive_max(input, 3, output_size, out, indices, "adaptive_max_pool3d")
