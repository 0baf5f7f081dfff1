"""Resampling: upsample_nearest{1,2,3}d, _upsample_nearest_exact{1,2,3}d, upsample_linear1d,
upsample_bilinear2d, _upsample_bilinear2d_aa (anti-aliased), upsample_trilinear3d,
upsample_bicubic2d (`.vec_out` and `.out` overloads) and grid_sampler_2d.

Upsampling is separable: each spatial axis gets a table of source positions (and, for
the interpolating modes, weights), computed with ATen's formulas and in ATen's
precision (float32 for float and the half types, float64 for double), then applied
with one gather per tap along that axis. Nearest modes are pure gathers, so they work
for every dtype and keep values bit for bit.

`grid_sampler_2d` gathers the corner values of every sampling point through flat
indices into each image; modes and padding modes are ATen's integer codes
(interpolation 0 bilinear, 1 nearest, 2 bicubic; padding 0 zeros, 1 border,
2 reflection).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..registry import register_kernel
from ._util import compute_dtype, is_float, write

INT64 = np.dtype(np.int64)
CUBIC_A = -0.75  # ATen's bicubic convolution coefficient


def _opmath(dtype: np.dtype) -> np.dtype:
    """ATen's accumulate type for interpolation weights: double stays double, the rest float32."""
    if not is_float(dtype):
        raise TypeError(f"interpolation needs a floating point tensor, got {dtype}")
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


# ----------------------------------------------------------------------------- sizes and scales


def _output_size(x: np.ndarray, k: int, output_size: Optional[Sequence[int]],
                 scale_factors: Optional[Sequence[float]]) -> tuple[int, ...]:
    """The `.vec` overloads take either an explicit size or scale factors (size = floor(in * scale))."""
    if output_size is not None and len(output_size) > 0:
        if scale_factors is not None and len(scale_factors) > 0:
            raise ValueError("upsample: give output_size or scale_factors, not both")
        size = tuple(int(s) for s in output_size)
    elif scale_factors is not None and len(scale_factors) > 0:
        if len(scale_factors) != k:
            raise ValueError(f"upsample: expected {k} scale factors, got {len(scale_factors)}")
        size = tuple(int(np.floor(float(s) * n)) for s, n in zip(scale_factors, x.shape[-k:]))
    else:
        raise ValueError("upsample: either output_size or scale_factors is required")
    if len(size) != k or any(s <= 0 for s in size):
        raise ValueError(f"upsample: invalid output size {size} for {k} spatial dims")
    return size


def _vec_scales(k: int, scale_factors: Optional[Sequence[float]]) -> tuple[Optional[float], ...]:
    if scale_factors is None or len(scale_factors) == 0:
        return (None,) * k
    return tuple(float(s) for s in scale_factors)


def _scale(in_size: int, out_size: int, scale: Optional[float], dtype: np.dtype):
    """ATen's `compute_scales_value`: 1/scale when a scale factor was given, else in/out."""
    if scale is not None and scale > 0:
        return dtype.type(1.0 / scale)
    return dtype.type(in_size) / dtype.type(out_size)


def _check_input(x: np.ndarray, k: int, name: str) -> None:
    if x.ndim != k + 2:
        raise ValueError(f"{name}: expected a {k + 2}-D input (N, C, spatial...), got shape {x.shape}")
    if any(s == 0 for s in x.shape[2:]):
        raise ValueError(f"{name}: empty spatial dims in input of shape {x.shape}")


# ----------------------------------------------------------------------------- nearest


def _nearest_source(in_size: int, out_size: int, scale: Optional[float], exact: bool,
                    shortcuts: bool = False) -> np.ndarray:
    """ATen's `nearest_idx` (float32 arithmetic) or its `_exact` variant (half-pixel centres).
    A given scale factor is used as is (1/scale), even where in/out would differ slightly,
    except with `shortcuts`: then equal sizes copy and doubled sizes halve the index
    whatever the scale (torch's 2-D CPU kernel does this; its 1-D and 3-D ones do not)."""
    dst = np.arange(out_size, dtype=INT64)
    if shortcuts and out_size == in_size:
        return dst
    if shortcuts and out_size == 2 * in_size:
        return dst >> 1
    s = _scale(in_size, out_size, scale, np.dtype(np.float32))
    if exact:
        src = np.floor((dst.astype(np.float32) + np.float32(0.5)) * s)
    else:
        src = np.floor(dst.astype(np.float32) * s)
    return np.minimum(src.astype(INT64), in_size - 1)


