"""Matrix products (mm, bmm, addmm, baddbmm, linear) and pairwise distances (_cdist_forward,
_pdist_forward).

Floating products go through numpy's BLAS (`np.matmul`), written straight into the
planned `out` buffer when it is float32/float64 and already has the result's shape.
Half types are multiplied in float32 and rounded once. Integer products accumulate in
int64 and wrap to the output type, which equals ATen's wrapping arithmetic.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..registry import register_kernel
from ._util import compute_dtype, is_float, write


def _compute_dtype(out: np.ndarray) -> np.dtype:
    if out.dtype == np.bool_:
        raise TypeError("matrix products are not defined for bool tensors")
    if is_float(out.dtype):
        return compute_dtype(out.dtype)
    return np.dtype(np.int64)


def _operand(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return x if x.dtype == dtype else x.astype(dtype)


def _matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """a @ b in the compute dtype; into `out` directly when dtype and shape allow."""
    dtype = _compute_dtype(out)
    a, b = _operand(a, dtype), _operand(b, dtype)
    shape = a.shape[:-2] + (a.shape[-2], b.shape[-1])
    if out.dtype == dtype and out.shape == shape:
        return np.matmul(a, b, out=out)
    return np.matmul(a, b)


def _check_ranks(name: str, rank: int, *tensors: np.ndarray) -> None:
    for t in tensors:
        if t.ndim != rank:
            raise ValueError(f"{name}: expected {rank}-D tensors, got shape {t.shape}")


@register_kernel("aten::mm.out")
def mm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    _check_ranks("mm", 2, a, b)
    return write(out, _matmul(a, b, out))


@register_kernel("aten::bmm.out")
def bmm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    _check_ranks("bmm", 3, a, b)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"bmm: batch sizes differ ({a.shape} and {b.shape})")
    return write(out, _matmul(a, b, out))


def _add_scaled(product: np.ndarray, bias: np.ndarray, beta, alpha, out: np.ndarray) -> np.ndarray:
    """beta * bias + alpha * product, computed in place on the product.

    As in ATen, beta == 0 ignores `bias` entirely, so NaN or inf in it do not leak through.
    """
    dtype = _compute_dtype(out)
    if alpha != 1:
        np.multiply(product, np.asarray(alpha).astype(dtype), out=product, casting="unsafe")
    if beta != 0:
        scaled = _operand(bias, dtype) if beta == 1 else _operand(bias, dtype) * np.asarray(beta).astype(dtype)
        np.add(product, scaled, out=product, casting="unsafe")
    return write(out, product)


@register_kernel("aten::addmm.out")
def addmm(bias: np.ndarray, a: np.ndarray, b: np.ndarray, beta=1, alpha=1, out: np.ndarray = None) -> np.ndarray:
    _check_ranks("addmm", 2, a, b)
    with np.errstate(all="ignore"):
        return _add_scaled(_matmul(a, b, out), bias, beta, alpha, out)


@register_kernel("aten::baddbmm.out")
def baddbmm(bias: np.ndarray, a: np.ndarray, b: np.ndarray, beta=1, alpha=1, out: np.ndarray = None) -> np.ndarray:
    _check_ranks("baddbmm", 3, a, b)
    with np.errstate(all="ignore"):
        return _add_scaled(_matmul(a, b, out), bias, beta, alpha, out)


@register_kernel("aten::linear.out")
def linear(x: np.ndarray, weight: np.ndarray, bias: Optional[np.ndarray] = None, out: np.ndarray = None) -> np.ndarray:
    """x @ weight.T (+ bias); weight is (out_features, in_features) or 1-D."""
    dtype = _compute_dtype(out)
    w = _operand(weight, dtype)
    product = np.matmul(_operand(x, dtype), w.T if w.ndim == 2 else w)
    if bias is None:
        return write(out, product)
    with np.errstate(all="ignore"):
        return write(out, product + _operand(bias, dtype))


# ----------------------------------------------------------------------------- pairwise distances


def _p_norm(diff: np.ndarray, p: float) -> np.ndarray:
    """The p-norm of |differences| along the last axis: p = 0 counts the nonzero ones,
    p = inf takes the largest."""
    if p == 0:
        return np.count_nonzero(diff, axis=-1).astype(diff.dtype)
    if p == 1:
        return np.sum(diff, axis=-1)
    if p == 2:
        return np.sqrt(np.sum(np.square(diff), axis=-1))
    if p == np.inf:
        return np.max(diff, axis=-1, initial=0)
    return np.power(np.sum(np.power(diff, diff.dtype.type(p)), axis=-1), diff.dtype.type(1 / p))


# Differences are materialized a slice at a time: at most this many elements at once.
_CHUNK = 1 << 22


def _chunks(total: int, per_item: int) -> list[slice]:
    """Slices covering range(total) (at least one, possibly empty), each of at most
    _CHUNK // per_item items."""
    step = max(1, _CHUNK // max(1, per_item))
    return [slice(start, start + step) for start in range(0, max(total, 1), step)]


def _distance_dtype(out: np.ndarray, name: str, p: float, *inputs: np.ndarray) -> np.dtype:
    if not is_float(out.dtype) or any(x.dtype != out.dtype for x in inputs):
        raise TypeError(f"{name}: inputs and out must share one floating dtype, got "
                        f"{[x.dtype.name for x in inputs]} and {out.dtype}")
    if not p >= 0:
        raise ValueError(f"{name}: p must be non-negative, got {p}")
    return compute_dtype(out.dtype)


@register_kernel("aten::_cdist_forward.out")
def cdist_forward(x1: np.ndarray, x2: np.ndarray, p: float, compute_mode: Optional[int] = None,
                  out: np.ndarray = None) -> np.ndarray:
    """p-norm distance between every row of x1 (.., P, M) and of x2 (.., R, M): (.., P, R),
    batch dims broadcast. compute_mode only chooses an algorithm in ATen; this is exact."""
    dtype = _distance_dtype(out, "_cdist_forward", p, x1, x2)
    if x1.ndim < 2 or x2.ndim < 2 or x1.shape[-1] != x2.shape[-1]:
        raise ValueError(f"_cdist_forward: shapes {x1.shape} and {x2.shape} are not (.., P, M) and (.., R, M)")
    if compute_mode is not None and compute_mode not in (0, 1, 2):
        raise ValueError(f"_cdist_forward: compute_mode must be 0, 1 or 2, got {compute_mode}")
    a, b = _operand(x1, dtype), _operand(x2, dtype)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    per_row = int(np.prod(batch, dtype=np.int64)) * b.shape[-2] * b.shape[-1]
    with np.errstate(all="ignore"):
        parts = [_p_norm(np.abs(a[..., rows, None, :] - b[..., None, :, :]), p)
                 for rows in _chunks(a.shape[-2], per_row)]
    return write(out, np.concatenate(parts, axis=-2))


@register_kernel("aten::_pdist_forward.out")
def pdist_forward(x: np.ndarray, p: float = 2, out: np.ndarray = None) -> np.ndarray:
    """p-norm distance between every pair of rows i < j of an (N, M) matrix, in row-major
    pair order: N * (N - 1) / 2 values."""
    dtype = _distance_dtype(out, "_pdist_forward", p, x)
    if x.ndim != 2:
        raise ValueError(f"_pdist_forward: expects a 2-D input, got shape {x.shape}")
    i, j = np.triu_indices(x.shape[0], k=1)
    rows = _operand(x, dtype)
    with np.errstate(all="ignore"):
        parts = [_p_norm(np.abs(rows[i[pairs]] - rows[j[pairs]]), p) for pairs in _chunks(i.size, x.shape[1])]
    return write(out, np.concatenate(parts))
