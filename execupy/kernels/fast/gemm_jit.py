"""A float32 GEMM with XNNPACK's epilogue in registers, for a CNN's 1x1 and im2col convolutions
(imported only where numba is installed; conv.py holds the numpy reference and the layout).

out[M, N] = clamp(bias + x[M, K] @ W[K, N], lo, hi). BLAS does the product well for large
matrices, but a MobileNet's are tall and thin (6400 pixels x 8 inputs x 48 outputs): OpenBLAS
packs both operands for a few hundred multiply-adds a row, and the bias and clamp are another
pass over an output larger than L2. Here a tile of TILE_ROWS rows x 32 outputs (16 without
AVX-512) is summed in registers (`llvm.fma`, rounded once per step as XNNPACK's vfmadd),
started from the bias as XNNPACK's microkernels start, clamped and stored once: no packing of
x, one write of the output.

W is laid out once, at load, as panels [P, K, 16] (output columns 16p.. of every input k next
to each other; the last panel padded with zero columns, the bias with zeros), so a step of a
tile reads one 64-byte vector per panel and one float per row. A row's inputs are read by
offsets (row r, input k: x[bases[r] + offsets[k]]): a matrix's rows, or a convolution's
windows straight from its padded input, with no im2col copy. The output's last panel may be
partial: its store is masked. numba cannot express the registers; the tiles are written in
LLVM IR, as vnni_jit's products are.

The sums' order is XNNPACK's (bias first, then k = 0, 1, ...), not BLAS's: the two agree
within float32 rounding, and exactly for integer-valued data whose sums float32 holds (the
int8 convolutions' exact sums).

Where the CPU has VNNI, an int8 convolution's tiles (`int8_block`) read its int8 or uint8 rows
as they are, four inputs a 32-bit word, and sum them in int32 with vpdpbusd (four byte products
per lane and instruction, against one float product per fma), then requantize in registers
as the float tiles do: the same sums, the same bytes.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .vnni_jit import _F32, _I32, _V16F, LANES, _arrays, _fma, _item, _splat, _vector_at, _vpdpbusd, target_has

# Without the instruction llvm.fma is a call to the C library's fmaf per lane: BLAS is faster there.
FMA = target_has("fma")

# A tile is TILE_ROWS rows x TILE_PANELS 16-column panels. With AVX-512, 6 x 2 accumulators, 2 weight
# vectors and a broadcast fit the 32 registers. Without it each 16-lane vector is two 8-lane AVX2
# registers, of which there are 16: 6 x 1 panel (12 + 2 + 1) fits, 6 x 2 spilled its sums to memory
# every step (a 2-core EPYC with AVX2: 6 x 1 1.3-1.8x faster, 47-80 GFLOP/s a core on MobileNet's
# and BERT's shapes, where 6 x 2 made 25-45).
TILE_ROWS = 6
TILE_PANELS = 2 if target_has("avx512f") else 1


def _masked_store(builder, value, at, remaining):
    """Store the first `remaining` lanes of the vector `value` at `at` (all of them from its width
    on). Whole vectors, and whole 8-lane halves of a partial one, are plain stores: AMD's Zen
    cores run a masked store (vmaskmovps) as a slow microcoded sequence, and a tile of 6 rows
    stores 12 or 24 vectors."""
    lanes = value.type.count
    with builder.if_else(builder.icmp_signed(">=", remaining, ir.Constant(remaining.type, lanes))) as (whole, part):
        with whole:
            builder.store(value, builder.bitcast(at, value.type.as_pointer()), align=1)
        with part:
            if lanes > 8:
                half = lanes // 2
                low, high = (builder.shuffle_vector(value, value, ir.Constant(
                    ir.VectorType(ir.IntType(32), half), list(range(start, start + half)))) for start in (0, half))
                _masked_store(builder, low, at, remaining)
                rest = builder.sub(remaining, ir.Constant(remaining.type, half))
                with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(remaining.type, 0))):
                    _masked_store(builder, high, builder.gep(at, [ir.Constant(ir.IntType(64), half)]), rest)
            else:
                _store_first_lanes(builder, value, at, remaining)


def _store_first_lanes(builder, value, at, remaining):
    vector, lanes = value.type, value.type.count
    kind = f"v{lanes}{'f32' if vector.element == _F32 else 'i8'}"
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [vector, vector.as_pointer(), ir.IntType(32),
                                                        ir.VectorType(ir.IntType(1), lanes)]),
        f"llvm.masked.store.{kind}.p0{kind}")
    longs = ir.VectorType(ir.IntType(64), lanes)
    one = builder.insert_element(ir.Constant(longs, ir.Undefined), remaining, ir.Constant(ir.IntType(32), 0))
    every = builder.shuffle_vector(one, ir.Constant(longs, ir.Undefined),
                                   ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
    mask = builder.icmp_signed("<", ir.Constant(longs, list(range(lanes))), every)
    builder.call(fn, [value, builder.bitcast(at, vector.as_pointer()), ir.Constant(ir.IntType(32), 1), mask])


def _clamped(builder, v, lo, hi):
    """v clamped to [lo, hi] lane by lane; a NaN stays NaN (both compares false), as np.clip keeps it."""
    v = builder.select(builder.fcmp_ordered("<", v, lo), lo, v)
    return builder.select(builder.fcmp_ordered(">", v, hi), hi, v)


def _requantized(builder, sums, bias, scale, zero, lo, hi):
    """conv_jit.requantize_rows' steps on 16 exact float32 sums: float32(sum + bias), * scale,
    rounded half to even, + zero, clamped to [lo, hi] (every value a finite integer), as int8 bits."""
    rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F]), "llvm.rint.v16f32")
    v = builder.fadd(builder.call(rint, [builder.fmul(builder.fadd(sums, bias), scale)]), zero)
    v = builder.select(builder.fcmp_ordered("<", v, lo), lo, v)  # max(v, lo), then min(., hi)
    v = builder.select(builder.fcmp_ordered(">", v, hi), hi, v)
    return builder.trunc(builder.fptosi(v, ir.VectorType(ir.IntType(32), LANES)), ir.VectorType(ir.IntType(8), LANES))


def _tile(rows: int, panels: int, requantize: bool):
    """An intrinsic computing out[r0:r0 + rows, 16 p0: 16 (p0 + panels)]: clamp(bias + X @ W) in
    float32, or with `requantize` the exact sums from 0 requantized into int8 (see the module
    docstring). Row r of X, input k: x[bases[r] + offsets[k]], x flat."""
    @intrinsic
    def tile(typingctx, x, bases, offsets, w, bias, scale, zero, lo, hi, out, r0, p0):
        def codegen(context, builder, sig, args):
            x_t, base_t, off_t, w_t, b_t, s_t = sig.args[:6]
            out_t = sig.args[9]
            x_arr, base_arr, off_arr, w_arr, b_arr, s_arr, out_arr = _arrays(
                context, builder, sig, args, (0, 1, 2, 3, 4, 5, 9))
            zero_v, lo_v, hi_v = (_splat(builder, args[i], _V16F) for i in (6, 7, 8))
            r0, p0 = args[10], args[11]
            intp = cgutils.intp_t
            row_ids = [builder.add(r0, ir.Constant(intp, m)) for m in range(rows)]
            panel_ids = [builder.add(p0, ir.Constant(intp, g)) for g in range(panels)]
            col0 = [builder.mul(p, ir.Constant(intp, LANES)) for p in panel_ids]
            biases = [builder.load(_vector_at(context, builder, b_t, b_arr, [c]), align=4) for c in col0]
            starts = [ir.Constant(_V16F, None) for _ in col0] if requantize else biases
            accs = [[cgutils.alloca_once_value(builder, v) for v in starts] for _ in row_ids]
            first = ir.Constant(intp, 0)
            row_bases = [_item(context, builder, base_t, base_arr, [row]) for row in row_ids]
            with cgutils.for_range(builder, builder.extract_value(off_arr.shape, 0)) as loop:
                k = loop.index
                ws = [builder.load(_vector_at(context, builder, w_t, w_arr, [p, k, first]), align=4)
                      for p in panel_ids]
                offset = _item(context, builder, off_t, off_arr, [k])
                for m, row in enumerate(row_ids):
                    xk = _item(context, builder, x_t, x_arr, [builder.add(row_bases[m], offset)])
                    xv = _splat(builder, xk, _V16F)
                    for g in range(panels):
                        builder.store(_fma(builder, xv, ws[g], builder.load(accs[m][g])), accs[m][g])
            n = builder.extract_value(out_arr.shape, 1)
            scales = [builder.load(_vector_at(context, builder, s_t, s_arr, [c]), align=4) for c in col0] \
                if requantize else None
            for m, row in enumerate(row_ids):
                for g in range(panels):
                    v = builder.load(accs[m][g])
                    v = _requantized(builder, v, biases[g], scales[g], zero_v, lo_v, hi_v) if requantize \
                        else _clamped(builder, v, lo_v, hi_v)
                    at = cgutils.get_item_pointer(context, builder, out_t, out_arr, [row, col0[g]], wraparound=False)
                    _masked_store(builder, v, at, builder.sub(n, col0[g]))
            return context.get_dummy_value()
        return types.void(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r0, p0), codegen
    return tile


def _int8_tile(panels: int):
    """An intrinsic computing out[r0:r0 + TILE_ROWS, 16 p0: 16 (p0 + panels)] of an int8
    convolution with VNNI: the int32 sums of int8 data and int8 weights (vpdpbusd: four byte
    products a lane), requantized in registers with `_requantized`'s steps. Row r of X, inputs
    4k..4k + 3: the four bytes at x[bases[r] + offsets[k]] (x flat int8 or uint8), xor `flip`
    (0x80808080 for int8 data: x + 128 as the unsigned operand vpdpbusd takes; 0 for uint8);
    w int32 [P, K/4, 16], four signed weights of one output per int32 (`int8_panels`); the sums
    start from init int32 [P * 16] (-128 * the column's weight sum for int8 data), so they end
    as the exact sum of x * w. Rows past r1 - 1 compute row r1 - 1 again (the same values
    stored twice): one tile shape serves the rows left over."""
    @intrinsic
    def tile(typingctx, x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out, r0, r1, p0):
        def codegen(context, builder, sig, args):
            x_t, base_t, off_t, w_t, init_t, b_t, s_t = sig.args[:7]
            out_t = sig.args[11]
            x_arr, base_arr, off_arr, w_arr, init_arr, b_arr, s_arr, out_arr = _arrays(
                context, builder, sig, args, (0, 1, 2, 3, 4, 5, 6, 11))
            zero_v, lo_v, hi_v = (_splat(builder, args[i], _V16F) for i in (7, 8, 9))
            flip, r0, r1, p0 = args[10], args[12], args[13], args[14]
            intp, dot = cgutils.intp_t, _vpdpbusd(builder)
            last = builder.sub(r1, ir.Constant(intp, 1))
            row_ids = []
            for m in range(TILE_ROWS):
                row = builder.add(r0, ir.Constant(intp, m))
                row_ids.append(builder.select(builder.icmp_signed(">", row, last), last, row))
            col0 = [builder.mul(builder.add(p0, ir.Constant(intp, g)), ir.Constant(intp, LANES)) for g in range(panels)]
            accs = [[cgutils.alloca_once_value(builder, builder.load(
                _vector_at(context, builder, init_t, init_arr, [c]), align=4)) for c in col0] for _ in row_ids]
            first = ir.Constant(intp, 0)
            row_bases = [_item(context, builder, base_t, base_arr, [row]) for row in row_ids]
            quad_type = _I32.as_pointer()
            with cgutils.for_range(builder, builder.extract_value(off_arr.shape, 0)) as loop:
                k = loop.index
                ws = [builder.load(_vector_at(context, builder, w_t, w_arr, [builder.add(p0, ir.Constant(intp, g)), k,
                                                                               first]), align=4)
                      for g in range(panels)]
                offset = _item(context, builder, off_t, off_arr, [k])
                for m in range(TILE_ROWS):
                    at = cgutils.get_item_pointer(context, builder, x_t, x_arr, [builder.add(row_bases[m], offset)],
                                                  wraparound=False)
                    quad = builder.xor(builder.load(builder.bitcast(at, quad_type), align=1), flip)
                    xv = _splat(builder, quad)
                    for g in range(panels):
                        builder.store(builder.call(dot, [builder.load(accs[m][g]), xv, ws[g]]), accs[m][g])
            n = builder.extract_value(out_arr.shape, 1)
            biases = [builder.load(_vector_at(context, builder, b_t, b_arr, [c]), align=4) for c in col0]
            scales = [builder.load(_vector_at(context, builder, s_t, s_arr, [c]), align=4) for c in col0]
            for m, row in enumerate(row_ids):
                for g in range(panels):
                    sums = builder.sitofp(builder.load(accs[m][g]), _V16F)  # exact: the caller's check
                    v = _requantized(builder, sums, biases[g], scales[g], zero_v, lo_v, hi_v)
                    at = cgutils.get_item_pointer(context, builder, out_t, out_arr, [row, col0[g]], wraparound=False)
                    _masked_store(builder, v, at, builder.sub(n, col0[g]))
            return context.get_dummy_value()
        return types.void(x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out, r0, r1, p0), codegen
    return tile


def panels(w: np.ndarray) -> np.ndarray:
    """W [K, N] as the tiles read it: [P, K, 16], panel p holding columns 16p.., zeros past N."""
    k, n = w.shape
    count = -(-n // LANES)
    padded = np.zeros((k, count * LANES), np.float32)
    padded[:, :n] = w
    return np.ascontiguousarray(padded.reshape(k, count, LANES).transpose(1, 0, 2))


@numba.njit(cache=True, nogil=True)
def batch_panels(b, transpose, w):
    """panels() of each matrix of a batch, into w [H * P, K, 16]: B_h = b[h] [K, N], or b[h].T
    with `transpose` (b [H, N, K]: an attention's keys for queries @ keys.T). Zeros past N."""
    batch, k, n = b.shape[0], b.shape[2] if transpose else b.shape[1], b.shape[1] if transpose else b.shape[2]
    count = w.shape[0] // batch
    for h in range(batch):
        for p in range(count):
            panel = w[h * count + p]
            width = min(LANES, n - p * LANES)
            if width < LANES:
                panel[:, width:] = 0
            if transpose:  # column j of B_h is row j of b[h]: read along it, write down the panel
                for j in range(width):
                    row = b[h, p * LANES + j]
                    for kk in range(k):
                        panel[kk, j] = row[kk]
            else:
                for kk in range(k):
                    for j in range(width):
                        panel[kk, j] = b[h, kk, p * LANES + j]


# The tile shapes of each kind ("PAIR": TILE_PANELS panels, two with AVX-512, else one, as "ONE"):
# TILE_ROWS x TILE_PANELS, TILE_ROWS x 1, 1 x TILE_PANELS, 1 x 1, and
# 2..5 x TILE_PANELS for the rows left after the last full tile (module-level names: numba's disk
# cache does not match a kernel calling a closure's dispatcher). One row's two chains of fmas
# wait on each other's latency: BERT's 128 tokens leave two rows, which took ~28 us of a
# 128 x 256 x 1024 product one at a time.
_F_FULL_PAIR, _F_FULL_ONE, _F_ROW_PAIR, _F_ROW_ONE = (_tile(r, p, False) for r in (TILE_ROWS, 1)
                                                      for p in (TILE_PANELS, 1))
_Q_FULL_PAIR, _Q_FULL_ONE, _Q_ROW_PAIR, _Q_ROW_ONE = (_tile(r, p, True) for r in (TILE_ROWS, 1)
                                                      for p in (TILE_PANELS, 1))
_F_2_PAIR, _F_3_PAIR, _F_4_PAIR, _F_5_PAIR = (_tile(r, TILE_PANELS, False) for r in range(2, TILE_ROWS))
_Q_2_PAIR, _Q_3_PAIR, _Q_4_PAIR, _Q_5_PAIR = (_tile(r, TILE_PANELS, True) for r in range(2, TILE_ROWS))
assert TILE_ROWS == 6  # the leftover tiles above and in _left_pairs


@numba.njit(cache=True, nogil=True)
def windows_product(x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out):
    """out [M, N] = clamp(bias + X @ W, lo, hi) in float32, or with `requantize` (out int8/uint8)
    X @ W + bias requantized as conv_jit.requantize_rows computes it from float32 sums (every sum
    of X @ W an integer float32 holds: the caller's check). Row r of X, input k: x[bases[r] +
    offsets[k]], x flat float32 (a [M, K] matrix's rows, or a padded input's conv windows);
    w float32 [P, K, 16] W's panels; bias and scale float32 [P * 16] (zero past N); zero, lo, hi
    float32 (-inf/inf: no bound)."""
    windows_block(x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out, 0, bases.shape[0], 0, w.shape[0])


@numba.njit(cache=True, inline="always")
def _left_pairs(x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out, r, left, p):
    """Rows r..r + left (2 <= left < TILE_ROWS) x panels p, p + 1 in one tile."""
    if requantize:
        if left == 2:
            _Q_2_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)
        elif left == 3:
            _Q_3_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)
        elif left == 4:
            _Q_4_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)
        else:
            _Q_5_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)
    elif left == 2:
        _F_2_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)
    elif left == 3:
        _F_3_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)
    elif left == 4:
        _F_4_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)
    else:
        _F_5_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)


