"""Which OpenBLAS kernels numpy runs here, and the environment that lets OpenBLAS choose them.

OpenBLAS picks its kernels for the CPU it finds unless OPENBLAS_CORETYPE names a core. The
sandbox these benchmarks were written in exports OPENBLAS_CORETYPE=Haswell (AVX2 kernels) for
every process, on a Zen 5 whose AVX-512 OpenBLAS would otherwise use through its SkylakeX
kernels: a prompt's products [113, 576] x [576, 1536] ran at 230 GFLOP/s pinned and 360-390
free. Only execupy uses OpenBLAS among the engines compared (llama.cpp has its own kernels,
torch its own BLAS, ExecuTorch XNNPACK), so the pin slows our side alone, and a user's machine
does not have it. The benchmarks therefore run execupy with the variable removed and print
the core OpenBLAS chose; `--keep-blas-core` keeps the environment as it is.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

PIN = "OPENBLAS_CORETYPE"


def engine_env(keep_pin: bool, **extra: str) -> dict:
    """This process's environment for an execupy subprocess: without PIN unless `keep_pin`."""
    env = {**os.environ, **extra}
    if not keep_pin:
        env.pop(PIN, None)
    return env


def chosen_core(env: dict) -> str:
    """The core OpenBLAS reports (OPENBLAS_VERBOSE=2) when numpy loads it in `env`, and why."""
    probe = subprocess.run([sys.executable, "-c", "import numpy; numpy.ones((2, 2)) @ numpy.ones((2, 2))"],
                           env={**env, "OPENBLAS_VERBOSE": "2"}, capture_output=True, text=True, timeout=120)
    found = re.search(r"Core:\s*(\S+)", probe.stdout + probe.stderr)
    core = found.group(1) if found else "unknown"
    return f"{core} ({PIN}={env[PIN]} in the environment)" if PIN in env else f"{core} (OpenBLAS's own choice)"
