"""A decode mat-vec or attention shared with a second thread that waits spinning: the numba half of
`execupy.kernels.fast.second_thread` (imported only where numba is installed).

Why not numba's `prange`: its parallel region starts and joins through the threading layer,
and inside a forward call (where its worker has gone idle since the last linear) that cost
SmolLM2's 576..1536-wide linears more than the half they saved. Here the second thread spins
on a control block between calls, so handing it a job costs a cache line's trip (~0.1 us).

A job is one weight's mat-vec in two halves, each one contiguous half of the weight, which the
hardware prefetcher streams (split so that each thread read half of every row, two threads
were slower than one). An 8-bit or 4-bit weight (`quantized_jit`'s panels) is cut into halves
of its panels of output columns, each half summed into its own buffer, 0 at the other's
outputs, then `out = first + second` (the same sum, exact); an XNNPACK qb4w weight into halves of
its panels (blockwise_jit: each panel's outputs computed alone); a float32 weight [n, k] into halves
of its output rows; a decode attention (attention_jit) into the first and second half of its
query heads, each head computed alone. The same two halves are computed (and combined) the same
way whoever runs them, so one thread and two give bit-identical results.

The caller posts the job, runs the first half, then claims the second (a compare-exchange
that names the job's sequence number, so a stale claim fails instead of running an old job's
half on a new job's buffers) unless the second thread claimed it first. A second thread that
is asleep, busy or absent (a forked child) therefore costs nothing, and one that claimed its
half and then lost its core has the half taken back (MIN_WAIT_CYCLES); it reads only its own
copy of x and writes only its own buffer, so finishing a half taken back harms nothing.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit_cache  # noqa: F401  (first: our kernels' cache entries, stamped by folder)
from .attention_jit import decode_attention_heads
from .blockwise_jit import PANEL, activation_bytes, blockwise_panels
from .quantized_jit import byte_panels, nibble_panels

# ---------------------------------------------------------------------------- atomics (LLVM)
# numba has no atomics or raw pointers in nopython code; these emit the LLVM instructions.


def _slot(context, builder, sig, args):
    array_type = sig.args[0]
    array = context.make_array(array_type)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, array_type, array, [args[1]], wraparound=False)


@intrinsic
def load_acquire(typingctx, ctrl, index):
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot(context, builder, sig, args), "acquire", 8)
    return types.int64(ctrl, index), codegen


@intrinsic
def store_release(typingctx, ctrl, index, value):
    def codegen(context, builder, sig, args):
        builder.store_atomic(args[2], _slot(context, builder, sig, args), "release", 8)
        return context.get_dummy_value()
    return types.void(ctrl, index, value), codegen


@intrinsic
def compare_exchange(typingctx, ctrl, index, expected, new):
    """ctrl[index] = new if it holds expected; True when it did."""
    def codegen(context, builder, sig, args):
        pair = builder.cmpxchg(_slot(context, builder, sig, args), args[2], args[3], "acq_rel", "acquire")
        return builder.extract_value(pair, 1)
    return types.boolean(ctrl, index, expected, new), codegen


@intrinsic
def fetch_add(typingctx, ctrl, index, value):
    """ctrl[index] += value, atomically; returns the value before."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _slot(context, builder, sig, args), args[2], "acq_rel")
    return types.int64(ctrl, index, value), codegen


@intrinsic
def _pointer(typingctx, address):
    return types.voidptr(types.int64), lambda context, builder, sig, args: builder.inttoptr(args[0], cgutils.voidptr_t)


@intrinsic
def call_at(typingctx, address, args):
    """Call the C function at `address` (a numba cfunc's) with the tuple `args` (int64, float32):
    one compiled copy, which LLVM cannot inline into the caller and optimize again there."""
    def codegen(context, builder, sig, llargs):
        arg_types = [context.get_value_type(t) for t in sig.args[1]]
        fn = builder.inttoptr(llargs[0], ir.FunctionType(ir.VoidType(), arg_types).as_pointer())
        builder.call(fn, [builder.extract_value(llargs[1], i) for i in range(len(arg_types))])
        return context.get_dummy_value()
    return types.void(address, args), codegen


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (rdtsc on x86): a clock without a system call. Fenced: LLVM may
    otherwise move the read across the work it is meant to time (it did: a caller timed its own
    half as nothing and took every long half back after MIN_WAIT_CYCLES)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter")
        builder.fence("seq_cst")
        cycles = builder.call(fn, [])
        builder.fence("seq_cst")
        return cycles
    return types.int64(), codegen


