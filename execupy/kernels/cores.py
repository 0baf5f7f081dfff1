"""Whether a call may take the second core now: one rule for every kernel that can split its work.

A mat-vec (an LLM's decode) reads each weight once, so two cores reading half each finish
sooner on an idle machine (SmolLM2 fp32 decode at load 1.3: 47-51 tok/s on two BLAS threads,
35-37 on one). On a busy machine the second thread waits for a core at every call, and a
call that took 0.02 ms takes milliseconds (fp32 decode at load 3.6: 143 ms per token on two
threads, 26 ms on one). The load average cannot tell the two apart: it lags a burst by a
minute, and our own spinning threads count in it. So each call site times itself:

* a site's first call runs on one thread, and every one-thread call is remembered; a mat-vec's
  site instead starts from a time assumed from its bytes (`assumed_serial_s`), so that it shares
  from its first call on (each decode step bound anew would otherwise run alone once: SmolLM2
  fp32's second token took 42 ms against 22);
* two-thread calls over 10x as slow as the site's last one-thread call are stalls; when
  stalls lately cost about a tenth of the time, the other core is busy: every site runs on
  one thread for `BACKOFF_S` seconds, then tries two again.

On a busy machine a few stalled calls per back-off (about LOST_S) pay for the retry; on an
idle or merely noisy one both cores stay on. The kernels using it: numba's quantized mat-vecs
(kernels/fast/quantized.py) and numpy's BLAS products (runtime/blas_threads.py).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol


# From this many bytes of weight read (a quantized weight's integers and scales too) a decode
# mat-vec may share its work with the second core's thread (kernels/fast/second_thread.py); below
# it the hand-over costs more than the half saves. SmolLM2: every linear but a quantized k/v
# projection (69-138 KB); float32 k/v (442 KB) shared read 41 GB/s against 25 on one BLAS thread.
SHARE_MIN_BYTES = 160 * 1024


# A mat-vec site's one-thread time before one is measured: its bytes read at this rate, about
# what one core reads (12-25 GB/s on the machines we measured). A stall is 10x that time, far from
# a call on two threads (about half a real one-thread time); a machine reading under 2 GB/s
# would see stalls, back off, and so time its sites on one thread.
ASSUMED_BYTES_PER_S = 20e9


def assumed_serial_s(nbytes: int) -> float:
    return nbytes / ASSUMED_BYTES_PER_S


class Site(Protocol):
    serial_s: float  # the site's last one-thread call, seconds (0: none yet)


@dataclass
class CallSite:
    """A call site with nothing else to hold its timing (a BLAS product of one step)."""

    serial_s: float = 0.0


@dataclass
class PerRow:
    """A prompt product's call site: its one-thread time kept per row of the prompt, so that a
    prompt of another length is held to its own share (set `rows` before each call)."""

    per_row_s: float = 0.0
    rows: int = 1

    @property
    def serial_s(self) -> float:
        return self.per_row_s * self.rows

    @serial_s.setter
    def serial_s(self, seconds: float) -> None:
        self.per_row_s = seconds / self.rows


@dataclass
class SecondCore:
    BACKOFF_S = 2.0
    # A stall costs many times a call's time (milliseconds for a call of microseconds).
    STALL = 10.0
    # What stalls cost lately decides: each adds the time it lost (at most LOST_S / 4, so it
    # takes four: a program's first prompt stalls a couple of times for 10 ms or more while the
    # second vCPU wakes), fading with time constant WINDOW_S, and the rule backs off once
    # LOST_S is reached, i.e. when stalls took about a tenth of the last quarter second.
    # A busy other core stalls every few calls (SmolLM2 fp32 decode with a spinning process on
    # the second core: 2-8 ms stalls 6-50 ms apart). A quiet virtual machine stalls too, but a
    # few times a second (the same decode at load 0.1: 2-8 ms pauses 100-500 ms apart, about 1%
    # of the time), and sending a generation to one thread for that would cost a quarter of it.
    WINDOW_S = 0.25
    LOST_S = 0.02
    serial_until: float = 0.0  # time.monotonic() before which every site runs on one thread
    lost_s: float = 0.0  # time recent stalls lost, fading by WINDOW_S
    last_stall: float = 0.0  # time.monotonic() of the last stall
    own_thread: bool = False  # the second core's own thread has started (kernels/fast/second_thread.py)

    def free(self, site: Site) -> bool:
        """Two threads for this call? Only once the site has a one-thread time to beat."""
        return site.serial_s > 0 and time.monotonic() >= self.serial_until

    def took(self, site: Site, threads: int, seconds: float) -> None:
        """A call's time: one thread's is remembered, two threads' compared with it."""
        if threads == 1:
            site.serial_s = seconds
            return
        if seconds <= self.STALL * site.serial_s:
            return
        now = time.monotonic()
        faded = self.lost_s * math.exp((self.last_stall - now) / self.WINDOW_S)
        self.lost_s, self.last_stall = faded + min(seconds - site.serial_s, self.LOST_S / 4), now
        if self.lost_s >= self.LOST_S:
            self.serial_until, self.lost_s = now + self.BACKOFF_S, 0.0


SECOND_CORE = SecondCore()  # one per process: a stall anywhere says the other core is busy
