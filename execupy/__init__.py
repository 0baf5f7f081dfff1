"""execupy: ExecuTorch, written in Python."""
import os as _os
import sys as _sys

# Read once, when numpy loads OpenBLAS: how long its idle worker threads keep spinning, as 2**n
# CPU cycles (OpenBLAS's default, 28, is about 0.1 s). execupy runs its own threads beside BLAS
# (numba's for a prompt's quantized products, the second core's for decode): after an attention's
# BLAS products OpenBLAS's spinning threads held the cores they wanted (SmolLM2 fp32 decode steps
# 3-5 at 16 ms against 9.5; ExecuTorch's 8da4w program's prompt 165-460 ms against 125-140).
# 2**20 cycles, a fraction of a millisecond, still spans the gaps between a prompt's products.
# Only where execupy is imported before numpy, and never over a value the user set.
if "numpy" not in _sys.modules:
    _os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")
__version__ = "0.1.0"
