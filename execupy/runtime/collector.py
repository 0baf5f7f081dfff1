"""Python's cycle collector, paused while a program loads and while a method binds or makes a
call without a shape plan (its first calls).

Those build thousands of small objects (steps, closures, views), and the collector runs
every few hundred allocations: each run walks the young objects, and every tenth or so all
the objects the process holds (numpy's, numba's, the program's). Measured on SmolLM2-135M,
one process each, collector on -> paused: fp32 load 0.45-0.46 -> 0.40-0.41 s and its first
decode step 94-99 -> 56-58 ms (14 collections in that step alone); int4 load 0.87 -> 0.68 s,
its first prompt 267 -> 220 ms. Nothing is lost: what became garbage meanwhile is collected
by the next run after.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused() -> Iterator[None]:
    """The block runs with the collector off; it is back on after if it was on before (a caller
    that turned it off itself keeps it off, and so does a nested pause)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
