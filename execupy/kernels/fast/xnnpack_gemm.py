"""XNNPACK's dynamically quantized GEMMs, reproduced bit for bit: int8 activations with a
scale and zero point per row (qd8) times int8 / int4 weights with a scale per output
channel (qc8w, qc4w) or per block of input channels (qb4w, bf16 scales).

What XNNPACK computes, per row r and output channel c (read from its x86 VNNI microkernels,
which ExecuTorch 1.5.1 runs on a CPU with AVX512-VNNI or AVX-VNNI; there the activations
are stored unsigned, q + 128, with zero point zp + 128: "qdu8"):

* channelwise: acc = sum_k (q[r,k] - zp[r]) * w[c,k] in int32 (exact), then
  y = fma(float(acc) * x_scale[r], w_scale[c], bias[c]) in float32.
* blockwise (qb4w): the packed weights carry ksum[c] = -sum over chunks of 16 inputs of
  (sum of the chunk's w) * w_scale[c, block], summed in float32 in input order. Then
  v = ksum[c] * (zp[r] + 128); for each block b in order
  v = fma(float(sum_{k in b} (q[r,k] + 128) * w[c,k]), w_scale[c,b], v); then
  y = v * x_scale[r] + bias[c], each step rounded to float32.

Here w are the signed weights (stored 4-bit values minus their zero point 8). A fused
multiply-add is emulated in float64: the product of two float32 is exact there and only
the sum is rounded (twice, to float64 then float32; that can differ from one rounding only
when the float64 sum lands exactly on a float32 midpoint).

Two implementations: numpy (always there; the reference) and numba (the `fast` extra),
equal bit for bit (tests/kernels/test_xnnpack_gemm.py). `BACKEND` says which one the
public functions use.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

F32, F64 = np.float32, np.float64
KSUM_CHUNK = 16  # inputs per packed-weight chunk of XNNPACK's x86 qb4w kernels (kr = 8, two nibble planes)
UNSIGNED_OFFSET = 128  # qdu8: activations and zero points stored as uint8


@dataclass
class BlockwiseWeight:
    """A qb4w filter laid out once, at init: w int8 [N, K] (signed), scales float32 [N, K / block]
    (the bf16 values), ksum float32 [N] (as XNNPACK packs it)."""

    w: np.ndarray
    scales: np.ndarray
    ksum: np.ndarray
    block: int


def pack_blockwise(w: np.ndarray, scales: np.ndarray) -> BlockwiseWeight:
    n, k = w.shape
    block = k // scales.shape[1]
    w = np.ascontiguousarray(w, np.int8)
    scales = np.ascontiguousarray(scales, F32)
    chunk_sums = w.reshape(n, k // KSUM_CHUNK, KSUM_CHUNK).sum(axis=-1, dtype=np.int32).astype(F32)
    chunk_scales = np.repeat(scales, block // KSUM_CHUNK, axis=1)
    terms = chunk_sums * chunk_scales  # exact: a 8-bit integer times a bf16 value
    ksum = np.zeros(n, F32)
    for t in terms.T:  # float32, in input order, as the packing loop does
        ksum = ksum - t
    return BlockwiseWeight(w, scales, ksum, block)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return (a.astype(F64) * b.astype(F64) + c.astype(F64)).astype(F32)


# ---------------------------------------------------------------------------- numpy reference


def gemm_blockwise_numpy(q: np.ndarray, zp: np.ndarray, x_scale: np.ndarray, w: BlockwiseWeight,
                         bias: Optional[np.ndarray]) -> np.ndarray:
    """q int8 [M, K], zp int32 [M], x_scale float32 [M] -> float32 [M, N] (before the clamp)."""
    m, k = q.shape
    n, nb = w.w.shape[0], w.scales.shape[1]
    a = (q.astype(F32) + F32(UNSIGNED_OFFSET)).reshape(m, nb, w.block).transpose(1, 0, 2)
    wb = w.w.astype(F32).reshape(n, nb, w.block).transpose(1, 2, 0)
    acc = np.matmul(a, wb)  # [nb, M, N]: integers below 2**24, exact in float32 in any order
    v = w.ksum[None, :] * (zp.astype(F32) + F32(UNSIGNED_OFFSET))[:, None]
    for b in range(nb):
        v = _fma(acc[b], w.scales[None, :, b], v)
    v = v * x_scale.astype(F32)[:, None]
    return v if bias is None else v + bias.astype(F32)


def gemm_channelwise_numpy(q: np.ndarray, zp: np.ndarray, x_scale: np.ndarray, w: np.ndarray,
                           w_scale: np.ndarray, bias: Optional[np.ndarray]) -> np.ndarray:
    """q int8 [M, K] x w int8 [N, K] (signed) -> float32 [M, N]."""
    acc = np.matmul(q.astype(F64) - zp.astype(F64)[:, None], w.astype(F64).T)  # exact integers
    scaled = acc.astype(F32) * x_scale.astype(F32)[:, None]
    return _fma(scaled, w_scale.astype(F32)[None, :], np.zeros(1, F32) if bias is None else bias.astype(F32)[None, :])


NUMPY: dict[str, Callable] = {"blockwise": gemm_blockwise_numpy, "channelwise": gemm_channelwise_numpy}

# ---------------------------------------------------------------------------- numba


def _compile() -> Optional[dict[str, Callable]]:
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(parallel=True, cache=True)
    def _blockwise(a, zp, x_scale, w, scales, ksum, bias, block, out):
        m, k = a.shape
        n, nb = w.shape[0], scales.shape[1]
        for c in numba.prange(n):
            for r in range(m):
                v = np.float32(ksum[c] * np.float32(zp[r]))
                for b in range(nb):
                    acc = np.int32(0)
                    for i in range(b * block, (b + 1) * block):
                        acc += np.int32(a[r, i]) * np.int32(w[c, i])
                    v = np.float32(np.float64(v) + np.float64(acc) * np.float64(scales[c, b]))
                v = np.float32(v * x_scale[r])
                out[r, c] = np.float32(v + bias[c])

    @numba.njit(parallel=True, cache=True)
    def _channelwise(q, zp, x_scale, w, w_scale, bias, out):
        m, k = q.shape
        n = w.shape[0]
        for c in numba.prange(n):
            for r in range(m):
                acc = np.int32(0)
                for i in range(k):
                    acc += np.int32(q[r, i]) * np.int32(w[c, i])
                wsum = np.int32(0)
                for i in range(k):
                    wsum += np.int32(w[c, i])
                acc -= np.int32(zp[r]) * wsum
                scaled = np.float32(np.float32(acc) * x_scale[r])
                out[r, c] = np.float32(np.float64(scaled) * np.float64(w_scale[c]) + np.float64(bias[c]))

    def blockwise(q, zp, x_scale, w: BlockwiseWeight, bias):
        m, n = q.shape[0], w.w.shape[0]
        a = q.astype(np.int16) + np.int16(UNSIGNED_OFFSET)
        out = np.empty((m, n), F32)
        _blockwise(a, (zp.astype(np.int32) + UNSIGNED_OFFSET).astype(F32), x_scale.astype(F32), w.w, w.scales,
                   w.ksum, np.zeros(n, F32) if bias is None else bias.astype(F32), w.block, out)
        return out

    def channelwise(q, zp, x_scale, w, w_scale, bias):
        m, n = q.shape[0], w.shape[0]
        out = np.empty((m, n), F32)
        _channelwise(np.ascontiguousarray(q), zp.astype(np.int32), x_scale.astype(F32), np.ascontiguousarray(w, np.int8),
                     w_scale.astype(F32), np.zeros(n, F32) if bias is None else bias.astype(F32), out)
        return out

    return {"blockwise": blockwise, "channelwise": channelwise}


NUMBA: Optional[dict[str, Callable]] = _compile() if os.environ.get("EXECUPY_NUMBA", "1") != "0" else None
BACKEND = "numba" if NUMBA is not None else "numpy"
_ACTIVE = NUMBA or NUMPY

gemm_blockwise: Callable = _ACTIVE["blockwise"]
gemm_channelwise: Callable = _ACTIVE["channelwise"]
