"""Normalizations: layer norm, batch norm (running or batch statistics), group norm.

Each returns ATen's three outputs (normalized tensor, mean, rstd) as a tuple, because
the program's return slot is a TensorList. Statistics use the biased variance and are
computed in float32 for half inputs (float64 stays float64).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..fast import compiled_rows
from ..registry import register_kernel
from ._util import compute_dtype, write


def _float(x: Optional[np.ndarray], dtype: np.dtype) -> Optional[np.ndarray]:
    if x is None:
        return None
    return x if x.dtype == dtype else x.astype(dtype)


def _moments(x: np.ndarray, axes: tuple[int, ...], eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, rstd, x - mean) over `axes` with keepdims; rstd = 1 / sqrt(biased var + eps). The
    centered values are the caller's to normalize (computed once, not again)."""
    mean = np.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    var = np.mean(np.square(centered), axis=axes, keepdims=True)
    return mean, 1.0 / np.sqrt(var + x.dtype.type(eps)), centered


def _affine(y: np.ndarray, weight, bias) -> np.ndarray:
    """y * weight + bias, in place: y is the caller's temporary, already of the result's shape."""
    if weight is not None:
        np.multiply(y, weight, out=y)
    if bias is not None:
        np.add(y, bias, out=y)
    return y


@register_kernel("aten::native_layer_norm.out")
def native_layer_norm(x: np.ndarray, normalized_shape: Sequence[int], weight: Optional[np.ndarray],
                      bias: Optional[np.ndarray], eps: float, out: np.ndarray, mean_out: np.ndarray,
                      rstd_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = len(normalized_shape)
    if k > x.ndim or tuple(x.shape[x.ndim - k:]) != tuple(normalized_shape):
        raise ValueError(f"layer_norm: normalized_shape {tuple(normalized_shape)} does not end input shape {x.shape}")
    compiled = _compiled_layer_norm(x, k, weight, bias, eps, out, mean_out, rstd_out)
    if compiled is not None:
        return compiled
    dtype = compute_dtype(x.dtype)
    xs = _float(x, dtype)
    axes = tuple(range(x.ndim - k, x.ndim))
    with np.errstate(all="ignore"):
        mean, rstd, centered = _moments(xs, axes, eps)
        # normalized straight into the output where it can hold the result (a BERT layer's norm:
        # 7 passes over the values instead of 11)
        y = out if out.shape == x.shape and out.dtype == dtype else centered
        y = _affine(np.multiply(centered, rstd, out=y), _float(weight, dtype), _float(bias, dtype))
    # mean/rstd keep the normalized dims as size 1: shape (*batch, 1, ..., 1).
    return write(out, y), write(mean_out, mean), write(rstd_out, rstd)


def _compiled_layer_norm(x: np.ndarray, k: int, weight: Optional[np.ndarray], bias: Optional[np.ndarray],
                         eps: float, out: np.ndarray, mean_out: np.ndarray,
                         rstd_out: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The float32 layer norm compiled (kernels/fast/rows_jit.py: numpy's bits, 3 passes instead of 7),
    where numba is and the tensors are plain C-ordered float32 of the expected shapes."""
    compiled = compiled_rows(x.size)
    n = math.prod(x.shape[x.ndim - k:])
    if (compiled is None or n == 0 or out.shape != x.shape or x.dtype != np.float32 or out.dtype != np.float32
            or not (x.flags.c_contiguous and out.flags.c_contiguous)
            or not all(a is None or (a.dtype == np.float32 and a.size == n and a.flags.c_contiguous)
                       for a in (weight, bias))):
        return None
    rows = x.size // n
    stats = x.shape[:x.ndim - k] + (1,) * k
    # mean and rstd straight into their outputs where those are plain float32 of the stats' shape
    mean, rstd = (a.reshape(rows) if a.shape == stats and a.dtype == np.float32 and a.flags.c_contiguous
                  else np.empty(rows, np.float32) for a in (mean_out, rstd_out))
    none = np.empty(0, np.float32)
    weight, bias = (none if a is None else a.reshape(n) for a in (weight, bias))
    compiled.layer_norm_rows(x.reshape(rows, n), weight, bias, np.float32(eps), out.reshape(rows, n), mean, rstd)
    return out, write(mean_out, mean.reshape(stats)), write(rstd_out, rstd.reshape(stats))


def _channel_shape(x: np.ndarray) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector along dim 1 of x."""
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


@register_kernel("aten::_native_batch_norm_legit_no_training.out")
def batch_norm_no_training(x: np.ndarray, weight: Optional[np.ndarray], bias: Optional[np.ndarray],
                           running_mean: np.ndarray, running_var: np.ndarray, momentum: float, eps: float,
                           out: np.ndarray, mean_out: np.ndarray,
                           rstd_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inference batch norm over channel dim 1 with the running statistics.

    ATen returns empty save_mean/save_invstd in this mode; they are passed through as is.
    """
    if x.ndim < 2:
        raise ValueError(f"batch_norm: input must have a channel dim, got shape {x.shape}")
    dtype = compute_dtype(x.dtype)
    shape = _channel_shape(x)
    mean = _float(running_mean, dtype).reshape(shape)
    with np.errstate(all="ignore"):
        rstd = 1.0 / np.sqrt(_float(running_var, dtype).reshape(shape) + dtype.type(eps))
        w = None if weight is None else _float(weight, dtype).reshape(shape)
        b = None if bias is None else _float(bias, dtype).reshape(shape)
        y = _affine((_float(x, dtype) - mean) * rstd, w, b)
    return write(out, y), mean_out, rstd_out


@register_kernel("aten::_native_batch_norm_legit.out")
def batch_norm_legit(x: np.ndarray, weight: Optional[np.ndarray], bias: Optional[np.ndarray],
                     running_mean: np.ndarray, running_var: np.ndarray, training: bool, momentum: float,
                     eps: float, out: np.ndarray, mean_out: np.ndarray,
                     rstd_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch norm with running statistics. Like ExecuTorch's portable kernel, only inference
    is supported: training mode would update the running statistics (program constants)."""
    if training:
        raise ValueError("_native_batch_norm_legit: training mode is not supported at run time "
                         "(export the model in eval mode)")
    return batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps,
                                  out, mean_out, rstd_out)


@register_kernel("aten::_native_batch_norm_legit.no_stats_out")
def batch_norm_no_stats(x: np.ndarray, weight: Optional[np.ndarray], bias: Optional[np.ndarray], training: bool,
                        momentum: float, eps: float, out: np.ndarray, mean_out: np.ndarray,
                        rstd_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch norm with the statistics of this batch (there are no running ones): mean and
    rstd per channel (shape (C,)) over every dim but dim 1, biased variance."""
    if x.ndim < 2:
        raise ValueError(f"batch_norm: input must have a channel dim, got shape {x.shape}")
    dtype = compute_dtype(x.dtype)
    shape = _channel_shape(x)
    xs = _float(x, dtype)
    with np.errstate(all="ignore"):
        mean, rstd, centered = _moments(xs, (0,) + tuple(range(2, x.ndim)), eps)
        w = None if weight is None else _float(weight, dtype).reshape(shape)
        b = None if bias is None else _float(bias, dtype).reshape(shape)
        y = _affine(np.multiply(centered, rstd, out=centered), w, b)
    channels = x.shape[1]
    return write(out, y), write(mean_out, mean.reshape(channels)), write(rstd_out, rstd.reshape(channels))


@register_kernel("aten::native_group_norm.out")
def native_group_norm(x: np.ndarray, weight: Optional[np.ndarray], bias: Optional[np.ndarray], N: int, C: int,
                      HxW: int, group: int, eps: float, out: np.ndarray, mean_out: np.ndarray,
                      rstd_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group norm: channels split into `group` groups; mean/rstd have shape (N, group)."""
    if group <= 0 or C % group:
        raise ValueError(f"group_norm: {C} channels cannot be split into {group} groups")
    if x.size != N * C * HxW:
        raise ValueError(f"group_norm: input shape {x.shape} does not hold N={N}, C={C}, HxW={HxW}")
    dtype = compute_dtype(x.dtype)
    grouped = _float(x, dtype).reshape(N, group, (C // group) * HxW)
    with np.errstate(all="ignore"):
        mean, rstd, centered = _moments(grouped, (2,), eps)
        y = np.multiply(centered, rstd, out=centered).reshape(N, C, HxW)
        w = None if weight is None else _float(weight, dtype).reshape(1, C, 1)
        b = None if bias is None else _float(bias, dtype).reshape(1, C, 1)
        y = _affine(y, w, b).reshape(x.shape)
    return write(out, y), write(mean_out, mean.reshape(N, group)), write(rstd_out, rstd.reshape(N, group))
