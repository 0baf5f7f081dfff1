"""Run a .pte in ExecuTorch's own runtime through ../shared/tools/reference_run.py.

The tool runs in its own virtual environment (built once under ~/.cache/execupy-reference)
and is called as a subprocess, so executorch is never imported here. One call loads the
program once and runs one method `calls` times with the same inputs.

Set EXECUPY_SKIP_REFERENCE=1 to skip every test that needs it (e.g. offline, where the
venv cannot be built).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import ml_dtypes
import numpy as np

TOOL = Path(__file__).resolve().parents[2] / "shared" / "tools" / "reference_run.py"
TIMEOUT_S = 600  # the first call may build the venv (a few minutes)


class ReferenceError(RuntimeError):
    """The reference runtime rejected or failed the program (exit status 3), or the tool broke."""


def skip_reason() -> Optional[str]:
    """Why reference tests cannot run here, or None when they can."""
    if os.environ.get("EXECUPY_SKIP_REFERENCE", "") not in ("", "0"):
        return "EXECUPY_SKIP_REFERENCE is set: not running ExecuTorch's reference runtime"
    if not TOOL.is_file():
        return f"reference tool not found at {TOOL}"
    return None


def _input_arrays(inputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """Name inputs the way the tool expects: inN, inN__bf16 (uint16 bits), inN__scalar."""
    arrays = {}
    for i, value in enumerate(inputs):
        if isinstance(value, np.ndarray) and value.dtype == ml_dtypes.bfloat16:
            arrays[f"in{i}__bf16"] = value.view(np.uint16)
        elif isinstance(value, np.ndarray):
            arrays[f"in{i}"] = value
        else:
            arrays[f"in{i}__scalar"] = np.asarray(value)
    return arrays


def _outputs(path: Path, calls: int) -> list[list[np.ndarray]]:
    """Outputs per call, in order; bfloat16 outputs come back as ml_dtypes.bfloat16."""
    data = np.load(path)
    per_call: list[dict[int, np.ndarray]] = [{} for _ in range(calls)]
    for name in data.files:
        call, rest = 0, name
        if calls > 1:
            prefix, rest = name.split("_", 1)  # call{k}_out{i}...
            call = int(prefix[len("call"):])
        index, _, suffix = rest[len("out"):].partition("__")
        array = data[name]
        if suffix == "bf16":
            array = array.view(ml_dtypes.bfloat16)
        per_call[call][int(index)] = array
    return [[outs[i] for i in sorted(outs)] for outs in per_call]


def run_reference(
    pte: bytes | os.PathLike | str, inputs: Sequence[Any], method: str = "forward", calls: int = 1
) -> list[list[np.ndarray]]:
    """Load `pte` (bytes or a path) once in the reference runtime and call `method`
    `calls` times with `inputs`; returns the outputs of each call."""
    with tempfile.TemporaryDirectory(prefix="execupy-ref-") as tmp:
        tmp = Path(tmp)
        if isinstance(pte, (bytes, bytearray, memoryview)):
            model = tmp / "model.pte"
            model.write_bytes(pte)
        else:
            model = Path(pte)
        np.savez(tmp / "inputs.npz", **_input_arrays(inputs))
        out = tmp / "out.npz"
        cmd = [sys.executable, str(TOOL), str(model), "--inputs", str(tmp / "inputs.npz"),
               "--out", str(out), "--method", method, "--calls", str(calls)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            raise ReferenceError(f"reference_run exited {proc.returncode}: {_last_lines(proc.stderr)}")
        return _outputs(out, calls)


def _last_lines(text: str, n: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-n:])
