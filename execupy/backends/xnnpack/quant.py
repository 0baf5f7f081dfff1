"""XNNPACK's quantization arithmetic, in numpy.

Static int8 (qint8/quint8 per tensor): quantize is round(x * (1/scale)) + zero_point,
rounded half to even and saturated, as XNNPACK's f32->qs8 converter does (it multiplies by
the float32 reciprocal of the scale, not divides). Dequantize is (q - zp) * scale in fp32.

Dynamic int8 (qdint8, one scale and zero point per row of the innermost dimension): see
quantize_rows in execupy/kernels/fast/xnnpack_gemm.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...kernels.fast import xnnpack_gemm as XG

F32 = np.float32
QRANGE = {"qint8": (-128, 127), "quint8": (0, 255), "qdint8": (-128, 127)}
STORAGE = {"qint8": np.int8, "quint8": np.uint8, "qdint8": np.int8}


@dataclass
class DynamicQuant:
    """A qdint8 value: int8 rows with a dequantization scale and zero point per row."""

    q: np.ndarray  # int8, the value's shape
    scale: np.ndarray  # float32, shape (*batch, 1 ... 1): broadcasts against q
    zero_point: np.ndarray  # int32, same shape as scale


def quantize(x: np.ndarray, scale: float, zero_point: int, datatype: str) -> np.ndarray:
    lo, hi = QRANGE[datatype]
    inv = F32(1.0) / F32(scale)
    q = np.rint(np.asarray(x, F32) * inv) + F32(zero_point)
    return np.clip(q, lo, hi).astype(STORAGE[datatype])


def dequantize(q: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    return (q.astype(F32) - F32(zero_point)) * F32(scale)


def quantize_dynamic(x: np.ndarray) -> DynamicQuant:
    """Per-row dynamic quantization (XNNPACK's qd8 convert). A row is the innermost
    dimension whatever the value's `num_nonbatch_dims` says: ExecuTorch 1.5.1's runtime gives
    each pixel of an NHWC conv input its own scale although the graph declares 3 non-batch
    dims (checked against its outputs in tests/test_xnnpack_nodes.py, dynamic_int8_conv).
    The arithmetic is in execupy/kernels/fast/xnnpack_gemm.py (quantize_rows)."""
    x = np.asarray(x, F32)
    rows = np.ascontiguousarray(x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1))
    q, scale, zp = XG.quantize_rows(rows)
    batch = x.shape[:-1] + (1,) if x.ndim else ()
    return DynamicQuant(q.reshape(x.shape), scale.reshape(batch), zp.reshape(batch))


def requantize(acc: np.ndarray, scale: np.ndarray, zero_point: int, datatype: str, lo: float, hi: float) -> np.ndarray:
    """int32 accumulators -> int8 with XNNPACK's fp32 requantization: float(acc) * scale
    (scale = input_scale * filter_scale / output_scale, computed in float32), rounded half
    to even, plus the zero point, saturated to the fused clamp's quantized bounds."""
    y = np.rint(acc.astype(F32) * scale) + F32(zero_point)
    return np.clip(y, lo, hi).astype(STORAGE[datatype])


def quantized_bounds(datatype: str, scale: float, zero_point: int, output_min: float, output_max: float):
    """The fused clamp [output_min, output_max] in the quantized domain (saturated)."""
    lo, hi = QRANGE[datatype]
    with np.errstate(over="ignore", invalid="ignore"):
        qlo = lo if not np.isfinite(output_min) else max(lo, min(hi, float(np.rint(output_min / scale) + zero_point)))
        qhi = hi if not np.isfinite(output_max) else max(lo, min(hi, float(np.rint(output_max / scale) + zero_point)))
    return qlo, qhi
