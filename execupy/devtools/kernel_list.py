"""`execupy kernels MODEL.pte [MORE.pte ...] [-o kernels.txt] [--import MODULE]`: the operators a set of programs needs.

Prints each operator with the kernel module that registers it and the programs that use
it, then the backends; `-o` writes the kernel list a deployment keeps and gives the
runtime (`EXECUPY_KERNELS=kernels.txt`, or `execupy.kernels.selection.use_kernel_list`).
`--import MODULE` registers a custom operator's kernels first, so the list names MODULE for
them. Exit status 1 when some operator has no kernel at all (the list would not run them).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "kernels", help="list the operators and backends some .pte programs need; write a kernel list",
        description="List the operators (with the kernel module registering each) and the backends that a set "
        "of programs needs. With -o, write them as a kernel list: EXECUPY_KERNELS=LIST makes the runtime import "
        "only the kernel modules it names.")
    p.add_argument("programs", nargs="+", metavar="MODEL.pte", help="the programs a deployment runs")
    p.add_argument("-o", "--output", metavar="LIST", help="write the kernel list to this file")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first: a module registering custom operators' kernels (repeatable)")
    p.set_defaults(func=cmd_kernels)


def program_needs(path: str) -> tuple[set[str], set[str]]:
    """(operator keys, backend ids) of every method of one program."""
    from execupy.runtime import Program

    program = Program.load(path)
    operators: set[str] = set()
    backends: set[str] = set()
    for name in program.method_names:
        meta = program.method_meta(name)
        operators |= set(meta.operators)
        backends |= set(meta.backends)
    return operators, backends


def cmd_kernels(args: argparse.Namespace) -> int:
    import importlib

    from execupy.kernels.selection import kernel_list_for

    for name in args.imports:
        importlib.import_module(name)
    users: dict[str, list[str]] = defaultdict(list)
    backends: set[str] = set()
    for path in args.programs:
        ops, used_backends = program_needs(path)
        for key in ops:
            users[key].append(path)
        backends |= used_backends
    found, missing = kernel_list_for(users, backends)
    width = max(map(len, users), default=0)
    print(f"{len(users)} operators, {len(found.modules())} kernel modules, {len(backends)} backends "
          f"for {len(args.programs)} program(s)")
    for key in sorted(users):
        where = found.operators.get(key, "NO KERNEL")
        print(f"  {key:<{width}}  {where}  ({', '.join(users[key])})")
    for backend in sorted(backends):
        print(f"  backend {backend}")
    if args.output:
        found.save(args.output, header="programs: " + " ".join(args.programs))
        print(f"kernel list written to {args.output} (use it with EXECUPY_KERNELS={args.output})")
    if missing:
        print(f"error: no kernel registered for {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0
