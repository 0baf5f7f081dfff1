"""LLM subcommands of the execupy CLI (export-llm, generate, chat).

    execupy export-llm --gguf model.gguf [--max-seq-len 512] -o model.pte
    execupy generate model.pte --prompt "Hello" [--temperature 0.7 --top-p 0.9 --seed 1] [--stats]
    execupy generate model.pte --prompt "Hello" --max-new-tokens 16 --profile report.html
    execupy generate model.pte --raw --prompt $'<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n'
    execupy chat model.pte
    execupy perplexity model.pte --text execupy/llm/data/us_constitution.txt [--ctx 128]

Generated text goes to stdout only; progress, statistics and logs go to stderr. Nothing
here imports torch at module level: only export-llm needs it, and imports it when run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from execupy.llm.config import EXPORT_DTYPES


def register(subparsers) -> None:
    """Add the LLM subcommands to the CLI's argparse subparsers."""
    _add_export(subparsers)
    _add_generate(subparsers)
    _add_chat(subparsers)
    _add_perplexity(subparsers)


# ---------------------------------------------------------------------------- export-llm


def _add_export(sub) -> None:
    p = sub.add_parser("export-llm", help="export a GGUF / Hugging Face / Meta LLM checkpoint to a .pte (needs torch)",
                       description="Export an LLM checkpoint to a .pte with a KV cache, and its tokenizer next to "
                       "it as <OUT stem>.tokenizer.json (or .model). Needs torch.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", metavar="FILE",
                     help="a .gguf file (quantized weights are dequantized to fp32 unless --quantize gguf)")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face folder (config.json + safetensors)")
    src.add_argument("--meta", metavar="DIR", help="a Meta folder (params.json + consolidated.*.pth)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context length of the KV cache (default: the model's, capped at 2048)")
    p.add_argument("--max-prefill-len", type=int, default=None,
                   help="most prompt tokens per forward call (default 128; longer prompts are chunked)")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="fp32",
                   help="dtype of the weights, activations, KV cache and logits (default fp32); fp16 and bf16 "
                        "halve the file and the memory")
    p.add_argument("--no-custom-ops", action="store_true",
                   help="core ATen ops only (the KV cache is updated by index_put and attended in full), "
                        "for runtimes without the llama:: ops such as ExecuTorch's stock one; slower")
    p.add_argument("--backend", choices=("portable", "xnnpack"), default="portable",
                   help="xnnpack: delegate the linears (and fp32 ops around them) to ExecuTorch's XnnpackBackend")
    p.add_argument("--generate-full-logits", action="store_true",
                   help="forward returns the logits of every token fed, not only the last one's "
                        "(ExecuTorch's generate_full_logits): what `execupy perplexity` scores fastest")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar per long stage on stderr (default: only when stderr is a terminal)")
    q = p.add_argument_group("quantization (docs/quantized-llm.md)")
    q.add_argument("--quantize", choices=("int8", "int4", "8da4w", "8da8w", "gguf"), default=None,
                   help="int8: weights int8 per channel; int4: weights int4 in groups; 8da4w / 8da8w: int8 "
                        "per-token activations with int4 grouped / int8 per-channel weights; gguf: keep the "
                        "GGUF's own Q8_0/Q4_0/Q4_1/F16 weights as they are")
    q.add_argument("--group-size", type=int, default=None, metavar="G", help="group size of int4 weights (default 32)")
    q.add_argument("--down-proj-blocks", type=int, default=None, metavar="N",
                   help="8da4w / 8da8w: the FFN down projections round their input to int8 in N blocks per "
                        "token, each with its own scale (default 8: its heavy-tailed channels cost SmolLM2 "
                        "+5.0%% perplexity at 1, +1.6%% at 8); 1 writes ExecuTorch's graph exactly")
    q.add_argument("--embedding-quantize", default=None, metavar="BITS[,G]",
                   help="quantize the token embedding: 8 or 4 bits, per row or in groups of G (e.g. 4,32)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.pte", help="where to write the program")
    p.set_defaults(func=cmd_export_llm)


