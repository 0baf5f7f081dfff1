"""Whether a call may take the second core now: one rule for every kernel that can split its work.

A mat-vec (an LLM's decode) reads each weight once, so two cores reading half each finish
sooner on an idle machine (SmolLM2 fp32 decode at load 1.3: 47-51 tok/s on two BLAS threads,
35-37 on one). On a busy machine the second thread waits for a core at every call, and a
call that took 0.02 ms takes milliseconds (fp32 decode at load 3.6: 143 ms per token on two
threads, 26 ms on one). The load average cannot tell the two apart: it lags a burst by a
minute, and our own spinning threads count in it. So each call site times itself:

* a site's first call runs on one thread, and every one-thread call is remembered;
* two-thread calls over 10x as slow as the site's last one-thread call, twice within a few
  dozen calls, mean the other core is busy: every site runs on one thread for `BACKOFF_S`
  seconds, then tries two again.

On a busy machine at most one call per back-off pays for a stall; on an idle one both cores
stay on. The kernels using it: numba's quantized mat-vecs (kernels/fast/quantized.py) and
numpy's BLAS products with few rows (runtime/blas_threads.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol


class Site(Protocol):
    serial_s: float  # the site's last one-thread call, seconds (0: none yet)


@dataclass
class CallSite:
    """A call site with nothing else to hold its timing (a BLAS product of one step)."""

    serial_s: float = 0.0


@dataclass
class SecondCore:
    BACKOFF_S = 2.0
    # A stall costs many times a call's time (milliseconds for a call of microseconds). On an
    # idle machine a few in 10,000 two-thread calls are over 10x slow too (a page fault, the
    # garbage collector), so one slow call is not enough: two within a few dozen calls are.
    STALL = 10.0
    DECAY = 0.9  # of the stall count, per two-thread call
    serial_until: float = 0.0  # time.monotonic() before which every site runs on one thread
    stalls: float = 0.0  # recent stalls, each fading by DECAY per two-thread call

    def free(self, site: Site) -> bool:
        """Two threads for this call? Only once the site has a one-thread time to beat."""
        return site.serial_s > 0 and time.monotonic() >= self.serial_until

    def took(self, site: Site, threads: int, seconds: float) -> None:
        """A call's time: one thread's is remembered, two threads' compared with it."""
        if threads == 1:
            site.serial_s = seconds
            return
        self.stalls *= self.DECAY
        if seconds > self.STALL * site.serial_s:
            self.stalls += 1.0
            if self.stalls > 1.0:
                self.serial_until, self.stalls = time.monotonic() + self.BACKOFF_S, 0.0


SECOND_CORE = SecondCore()  # one per process: a stall anywhere says the other core is busy
