"""The numba kernels behind `execupy.kernels.fast.conv` (imported only where numba is installed).

Module-level functions, not closures made inside a function: numba's disk cache never
matches a jitted function that calls another closure's dispatcher (here the inlined plane
and tap helpers), so `nchw` and `nhwc` were compiled again in every process.
`tests/kernels/test_fast_conv.py` checks that a second process finds every one in the cache.
The arithmetic is documented in conv.py.
"""
from __future__ import annotations

import numba
import numpy as np

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)


@numba.njit(cache=True, inline="always")
def nchw_plane(xp, w, sh, sw, dh, dw, out, n, c):
    # Rows are sliced first so the innermost loop indexes with its own counter only: an
    # index like base + x makes numba test for negative indices, and LLVM then cannot
    # vectorize the loop.
    ow = out.shape[3]
    for y in range(out.shape[2]):
        dst = out[n, c, y]
        for kh in range(w.shape[1]):
            row = xp[n, c, y * sh + kh * dh]
            for kw in range(w.shape[2]):
                wv, base = w[c, kh, kw], kw * dw
                first = kh == 0 and kw == 0
                if sw == 1:
                    src = row[base:base + ow]
                    if first:
                        for x in range(ow):
                            dst[x] = src[x] * wv
                    else:
                        for x in range(ow):
                            dst[x] += src[x] * wv
                else:
                    for x in range(ow):
                        term = row[base + x * sw] * wv
                        dst[x] = term if first else dst[x] + term

@numba.njit(cache=True)
def nchw(xp, w, sh, sw, dh, dw, out):
    for n in range(out.shape[0]):
        for c in range(out.shape[1]):
            nchw_plane(xp, w, sh, sw, dh, dw, out, n, c)

