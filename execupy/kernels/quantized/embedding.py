"""quantized_decomposed::embedding_{byte,2bit,4bit}: look rows up in a quantized table.

Each row of the weight table is quantized with one scale (and optional zero point) per
row, or per group of columns when `weight_scales` is 2-D ([rows, groups]). A looked-up
value is `(w - zero_point) * scale`, computed in float32 and written in the out dtype.

Packing, as ExecuTorch's exporter writes it (the weight is always a byte tensor here):

* byte: one int8 or uint8 value per column;
* 4bit: two values per byte, the even column in the high nibble, the odd one in the low
  nibble, each stored as value + 8 (so the range -8..7 is kept in 0..15);
* 2bit: four values per byte, column 4k in bits 0-1 up to column 4k+3 in bits 6-7, each
  stored as value + 2.

`weight_quant_min/max` are metadata only (as in ExecuTorch); `dtype` in the `.dtype_out`
variants must match the out tensor's dtype.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...schema.program import numpy_dtype
from ..portable._util import write
from ..registry import register_kernel

# By name: bfloat16 is ml_dtypes' type, which is not imported here (2.5 MiB resident).
_FLOATS = frozenset({"float32", "float16", "bfloat16"})


def unpack_4bit(packed: np.ndarray) -> np.ndarray:
    """[rows, cols/2] uint8 -> [rows, cols] int8 in -8..7 (high nibble first)."""
    high = (packed >> 4).astype(np.int8) - 8
    low = (packed & 0x0F).astype(np.int8) - 8
    return np.stack((high, low), axis=-1).reshape(packed.shape[0], -1)


def unpack_2bit(packed: np.ndarray) -> np.ndarray:
    """[rows, cols/4] uint8 -> [rows, cols] int8 in -2..1 (lowest bits first)."""
    parts = [((packed >> shift) & 3).astype(np.int8) - 2 for shift in (0, 2, 4, 6)]
    return np.stack(parts, axis=-1).reshape(packed.shape[0], -1)


def _check(weight: np.ndarray, scales: np.ndarray, zero_points: Optional[np.ndarray], indices: np.ndarray,
           out: np.ndarray, bits: int) -> None:
    if weight.ndim != 2:
        raise ValueError(f"embedding_{bits}bit: weight must be 2-D, got shape {weight.shape}")
    allowed = (np.int8, np.uint8) if bits == 8 else (np.uint8,)
    if weight.dtype not in [np.dtype(t) for t in allowed]:
        raise TypeError(f"embedding: weight dtype {weight.dtype} is not supported for {bits}-bit tables")
    if scales.ndim not in (1, 2) or scales.shape[0] != weight.shape[0]:
        raise ValueError(f"embedding: weight_scales of shape {scales.shape} do not fit {weight.shape[0]} rows")
    if scales.dtype.name not in _FLOATS or out.dtype.name not in _FLOATS:
        raise TypeError(f"embedding: scales {scales.dtype} / out {out.dtype} must be floating")
    if zero_points is not None and zero_points.shape != scales.shape:
        raise ValueError(f"embedding: weight_zero_points shape {zero_points.shape} != scales shape {scales.shape}")
    if indices.dtype != np.int64:
        raise TypeError(f"embedding: indices must be int64, got {indices.dtype}")
    if indices.size and (indices.min() < 0 or indices.max() >= weight.shape[0]):
        raise IndexError(f"embedding: index out of range for a table of {weight.shape[0]} rows")


def _lookup(weight: np.ndarray, scales: np.ndarray, zero_points: Optional[np.ndarray], indices: np.ndarray,
            out: np.ndarray, bits: int) -> np.ndarray:
    _check(weight, scales, zero_points, indices, out, bits)
    flat = indices.reshape(-1)
    rows = weight[flat]                      # unpack only the rows asked for
    if bits == 4:
        rows = unpack_4bit(rows)
    elif bits == 2:
        rows = unpack_2bit(rows)
    dim = rows.shape[1]
    groups = 1 if scales.ndim == 1 else scales.shape[1]
    if dim % groups:
        raise ValueError(f"embedding: {groups} groups do not divide the embedding dim {dim}")
    values = rows.reshape(len(flat), groups, dim // groups).astype(np.float32)
    if zero_points is not None:
        values -= zero_points.reshape(-1, groups)[flat].astype(np.float32)[:, :, None]
    values *= scales.reshape(-1, groups)[flat].astype(np.float32)[:, :, None]
    return write(out, values.reshape(*indices.shape, dim))


def _check_dtype(dtype: Optional[int], out: np.ndarray) -> None:
    if dtype is not None and numpy_dtype(dtype) != out.dtype:
        raise TypeError(f"embedding: dtype {numpy_dtype(dtype)} does not match out's {out.dtype}")


def _register(bits: int, name: str) -> None:
    @register_kernel(f"quantized_decomposed::{name}.out")
    def lookup(weight, scales, zero_points, quant_min, quant_max, indices, out):
        return _lookup(weight, scales, zero_points, indices, out, bits)

    @register_kernel(f"quantized_decomposed::{name}.dtype_out")
    def lookup_dtype(weight, scales, zero_points, quant_min, quant_max, indices, dtype, out):
        _check_dtype(dtype, out)
        return _lookup(weight, scales, zero_points, indices, out, bits)

    lookup.__name__, lookup_dtype.__name__ = name, f"{name}_dtype"


for _bits, _name in ((8, "embedding_byte"), (4, "embedding_4bit"), (2, "embedding_2bit")):
    _register(_bits, _name)
