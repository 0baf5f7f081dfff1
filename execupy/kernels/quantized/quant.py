"""quantized_decomposed:: quantize / dequantize / choose_qparams kernels.

Semantics follow torch's reference implementations in
`torch.ao.quantization.fx._decomposed` (the ops the exporter puts in the graph):

* per-tensor and per-channel quantize: q = clamp(round(x * (1 / scale)) + zero_point),
  rounding half to even (np.rint, like torch.round), the product taken in float32
  for float32 inputs, then cast to the quantized dtype;
* per-token quantize adds the zero point *before* rounding, as torch does;
* dequantize: (q - zero_point) * scale in the floating type of the scale;
* choose_qparams: torch's `determine_qparams` for affine per-tensor qparams, and its
  per-token asymmetric variant. (ExecuTorch's own choose_qparams kernel keeps the scale
  in double and nudges the zero point differently; results agree to within one step.)

ScalarType arguments arrive as ExecuTorch type codes (ints).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..registry import register_kernel
from ...schema.program import numpy_dtype
from ..portable._util import compute_dtype, is_float, write

# The float "quantized" types (float8) are not supported by these kernels.
_INT_QTYPES = {np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16, np.int32)}


def _qtype(code: int, quant_min: int, quant_max: int) -> np.dtype:
    """The quantized dtype for a ScalarType code, checking quant_min/max fit it."""
    dtype = numpy_dtype(code)
    if dtype not in _INT_QTYPES:
        raise TypeError(f"unsupported quantized dtype {dtype}")
    info = np.iinfo(dtype)
    if quant_min < info.min or quant_max > info.max or quant_min > quant_max:
        raise ValueError(f"quant range [{quant_min}, {quant_max}] does not fit {dtype}")
    return dtype


def _float_input(x: np.ndarray) -> np.ndarray:
    """Inputs to quantize are float32; half types are widened first (as torch does)."""
    if not is_float(x.dtype):
        raise TypeError(f"quantize expects a floating input, got {x.dtype}")
    dtype = compute_dtype(x.dtype)
    return x if x.dtype == dtype else x.astype(dtype)


def _scale_dtype(scales: np.ndarray) -> np.dtype:
    """Floating type products with `scales` are taken in (torch's tensor-tensor promotion)."""
    return compute_dtype(scales.dtype) if is_float(scales.dtype) else np.dtype(np.float32)


def _finish_quantize(rounded: np.ndarray, zero_point, quant_min: int, quant_max: int,
                     qdtype: np.dtype, out: np.ndarray) -> np.ndarray:
    # Add the zero point and clamp in float64 so that int32 bounds are exact.
    q = np.clip(rounded.astype(np.float64) + zero_point, quant_min, quant_max)
    if out.dtype != qdtype:
        raise TypeError(f"quantize: out has dtype {out.dtype}, expected {qdtype}")
    return write(out, q.astype(qdtype))


def _channel_view(v: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    """Reshape a per-channel vector so it broadcasts along `axis` of an ndim tensor."""
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


def _one(t: np.ndarray, what: str):
    if t.size != 1:
        raise ValueError(f"{what} must have exactly one element, got shape {t.shape}")
    return t.reshape(()).item()


def _out_float_dtype(out_dtype: Optional[int], out: np.ndarray) -> np.dtype:
    want = np.dtype(np.float32) if out_dtype is None else numpy_dtype(out_dtype)
    if out.dtype != want:
        raise TypeError(f"dequantize: out has dtype {out.dtype}, expected {want}")
    return want


# ------------------------------------------------------------------ per tensor


@register_kernel("quantized_decomposed::quantize_per_tensor.out")
def quantize_per_tensor(x: np.ndarray, scale: float, zero_point: int, quant_min: int, quant_max: int,
                        dtype: int, out: np.ndarray) -> np.ndarray:
    qdtype = _qtype(dtype, quant_min, quant_max)
    xs = _float_input(x)
    inv_scale = xs.dtype.type(1.0 / scale)  # torch multiplies by the reciprocal in the input's type
    with np.errstate(all="ignore"):
        return _finish_quantize(np.rint(xs * inv_scale), int(zero_point), quant_min, quant_max, qdtype, out)


@register_kernel("quantized_decomposed::quantize_per_tensor.Tensor_out")
def quantize_per_tensor_tensor(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, quant_min: int,
                               quant_max: int, dtype: int, out: np.ndarray) -> np.ndarray:
    return quantize_per_tensor(x, float(_one(scale, "scale")), int(_one(zero_point, "zero_point")),
                               quant_min, quant_max, dtype, out)


@register_kernel("quantized_decomposed::dequantize_per_tensor.out")
def dequantize_per_tensor(q: np.ndarray, scale: float, zero_point: int, quant_min: int, quant_max: int,
                          dtype: int, out_dtype: Optional[int] = None, out: np.ndarray = None) -> np.ndarray:
    if q.dtype != numpy_dtype(dtype):
        raise TypeError(f"dequantize: input has dtype {q.dtype}, expected {numpy_dtype(dtype)}")
    calc = compute_dtype(_out_float_dtype(out_dtype, out))
    return write(out, (q.astype(calc) - calc.type(zero_point)) * calc.type(scale))


@register_kernel("quantized_decomposed::dequantize_per_tensor.Tensor_out")
def dequantize_per_tensor_tensor(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, quant_min: int,
                                 quant_max: int, dtype: int, out_dtype: Optional[int] = None,
                                 out: np.ndarray = None) -> np.ndarray:
    return dequantize_per_tensor(q, float(_one(scale, "scale")), int(_one(zero_point, "zero_point")),
                                 quant_min, quant_max, dtype, out_dtype, out)


# ------------------------------------------------------------------ per channel


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise IndexError(f"axis {axis} out of range for a tensor of rank {ndim}")
    return axis % ndim



@register_kernel("quantized_decomposed::quantize_per_channel.out")
def quantize_per_channel(x: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, axis: int, quant_min: int,
                         quant_max: int, dtype: int, out: np.ndarray) -> np.ndarray:
    qdtype = _qtype(dtype, quant_min, quant_max)
    xs = _float_input(x)
    axis = _axis(axis, xs.ndim)
    calc = np.dtype(np.float64) if _scale_dtype(scales) == np.float64 else xs.dtype
    with np.errstate(all="ignore"):
        inv = _channel_view(1.0 / scales.astype(calc), xs.ndim, axis)
        rounded = np.rint(xs.astype(calc, copy=False) * inv)
        zp = _channel_view(zero_points, xs.ndim, axis)
        return _finish_quantize(rounded, zp, quant_min, quant_max, qdtype, out)


@register_kernel("quantized_decomposed::dequantize_per_channel.out")
def dequantize_per_channel(q: np.ndarray, scales: np.ndarray, zero_points: Optional[np.ndarray], axis: int,
                           quant_min: int, quant_max: int, dtype: int, out_dtype: Optional[int] = None,
                           out: np.ndarray = None) -> np.ndarray:
    if q.dtype != numpy_dtype(dtype):
        raise TypeError(f"dequantize: input has dtype {q.dtype}, expected {numpy_dtype(dtype)}")
    _out_float_dtype(out_dtype, out)
    axis = _axis(axis, q.ndim)
    if scales.size != q.shape[axis]:
        raise ValueError(f"dequantize_per_channel: {scales.size} scales for {q.shape[axis]} channels")
    calc = _scale_dtype(scales)
    per_channel = _channel_view(scales.astype(calc, copy=False), q.ndim, axis)
    if zero_points is None:  # a weight-only LLM weight: skip the int64 detour (same values, 1/3 the memory traffic)
        return write(out, q.astype(calc) * per_channel)
    values = q.astype(np.int64) - _channel_view(zero_points.astype(np.int64), q.ndim, axis)
    return write(out, values.astype(calc) * per_channel)


# ------------------------------------------------------------------ choose_qparams


@register_kernel("quantized_decomposed::choose_qparams.Tensor_out")
def choose_qparams(x: np.ndarray, quant_min: int, quant_max: int, eps: float, dtype: int,
                   scale_out: np.ndarray, zero_point_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Affine per-tensor qparams from the input's range widened to include 0 (torch's determine_qparams)."""
    _qtype(dtype, quant_min, quant_max)
    if quant_min >= quant_max:
        raise ValueError(f"quant_min {quant_min} must be below quant_max {quant_max}")
    xs = _float_input(x)
    f32 = np.float32
    if xs.size == 0:  # torch's answer for an empty observer range
        return write(scale_out, np.ones(1)), write(zero_point_out, np.zeros(1, np.int64))
    lo, hi = f32(min(np.min(xs), 0)), f32(max(np.max(xs), 0))
    scale = np.maximum(f32(hi - lo) / f32(quant_max - quant_min), f32(eps))
    zero_point = quant_min - int(np.rint(lo / scale))
    zero_point = min(max(zero_point, quant_min), quant_max)
    return (write(scale_out, np.full(1, scale, np.float64)),
            write(zero_point_out, np.full(1, zero_point, np.int64)))


@register_kernel("quantized_decomposed::choose_qparams_per_token_asymmetric.out")
def choose_qparams_per_token_asymmetric(x: np.ndarray, dtype: int, scale_out: np.ndarray,
                                        zero_point_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (last dim) asymmetric int8 qparams, XNNPACK style as in torch's reference."""
    qmin, qmax = -128, 127  # torch's reference fixes the int8 range whatever `dtype` says
    xs = _float_input(x)
    f = xs.dtype.type
    with np.errstate(all="ignore"):
        lo = np.minimum(np.min(xs, axis=-1, keepdims=True), f(0))
        hi = np.maximum(np.max(xs, axis=-1, keepdims=True), f(0))
        scale = np.maximum((hi - lo) / f(qmax - qmin), f(np.finfo(np.float32).eps))
        descaled_min, descaled_max = lo / scale, hi / scale
        # Derive the zero point from the end with the smaller error, then round it.
        use_min = (qmin + descaled_min) + (qmax + descaled_max) > 0
        zero_point = np.where(use_min, qmin - descaled_min, qmax - descaled_max)
        zero_point = np.rint(np.clip(zero_point, qmin, qmax))
    return write(scale_out, scale.astype(np.float64)), write(zero_point_out, zero_point.astype(np.int64))


# ------------------------------------------------------------------ per token


def _token_view(v: np.ndarray, x: np.ndarray, what: str) -> np.ndarray:
    tokens = int(np.prod(x.shape[:-1]))
    if v.size != tokens:
        raise ValueError(f"per-token {what}: {v.size} values for {tokens} tokens")
    return v.reshape(x.shape[:-1] + (1,))


@register_kernel("quantized_decomposed::quantize_per_token.out")
def quantize_per_token(x: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, quant_min: int,
                       quant_max: int, dtype: int, out: np.ndarray) -> np.ndarray:
    qdtype = _qtype(dtype, quant_min, quant_max)
    xs = _float_input(x)
    calc = np.dtype(np.float64) if _scale_dtype(scales) == np.float64 else xs.dtype
    with np.errstate(all="ignore"):
        inv = 1.0 / _token_view(scales, xs, "scales").astype(calc)
        # torch adds the zero point before rounding here (per-tensor rounds first).
        shifted = xs.astype(calc, copy=False) * inv + _token_view(zero_points, xs, "zero_points").astype(calc)
        q = np.clip(np.rint(shifted), quant_min, quant_max)
    if out.dtype != qdtype:
        raise TypeError(f"quantize: out has dtype {out.dtype}, expected {qdtype}")
    return write(out, q.astype(qdtype))


@register_kernel("quantized_decomposed::dequantize_per_token.out")
def dequantize_per_token(q: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, quant_min: int,
                         quant_max: int, dtype: int, output_dtype: int, out: np.ndarray) -> np.ndarray:
    _out_float_dtype(output_dtype, out)
    calc = _scale_dtype(scales)
    values = q.astype(np.int64) - _token_view(zero_points, q, "zero_points").astype(np.int64)
    return write(out, values.astype(calc) * _token_view(scales, q, "scales").astype(calc, copy=False))


@register_kernel("quantized_decomposed::dequantize_per_channel_group.out")
def dequantize_per_channel_group(q: np.ndarray, scales: np.ndarray, zero_points: Optional[np.ndarray],
                                 quant_min: int, quant_max: int, dtype: int, group_size: int, output_dtype: int,
                                 out: np.ndarray) -> np.ndarray:
    """2-D weights, each row split into groups of `group_size` columns with their own scale."""
    _out_float_dtype(output_dtype, out)
    if q.ndim != 2:
        raise ValueError(f"dequantize_per_channel_group expects a 2-D input, got shape {q.shape}")
    if group_size > q.shape[-1] and scales.shape[-1] == 1:
        group_size = q.shape[-1]
    if group_size <= 1 or q.shape[-1] % group_size:
        raise ValueError(f"group_size {group_size} does not divide {q.shape[-1]} columns")
    calc = _scale_dtype(scales)
    grouped = q.reshape(-1, group_size).astype(np.int64)
    if scales.size != grouped.shape[0]:
        raise ValueError(f"dequantize_per_channel_group: {scales.size} scales for {grouped.shape[0]} groups")
    if zero_points is not None:
        grouped = grouped - zero_points.reshape(-1, 1).astype(np.int64)
    values = grouped.astype(calc) * scales.reshape(-1, 1).astype(calc, copy=False)
    return write(out, values.reshape(q.shape))
