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


def fake_quantize_per_token_numpy(x: np.ndarray) -> np.ndarray:
    """x through 8da4w's dynamic int8 activations, float32 [M, K] -> float32 [M, K]: the
    registered choose_qparams_per_token_asymmetric / quantize_per_token / dequantize_per_token
    kernels in a row, with the float64 scales and int64 zero points the exported graph uses."""
    from ..quantized.quant import choose_qparams_per_token_asymmetric, dequantize_per_token, quantize_per_token

    x = np.asarray(x, np.float32)
    scale, zero = np.empty((x.shape[0], 1), np.float64), np.empty((x.shape[0], 1), np.int64)
    choose_qparams_per_token_asymmetric(x, 1, scale, zero)
    q = quantize_per_token(x, scale, zero, -128, 127, 1, np.empty(x.shape, np.int8))
    return dequantize_per_token(q, scale, zero, -128, 127, 1, 6, np.empty(x.shape, np.float32))


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


# From this many rows on, a call dequantizes the weight a slice at a time and hands each slice to
# BLAS (prefill); fewer rows read the integers directly (decode), which moves a quarter of the bytes.
BLAS_MIN_ROWS = 4
BLAS_SLICE_COLUMNS = 2048  # a [K, 2048] float32 slice stays in L2 for K = 576


