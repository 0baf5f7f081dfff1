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

from .. import cores
from ..portable._util import same_view


# ---------------------------------------------------------------------------- numpy reference


def fake_quantize_per_token_numpy(x: np.ndarray) -> np.ndarray:
    """x through 8da4w's dynamic int8 activations, float32 [..., K] -> the same shape: the
    registered choose_qparams_per_token_asymmetric / quantize_per_token / dequantize_per_token
    kernels in a row, with the float64 scales and int64 zero points the exported graph uses."""
    from ..quantized.quant import choose_qparams_per_token_asymmetric, dequantize_per_token, quantize_per_token

    x = np.asarray(x, np.float32)
    tokens = x.shape[:-1]  # any leading shape (a prompt's [1, M, K] too): one scale per row
    scale, zero = np.empty((*tokens, 1), np.float64), np.empty((*tokens, 1), np.int64)
    choose_qparams_per_token_asymmetric(x, 1, scale, zero)
    q = quantize_per_token(x, scale, zero, -128, 127, 1, np.empty(x.shape, np.int8))
    return dequantize_per_token(q, scale, zero, -128, 127, 1, 6, np.empty(x.shape, np.float32))


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
# Of 128..2048 columns, 2048 was the fastest on SmolLM2's shapes at 64 and 113 rows (bench/quantized_kernels.py).
BLAS_SLICE_COLUMNS = 2048


# Output columns per panel of a 4-bit weight: a decode mat-vec keeps a panel's running sums in
# four 16-lane registers (xnnpack_gemm's qb4w weights use the same panels).
PANEL = 64