@numba.njit(cache=True, nogil=True)
def windows_block(x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out, r0, r1, p0, p1):
    """Rows r0..r1 x panels p0..p1 (p0 a multiple of TILE_PANELS) of windows_product's out: tiles of TILE_ROWS rows,
    then one tile of the rows left. (Both kinds of tile are compiled for the given `out`; only
    the one `requantize` names runs.)"""
    pairs, full = p1 - (p1 - p0) % TILE_PANELS, r1 - (r1 - r0) % TILE_ROWS
    for r in range(r0, full, TILE_ROWS):
        for p in range(p0, pairs, TILE_PANELS):
            if requantize:
                _Q_FULL_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)
            else:
                _F_FULL_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, p)
        if pairs < p1 and requantize:
            _Q_FULL_ONE(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, pairs)
        elif pairs < p1:
            _F_FULL_ONE(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, pairs)
    left = r1 - full
    for p in range(p0, pairs, TILE_PANELS):  # the rows left: one tile of their count
        if left > 1:
            _left_pairs(x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out, full, left, p)
        elif left and requantize:
            _Q_ROW_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, full, p)
        elif left:
            _F_ROW_PAIR(x, bases, offsets, w, bias, scale, zero, lo, hi, out, full, p)
    for r in range(full, r1):  # and their last, odd panel one row at a time
        if pairs < p1 and requantize:
            _Q_ROW_ONE(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, pairs)
        elif pairs < p1:
            _F_ROW_ONE(x, bases, offsets, w, bias, scale, zero, lo, hi, out, r, pairs)