@dataclass
class PackedWeight:
    """A grouped quantized weight laid out once, at load, for `qlinear`: w = q * scale + offset.

    Stored input-major (the transpose of the [N, K] weight): a decode step walks the K rows of
    `qt` once, and every output's running sum advances in the same SIMD lane, so no horizontal
    sums and no per-group reductions. 4-bit weights go two rows to a byte (`nibbles`): decode
    reads every weight byte once per token, so half the bytes is close to half the time."""

    qt: np.ndarray  # int8 [K, N]; with nibbles uint8 [K/2, N]: row 2i in the low half, 2i+1 in the high
    scales: np.ndarray  # float32 [K / group_size, N]
    offsets: np.ndarray  # float32 [K / group_size, N]: min - zero * scale (- shift * scale for nibbles)
    group_size: int
    k: int
    nibbles: bool

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), the shape of the weight it stands for."""
        return self.qt.shape[1], self.k


def pack(q: np.ndarray, scales: np.ndarray, zeros: Optional[np.ndarray], group_size: int,
         mins: Optional[np.ndarray] = None) -> PackedWeight:
    n = q.shape[0]
    q = q.reshape(n, -1)
    k = q.shape[1]
    s = np.ascontiguousarray(scales.reshape(n, -1), np.float32)
    offsets = group_offsets(s, zeros, mins)
    lo, hi = (int(q.min()), int(q.max())) if q.size else (0, 0)
    shift = 8 if -8 <= lo and hi <= 7 else 0 if 0 <= lo and hi <= 15 else None  # int4 or uint4 values
    if shift is None or group_size % 4:
        return PackedWeight(np.ascontiguousarray(q.T), np.ascontiguousarray(s.T), np.ascontiguousarray(offsets.T),
                            group_size, k, False)
    u = (q.T + np.int8(shift)).view(np.uint8)  # [K, N], values 0..15
    packed = u[0::2] | (u[1::2] << np.uint8(4))
    return PackedWeight(np.ascontiguousarray(packed), np.ascontiguousarray(s.T),
                        np.ascontiguousarray((offsets - np.float32(shift) * s).T), group_size, k, True)


def _integer_rows(w: PackedWeight, j0: int, j1: int) -> np.ndarray:
    """The stored integers of columns j0..j1, [K, j1 - j0]."""
    if not w.nibbles:
        return w.qt[:, j0:j1]
    rows = np.empty((w.k, j1 - j0), np.uint8)
    rows[0::2], rows[1::2] = w.qt[:, j0:j1] & np.uint8(15), w.qt[:, j0:j1] >> np.uint8(4)
    return rows


def dequantize_columns(w: PackedWeight, j0: int, j1: int) -> np.ndarray:
    """float32 [K, j1 - j0]: columns j0..j1 of the dequantized transposed weight (numpy)."""
    cols = j1 - j0
    groups = (_integer_rows(w, j0, j1).reshape(-1, w.group_size, cols) * w.scales[:, None, j0:j1]
              + w.offsets[:, None, j0:j1])
    return groups.reshape(w.k, cols)


def qlinear_numpy(x: np.ndarray, w: PackedWeight) -> np.ndarray:
    """x[M, K] @ w.T, the weight dequantized in float32 for the call (numpy has no int8 x float32 product)."""
    n, _ = w.shape
    return np.asarray(x, np.float32) @ dequantize_columns(w, 0, n)


NUMPY: dict[str, Callable] = {"qmatmul": qmatmul_numpy, "quantize_per_token": quantize_per_token_numpy,
                              "fake_quantize_per_token": fake_quantize_per_token_numpy,
                              "embedding": embedding_numpy, "qlinear": qlinear_numpy}

# ---------------------------------------------------------------------------- numba


def _compile() -> Optional[dict[str, Callable]]:
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(cache=True, fastmath=True)
    def _matvec(x, xsum, qt, scales, offsets, group_size, out):
        # out[r, j] = sum_g (s[g, j] * sum_{c in g} x[r, c] q[c, j] + o[g, j] * xsum[r, g]). The
        # innermost loops run over contiguous outputs through 1-D row views, which LLVM vectorises
        # (2-D indexing there kept it scalar, 10x slower); four input rows per pass quarter the
        # traffic on the running sums. Rows of x loop here, not in a jitted caller: numba never
        # finds a function that calls another closure's dispatcher in its on-disk cache, and
        # compiled it again in every process (0.5 s in the first call).
        k, n = qt.shape
        total = np.empty(n, np.float32)
        acc = np.empty(n, np.float32)
        for r in range(x.shape[0]):
            xr = x[r]
            total[:] = 0
            for g in range(k // group_size):
                acc[:] = 0
                c, end = g * group_size, (g + 1) * group_size
                while c + 4 <= end:
                    x0, x1, x2, x3 = xr[c], xr[c + 1], xr[c + 2], xr[c + 3]
                    r0, r1, r2, r3 = qt[c], qt[c + 1], qt[c + 2], qt[c + 3]
                    for j in range(n):
                        acc[j] += (x0 * np.float32(r0[j]) + x1 * np.float32(r1[j])
                                   + x2 * np.float32(r2[j]) + x3 * np.float32(r3[j]))
                    c += 4
                while c < end:
                    xc, r0 = xr[c], qt[c]
                    for j in range(n):
                        acc[j] += xc * np.float32(r0[j])
                    c += 1
                xs, sg, og = xsum[r, g], scales[g], offsets[g]
                for j in range(n):
                    total[j] += acc[j] * sg[j] + og[j] * xs
            out[r] = total

    @numba.njit(cache=True, fastmath=True)
    def _matvec_nibbles(x, xsum, qt, scales, offsets, group_size, out):
        # _matvec on two rows per byte: low half row 2i, high half row 2i + 1 (group_size % 4 == 0).
        n = qt.shape[1]
        total = np.empty(n, np.float32)
        acc = np.empty(n, np.float32)
        # The nibbles stay uint8 (explicit casts): numba would widen `byte >> 4` to int64,
        # and the loop would run at half the speed of the int8 layout instead of twice.
        low, four = np.uint8(15), np.uint8(4)
        for r in range(x.shape[0]):
            xr = x[r]
            total[:] = 0
            for g in range(qt.shape[0] * 2 // group_size):
                acc[:] = 0
                for b in range(g * group_size // 2, (g + 1) * group_size // 2, 2):
                    c = 2 * b
                    x0, x1, x2, x3 = xr[c], xr[c + 1], xr[c + 2], xr[c + 3]
                    r0, r1 = qt[b], qt[b + 1]
                    for j in range(n):
                        v0, v1 = r0[j], r1[j]
                        acc[j] += (x0 * np.float32(np.uint8(v0 & low)) + x1 * np.float32(np.uint8(v0 >> four))
                                   + x2 * np.float32(np.uint8(v1 & low)) + x3 * np.float32(np.uint8(v1 >> four)))
                xs, sg, og = xsum[r, g], scales[g], offsets[g]
                for j in range(n):
                    total[j] += acc[j] * sg[j] + og[j] * xs
            out[r] = total

    @numba.njit(cache=True, fastmath=True)
    def _dequantize_columns(qt, scales, offsets, group_size, j0, j1, dst):
        for c in range(qt.shape[0]):
            g = c // group_size
            q, sg, og, row = qt[c, j0:j1], scales[g, j0:j1], offsets[g, j0:j1], dst[c]
            for j in range(j1 - j0):
                row[j] = np.float32(q[j]) * sg[j] + og[j]

    @numba.njit(cache=True, fastmath=True)
    def _dequantize_nibble_columns(qt, scales, offsets, group_size, j0, j1, dst):
        low, four = np.uint8(15), np.uint8(4)
        for b in range(qt.shape[0]):
            g = 2 * b // group_size  # rows 2b and 2b + 1 share a group (group_size is even)
            q, sg, og, even, odd = qt[b, j0:j1], scales[g, j0:j1], offsets[g, j0:j1], dst[2 * b], dst[2 * b + 1]
            for j in range(j1 - j0):
                v = q[j]
                even[j] = np.float32(np.uint8(v & low)) * sg[j] + og[j]
                odd[j] = np.float32(np.uint8(v >> four)) * sg[j] + og[j]

    @numba.njit(cache=True)
    def _token_qparams(row):
        # choose_qparams_per_token_asymmetric's arithmetic for one row, in float32: (scale, zero point)
        eps = np.float32(np.finfo(np.float32).eps)
        lo = np.float32(0)
        hi = np.float32(0)
        for c in range(row.shape[0]):
            lo = min(lo, row[c])
            hi = max(hi, row[c])
        s = max(np.float32((hi - lo) / np.float32(255)), eps)
        dmin, dmax = np.float32(lo / s), np.float32(hi / s)
        if (np.float32(-128) + dmin) + (np.float32(127) + dmax) > 0:
            z = np.float32(-128) - dmin
        else:
            z = np.float32(127) - dmax
        return s, np.round(min(max(z, np.float32(-128)), np.float32(127)))

    @numba.njit(cache=True)
    def _quantize_per_token(x):
        m, k = x.shape
        q = np.empty((m, k), np.int8)
        scale = np.empty(m, np.float32)
        zero = np.empty(m, np.int64)
        for r in range(m):
            s, z = _token_qparams(x[r])
            scale[r] = s
            zero[r] = np.int64(z)
            inv = np.float32(1.0) / s
            for c in range(k):
                v = np.round(np.float32(x[r, c] * inv + np.float32(z)))
                q[r, c] = np.int8(min(max(v, np.float32(-128)), np.float32(127)))
        return q, scale, zero

    @numba.njit(cache=True)
    def _fake_quantize_per_token(x, out):
        # Step for step the numpy kernels' arithmetic: range and scale in float32, then the
        # quantize and dequantize in float64 (the graph's scales are float64), no fastmath.
        m, k = x.shape
        for r in range(m):
            s, z = _token_qparams(x[r])
            z64, s64 = np.float64(z), np.float64(s)
            inv = 1.0 / s64
            for c in range(k):
                v = min(max(np.round(np.float64(x[r, c]) * inv + z64), -128.0), 127.0)
                out[r, c] = np.float32((v - z64) * s64)

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
        (n, k), m = w.shape, x.shape[0]
        x = np.ascontiguousarray(x, np.float32)
        if m < BLAS_MIN_ROWS:  # decode: one pass over the integers (a second thread's wake-up costs more)
            out = np.empty((m, n), np.float32)
            xsum = x.reshape(m, k // w.group_size, w.group_size).sum(axis=-1, dtype=np.float32)
            matvec = _matvec_nibbles if w.nibbles else _matvec
            matvec(x, xsum, w.qt, w.scales, w.offsets, w.group_size, out)
            return out
        # prefill: dequantize a slice of columns, multiply it with BLAS (both cores), next slice
        out = np.empty((m, n), np.float32)
        scratch = np.empty((k, min(n, BLAS_SLICE_COLUMNS)), np.float32)
        for j0 in range(0, n, BLAS_SLICE_COLUMNS):
            j1 = min(n, j0 + BLAS_SLICE_COLUMNS)
            part = scratch[:, : j1 - j0]
            dequantize = _dequantize_nibble_columns if w.nibbles else _dequantize_columns
            dequantize(w.qt, w.scales, w.offsets, w.group_size, j0, j1, part)
            out[:, j0:j1] = x @ part  # into a fresh contiguous product: BLAS refuses a strided out
        return out

    def qmatmul(x, q, scales, zeros, group_size, mins=None):
        return qlinear(x, pack(q, scales, zeros, group_size, mins))

    def quantize_per_token(x):
        return _quantize_per_token(np.ascontiguousarray(x, np.float32))

    def fake_quantize_per_token(x):
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty(x.shape, np.float32)
        _fake_quantize_per_token(x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1]))
        return out

    def embedding(q, scales, zeros, group_size, ids):
        n = q.shape[0]
        s = scales.reshape(n, -1).astype(np.float32)
        z = np.zeros(s.shape, np.int32) if zeros is None else zeros.reshape(n, -1).astype(np.int32)
        return _embedding(q, s, z, group_size, np.asarray(ids, np.int64).reshape(-1))

    return {"qmatmul": qmatmul, "quantize_per_token": quantize_per_token, "embedding": embedding,
            "fake_quantize_per_token": fake_quantize_per_token,
            "qlinear": qlinear}


NUMBA: Optional[dict[str, Callable]] = _compile() if os.environ.get("EXECUPY_NUMBA", "1") != "0" else None
BACKEND = "numba" if NUMBA is not None else "numpy"
_ACTIVE = NUMBA or NUMPY

qmatmul: Callable = _ACTIVE["qmatmul"]
quantize_per_token: Callable = _ACTIVE["quantize_per_token"]
fake_quantize_per_token: Callable = _ACTIVE["fake_quantize_per_token"]
embedding: Callable = _ACTIVE["embedding"]
qlinear: Callable = _ACTIVE["qlinear"]
