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
from typing import Callable, Optional

import numpy as np

# ---------------------------------------------------------------------------- numpy reference


def _grouped(q: np.ndarray, scales: np.ndarray, zeros: Optional[np.ndarray], group_size: int) -> np.ndarray:
    n, k = q.shape
    groups = q.reshape(n, k // group_size, group_size).astype(np.float32)
    if zeros is not None:
        groups = groups - zeros.reshape(n, -1, 1).astype(np.float32)
    return groups * scales.reshape(n, -1, 1).astype(np.float32)


def qmatmul_numpy(x: np.ndarray, q: np.ndarray, scales: np.ndarray, zeros: Optional[np.ndarray],
                  group_size: int) -> np.ndarray:
    """x[M, K] @ dequantized(q)[N, K].T, one group of the weight at a time in float32."""
    w = _grouped(q, scales, zeros, group_size).reshape(q.shape)
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


# Below this much work a second thread costs more to wake than it saves (measured on 2 shared
# cores: bench/README.md); prefill-sized products use every numba thread.
PARALLEL_MIN_MACS = int(os.environ.get("EXECUPY_PARALLEL_MIN_MACS", 8_000_000))

NUMPY: dict[str, Callable] = {"qmatmul": qmatmul_numpy, "quantize_per_token": quantize_per_token_numpy,
                              "embedding": embedding_numpy}

# ---------------------------------------------------------------------------- numba


def _compile() -> Optional[dict[str, Callable]]:
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(cache=True, fastmath=True)
    def _qmatmul_rows(x, xsum, q, scales, zeros, group_size, out, j0, j1):
        m, k = x.shape
        for j in range(j0, j1):
            for r in range(m):
                total = np.float32(0)
                for g in range(k // group_size):
                    acc = np.float32(0)
                    for c in range(g * group_size, (g + 1) * group_size):
                        acc += x[r, c] * np.float32(q[j, c])
                    total += (acc - np.float32(zeros[j, g]) * xsum[r, g]) * scales[j, g]
                out[r, j] = total

    @numba.njit(parallel=True, cache=True)
    def _qmatmul_parallel(x, xsum, q, scales, zeros, group_size, out, chunks):
        n = q.shape[0]
        step = (n + chunks - 1) // chunks
        for t in numba.prange(chunks):
            _qmatmul_rows(x, xsum, q, scales, zeros, group_size, out, t * step, min(n, (t + 1) * step))

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

    def qmatmul(x, q, scales, zeros, group_size):
        (n, k), m = q.shape, x.shape[0]
        x = np.ascontiguousarray(x, np.float32)
        xsum = x.reshape(m, k // group_size, group_size).sum(axis=-1, dtype=np.float32)
        s = scales.reshape(n, -1).astype(np.float32, copy=False)
        z = np.zeros(s.shape, np.int32) if zeros is None else zeros.reshape(n, -1)
        out = np.empty((m, n), np.float32)
        if m * n * k >= PARALLEL_MIN_MACS and numba.get_num_threads() > 1:
            _qmatmul_parallel(x, xsum, q, s, z, group_size, out, numba.get_num_threads())
        else:
            _qmatmul_rows(x, xsum, q, s, z, group_size, out, 0, n)
        return out

    def quantize_per_token(x):
        return _quantize_per_token(np.ascontiguousarray(x, np.float32))

    def embedding(q, scales, zeros, group_size, ids):
        n = q.shape[0]
        s = scales.reshape(n, -1).astype(np.float32)
        z = np.zeros(s.shape, np.int32) if zeros is None else zeros.reshape(n, -1).astype(np.int32)
        return _embedding(q, s, z, group_size, np.asarray(ids, np.int64).reshape(-1))

    return {"qmatmul": qmatmul, "quantize_per_token": quantize_per_token, "embedding": embedding}


NUMBA: Optional[dict[str, Callable]] = _compile() if os.environ.get("EXECUPY_NUMBA", "1") != "0" else None
BACKEND = "numba" if NUMBA is not None else "numpy"
_ACTIVE = NUMBA or NUMPY

qmatmul: Callable = _ACTIVE["qmatmul"]
quantize_per_token: Callable = _ACTIVE["quantize_per_token"]
embedding: Callable = _ACTIVE["embedding"]
