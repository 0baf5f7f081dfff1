"""A CNN's convolutions on both cores: the second core's thread (second_thread.py) takes chunks
of a conv's outputs while the caller takes the rest (numba only; second_thread_jit's chunked jobs).

The one-thread kernels are gemm_jit's (1x1 and im2col convs) and conv_jit's (3x3 depthwise);
this module cuts their work into chunks, the caller's from the front and the thread's from the
back, so that each core keeps to its half of the image layer after layer (handed out in turn,
the two cores swapped halves of every activation between their caches and a MobileNetV2 call
was no faster). Each driver fills a job block with its call's arrays (addresses and sizes) for
a C function the thread runs (a numba cfunc: the thread's loop can call only C functions).
Imported when a conv kernel is first built, not with conv.py: the second thread's module and
these C functions cost ~0.1-0.2 s to load, which a program without such convs need not pay.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .conv_jit import nhwc_3x3_rows, nhwc_3x3_vectors
from .gemm_jit import FMA, LANES, TILE_PANELS, TILE_ROWS, int8_block, windows_block
from .second_thread_jit import FIELDS, JOB_SLOTS, _pointer, join_chunks, next_chunk, open_chunks, post_chunks
from .vnni_jit import VNNI

_CFUNC = types.void(*[types.int64] * 12)  # second_thread_jit's CALL: the job's fields, xbuf, scratch

# ---------------------------------------------------------------- 1x1 and im2col convs, batched products
# GEMM tiles (gemm_jit): the caller and the second core's thread take chunks, each written straight into out: blocks of
# rows when X is the larger operand (each thread then reads all of W and its own rows), of panels
# when W is (a few pixels times a wide filter: each reads all of X and its own columns of W).
# A batch of products (an encoder's attention: one per head) is one job, its chunks those of
# each product in turn: product h reads x[h * x_stride:], panels w[h * P:] and writes out[h * M:].
# The job block's fields: the addresses (and sizes) of x, bases, offsets, the panels, bias, scale
# and out; requantize; the chunks' rows and panels; the batch and x's stride. The float32 zero,
# lo, hi ride in xbuf[:3].
(X_AT, X_SIZE, BASES_AT, M_, OFFSETS_AT, K_, W_AT, P_, BIAS_AT, SCALE_AT, OUT_AT, N_, REQUANTIZE, CHUNK_ROWS,
 CHUNK_PANELS, BATCH, X_STRIDE) = range(FIELDS, FIELDS + 17)
CHUNKS_PER_THREAD = 8  # a thread's share in about this many chunks: a late thread still finds some left


@numba.njit(cache=True, inline="always")
def _chunking(m, p_, batch):
    """(rows, panels) of a chunk: whole tiles of rows, or of panels."""
    chunks = max(1, 2 * CHUNKS_PER_THREAD // batch)
    if p_ * LANES > m:  # W read more than X
        return m, TILE_PANELS * max(1, -(-p_ // (TILE_PANELS * chunks)))
    return TILE_ROWS * max(1, -(-m // (TILE_ROWS * chunks))), p_


@numba.njit(cache=True, inline="always")
def _product_block(x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out, h, x_stride, p_, r0, r1, p0,
                   p1):
    """Rows r0..r1 x panels p0..p1 of product h of a batch (windows_block on its slices: x_stride
    values of x, p_ panels of w, M = bases.shape[0] rows of out)."""
    m = bases.shape[0]
    windows_block(x[h * x_stride:(h + 1) * x_stride], bases, offsets, w[h * p_:(h + 1) * p_], bias, scale, zero, lo,
                  hi, requantize, out[h * m:(h + 1) * m], r0, r1, p0, p1)


@numba.njit(cache=True, inline="always")
def _take_chunks(job, from_back, x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out):
    m, p_, rows, panels, x_stride = bases.shape[0], job[P_], job[CHUNK_ROWS], job[CHUNK_PANELS], job[X_STRIDE]
    across = -(-p_ // panels)
    per_product = -(-m // rows) * across
    while True:
        c = next_chunk(job, from_back)
        if c < 0:
            return
        h, c = c // per_product, c % per_product
        r0, p0 = (c // across) * rows, (c % across) * panels
        _product_block(x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out, h, x_stride, p_,
                       r0, min(m, r0 + rows), p0, min(p_, p0 + panels))


@numba.njit(cache=True, nogil=True)
def windows_shared(ctrl, xbuf, scratch, fn, job, x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out,
                   batch, share):
    """windows_product over a batch of `batch` products (product h: x[h * x.size // batch:],
    panels w[h * P:], out[h * M:], with P = w.shape[0] // batch and M = bases.shape[0]), with
    `share` its chunks taken by this thread and the second core's (fn: WINDOWS_CHUNKS's address;
    job: the second thread's job block, which only a sharing call may use). The same bits either
    way. Returns 0 (nothing is taken back)."""
    if not share:
        m, p_, x_stride = bases.shape[0], w.shape[0] // batch, x.shape[0] // batch
        for h in range(batch):
            _product_block(x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out, h, x_stride, p_, 0, m,
                           0, p_)
        return 0
    windows_job(job, xbuf, x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out, batch)
    seq = post_chunks(ctrl, job, fn)
    _take_chunks(job, False, x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out)
    join_chunks(ctrl, seq)
    return 0


@numba.njit(cache=True)
def windows_job(job, xbuf, x, bases, offsets, w, bias, scale, zero, lo, hi, requantize, out, batch):
    """Write windows_shared's call into a job block (and xbuf), its chunks opened."""
    m, p_ = bases.shape[0], w.shape[0] // batch
    rows, panels = _chunking(m, p_, batch)
    job[X_AT], job[X_SIZE], job[BASES_AT], job[M_] = x.ctypes.data, x.shape[0], bases.ctypes.data, m
    job[OFFSETS_AT], job[K_], job[W_AT], job[P_] = offsets.ctypes.data, offsets.shape[0], w.ctypes.data, p_
    job[BIAS_AT], job[SCALE_AT], job[OUT_AT], job[N_] = bias.ctypes.data, scale.ctypes.data, out.ctypes.data, out.shape[1]
    job[REQUANTIZE], job[CHUNK_ROWS], job[CHUNK_PANELS] = requantize, rows, panels
    job[BATCH], job[X_STRIDE] = batch, x.shape[0] // batch
    xbuf[0], xbuf[1], xbuf[2] = zero, lo, hi
    open_chunks(job, batch * -(-m // rows) * -(-p_ // panels))


def _windows_chunks(job_at, _1, _2, _3, _4, _5, _6, _7, xbuf_at, _xbuf_size, _scratch_at, _scratch_size):
    # windows_shared's job on the second core's thread: its arrays again from the job block
    job = numba.carray(_pointer(job_at), JOB_SLOTS, np.int64)
    consts = numba.carray(_pointer(xbuf_at), 3, np.float32)
    m, k, p_, n, batch = job[M_], job[K_], job[P_], job[N_], job[BATCH]
    x = numba.carray(_pointer(job[X_AT]), job[X_SIZE], np.float32)
    bases = numba.carray(_pointer(job[BASES_AT]), m, np.int64)
    offsets = numba.carray(_pointer(job[OFFSETS_AT]), k, np.int64)
    w = numba.carray(_pointer(job[W_AT]), (batch * p_, k, LANES), np.float32)
    bias = numba.carray(_pointer(job[BIAS_AT]), p_ * LANES, np.float32)
    scale = numba.carray(_pointer(job[SCALE_AT]), p_ * LANES, np.float32)
    if job[REQUANTIZE]:  # int8 or uint8 outputs: the same bytes (values clamped to the type's range)
        out = numba.carray(_pointer(job[OUT_AT]), (batch * m, n), np.int8)
        _take_chunks(job, True, x, bases, offsets, w, bias, scale, consts[0], consts[1], consts[2], True, out)
    else:
        out32 = numba.carray(_pointer(job[OUT_AT]), (batch * m, n), np.float32)
        _take_chunks(job, True, x, bases, offsets, w, bias, scale, consts[0], consts[1], consts[2], False, out32)


# The thread's part as a C function (compiled at import, or read from numba's cache), only where
# the tiles run (with FMA: elsewhere conv.py uses BLAS).
WINDOWS_CHUNKS = numba.cfunc(_CFUNC, cache=True)(_windows_chunks) if FMA else None


# ---------------------------------------------------------------- int8 1x1 convs (VNNI)
# gemm_jit.int8_block's tiles in windows_shared's chunks (the same job fields), two fields more:
# the sums' starting values (init) and the flip of x's bytes. x and out travel as int8 bytes
# (uint8 data and outputs too: the flip and the clamp bounds tell them apart).
INIT_AT, FLIP = FIELDS + 17, FIELDS + 18


@numba.njit(cache=True, inline="always")
def _take_int8_chunks(job, from_back, x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out):
    m, p_, rows, panels = bases.shape[0], w.shape[0], job[CHUNK_ROWS], job[CHUNK_PANELS]
    across = -(-p_ // panels)
    while True:
        c = next_chunk(job, from_back)
        if c < 0:
            return
        r0, p0 = (c // across) * rows, (c % across) * panels
        int8_block(x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out, r0, min(m, r0 + rows), p0,
                   min(p_, p0 + panels))


@numba.njit(cache=True, nogil=True)
def int8_shared(ctrl, xbuf, scratch, fn, job, x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out, share):
    """gemm_jit.int8_block over all of out, with `share` in chunks taken by this thread and the
    second core's (fn: INT8_CHUNKS's address; job: the second thread's job block). The same bits
    either way. Returns 0."""
    m, p_ = bases.shape[0], w.shape[0]
    if not share:
        int8_block(x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out, 0, m, 0, p_)
        return 0
    int8_job(job, xbuf, x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out)
    seq = post_chunks(ctrl, job, fn)
    _take_int8_chunks(job, False, x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out)
    join_chunks(ctrl, seq)
    return 0


@numba.njit(cache=True)
def int8_job(job, xbuf, x, bases, offsets, w, init, bias, scale, zero, lo, hi, flip, out):
    """Write int8_shared's call into a job block (and xbuf), its chunks opened."""
    m, p_ = bases.shape[0], w.shape[0]
    rows, panels = _chunking(m, p_, 1)
    job[X_AT], job[X_SIZE], job[BASES_AT], job[M_] = x.ctypes.data, x.shape[0], bases.ctypes.data, m
    job[OFFSETS_AT], job[K_], job[W_AT], job[P_] = offsets.ctypes.data, offsets.shape[0], w.ctypes.data, p_
    job[BIAS_AT], job[SCALE_AT], job[OUT_AT], job[N_] = bias.ctypes.data, scale.ctypes.data, out.ctypes.data, out.shape[1]
    job[CHUNK_ROWS], job[CHUNK_PANELS], job[INIT_AT], job[FLIP] = rows, panels, init.ctypes.data, flip
    xbuf[0], xbuf[1], xbuf[2] = zero, lo, hi
    open_chunks(job, -(-m // rows) * -(-p_ // panels))


def _int8_chunks(job_at, _1, _2, _3, _4, _5, _6, _7, xbuf_at, _xbuf_size, _scratch_at, _scratch_size):
    # int8_shared's job on the second core's thread: its arrays again from the job block
    job = numba.carray(_pointer(job_at), JOB_SLOTS, np.int64)
    consts = numba.carray(_pointer(xbuf_at), 3, np.float32)
    m, k, p_, n = job[M_], job[K_], job[P_], job[N_]
    _take_int8_chunks(job, True, numba.carray(_pointer(job[X_AT]), job[X_SIZE], np.int8),
                      numba.carray(_pointer(job[BASES_AT]), m, np.int64),
                      numba.carray(_pointer(job[OFFSETS_AT]), k, np.int64),
                      numba.carray(_pointer(job[W_AT]), (p_, k, LANES), np.int32),
                      numba.carray(_pointer(job[INIT_AT]), p_ * LANES, np.int32),
                      numba.carray(_pointer(job[BIAS_AT]), p_ * LANES, np.float32),
                      numba.carray(_pointer(job[SCALE_AT]), p_ * LANES, np.float32), consts[0], consts[1], consts[2],
                      np.int32(job[FLIP]), numba.carray(_pointer(job[OUT_AT]), (m, n), np.int8))


# The thread's part as a C function, only where the int8 tiles can run.
INT8_CHUNKS = numba.cfunc(_CFUNC, cache=True)(_int8_chunks) if VNNI else None


# ---------------------------------------------------------------- 3x3 depthwise convs
# 3x3 depthwise (conv_jit.nhwc_3x3_vectors): output rows in chunks taken by the caller (from the top) and the second core's
# thread (from the bottom), as gemm_jit.windows_shared's 1x1 convs split theirs: the rows a core
# wrote in one layer are, mostly, the rows it reads in the next. The job block's fields: x's
# address, shape and kind (KINDS), padded's, w's, bias's, scale's (and its length) and out's
# addresses, out's rows and columns, the strides, dilations and pads; xz, lo, hi and zero
# (float32) ride in xbuf[:4].
(DW_X_AT, DW_N, DW_H, DW_W, DW_C, DW_KIND, DW_PADDED_AT, DW_W_AT, DW_BIAS_AT, DW_OUT_AT, DW_OH, DW_OW, DW_SH, DW_SW,
 DW_DH, DW_DW, DW_TOP, DW_LEFT, DW_CHUNK, DW_SCALE_AT, DW_SCALES) = range(FIELDS, FIELDS + 21)
# (x's dtype, out's dtype) -> the kind's number: float sums of float or integer data, and the
# requantized sums of integer data
KINDS = {(np.dtype(x), np.dtype(out)): i for i, (x, out) in enumerate(
    [(np.float32, np.float32), (np.int8, np.float32), (np.uint8, np.float32), (np.int8, np.int8),
     (np.uint8, np.uint8)])}
DEPTHWISE_CHUNKS = 16  # about this many chunks of rows per layer, shared by both threads


@numba.njit(cache=True, inline="always")
def _depthwise_chunks(job, from_back, x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out):
    rows, chunk = out.shape[0] * out.shape[1], job[DW_CHUNK]
    while True:
        c = next_chunk(job, from_back)
        if c < 0:
            return
        nhwc_3x3_rows(x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out, c * chunk,
                      min(rows, (c + 1) * chunk))


@numba.njit(cache=True, nogil=True, error_model="numpy")
def nhwc_3x3_shared(ctrl, xbuf, scratch, fn, job, kind, x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw,
                    top, left, out, share):
    """nhwc_3x3_vectors, with `share` its rows in chunks taken by this thread and the second core's
    (fn: the C function for x's and out's kind, NHWC_3X3_CHUNKS[kind]'s address; job: the second
    thread's job block, which only a sharing call may use). The same bits either way. Returns 0."""
    if not share:
        nhwc_3x3_vectors(x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out)
        return 0
    nhwc_3x3_job(job, xbuf, kind, x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out)
    seq = post_chunks(ctrl, job, fn)
    _depthwise_chunks(job, False, x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out)
    join_chunks(ctrl, seq)
    return 0


@numba.njit(cache=True)
def nhwc_3x3_job(job, xbuf, kind, x, padded, xz, w, bias, scale, zero, lo, hi, sh, sw, dh, dw, top, left, out):
    """Write nhwc_3x3_vectors' call into a job block (and xbuf), its chunks opened."""
    rows = out.shape[0] * out.shape[1]
    chunk = max(1, -(-rows // DEPTHWISE_CHUNKS))
    job[DW_X_AT], job[DW_N], job[DW_H], job[DW_W], job[DW_C] = x.ctypes.data, x.shape[0], x.shape[1], x.shape[2], x.shape[3]
    job[DW_KIND], job[DW_PADDED_AT], job[DW_W_AT], job[DW_BIAS_AT] = kind, padded.ctypes.data, w.ctypes.data, bias.ctypes.data
    job[DW_OUT_AT], job[DW_OH], job[DW_OW], job[DW_SH], job[DW_SW] = out.ctypes.data, out.shape[1], out.shape[2], sh, sw
    job[DW_DH], job[DW_DW], job[DW_TOP], job[DW_LEFT], job[DW_CHUNK] = dh, dw, top, left, chunk
    job[DW_SCALE_AT], job[DW_SCALES] = scale.ctypes.data, scale.shape[0]
    xbuf[0], xbuf[1], xbuf[2], xbuf[3] = xz, lo, hi, zero
    open_chunks(job, -(-rows // chunk))


def _nhwc_3x3_chunks_of(dtype, out_dtype):
    def chunks(job_at, _1, _2, _3, _4, _5, _6, _7, xbuf_at, _xbuf_size, _scratch_at, _scratch_size):
        # nhwc_3x3_shared's job on the second core's thread: its arrays again from the job block
        job = numba.carray(_pointer(job_at), JOB_SLOTS, np.int64)
        consts = numba.carray(_pointer(xbuf_at), 4, np.float32)
        c = job[DW_C]
        x = numba.carray(_pointer(job[DW_X_AT]), (job[DW_N], job[DW_H], job[DW_W], c), dtype)
        out = numba.carray(_pointer(job[DW_OUT_AT]), (job[DW_N], job[DW_OH], job[DW_OW], c), out_dtype)
        _depthwise_chunks(job, True, x, numba.carray(_pointer(job[DW_PADDED_AT]), c, dtype), consts[0],
                          numba.carray(_pointer(job[DW_W_AT]), (3, 3, c), np.float32),
                          numba.carray(_pointer(job[DW_BIAS_AT]), c, np.float32),
                          numba.carray(_pointer(job[DW_SCALE_AT]), job[DW_SCALES], np.float32), consts[3],
                          consts[1], consts[2], job[DW_SH], job[DW_SW], job[DW_DH], job[DW_DW], job[DW_TOP],
                          job[DW_LEFT], out)
    return chunks


# The thread's part as C functions, one per kind (compiled at import, or read from numba's cache).
NHWC_3X3_CHUNKS = tuple(numba.cfunc(_CFUNC, cache=True)(_nhwc_3x3_chunks_of(*kind)) for kind in KINDS)


# Every compiled entry point by name (the cache test runs each and reads its dispatcher's stats;
# gemm_jit's windows_block and conv_jit's nhwc_3x3_vectors are compiled inside them).
KERNELS = {"windows_shared": windows_shared, "nhwc_3x3_shared": nhwc_3x3_shared,
           **({"int8_shared": int8_shared} if VNNI else {})}