def _nearest(x: np.ndarray, k: int, size, scales, exact: bool, out: np.ndarray, name: str) -> np.ndarray:
    _check_input(x, k, name)
    y = x
    for i in range(k):
        src = _nearest_source(x.shape[2 + i], size[i], scales[i], exact, shortcuts=(k == 2 and not exact))
        y = np.take(y, src, axis=2 + i)
    return write(out, y)


# ----------------------------------------------------------------------------- linear and cubic


def _linear_taps(in_size: int, out_size: int, align_corners: bool, scale: Optional[float], dtype: np.dtype):
    """Two source indices and weights per output position (ATen `compute_indices_weights_linear`)."""
    s = _area_scale(in_size, out_size, align_corners, scale, dtype)
    dst = np.arange(out_size).astype(dtype)
    if align_corners:
        src = s * dst
    else:
        src = np.maximum(s * (dst + dtype.type(0.5)) - dtype.type(0.5), dtype.type(0))
    i0 = src.astype(INT64)
    i1 = i0 + (i0 < in_size - 1)
    l1 = np.clip(src - i0.astype(dtype), 0, 1).astype(dtype)
    return np.stack([i0, i1], axis=1), np.stack([1 - l1, l1], axis=1)


def _area_scale(in_size: int, out_size: int, align_corners: bool, scale: Optional[float], dtype: np.dtype):
    """ATen's `area_pixel_compute_scale`."""
    if align_corners:
        return dtype.type(in_size - 1) / dtype.type(out_size - 1) if out_size > 1 else dtype.type(0)
    return _scale(in_size, out_size, scale, dtype)


def _cubic_weights(t: np.ndarray) -> np.ndarray:
    """The four cubic-convolution weights for fractional offset t (ATen `get_cubic_upsample_coefficients`)."""
    a = t.dtype.type(CUBIC_A)

    def near(v):  # |v| <= 1
        return ((a + 2) * v - (a + 3)) * v * v + 1

    def far(v):  # 1 < |v| < 2
        return ((a * v - 5 * a) * v + 8 * a) * v - 4 * a

    one = t.dtype.type(1)
    return np.stack([far(t + one), near(t), near(one - t), far(2 * one - t)], axis=1)


def _cubic_taps(in_size: int, out_size: int, align_corners: bool, scale: Optional[float], dtype: np.dtype):
    """Four clamped source indices and cubic weights per output position."""
    s = _area_scale(in_size, out_size, align_corners, scale, dtype)
    dst = np.arange(out_size).astype(dtype)
    src = s * dst if align_corners else s * (dst + dtype.type(0.5)) - dtype.type(0.5)  # not clamped for cubic
    base = np.floor(src)
    t = (src - base).astype(dtype)
    idx = base.astype(INT64)[:, None] + np.arange(-1, 3)
    return np.clip(idx, 0, in_size - 1), _cubic_weights(t)


def _antialias_taps(in_size: int, out_size: int, align_corners: bool, scale: Optional[float], dtype: np.dtype):
    """Anti-aliased linear taps (ATen `_compute_index_ranges_weights` with the triangle filter):
    when shrinking, the triangle widens by the scale so every input pixel contributes; the
    weights of each output are normalized to sum to 1. Unused taps get weight 0."""
    s = _area_scale(in_size, out_size, align_corners, scale, dtype)
    one, half = dtype.type(1), dtype.type(0.5)
    support = s if s >= one else one
    invscale = one / s if s >= one else one
    width = int(np.ceil(support)) * 2 + 1
    center = s * (np.arange(out_size).astype(dtype) + half)
    first = np.maximum((center - support + half).astype(INT64), 0)  # C cast: truncation
    count = np.clip(np.minimum((center + support + half).astype(INT64), in_size) - first, 0, width)
    taps = np.arange(width)
    idx = first[:, None] + taps
    w = np.maximum(one - np.abs((idx.astype(dtype) - center[:, None] + half) * invscale), dtype.type(0))
    w = np.where(taps < count[:, None], w, dtype.type(0)).astype(dtype)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total != 0, w / np.where(total != 0, total, one), w).astype(dtype)
    return np.minimum(idx, in_size - 1), w


