"""Grouped int8/int4 quantized kernels: numpy (always there, the reference) and numba (the `fast` extra).

Weights are `q[N, K]` integers (int4 values held one per int8), with one float scale and
an optional zero point per group of `group_size` consecutive columns of a row:
`w = (q - zero) * scale`. Activations are float32 rows `x[M, K]`; M = 1 is the decode
mat-vec, M > 1 the prefill mat-mat. The compiled kernels never build the float32 weight:
they accumulate `x . q` per group and scale the group's sum, so they agree with the numpy
reference to float32 rounding (relative 1e-5 of the row's magnitude), not bit for bit.

`BACKEND` says which implementation the public functions use: "numba" when numba imports
and EXECUPY_NUMBA is not 0, else "numpy". Both stay callable as `NUMPY[...]` / `NUMBA[...]`
so a test can compare them on the same inputs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

# ---------------------------------------------------------------------------- numpy reference


def _grouped(q: np.ndarray, scales: np.ndarray, zeros: Optional[np.ndarray], group_size: int,
             mins: Optional[np.ndarray] = None) -> np.ndarray:
    n, k = q.shape
    groups = q.reshape(n, k // group_size, group_size).astype(np.float32)
    if zeros is not None:
        groups = groups - zeros.reshape(n, -1, 1).astype(np.float32)
    groups = groups * scales.reshape(n, -1, 1).astype(np.float32)
    return groups if mins is None else groups + mins.reshape(n, -1, 1).astype(np.float32)


def qmatmul_numpy(x: np.ndarray, q: np.ndarray, scales: np.ndarray, zeros: Optional[np.ndarray],
                  group_size: int, mins: Optional[np.ndarray] = None) -> np.ndarray:
    """x[M, K] @ w[N, K].T with w = (q - zeros) * scales (+ mins) per group, in float32."""
    w = _grouped(q, scales, zeros, group_size, mins).reshape(q.shape)
    return np.asarray(x, np.float32) @ w.T


def quantize_per_token_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Dynamic asymmetric int8 per row, as `choose_qparams_per_token_asymmetric` then
    `quantize_per_token` compute it (the registered kernels themselves); returns
    (q int8[M, K], scale float32[M], zero point int64[M])."""
    from ..quantized.quant import choose_qparams_per_token_asymmetric, quantize_per_token

    x = np.asarray(x, np.float32)
    scale, zero = np.empty((x.shape[0], 1), np.float32), np.empty((x.shape[0], 1), np.int64)
    choose_qparams_per_token_asymmetric(x, 1, scale, zero)
    q = quantize_per_token(x, scale, zero, -128, 127, 1, np.empty(x.shape, np.int8))
    return q, scale.reshape(-1), zero.reshape(-1)