_sched_yield = types.ExternalFunction("sched_yield", types.int32())


# ---------------------------------------------------------------------------- the control block
# int64 slots; each one both threads write has a cache line (8 slots) to itself.
SEQ = 0  # the posted job's number
CLAIM = 8  # SEQ * 2 + 1 once the second half is claimed (by either thread: a compare-exchange)
RESULT = 16  # SEQ * 4 + PENDING, DONE (the second thread's half is in `scratch`) or TAKEN_BACK
STATE = 24  # ASLEEP, SPINNING or QUIT (the second thread's)
JOB = 32  # GROUPED: addresses of qt, scales, offsets; k, n, groups, group_size, bits. DENSE: w; -, -; k, n.
# BLOCKWISE: words, scales, ksum; k, n (panels * PANEL), -, block (and zp + 128 in xbuf[k]). ATTENTION: key cache, value cache; -; H * D, -, H, S, Hkv, kv_len (and
# ATTENTION_BLOCK; the query in xbuf[:H * D], its scale after it)
# WHOLE: a GROUPED weight's whole mat-vec (the second of a pair reading the same x), fields as GROUPED.
# CALL: the C function at JOB_FN (a numba.cfunc of 12 int64) runs the second half, given the eight
# JOB fields as the caller set them, then xbuf's and scratch's addresses and sizes: how kernels this
# module does not know post a job (xnnpack_gemm_jit's prompt rows). It may read only xbuf and its
# fields' arrays, and write only scratch.
KIND = JOB + 8  # GROUPED (quantized_jit's layouts), DENSE (float32 [n, k]), BLOCKWISE (XNNPACK qb4w), ATTENTION, WHOLE, CALL
ATTENTION_BLOCK = KIND + 1
# Written once (control_block): the addresses of the three halves' compiled copies (see "one copy").
GROUPED_HALF_AT, DENSE_ROWS_AT, ATTENTION_HEADS_AT = KIND + 2, KIND + 3, KIND + 4
JOB_FN = KIND + 5
CTRL_SLOTS = 48
ASLEEP, SPINNING, QUIT = 0, 1, 2
PENDING, DONE, TAKEN_BACK = 0, 1, 2
GROUPED, DENSE, BLOCKWISE, ATTENTION, WHOLE, CALL = 0, 1, 2, 3, 4, 5
HERE, THERE, TAKEN = 0, 1, 2  # where a job's second half ran: see second_half_where
# A caller waits for the second thread's half at most this many cycles, or three times its own
# half, whichever is longer, then takes the half back and runs it itself: a second thread that
# lost its core to another thread (OpenBLAS's spinning after a prompt, another process) would
# otherwise hold the call for a scheduler tick (4 ms against tens of microseconds).
MIN_WAIT_CYCLES = 100_000


@numba.njit(cache=True, inline="always")
def _panels_of_half(panels, half):
    """A quantized weight's half 0 (the first half of its panels) or half 1 (the rest)."""
    middle = panels // 2
    return (0, middle) if half == 0 else (middle, panels)


@numba.njit(cache=True, fastmath=True)
def dense_rows(w, x, r0, r1, out):
    """out[r - r0] = w[r] @ x for the rows r0..r1 of a float32 weight [n, k], four rows at a time
    (each x[i] loaded once for four rows). Both halves of a dense job are this call, so one
    thread and two give the same bits."""
    k = x.shape[0]
    r = r0
    while r + 4 <= r1:
        w0, w1, w2, w3 = w[r], w[r + 1], w[r + 2], w[r + 3]
        a0 = a1 = a2 = a3 = np.float32(0)
        for i in range(k):
            xi = x[i]
            a0 += w0[i] * xi
            a1 += w1[i] * xi
            a2 += w2[i] * xi
            a3 += w3[i] * xi
        out[r - r0], out[r + 1 - r0], out[r + 2 - r0], out[r + 3 - r0] = a0, a1, a2, a3
        r += 4
    for r in range(r, r1):
        row, acc = w[r], np.float32(0)
        for i in range(k):
            acc += row[i] * x[i]
        out[r - r0] = acc


