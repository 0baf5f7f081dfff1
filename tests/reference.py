"""Run a .pte in ExecuTorch's own runtime, as an outside reference for the tests.

ExecuTorch lives in its own virtual environment (~/.cache/execupy-reference, or
$EXECUPY_REFERENCE_VENV), built here on first use from the package index with the same
pins as ../shared/tools/reference_run.py (so either builds the venv the other uses), and
is only ever run as a subprocess: tests/reference_worker.py for one program, small
workers for stepwise calls. Nothing here needs ../shared, so the reference tests run on a
user's machine too.

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

WORKER = Path(__file__).resolve().parent / "reference_worker.py"
VENV = Path(os.environ.get("EXECUPY_REFERENCE_VENV", Path.home() / ".cache" / "execupy-reference"))
PINS = ["torch==2.13.0", "executorch==1.5.1"]
TIMEOUT_S = 600
BUILD_TIMEOUT_S = 1800


class ReferenceError(RuntimeError):
    """The reference runtime rejected or failed the program (exit status 3), or the tool broke."""


def skip_reason() -> Optional[str]:
    """Why reference tests cannot run here, or None when they can."""
    if os.environ.get("EXECUPY_SKIP_REFERENCE", "") not in ("", "0"):
        return "EXECUPY_SKIP_REFERENCE is set: not running ExecuTorch's reference runtime"
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
        cmd = [str(reference_python()), str(WORKER), str(model), "--inputs", str(tmp / "inputs.npz"),
               "--out", str(out), "--method", method, "--calls", str(calls)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            raise ReferenceError(f"reference worker exited {proc.returncode}: {_last_lines(proc.stderr)}")
        return _outputs(out, calls)


# Runs inside the reference venv: one loaded program, a sequence of calls with different
# inputs (the state carries over), with ExecuTorch's quantized_decomposed:: kernels and
# optionally its llama:: custom-op kernels.
_STEPS_WORKER = r"""
import sys, numpy as np, torch
import executorch.kernels.quantized  # registers the quantized_decomposed:: kernels
if sys.argv[3] == "1":
    from executorch.extension.llm.custom_ops import custom_ops  # registers the llama:: kernels
from executorch.extension.pybindings.portable_lib import _load_for_executorch
data = np.load(sys.argv[2])
module = _load_for_executorch(sys.argv[1])
outs = {}
for k in range(int(data["steps"])):
    args = tuple(torch.from_numpy(data[f"step{k}_in{i}"]) for i in range(int(data[f"step{k}_n"])))
    results = module.run_method("forward", args)
    outs[f"step{k}_n"] = np.asarray(len(results))
    outs.update({f"step{k}_out{i}": o.numpy() for i, o in enumerate(results)})
np.savez(sys.argv[4], **outs)
"""


def reference_python() -> Path:
    """The reference venv's python, building the venv first if it is not there yet (once,
    a few minutes; a lock keeps parallel test processes from building it twice)."""
    import fcntl

    python, ready = VENV / "bin" / "python", VENV / ".ready"
    if ready.exists():
        return python
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / f".{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            print(f"building ExecuTorch's reference venv at {VENV} ({' '.join(PINS)}), once", file=sys.stderr)
            for cmd in ([sys.executable, "-m", "venv", str(VENV)],
                        [str(python), "-m", "pip", "install", "-q", *PINS]):
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
                if proc.returncode != 0:
                    raise ReferenceError(f"could not build the reference venv ({' '.join(cmd[:4])}...): "
                                         f"{_last_lines(proc.stderr)}; set EXECUPY_SKIP_REFERENCE=1 offline")
            ready.write_text(" ".join(PINS) + "\n")
    return python


def run_reference_steps(pte: os.PathLike | str, steps: Sequence[Sequence[np.ndarray]],
                        llama_ops: bool = False) -> list[list[np.ndarray]]:
    """Load `pte` once in ExecuTorch's runtime and call forward once per step, each with its
    own inputs, in order (mutable state carries from call to call). ExecuTorch's quantized
    kernels are always loaded; `llama_ops` loads its llama:: custom-op kernels too. Returns each call's outputs."""
    with tempfile.TemporaryDirectory(prefix="execupy-ref-") as tmp:
        arrays = {"steps": np.asarray(len(steps))}
        for k, inputs in enumerate(steps):
            arrays[f"step{k}_n"] = np.asarray(len(inputs))
            arrays.update({f"step{k}_in{i}": np.asarray(x) for i, x in enumerate(inputs)})
        np.savez(Path(tmp) / "in.npz", **arrays)
        cmd = [str(reference_python()), "-c", _STEPS_WORKER, str(pte), str(Path(tmp) / "in.npz"),
               "1" if llama_ops else "0", str(Path(tmp) / "out.npz")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        if proc.returncode != 0:
            raise ReferenceError(f"reference worker exited {proc.returncode}: {_last_lines(proc.stderr)}")
        data = np.load(Path(tmp) / "out.npz")
        return [[data[f"step{k}_out{i}"] for i in range(int(data[f"step{k}_n"]))] for k in range(len(steps))]


def _last_lines(text: str, n: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


def run_worker_once(worker: str, cases: str, prefix: str, timeout_s: int = 1800) -> tuple[Path, dict]:
    """Run `worker` (a script for the reference venv taking a cases.json path and a folder) once
    per machine: the folder, under ~/.cache/execupy-conformance, is keyed by a hash of the
    cases, the worker and the venv, and holds what the worker wrote plus its report.json."""
    import hashlib
    import json

    python = reference_python()
    key = hashlib.sha256(f"{cases}{worker}{python}".encode()).hexdigest()[:16]
    folder = Path.home() / ".cache" / "execupy-conformance" / f"{prefix}-{key}"
    if not (folder / "report.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cases.json").write_text(cases)
        proc = subprocess.run([str(python), "-c", worker, str(folder / "cases.json"), str(folder)],
                              capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise ReferenceError(f"ExecuTorch worker exited {proc.returncode}: {proc.stderr[-2000:]}")
    return folder, json.loads((folder / "report.json").read_text())


def worker_case_outputs(folder: Path, name: str) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """(inputs, ExecuTorch's outputs, execupy's outputs) of a program a worker saved as
    `name`.pte with `name`.npz (in0.., out0..)."""
    from execupy.runtime import Module

    data = np.load(folder / f"{name}.npz")
    inputs = [data[f"in{i}"] for i in range(sum(k.startswith("in") for k in data.files))]
    expected = [data[f"out{i}"] for i in range(sum(k.startswith("out") for k in data.files))]
    got = Module(str(folder / f"{name}.pte")).forward(*inputs)
    return inputs, expected, list(got) if isinstance(got, (list, tuple)) else [got]