def embedding_numpy(q: np.ndarray, scales: np.ndarray, zeros: Optional[np.ndarray], group_size: int,
                    ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of the dequantized table, float32."""
    rows = np.asarray(ids, np.int64).reshape(-1)
    z = None if zeros is None else zeros.reshape(q.shape[0], -1)[rows]
    return _grouped(q[rows], scales.reshape(q.shape[0], -1)[rows], z, group_size).reshape(len(rows), q.shape[1])


def group_offsets(scales: np.ndarray, zeros: Optional[np.ndarray], mins: Optional[np.ndarray]) -> np.ndarray:
    """Per group, what w = (q - zero) * scale + min adds to q * scale: min - zero * scale."""
    offsets = np.zeros(scales.shape, np.float32)
    if zeros is not None:
        offsets -= zeros.reshape(scales.shape).astype(np.float32) * scales
    if mins is not None:
        offsets += mins.reshape(scales.shape).astype(np.float32)
    return offsets


# Below this much work a second thread costs more to wake than it saves (measured on 2 shared
# cores: bench/README.md); prefill-sized products use every numba thread.
PARALLEL_MIN_MACS = int(os.environ.get("EXECUPY_PARALLEL_MIN_MACS", 8_000_000))

@dataclass
class PackedWeight:
    """A grouped quantized weight laid out once, at load, for `qlinear`: w = q * scale + offset."""

    q: np.ndarray  # int8 [N, K], contiguous
    scales: np.ndarray  # float32 [N, K / group_size]
    offsets: np.ndarray  # float32 [N, K / group_size]: min - zero * scale
    group_size: int


def pack(q: np.ndarray, scales: np.ndarray, zeros: Optional[np.ndarray], group_size: int,
         mins: Optional[np.ndarray] = None) -> PackedWeight:
    n = q.shape[0]
    s = np.ascontiguousarray(scales.reshape(n, -1), np.float32)
    return PackedWeight(np.ascontiguousarray(q), s, group_offsets(s, zeros, mins), group_size)


def qlinear_numpy(x: np.ndarray, w: PackedWeight) -> np.ndarray:
    """x[M, K] @ w.T, the weight dequantized in float32 for the call (numpy has no int8 x float32 product)."""
    n, k = w.q.shape
    groups = w.q.reshape(n, -1, w.group_size) * w.scales[:, :, None] + w.offsets[:, :, None]
    return np.asarray(x, np.float32) @ groups.reshape(n, k).T


NUMPY: dict[str, Callable] = {"qmatmul": qmatmul_numpy, "quantize_per_token": quantize_per_token_numpy,
                              "embedding": embedding_numpy, "qlinear": qlinear_numpy}

# ---------------------------------------------------------------------------- numba


def _compile() -> Optional[dict[str, Callable]]:
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(cache=True, fastmath=True)
    def _qmatmul_rows(x, xsum, q, scales, offsets, group_size, out, j0, j1):
        # w = q * s + o per group, o = mins - zeros * s: sum(x * w) = s * sum(x * q) + o * sum(x)
        m, k = x.shape
        for j in range(j0, j1):
            for r in range(m):
                total = np.float32(0)
                for g in range(k // group_size):
                    acc = np.float32(0)
                    for c in range(g * group_size, (g + 1) * group_size):
                        acc += x[r, c] * np.float32(q[j, c])
                    total += acc * scales[j, g] + offsets[j, g] * xsum[r, g]
                out[r, j] = total

    @numba.njit(parallel=True, cache=True)
    def _qmatmul_parallel(x, xsum, q, scales, offsets, group_size, out, chunks):
        n = q.shape[0]
        step = (n + chunks - 1) // chunks
        for t in numba.prange(chunks):
            _qmatmul_rows(x, xsum, q, scales, offsets, group_size, out, t * step, min(n, (t + 1) * step))

    @numba.njit(cache=True)
    def _quantize_per_token(x):
        m, k = x.shape
        q = np.empty((m, k), np.int8)
        scale = np.empty(m, np.float32)
        zero = np.empty(m, np.int64)
        eps = np.float32(np.finfo(np.float32).eps)
        for r in range(m):
            lo = np.float32(0)
            hi = np.float32(0)
            for c in range(k):
                lo = min(lo, x[r, c])
                hi = max(hi, x[r, c])
            s = max(np.float32((hi - lo) / np.float32(255)), eps)
            dmin, dmax = np.float32(lo / s), np.float32(hi / s)
            if (np.float32(-128) + dmin) + (np.float32(127) + dmax) > 0:
                z = np.float32(-128) - dmin
            else:
                z = np.float32(127) - dmax
            z = np.round(min(max(z, np.float32(-128)), np.float32(127)))
            scale[r] = s
            zero[r] = np.int64(z)
            inv = np.float32(1.0) / s
            for c in range(k):
                v = np.round(np.float32(x[r, c] * inv + np.float32(z)))
                q[r, c] = np.int8(min(max(v, np.float32(-128)), np.float32(127)))
        return q, scale, zero

    @numba.njit(cache=True)
    def _embedding(q, scales, zeros, group_size, rows):
        d = q.shape[1]
        out = np.empty((rows.shape[0], d), np.float32)
        for i in range(rows.shape[0]):
            row = rows[i]
            for c in range(d):
                g = c // group_size
                out[i, c] = (np.float32(q[row, c]) - np.float32(zeros[row, g])) * scales[row, g]
        return out

    def qlinear(x, w: PackedWeight):
        (n, k), m = w.q.shape, x.shape[0]
        x = np.ascontiguousarray(x, np.float32)
        xsum = x.reshape(m, k // w.group_size, w.group_size).sum(axis=-1, dtype=np.float32)
        out = np.empty((m, n), np.float32)
        if m * n * k >= PARALLEL_MIN_MACS and numba.get_num_threads() > 1:
            _qmatmul_parallel(x, xsum, w.q, w.scales, w.offsets, w.group_size, out, numba.get_num_threads())
        else:
            _qmatmul_rows(x, xsum, w.q, w.scales, w.offsets, w.group_size, out, 0, n)
        return out

    def qmatmul(x, q, scales, zeros, group_size, mins=None):
        return qlinear(x, pack(q, scales, zeros, group_size, mins))

    def quantize_per_token(x):
        return _quantize_per_token(np.ascontiguousarray(x, np.float32))

    def embedding(q, scales, zeros, group_size, ids):
        n = q.shape[0]
        s = scales.reshape(n, -1).astype(np.float32)
        z = np.zeros(s.shape, np.int32) if zeros is None else zeros.reshape(n, -1).astype(np.int32)
        return _embedding(q, s, z, group_size, np.asarray(ids, np.int64).reshape(-1))

    return {"qmatmul": qmatmul, "quantize_per_token": quantize_per_token, "embedding": embedding,
            "qlinear": qlinear}


NUMBA: Optional[dict[str, Callable]] = _compile() if os.environ.get("EXECUPY_NUMBA", "1") != "0" else None
BACKEND = "numba" if NUMBA is not None else "numpy"
_ACTIVE = NUMBA or NUMPY

qmatmul: Callable = _ACTIVE["qmatmul"]
quantize_per_token: Callable = _ACTIVE["quantize_per_token"]
embedding: Callable = _ACTIVE["embedding"]
qlinear: Callable = _ACTIVE["qlinear"]
