#!/usr/bin/env python3
"""Per-instruction overhead of execupy's runtime beside ExecuTorch's own, on the same .pte.

The program is a chain of N tiny ops (x = x * a; x = x + b; ... on 4-element float32
tensors), so the time per call is almost all dispatch: fetching arguments, calling the
kernel, storing the result. Both runtimes run the very same file.

    .venv/bin/python bench/runtime_overhead.py [--sizes 200,500,1000] [--repeat 200] [--keep DIR]

Steps:
1. In ExecuTorch's reference venv (~/.cache/execupy-reference, see
   ../shared/tools/reference_run.py; override with $EXECUPY_REFERENCE_VENV) this same
   file runs with `--reference-worker`: it exports each chain with torch.export ->
   to_edge -> to_executorch and times `_load_for_executorch(...).run_method` on it.
   That is a separate process: execupy itself never imports executorch.
2. Here, execupy's runtime loads the same files and times `Method.execute` three ways:
   fused as loaded by default (the chain is one step, numba loops: docs/fusion.md rule 3),
   fused without numba (EXECUPY_NUMBA=0: one generated function of numpy calls), and
   unfused (`fuse=False`: one step per instruction, the portable kernels).
3. It prints, per size, the instructions in the plan, us/instruction (median time per
   call / instructions) for each, and each one's ratio to ExecuTorch's, plus the marginal
   cost per instruction (slope of a line fit over the sizes, which removes the fixed
   per-call cost such as input copies and the pybind conversion). The column "no-op
   kernels" reruns the unfused plan with every kernel replaced by one that returns `out`
   untouched: the runtime's own dispatch cost, without numpy. The last column runs the
   plan with an EventTracer attached (profile events only, which turns fusion off): the
   cost of tracing when it is on.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ELEMENTS = 4


def _inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(ELEMENTS).astype(np.float32)
    a = np.full(ELEMENTS, 0.9, np.float32)  # |x| converges towards b / (1 - a): no overflow however long
    b = np.full(ELEMENTS, 0.1, np.float32)
    return [x, a, b]


def time_calls(call: Callable[[], object], repeat: int) -> float:
    """Median seconds per call over batches (after a warm-up), robust to a busy machine."""
    for _ in range(3):
        call()
    batch = max(1, repeat // 10)
    samples = []
    for _ in range(max(1, repeat // batch)):
        start = time.perf_counter()
        for _ in range(batch):
            call()
        samples.append((time.perf_counter() - start) / batch)
    return statistics.median(samples)


# ---------------------------------------------------------------------------- reference side


def chain_model(n: int):
    """The torch module of a chain of n ops: x = x * a; x = x + b; ... (torch imported here)."""
    import torch

    class Chain(torch.nn.Module):
        def forward(self, x, a, b):
            for _ in range(n // 2):
                x = x * a
                x = x + b
            return x

    return Chain()


def reference_worker(sizes: list[int], directory: Path, repeat: int) -> dict:
    """Runs inside the reference venv: export each chain, time ExecuTorch's runtime on it."""
    import torch
    from executorch.exir import to_edge
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    inputs = tuple(torch.from_numpy(v) for v in _inputs())
    out = {}
    for n in sizes:
        path = directory / f"chain_{n}.pte"
        if not path.exists():
            program = to_edge(torch.export.export(chain_model(n), inputs)).to_executorch()
            path.write_bytes(program.buffer)
        module = _load_for_executorch(str(path))
        result = module.run_method("forward", inputs)[0].numpy()
        seconds = time_calls(lambda: module.run_method("forward", inputs), repeat)
        out[n] = {"path": str(path), "seconds_per_call": seconds, "output": result.tolist()}
    return out


