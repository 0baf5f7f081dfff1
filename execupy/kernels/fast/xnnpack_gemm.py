"""XNNPACK's dynamically quantized GEMMs, reproduced bit for bit: int8 activations with a
scale and zero point per row (qd8) times int8 / int4 weights with a scale per output
channel (qc8w, qc4w) or per block of input channels (qb4w, bf16 scales).

What ExecuTorch 1.5.1's XNNPACK computes on x86, per row r and output channel c, from the
microkernels its gemm configs pick (XNNPACK 92a7ad50, src/configs/gemm-config.c; the Convert's
quantization, `quantize_rows`, is the same everywhere):

* channelwise (qc8w, qc4w), the same on every CPU with AVX2 (its VNNI kernels; without VNNI
  qd8-f32-qc8w avx2 and qdu8-f32-qc4w avx2-madd): acc = sum_k (q[r,k] - zp[r]) * w[c,k] in
  int32 (exact), then y = fma(float(acc) * x_scale[r], w_scale[c], bias[c]) in float32.
* blockwise (qb4w) depends on the CPU (`ARITHMETIC`, read from the host's flags). The packed
  weights carry ksum[c] = -sum over chunks of 16 inputs of (sum of the chunk's w) *
  w_scale[c, block], summed in float32 in input order (the same packing for both).
  - "vnni": a CPU with AVX512-VNNI runs the qdu8-f32-qb4w 16c8 kernels (activations stored
    unsigned, q + 128, zero point zp + 128; verified on an Intel CPU with AVX512-VNNI):
    v = ksum[c] * (zp[r] + 128); for each block b in order
    v = fma(float(sum_{k in b} (q[r,k] + 128) * w[c,k]), w_scale[c,b], v); then
    y = v * x_scale[r] + bias[c], each step rounded to float32.
  - "avx2": an x86 CPU with AVX2 + FMA but no AVX512-VNNI (AVX-VNNI alone included: there is
    no qdu8 qb4w kernel for it) runs the qd8-f32-qb4w 1x8c8 / 3x8c8 avx2 kernels (signed
    activations; verified on an AMD EPYC exposing AVX2 + FMA only). Each output keeps four
    partial sums, lane j holding the inputs k with (k mod 8) // 2 == j (vpmaddwd's pairs):
    v_0 = ksum[c] * zp[r], v_1 = v_2 = v_3 = 0 * zp[r]; for each block b in order
    v_j = fma(float(sum_{k in b, lane j} q[r,k] * w[c,k]), w_scale[c,b], v_j); then
    y = fma((v_0 + v_1) + (v_2 + v_3), x_scale[r], bias[c]).
  Both kernels keep the weights as w << 4 with the block scales divided by 16 (exact: a
  power of two), which changes no bit of the above. Elsewhere (no AVX2, not x86, flags
  unknown) "vnni" stands in; neither is verified there.

Here w are the signed weights (stored 4-bit values minus their zero point 8). A fused
multiply-add rounds once: `fma32` in numpy, the CPU's own in the compiled kernels (fma_jit).

Two implementations: numpy (always there; the reference) and numba (the `fast` extra),
equal bit for bit (tests/kernels/test_xnnpack_gemm.py), each with both qb4w arithmetics.
`BACKEND` says which one the public functions use.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .. import cores
from . import quantized

# Below this many multiply-adds a prompt's product runs on one thread: handing half of it to another
# thread (the second core's, with VNNI: the rows over, its half back) costs more than the half saves.
PARALLEL_MIN_MACS = int(os.environ.get("EXECUPY_PARALLEL_MIN_MACS", 8_000_000))

F32, F64 = np.float32, np.float64
KSUM_CHUNK = 16  # inputs per packed-weight chunk of XNNPACK's x86 qb4w kernels (kr = 8, two nibble planes)
UNSIGNED_OFFSET = 128  # qdu8: activations and zero points stored as uint8
# Inputs per float32 BLAS product in channelwise_sums_blas: 512 * 255 * 128 < 2**24.
BLAS_EXACT_INPUTS = 512
# From this many rows on the qd8 x qc8w product runs on BLAS (a prompt, an encoder's tokens): a
# numba kernel's worker threads left spinning after it slowed the BLAS products between (a BERT
# forward: 0.44 s with them, 0.05 s on one thread each); fewer rows keep the numba kernel.
CHANNELWISE_BLAS_MIN_ROWS = 8
TILE = 256  # output channels per weight tile of the many-row kernel without VNNI: a tile's block sums stay in L1
# Fewer rows than this (a decode step) take the mat-vec kernel, which reads the 4-bit words once per row;
# more (a prompt) run four rows at a time through vpdpbusd (blockwise_jit.blockwise_rows) where the CPU
# has AVX512-VNNI, else unpack a tile of weights once and run every row over it.
MATVEC_MAX_ROWS = 4
# A block's sum of (q + 128) * (w + 8) is at most 255 * 15 per input: below 2**24, exact in float32 in any order.
MAX_EXACT_BLOCK = (1 << 24) // (255 * 15)


def cpu_flags() -> Optional[frozenset]:
    """The host CPU's feature flags as /proc/cpuinfo spells them (avx2, avx512_vnni), else as
    LLVM does (avx512vnni), or None where neither can tell. The host's own: XNNPACK reads the
    CPU whatever target numba compiles for (NUMBA_CPU_NAME)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    try:
        from llvmlite import binding

        return frozenset(name for name, on in binding.get_host_cpu_features().items() if on)
    except (ImportError, RuntimeError):
        return None


