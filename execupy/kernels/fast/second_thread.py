"""The second core's thread: shares decode mat-vecs and attention, an XNNPACK program's 4-bit
prompt products (xnnpack_gemm_jit) and a CNN's convolutions (gemm_jit, conv_jit: chunks of rows
taken from both ends) with the calling thread (numba only).

An LLM's decode step runs some 200 mat-vecs of 0.1-1 million weights, each a few tens of
microseconds, one after another with Python between them. A thread pool that sleeps between
calls (numba's `prange`) takes longer to wake than half such a call saves; this one thread
spins on a control block (`second_thread_jit`) while calls keep coming and goes to sleep after
`SPIN_CYCLES` without one (a few milliseconds: decode's gaps are tens of microseconds, and a
prompt's BLAS products then have the core to themselves).

Sharing never waits long for the thread: the caller posts a job, runs the first half, and runs
the second too unless the thread has claimed it; a thread that claimed it and then lost its core
has it taken back. So an asleep, busy or missing thread only means the caller did both. Whether a
call may share at all is `kernels/cores.py`'s rule, applied and timed in `SecondThread.run`.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Optional

import numba
import numpy as np

from .. import cores
from . import second_thread_jit as K

# The spin limit in CPU cycles: 10 million is 2.5-5 ms at 2-4 GHz (the counter's rate is the
# nominal clock, close enough for a limit nobody needs exact).
SPIN_CYCLES = 10_000_000
# The most floats of x and of the second half's results a shared call may have (the second
# thread's copy of x and its results live in buffers of this size, whose pages are touched only
# as used): room for the second half of any LLM head's outputs (SmolLM2's is 24576 floats).
MAX_SHARED = 1 << 20
CORES = numba.config.NUMBA_NUM_THREADS  # NUMBA_NUM_THREADS=1: nothing is shared


class SecondThread:
    def __init__(self) -> None:
        self.ctrl = K.control_block()
        self.xbuf, self.scratch = np.zeros(MAX_SHARED, np.float32), np.zeros(MAX_SHARED, np.float32)
        self.job = np.zeros(K.JOB_SLOTS, np.int64)  # a chunked job's block (second_thread_jit), one job at a time
        self.taken_back = 0  # halves the caller took back from a second thread too slow to finish them
        self.calls = threading.Lock()  # one caller posts at a time; another does its calls alone
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def matvec(self, x: np.ndarray, qt: np.ndarray, scales: np.ndarray, offsets: np.ndarray,
               group_size: int, bits: int, out: np.ndarray, share: bool) -> bool:
        """out = x @ w.T (quantized_jit's layouts); True when it was offered to the second thread."""
        return self.call(K.matvec_halves, (x, qt, scales, offsets, group_size, bits, out), share)

    def dense_matvec(self, x: np.ndarray, w: np.ndarray, out: np.ndarray, share: bool) -> bool:
        """out = w @ x for a float32 weight w [n, k] (C order), x [k] and out [n] (contiguous);
        True when it was offered to the second thread."""
        return self.call(K.dense_matvec_halves, (x, w, out), share)

    def decode_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_len: int, scale: np.float32,
                         block: int, out: np.ndarray, site: Optional[cores.Site]) -> None:
        """attention_jit's decode attention (float32, C order), its query heads split between the
        two cores while the rule of kernels/cores.py says the other one is free (never without a site)."""
        self.run(K.attention_halves, (q, k, v, kv_len, scale, block, out), site)

    def run(self, kernel, args: tuple, site: Optional[cores.Site], threads: Optional[int] = None) -> None:
        """kernel's job (see `call`). With `threads` given, offered to the thread when it is 2 or
        more. Else, for a `site` (a weight big enough to share), offered while the rule of
        kernels/cores.py says the other core is free, and timed for that rule (the site's first
        call runs alone: the time two threads must beat). Else, or with one core, not offered."""
        if threads is not None or site is None or CORES < 2:
            self.call(kernel, args, threads is not None and threads > 1)
            return
        rule = cores.SECOND_CORE
        t0 = time.perf_counter()
        shared = self.call(kernel, args, rule.free(site))
        rule.took(site, 2 if shared else 1, time.perf_counter() - t0)

    def call(self, kernel, args: tuple, share: bool) -> bool:
        """kernel(ctrl, xbuf, scratch, *args, share), a `second_thread_jit` job poster that returns
        the halves it took back; True when it was offered to the second thread."""
        if share and self.calls.acquire(blocking=False):
            try:
                if self.ctrl[K.STATE] == K.ASLEEP:
                    self._wake_up()
                self.taken_back += kernel(self.ctrl, self.xbuf, self.scratch, *args, True)
                return True
            finally:
                self.calls.release()
        kernel(self.ctrl, self.xbuf, self.scratch, *args, False)
        return False

    def _wake_up(self) -> None:
        # This call runs without it: the thread takes a while to start spinning, and claims
        # only what is left when it does.
        if self.thread is None:
            self.load_loop()
        self.ctrl[K.STATE] = K.SPINNING
        if self.thread is None:
            cores.SECOND_CORE.own_thread = True  # BLAS's small products now leave the second core to it
            self.thread = threading.Thread(target=self._run, name="execupy-second-core", daemon=True)
            self.thread.start()
        self.wake.set()

    def load_loop(self) -> None:
        """Compile the thread's loop (or read it from numba's cache, ~8 ms) in this thread: a
        process that ends while a daemon thread is inside LLVM aborts at exit. Called by the
        first wake-up, or earlier, at load, by the decode kernels' warm-up."""
        quit_now = np.zeros(K.CTRL_SLOTS, np.int64)
        quit_now[K.STATE] = K.QUIT
        K.second_thread_loop(quit_now, self.xbuf, self.scratch, SPIN_CYCLES)

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            if K.second_thread_loop(self.ctrl, self.xbuf, self.scratch, SPIN_CYCLES) == K.QUIT:
                return

    def stop(self) -> None:
        """Ask the thread to leave (at exit: it may be spinning inside compiled code)."""
        self.ctrl[K.STATE] = K.QUIT
        self.wake.set()

    def _forked(self) -> None:
        # A forked child has no such thread: start afresh (jobs would be done by the caller alone anyway).
        self.ctrl[:] = K.control_block()
        self.calls, self.wake, self.thread = threading.Lock(), threading.Event(), None


SECOND_THREAD = SecondThread()
atexit.register(SECOND_THREAD.stop)
os.register_at_fork(after_in_child=SECOND_THREAD._forked)