def int8_panels(w: np.ndarray) -> np.ndarray:
    """W [K, N] of int8 values (K a multiple of 4) as the int8 tiles read it: int32 [P, K/4, 16],
    byte t of [p, k, j] the weight of input 4k + t for output 16p + j; zeros past N."""
    k, n = w.shape
    count = -(-n // LANES)
    padded = np.zeros((k, count * LANES), np.int8)
    padded[:, :n] = w
    quads = np.ascontiguousarray(padded.reshape(k // 4, 4, count, LANES).transpose(2, 0, 3, 1))
    return quads.view(np.int32).reshape(count, k // 4, LANES)


_I8_PAIR, _I8_ONE = _int8_tile(TILE_PANELS), _int8_tile(1)


@numba.njit(cache=True, nogil=True)
def int8_block(x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out, r0, r1, p0, p1):
    """Rows r0..r1 x panels p0..p1 (p0 even) of an int8 convolution's requantized output
    (`_int8_tile`; VNNI only): tiles of TILE_ROWS rows x TILE_PANELS panels, then the odd panel."""
    pairs = p1 - (p1 - p0) % TILE_PANELS
    for r in range(r0, r1, TILE_ROWS):
        for p in range(p0, pairs, TILE_PANELS):
            _I8_PAIR(x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out, r, r1, p)
        if pairs < p1:
            _I8_ONE(x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out, r, r1, pairs)


# (No KERNELS here: windows_product is compiled inside conv_shared_jit.windows_shared, whose
# KERNELS the cache test reads.)