def qb4w_arithmetic(flags: Optional[frozenset]) -> str:
    """Which qb4w arithmetic XNNPACK runs on a CPU with these flags (the module docstring): "vnni"
    where its hardware config sets avx512vnni (AVX-512 F, BW, DQ, VL and VNNI), "avx2" on an x86
    CPU with AVX2 and FMA otherwise; "vnni" stands in where the flags are unknown or neither."""
    if flags is None:
        return "vnni"
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags and flags & {"avx512_vnni", "avx512vnni"}:
        return "vnni"
    return "avx2" if {"avx2", "fma"} <= flags else "vnni"


# This CPU's qb4w arithmetic: the products below read it at each call (or bind), so a test
# may set it to the other one.
ARITHMETIC = qb4w_arithmetic(cpu_flags())
AVX2_LANES = 4  # partial sums per output in XNNPACK's AVX2 qb4w kernels: inputs (k mod 8) // 2 == j in lane j


PANEL = quantized.PANEL  # output columns per panel of a BlockwiseWeight (vnni_jit: four vector registers of int32)


@dataclass
class BlockwiseWeight:
    """A qb4w filter laid out once, at init, for the products below, in panels of PANEL output
    columns (N padded up to a multiple with zero weights): words uint32 [N/64, K/8, 64], each
    panel's stored 4-bit values (signed weight + 8), eight inputs to a word as the grouped 4-bit
    kernels keep them (`quantized.nibble_words`), so that a decode mat-vec streams each panel's
    rows from one run of memory (a [K/8, N] layout read at 12-15 GB/s from memory where a panel
    reads at 27); scales float32 [N/64, K / block, 64] (the bf16 values) and ksum float32 [N/64 *
    64] (as XNNPACK packs it); n the true number of outputs. `layout` "lanes": the same bytes of
    each panel rearranged for the "avx2" arithmetic's kernels (lanes_layout), as the packing
    functions lay them out where that is this CPU's arithmetic."""

    words: np.ndarray
    scales: np.ndarray
    ksum: np.ndarray
    block: int
    n: int
    layout: str = "rows"
    serial_s: float = 0.0  # the last one-thread mat-vec on it, seconds (assumed until one); see kernels/cores.py
    prompt: cores.PerRow = field(default_factory=cores.PerRow)  # its prompts' call site for the same rule

    def __post_init__(self) -> None:
        self.serial_s = self.serial_s or cores.assumed_serial_s(self.nbytes)

    @property
    def k(self) -> int:
        return self.words.shape[1] * 8

    @property
    def nbytes(self) -> int:
        """What a decode mat-vec reads: the words and the block scales."""
        return self.words.nbytes + self.scales.nbytes

    def words_as(self, layout: str) -> np.ndarray:
        """words in `layout` ("rows" or "lanes"): its own array, or a rearranged copy (a test
        that switches ARITHMETIC after packing)."""
        if layout == self.layout:
            return self.words
        return lanes_layout(self.words) if layout == "lanes" else rows_layout(self.words)

    def scales_as(self, layout: str) -> np.ndarray:
        """scales in `layout`, as words_as."""
        if layout == self.layout:
            return self.scales
        return lanes_scales(self.scales) if layout == "lanes" else rows_scales(self.scales)

    def column_words(self) -> np.ndarray:
        """words as uint32 [K/8, N] (one row of words per eight inputs)."""
        return quantized.unpanel(self.words_as("rows"), self.n)

    def column_scales(self) -> np.ndarray:
        """scales as float32 [K / block, N]."""
        return quantized.unpanel(self.scales_as("rows"), self.n)


# A panel's bytes as uint8 [P, 64 outputs, K/8 word rows, 4 bytes], the rows split in pairs
# (d, rho) and the outputs in registers of four (g, c), the registers in pairs (gg, gi): the "rows"
# layout orders them [P, d, rho, g, c, byte] (a word row of the panel, one output's word after
# another), the "lanes" layout [P, gg, d, gi, byte, c, rho] (avx2_jit: a pair of registers of four
# outputs, LANES_GROUP, read through the panel as one run, a cache line per double row).
LANES_GROUP = 2  # avx2_jit.GROUP (xnnpack_gemm_jit checks)
_LANES_ORDER = (0, 1, 4, 2, 6, 3, 5)  # from [P, gg, gi, c, d, rho, byte]