def panels(a: np.ndarray) -> np.ndarray:
    """[R, N] -> [ceil(N / PANEL), R, PANEL], contiguous, the columns past N zero."""
    rows, n = a.shape
    padded = np.zeros((rows, -(-n // PANEL) * PANEL), a.dtype)
    padded[:, :n] = a
    return np.ascontiguousarray(padded.reshape(rows, -1, PANEL).transpose(1, 0, 2))


def unpanel(a: np.ndarray, n: int) -> np.ndarray:
    """panels undone: [P, R, PANEL] -> [R, n]."""
    return a.transpose(1, 0, 2).reshape(a.shape[1], -1)[:, :n]


@dataclass
class PackedWeight:
    """A grouped quantized weight laid out once, at load, for `qlinear`: w = q * scale + offset.

    Stored input-major (the transpose of the [N, K] weight) and cut into panels of PANEL output
    columns, [N/64, rows, 64]: a decode step walks a panel's rows, one run of memory the mat-vec
    streams while the panel's 64 running sums stay in registers, every output's sum advancing in
    its own SIMD lane (no horizontal sums, no per-group reductions), and each of two threads
    takes whole panels (from memory, one thread, SmolLM2's 4-bit 1536x576 41 -> 29 us, 576x1536
    40 -> 31, 576x576 17 -> 14 against [K/8, N] rows, whose 2-4 KiB strides the prefetcher followed
    worse; its 8-bit weights 6.5 -> 12 G weights/s against four rows to an int32 word in [K/4, N],
    whose running sums went through memory). Scales and offsets are in the same panels.
    8-bit weights are int8 [P, K, PANEL], a row of a panel one cache line. 4-bit weights go eight
    rows to a 32-bit word, [P, K/8, PANEL]: decode reads every weight byte once per token, so half
    the bytes is close to half the time, and a word's rows come out with a shift and a mask in the
    lane that uses them (with two rows per byte, widening bytes to 32-bit lanes took a shuffle per
    16 weights; the words made a cold 576x576 mat-vec 2x faster)."""

    # bits 8: int8 [P, K, PANEL]; 4: uint32 [P, K/8, PANEL], row 8i + r in bits 4r..4r+3
    qt: np.ndarray
    scales: np.ndarray  # float32 panels [P, K / group_size, PANEL]
    offsets: np.ndarray  # float32, as scales: min - zero * scale (- shift * scale for nibbles)
    group_size: int
    k: int
    n: int
    bits: int
    serial_s: float = 0.0  # the last one-thread decode mat-vec on it, seconds (assumed until one); see kernels/cores.py

    def __post_init__(self) -> None:
        self.serial_s = self.serial_s or cores.assumed_serial_s(self.nbytes)
        # Read-only, all three, whether a view of the program's mapping or a copy: numba compiles
        # a read-only array's call apart and warm_up can load only the one form at load (a per-
        # channel int8 weight's scales stayed a view and its prompts loaded two kernels mid-call)
        for array in (self.qt, self.scales, self.offsets):
            array.flags.writeable = False

    @property
    def nibbles(self) -> bool:
        """4-bit rows, eight to a word."""
        return self.bits == 4

    @property
    def nbytes(self) -> int:
        """What a decode mat-vec reads: the integers, scales and offsets."""
        return self.qt.nbytes + self.scales.nbytes + self.offsets.nbytes

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K), the shape of the weight it stands for."""
        return self.n, self.k


def pack(q: np.ndarray, scales: np.ndarray, zeros: Optional[np.ndarray], group_size: int,
         mins: Optional[np.ndarray] = None) -> PackedWeight:
    """The weight q [N, K] (w = (q - zeros) * scales (+ mins) per group) laid out for `qlinear`;
    the first call in a process also warms the compiled kernels up (`warm_up`, `_warm_pair`)."""
    warm_up()
    return _warm_pair(_pack(q, scales, zeros, group_size, mins))


def _pack(q: np.ndarray, scales: np.ndarray, zeros: Optional[np.ndarray], group_size: int,
          mins: Optional[np.ndarray] = None) -> PackedWeight:
    n = q.shape[0]
    q = q.reshape(n, -1)
    k = q.shape[1]
    s = np.ascontiguousarray(scales.reshape(n, -1), np.float32)
    offsets = group_offsets(s, zeros, mins)
    shift = nibble_shift(q)
    if shift is None or group_size % 8:
        return PackedWeight(_byte_panels(q), panels(s.T), panels(offsets.T), group_size, k, n, 8)
    words = _nibble_words(q, shift)
    return PackedWeight(panels(words), panels(s.T), panels((offsets - np.float32(shift) * s).T), group_size, k, n, 4)


def nibble_shift(q: np.ndarray) -> Optional[int]:
    """What `pack` adds to q's values to store them as 4-bit words: 8 for int4 (-8..7), 0 for
    uint4 (0..15); None for wider values, which it stores as bytes."""
    lo, hi = (int(q.min()), int(q.max())) if q.size else (0, 0)
    return 8 if -8 <= lo and hi <= 7 else 0 if 0 <= lo and hi <= 15 else None


def nibble_words(u: np.ndarray) -> np.ndarray:
    """uint8 [K, N] of values 0..15 (K a multiple of 8) -> uint32 [K/8, N], row 8i + r in bits 4r..4r+3."""
    k, n = u.shape
    pairs = u[0::2] | (u[1::2] << np.uint8(4))  # [K/2, N]: rows 2i (low) and 2i + 1 (high) in a byte
    words = np.zeros((k // 8, n), np.uint32)  # byte b of a word: pair 4i + b, so row 8i + r in bits 4r..4r+3
    for b in range(4):
        words |= pairs[b::4].astype(np.uint32) << np.uint32(8 * b)
    return words


def unpack_nibbles(words: np.ndarray) -> np.ndarray:
    """nibble_words undone: uint32 [K/8, N] -> uint8 [K, N]."""
    rows = np.empty((words.shape[0] * 8, words.shape[1]), np.uint8)
    for r in range(8):
        rows[r::8] = (words >> np.uint32(4 * r)) & np.uint32(15)
    return rows


def _nibble_words(q: np.ndarray, shift: int) -> np.ndarray:
    """nibble_words of q [N, K] + shift, compiled in one pass where numba is (the same words)."""
    if NUMBA is None:
        return nibble_words((q.T + np.int8(shift)).view(np.uint8))
    words = np.empty((q.shape[1] // 8, q.shape[0]), np.uint32)
    NUMBA["pack_nibbles"](np.ascontiguousarray(q, np.int8), np.int32(shift), words)
    return words


def _byte_panels(q: np.ndarray) -> np.ndarray:
    """int8 q [N, K] as panels of its transpose, [P, K, PANEL] (compiled in one pass where numba is)."""
    if NUMBA is None:
        return panels(np.ascontiguousarray(q.T, np.int8))
    qp = np.empty((-(-q.shape[0] // PANEL), q.shape[1], PANEL), np.int8)
    NUMBA["pack_byte_panels"](np.ascontiguousarray(q, np.int8), qp)
    return qp


_warm = {"done": False}


def warm_up() -> None:
    """Run every compiled kernel once on a tiny weight of each layout, at load (the runtime packs
    weights when it binds a method): numba reads its machine code from the disk cache and starts
    its worker threads now, not inside the first forward call (0.1 s the first time in a process)."""
    if NUMBA is None or _warm["done"]:
        return
    _warm["done"] = True
    for values in ((-128, 127), (0, 15)):  # 8-bit panels, 4-bit words
        q = np.full((64, 32), values[1], np.int8)
        w = _pack(q, np.ones((64, 1), np.float32), None, 32)
        for m in (1, BLAS_MIN_ROWS):
            NUMBA["qlinear"](np.ones((m, 32), np.float32), w)
        NUMBA["qlinear"](np.ones((1, 32), np.float32), w, threads=2)
    NUMBA["fake_quantize_per_token"](np.ones((1, 32), np.float32))
    # A quantized program's other decode steps are compiled too (fusion.py, kernels/llm/kv_cache.py)
    from . import decode_jit

    decode_jit.warm_up()


_warm_layouts: set[int] = set()


def _warm_pair(w: PackedWeight) -> PackedWeight:
    """The first weight of each layout a program packs runs the paired mat-vec (a layer's k and v,
    second_thread_jit.matvec_pair) once on a few of its columns, as `warm_up` does the other
    kernels: that layout's machine code read from numba's cache now (13-14 ms), not in the
    first generated token, and no layout the program lacks."""
    if NUMBA is None or w.bits in _warm_layouts:
        return w
    _warm_layouts.add(w.bits)
    few = min(8, w.shape[0])  # of the first panel
    part = PackedWeight(w.qt[:1], w.scales[:1], w.offsets[:1], w.group_size, w.k, few, w.bits)
    x, outs = np.zeros((1, w.k), np.float32), np.empty((2, 1, few), np.float32)
    pair = NUMBA["bind_matvec"](x, part, outs[0]).pair_with(NUMBA["bind_matvec"](x, part, outs[1]))
    if pair is not None:
        pair()
    return w


def _integer_rows(w: PackedWeight, j0: int, j1: int) -> np.ndarray:
    """The stored integers of columns j0..j1, [K, j1 - j0]."""
    rows = _panel_columns(w.qt, j0, j1)
    return unpack_nibbles(rows) if w.nibbles else rows


def _panel_columns(a: np.ndarray, j0: int, j1: int) -> np.ndarray:
    """Columns j0..j1 of panels [P, R, PANEL] as [R, j1 - j0]."""
    p0, p1 = j0 // PANEL, -(-j1 // PANEL)
    return unpanel(a[p0:p1], p1 * PANEL - p0 * PANEL)[:, j0 - p0 * PANEL:j1 - p0 * PANEL]


def dequantize_columns(w: PackedWeight, j0: int, j1: int) -> np.ndarray:
    """float32 [K, j1 - j0]: columns j0..j1 of the dequantized transposed weight (numpy)."""
    cols = j1 - j0
    scales, offsets = _panel_columns(w.scales, j0, j1), _panel_columns(w.offsets, j0, j1)
    groups = _integer_rows(w, j0, j1).reshape(-1, w.group_size, cols) * scales[:, None] + offsets[:, None]
    return groups.reshape(w.k, cols)


def qlinear_numpy(x: np.ndarray, w: PackedWeight) -> np.ndarray:
    """x[M, K] @ w.T, the weight dequantized in float32 for the call (numpy has no int8 x float32 product)."""
    n, _ = w.shape
    return np.asarray(x, np.float32) @ dequantize_columns(w, 0, n)


def qlinear_columns_numpy(x: np.ndarray, w: PackedWeight, j0: int, j1: int, out: np.ndarray) -> None:
    """out [M, j1 - j0] = (x @ w.T)[:, j0:j1] for a prompt's rows, a slice of columns at a time."""
    for s0 in range(j0, j1, BLAS_SLICE_COLUMNS):
        s1 = min(j1, s0 + BLAS_SLICE_COLUMNS)
        out[:, s0 - j0:s1 - j0] = x @ dequantize_columns(w, s0, s1)


NUMPY: dict[str, Callable] = {"fake_quantize_per_token": fake_quantize_per_token_numpy, "qlinear": qlinear_numpy,
                              "qlinear_columns": qlinear_columns_numpy}

# ---------------------------------------------------------------------------- numba

# From this many bytes of weight on a decode mat-vec may share its work (kernels/cores.py; a module
# global here so that a test can lower it for these kernels alone)
SHARE_MIN_BYTES = cores.SHARE_MIN_BYTES


def _compile() -> Optional[dict[str, Callable]]:
    try:
        from . import quantized_jit as K
        from . import second_thread_jit as ST
        from .second_thread import SECOND_THREAD
    except ImportError:
        return None
    assert K.PANEL == PANEL, "the compiled kernels' panels are PackedWeight's"

    def qlinear(x, w: PackedWeight, threads: Optional[int] = None):
        """`threads` (decode only) overrides the choice between one thread and all of them."""
        n, m = w.shape[0], x.shape[0]
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty((m, n), np.float32)
        if m < BLAS_MIN_ROWS:  # decode: one pass over the integers
            SECOND_THREAD.run(ST.matvec_halves, (x, w.qt, w.scales, w.offsets, w.group_size, w.bits, out),
                              w if w.nbytes >= SHARE_MIN_BYTES else None, threads)
            return out
        qlinear_columns(x, w, 0, n, out)
        return out

    def bind_matvec(x, w: PackedWeight, out) -> Callable[[], None]:
        """A decode step out = x @ w.T on arrays fixed at bind (x [1, K], out [1, N], C order):
        `qlinear`'s mat-vec with its arguments gathered once, and no result to copy."""
        n, k = w.shape
        args = (x, w.qt, w.scales, w.offsets, w.group_size, w.bits, out)
        run, kernel, site = SECOND_THREAD.run, ST.matvec_halves, w if w.nbytes >= SHARE_MIN_BYTES else None

        def matvec() -> None:
            run(kernel, args, site)

        if site is None:  # too small to split: it may run beside another such product of the same x
            matvec.pair_with = lambda other: _bind_pair(x, w, out, getattr(other, "matvec_of", None))
            matvec.matvec_of = (x, w, out)
        return matvec

    def _bind_pair(x, w: PackedWeight, out, other) -> Optional[Callable[[], None]]:
        """One step for this mat-vec and `other` (x, w2, out2) on the same x, the second on the
        second core (second_thread_jit.matvec_pair): an LLM's k and v projections."""
        if other is None or not same_view(other[0], x) or np.may_share_memory(out, other[2]):
            return None
        _, w2, out2 = other
        if (w2.group_size, w2.bits) != (w.group_size, w.bits):
            return None
        args = (x, w.qt, w.scales, w.offsets, w2.qt, w2.scales, w2.offsets, w.group_size, w.bits, out, out2)
        run, kernel = SECOND_THREAD.run, ST.matvec_pair
        site = cores.CallSite(cores.assumed_serial_s(w.nbytes + w2.nbytes))

        def matvec_pair() -> None:
            run(kernel, args, site)

        return matvec_pair

    def qlinear_columns(x, w: PackedWeight, j0: int, j1: int, out) -> None:
        """out [M, j1 - j0] = columns j0..j1 of a prompt's rows' product: dequantize a slice of
        columns, multiply it with BLAS, next slice. Two calls on distinct columns may run at once
        (the numba part releases the GIL)."""
        k = w.shape[1]
        scratch = np.empty((k, min(j1 - j0, BLAS_SLICE_COLUMNS)), np.float32)
        for s0 in range(j0, j1, BLAS_SLICE_COLUMNS):
            s1 = min(j1, s0 + BLAS_SLICE_COLUMNS)
            part = scratch[:, : s1 - s0]
            dequantize = K.dequantize_panels if w.nibbles else K.dequantize_byte_panels
            dequantize(w.qt, w.scales, w.offsets, w.group_size, s0, s1, part)
            out[:, s0 - j0:s1 - j0] = x @ part  # into a fresh contiguous product: BLAS refuses a strided out

    def fake_quantize_per_token(x):
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty(x.shape, np.float32)
        K.fake_quantize_per_token(x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1]))
        return out

    def bind_fake_quantize_per_token(x, out) -> Callable[[], None]:
        """fake_quantize_per_token from x into out, both float32 [..., K] in C order and fixed at bind."""
        rows, result, kernel = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1]), K.fake_quantize_per_token

        def fake_quantize() -> None:
            kernel(rows, result)

        return fake_quantize

    return {"fake_quantize_per_token": fake_quantize_per_token, "qlinear": qlinear, "qlinear_columns": qlinear_columns,
            "pack_nibbles": K.pack_nibbles, "pack_byte_panels": K.pack_byte_panels,
            "bind_matvec": bind_matvec, "bind_fake_quantize_per_token": bind_fake_quantize_per_token}


NUMBA: Optional[dict[str, Callable]] = _compile() if os.environ.get("EXECUPY_NUMBA", "1") != "0" else None
BACKEND = "numba" if NUMBA is not None else "numpy"
_ACTIVE = NUMBA or NUMPY

fake_quantize_per_token: Callable = _ACTIVE["fake_quantize_per_token"]
qlinear: Callable = _ACTIVE["qlinear"]
qlinear_columns: Callable = _ACTIVE["qlinear_columns"]
# The compiled decode mat-vec and activation quantization bound to fixed arrays (None without
# numba: the steps call qlinear and fake_quantize_per_token)
bind_matvec: Optional[Callable] = NUMBA["bind_matvec"] if NUMBA is not None else None
bind_fake_quantize_per_token: Optional[Callable] = NUMBA["bind_fake_quantize_per_token"] if NUMBA is not None else None
