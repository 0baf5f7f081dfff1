"""Helpers shared by the portable kernels: result writing and ATen type promotion."""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import numpy as np

class _LowPrecision(dict):
    """dtype -> whether numpy cannot do arithmetic in it natively (or does it slowly): float16,
    bfloat16, float8; kernels compute in float32 instead. Filled as dtypes are first asked
    about, so that ml_dtypes (2.5 MiB resident) is never imported here: no array can have one
    of its types before something else imported it."""

    _ML_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})

    def __missing__(self, key) -> bool:
        dtype = np.dtype(key)
        low = dtype == np.float16 or (dtype.type.__module__ == "ml_dtypes" and dtype.name in self._ML_DTYPES)
        self[key] = low
        return low


LOW_PRECISION = _LowPrecision()  # LOW_PRECISION[dtype] -> bool

# Creation kernels refuse to build larger tensors: a hostile program must not make us
# allocate gigabytes from one Int value (32M elements = 256 MiB of int64).
MAX_CREATED_ELEMENTS = 1 << 25


@functools.cache
def random_generator() -> np.random.Generator:
    """The generator behind the random kernels (rand, randn, native_dropout). Like
    ExecuTorch's, it is seeded from OS entropy: programs draw fresh values on every run.
    Made at the first call: importing numpy.random costs a process 6 MiB resident (it
    loads OpenSSL), and most programs draw nothing."""
    return np.random.default_rng()


def write(out: np.ndarray, result: Any) -> np.ndarray:
    """Finish a kernel: put `result` into `out` when the shapes agree, else return a new array.

    Returning `out` itself tells the runtime nothing more is needed; a differently
    shaped result (dynamic shapes) is copied into the tensor's planned storage by it.
    """
    if np.shape(result) == out.shape:
        np.copyto(out, result, casting="unsafe")
        return out
    return np.asarray(result).astype(out.dtype, copy=False)


def same_view(a: np.ndarray, b: np.ndarray) -> bool:
    """a and b are the same elements of the same memory (two view objects of it, say)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def is_float(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or LOW_PRECISION[dtype]


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype to do arithmetic in for a result of `dtype` (float32 for half types)."""
    return np.dtype(np.float32) if LOW_PRECISION[dtype] else dtype


def as_compute(x: Any, dtype: np.dtype) -> Any:
    """Cast an operand (array or Python scalar) to the compute dtype."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == dtype else x.astype(dtype)
    return np.asarray(x, dtype=dtype)


def check_created(shape: Sequence[int]) -> tuple[int, ...]:
    """Validate a requested tensor shape before allocating it (hostile programs)."""
    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        if s < 0:
            raise ValueError(f"negative size in {shape}")
        n *= s
    if n > MAX_CREATED_ELEMENTS:
        raise ValueError(f"refusing to create a tensor of {n} elements")
    return shape


def norm_dim(dim: int, ndim: int) -> int:
    """Wrap a possibly negative dim; rank-0 tensors accept dim 0 and -1 like ATen."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"dim {dim} out of range for a tensor of rank {ndim}")
    return dim % n


def norm_dims(dims: Optional[Sequence[int]], ndim: int) -> Optional[tuple[int, ...]]:
    """None or empty -> None (all dims, ATen reduction convention)."""
    if dims is None or len(dims) == 0:
        return None
    if ndim == 0:
        return None
    return tuple(sorted({norm_dim(d, ndim) for d in dims}))