def _panel_words(by_output: np.ndarray, layout: str) -> np.ndarray:
    """uint32 [N', K/8] (N' a multiple of PANEL; each output's words in input order) -> words
    [N'/64, K/8, 64] in `layout`, in one copy."""
    rows = by_output.shape[1]
    b = np.ascontiguousarray(by_output).view(np.uint8).reshape(-1, PANEL // 4 // LANES_GROUP, LANES_GROUP, 4,
                                                                rows // 2, 2, 4)
    if layout == "rows":  # [P, d, rho, g, c, byte]
        ordered = b.reshape(-1, PANEL // 4, 4, rows // 2, 2, 4).transpose(0, 3, 4, 1, 2, 5)
    else:
        ordered = b.transpose(_LANES_ORDER)
    return np.ascontiguousarray(ordered).reshape(-1).view(np.uint32).reshape(-1, rows, PANEL)


def lanes_layout(words: np.ndarray) -> np.ndarray:
    """words uint32 [P, K/8, 64] in the "rows" layout -> the same bytes in the "lanes" layout."""
    p, rows, _ = words.shape
    by_output = words.transpose(0, 2, 1).reshape(p * PANEL, rows)
    return _panel_words(by_output, "lanes")


def rows_layout(words: np.ndarray) -> np.ndarray:
    """lanes_layout undone."""
    p, rows, _ = words.shape
    b = words.view(np.uint8).reshape(p, PANEL // 4 // LANES_GROUP, rows // 2, LANES_GROUP, 4, 4, 2)
    ordered = b.transpose(0, 2, 6, 1, 3, 5, 4)  # [P, d, rho, gg, gi, c, byte]
    return np.ascontiguousarray(ordered).reshape(-1).view(np.uint32).reshape(p, rows, PANEL)


def lanes_scales(scales: np.ndarray) -> np.ndarray:
    """scales float32 [P, blocks, 64] -> the lanes layout's: each pair of registers' eight outputs'
    scales of every block, one run, [P, 8 pairs, blocks, 8] (kept [P, blocks, 64] in shape)."""
    p, blocks, _ = scales.shape
    pairs = scales.reshape(p, blocks, -1, 4 * LANES_GROUP).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(pairs).reshape(p, blocks, PANEL)


def rows_scales(scales: np.ndarray) -> np.ndarray:
    """lanes_scales undone."""
    p, blocks, _ = scales.shape
    return np.ascontiguousarray(scales.reshape(p, -1, blocks, 4 * LANES_GROUP).transpose(0, 2, 1, 3)).reshape(
        p, blocks, PANEL)


def _panel_scales(scales: np.ndarray, layout: str) -> np.ndarray:
    """scales [N, K / block] -> float32 [N'/64, K / block, 64] in `layout`."""
    rows = quantized.panels(np.asarray(scales, F32).T)
    return lanes_scales(rows) if layout == "lanes" else rows


def packing_layout() -> str:
    """The layout this CPU's arithmetic reads."""
    return "lanes" if ARITHMETIC == "avx2" else "rows"


def pack_blockwise(w: np.ndarray, scales: np.ndarray) -> BlockwiseWeight:
    """w int8 [N, K] (signed, -8..7), scales [N, K / block]; the block a multiple of KSUM_CHUNK."""
    n, k = w.shape
    block = k // scales.shape[1]
    scales = np.asarray(scales, F32)
    chunk_sums = w.reshape(n, k // KSUM_CHUNK, KSUM_CHUNK).sum(axis=-1, dtype=np.int32).astype(F32)
    terms = chunk_sums * np.repeat(scales, block // KSUM_CHUNK, axis=1)  # exact: a small integer times a bf16
    ksum = np.zeros(n, F32)
    for t in terms.T:  # float32, in input order, as XNNPACK's packing loop adds them
        ksum = ksum - t
    padded = -(-n // PANEL) * PANEL
    stored = np.full((k, padded), 8, np.uint8)  # the padding's weights are 0, its scales 0
    stored[:, :n] = (np.asarray(w, np.int8).T + np.int8(8)).view(np.uint8)
    layout = packing_layout()
    return BlockwiseWeight(_panel_words(quantized.nibble_words(stored).T, layout), _panel_scales(scales, layout),
                           np.concatenate([ksum, np.zeros(padded - n, F32)]), block, n, layout=layout)


def pack_blockwise_stored(nibbles: np.ndarray, scales: np.ndarray) -> BlockwiseWeight:
    """pack_blockwise of a qb4w filter as XNNPACK stores it: nibbles uint8 [N, K/2], two values
    (the signed weight + 8) a byte, input 2i in the low nibble. Four such bytes are already one
    of BlockwiseWeight's words (input 8i + r in bits 4r..4r+3, little-endian), so the words are
    the bytes regrouped into panels, and the weights are never unpacked (an LLM's 200 filters
    took 0.6 s to unpack and pack again); the same arrays as pack_blockwise, bit for bit."""
    n, k = nibbles.shape[0], nibbles.shape[1] * 2
    block = k // scales.shape[1]
    scales = np.asarray(scales, F32)
    words = np.ascontiguousarray(nibbles).view("<u4")  # [N, K/8]
    pairs = (words & np.uint32(0x0F0F0F0F)) + ((words >> np.uint32(4)) & np.uint32(0x0F0F0F0F))  # bytes <= 30
    word_sums = (pairs * np.uint32(0x01010101)) >> np.uint32(24)  # the top byte sums the four: <= 120
    chunk_sums = (word_sums[:, 0::2] + word_sums[:, 1::2]).astype(np.int32) - 8 * KSUM_CHUNK  # signed weights
    terms = chunk_sums.astype(F32) * np.repeat(scales, block // KSUM_CHUNK, axis=1)
    # pack_blockwise's ksum - t, in input order: 0 - (t0 + t1 + ...), the sum accumulated left to
    # right in float32 (cumsum; rounding is symmetric, so subtracting each term gives these bits)
    ksum = F32(0) - np.cumsum(terms, axis=1, dtype=F32)[:, -1]
    padded = -(-n // PANEL) * PANEL
    panel_words = np.full((padded, k // 8), 0x88888888, np.uint32)  # the padding's weights are 0 (stored 8)
    panel_words[:n] = words
    layout = packing_layout()
    return BlockwiseWeight(_panel_words(panel_words, layout), _panel_scales(scales, layout),
                           np.concatenate([ksum, np.zeros(padded - n, F32)]), block, n, layout=layout)


def side_by_side(weights: list[BlockwiseWeight]) -> tuple[BlockwiseWeight, list[int]]:
    """Filters of the same inputs and block as one: their panels one after another (each already
    padded to whole panels), so that one product computes all their outputs; and where each one's
    outputs start. A panel's outputs depend on nothing else: each is what its own filter gives."""
    starts = list(np.cumsum([0] + [w.words.shape[0] * PANEL for w in weights[:-1]]))
    layout = weights[0].layout
    return BlockwiseWeight(np.concatenate([w.words_as(layout) for w in weights]),
                           np.concatenate([w.scales_as(layout) for w in weights]),
                           np.concatenate([w.ksum for w in weights]),
                           weights[0].block, sum(w.words.shape[0] for w in weights) * PANEL,
                           layout=layout), [int(s) for s in starts]


def _shared_site(w: BlockwiseWeight) -> Optional[BlockwiseWeight]:
    """w as its mat-vec's call site for kernels/cores.py's rule when it is big enough to share
    with the second core (quantized.SHARE_MIN_BYTES), else None: one thread."""
    return w if w.nbytes >= quantized.SHARE_MIN_BYTES else None


# A prompt product's one-thread time before it has one of its own: this many multiply-adds a
# second, below one core's (150-190 GMAC/s through vpdpbusd here). The rule would otherwise run
# each product's first call alone to time it, and a program's first prompt, the one a user
# waits for after loading, would run on one thread.
ASSUMED_MACS_PER_S = 1e11


def _prompt_site(site: cores.PerRow, rows: int, macs_per_row: int) -> cores.PerRow:
    """A prompt product's call site for kernels/cores.py's rule, held to `rows` rows' share."""
    if site.per_row_s == 0.0:
        site.per_row_s = macs_per_row / ASSUMED_MACS_PER_S
    site.rows = rows
    return site


def fma32(a, b, c) -> np.ndarray:
    """float32 a * b + c rounded once, as the CPU's vfmadd. The product of two float32 is exact
    in float64; their float64 sum s is rounded there, and rounding s again to float32 could
    differ from one rounding where s lands on a float32 midpoint. So s is first made round-to-odd
    (if inexact and its last bit even, one step toward the exact sum, whose error TwoSum gives):
    rounding that to float32 is the exact sum's single rounding (53 bits >= 24 + 2)."""
    p, c = np.asarray(a, F64) * np.asarray(b, F64), np.asarray(c, F64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        t = s - p
        error = (p - (s - t)) + (c - t)
        bits = np.asarray(s).view(np.int64)
        inexact_even = (error != 0) & ((bits & 1) == 0) & np.isfinite(s)
        toward = np.where((error > 0) == (s > 0), 1, -1)  # one step away from 0 or toward it
        return np.where(inexact_even, bits + toward, bits).view(F64).astype(F32)


# ---------------------------------------------------------------------------- numpy reference


def quantize_rows_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [M, K] -> (q int8 [M, K], dequantization scale float32 [M], zero point int32 [M]).
    Each row's range [min(0, rmin), max(0, rmax)] maps onto [-128, 127]; the zero point is
    taken from whichever end gives the smaller error, clamped and rounded to nearest even; a
    row of zeros gets scale 1; q = clamp(rint(x * inv_scale) + zp). This is XNNPACK's
    `xnn_f32_qd8_asymmetric_quantization_params` and its f32->int8 converter, step by step in
    float32 (the unsigned qdu8 form is the same numbers plus 128)."""
    rmin = np.minimum(F32(0), x.min(axis=-1))
    rmax = np.maximum(F32(0), x.max(axis=-1))
    same = rmin == rmax
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_scale = np.where(same, F32(1), F32(255) / np.where(same, F32(1), rmax - rmin)).astype(F32)
    rmin_scaled, rmax_scaled = rmin * inv_scale, rmax * inv_scale
    from_min = (F32(-128) + rmin_scaled) + (F32(127) + rmax_scaled) > 0
    zp = np.where(from_min, F32(-128) - rmin_scaled, F32(127) - rmax_scaled)
    zp = np.rint(np.clip(zp, -128, 127)).astype(np.int32)
    q = np.clip(np.rint(x * inv_scale[:, None]) + zp.astype(F32)[:, None], -128, 127).astype(np.int8)
    return q, (F32(1) / inv_scale).astype(F32), zp  # XNNPACK keeps 1 / inv_scale as the row's scale


def gemm_blockwise_numpy(q: np.ndarray, zp: np.ndarray, x_scale: np.ndarray, w: BlockwiseWeight,
                         bias: Optional[np.ndarray], arithmetic: Optional[str] = None) -> np.ndarray:
    """q int8 [M, K], zp int32 [M], x_scale float32 [M] -> float32 [M, N] (before the clamp), in
    `arithmetic` ("vnni" or "avx2"; this CPU's, ARITHMETIC, by default)."""
    if (arithmetic or ARITHMETIC) == "avx2":
        return _gemm_blockwise_avx2_numpy(q, zp, x_scale, w, bias)
    m, k = q.shape
    scales = w.column_scales()
    nb = scales.shape[0]
    a = (q.astype(F32) + F32(UNSIGNED_OFFSET)).reshape(m, nb, w.block).transpose(1, 0, 2)
    signed = quantized.unpack_nibbles(w.column_words()).astype(F32) - F32(8)  # [K, N]
    # [nb, M, N]: each block's sum is an integer below 2**24, exact in float32 in any order
    acc = np.matmul(a, signed.reshape(nb, w.block, w.n))
    v = w.ksum[None, :w.n] * (zp.astype(F32) + F32(UNSIGNED_OFFSET))[:, None]
    for b in range(nb):
        v = fma32(acc[b], scales[None, b], v)
    v = v * x_scale.astype(F32)[:, None]
    return v if bias is None else v + bias.astype(F32)


def _gemm_blockwise_avx2_numpy(q: np.ndarray, zp: np.ndarray, x_scale: np.ndarray, w: BlockwiseWeight,
                               bias: Optional[np.ndarray]) -> np.ndarray:
    """gemm_blockwise_numpy in the "avx2" arithmetic: each block's inputs regrouped by lane (input
    8i + t of the block in lane t // 2), so one matmul gives every lane's sums of q * w, [nb, 4,
    M, N]: integers at most 128 * 8 * block / 4 in size, exact in float32 in any order."""
    m, k = q.shape
    scales = w.column_scales()
    nb, block, lanes = scales.shape[0], w.block, AVX2_LANES
    per_lane = block // lanes
    a = q.astype(F32).reshape(m, nb, block // 8, lanes, 2).transpose(1, 3, 0, 2, 4).reshape(nb, lanes, m, per_lane)
    signed = quantized.unpack_nibbles(w.column_words()).astype(F32) - F32(8)  # [K, N]
    signed = signed.reshape(nb, block // 8, lanes, 2, w.n).transpose(0, 2, 1, 3, 4).reshape(nb, lanes, per_lane, w.n)
    acc = np.matmul(a, signed)
    zf = zp.astype(F32)[:, None]
    v = np.empty((lanes, m, w.n), F32)
    v[0] = w.ksum[None, :w.n] * zf
    v[1:] = F32(0) * zf  # -0.0 where zp < 0, as the kernel's 0 * zp
    for b in range(nb):
        v = fma32(acc[b], scales[None, b], v)
    y = (v[0] + v[1]) + (v[2] + v[3])
    return fma32(y, x_scale.astype(F32)[:, None], np.zeros(1, F32) if bias is None else bias.astype(F32)[None, :])


def gemm_channelwise_numpy(q: np.ndarray, zp: np.ndarray, x_scale: np.ndarray, w: np.ndarray,
                           w_scale: np.ndarray, bias: Optional[np.ndarray]) -> np.ndarray:
    """q int8 [M, K] x w int8 [N, K] (signed) -> float32 [M, N]."""
    acc = np.matmul(q.astype(F64) - zp.astype(F64)[:, None], w.astype(F64).T)  # exact integers
    scaled = acc.astype(F32) * x_scale.astype(F32)[:, None]
    return fma32(scaled, w_scale.astype(F32)[None, :], np.zeros(1, F32) if bias is None else bias.astype(F32)[None, :])


def channelwise_sums_blas(q: np.ndarray, zp: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The int32 sums sum_k (q[r,k] - zp[r]) * w[c,k], exact, from float32 BLAS products over runs
    of BLAS_EXACT_INPUTS inputs: a term is at most 255 * 128 in size, so any partial sum of such a
    run is an integer below 2**24, exact in float32 whatever order BLAS adds in. float32 [M, N]."""
    a = q.astype(F32) - zp.astype(F32)[:, None]
    k = q.shape[1]
    acc = None
    for i in range(0, k, BLAS_EXACT_INPUTS):
        part = a[:, i:i + BLAS_EXACT_INPUTS] @ w[:, i:i + BLAS_EXACT_INPUTS].astype(F32).T
        acc = part if acc is None else acc + part.astype(F64)  # the runs' total may pass 2**24
    return acc.astype(F32)


NUMPY: dict[str, Callable] = {"blockwise": gemm_blockwise_numpy, "channelwise": gemm_channelwise_numpy,
                              "quantize_rows": quantize_rows_numpy}

# ---------------------------------------------------------------------------- numba


def _compile() -> Optional[dict[str, Callable]]:
    try:
        import numba

        from . import xnnpack_gemm_jit as K
        from .second_thread import SECOND_THREAD
        from .vnni_jit import VNNI
    except ImportError:
        return None

    def quantize_rows(x):
        m = x.shape[0]
        q, scale, zero = np.empty(x.shape, np.int8), np.empty(m, F32), np.empty(m, np.int32)
        K.quantize_rows(np.ascontiguousarray(x, F32), q, scale, zero)
        return q, scale, zero

    def blockwise(q, zp, x_scale, w: BlockwiseWeight, bias):
        q, m = np.ascontiguousarray(q, np.int8), q.shape[0]
        out = np.empty((m, w.n), F32)
        bias = np.zeros(w.n, F32) if bias is None else np.ascontiguousarray(bias, F32)
        zp, x_scale = np.asarray(zp, np.int32), np.asarray(x_scale, F32)
        if m < MATVEC_MAX_ROWS:
            blockwise_matvec(q, zp, x_scale, w, bias, out)
            return out
        parallel = m * w.n * w.k >= PARALLEL_MIN_MACS
        threaded = parallel and numba.get_num_threads() > 1
        if ARITHMETIC == "avx2" and K.AVX2:  # AVX2's byte products, four rows per unpacking of the nibbles
            run = K.blockwise_rows_avx2_parallel if threaded else K.blockwise_rows_avx2
            run(q, zp, x_scale, w.words_as("lanes"), w.scales_as("lanes"), w.ksum, bias, w.block, out)
            return out
        if ARITHMETIC == "avx2":  # numba not compiling for AVX2: a tile of unpacked weights at a time
            run = K.blockwise_tiles_avx2_parallel if threaded else K.blockwise_tiles_avx2
            run(q.astype(np.int16), zp.astype(F32), x_scale, w.words_as("lanes"), w.scales_as("lanes"), w.ksum, bias,
                w.block, out)
            return out
        words, scales = w.words_as("rows"), w.scales_as("rows")
        if VNNI:  # four rows at a time through vpdpbusd, each word row unpacked once for them
            SECOND_THREAD.run(K.blockwise_rows_halves, (K.BLOCKWISE_SECOND_HALF.address, q, zp, x_scale, words,
                                                        scales, w.ksum, bias, w.block, out),
                              _prompt_site(w.prompt, m, w.n * w.k) if parallel else None)
            return out
        run = K.blockwise_tiles_parallel if threaded else K.blockwise_tiles
        a = q.astype(np.int16) + np.int16(UNSIGNED_OFFSET)
        run(a, zp.astype(F32) + F32(UNSIGNED_OFFSET), x_scale, words, scales, w.ksum, bias, w.block, out)
        return out

    def matvec_call(from_float: bool) -> tuple[Callable, tuple]:
        """The decode mat-vec's kernel in this CPU's arithmetic, and the arguments it takes before
        the product's own (the "avx2" one's second half: a C function, named by its address)."""
        if ARITHMETIC == "avx2":
            kernel = K.blockwise_matvec_from_float_avx2 if from_float else K.blockwise_matvec_avx2
            return kernel, (K.blockwise_avx2_second_half().address,)
        return (K.blockwise_matvec_from_float if from_float else K.blockwise_matvec), ()

    def blockwise_matvec(q, zp, x_scale, w: BlockwiseWeight, bias, out, threads: Optional[int] = None):
        """out float32 [M, N] for a few rows (M < MATVEC_MAX_ROWS): q int8 [M, K], zp int32 [M],
        x_scale float32 [M], bias float32 [N] (zeros for none). From SHARE_MIN_BYTES bytes of weight on,
        the second core's thread sums half of the blocks while the rule of kernels/cores.py says
        it is free; `threads` (1, 2) overrides the rule. One thread and two give the same bits."""
        kernel, first = matvec_call(False)
        layout = packing_layout()
        SECOND_THREAD.run(kernel, (*first, q, zp, x_scale, w.words_as(layout), w.scales_as(layout), w.ksum, bias,
                                   w.block, out),
                          _shared_site(w), threads)
        return out

    def blockwise_matvec_from_float(x, w: BlockwiseWeight, bias, out):
        """blockwise_matvec of quantize_rows(x) (x float32 [M, K], C order), in one compiled call."""
        kernel, first = matvec_call(True)
        layout = packing_layout()
        SECOND_THREAD.run(kernel, (*first, x, w.words_as(layout), w.scales_as(layout), w.ksum, bias, w.block, out),
                          _shared_site(w))
        return out

    def channelwise(q, zp, x_scale, w, w_scale, bias):
        m, n = q.shape[0], w.shape[0]
        out = np.empty((m, n), F32)
        bias = np.zeros(n, F32) if bias is None else bias.astype(F32)
        if m >= CHANNELWISE_BLAS_MIN_ROWS:
            K.scale_sums(channelwise_sums_blas(q, zp, w), x_scale.astype(F32), w_scale.astype(F32), bias, out)
            return out
        K.channelwise(np.ascontiguousarray(q), zp.astype(np.int32), x_scale.astype(F32), np.ascontiguousarray(w, np.int8),
                     w_scale.astype(F32), bias, out)
        return out

    return {"blockwise": blockwise, "blockwise_matvec": blockwise_matvec,
            "blockwise_matvec_from_float": blockwise_matvec_from_float, "channelwise": channelwise,
            "quantize_rows": quantize_rows, "vnni": VNNI, "matvec_call": matvec_call}


def bind_blockwise(w: BlockwiseWeight, bias: Optional[np.ndarray]) -> Callable[
        [np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """(q, zp, x_scale) -> the product with w (+ bias), bound once: a decode step calls a
    SmolLM2's 211 of them per token, each a mat-vec of a few microseconds."""
    if NUMBA is None:
        return lambda q, zp, x_scale: gemm_blockwise_numpy(q, zp, x_scale, w, bias)
    matvec, general = NUMBA["blockwise_matvec"], NUMBA["blockwise"]
    bias_or_zeros = np.zeros(w.n, F32) if bias is None else np.ascontiguousarray(bias, F32)

    def product(q: np.ndarray, zp: np.ndarray, x_scale: np.ndarray) -> np.ndarray:
        if q.shape[0] < MATVEC_MAX_ROWS:  # q int8, zp int32, x_scale float32 as quantize_rows makes them
            return matvec(q, zp, x_scale, w, bias_or_zeros, np.empty((q.shape[0], w.n), F32))
        return general(q, zp, x_scale, w, bias)

    return product


# Inputs up to which vpdpbusd's int32 sums of (q + 128) * w stay exact (255 * 128 a term at most).
MAX_VNNI_INPUTS = (1 << 31) // (255 * 128)


def channelwise_words(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w int8 [N, K] (signed) as vpdpbusd reads it: int32 [N/PANEL, K/4, PANEL], four consecutive
    inputs' weights of one output to a word (input 4r + t in byte t; N and K padded with zeros),
    and each output's sum of weights, int32 [N/PANEL * PANEL]."""
    n, k = w.shape
    padded = np.zeros((-(-n // PANEL) * PANEL, -(-k // 4) * 4), np.int8)
    padded[:n, :k] = w
    words = padded.view(np.int32)  # [N', K/4]: byte t of word r is input 4r + t (little-endian)
    return (np.ascontiguousarray(words.reshape(-1, PANEL, words.shape[1]).transpose(0, 2, 1)),
            padded.sum(axis=1, dtype=np.int32))


def bind_channelwise(w: np.ndarray, w_scale: np.ndarray, bias: Optional[np.ndarray], from_float: bool = False
                     ) -> Callable[..., np.ndarray]:
    """(q, zp, x_scale) -> gemm_channelwise with w int8 [N, K] (signed), bound once: with
    AVX512-VNNI the rows run through vpdpbusd on weights laid out for it here
    (xnnpack_gemm_jit.channelwise_rows; a single row too: 1 x 1280 x 1000 in 23 us on one core,
    where gemm_channelwise's loop took 200), from PARALLEL_MIN_MACS multiply-adds (or, for a
    few rows, a filter of cores.SHARE_MIN_BYTES) on both cores while kernels/cores.py's rule
    allows; other calls as gemm_channelwise. With `from_float`
    x float32 [M, K] -> the product of quantize_rows(x) (`quantizing`), those rows quantized
    straight into the products' layout (xnnpack_gemm_jit.channelwise_from_float)."""
    w_scale = np.ascontiguousarray(w_scale, F32)
    general = lambda q, zp, x_scale: gemm_channelwise(q, zp, x_scale, w, w_scale, bias)
    if NUMBA is None or not NUMBA["vnni"] or w.shape[1] > MAX_VNNI_INPUTS:
        return quantizing(general) if from_float else general
    from . import xnnpack_gemm_jit as K
    from .second_thread import SECOND_THREAD

    words, wsum = channelwise_words(w)
    n, k = w.shape
    bias_or_zeros = np.zeros(n, F32) if bias is None else np.ascontiguousarray(bias, F32)
    site = cores.PerRow()

    few_rows_share = n * k >= cores.SHARE_MIN_BYTES  # a mat-vec's rule: its filter's bytes

    def run(kernel, m: int, *inputs) -> np.ndarray:
        out = np.empty((m, n), F32)
        shared = m * n * k >= PARALLEL_MIN_MACS or (m < MATVEC_MAX_ROWS and few_rows_share)
        SECOND_THREAD.run(kernel, (K.CHANNELWISE_CHUNKS.address, SECOND_THREAD.job, *inputs, words, wsum, w_scale,
                                   bias_or_zeros, out),
                          _prompt_site(site, m, n * k) if shared else None)
        return out

    def product(q: np.ndarray, zp: np.ndarray, x_scale: np.ndarray) -> np.ndarray:
        return run(K.channelwise_rows, q.shape[0], np.ascontiguousarray(q, np.int8), np.asarray(zp, np.int32),
                   np.asarray(x_scale, F32))

    def product_from_float(x: np.ndarray) -> np.ndarray:
        return run(K.channelwise_from_float, x.shape[0], K.QUANTIZE_CHUNKS.address, np.ascontiguousarray(x, F32))

    return product_from_float if from_float else product


def quantizing(product: Callable) -> Callable[[np.ndarray], np.ndarray]:
    """x float32 [M, K] -> product(q, zero point, scale) of quantize_rows(x): a Convert to qdint8
    fused into the product that reads it."""
    def quantized_product(x: np.ndarray) -> np.ndarray:
        q, scale, zero_point = quantize_rows(x)
        return product(q, zero_point, scale)

    return quantized_product


def bind_blockwise_from_float(w: BlockwiseWeight, bias: Optional[np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """`quantizing(bind_blockwise(w, bias))`, where a decode step's few rows take one compiled call."""
    quantized_product = quantizing(bind_blockwise(w, bias))
    if NUMBA is None:
        return quantized_product
    _warm_up()
    matvec = NUMBA["blockwise_matvec_from_float"]
    bias_or_zeros = np.zeros(w.n, F32) if bias is None else np.ascontiguousarray(bias, F32)

    def from_float(x: np.ndarray) -> np.ndarray:
        if x.shape[0] < MATVEC_MAX_ROWS and x.dtype == F32 and x.flags.c_contiguous:
            return matvec(x, w, bias_or_zeros, np.empty((x.shape[0], w.n), F32))
        return quantized_product(x)

    return from_float


def bind_blockwise_from_float_into(w: BlockwiseWeight, bias: Optional[np.ndarray], x: np.ndarray,
                                   out: np.ndarray) -> Optional[Callable[[], None]]:
    """out = the product of x (quantized first) with w (+ bias) on arrays fixed now (a decode
    step's, x [..., K] and out [..., N] float32 in C order, a few rows): the compiled mat-vec
    with its arguments gathered once; None where numba is not loaded or the arrays do not fit."""
    if NUMBA is None or x.dtype != F32 or out.dtype != F32 or not (x.flags.c_contiguous and out.flags.c_contiguous):
        return None
    if x.ndim == 0 or x.shape[-1] != w.k or out.shape != x.shape[:-1] + (w.n,) or np.may_share_memory(x, out):
        return None
    rows = x.reshape(-1, w.k)
    if rows.shape[0] >= MATVEC_MAX_ROWS:
        return None
    from .second_thread import SECOND_THREAD

    bias_or_zeros = np.zeros(w.n, F32) if bias is None else np.ascontiguousarray(bias, F32)
    kernel, first = NUMBA["matvec_call"](True)  # this CPU's arithmetic
    layout = packing_layout()
    args = (*first, rows, w.words_as(layout), w.scales_as(layout), w.ksum, bias_or_zeros, w.block,
            out.reshape(-1, w.n))
    run = SECOND_THREAD.run
    site = _shared_site(w)
    return lambda: run(kernel, args, site)


_warmed: list[bool] = []


def _warm_up() -> None:
    """Once per process, at init: numba reads a kernel's machine code from its disk cache at its
    first call (7-8 ms each here), which would otherwise fall inside an LLM's first prompt (its
    quantizing and many-row kernels) or first generated token (the decode mat-vec), with the
    other compiled decode steps (decode_jit.warm_up)."""
    if _warmed:
        return
    _warmed.append(True)
    w = pack_blockwise(np.zeros((PANEL, KSUM_CHUNK), np.int8), np.ones((PANEL, 1), F32))
    NUMBA["blockwise_matvec_from_float"](np.ones((1, KSUM_CHUNK), F32), w, np.zeros(PANEL, F32),
                                         np.empty((1, PANEL), F32))
    quantizing(bind_blockwise(w, None))(np.ones((MATVEC_MAX_ROWS, KSUM_CHUNK), F32))  # a prompt's rows
    from . import decode_jit

    decode_jit.warm_up()


# Compiled where the grouped kernels are (numba installed, EXECUPY_NUMBA not 0).
NUMBA: Optional[dict[str, Callable]] = _compile() if quantized.BACKEND == "numba" else None
BACKEND = quantized.BACKEND
gemm_blockwise, gemm_channelwise, quantize_rows = ((NUMBA or NUMPY)[name]
                                                   for name in ("blockwise", "channelwise", "quantize_rows"))
