"""Indexing kernels: advanced indexing (index, index_put and index_put_, index_select,
masked_fill/select/scatter, nonzero), scatter/gather, slice/select scatter, and the
ordering ops (topk, sort, cumsum).

Semantics follow torch where ExecuTorch's portable kernels differ or are missing:
indices are bounds-checked (negative ones wrap only where torch allows it), sorting is
stable with NaN treated as the largest value, and half types accumulate in float32.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..registry import register_kernel
from ._util import compute_dtype, is_float, norm_dim, write
from .shape import clamp_slice, same_dtype, slice_index, wrap_index


def start_from(x: np.ndarray, out: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A writable copy of `x` in `dtype` to update in place: `out` itself when it fits.

    Writing straight into the planned out buffer saves a full copy per call, which
    matters for the large tensors (KV caches) that index_put and slice_scatter update.
    """
    if out.shape == x.shape and out.dtype == dtype and not np.may_share_memory(out, x):
        np.copyto(out, x)
        return out
    return x.astype(dtype)  # always a copy


def finish(result: np.ndarray, out: np.ndarray) -> np.ndarray:
    return result if result is out else write(out, result)


def index_tuple(x: np.ndarray, indices: Sequence[Optional[np.ndarray]]) -> tuple:
    """torch's `Tensor?[]` indices as a numpy index: None is a full slice, masks stay masks."""
    if len(indices) > max(x.ndim, 1):
        raise IndexError(f"too many indices ({len(indices)}) for a tensor of rank {x.ndim}")
    parts = []
    for i in indices:
        if i is None:
            parts.append(slice(None))
        elif i.dtype == np.bool_ or i.dtype == np.uint8:  # uint8 indices are masks in torch
            parts.append(i.astype(np.bool_, copy=False))
        elif np.issubdtype(i.dtype, np.integer):
            parts.append(i.astype(np.int64, copy=False))
        else:
            raise TypeError(f"indices must be integer or bool tensors, got {i.dtype}")
    return tuple(parts)


@register_kernel("aten::index.Tensor_out")
def index(x: np.ndarray, indices: Sequence[Optional[np.ndarray]], out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "index")
    return write(out, x[index_tuple(x, indices)])


def put(target: np.ndarray, indices: Sequence[Optional[np.ndarray]], values: np.ndarray, accumulate: bool) -> None:
    """target[indices] = values (or += with `accumulate`), in place."""
    where = index_tuple(target, indices)
    if not accumulate:
        target[where] = np.asarray(values).astype(target.dtype, copy=False)
        return
    # duplicates add up: ufunc.at, in a dtype numpy can do arithmetic in
    dtype = compute_dtype(target.dtype)
    work = target if dtype == target.dtype else target.astype(dtype)
    np.add.at(work, where, np.asarray(values).astype(dtype))
    if work is not target:
        np.copyto(target, work, casting="unsafe")


@register_kernel("aten::index_put.out")
def index_put(x: np.ndarray, indices: Sequence[Optional[np.ndarray]], values: np.ndarray,
              accumulate: bool = False, out: np.ndarray = None) -> np.ndarray:
    same_dtype(x, out, "index_put")
    result = start_from(x, out, x.dtype)
    put(result, indices, values, accumulate)
    return finish(result, out)


@register_kernel("aten::index_put_")
def index_put_(x: np.ndarray, indices: Sequence[Optional[np.ndarray]], values: np.ndarray,
               accumulate: bool = False) -> np.ndarray:
    """In place (a mutable buffer, like copy_): returns `x` itself after the update."""
    put(x, indices, values, accumulate)
    return x


@register_kernel("aten::index_select.out")
def index_select(x: np.ndarray, dim: int, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "index_select")
    if idx.ndim > 1:
        raise ValueError(f"index_select: index must be 0-D or 1-D, got shape {idx.shape}")
    if x.ndim == 0:  # torch: a scalar takes exactly one index, 0, and stays a scalar
        if idx.size != 1:
            raise ValueError(f"index_select: a 0-dim tensor takes one index, got {idx.size}")
        check_range(idx, 1, "index_select")
        return write(out, x)
    dim = norm_dim(dim, x.ndim)
    check_range(idx, x.shape[dim], "index_select")
    return write(out, np.take(x, idx.reshape(-1).astype(np.int64), axis=dim))