def run_reference(sizes: list[int], directory: Path, repeat: int) -> dict:
    venv = Path(os.environ.get("EXECUPY_REFERENCE_VENV", Path.home() / ".cache" / "execupy-reference"))
    python = venv / "bin" / "python"
    if not python.exists():
        sys.exit(f"no reference venv at {venv}: run ../shared/tools/reference_run.py once to create it")
    proc = subprocess.run(
        [str(python), __file__, "--reference-worker", "--sizes", ",".join(map(str, sizes)),
         "--repeat", str(repeat), "--keep", str(directory)],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"reference worker failed:\n{proc.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


# ---------------------------------------------------------------------------- our side


@dataclass
class Ours:
    instructions: int
    fused: float  # seconds per call, as loaded by default
    fused_numpy: float  # fused with EXECUPY_NUMBA=0
    unfused: float
    dispatch: float  # unfused, with no-op kernels
    tracing: float  # with an EventTracer attached
    load_fused: float  # seconds to load the method fused (numba's compile or its disk cache included)
    outputs: list = field(default_factory=list)


@contextlib.contextmanager
def _numba_off():
    """EXECUPY_NUMBA=0 while a method is bound (chains read it at load)."""
    before = os.environ.get("EXECUPY_NUMBA")
    os.environ["EXECUPY_NUMBA"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["EXECUPY_NUMBA"]
        else:
            os.environ["EXECUPY_NUMBA"] = before


def run_ours(path: str, repeat: int) -> Ours:
    sys.path.insert(0, str(REPO))
    from execupy.devtools.tracer import EventTracer
    from execupy.runtime import Program, get_kernel, register_kernel

    program = Program.load(path)
    inputs = _inputs()
    started = time.perf_counter()
    method = program.load_method("forward")
    load_fused = time.perf_counter() - started
    seconds = time_calls(lambda: method.execute(inputs), repeat)
    with _numba_off():
        fused_numpy = program.load_method("forward")
    numpy_seconds = time_calls(lambda: fused_numpy.execute(inputs), repeat)
    unfused = program.load_method("forward", fuse=False)
    unfused_seconds = time_calls(lambda: unfused.execute(inputs), repeat)
    outputs = [m.execute(inputs)[0] for m in (method, fused_numpy, unfused)]
    # The same plan with kernels that only hand back `out`: what is left is pure dispatch.
    operators = program.method_meta("forward").operators
    real = {key: get_kernel(key) for key in operators}
    try:
        for key in operators:
            register_kernel(key, override=True)(lambda *args: args[-1])
        noop = program.load_method("forward", fuse=False)
        dispatch = time_calls(lambda: noop.execute(inputs), repeat)
    finally:
        for key, fn in real.items():
            register_kernel(key, override=True)(fn)
    tracer = EventTracer()  # profiling only, as `execupy run --etdump` without --debug-buffer
    traced = program.load_method("forward", event_tracer=tracer)
    tracing = time_calls(lambda: (tracer.blocks.clear(), traced.execute(inputs)), repeat)
    return Ours(program.method_meta("forward").num_instructions, seconds, numpy_seconds, unfused_seconds, dispatch,
                tracing, load_fused, outputs)


def slope(xs: list[int], ys: list[float]) -> float:
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0]) if len(xs) > 1 else ys[0] / xs[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="200,500,1000", help="chain lengths (ops per program), comma-separated")
    parser.add_argument("--repeat", type=int, default=200, help="timed calls per size and runtime")
    parser.add_argument("--keep", help="directory for the .pte files (default: a temporary one)")
    parser.add_argument("--reference-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    if args.reference_worker:
        print(json.dumps(reference_worker(sizes, Path(args.keep), args.repeat)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.keep or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        reference = run_reference(sizes, directory, args.repeat)
        rows = []
        for n in sizes:
            ours = run_ours(reference[n]["path"], args.repeat)
            expected = np.asarray(reference[n]["output"], np.float32)
            for name, result in zip(("fused", "fused numpy", "unfused"), ours.outputs):
                if not np.allclose(result, expected, rtol=1e-5, atol=1e-6):
                    sys.exit(f"chain {n} ({name}): outputs differ between runtimes: {result} vs {expected}")
            if not (np.array_equal(ours.outputs[0], ours.outputs[2]) and np.array_equal(ours.outputs[1], ours.outputs[2])):
                sys.exit(f"chain {n}: the fused plans are not bit-equal to the unfused one")
            rows.append((ours, reference[n]["seconds_per_call"]))

    print(f"runtime overhead: chains of tiny ops on {ELEMENTS}-element float32 tensors, "
          f"median of {args.repeat} calls each; us per instruction (ratio to ExecuTorch)")
    header = ["instructions", "ExecuTorch", "ours fused", "ours fused, numpy", "ours unfused",
              "unfused, no-op kernels", "traced", "load fused s"]
    print("  ".join(f"{h:>22}" if k else f"{h:>12}" for k, h in enumerate(header)))
    kinds = ("fused", "fused_numpy", "unfused", "dispatch", "tracing")
    for ours, ref in rows:
        us = [1e6 * x / ours.instructions for x in [ref] + [getattr(ours, k) for k in kinds]]
        print(_row(str(ours.instructions), us) + f"  {ours.load_fused:>22.3f}")
    counts = [ours.instructions for ours, _ in rows]
    marginal = [slope(counts, [ref for _, ref in rows])] + [slope(counts, [getattr(o, k) for o, _ in rows]) for k in kinds]
    print(_row("marginal", [1e6 * x for x in marginal]))


def _row(label: str, us: list[float]) -> str:
    """ExecuTorch's us per instruction, then each of ours with its ratio to it."""
    cells = [f"{us[0]:>22.3f}"] + [f"{u:>12.3f} ({u / us[0]:>6.2f}x)" for u in us[1:]]
    return f"{label:>12}  " + "  ".join(cells)


if __name__ == "__main__":
    main()
