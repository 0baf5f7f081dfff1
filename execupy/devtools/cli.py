"""The `profile` and `debug` subcommands of the execupy CLI.

    execupy profile model.pte [--inputs in.npz | --random-inputs] [--etrecord model.etrecord] [--repeat N] -o report.html
    execupy debug model.pte --etrecord model.etrecord [--inputs in.npz] [--atol A --rtol R] [--top K]

`profile` runs a method with an EventTracer and writes the HTML report of report.py.
`debug` runs it with intermediate outputs logged, runs the ETRecord's graph in torch eager on
the same inputs, and names the first instruction (in execution order) whose output differs
beyond the tolerance, then the worst ones. Only `debug` needs torch, and only when run.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from ..cli import add_input_options
from ..errors import InvalidInputError


def register(sub) -> None:
    _add_profile(sub)
    _add_debug(sub)


def _traced_run(args: argparse.Namespace, log_intermediate_outputs: bool, repeat: int):
    """(inputs, tracer, method name) after running the chosen method `repeat` times, traced."""
    from ..cli import _inputs, _pick_method
    from ..runtime import Program
    from .tracer import EventTracer

    if repeat < 1:
        raise InvalidInputError(f"--repeat must be at least 1, got {repeat}")
    program = Program.load(args.file)
    name = _pick_method(program.method_names, args.method)
    inputs = _inputs(program.method_meta(name), args)
    tracer = EventTracer(log_intermediate_outputs=log_intermediate_outputs)
    method = program.load_method(name, event_tracer=tracer)
    for _ in range(repeat):
        method.execute(inputs)
    return inputs, tracer, name


# ---------------------------------------------------------------------------- profile


def _add_profile(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="run a .pte traced and write an HTML report: time per operator, a timeline, the table",
        description="Run one method of a .pte program N times with an event tracer and write one self-contained "
        "HTML file (no network needed to view it): a bar chart of the time per operator, a timeline of the "
        "last run and a table per operator (calls, mean/p50/p90/total ms, share of the call). With --etrecord "
        "the table also gives each operator's module and source line. The table is printed too.",
    )
    p.add_argument("file", help="path of the .pte program")
    add_input_options(p)
    p.add_argument("--etrecord", metavar="R", help="the program's ETRecord (module paths and source lines)")
    p.add_argument("--repeat", type=int, default=5, metavar="N", help="traced runs (default 5)")
    p.add_argument("-o", "--output", required=True, metavar="REPORT.html", help="where to write the report")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from .inspector import Inspector
    from .report import render_report, write_report

    _, tracer, name = _traced_run(args, log_intermediate_outputs=False, repeat=args.repeat)
    inspector = Inspector.from_tracer(tracer, args.etrecord, method=name)
    inspector.print_data_tabular(limit=20)
    facts = [f"method {name}, {args.repeat} traced run(s)",
             "inputs: " + (args.inputs or f"random (seed {args.seed})")]
    write_report(args.output, render_report(inspector, Path(args.file).name, [("Execute", name)], facts))
    print(f"report written to {args.output}")
    return 0


# ---------------------------------------------------------------------------- debug


def _add_debug(sub) -> None:
    p = sub.add_parser(
        "debug",
        help="find the first operator whose output differs from torch eager (needs torch and the ETRecord)",
        description="Run one method of a .pte program with every intermediate output logged, and the ETRecord's "
        "exported graph in torch eager on the same inputs (random ones unless --inputs), side by side. "
        "Prints the first operator, in execution order, whose output differs beyond the tolerance "
        "(max |diff| > atol + rtol * max |eager|), with its source line, module path and the gap (L1, MSE, "
        "SNR), then the operators with the lowest SNR. Exit status 0 when every output is within the "
        "tolerance, 1 when one is not.",
    )
    p.add_argument("file", help="path of the .pte program")
    p.add_argument("--etrecord", required=True, metavar="R", help="the program's ETRecord")
    add_input_options(p)
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (default 1e-4)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance, of the largest eager value "
                   "(default 1e-4)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="worst operators to list (default 5)")
    p.set_defaults(func=cmd_debug)


def _torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module entry set to None
        return False


def cmd_debug(args: argparse.Namespace) -> int:
    from .inspector import Inspector, format_gaps

    if not _torch_installed():  # the eager side (devtools/aot) imports it; this module must not
        raise InvalidInputError("execupy debug runs the ETRecord's graph in torch eager; install torch "
                                "(pip install 'execupy[export]')")
    args.random_inputs = args.random_inputs or not args.inputs
    inputs, tracer, name = _traced_run(args, log_intermediate_outputs=True, repeat=1)
    gaps = Inspector.from_tracer(tracer, args.etrecord, method=name).calculate_numeric_gap(inputs=inputs)
    if not gaps:
        raise InvalidInputError(f"no traced output of method {name!r} could be matched to the ETRecord's graph; "
                                "is the ETRecord the one written with this program?")
    first = next((g for g in gaps if g.exceeds(args.atol, args.rtol)), None)
    if first is None:
        print(f"all {len(gaps)} compared operator outputs are within atol {args.atol:g} + rtol {args.rtol:g} "
              "of torch eager")
    else:
        print(f"first operator beyond atol {args.atol:g} + rtol {args.rtol:g}, in execution order:\n"
              f"  instruction {first.instruction_id}: {first.op}\n"
              f"  source: {first.source or 'unknown'}\n"
              f"  module: {first.module_path if first.module_path else '(top-level module)'}\n"
              f"  gap: max |diff| {first.max_abs:.4g} (largest |eager| {first.max_ref:.4g}), "
              f"L1 {first.l1:.4g}, MSE {first.mse:.4g}, SNR {first.snr_db:.1f} dB")
    worst = sorted(gaps, key=lambda g: g.snr_db)[:args.top]
    print(f"\nlowest SNR of {len(gaps)} compared operators:\n" + format_gaps(worst))
    sys.stdout.flush()
    return 0 if first is None else 1