def check_range(idx: np.ndarray, size: int, op: str, allow_negative: bool = False) -> None:
    if idx.size == 0:
        return
    lo = -size if allow_negative else 0
    if idx.min() < lo or idx.max() >= size:
        raise IndexError(f"{op}: index out of range for dim of size {size}")


@register_kernel("aten::masked_fill.Scalar_out", "aten::masked_fill.Tensor_out")
def masked_fill(x: np.ndarray, mask: np.ndarray, value, out: np.ndarray) -> np.ndarray:
    if mask.dtype != np.bool_:
        raise TypeError(f"masked_fill: mask must be bool, got {mask.dtype}")
    fill = np.asarray(value).astype(out.dtype)
    return write(out, np.where(mask, fill, x.astype(out.dtype, copy=False)))


def _mask(mask: np.ndarray, op: str) -> np.ndarray:
    if mask.dtype != np.bool_:
        raise TypeError(f"{op}: mask must be bool, got {mask.dtype}")
    return mask


@register_kernel("aten::masked_select.out")
def masked_select(x: np.ndarray, mask: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The elements of x (broadcast with mask) where mask holds, as a 1-D tensor in row-major
    order: its length depends on the data, so the result is usually resized."""
    same_dtype(x, out, "masked_select")
    x, mask = np.broadcast_arrays(x, _mask(mask, "masked_select"))
    return write(out, x[mask])


@register_kernel("aten::masked_scatter.out")
def masked_scatter(x: np.ndarray, mask: np.ndarray, source: np.ndarray, out: np.ndarray) -> np.ndarray:
    """x (broadcast with mask) with the positions where mask holds taken, in row-major order,
    from the leading elements of source."""
    same_dtype(x, out, "masked_scatter")
    same_dtype(source, out, "masked_scatter")
    x, mask = np.broadcast_arrays(x, _mask(mask, "masked_scatter"))
    count = int(np.count_nonzero(mask))
    if count > source.size:
        raise ValueError(f"masked_scatter: the mask selects {count} elements but source has only {source.size}")
    result = x.copy()
    result[mask] = source.reshape(-1)[:count]
    return write(out, result)


@register_kernel("aten::nonzero.out")
def nonzero(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Coordinates of the nonzero elements, shape (n, ndim): data-dependent, so usually resized."""
    return write(out, np.argwhere(x).astype(np.int64))


# ----------------------------------------------------------------------------- scatter / gather


def scatter_coords(index: np.ndarray, dim: int) -> tuple:
    """Index tuple addressing self[..., index[i][j], ...] at every position of `index`."""
    coords = list(np.indices(index.shape, sparse=True))
    coords[dim] = index.astype(np.int64)
    return tuple(coords)


def check_scatter(x: np.ndarray, dim: int, index: np.ndarray, src: Optional[np.ndarray], op: str) -> None:
    if not np.issubdtype(index.dtype, np.integer):
        raise TypeError(f"{op}: index must be an integer tensor, got {index.dtype}")
    if index.ndim != x.ndim:
        raise ValueError(f"{op}: index rank {index.ndim} differs from self rank {x.ndim}")
    for d in range(x.ndim):
        if d != dim and index.shape[d] > x.shape[d]:
            raise ValueError(f"{op}: index shape {index.shape} exceeds self shape {x.shape} in dim {d}")
        if src is not None and index.shape[d] > src.shape[d]:
            raise ValueError(f"{op}: index shape {index.shape} exceeds src shape {src.shape} in dim {d}")
    check_range(index, x.shape[dim], op)


def prefix(a: np.ndarray, shape: tuple) -> np.ndarray:
    """The leading corner of `a` with `shape` (torch scatter/gather use only that part)."""
    return a[tuple(slice(0, s) for s in shape)]


def lifted(x: np.ndarray, *others: np.ndarray):
    """Rank-0 tensors scatter/gather like 1-element vectors."""
    return [a.reshape(1) if a.ndim == 0 else a for a in (x, *others)]


def scatter_impl(x, dim, index, src, out, op, reduce=None):
    shape = x.shape
    x, index = lifted(x, index)
    src_arr = lifted(src)[0] if isinstance(src, np.ndarray) else None
    dim = norm_dim(dim, x.ndim)
    check_scatter(x, dim, index, src_arr, op)
    dtype = compute_dtype(out.dtype) if reduce else out.dtype
    result = x.astype(dtype)
    values = prefix(src_arr, index.shape).astype(dtype) if src_arr is not None else np.asarray(src).astype(dtype)
    where = scatter_coords(index, dim)
    if reduce is None:
        result[where] = values
    else:
        reduce.at(result, where, np.broadcast_to(values, index.shape))
    return write(out, result.reshape(shape))


@register_kernel("aten::scatter.src_out")
def scatter_src(x: np.ndarray, dim: int, index: np.ndarray, src: np.ndarray, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "scatter")
    return scatter_impl(x, dim, index, src, out, "scatter")


@register_kernel("aten::scatter.value_out")
def scatter_value(x: np.ndarray, dim: int, index: np.ndarray, value, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "scatter")
    return scatter_impl(x, dim, index, value, out, "scatter")


@register_kernel("aten::scatter_add.out")
def scatter_add(x: np.ndarray, dim: int, index: np.ndarray, src: np.ndarray, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "scatter_add")
    add = np.logical_or if out.dtype == np.bool_ else np.add
    return scatter_impl(x, dim, index, src, out, "scatter_add", reduce=add)


_REDUCE = {"sum": np.add, "mean": np.add, "prod": np.multiply, "amax": np.maximum, "amin": np.minimum}


def _identity(reduce: str, dtype: np.dtype):
    """The starting value a position takes when include_self=False."""
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if is_float(dtype):
        return -np.inf if reduce == "amax" else np.inf
    info = np.iinfo(dtype) if dtype != np.bool_ else None
    if info is None:
        return reduce == "amin"
    return info.min if reduce == "amax" else info.max


@register_kernel("aten::scatter_reduce.two_out")
def scatter_reduce(x: np.ndarray, dim: int, index: np.ndarray, src: np.ndarray, reduce: str,
                   include_self: bool = True, out: np.ndarray = None) -> np.ndarray:
    """torch.scatter_reduce: sum | prod | mean | amax | amin, optionally ignoring self's values."""
    same_dtype(x, out, "scatter_reduce")
    if reduce not in _REDUCE:
        raise ValueError(f"scatter_reduce: unknown reduction {reduce!r}")
    shape = x.shape
    x, index, src = lifted(x, index, src)
    dim = norm_dim(dim, x.ndim)
    check_scatter(x, dim, index, src, "scatter_reduce")
    dtype = compute_dtype(x.dtype)
    ufunc = _REDUCE[reduce]
    if x.dtype == np.bool_ and ufunc in (np.add, np.multiply):
        ufunc = np.logical_or if ufunc is np.add else np.logical_and
    result = x.astype(dtype)
    where = scatter_coords(index, dim)
    values = prefix(src, index.shape).astype(dtype)
    if not include_self:
        result[where] = _identity(reduce, dtype)
    ufunc.at(result, where, values)
    if reduce == "mean":
        count = np.full(x.shape, 1 if include_self else 0, np.int64)
        np.add.at(count, where, 1)
        count = np.maximum(count, 1)  # untouched positions keep self
        if is_float(dtype):
            result = result / count
        else:
            result = np.floor_divide(result, count)
    return write(out, result.astype(dtype, copy=False).reshape(shape))


@register_kernel("aten::gather.out")
def gather(x: np.ndarray, dim: int, index: np.ndarray, sparse_grad: bool = False,
           out: np.ndarray = None) -> np.ndarray:
    same_dtype(x, out, "gather")
    shape = index.shape
    x, index = lifted(x, index)
    dim = norm_dim(dim, x.ndim)
    check_scatter(x, dim, index, None, "gather")
    return write(out, x[scatter_coords(index, dim)].reshape(shape))


@register_kernel("aten::slice_scatter.out")
def slice_scatter(x: np.ndarray, src: np.ndarray, dim: int = 0, start: Optional[int] = None,
                  end: Optional[int] = None, step: int = 1, out: np.ndarray = None) -> np.ndarray:
    same_dtype(x, out, "slice_scatter")
    dim = norm_dim(dim, x.ndim)
    where = slice_index(dim, clamp_slice(x.shape[dim], start, end, step))
    if x[where].shape != src.shape:
        raise ValueError(f"slice_scatter: src shape {src.shape} does not match the slice {x[where].shape}")
    result = start_from(x, out, x.dtype)
    result[where] = src
    return finish(result, out)


@register_kernel("aten::select_scatter.out")
def select_scatter(x: np.ndarray, src: np.ndarray, dim: int, index: int, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "select_scatter")
    dim = norm_dim(dim, x.ndim)
    where = slice_index(dim, wrap_index(int(index), x.shape[dim], "select_scatter"))
    if x[where].shape != src.shape:
        raise ValueError(f"select_scatter: src shape {src.shape} does not match the slice {x[where].shape}")
    result = start_from(x, out, x.dtype)
    result[where] = src
    return finish(result, out)


# ----------------------------------------------------------------------------- ordering


def stable_order(x: np.ndarray, axis: int, descending: bool) -> np.ndarray:
    """Stable argsort along `axis`; NaN counts as the largest value (first when descending).

    numpy sorts NaN last, which is right for ascending. For descending, sort the
    reversed array ascending and reverse the result: ties then keep index order.
    """
    if x.dtype != compute_dtype(x.dtype):
        x = x.astype(compute_dtype(x.dtype))
    if not descending:
        return np.argsort(x, axis=axis, kind="stable")
    n = x.shape[axis]
    rev = np.flip(x, axis=axis)
    return (n - 1) - np.flip(np.argsort(rev, axis=axis, kind="stable"), axis=axis)


@register_kernel("aten::sort.values")
def sort(x: np.ndarray, dim: int = -1, descending: bool = False, values: np.ndarray = None,
         indices: np.ndarray = None) -> tuple:
    same_dtype(x, values, "sort")
    if x.ndim == 0:
        return write(values, x), write(indices, np.zeros((), np.int64))
    dim = norm_dim(dim, x.ndim)
    order = stable_order(x, dim, descending)
    return write(values, np.take_along_axis(x, order, axis=dim)), write(indices, order)


@register_kernel("aten::sort.values_stable")
def sort_stable(x: np.ndarray, stable: Optional[bool] = None, dim: int = -1, descending: bool = False,
                values: np.ndarray = None, indices: np.ndarray = None) -> tuple:
    return sort(x, dim, descending, values, indices)


@register_kernel("aten::topk.values")
def topk(x: np.ndarray, k: int, dim: int = -1, largest: bool = True, sorted: bool = True,
         values: np.ndarray = None, indices: np.ndarray = None) -> tuple:
    """The k largest (or smallest) along `dim`, always returned in sorted order."""
    same_dtype(x, values, "topk")
    size = x.shape[norm_dim(dim, x.ndim)] if x.ndim else 1
    if not 0 <= k <= size:
        raise ValueError(f"topk: k={k} out of range for a dim of size {size}")
    if x.ndim == 0:
        return write(values, x), write(indices, np.zeros((), np.int64))
    dim = norm_dim(dim, x.ndim)
    order = np.take(stable_order(x, dim, descending=largest), np.arange(k), axis=dim)
    return write(values, np.take_along_axis(x, order, axis=dim)), write(indices, order)


@register_kernel("aten::cumsum.out")
def cumsum(x: np.ndarray, dim: int, dtype: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    """Running sum in out's dtype (half types accumulate in float32, like torch on CPU)."""
    acc = compute_dtype(out.dtype)
    if x.ndim == 0:
        return write(out, x.astype(acc))
    with np.errstate(all="ignore"):
        return write(out, np.cumsum(x.astype(acc), axis=norm_dim(dim, x.ndim)))
