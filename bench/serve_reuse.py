"""Time to first token of a conversation's second turn: prompt reuse vs a fresh request.

    .venv/bin/python bench/serve_reuse.py [--model PTE] [--rounds 3] [--max-tokens 24]

Starts `execupy serve` on 127.0.0.1 (default model: the SmolLM2 program the tests cache
in ~/.cache/execupy/tests) and, per round, with the official openai client (streaming):

1. turn one: a user message, answered (its reply is kept);
2. turn two, reused: the conversation so far plus a new user message, sent right after
   turn one, so the KV cache already holds turn one and only the new tokens are prefilled;
3. turn two, fresh: a raw completion with another first token empties the cache, then the
   very same turn-two messages again, prefilled whole.

Printed: median time to first token (from sending to the first streamed text) of (2)
and (3), the prompt and cached token counts the server reported, and the ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.serve.server import running_server  # noqa: E402  (the tests' server launcher)

FIRST = ("I am planning a small vegetable garden on a sunny balcony in a city with hot summers and mild "
         "winters. I have room for about six large pots. Which vegetables would you suggest, and why?")
SECOND = "Which of those needs the least water?"


def default_model() -> Path:
    cache = Path(os.environ.get("EXECUPY_CACHE", Path.home() / ".cache/execupy")) / "tests"
    found = sorted(cache.glob("smollm2-*.pte"))
    if not found:
        sys.exit("no cached SmolLM2 program: run tests/serve/test_serve_smollm2.py once, or pass --model")
    return found[0]


def streamed(client, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str, object]:
    """(seconds to the first text, whole text, usage) of one streamed chat request."""
    start = time.perf_counter()
    first, parts, usage = None, [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                max_tokens=max_tokens, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return (first or time.perf_counter()) - start, "".join(parts), usage


def main() -> None:
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    pte = args.model or default_model()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "execupy-serve-bench.log"
    with running_server(pte, log) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        reused, fresh = [], []
        for k in range(args.rounds):
            question = [{"role": "user", "content": f"{FIRST} (Round {k + 1}.)"}]
            _, reply, _ = streamed(client, pte.stem, question, args.max_tokens)
            turn_two = question + [{"role": "assistant", "content": reply}, {"role": "user", "content": SECOND}]
            reused.append(streamed(client, pte.stem, turn_two, args.max_tokens))
            client.completions.create(model=pte.stem, prompt="Zebra", max_tokens=1)  # empties the cache
            fresh.append(streamed(client, pte.stem, turn_two, args.max_tokens))
            assert reused[-1][1] == fresh[-1][1], "reusing the cache changed the answer"
        print(f"model {pte.name}; {args.rounds} rounds; second turn of {reused[0][2].prompt_tokens} prompt tokens")
        for name, rows in (("reused", reused), ("fresh", fresh)):
            print(f"  {name:<7} time to first token {statistics.median(r[0] for r in rows):7.3f} s "
                  f"(cached tokens: {', '.join(str(r[2].prompt_tokens_details.cached_tokens) for r in rows)})")
        ratio = statistics.median(r[0] for r in fresh) / statistics.median(r[0] for r in reused)
        print(f"  fresh / reused: {ratio:.2f}x")


if __name__ == "__main__":
    main()
