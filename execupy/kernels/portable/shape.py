"""Shape and copy kernels: views that copy (permute, view, expand, squeeze, select,
slice, ...), joins and splits (cat, stack, split, unbind), reorderings (flip, roll,
repeat, repeat_interleave), triangular masks and the plain copies and casts.

ExecuTorch has no real views at run time: every `*_copy` op writes a fresh tensor. The
result dtype is always `out.dtype`; the pure data-movement ops insist that it equals the
input's (a mismatch means a malformed program), the cast ops (`_to_dim_order_copy`,
`_to_copy`, `copy`) convert with C semantics as ATen does.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..registry import register_kernel
from ._util import check_created, norm_dim, write


def same_dtype(x: np.ndarray, out: np.ndarray, op: str) -> None:
    if x.dtype != out.dtype:
        raise TypeError(f"{op}: input dtype {x.dtype} differs from out dtype {out.dtype}")


def slice_index(dim: int, index) -> tuple:
    """An index tuple that applies `index` (int or slice) to axis `dim` only."""
    return (slice(None),) * dim + (index,)


def clamp_slice(size: int, start: Optional[int], end: Optional[int], step: int) -> slice:
    """ATen slice bounds: None means the whole range, negatives wrap once, then clamp."""
    if step <= 0:
        raise ValueError(f"slice step must be positive, got {step}")
    start = 0 if start is None else int(start)
    end = size if end is None else int(end)
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return slice(start, end, int(step))


def wrap_index(index: int, size: int, what: str) -> int:
    if not -size <= index < size:
        raise IndexError(f"{what}: index {index} out of range for size {size}")
    return index % size


# ----------------------------------------------------------------------------- views


@register_kernel("aten::permute_copy.out")
def permute_copy(x: np.ndarray, dims: Sequence[int], out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "permute_copy")
    axes = [norm_dim(d, x.ndim) for d in dims]
    if x.ndim == 0:
        axes = []
    if sorted(axes) != list(range(x.ndim)):
        raise ValueError(f"permute_copy: dims {tuple(dims)} are not a permutation of rank {x.ndim}")
    return write(out, np.transpose(x, axes))


@register_kernel("aten::view_copy.out", "aten::_unsafe_view.out")
def view_copy(x: np.ndarray, size: Sequence[int], out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "view_copy")
    return write(out, x.reshape(tuple(size)))


@register_kernel("aten::expand_copy.out")
def expand_copy(x: np.ndarray, size: Sequence[int], implicit: bool = False, out: np.ndarray = None) -> np.ndarray:
    same_dtype(x, out, "expand_copy")
    return write(out, expanded(x, size))


def expanded(x: np.ndarray, size: Sequence[int], implicit: bool = False) -> np.ndarray:
    """x broadcast to `size` (-1 keeps an input dim's size), a read-only view."""
    lead = len(size) - x.ndim
    if lead < 0:
        raise ValueError(f"expand_copy: size {tuple(size)} has fewer dims than the input {x.shape}")
    # -1 keeps the input's size; it is only allowed for dims the input has.
    shape = []
    for i, s in enumerate(size):
        if s == -1:
            if i < lead:
                raise ValueError("expand_copy: -1 is not allowed for a new leading dim")
            s = x.shape[i - lead]
        shape.append(int(s))
    # Sizes come from the program: validate before materializing the broadcast.
    return np.broadcast_to(x, check_created(shape))


@register_kernel("aten::squeeze_copy.dims_out")
def squeeze_copy_dims(x: np.ndarray, dims: Sequence[int], out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "squeeze_copy")
    if x.ndim == 0:
        return write(out, x)
    axes = tuple(sorted({d for d in (norm_dim(d, x.ndim) for d in dims) if x.shape[d] == 1}))
    return write(out, np.squeeze(x, axis=axes) if axes else x)


@register_kernel("aten::squeeze_copy.dim_out")
def squeeze_copy_dim(x: np.ndarray, dim: int, out: np.ndarray) -> np.ndarray:
    return squeeze_copy_dims(x, (dim,), out)


@register_kernel("aten::squeeze_copy.out")
def squeeze_copy(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    return squeeze_copy_dims(x, tuple(range(x.ndim)), out)


@register_kernel("aten::unsqueeze_copy.out")
def unsqueeze_copy(x: np.ndarray, dim: int, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "unsqueeze_copy")
    return write(out, np.expand_dims(x, norm_dim(dim, x.ndim + 1)))


@register_kernel("aten::select_copy.int_out")
def select_copy(x: np.ndarray, dim: int, index: int, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "select_copy")
    if x.ndim == 0:
        raise IndexError("select_copy: cannot select from a 0-dim tensor")
    dim = norm_dim(dim, x.ndim)
    index = wrap_index(int(index), x.shape[dim], "select_copy")
    return write(out, x[slice_index(dim, index)])


@register_kernel("aten::slice_copy.Tensor_out")
def slice_copy(x: np.ndarray, dim: int = 0, start: Optional[int] = None, end: Optional[int] = None,
               step: int = 1, out: np.ndarray = None) -> np.ndarray:
    same_dtype(x, out, "slice_copy")
    dim = norm_dim(dim, x.ndim)
    return write(out, x[slice_index(dim, clamp_slice(x.shape[dim], start, end, step))])


@register_kernel("aten::narrow_copy.out")
def narrow_copy(x: np.ndarray, dim: int, start: int, length: int, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "narrow_copy")
    dim = norm_dim(dim, x.ndim)
    size = x.shape[dim]
    start = int(start) + size if start < 0 else int(start)
    if not (0 <= start <= size and 0 <= length and start + length <= size):
        raise IndexError(f"narrow_copy: start {start} + length {length} exceeds size {size}")
    return write(out, x[slice_index(dim, slice(start, start + int(length)))])


@register_kernel("aten::alias_copy.out", "aten::lift_fresh_copy.out", "aten::detach_copy.out")
def alias_copy(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "alias_copy")
    return write(out, x)


@register_kernel("aten::clone.out")
def clone(x: np.ndarray, memory_format: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    same_dtype(x, out, "clone")
    return write(out, x)


# ----------------------------------------------------------------------------- copies and casts


def cast(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Convert to out.dtype with C semantics (floats truncate toward zero; NaN/overflow are
    undefined in ATen too, so numpy's warnings about them are silenced)."""
    with np.errstate(all="ignore"):
        return write(out, x)


def check_dim_order(dim_order: Optional[Sequence[int]], out: np.ndarray, op: str) -> None:
    """The out tensor already lives in its planned layout; the list only has to describe one."""
    if dim_order is not None and sorted(dim_order) != list(range(out.ndim)):
        raise ValueError(f"{op}: dim_order {tuple(dim_order)} does not fit a rank-{out.ndim} tensor")


@register_kernel("dim_order_ops::_to_dim_order_copy.out")
def to_dim_order_copy(x: np.ndarray, non_blocking: bool = False, dim_order: Optional[Sequence[int]] = None,
                      out: np.ndarray = None) -> np.ndarray:
    """A cast (target dtype = out.dtype) and/or a layout change (handled by out's own layout)."""
    check_dim_order(dim_order, out, "_to_dim_order_copy")
    return cast(x, out)


@register_kernel("dim_order_ops::_clone_dim_order.out")
def clone_dim_order(x: np.ndarray, non_blocking: bool = False, dim_order: Optional[Sequence[int]] = None,
                    out: np.ndarray = None) -> np.ndarray:
    check_dim_order(dim_order, out, "_clone_dim_order")
    same_dtype(x, out, "_clone_dim_order")
    return write(out, x)


@register_kernel("aten::_to_copy.out")
def to_copy(x: np.ndarray, non_blocking: bool = False, memory_format: Optional[int] = None,
            out: np.ndarray = None) -> np.ndarray:
    return cast(x, out)


@register_kernel("aten::copy.out")
def copy(x: np.ndarray, src: np.ndarray, non_blocking: bool = False, out: np.ndarray = None) -> np.ndarray:
    """`self` with `src` broadcast into it: the result has self's shape and out's dtype."""
    return cast(np.broadcast_to(src, x.shape), out)


@register_kernel("aten::copy_")
def copy_(x: np.ndarray, src: np.ndarray, non_blocking: bool = False) -> np.ndarray:
    """In place (mutable-buffer write-back): returns `x` itself after copying `src` into it."""
    with np.errstate(all="ignore"):
        np.copyto(x, np.broadcast_to(src, x.shape), casting="unsafe")
    return x


# ----------------------------------------------------------------------------- joins and splits


@register_kernel("aten::cat.out")
def cat(tensors: Sequence[np.ndarray], dim: int = 0, out: np.ndarray = None) -> np.ndarray:
    # ATen still skips 1-D empty tensors whatever the rank of the others (legacy behaviour).
    parts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not parts:
        return write(out, np.zeros((0,), out.dtype))
    dim = norm_dim(dim, parts[0].ndim)
    parts = [t if t.dtype == out.dtype else t.astype(out.dtype) for t in parts]
    result_shape = list(parts[0].shape)
    result_shape[dim] = sum(t.shape[dim] for t in parts)
    if tuple(result_shape) == out.shape and all(t.ndim == out.ndim for t in parts):
        return np.concatenate(parts, axis=dim, out=out)
    return write(out, np.concatenate(parts, axis=dim))


@register_kernel("aten::stack.out")
def stack(tensors: Sequence[np.ndarray], dim: int = 0, out: np.ndarray = None) -> np.ndarray:
    if not tensors:
        raise ValueError("stack: expects a non-empty list of tensors")
    dim = norm_dim(dim, tensors[0].ndim + 1)
    parts = [t if t.dtype == out.dtype else t.astype(out.dtype) for t in tensors]
    return write(out, np.stack(parts, axis=dim))


def split_into(x: np.ndarray, sizes: Sequence[int], dim: int, outs: Sequence[np.ndarray], op: str) -> list:
    if len(sizes) != len(outs):
        raise ValueError(f"{op}: {len(sizes)} pieces but {len(outs)} out tensors")
    if any(s < 0 for s in sizes) or sum(sizes) != x.shape[dim]:
        raise ValueError(f"{op}: sizes {tuple(sizes)} do not add up to {x.shape[dim]} along dim {dim}")
    results, start = [], 0
    for size, out in zip(sizes, outs):
        same_dtype(x, out, op)
        results.append(write(out, x[slice_index(dim, slice(start, start + size))]))
        start += size
    return results


@register_kernel("aten::split_with_sizes_copy.out")
def split_with_sizes_copy(x: np.ndarray, split_sizes: Sequence[int], dim: int = 0,
                          out: Sequence[np.ndarray] = ()) -> list:
    dim = norm_dim(dim, x.ndim)
    return split_into(x, [int(s) for s in split_sizes], dim, out, "split_with_sizes_copy")


@register_kernel("aten::split_copy.Tensor_out")
def split_copy(x: np.ndarray, split_size: int, dim: int = 0, out: Sequence[np.ndarray] = ()) -> list:
    dim = norm_dim(dim, x.ndim)
    size = x.shape[dim]
    if split_size <= 0:
        if size != 0 or split_size < 0:
            raise ValueError(f"split_copy: split_size must be positive, got {split_size}")
        sizes = [0]
    else:
        sizes = [split_size] * (size // split_size) + ([size % split_size] if size % split_size else [])
    return split_into(x, sizes or [0], dim, out, "split_copy")


@register_kernel("aten::unbind_copy.int_out")
def unbind_copy(x: np.ndarray, dim: int = 0, out: Sequence[np.ndarray] = ()) -> list:
    dim = norm_dim(dim, x.ndim)
    if len(out) != x.shape[dim]:
        raise ValueError(f"unbind_copy: {x.shape[dim]} pieces but {len(out)} out tensors")
    results = []
    for i, o in enumerate(out):
        same_dtype(x, o, "unbind_copy")
        results.append(write(o, x[slice_index(dim, i)]))
    return results


# ----------------------------------------------------------------------------- reorderings


@register_kernel("aten::flip.out")
def flip(x: np.ndarray, dims: Sequence[int], out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "flip")
    axes = [norm_dim(d, x.ndim) for d in dims]
    if len(set(axes)) != len(axes):
        raise ValueError(f"flip: dims {tuple(dims)} repeat a dim")
    if x.ndim == 0 or not axes:
        return write(out, x)
    return write(out, np.flip(x, axis=tuple(axes)))


@register_kernel("aten::roll.out")
def roll(x: np.ndarray, shifts: Sequence[int], dims: Sequence[int] = (), out: np.ndarray = None) -> np.ndarray:
    same_dtype(x, out, "roll")
    shifts = [int(s) for s in shifts]
    if not dims:  # roll the flattened tensor, then restore the shape
        if len(shifts) != 1:
            raise ValueError("roll: without dims, exactly one shift is allowed")
        return write(out, np.roll(x.reshape(-1), shifts[0]).reshape(x.shape))
    if len(shifts) != len(dims):
        raise ValueError(f"roll: {len(shifts)} shifts for {len(dims)} dims")
    return write(out, np.roll(x, shifts, axis=[norm_dim(d, x.ndim) for d in dims]))


@register_kernel("aten::repeat.out")
def repeat(x: np.ndarray, repeats: Sequence[int], out: np.ndarray) -> np.ndarray:
    same_dtype(x, out, "repeat")
    repeats = tuple(int(r) for r in repeats)
    if len(repeats) < x.ndim or any(r < 0 for r in repeats):
        raise ValueError(f"repeat: repeats {repeats} must be non-negative and cover all {x.ndim} dims")
    lifted = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
    check_created([s * r for s, r in zip(lifted.shape, repeats)])
    return write(out, np.tile(lifted, repeats))


@register_kernel("aten::repeat_interleave.Tensor_out")
def repeat_interleave(repeats: np.ndarray, output_size: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    """Index i repeated repeats[i] times: [2, 0, 1] -> [0, 0, 2] (int32 or int64, like repeats)."""
    if repeats.dtype not in (np.int32, np.int64) or repeats.ndim != 1:
        raise TypeError(f"repeat_interleave: repeats must be a 1-D int32/int64 tensor, got {repeats.dtype} {repeats.shape}")
    if repeats.size and repeats.min() < 0:
        raise ValueError("repeat_interleave: repeats cannot be negative")
    same_dtype(repeats, out, "repeat_interleave")
    total = int(repeats.sum(dtype=np.int64))
    if output_size is not None and int(output_size) != total:
        raise ValueError(f"repeat_interleave: output_size {output_size} differs from sum(repeats) = {total}")
    check_created((total,))
    return write(out, np.repeat(np.arange(repeats.size, dtype=repeats.dtype), repeats))


def _triangle(x: np.ndarray, diagonal: int, out: np.ndarray, upper: bool) -> np.ndarray:
    same_dtype(x, out, "triu" if upper else "tril")
    if x.ndim < 2:
        raise ValueError("tril/triu: input must have at least 2 dims")
    rows, cols = x.shape[-2:]
    keep = np.tri(rows, cols, k=int(diagonal) - (1 if upper else 0), dtype=bool)
    if upper:
        keep = ~keep
    return write(out, np.where(keep, x, np.zeros((), x.dtype)))


@register_kernel("aten::tril.out")
def tril(x: np.ndarray, diagonal: int = 0, out: np.ndarray = None) -> np.ndarray:
    return _triangle(x, diagonal, out, upper=False)


@register_kernel("aten::triu.out")
def triu(x: np.ndarray, diagonal: int = 0, out: np.ndarray = None) -> np.ndarray:
    return _triangle(x, diagonal, out, upper=True)
