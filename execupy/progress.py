"""A one-line progress bar on stderr for long stages (export-llm's capture, lowering, writing).

    bar = ProgressBar(enabled=None)              # None: only when stderr is a terminal
    with bar.stage("capturing", total=30) as s:  # total None: a spinner with the time so far
        for layer in layers:
            ...
            s.advance()

The line redraws in place from a small background thread (so a stage torch runs for a
minute still shows time passing) and ends as "capturing: done in 12.3 s". Disabled, every
call is a no-op and no thread starts, so tests and pipes see nothing of it.
Torch-free and dependency-free.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional, TextIO

_WIDTH = 30  # characters of the bar itself
_SPINNER = "|/-\\"
_REDRAW_S = 0.2


class ProgressBar:
    def __init__(self, enabled: Optional[bool] = None, stream: Optional[TextIO] = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = _is_terminal(self.stream) if enabled is None else enabled
        self._lock = threading.Lock()
        self._label, self._total, self._done, self._t0 = "", None, 0, 0.0

    @contextmanager
    def stage(self, label: str, total: Optional[int] = None) -> Iterator["ProgressBar"]:
        """Show `label` while the block runs; `advance()` moves the bar when a total is known."""
        if not self.enabled:
            yield self
            return
        self._label, self._total, self._done, self._t0 = label, total, 0, time.perf_counter()
        stop = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(stop,), daemon=True)
        ticker.start()
        try:
            yield self
        finally:
            stop.set()
            ticker.join()
            self._write(f"\r\033[K{label}: done in {time.perf_counter() - self._t0:.1f} s\n")

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self._done += n

    def line(self) -> str:
        """The bar as it reads now, e.g. 'capturing [#########.....]  12/30  3.4 s'."""
        with self._lock:
            done, total = self._done, self._total
        elapsed = time.perf_counter() - self._t0
        if not total:
            return f"{self._label} {_SPINNER[int(elapsed / _REDRAW_S) % len(_SPINNER)]} {elapsed:5.1f} s"
        filled = min(_WIDTH, _WIDTH * done // total)
        return f"{self._label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {_count(done, total)} {elapsed:5.1f} s"

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(_REDRAW_S):
            self._write("\r\033[K" + self.line())

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream must not break the export
            pass


def _count(done: int, total: int) -> str:
    if total >= 1 << 20:  # bytes
        return f"{done / (1 << 20):6.0f}/{total / (1 << 20):.0f} MiB"
    return f"{done:>{len(str(total))}}/{total}"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
