"""The `execupy` command line.

    execupy inspect model.pte [--json] [--load]
    execupy run model.pte [--method NAME] [--inputs in.npz | --random-inputs] [--repeat N] [--save out.npz]
                          [--etdump trace.etdp [--debug-buffer trace.bin]]
    execupy verify model.bpte [--rtol R] [--atol A]
    execupy profile model.pte [--inputs in.npz | --random-inputs] [--etrecord R] [--repeat N] -o report.html
    execupy debug model.pte --etrecord R [--inputs in.npz]

LLM commands (export-llm, generate, chat) come from `execupy.llm.cli.register`, `kernels`
from `execupy.devtools.kernel_list`, `profile` and `debug` from `execupy.devtools.cli`, `serve` from `execupy.serve.cli`.
Convention for every subcommand: its parser sets `func=handler` with
`set_defaults`, and `handler(args) -> int` returns the exit status. An
`ExecupyError` (or a missing file) raised by a handler is printed as
`error: <message>` on stderr and exits with status 1, without a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from .errors import ExecupyError, InvalidInputError
from .fileio import atomic_write


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ExecupyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # missing or unreadable files are the user's to fix, not a crash
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .devtools import cli as devtools_cli
    from .devtools import kernel_list as kernels_cli
    from .llm import cli as llm_cli
    from .serve import cli as serve_cli

    parser = argparse.ArgumentParser(
        prog="execupy",
        description="ExecuTorch, written in Python: inspect, run, profile and debug .pte programs with a "
        "numpy-only runtime.",
    )
    parser.add_argument("--version", action="version", version=f"execupy {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_inspect(sub)
    _add_run(sub)
    _add_verify(sub)
    llm_cli.register(sub)
    kernels_cli.register(sub)
    devtools_cli.register(sub)
    serve_cli.register(sub)
    return parser


# ---------------------------------------------------------------------------- inspect


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="describe a .pte file: methods, inputs/outputs, operators, delegates, memory, segments",
        description="Describe a .pte program without running it: header, segments, constants, named data and, "
        "per method, inputs/outputs (dtype, shape, static or dynamic), operator counts, delegates and "
        "planned memory. Works on damaged files too: what cannot be read is listed under 'problems'. "
        "Exit status 0 when the file reads cleanly, 1 when it has problems.",
    )
    p.add_argument("file", help="path of the .pte program")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    p.add_argument("--load", action="store_true",
                   help="also load every method (allocate its memory, bind every instruction) to find more problems")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .devtools.summary import format_summary, summarize

    info = summarize(args.file, load_methods=args.load)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(format_summary(info))
    return 1 if info["problems"] else 0


# ---------------------------------------------------------------------------- run


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run one method of a .pte file and print its outputs and timing",
        description="Load a .pte program, run one of its methods and print each output's dtype, shape and first "
        "values, then the load and execution times. Inputs come from an .npz (arrays in0, in1, ... in "
        "argument order; bfloat16 as uint16 bits named inN__bf16) or are drawn at random from the method's "
        "input shapes (the upper bound for dynamic inputs). Non-tensor inputs are fixed in the program and "
        "are filled in automatically.",
    )
    p.add_argument("file", help="path of the .pte program")
    add_input_options(p)
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="execute N times and report timing (default 1)")
    p.add_argument("--save", metavar="OUT.npz", help="write the outputs as out0, out1, ... to an .npz file")
    p.add_argument("--etdump", metavar="OUT.etdp",
                   help="trace the run and write it as an ETDump (ExecuTorch's Inspector reads it)")
    p.add_argument("--debug-buffer", metavar="OUT.bin",
                   help="with --etdump: also log every intermediate output, their tensors into this file")
    p.set_defaults(func=cmd_run)


def add_input_options(p: argparse.ArgumentParser) -> None:
    """--method and where its inputs come from (read by _pick_method and _inputs); shared with
    the commands that run a program too (profile, debug)."""
    p.add_argument("--method", default=None, help="method to run (default: forward, or the only method)")
    p.add_argument("--inputs", metavar="IN.npz", help="inputs as arrays in0, in1, ... in an .npz file")
    p.add_argument("--random-inputs", action="store_true", help="use random inputs of the method's input shapes")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-inputs (default 0)")


def cmd_run(args: argparse.Namespace) -> int:
    from .runtime import Program

    if args.repeat < 1:
        raise InvalidInputError(f"--repeat must be at least 1, got {args.repeat}")
    t0 = time.perf_counter()
    program = Program.load(args.file)
    name = _pick_method(program.method_names, args.method)
    meta = program.method_meta(name)
    t1 = time.perf_counter()
    tracer = _event_tracer(args)
    method = program.load_method(name, event_tracer=tracer)
    t2 = time.perf_counter()
    inputs = _inputs(meta, args)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        outputs = method.execute(inputs)
        times.append(time.perf_counter() - start)
    _print_outputs(outputs)
    print(f"program load {1e3 * (t1 - t0):.2f} ms, method load {1e3 * (t2 - t1):.2f} ms, "
          f"{meta.num_instructions} instructions")
    print(f"execute: {args.repeat} run(s), mean {1e3 * float(np.mean(times)):.3f} ms, "
          f"min {1e3 * min(times):.3f} ms")
    if args.save:
        arrays = {f"out{k}": np.asarray(o) for k, o in enumerate(outputs)}
        path = args.save if args.save.endswith(".npz") else args.save + ".npz"  # as np.savez names it
        atomic_write(path, lambda f: np.savez(f, **arrays))
        print(f"outputs written to {path}")
    if tracer is not None:
        tracer.save(args.etdump, args.debug_buffer)
        print(f"trace written to {args.etdump}" + (f", debug buffer to {args.debug_buffer}" if args.debug_buffer else ""))
    return 0


def _event_tracer(args: argparse.Namespace):
    """An EventTracer when --etdump asks for a trace, else None (the untraced runtime)."""
    if args.debug_buffer and not args.etdump:
        raise InvalidInputError("--debug-buffer needs --etdump: the buffer only holds what the trace refers to")
    if not args.etdump:
        return None
    from .devtools.tracer import EventTracer

    return EventTracer(log_intermediate_outputs=bool(args.debug_buffer))


# ---------------------------------------------------------------------------- verify


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="run the test cases of a bundled program (.bpte) and compare with its expected outputs",
        description="Load the program embedded in a bundled program (ExecuTorch's .bpte), run every test case "
        "of every method and compare with the expected outputs: |actual - expected| <= atol + rtol * "
        "|expected|. Prints one line per case and a summary. Exit status 0 when all pass, 1 when any "
        "fails, 2 when the file is malformed.",
    )
    p.add_argument("file", help="path of the .bpte bundled program")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    p.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance (default 1e-6)")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from .devtools.bundled_program import format_results, load_bundled_program, verify_bundled_program
    from .errors import MalformedProgramError

    try:
        results = verify_bundled_program(load_bundled_program(args.file), rtol=args.rtol, atol=args.atol)
    except MalformedProgramError as e:
        print(f"error: {args.file}: {e}", file=sys.stderr)
        return 2
    print(format_results(results))
    return 0 if all(r.passed for r in results) else 1


def _pick_method(names: list[str], wanted: Optional[str]) -> str:
    if wanted is None:
        if "forward" in names or len(names) != 1:
            wanted = "forward"
        else:
            return names[0]
    if wanted not in names:
        raise InvalidInputError(f"the program has no method {wanted!r}; its methods are: {', '.join(names) or 'none'}")
    return wanted


def _inputs(meta, args: argparse.Namespace) -> list[Any]:
    """One value per method input: from --inputs, at random, or the fixed value of a non-tensor input."""
    from .runtime import TensorInfo

    tensors = [k for k, info in enumerate(meta.inputs) if isinstance(info, TensorInfo)]
    if args.inputs:
        arrays = _load_npz(args.inputs)
    elif args.random_inputs or not tensors:
        rng = np.random.default_rng(args.seed)
        arrays = {k: _random(info, rng) for k, info in enumerate(meta.inputs) if isinstance(info, TensorInfo)}
    else:
        raise InvalidInputError(
            f"method {meta.name!r} takes {len(tensors)} tensor input(s); give --inputs IN.npz or --random-inputs"
        )
    values = []
    for k, info in enumerate(meta.inputs):
        if not isinstance(info, TensorInfo):
            values.append(info.value)
        elif k in arrays:
            values.append(arrays[k])
        else:
            raise InvalidInputError(f"{args.inputs} has no array in{k} for input {k} ({info.dtype} {info.shape})")
    return values


def _load_npz(path: str) -> dict[int, np.ndarray]:
    import ml_dtypes

    out = {}
    with np.load(path) as data:
        for name in data.files:
            base, _, suffix = name.partition("__")
            if not base.startswith("in") or not base[2:].isdigit():
                continue
            arr = data[name]
            out[int(base[2:])] = arr.view(ml_dtypes.bfloat16) if suffix == "bf16" else arr
    return out


def _random(info, rng: np.random.Generator) -> np.ndarray:
    shape, dtype = info.shape, info.dtype
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if dtype.kind in "iu":
        return rng.integers(0, 4, shape).astype(dtype)  # small: integer inputs are often indices
    return rng.standard_normal(shape).astype(dtype)


def _print_outputs(outputs: list[Any]) -> None:
    for k, out in enumerate(outputs):
        if isinstance(out, np.ndarray):
            flat = out.reshape(-1)
            head = np.array2string(flat[:6].astype(np.float64) if out.dtype.kind == "V" or
                                   str(out.dtype) == "bfloat16" else flat[:6], precision=5, separator=", ")
            more = f" ... ({flat.size} values)" if flat.size > 6 else ""
            print(f"output {k}: {out.dtype} {list(out.shape)} {head}{more}")
        else:
            print(f"output {k}: {type(out).__name__} {out!r}")