def cmd_export_llm(args: argparse.Namespace) -> int:
    import warnings

    from execupy.llm.export import export_llm

    # torch 2.13's own pytree code trips its own deprecation warning during export; not the user's concern.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)

    source = args.gguf or args.hf or args.meta
    result = export_llm(source, args.output, max_seq_len=args.max_seq_len, max_prefill_len=args.max_prefill_len,
                        dtype=args.dtype, custom_ops=not args.no_custom_ops, backend=args.backend,
                        quantize=args.quantize, group_size=args.group_size,
                        embedding_quantize=args.embedding_quantize, progress_bar=args.progress,
                        down_proj_blocks=args.down_proj_blocks,
                        generate_full_logits=args.generate_full_logits,
                        progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(f"done in {result.seconds:.1f} s", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- generate / chat


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer file (default: the one next to the .pte)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stats", action="store_true", help="print timing statistics on stderr")
    p.add_argument("--stats-json", action="store_true", help="print timing statistics as JSON on stderr")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with an exported LLM (.pte)",
                       description="Complete a prompt with an exported LLM. Instruct models (those with a chat "
                       "template) get the prompt as a user message unless --raw. Text is streamed to stdout. "
                       "Special tokens the model generates (such as <|im_start|>) print nothing, unless --raw; "
                       "an end-of-sequence token ends generation (unless --ignore-eos) and is not printed.")
    p.add_argument("model", help="the .pte from export-llm")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop once the generated text contains TEXT (repeatable)")
    p.add_argument("--raw", action="store_true",
                   help="raw in, raw out: tokenize the prompt as written, special tokens such as <|im_start|> "
                        "included, without the chat template; print generated special tokens as their text")
    p.add_argument("--profile", metavar="REPORT.html",
                   help="trace every forward call and write an HTML profile of prefill and decode "
                        "(time per operator, a timeline, the table; see `execupy profile`)")
    p.add_argument("--print-token-ids", action="store_true",
                   help='print {"prompt_ids": [...], "generated_ids": [...]} as one JSON line on stderr '
                        "(to check tokenization)")
    _add_sampling(p)
    p.set_defaults(func=cmd_generate)


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="multi-turn chat with an exported instruct LLM (.pte)",
                       description="Interactive chat; the KV cache is kept between turns. Commands: /reset, /quit.")
    p.add_argument("model", help="the .pte from export-llm")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per reply")
    _add_sampling(p)
    p.set_defaults(func=cmd_chat)


def _sampler_config(args: argparse.Namespace):
    from execupy.errors import InvalidInputError
    from execupy.llm.sampler import SamplerConfig

    try:
        return SamplerConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                             repetition_penalty=args.repetition_penalty, seed=args.seed)
    except ValueError as e:
        raise InvalidInputError(str(e)) from None