def _interpolate(x: np.ndarray, k: int, size, align_corners: bool, scales, taps_fn, out: np.ndarray,
                 name: str) -> np.ndarray:
    _check_input(x, k, name)
    dtype = _opmath(out.dtype)
    y = x.astype(dtype, copy=False)
    # last axis first: ATen's bicubic interpolates along W, then along H
    for i in reversed(range(k)):
        axis = 2 + i
        idx, w = taps_fn(x.shape[axis], size[i], bool(align_corners), scales[i], dtype)
        shape = [1] * y.ndim
        shape[axis] = size[i]
        acc = None
        for t in range(idx.shape[1]):
            term = np.take(y, idx[:, t], axis=axis) * w[:, t].reshape(shape)
            acc = term if acc is None else acc + term
        y = acc
    return write(out, y)


# ----------------------------------------------------------------------------- registered overloads


def _nearest_kernels(k: int, exact: bool) -> None:
    base = f"_upsample_nearest_exact{k}d" if exact else f"upsample_nearest{k}d"

    @register_kernel(f"aten::{base}.vec_out")
    def vec_out(input: np.ndarray, output_size: Optional[Sequence[int]], scale_factors: Optional[Sequence[float]],
                out: np.ndarray) -> np.ndarray:
        size = _output_size(input, k, output_size, scale_factors)
        return _nearest(input, k, size, _vec_scales(k, scale_factors), exact, out, base)

    @register_kernel(f"aten::{base}.out")
    def sized_out(input: np.ndarray, output_size: Sequence[int], *scales_and_out) -> np.ndarray:
        *scales, out = scales_and_out  # one optional scale per spatial dim, then out
        scales = tuple(scales) + (None,) * (k - len(scales))
        return _nearest(input, k, _output_size(input, k, output_size, None), scales, exact, out, base)


def _interpolating_kernels(name: str, k: int, taps_fn) -> None:
    @register_kernel(f"aten::{name}.vec_out")
    def vec_out(input: np.ndarray, output_size: Optional[Sequence[int]], align_corners: bool,
                scale_factors: Optional[Sequence[float]], out: np.ndarray) -> np.ndarray:
        size = _output_size(input, k, output_size, scale_factors)
        return _interpolate(input, k, size, align_corners, _vec_scales(k, scale_factors), taps_fn, out, name)

    @register_kernel(f"aten::{name}.out")
    def sized_out(input: np.ndarray, output_size: Sequence[int], align_corners: bool, *scales_and_out) -> np.ndarray:
        *scales, out = scales_and_out
        scales = tuple(scales) + (None,) * (k - len(scales))
        size = _output_size(input, k, output_size, None)
        return _interpolate(input, k, size, align_corners, scales, taps_fn, out, name)


for _k in (1, 2, 3):
    _nearest_kernels(_k, exact=False)
    _nearest_kernels(_k, exact=True)
_interpolating_kernels("upsample_linear1d", 1, _linear_taps)
_interpolating_kernels("upsample_bilinear2d", 2, _linear_taps)
_interpolating_kernels("upsample_trilinear3d", 3, _linear_taps)
_interpolating_kernels("upsample_bicubic2d", 2, _cubic_taps)


