"""XNNPACK's quantization arithmetic, in numpy.

Static int8 (qint8/quint8 per tensor): quantize is round(x * (1/scale)) + zero_point,
rounded half to even and saturated, as XNNPACK's f32->qs8 converter does (it multiplies by
the float32 reciprocal of the scale, not divides). Dequantize is (q - zp) * scale in fp32.

Dynamic int8 (qdint8, one scale and zero point per row of the innermost dimension): see
quantize_rows in execupy/kernels/fast/xnnpack_gemm.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ...kernels.fast import quantized
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


def quantize_clamped(x: np.ndarray, lo: float, hi: float, scale: float, zero_point: int, datatype: str) -> np.ndarray:
    """quantize(np.clip(x, lo, hi)) (no clip where both bounds are infinite): a node's float
    result stored as its 8-bit output, in one compiled pass where numba is."""
    clamp = lo != -np.inf or hi != np.inf
    x = np.asarray(x, F32)
    if _COMPILED is None or x.size < COMPILED_MIN_SIZE:
        return quantize(np.clip(x, F32(lo), F32(hi)) if clamp else x, scale, zero_point, datatype)
    out = np.empty(x.shape, STORAGE[datatype])
    qlo, qhi = QRANGE[datatype]
    _COMPILED.quantize_into(_flat(x), clamp, F32(lo), F32(hi), F32(1.0) / F32(scale), F32(zero_point),
                            F32(qlo), F32(qhi), out.reshape(-1))
    return out


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


ADD, SUBTRACT, MULTIPLY = 0, 1, 2  # element-wise ops of binary_quantized (quant_jit.binary_into's `op`)


def _flat(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1)


def binary_quantized(op: int, a_params: tuple[int, float], b_params: tuple[int, float], lo: float, hi: float,
                     out_value) -> Optional[Callable[[np.ndarray, np.ndarray], Optional[np.ndarray]]]:
    """(qa, qb) -> the 8-bit result of dequantize(qa) `op` dequantize(qb), clamped to [lo, hi]
    and quantized as `out_value` (a graph Value) says: the loaders' and storer's float32 steps
    in one compiled pass. The function returns None where the two shapes differ (broadcasting)
    or the tensors are small, and is itself None where numba is missing: the caller then takes
    the numpy steps, which give the same bits. a_params, b_params: (zero point, scale) of each input."""
    if _COMPILED is None:
        return None
    (a_zero, a_scale), (b_zero, b_scale) = a_params, b_params
    dtype, clamp = out_value.datatype, lo != -np.inf or hi != np.inf
    qlo, qhi = QRANGE[dtype]
    a_args, b_args = (F32(a_zero), F32(a_scale)), (F32(b_zero), F32(b_scale))
    out_args = (clamp, F32(lo), F32(hi), F32(1.0) / F32(out_value.quant.scale[0]), F32(out_value.quant.zero_point),
                F32(qlo), F32(qhi))

    def run(qa: np.ndarray, qb: np.ndarray) -> Optional[np.ndarray]:
        if qa.shape != qb.shape or qa.size < COMPILED_MIN_SIZE:
            return None
        out = np.empty(qa.shape, STORAGE[dtype])
        _COMPILED.binary_into(op, _flat(qa), *a_args, _flat(qb), *b_args, *out_args, out.reshape(-1))
        return out

    return run


def mean_quantized(x_params: tuple[int, float], lo: float, hi: float,
                   out_value) -> Optional[Callable[[np.ndarray], Optional[np.ndarray]]]:
    """q [N, H, W, C] -> the 8-bit mean over H and W as [N, C]: dequantize(q) (x_params: its zero
    point and scale), numpy's float32 mean, clamped to [lo, hi] and quantized as `out_value` says,
    in one compiled pass (the same bits). The function returns None for a single channel (numpy
    then sums pairwise, not pixel after pixel); None where numba is missing."""
    if _COMPILED is None:
        return None
    x_zero, x_scale = x_params
    dtype, qlo, qhi = out_value.datatype, *QRANGE[out_value.datatype]
    out_args = (lo != -np.inf or hi != np.inf, F32(lo), F32(hi), F32(1.0) / F32(out_value.quant.scale[0]),
                F32(out_value.quant.zero_point), F32(qlo), F32(qhi))

    def run(q: np.ndarray) -> Optional[np.ndarray]:
        n, h, w, c = q.shape
        if c < 2:
            return None
        out = np.empty((n, c), STORAGE[dtype])
        _COMPILED.mean_into(np.ascontiguousarray(q).reshape(n, h * w, c), F32(x_zero), F32(x_scale), *out_args, out)
        return out

    return run


def _compile():
    if quantized.BACKEND != "numba":
        return None
    from . import quant_jit  # module level: numba's disk cache finds its kernels in the next process

    return quant_jit


_COMPILED = _compile()
# Below this many elements the numpy steps cost less than the compiled call's dispatch.
COMPILED_MIN_SIZE = 256