@numba.njit(cache=True)
def split_columns(x, sw, xz, xs):
    """xs[n, r, phase, q*C + ch] = x[n, r, q*sw + phase, ch] - xz: the input's columns split by
    stride phase, so that every kernel tap of an output row reads one contiguous run."""
    c = x.shape[3]
    for n in range(x.shape[0]):
        for r in range(x.shape[1]):
            for col in range(x.shape[2]):
                dst = xs[n, r, col % sw, (col // sw) * c:(col // sw + 1) * c]
                src = x[n, r, col]
                for ch in range(c):
                    dst[ch] = src[ch] - xz


@numba.njit(cache=True, inline="always")
def _tap(dst, src, wk, first):
    if first:
        for j in range(dst.shape[0]):
            dst[j] = src[j] * wk[j]
    else:
        for j in range(dst.shape[0]):
            dst[j] += src[j] * wk[j]


@numba.njit(cache=True, inline="always")
def epilogue(o, bias, clamp, lo, hi):
    """o (+ bias when not empty), clamped to [lo, hi] if `clamp` (NaN stays NaN, as in np.clip)."""
    if bias.shape[0]:
        for j in range(o.shape[0]):
            o[j] += bias[j]
    if clamp:
        for j in range(o.shape[0]):
            v = o[j]
            v = lo if v < lo else v
            o[j] = hi if v > hi else v


@numba.njit(cache=True)
def bias_clamp_flat(y, bias_tile, clamp, lo, hi):
    """Flat `y` in place, chunk by chunk of len(bias_tile) (the bias tiled over a few pixels,
    so that a layer of 16 channels still runs long loops): + bias when `bias_tile` is not
    empty, clamped to [lo, hi] if `clamp`."""
    step = bias_tile.shape[0] if bias_tile.shape[0] else 4096
    for j in range(0, y.shape[0], step):
        chunk = y[j:j + step]
        epilogue(chunk, bias_tile[:chunk.shape[0]], clamp, lo, hi)


@numba.njit(cache=True)
def pad_into(x, xz, top, left, channels_outer, xp):
    """xp[n, top + y, left + px, ch] = x[n, y, px, ch] - xz, x of any strides: channels in
    the outer loop when they are x's outer dimension in memory (a transposed NCHW input)."""
    n_, h, w, c = x.shape
    for n in range(n_):
        for y in range(h):
            dst = xp[n, top + y]
            if channels_outer:
                for ch in range(c):
                    for px in range(w):
                        dst[left + px, ch] = x[n, y, px, ch] - xz
            else:
                for px in range(w):
                    for ch in range(c):
                        dst[left + px, ch] = x[n, y, px, ch] - xz


@numba.njit(cache=True)
def nhwc(xs, tiled, bias_row, clamp, width, sh, sw, dh, dw, top, left, zero, lo, hi, out):
    """Depthwise conv of `xs` (split_columns' layout; `width` the unsplit input's) into `out`
    (N, OH, OW, C), then + bias when `bias_row` is not empty and clamped to [lo, hi] if `clamp`.

    Each (output row, tap) is one loop over the whole row, OW*C products against the tap's
    weights tiled across the row (`tiled`: (KH, KW, OW*C); `bias_row` the bias tiled so):
    short per-pixel loops (C can be 16) cost more in loop set-up than in arithmetic. Padded
    pixels add zero * w, as the padded copy would. (Three taps of a kernel row in one loop,
    one load and store of the output instead of three, measured no faster.)"""
    n_, h = xs.shape[0], xs.shape[1]
    kh_, kw_, row = tiled.shape
    oh, ow = out.shape[1], out.shape[2]
    c = row // ow
    zeros = np.full(row, zero, out.dtype)  # a padded run's input
    flat = out.reshape(n_, oh, row)
    for n in range(n_):
        for y in range(oh):
            o = flat[n, y]
            for i in range(kh_):
                r = y * sh + i * dh - top
                for k in range(kw_):
                    first = i == 0 and k == 0
                    wk = tiled[i, k]
                    off = k * dw - left  # input column = px * sw + off
                    phase = off % sw
                    shift = (off - phase) // sw  # split column = px + shift
                    a = min(-(off // sw), ow) if off < 0 else 0  # the first px whose column is >= 0
                    b = max(min(ow, (width - 1 - off) // sw + 1), a) if off < width else a  # past the last
                    if not 0 <= r < h:
                        b = a
                    if a > 0:
                        _tap(o[:a * c], zeros[:a * c], wk[:a * c], first)
                    if b > a:
                        _tap(o[a * c:b * c], xs[n, r, phase, (a + shift) * c:(b + shift) * c], wk[a * c:b * c], first)
                    if b < ow:
                        _tap(o[b * c:], zeros[b * c:], wk[b * c:], first)
            if bias_row.shape[0] or clamp:
                epilogue(o, bias_row, clamp, lo, hi)


@numba.njit(cache=True, inline="always")
def _shifted(t, ch, xz, shift):
    # x - x_zero in the accumulator's type for int8 data, x itself for float data
    return t[ch] - xz if shift else t[ch]


@numba.njit(cache=True, error_model="numpy")
def nhwc_3x3(x, padded, xz, shift, w, bias, clamp, sh, sw, dh, dw, top, left, lo, hi, out):
    """A 3x3 depthwise conv of `x` (N, H, W, C) into `out` (N, OH, OW, C), w (3, 3, C), then
    + bias when `bias` is not empty and clamped to [lo, hi] if `clamp`, pixel by pixel: each
    channel's nine products and the epilogue in registers, one store (`nhwc` goes tap by tap
    through the output row, a load and a store per tap, and splits a strided input by column
    phase first). The same operations in the same order as `nhwc`: the first tap's product,
    the others added in tap order, a tap outside the input reading `padded` (C values of x's
    type: 0, or x_zero for int8 data, which `shift` takes off every input as x - xz). Wide
    layers only (the caller's choice): for 16 channels the per-pixel loop is too short."""
    n_, h, width, c = x.shape
    oh, ow = out.shape[1], out.shape[2]
    has_bias = bias.shape[0] > 0
    for n in range(n_):
        for y in range(oh):
            r0 = y * sh - top
            in0, in1, in2 = 0 <= r0 < h, 0 <= r0 + dh < h, 0 <= r0 + 2 * dh < h
            for px in range(ow):
                c0 = px * sw - left
                ok0, ok1, ok2 = 0 <= c0 < width, 0 <= c0 + dw < width, 0 <= c0 + 2 * dw < width
                t0 = x[n, r0, c0] if in0 and ok0 else padded
                t1 = x[n, r0, c0 + dw] if in0 and ok1 else padded
                t2 = x[n, r0, c0 + 2 * dw] if in0 and ok2 else padded
                t3 = x[n, r0 + dh, c0] if in1 and ok0 else padded
                t4 = x[n, r0 + dh, c0 + dw] if in1 and ok1 else padded
                t5 = x[n, r0 + dh, c0 + 2 * dw] if in1 and ok2 else padded
                t6 = x[n, r0 + 2 * dh, c0] if in2 and ok0 else padded
                t7 = x[n, r0 + 2 * dh, c0 + dw] if in2 and ok1 else padded
                t8 = x[n, r0 + 2 * dh, c0 + 2 * dw] if in2 and ok2 else padded
                o = out[n, y, px]
                for ch in range(c):
                    acc = _shifted(t0, ch, xz, shift) * w[0, 0, ch]
                    acc = acc + _shifted(t1, ch, xz, shift) * w[0, 1, ch]
                    acc = acc + _shifted(t2, ch, xz, shift) * w[0, 2, ch]
                    acc = acc + _shifted(t3, ch, xz, shift) * w[1, 0, ch]
                    acc = acc + _shifted(t4, ch, xz, shift) * w[1, 1, ch]
                    acc = acc + _shifted(t5, ch, xz, shift) * w[1, 2, ch]
                    acc = acc + _shifted(t6, ch, xz, shift) * w[2, 0, ch]
                    acc = acc + _shifted(t7, ch, xz, shift) * w[2, 1, ch]
                    acc = acc + _shifted(t8, ch, xz, shift) * w[2, 2, ch]
                    if has_bias:
                        acc = acc + bias[ch]
                    if clamp:
                        acc = lo if acc < lo else acc
                        acc = hi if acc > hi else acc
                    o[ch] = acc


@numba.njit(cache=True)
def requantize_rows(acc, bias, scale, zero, lo, hi, out):
    for r in range(acc.shape[0]):
        a, o = acc[r], out[r]
        for c in range(acc.shape[1]):
            v = np.float32(a[c] + bias[c])  # in float64 for a float64 bias or int32 sums
            o[c] = min(max(np.rint(v * scale[c]) + zero, lo), hi)


# Every compiled entry point by name (the cache test runs each and reads its dispatcher's stats).
KERNELS = {"nchw": nchw, "split_columns": split_columns, "nhwc": nhwc, "nhwc_3x3": nhwc_3x3,
           "bias_clamp_flat": bias_clamp_flat,
           "pad_into": pad_into,
           "requantize_rows": requantize_rows}


# ---------------------------------------------------------------- 3x3 depthwise, 16 channels a vector

from llvmlite import ir  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from .vnni_jit import _V16F, LANES, _arrays, _fma, _splat, _vector_at  # noqa: E402

_V16I32, _V16I8 = ir.VectorType(ir.IntType(32), LANES), ir.VectorType(ir.IntType(8), LANES)


def _load_floats(context, builder, x_t, x_arr, indices):
    """16 consecutive elements of x from `indices` on, as float32 (int8 and uint8 data exactly)."""
    dtype = x_t.dtype
    if isinstance(dtype, types.Float):
        return builder.load(_vector_at(context, builder, x_t, x_arr, indices), align=4)
    at = cgutils.get_item_pointer(context, builder, x_t, x_arr, indices, wraparound=False)
    raw = builder.load(builder.bitcast(at, ir.VectorType(ir.IntType(8), LANES).as_pointer()), align=1)
    wide = (builder.sext if dtype.signed else builder.zext)(raw, ir.VectorType(ir.IntType(32), LANES))
    return (builder.sitofp if dtype.signed else builder.uitofp)(wide, _V16F)


def _depthwise_3x3(checked: bool):
    """An intrinsic computing out[n, y, px_a:px_b, c0:c0 + 16] of a 3x3 depthwise conv (rows
    r0, r0 + dh, r0 + 2 dh of x), nhwc_3x3's steps for 16 channels a vector, the nine filter
    vectors held in registers along the run: the first tap's product, the others added in tap
    order, + bias, clamped to [lo, hi] (select on compares: NaN stays NaN), stored. Float data
    is multiplied then added, each rounded, as numpy does; int8 data is summed with fmas from
    -xz * the taps' sum (exact in float32, as are all its partial sums: the caller's check),
    the same exact values as (x - xz) * w with one subtraction a tap fewer. `checked`: a tap
    outside x reads the padded value (0, or xz for int8 data) in place of a load from a clamped
    address; else every tap must lie inside x. An int8 or
    uint8 `out` takes the requantized sums (int8 data): after the bias, rint(v * scale) + zero,
    then clamped, as requantize_rows."""
    @intrinsic
    def run(typingctx, x, w, bias, scale, zero, xz, lo, hi, out, n, y, r0, px_a, px_b, sw, dh, dw, left, c0):
        def codegen(context, builder, sig, args):
            x_t, w_t, b_t, s_t = sig.args[:4]
            out_t = sig.args[8]
            x_arr, w_arr, b_arr, s_arr, out_arr = _arrays(context, builder, sig, args, (0, 1, 2, 3, 8))
            zero_f, xz_v, lo_v, hi_v = (_splat(builder, args[i], _V16F) for i in (4, 5, 6, 7))
            n, y, r0, px_a, px_b, sw, dh, dw, left, c0 = args[9:]
            requantize = isinstance(out_t.dtype, types.Integer)
            rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F]), "llvm.rint.v16f32")
            integer = not isinstance(x_t.dtype, types.Float)
            intp = cgutils.intp_t
            consts = [ir.Constant(intp, i) for i in range(3)]
            zero_v = ir.Constant(_V16F, None)
            h, width = (builder.extract_value(x_arr.shape, i) for i in (1, 2))
            taps = [builder.load(_vector_at(context, builder, w_t, w_arr, [consts[i], consts[k], c0]), align=4)
                    for i in range(3) for k in range(3)]
            b_v = builder.load(_vector_at(context, builder, b_t, b_arr, [c0]), align=4)
            s_v = builder.load(_vector_at(context, builder, s_t, s_arr, [c0]), align=4) if requantize else None
            rows = [builder.add(r0, builder.mul(dh, consts[i])) for i in range(3)]

            def inside(index, size):  # 0 <= index < size, and index clamped into [0, size)
                ok = builder.and_(builder.icmp_signed(">=", index, consts[0]), builder.icmp_signed("<", index, size))
                low = builder.select(builder.icmp_signed("<", index, consts[0]), consts[0], index)
                last = builder.sub(size, consts[1])
                return ok, builder.select(builder.icmp_signed(">", low, last), last, low)

            row_at = [inside(r, h) if checked else (None, r) for r in rows]
            # int8 data: sum(x * w) - xz * sum(w) = sum((x - xz) * w), the sums starting from the
            # second term, one subtraction a tap fewer (exact integers: the caller bounds them)
            start = None
            if integer:
                taps_sum = taps[0]
                for tap in taps[1:]:
                    taps_sum = builder.fadd(taps_sum, tap)
                start = builder.fsub(zero_v, builder.fmul(xz_v, taps_sum))
            padded_v = xz_v if integer else zero_v  # a tap outside x reads the padded value
            with cgutils.for_range_slice(builder, px_a, px_b, consts[1]) as (px, _):
                col0 = builder.sub(builder.mul(px, sw), left)
                col_at = [inside(builder.add(col0, builder.mul(dw, consts[k])), width) if checked
                          else (None, builder.add(col0, builder.mul(dw, consts[k]))) for k in range(3)]
                acc = start
                for i in range(3):
                    for k in range(3):
                        v = _load_floats(context, builder, x_t, x_arr, [n, row_at[i][1], col_at[k][1], c0])
                        if checked:
                            v = builder.select(builder.and_(row_at[i][0], col_at[k][0]), v, padded_v)
                        tap = taps[3 * i + k]
                        if integer:
                            acc = _fma(builder, v, tap, acc)
                        elif acc is None:
                            acc = builder.fmul(v, tap)
                        else:
                            acc = builder.fadd(acc, builder.fmul(v, tap))
                acc = builder.fadd(acc, b_v)
                if requantize:
                    acc = builder.fadd(builder.call(rint, [builder.fmul(acc, s_v)]), zero_f)
                acc = builder.select(builder.fcmp_ordered("<", acc, lo_v), lo_v, acc)
                acc = builder.select(builder.fcmp_ordered(">", acc, hi_v), hi_v, acc)
                if requantize:
                    at = cgutils.get_item_pointer(context, builder, out_t, out_arr, [n, y, px, c0], wraparound=False)
                    builder.store(builder.trunc(builder.fptosi(acc, _V16I32), _V16I8),
                                  builder.bitcast(at, _V16I8.as_pointer()), align=1)
                else:
                    builder.store(acc, _vector_at(context, builder, out_t, out_arr, [n, y, px, c0]), align=4)
            return context.get_dummy_value()
        return types.void(x, w, bias, scale, zero, xz, lo, hi, out, n, y, r0, px_a, px_b, sw, dh, dw, left, c0), codegen
    return run


_DEPTHWISE_INSIDE, _DEPTHWISE_CHECKED = _depthwise_3x3(False), _depthwise_3x3(True)


@numba.njit(cache=True, inline="always")
def _pixel_3x3(x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out, n, y, px, ch_lo, ch_hi):
    """Channels ch_lo..ch_hi of one output pixel, nhwc_3x3's steps (a tap outside x reads `padded`);
    requantized where `scale` is given (an integer out), as _depthwise_3x3."""
    h, width = x.shape[1], x.shape[2]
    r0, c0 = y * sh - top, px * sw - left
    o = out[n, y, px]
    for ch in range(ch_lo, ch_hi):
        acc = np.float32(0)
        for i in range(3):
            r = r0 + i * dh
            for k in range(3):
                c = c0 + k * dw
                t = x[n, r, c, ch] if 0 <= r < h and 0 <= c < width else padded[ch]
                product = (np.float32(t) - xz) * w[i, k, ch]
                acc = product if i == 0 and k == 0 else acc + product
        acc = acc + bias[ch]
        if scale.shape[0]:
            acc = np.rint(np.float32(acc * scale[ch])) + zero
        acc = lo if acc < lo else acc
        o[ch] = hi if acc > hi else acc


@numba.njit(cache=True, nogil=True, error_model="numpy")
def nhwc_3x3_vectors(x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out):
    """nhwc_3x3 with every channel's epilogue given (a -0.0 bias and infinite bounds change
    nothing: x + -0.0 is x, -0.0 included), out float32 and x float32 without a zero point or
    int8 data: 16 channels a vector (`_depthwise_3x3`; the border pixels reading the padded
    value), the channels past a multiple of 16 one at a time; the same values as nhwc_3x3.
    With int8 data and an int8 or uint8 out, the sums requantized as requantize_rows would
    (scale [C] and zero; else scale is empty): the same bits, without their float32 pass."""
    nhwc_3x3_rows(x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out, 0,
                  out.shape[0] * out.shape[1])


@numba.njit(cache=True, nogil=True, error_model="numpy")
def nhwc_3x3_rows(x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out, q0, q1):
    """nhwc_3x3_vectors' output rows q0..q1, row q being image q // OH's row q % OH."""
    h, width, c = x.shape[1], x.shape[2], x.shape[3]
    oh, ow = out.shape[1], out.shape[2]
    vectors = c - c % LANES
    a = min(ow, -(-left // sw))  # the first output column whose three taps are inside x
    b = max(a, min(ow, (width - 1 - 2 * dw + left) // sw + 1))  # past the last
    for q in range(q0, q1):
        n, y = q // oh, q % oh
        r0 = y * sh - top
        for c0 in range(0, vectors, LANES):
            if r0 < 0 or r0 + 2 * dh >= h:
                _DEPTHWISE_CHECKED(x, w, bias, scale, zero, xz, lo, hi, out, n, y, r0, 0, ow, sw, dh, dw, left, c0)
            else:
                _DEPTHWISE_CHECKED(x, w, bias, scale, zero, xz, lo, hi, out, n, y, r0, 0, a, sw, dh, dw, left, c0)
                _DEPTHWISE_INSIDE(x, w, bias, scale, zero, xz, lo, hi, out, n, y, r0, a, b, sw, dh, dw, left, c0)
                _DEPTHWISE_CHECKED(x, w, bias, scale, zero, xz, lo, hi, out, n, y, r0, b, ow, sw, dh, dw, left, c0)
        if vectors < c:
            for px in range(ow):
                _pixel_3x3(x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out, n, y, px,
                               vectors, c)


# (nhwc_3x3_vectors is compiled inside conv_shared_jit.nhwc_3x3_shared, in that module's KERNELS)