def _antialias_integers(x: np.ndarray, size, align_corners: bool, scales, out: np.ndarray) -> np.ndarray:
    """Integer images as ExecuTorch's kernel resizes them: every (row, column) tap is added
    in float32 to the integer running value, which is truncated back after each addition."""
    f32 = np.dtype(np.float32)
    rows, row_w = _antialias_taps(x.shape[2], size[0], align_corners, scales[0], f32)
    cols, col_w = _antialias_taps(x.shape[3], size[1], align_corners, scales[1], f32)
    value = np.zeros(x.shape[:2] + tuple(size), np.int64)
    for i in range(rows.shape[1]):
        band = np.take(x, rows[:, i], axis=2).astype(f32) * row_w[:, i, None]
        for j in range(cols.shape[1]):
            value = np.trunc(value.astype(f32) + np.take(band, cols[:, j], axis=3) * col_w[:, j]).astype(np.int64)
    return write(out, value)


@register_kernel("aten::_upsample_bilinear2d_aa.out")
def upsample_bilinear2d_aa(input: np.ndarray, output_size: Sequence[int], align_corners: bool,
                           scales_h: Optional[float] = None, scales_w: Optional[float] = None,
                           out: np.ndarray = None) -> np.ndarray:
    """Anti-aliased bilinear resize: floats as ATen computes them, integers (which torch only
    does for uint8, rounding) as ExecuTorch does."""
    name = "_upsample_bilinear2d_aa"
    size, scales = _output_size(input, 2, output_size, None), (scales_h, scales_w)
    if input.dtype != out.dtype or input.dtype == np.bool_:
        raise TypeError(f"{name}: needs a real input of out's dtype, got {input.dtype} and {out.dtype}")
    if is_float(out.dtype):
        return _interpolate(input, 2, size, align_corners, scales, _antialias_taps, out, name)
    _check_input(input, 2, name)
    return _antialias_integers(input, size, bool(align_corners), scales, out)


# ----------------------------------------------------------------------------- grid_sampler_2d

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
ZEROS, BORDER, REFLECTION = 0, 1, 2


def _unnormalize(coord: np.ndarray, size: int, align_corners: bool) -> np.ndarray:
    """[-1, 1] -> pixel coordinates: corner pixel centres (align_corners) or image edges.
    Written as torch's vectorized CPU kernel computes it, for the same rounding."""
    if align_corners:
        return (coord + 1) * coord.dtype.type((size - 1) / 2)
    return (coord + 1) * coord.dtype.type(size / 2) - coord.dtype.type(0.5)


def _reflect(coord: np.ndarray, size: int, align_corners: bool) -> np.ndarray:
    """Fold coordinates into the image by mirroring at its edges: at the corner pixel centres
    (align_corners) or at the outer pixel edges (-0.5 and size - 0.5)."""
    t = coord.dtype.type
    if align_corners:
        if size <= 1:
            return np.zeros_like(coord)
        low, twice_span = t(0), t(2 * (size - 1))
    else:
        low, twice_span = t(-0.5), t(2 * size)
    distance = np.abs(coord - low)
    extra = distance - np.trunc(distance / twice_span) * twice_span
    return np.minimum(extra, twice_span - extra) + low


def _apply_padding(coord: np.ndarray, size: int, padding_mode: int, align_corners: bool) -> np.ndarray:
    """ATen's `compute_coordinates`: border clamps, reflection folds then clamps. As in ATen's
    CPU kernel, clamping sends NaN (and a reflected infinity) to 0."""
    if padding_mode == ZEROS:
        return coord
    if padding_mode == REFLECTION:
        coord = _reflect(coord, size, align_corners)
    coord = np.clip(coord, 0, size - 1)
    return np.where(np.isnan(coord), coord.dtype.type(0), coord)


class _Sampler:
    """Reads image values at integral (float-typed) positions, zero outside the image."""

    def __init__(self, images: np.ndarray):
        n, c, self.h, self.w = images.shape
        self.flat = images.reshape(n, c, self.h * self.w)

    def at(self, fx: np.ndarray, fy: np.ndarray) -> np.ndarray:
        """fx, fy: (N, P) whole numbers (or NaN/inf, which are outside) -> (N, C, P) values."""
        inside = (fx >= 0) & (fx < self.w) & (fy >= 0) & (fy < self.h)
        index = np.where(inside, fy * self.w + fx, 0).astype(INT64)
        values = np.take_along_axis(self.flat, index[:, None, :], axis=2)
        return np.where(inside[:, None, :], values, 0)


