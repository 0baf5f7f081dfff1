"""Symbolic-size and primitive ops: `aten::sym_size.int`, the `executorch_prim::*.Scalar`
integer/float arithmetic used by dynamic shapes and loops, `et_view` and `et_copy_index`.

These return Python scalars (int, float, bool) that the runtime stores into the
instruction's placeholder value. Arithmetic follows Python (= torch SymInt) semantics:
int op int stays int, anything with a float becomes float, `//` and `%` floor.
"""
from __future__ import annotations

import math
import operator
from typing import Sequence, Union

import numpy as np

from ..registry import register_kernel
from ._util import check_created, norm_dim

Number = Union[int, float, bool]


def scalar(v) -> Number:
    """Plain Python number: numpy scalars and 0-d arrays are unwrapped."""
    if isinstance(v, np.ndarray):
        if v.ndim != 0:
            raise TypeError(f"expected a scalar, got a tensor of shape {v.shape}")
        v = v.item()
    elif isinstance(v, np.generic):
        v = v.item()
    if not isinstance(v, (int, float, bool)):
        raise TypeError(f"expected a number, got {type(v).__name__}")
    return v


@register_kernel("aten::sym_size.int")
def sym_size(x: np.ndarray, dim: int) -> int:
    return int(x.shape[norm_dim(dim, x.ndim)])


@register_kernel("aten::_local_scalar_dense")
def local_scalar_dense(x: np.ndarray) -> Number:
    """`tensor.item()`: the one element of a tensor as a Python number."""
    if x.size != 1:
        raise ValueError(f"item() needs a tensor of one element, got shape {x.shape}")
    return x.reshape(()).item()


@register_kernel("aten::sym_numel")
def sym_numel(x: np.ndarray) -> int:
    return int(x.size)


def _binary(name: str, fn):
    @register_kernel(f"executorch_prim::{name}.Scalar")
    def kernel(a, b):
        return fn(scalar(a), scalar(b))

    kernel.__name__ = f"prim_{name}"
    return kernel


def _floordiv(a: Number, b: Number) -> Number:
    if b == 0:
        raise ZeroDivisionError("executorch_prim::floordiv by zero")
    return a // b


def _truediv(a: Number, b: Number) -> float:
    if b == 0:
        raise ZeroDivisionError("executorch_prim::truediv by zero")
    return a / b


def _mod(a: Number, b: Number) -> Number:
    if b == 0:
        raise ZeroDivisionError("executorch_prim::mod by zero")
    return a % b


def _promote(result: Number, a: Number, b: Number) -> Number:
    """max/min of an int and a float is a float, as in torch.sym_max."""
    return float(result) if isinstance(a, float) or isinstance(b, float) else result


_binary("add", operator.add)
_binary("sub", operator.sub)
_binary("mul", operator.mul)
_binary("floordiv", _floordiv)
_binary("truediv", _truediv)
_binary("mod", _mod)
_binary("eq", operator.eq)
_binary("gt", operator.gt)
_binary("lt", operator.lt)
_binary("ge", operator.ge)
_binary("le", operator.le)
_binary("sym_max", lambda a, b: _promote(max(a, b), a, b))
_binary("sym_min", lambda a, b: _promote(min(a, b), a, b))


def _unary(name: str, fn):
    @register_kernel(f"executorch_prim::{name}.Scalar")
    def kernel(a):
        return fn(scalar(a))

    kernel.__name__ = f"prim_{name}"
    return kernel


_unary("neg", operator.neg)
_unary("sym_float", float)
_unary("sym_int", lambda a: int(a))  # truncates toward zero, like Python's int()
_unary("ceil", lambda a: int(math.ceil(a)))
_unary("round", lambda a: int(round(a)))  # round half to even, like Python's round()
_unary("trunc", lambda a: int(math.trunc(a)))
_unary("sym_not", lambda a: not a)


@register_kernel("executorch_prim::sym_ite.Scalar")
def sym_ite(cond, if_true, if_false) -> Number:
    return scalar(if_true) if scalar(cond) else scalar(if_false)


@register_kernel("executorch_prim::et_view.default")
def et_view(x: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """A dynamic-shape view: the out value shares its base's planned bytes, so a view is enough."""
    return x.reshape(tuple(int(s) for s in sizes))


@register_kernel("executorch_prim::et_copy_index.tensor")
def et_copy_index(copy_to: np.ndarray, copy_from: np.ndarray, index: int) -> np.ndarray:
    """One step of a `map` loop: the stacked output grows to `index + 1` rows, the last being copy_from.

    Unlike other kernels all three arguments are inputs (the emitter writes no return
    slot); the runtime stores the returned array into `copy_to` (argument 0), whose
    planned upper bound holds every row. Rows before `index` were written by earlier steps.
    """
    index = int(scalar(index))
    if index < 0:
        raise IndexError(f"et_copy_index: negative index {index}")
    row_shape = tuple(copy_from.shape)
    if copy_to.ndim != len(row_shape) + 1 or tuple(copy_to.shape[1:]) != row_shape:
        raise ValueError(f"et_copy_index: rows of {copy_to.shape} cannot hold a tensor of shape {row_shape}")
    if index > copy_to.shape[0]:
        raise IndexError(f"et_copy_index: index {index} skips rows (the output has {copy_to.shape[0]})")
    result = np.empty(check_created((index + 1,) + row_shape), copy_to.dtype)
    result[:index] = copy_to[:index]
    result[index] = copy_from
    return result
