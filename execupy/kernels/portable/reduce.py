"""Reductions: sum, mean, prod, amax/amin, any/all, argmax/argmin, max/min over a dim,
var/std/var_mean, logsumexp.

ATen conventions followed throughout:

* `dim=None` or an empty dim list reduces over every dimension.
* `keepdim=True` leaves each reduced dimension in place with size 1.
* Half types (float16, bfloat16) accumulate in float32 and are rounded once at the end.
* Integer and bool inputs of sum/prod accumulate in int64 (the dtype ATen picks when
  `dtype` is None); a narrower `out` dtype then wraps exactly as ATen's would.
* NaN propagates through amax/amin/max/min, and argmax/argmin point at the first NaN.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..registry import register_kernel
from ...schema.program import numpy_dtype
from ._util import compute_dtype, is_float, norm_dim, norm_dims, write

Dims = Optional[Sequence[int]]


def _axes(x: np.ndarray, dims: Dims) -> Optional[tuple[int, ...]]:
    return norm_dims(dims, x.ndim)


def _accumulate_dtype(out: np.ndarray, dtype_code: Optional[int]) -> np.dtype:
    """The dtype a sum/prod/mean accumulates in: the requested dtype (or out's), widened."""
    target = numpy_dtype(dtype_code) if dtype_code is not None else out.dtype
    if is_float(target):
        return compute_dtype(target)
    if target == np.bool_:
        return np.dtype(np.bool_)
    return np.dtype(np.uint64) if target.kind == "u" else np.dtype(np.int64)


def _cast_input(x: np.ndarray, dtype_code: Optional[int]) -> np.ndarray:
    """ATen casts the input to `dtype` before reducing when one is given."""
    if dtype_code is None:
        return x
    target = numpy_dtype(dtype_code)
    return x if x.dtype == target else x.astype(target)


# ------------------------------------------------------------------ sum / mean / prod


def _count(x: np.ndarray, axes: Optional[tuple[int, ...]]) -> int:
    """How many elements each output of a reduction over `axes` combines."""
    return x.size if axes is None else int(np.prod([x.shape[a] for a in axes]))


@register_kernel("aten::sum.IntList_out")
def sum_dim(x: np.ndarray, dim: Dims = None, keepdim: bool = False, dtype: Optional[int] = None,
            out: np.ndarray = None) -> np.ndarray:
    x = _cast_input(x, dtype)
    acc = _accumulate_dtype(out, dtype)
    axes = _axes(x, dim)
    if acc == np.bool_:  # a bool sum is "any": stays bool
        return write(out, np.any(x, axis=axes, keepdims=keepdim))
    with np.errstate(all="ignore"):
        return write(out, np.sum(x, axis=axes, dtype=acc, keepdims=keepdim))


@register_kernel("aten::sum.out")
def sum_all(x: np.ndarray, dtype: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    return sum_dim(x, None, False, dtype, out)


@register_kernel("aten::mean.out")
def mean_dim(x: np.ndarray, dim: Dims = None, keepdim: bool = False, dtype: Optional[int] = None,
             out: np.ndarray = None) -> np.ndarray:
    if last_dim_float32(x, dim, keepdim, dtype, out):  # an RMSNorm's mean: the same sums, fewer steps
        from ..fast import compiled_decode  # (here: kernels.fast imports this module)

        compiled = compiled_decode() if x.flags.c_contiguous and out.flags.c_contiguous else None
        if compiled is not None and not np.may_share_memory(x, out):  # one pass, eight rows at once
            compiled.mean_rows(x.reshape(-1, x.shape[-1]), out.reshape(-1))
            return out
        with np.errstate(all="ignore"):
            return np.true_divide(row_sums(x, np.float32), x.shape[-1], out=out)
    x = _cast_input(x, dtype)
    if not is_float(out.dtype):
        raise TypeError(f"mean needs a floating output, got {out.dtype}")
    acc = compute_dtype(out.dtype)
    axes = _axes(x, dim)
    with np.errstate(all="ignore"):  # the mean of nothing is 0 / 0 = NaN, as in ATen
        total = sequential_sum(x, axes, acc, keepdim)
        return write(out, np.true_divide(total, _count(x, axes), dtype=acc))


def last_dim_float32(x: np.ndarray, dim: Dims, keepdim: bool, dtype: Optional[int], out: np.ndarray) -> bool:
    """A float32 mean over the last dim, kept, into an out of exactly that shape."""
    return (keepdim and dtype is None and x.dtype == np.float32 and out.dtype == np.float32 and x.ndim > 0
            and x.shape[-1] > 0 and dim is not None and len(dim) == 1 and dim[0] in (-1, x.ndim - 1)
            and out.shape == x.shape[:-1] + (1,))


def sequential_sum(x: np.ndarray, axes: Optional[tuple[int, ...]], acc: np.dtype, keepdim: bool) -> np.ndarray:
    """The sum over `axes` added one element after another, in index order, as ExecuTorch's
    portable mean does (numpy's np.sum adds pairwise: the last bits can differ, and an
    RMSNorm's mean feeds an int8 quantization that can round the other way on them)."""
    axes = tuple(range(x.ndim)) if axes is None else axes
    rest = [a for a in range(x.ndim) if a not in axes]
    rows = np.transpose(x, rest + list(axes)).reshape([x.shape[a] for a in rest] + [-1])
    total = row_sums(rows, acc)[..., 0] if rows.shape[-1] else np.zeros(rows.shape[:-1], acc)
    return total.reshape([1 if a in axes else x.shape[a] for a in range(x.ndim)]) if keepdim else total


SIDE_BY_SIDE_ROWS = 8  # from this many rows on, `row_sums` adds them side by side


def row_sums(x: np.ndarray, acc: np.dtype) -> np.ndarray:
    """[..., 1]: each row of x (its last axis, not empty) summed in `acc` one element after
    another, in index order, from the first element as ExecuTorch's reductions seed their
    accumulator (from 0, a row of -0.0 would sum to 0.0, not -0.0). Few rows: cumsum's running
    sums. Many: side by side, a transposed copy [n, rows] reduced over its first axis, which
    numpy adds one whole row of the copy after another (it adds pairwise only along its inner
    loop, here the rows), vectorised across the rows: the same sums, an RMSNorm's mean over a
    113-token prompt in 28 us instead of 180."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] < SIDE_BY_SIDE_ROWS:
        return np.cumsum(x, axis=-1, dtype=acc)[..., -1:]
    total = np.add.reduce(np.ascontiguousarray(rows.T, acc), axis=0)
    zero = total == 0  # numpy's reduce starts from +0: a row all of -0.0 sums to -0.0 from its first element
    if zero.any() and total.dtype.kind == "f":
        for r in np.flatnonzero(zero):
            if np.all((rows[r] == 0) & np.signbit(rows[r])):
                total[r] = -total.dtype.type(0)
    return total.reshape(x.shape[:-1] + (1,))


@register_kernel("aten::mean.dtype_out")
def mean_all(x: np.ndarray, dtype: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    return mean_dim(x, None, False, dtype, out)


@register_kernel("aten::prod.int_out")
def prod_dim(x: np.ndarray, dim: int, keepdim: bool = False, dtype: Optional[int] = None,
             out: np.ndarray = None) -> np.ndarray:
    x = _cast_input(x, dtype)
    acc = _accumulate_dtype(out, dtype)
    axis = norm_dim(dim, x.ndim) if x.ndim else None
    if acc == np.bool_:
        return write(out, np.all(x, axis=axis, keepdims=keepdim))
    with np.errstate(all="ignore"):
        return write(out, np.prod(x, axis=axis, dtype=acc, keepdims=keepdim))


@register_kernel("aten::prod.out")
def prod_all(x: np.ndarray, dtype: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    x = _cast_input(x, dtype)
    acc = _accumulate_dtype(out, dtype)
    if acc == np.bool_:
        return write(out, np.all(x))
    with np.errstate(all="ignore"):
        return write(out, np.prod(x, dtype=acc))


# ------------------------------------------------------------------ amax / amin


def _need_elements(x: np.ndarray, axes: Optional[tuple[int, ...]], what: str) -> None:
    sizes = x.shape if axes is None else [x.shape[a] for a in axes]
    if x.ndim and any(s == 0 for s in sizes):
        raise ValueError(f"{what}: cannot reduce over an empty dimension")


def _extreme(fn, x: np.ndarray, dim: Dims, keepdim: bool, out: np.ndarray, what: str) -> np.ndarray:
    axes = _axes(x, dim)
    _need_elements(x, axes, what)
    with np.errstate(invalid="ignore"):  # np.max/np.min propagate NaN, as ATen does
        return write(out, fn(x, axis=axes, keepdims=keepdim))


@register_kernel("aten::amax.out")
def amax(x: np.ndarray, dim: Dims = (), keepdim: bool = False, out: np.ndarray = None) -> np.ndarray:
    return _extreme(np.max, x, dim, keepdim, out, "amax")


@register_kernel("aten::amin.out")
def amin(x: np.ndarray, dim: Dims = (), keepdim: bool = False, out: np.ndarray = None) -> np.ndarray:
    return _extreme(np.min, x, dim, keepdim, out, "amin")


@register_kernel("aten::max.unary_out")
def max_all(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    return _extreme(np.max, x, None, False, out, "max")


@register_kernel("aten::min.unary_out")
def min_all(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    return _extreme(np.min, x, None, False, out, "min")


# ------------------------------------------------------------------ any / all


def _truth(fn, x: np.ndarray, axes, keepdim: bool, out: np.ndarray) -> np.ndarray:
    # NaN counts as true (it is non-zero), which numpy's logical reductions already do.
    return write(out, fn(x, axis=axes, keepdims=keepdim))


@register_kernel("aten::any.all_out")
def any_all(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    return _truth(np.any, x, None, False, out)


@register_kernel("aten::any.out")
def any_dim(x: np.ndarray, dim: int, keepdim: bool = False, out: np.ndarray = None) -> np.ndarray:
    return _truth(np.any, x, _axes(x, (dim,)), keepdim, out)


def _truth_dims(fn, x: np.ndarray, dim: Dims, keepdim: bool, out: np.ndarray) -> np.ndarray:
    # Unlike sum/amax, any.dims/all.dims read an empty list as "no dims": nothing is
    # reduced and the result is the element-wise truth value; only None means all dims.
    if dim is not None and len(dim) == 0:
        return write(out, x.astype(np.bool_))
    return _truth(fn, x, _axes(x, dim), keepdim, out)


@register_kernel("aten::any.dims_out")
def any_dims(x: np.ndarray, dim: Dims = None, keepdim: bool = False, out: np.ndarray = None) -> np.ndarray:
    return _truth_dims(np.any, x, dim, keepdim, out)


@register_kernel("aten::all.all_out")
def all_all(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    return _truth(np.all, x, None, False, out)


@register_kernel("aten::all.out")
def all_dim(x: np.ndarray, dim: int, keepdim: bool = False, out: np.ndarray = None) -> np.ndarray:
    return _truth(np.all, x, _axes(x, (dim,)), keepdim, out)


@register_kernel("aten::all.dims_out")
def all_dims(x: np.ndarray, dim: Dims = None, keepdim: bool = False, out: np.ndarray = None) -> np.ndarray:
    return _truth_dims(np.all, x, dim, keepdim, out)


# ------------------------------------------------------------------ arg reductions


def _arg(fn, x: np.ndarray, dim: Optional[int], keepdim: bool, out: np.ndarray, what: str) -> np.ndarray:
    """argmax/argmin; numpy, like ATen, returns the first extreme and treats NaN as the extreme."""
    if dim is None:
        if x.size == 0:
            raise ValueError(f"{what}: cannot reduce an empty tensor")
        index = np.asarray(fn(x.reshape(-1)))
        if keepdim:
            index = index.reshape((1,) * x.ndim)
        return write(out, index)
    if x.ndim == 0:
        norm_dim(dim, 0)
        return write(out, np.asarray(0))
    axis = norm_dim(dim, x.ndim)
    _need_elements(x, (axis,), what)
    return write(out, fn(x, axis=axis, keepdims=keepdim))


@register_kernel("aten::argmax.out")
def argmax(x: np.ndarray, dim: Optional[int] = None, keepdim: bool = False, out: np.ndarray = None) -> np.ndarray:
    return _arg(np.argmax, x, dim, keepdim, out, "argmax")


@register_kernel("aten::argmin.out")
def argmin(x: np.ndarray, dim: Optional[int] = None, keepdim: bool = False, out: np.ndarray = None) -> np.ndarray:
    return _arg(np.argmin, x, dim, keepdim, out, "argmin")


def _value_and_index(argfn, x: np.ndarray, dim: int, keepdim: bool, values: np.ndarray,
                     indices: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    if x.ndim == 0:
        norm_dim(dim, 0)
        return write(values, x), write(indices, np.asarray(0))
    axis = norm_dim(dim, x.ndim)
    _need_elements(x, (axis,), what)
    index = argfn(x, axis=axis, keepdims=True)
    value = np.take_along_axis(x, index, axis=axis)  # the NaN itself where argfn found one
    if not keepdim:
        index, value = np.squeeze(index, axis), np.squeeze(value, axis)
    return write(values, value), write(indices, index)


@register_kernel("aten::max.dim_max")
def max_dim(x: np.ndarray, dim: int, keepdim: bool = False, max: np.ndarray = None,
            max_values: np.ndarray = None) -> tuple[np.ndarray, np.ndarray]:
    # ATen names the outputs (max, max_values) though they hold values and indices.
    return _value_and_index(np.argmax, x, dim, keepdim, max, max_values, "max")


@register_kernel("aten::min.dim_min")
def min_dim(x: np.ndarray, dim: int, keepdim: bool = False, min: np.ndarray = None,
            min_indices: np.ndarray = None) -> tuple[np.ndarray, np.ndarray]:
    return _value_and_index(np.argmin, x, dim, keepdim, min, min_indices, "min")


# ------------------------------------------------------------------ var / std


def _variance(x: np.ndarray, dim: Dims, correction, keepdim: bool, out: np.ndarray) -> np.ndarray:
    return _variance_and_mean(x, dim, correction, keepdim, out)[0]


def _variance_and_mean(x: np.ndarray, dim: Dims, correction, keepdim: bool,
                       out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if not is_float(out.dtype):
        raise TypeError(f"var/std need a floating output, got {out.dtype}")
    correction = 1 if correction is None else correction
    acc = compute_dtype(out.dtype)
    axes = _axes(x, dim)
    xs = x.astype(acc, copy=False)
    # Two passes (mean, then squared deviations); the divisor is max(0, N - correction),
    # so a correction of N or more gives inf (or NaN for zero spread), as in ATen.
    with np.errstate(all="ignore"):
        n = _count(x, axes)
        mean = np.sum(xs, axis=axes, keepdims=True) / acc.type(n)
        squares = np.sum(np.square(xs - mean), axis=axes, keepdims=keepdim)
        return squares / acc.type(max(0.0, n - correction)), mean.reshape(squares.shape)


@register_kernel("aten::var.correction_out")
def var_correction(x: np.ndarray, dim: Dims = None, correction=None, keepdim: bool = False,
                   out: np.ndarray = None) -> np.ndarray:
    return write(out, _variance(x, dim, correction, keepdim, out))


@register_kernel("aten::var_mean.correction_out")
def var_mean_correction(x: np.ndarray, dim: Dims = None, correction=None, keepdim: bool = False,
                        out0: np.ndarray = None, out1: np.ndarray = None) -> tuple[np.ndarray, np.ndarray]:
    """(variance, mean) over the same dims, from one computation of the mean."""
    var, mean = _variance_and_mean(x, dim, correction, keepdim, out0)
    return write(out0, var), write(out1, mean)


@register_kernel("aten::std.correction_out")
def std_correction(x: np.ndarray, dim: Dims = None, correction=None, keepdim: bool = False,
                   out: np.ndarray = None) -> np.ndarray:
    return write(out, np.sqrt(_variance(x, dim, correction, keepdim, out)))


@register_kernel("aten::var.out")
def var_unbiased(x: np.ndarray, dim: Dims = None, unbiased: bool = True, keepdim: bool = False,
                 out: np.ndarray = None) -> np.ndarray:
    return var_correction(x, dim, 1 if unbiased else 0, keepdim, out)


@register_kernel("aten::std.out")
def std_unbiased(x: np.ndarray, dim: Dims = None, unbiased: bool = True, keepdim: bool = False,
                 out: np.ndarray = None) -> np.ndarray:
    return std_correction(x, dim, 1 if unbiased else 0, keepdim, out)


# ------------------------------------------------------------------ logsumexp


@register_kernel("aten::logsumexp.out")
def logsumexp(x: np.ndarray, dim: Sequence[int] = (), keepdim: bool = False, out: np.ndarray = None) -> np.ndarray:
    acc = compute_dtype(out.dtype) if is_float(out.dtype) else np.dtype(np.float32)
    xs = x.astype(acc, copy=False)
    axes = _axes(x, dim)
    with np.errstate(all="ignore"):
        m = np.max(xs, axis=axes, keepdims=True, initial=-np.inf)  # initial: empty slices give -inf
        # Shift by the max for stability, except where it is infinite (ATen does the same):
        # an all -inf slice then gives log(0) + (-inf) = -inf, and +inf stays +inf.
        m = np.where(np.isinf(m), 0, m).astype(acc)
        result = np.log(np.sum(np.exp(xs - m), axis=axes, keepdims=True)) + m
    if not keepdim:
        result = np.squeeze(result, axis=axes)
    return write(out, result)