def _stream(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _print_stats(args: argparse.Namespace, stats) -> None:
    if args.stats:
        print(stats.report(), file=sys.stderr)
    if args.stats_json:
        print(stats.to_json(), file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    from execupy.llm.runner import LLMRunner
    from execupy.llm.sampler import Sampler

    sampler = Sampler(_sampler_config(args))
    tracer = None
    if args.profile:
        from execupy.devtools.tracer import EventTracer

        tracer = EventTracer()
    runner = LLMRunner(args.model, args.tokenizer, event_tracer=tracer)
    chat = bool(runner.tokenizer.chat_template) and not args.raw
    prompt_ids = runner.encode_prompt(args.prompt, chat=chat)
    runner.tokenizer.release_encoder()  # one prompt, encoded: from here on only token bytes are read
    new = runner.generate_tokens(prompt_ids, args.max_new_tokens, sampler, ignore_eos=args.ignore_eos,
                                 callback=_stream, stop=args.stop, special_text=args.raw)
    sys.stdout.write("\n")
    if args.print_token_ids:
        print(json.dumps({"prompt_ids": prompt_ids, "generated_ids": new}), file=sys.stderr)
    _print_stats(args, runner.stats)
    if tracer is not None:
        _write_profile(args, runner, tracer, len(prompt_ids))
    return 0


def _write_profile(args: argparse.Namespace, runner, tracer, prompt_tokens: int) -> None:
    """The HTML profile of a generation: its first forward calls fed the prompt, the rest decoded."""
    from pathlib import Path

    from execupy.devtools.inspector import Inspector
    from execupy.devtools.report import render_report, write_report

    prefill_calls = -(-prompt_tokens // runner.meta.max_prefill_len)
    calls = [b for b in tracer.blocks if b.name == "Execute"]
    for k, block in enumerate(calls):
        block.name = "Prefill" if k < prefill_calls else "Decode"
    sections = [("Prefill", f"prefill: {prompt_tokens} prompt tokens in {prefill_calls} call(s)")]
    if len(calls) > prefill_calls:
        sections.append(("Decode", f"decode: {len(calls) - prefill_calls} call(s) of one token"))
    facts = [f"prompt {prompt_tokens} tokens, {runner.stats.generated_tokens} generated", runner.stats.report()]
    write_report(args.profile, render_report(Inspector.from_tracer(tracer), Path(args.model).name, sections, facts))
    print(f"profile written to {args.profile}", file=sys.stderr)


def _read_line(prompt: str) -> str:
    """input() without readline writes its prompt to stderr on a terminal; keep it on stdout."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def cmd_chat(args: argparse.Namespace) -> int:
    from execupy.llm.runner import ContextLengthError, LLMRunner
    from execupy.llm.sampler import Sampler

    sampler = Sampler(_sampler_config(args))
    runner = LLMRunner(args.model, args.tokenizer)
    print(f"loaded {args.model} in {runner.load_s:.1f} s; context {runner.meta.max_seq_len} tokens. "
          "/reset starts over, /quit (or Ctrl-D) leaves.", file=sys.stderr)
    while True:
        try:
            line = _read_line("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            runner.reset()
            continue
        if not line.strip():
            continue
        try:
            runner.chat(line, args.max_new_tokens, sampler, callback=_stream)
        except ContextLengthError as e:  # the conversation is full; the user may /reset and go on
            print(f"error: {e}; /reset to start a new conversation", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        _print_stats(args, runner.stats)


# ---------------------------------------------------------------------------- perplexity


def _add_perplexity(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of an exported LLM (.pte) on a text file",
                       description="Perplexity as llama.cpp's llama-perplexity reports it: the text in "
                       "non-overlapping windows of --ctx tokens, each from an empty cache, the second half "
                       "of each window scored. Prints PPL and the number of tokens scored. A program exported "
                       "with --generate-full-logits scores a window in ctx / max-prefill-len calls; others "
                       "take one call per scored token.")
    p.add_argument("model", help="the .pte from export-llm")
    p.add_argument("--text", required=True, metavar="FILE", help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, default=None, help="window length in tokens (default: the program's context)")
    p.add_argument("--chunks", type=int, default=None, metavar="N", help="score the first N windows only")
    p.add_argument("--tokenizer", metavar="FILE", help="tokenizer file (default: the one next to the .pte)")
    p.set_defaults(func=cmd_perplexity)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from execupy.errors import InvalidInputError
    from execupy.llm.perplexity import perplexity
    from execupy.llm.runner import LLMRunner

    if args.chunks is not None and args.chunks <= 0:
        raise InvalidInputError(f"--chunks {args.chunks} must be positive")
    runner = LLMRunner(args.model, args.tokenizer)
    try:
        with open(args.text, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"{args.text}: cannot be read as UTF-8 text ({e})") from None
    if not runner.full_logits:
        print("note: this program returns the last position's logits only, so each scored token costs a "
              "call; export-llm --generate-full-logits scores a window in a few calls", file=sys.stderr)
    t0 = time.perf_counter()
    result = perplexity(runner, runner.tokenizer.encode(text), args.ctx or runner.meta.max_seq_len, args.chunks,
                        progress=lambda w, ppl: print(f"[{w}] {ppl:.4f}", file=sys.stderr, flush=True))
    print(f"PPL = {result.perplexity:.4f} over {result.tokens_scored} tokens "
          f"({result.windows} windows of {result.ctx}; the text has {result.text_tokens} tokens)")
    print(f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