@numba.njit(cache=True, inline="always")
def _dense_middle(n):
    # the first row of a dense job's second half: a multiple of 16, so the halves' outputs
    # (float32) start on their own cache lines
    return n // 32 * 16


@numba.njit(cache=True, inline="always")
def _attention_middle(heads):
    # the first query head of an attention job's second half: the caller takes the odd one
    return (heads + 1) // 2


# ---------------------------------------------------------------------------- one copy of each half
# A job's half must give the same bits whichever thread runs it. A numba function called from two
# jitted callers is linked into both and optimized again inside each, and with fastmath LLVM may
# associate a sum differently in each copy (CI saw it: a shared int8 mat-vec a few ulps off the
# one-thread result, on a machine whose compiler choices differ from ours). So each half is
# compiled once, as a C function (numba.cfunc), and both threads call that copy at its address,
# kept in the control block. Arrays go by address, in C order.

_I64 = types.int64


@numba.cfunc(types.void(*[_I64] * 11), cache=True)
def _grouped_half_c(x, qt, scales, offsets, k, n, groups, group_size, bits, half, part):
    # half 0 or 1 of x @ w.T (quantized_jit.byte_panels or nibble_panels, each thread half of the
    # panels): x [k], qt (quantized_jit's panels for `bits`), scales and offsets panels
    # [P, k / group_size, PANEL], part [n]
    xs = numba.carray(_pointer(x), (k,), np.float32)
    out = numba.carray(_pointer(part), (n,), np.float32)
    panels = -(-n // PANEL)
    shape = (panels, k // group_size, PANEL)
    s, o = numba.carray(_pointer(scales), shape, np.float32), numba.carray(_pointer(offsets), shape, np.float32)
    p0, p1 = _panels_of_half(panels, half)
    out[:] = 0  # at the other half's outputs: the halves' sum is the product, exactly (v + 0 is v)
    if bits == 8:
        byte_panels(xs, numba.carray(_pointer(qt), (panels, k, PANEL), np.int8), s, o, group_size, p0, p1, out)
    else:
        nibble_panels(xs, numba.carray(_pointer(qt), (panels, k // 8, PANEL), np.uint32), s, o, group_size, p0, p1, out)


@numba.cfunc(types.void(*[_I64] * 7), cache=True)
def _dense_rows_c(w, x, k, n, r0, r1, out):
    # dense_rows: w [n, k], x [k], out [r1 - r0]
    dense_rows(numba.carray(_pointer(w), (n, k), np.float32), numba.carray(_pointer(x), (k,), np.float32),
               r0, r1, numba.carray(_pointer(out), (r1 - r0,), np.float32))


@numba.cfunc(types.void(*[_I64] * 8, types.float32, *[_I64] * 4), cache=True)
def _attention_heads_c(q, keys, values, heads, dim, rows, kv_heads, kv_len, scale, block, h0, h1, out):
    # decode_attention_heads: q [heads, dim], caches [rows, kv_heads, dim], out [h1 - h0, dim]
    cache = (rows, kv_heads, dim)
    decode_attention_heads(numba.carray(_pointer(q), (heads, dim), np.float32),
                           numba.carray(_pointer(keys), cache, np.float32),
                           numba.carray(_pointer(values), cache, np.float32), kv_len, scale, block, h0, h1,
                           numba.carray(_pointer(out), (h1 - h0, dim), np.float32))


def control_block() -> np.ndarray:
    """A new control block, with the halves' addresses written in."""
    ctrl = np.zeros(CTRL_SLOTS, np.int64)
    ctrl[GROUPED_HALF_AT], ctrl[DENSE_ROWS_AT] = _grouped_half_c.address, _dense_rows_c.address
    ctrl[ATTENTION_HEADS_AT] = _attention_heads_c.address
    return ctrl


# Each caller below is its kernel's plain call with the control block first (C-order arrays).

@numba.njit(cache=True, inline="always")
def grouped_half(ctrl, x, qt_address, scales, offsets, group_size, bits, half, part):
    call_at(ctrl[GROUPED_HALF_AT], (x.ctypes.data, qt_address, scales.ctypes.data, offsets.ctypes.data,
                                    x.shape[0], part.shape[0], scales.shape[0], np.int64(group_size),
                                    np.int64(bits), np.int64(half), part.ctypes.data))


@numba.njit(cache=True, inline="always")
def dense_rows_at(ctrl, w, x, r0, r1, out):
    n, k = w.shape
    call_at(ctrl[DENSE_ROWS_AT], (w.ctypes.data, x.ctypes.data, k, n, np.int64(r0), np.int64(r1), out.ctypes.data))


@numba.njit(cache=True, inline="always")
def attention_heads_at(ctrl, q, k, v, kv_len, scale, block, h0, h1, out):
    heads, dim = q.shape
    call_at(ctrl[ATTENTION_HEADS_AT], (q.ctypes.data, k.ctypes.data, v.ctypes.data, heads, dim, k.shape[0],
                                       k.shape[1], np.int64(kv_len), np.float32(scale), np.int64(block),
                                       np.int64(h0), np.int64(h1), out.ctypes.data))


@numba.njit(cache=True)
def _run_second_half(ctrl, seq, xbuf, scratch):
    """The second thread's part of job `seq`: claim the second half, run it into `scratch`, say so.
    The fields are read before the claim; a claim that succeeds proves they were this job's."""
    kind, k, n = ctrl[KIND], ctrl[JOB + 3], ctrl[JOB + 4]
    groups, group_size, bits = ctrl[JOB + 5], ctrl[JOB + 6], ctrl[JOB + 7]
    address, second, third, block = ctrl[JOB], ctrl[JOB + 1], ctrl[JOB + 2], ctrl[ATTENTION_BLOCK]
    fn = ctrl[JOB_FN]
    if not compare_exchange(ctrl, CLAIM, seq * 2, seq * 2 + 1):
        return
    if kind == CALL:
        call_at(fn, (address, second, third, k, n, groups, group_size, bits,
                     xbuf.ctypes.data, np.int64(xbuf.shape[0]), scratch.ctypes.data, np.int64(scratch.shape[0])))
        compare_exchange(ctrl, RESULT, seq * 4 + PENDING, seq * 4 + DONE)
        return
    x = xbuf[:k]
    if kind == ATTENTION:  # fields renamed: heads, cache rows, KV heads, kv_len
        heads, rows, kv_heads, kv_len = n, groups, group_size, bits
        dim, middle = k // heads, _attention_middle(heads)
        keys = numba.carray(_pointer(address), (rows, kv_heads, dim), np.float32)
        values = numba.carray(_pointer(second), (rows, kv_heads, dim), np.float32)
        attention_heads_at(ctrl, x.reshape((heads, dim)), keys, values, kv_len, xbuf[k], block, middle, heads,
                           scratch[:(heads - middle) * dim].reshape((heads - middle, dim)))
        compare_exchange(ctrl, RESULT, seq * 4 + PENDING, seq * 4 + DONE)
        return
    scales = numba.carray(_pointer(second), (groups, n), np.float32)
    offsets = numba.carray(_pointer(third), (groups, n), np.float32)
    if kind == DENSE:
        middle = _dense_middle(n)
        dense_rows_at(ctrl, numba.carray(_pointer(address), (n, k), np.float32), x, middle, n, scratch[:n - middle])
    elif kind == BLOCKWISE:  # x holds q + 128; the second half of the panels (xnnpack_gemm_jit)
        block, panels = group_size, n // PANEL
        middle = panels // 2
        xbytes, shifts = np.empty((k // 8, 2), np.int32), np.empty(k // block, np.float32)
        activation_bytes(x, block, xbytes, shifts)
        blockwise_panels(x, xbytes, shifts, numba.carray(_pointer(address), (panels, k // 8, PANEL), np.uint32),
                         numba.carray(_pointer(second), (panels, k // block, PANEL), np.float32),
                         numba.carray(_pointer(third), n, np.float32), xbuf[k], block, middle, panels,
                         scratch[:(panels - middle) * PANEL].reshape((panels - middle, PANEL)))
    elif kind == WHOLE:  # both halves, summed as a one-thread call sums them
        grouped_half(ctrl, x, address, scales, offsets, group_size, bits, 0, scratch[:n])
        grouped_half(ctrl, x, address, scales, offsets, group_size, bits, 1, scratch[n:2 * n])
        _sum_into(scratch[:n], scratch[:n], scratch[n:2 * n])
    else:
        grouped_half(ctrl, x, address, scales, offsets, group_size, bits, 1, scratch[:n])
    compare_exchange(ctrl, RESULT, seq * 4 + PENDING, seq * 4 + DONE)  # fails if the caller took it back


@numba.njit(cache=True, nogil=True)
def second_thread_loop(ctrl, xbuf, scratch, spin_cycles):
    """The second thread: run posted jobs until none came for `spin_cycles` cycles (returns
    ASLEEP; the Python side then waits for a wake-up) or QUIT is asked (returns QUIT)."""
    seen = load_acquire(ctrl, SEQ)
    if seen > 0 and load_acquire(ctrl, CLAIM) == seen * 2:  # woken by a job still unclaimed: take its half
        seen -= 1  # (a long one, the 113 MB head of fp32 SmolLM2, had run alone, the thread asleep again by the next)
    idle_since = cycles()
    while True:
        seq = load_acquire(ctrl, SEQ)
        if seq != seen:
            seen = seq
            _run_second_half(ctrl, seq, xbuf, scratch)
            idle_since = cycles()
        elif load_acquire(ctrl, STATE) == QUIT:
            return QUIT
        elif cycles() - idle_since > spin_cycles:
            store_release(ctrl, STATE, ASLEEP)
            return ASLEEP
        else:
            _sched_yield()


@numba.njit(cache=True, inline="always")
def _sum_into(out, first, second):
    for j in range(out.shape[0]):
        out[j] = first[j] + second[j]


@numba.njit(cache=True, inline="always")
def post_job(ctrl, xbuf, x, kind, address, k, n):
    """Post a job on x (copied: the second thread reads its own x, which may be gone when a
    taken-back half ends); the caller sets the kind's other fields first. Returns its number."""
    xbuf[:k] = x
    ctrl[KIND], ctrl[JOB], ctrl[JOB + 3], ctrl[JOB + 4] = kind, address, k, n
    return publish(ctrl)


@numba.njit(cache=True, inline="always")
def publish(ctrl):
    """Post the job whose fields (and xbuf) the caller has written. Returns its number."""
    seq = ctrl[SEQ] + 1
    store_release(ctrl, RESULT, seq * 4 + PENDING)
    store_release(ctrl, CLAIM, seq * 2)
    store_release(ctrl, SEQ, seq)  # published: everything written before is visible before it
    return seq


@numba.njit(cache=True)
def second_half_where(ctrl, seq, start):
    """Once the caller's own half of job `seq` (begun at cycle `start`) is done: HERE when the
    caller claimed the second half (the thread had not), THERE when the thread ran it (it is in
    `scratch`), TAKEN when the thread was too slow and the caller took it back. On HERE and
    TAKEN the caller runs the second half itself."""
    if compare_exchange(ctrl, CLAIM, seq * 2, seq * 2 + 1):
        return HERE
    deadline = cycles() + max(3 * (cycles() - start), MIN_WAIT_CYCLES)
    while True:
        if load_acquire(ctrl, RESULT) == seq * 4 + DONE:
            return THERE
        if cycles() > deadline and compare_exchange(ctrl, RESULT, seq * 4 + PENDING, seq * 4 + TAKEN_BACK):
            return TAKEN


@numba.njit(cache=True, nogil=True)
def matvec_halves(ctrl, xbuf, scratch, x, qt, scales, offsets, group_size, bits, out, share):
    """out[r] = x[r] @ w.T for each (few) row r, as its two halves summed; with `share` the second
    thread may run the second half (layouts of `quantized_jit`). Returns the halves taken back."""
    k, n = x.shape[1], out.shape[1]
    first, second = np.empty(n, np.float32), np.empty(n, np.float32)
    share = share and k <= xbuf.shape[0] and n <= scratch.shape[0]
    taken_back, seq, start = 0, 0, 0
    for r in range(x.shape[0]):
        where = HERE
        if share:
            ctrl[JOB + 1], ctrl[JOB + 2] = scales.ctypes.data, offsets.ctypes.data
            ctrl[JOB + 5], ctrl[JOB + 6], ctrl[JOB + 7] = scales.shape[0], group_size, bits
            seq = post_job(ctrl, xbuf, x[r], GROUPED, qt.ctypes.data, k, n)
            start = cycles()
        grouped_half(ctrl, x[r], qt.ctypes.data, scales, offsets, group_size, bits, 0, first)
        if share:
            where = second_half_where(ctrl, seq, start)
        if where == THERE:
            _sum_into(out[r], first, scratch)
        else:
            grouped_half(ctrl, x[r], qt.ctypes.data, scales, offsets, group_size, bits, 1, second)
            _sum_into(out[r], first, second)
        taken_back += where == TAKEN
    return taken_back


@numba.njit(cache=True, inline="always")
def _whole_matvec(ctrl, x, qt, scales, offsets, group_size, bits, out):
    # out = x @ w.T for one row, as matvec_halves computes it alone: both halves, then their sum
    n = out.shape[0]
    first, second = np.empty(n, np.float32), np.empty(n, np.float32)
    grouped_half(ctrl, x, qt.ctypes.data, scales, offsets, group_size, bits, 0, first)
    grouped_half(ctrl, x, qt.ctypes.data, scales, offsets, group_size, bits, 1, second)
    _sum_into(out, first, second)


@numba.njit(cache=True, nogil=True)
def matvec_pair(ctrl, xbuf, scratch, x, qt, scales, offsets, qt2, scales2, offsets2, group_size, bits,
                out, out2, share):
    """out = x @ w.T here and out2 = x @ w2.T on the second thread when `share`: two weights too
    small to split (an LLM's k and v projections) read the same row x [1, K] at once. Each is
    computed as matvec_halves computes it alone, so one thread and two give the same bits.
    Returns 1 when the second weight's product was taken back."""
    k, n2 = x.shape[1], out2.shape[1]
    share = share and k <= xbuf.shape[0] and 2 * n2 <= scratch.shape[0]
    where, seq, start = HERE, 0, 0
    if share:
        ctrl[JOB + 1], ctrl[JOB + 2] = scales2.ctypes.data, offsets2.ctypes.data
        ctrl[JOB + 5], ctrl[JOB + 6], ctrl[JOB + 7] = scales2.shape[0], group_size, bits
        seq = post_job(ctrl, xbuf, x[0], WHOLE, qt2.ctypes.data, k, n2)
        start = cycles()
    _whole_matvec(ctrl, x[0], qt, scales, offsets, group_size, bits, out[0])
    if share:
        where = second_half_where(ctrl, seq, start)
    if where == THERE:
        out2[0, :] = scratch[:n2]
    else:
        _whole_matvec(ctrl, x[0], qt2, scales2, offsets2, group_size, bits, out2[0])
    return 1 if where == TAKEN else 0


@numba.njit(cache=True, nogil=True)
def dense_matvec_halves(ctrl, xbuf, scratch, x, w, out, share):
    """out = w @ x for a float32 weight w [n, k] (C order) and x [k]: the first half of w's rows
    here, the second on the second thread when `share` (each half one contiguous run of the
    weight). Returns 1 when the second half was taken back."""
    n, k = w.shape
    middle = _dense_middle(n)
    share = share and k <= xbuf.shape[0] and n - middle <= scratch.shape[0]
    where, seq, start = HERE, 0, 0
    if share:
        ctrl[JOB + 5] = 0  # no scales or offsets
        seq = post_job(ctrl, xbuf, x, DENSE, w.ctypes.data, k, n)
        start = cycles()
    dense_rows_at(ctrl, w, x, 0, middle, out[:middle])
    if share:
        where = second_half_where(ctrl, seq, start)
    if where == THERE:
        out[middle:] = scratch[:n - middle]
    else:
        dense_rows_at(ctrl, w, x, middle, n, out[middle:])
    return 1 if where == TAKEN else 0


@numba.njit(cache=True, nogil=True)
def attention_halves(ctrl, xbuf, scratch, q, k, v, kv_len, scale, block, out, share):
    """attention_jit's decode attention (q [H, D], caches k, v [S, Hkv, D], out [H, D]) with the
    first half of the query heads here and, when `share`, the rest on the second thread. Each
    head is computed alone, so one thread and two give the same bits. Returns 1 when the second
    half was taken back."""
    heads, dim = q.shape
    middle = _attention_middle(heads)
    share = share and heads * dim < xbuf.shape[0] and (heads - middle) * dim <= scratch.shape[0]
    where, seq, start = HERE, 0, 0
    if share:
        xbuf[heads * dim] = scale
        ctrl[JOB + 1], ctrl[JOB + 5], ctrl[JOB + 6], ctrl[JOB + 7] = v.ctypes.data, k.shape[0], k.shape[1], kv_len
        ctrl[ATTENTION_BLOCK] = block
        seq = post_job(ctrl, xbuf, q.reshape(heads * dim), ATTENTION, k.ctypes.data, heads * dim, heads)
        start = cycles()
    attention_heads_at(ctrl, q, k, v, kv_len, scale, block, 0, middle, out[:middle])
    if share:
        where = second_half_where(ctrl, seq, start)
    if where == THERE:
        rest = out[middle:]
        for h in range(heads - middle):
            for d in range(dim):
                rest[h, d] = scratch[h * dim + d]
    else:
        attention_heads_at(ctrl, q, k, v, kv_len, scale, block, middle, heads, out[middle:])
    return 1 if where == TAKEN else 0


KERNELS = {"second_thread_loop": second_thread_loop, "matvec_halves": matvec_halves,
           "dense_matvec_halves": dense_matvec_halves, "attention_halves": attention_halves,
           "matvec_pair": matvec_pair}


# ---------------------------------------------------------------------------- chunks both threads take
# A job of many independent blocks of outputs (a convolution's rows or columns): the caller and
# the second thread each take the next chunk from a counter (`job[NEXT]`, a fetch-add) until none
# is left, each writing its outputs straight into the output array. Unlike the halves above,
# nothing is copied from scratch (a conv's output is megabytes) and nothing is taken back: the
# output is the caller's, so the caller returns only once the thread has finished the chunk it
# holds (`join_chunks`), yielding its core while it waits, so that a thread that lost its core
# gets it back. A chunk's outputs do not depend on who computes them: one thread and two give
# the same bits. The job block (int64, the caller's) holds NEXT and CHUNKS (how many), then the
# kernel's own fields from FIELDS; a CALL job (JOB: the block's address, JOB_FN: the kernel's C
# function, which takes chunks as the caller does) hands it to the thread.
NEXT, CHUNKS, FIELDS = 0, 8, 9  # NEXT on a cache line of its own
JOB_SLOTS = 32


@numba.njit(cache=True, inline="always")
def next_chunk(job, from_back):
    """The next chunk's number, or -1 when none is left. The caller takes chunks from the
    front, the thread from the back (job[NEXT] = front + back << 32): each keeps to its own
    half of every job while both keep pace, so the rows a core wrote are the rows it reads
    next (a conv's output rows are the next layer's input rows, in that core's cache)."""
    while True:
        state = load_acquire(job, NEXT)
        front, back = state & 0xFFFFFFFF, state >> 32
        if front >= back:
            return -1
        taken = back - 1 if from_back else front
        new = front | (taken << 32) if from_back else (front + 1) | (back << 32)
        if compare_exchange(job, NEXT, state, new):
            return taken


@numba.njit(cache=True, inline="always")
def open_chunks(job, chunks):
    """Set a job block's counter to `chunks` chunks, none taken."""
    job[CHUNKS] = chunks
    store_release(job, NEXT, chunks << 32)


@numba.njit(cache=True, inline="always")
def post_chunks(ctrl, job, fn):
    """Post an opened job block (its FIELDS written) for the second thread, its C function at
    `fn`. Returns the job's number."""
    ctrl[KIND], ctrl[JOB], ctrl[JOB_FN] = CALL, job.ctypes.data, fn
    return publish(ctrl)


@numba.njit(cache=True, inline="always")
def join_chunks(ctrl, seq):
    """Once the caller found no chunk left: return when the thread no longer writes. Either the
    caller claims the job first (the thread never started it) or it waits for the thread's DONE."""
    if compare_exchange(ctrl, CLAIM, seq * 2, seq * 2 + 1):
        return
    start = cycles()
    while load_acquire(ctrl, RESULT) != seq * 4 + DONE:
        if cycles() - start > MIN_WAIT_CYCLES:
            _sched_yield()