def _bilinear(sampler: _Sampler, ix: np.ndarray, iy: np.ndarray) -> np.ndarray:
    x0, y0 = np.floor(ix), np.floor(iy)
    x1, y1 = x0 + 1, y0 + 1
    w = lambda a: a[:, None, :]  # noqa: E731  (weights broadcast over channels)
    # a non-finite coordinate gives NaN weights, hence NaN, as in ATen
    return (sampler.at(x0, y0) * w((x1 - ix) * (y1 - iy)) + sampler.at(x1, y0) * w((ix - x0) * (y1 - iy))
            + sampler.at(x0, y1) * w((x1 - ix) * (iy - y0)) + sampler.at(x1, y1) * w((ix - x0) * (iy - y0)))


def _bicubic(sampler: _Sampler, ix: np.ndarray, iy: np.ndarray, padding_mode: int, align_corners: bool) -> np.ndarray:
    """16 taps around the point; every tap's coordinate gets the padding mode on its own."""
    x0, y0 = np.floor(ix), np.floor(iy)
    wx = _cubic_weights((ix - x0).ravel()).reshape(*ix.shape, 4)
    wy = _cubic_weights((iy - y0).ravel()).reshape(*iy.shape, 4)
    acc = None
    for i in range(4):
        row = None
        ty = _apply_padding(y0 - 1 + i, sampler.h, padding_mode, align_corners)
        for j in range(4):
            tx = _apply_padding(x0 - 1 + j, sampler.w, padding_mode, align_corners)
            term = sampler.at(tx, ty) * wx[:, None, :, j]
            row = term if row is None else row + term
        term = row * wy[:, None, :, i]
        acc = term if acc is None else acc + term
    return acc


@register_kernel("aten::grid_sampler_2d.out")
def grid_sampler_2d(input: np.ndarray, grid: np.ndarray, interpolation_mode: int, padding_mode: int,
                    align_corners: bool, out: np.ndarray) -> np.ndarray:
    """Sample input (N, C, H, W) at grid (N, Ho, Wo, 2) points given as (x, y) in [-1, 1]."""
    if input.ndim != 4 or grid.ndim != 4 or grid.shape[-1] != 2 or grid.shape[0] != input.shape[0]:
        raise ValueError(f"grid_sampler_2d: expected input (N, C, H, W) and grid (N, Ho, Wo, 2), "
                         f"got {input.shape} and {grid.shape}")
    if interpolation_mode not in (BILINEAR, NEAREST, BICUBIC) or padding_mode not in (ZEROS, BORDER, REFLECTION):
        raise ValueError(f"grid_sampler_2d: unknown interpolation mode {interpolation_mode} "
                         f"or padding mode {padding_mode}")
    n, c, h, w = input.shape
    ho, wo = grid.shape[1:3]
    dtype = compute_dtype(out.dtype) if is_float(out.dtype) else None
    if dtype is None:
        raise TypeError(f"grid_sampler_2d: expected a floating point tensor, got {out.dtype}")
    align_corners = bool(align_corners)
    g = grid.astype(dtype, copy=False).reshape(n, ho * wo, 2)
    sampler = _Sampler(input.astype(dtype, copy=False))
    with np.errstate(invalid="ignore", over="ignore"):
        ix = _unnormalize(g[..., 0], w, align_corners)
        iy = _unnormalize(g[..., 1], h, align_corners)
        if interpolation_mode == BICUBIC:
            y = _bicubic(sampler, ix, iy, padding_mode, align_corners)
        else:
            ix = _apply_padding(ix, w, padding_mode, align_corners)
            iy = _apply_padding(iy, h, padding_mode, align_corners)
            if interpolation_mode == BILINEAR:
                y = _bilinear(sampler, ix, iy)
            else:  # nearest: round half to even, like nearbyint
                y = sampler.at(np.rint(ix), np.rint(iy))
    return write(out, y.reshape(n, c, ho, wo))
