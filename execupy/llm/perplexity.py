"""Perplexity of an exported LLM on a text, the way llama.cpp's ``llama-perplexity`` counts it.

    execupy perplexity model.pte --text execupy/llm/data/constitution.txt --ctx 128

The text is tokenized once (with BOS when the model adds one) and cut into
non-overlapping windows of ``ctx`` tokens; a trailing part shorter than a window is left
out. Each window starts from an empty KV cache (its first token replaced by BOS when the
model adds one). Only the second half of a window is scored, so that every scored token
has at least ctx/2 tokens of context: with ``first = ctx // 2``, the logits after token
``j`` score token ``j + 1`` for ``j = first .. ctx - 2`` (ctx - 1 - first tokens per window).
PPL = exp(mean negative log-likelihood). Torch-free: it runs the program in our runtime.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from execupy.errors import InvalidInputError


@dataclass
class PerplexityResult:
    perplexity: float
    tokens_scored: int
    windows: int
    ctx: int
    text_tokens: int


def log_prob(logits: np.ndarray, token: int) -> float:
    """log softmax(logits)[token], in float64."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    top = x.max()
    return float(x[token] - top - math.log(np.exp(x - top).sum()))


def perplexity(runner, tokens: list[int], ctx: int, max_windows: Optional[int] = None,
               progress: Optional[Callable[[int, float], None]] = None) -> PerplexityResult:
    """Score ``tokens`` in windows of ``ctx`` with an LLMRunner; ``progress(window, ppl so far)``."""
    if ctx < 4 or ctx > runner.meta.max_seq_len:
        raise InvalidInputError(f"--ctx {ctx} must be between 4 and the program's context, "
                                f"{runner.meta.max_seq_len} tokens")
    windows = len(tokens) // ctx if max_windows is None else min(max_windows, len(tokens) // ctx)
    if windows == 0:
        raise InvalidInputError(f"the text has {len(tokens)} tokens: fewer than one window of {ctx}")
    bos = runner.meta.bos_id if runner.meta.add_bos else None
    first = ctx // 2
    nll, count = 0.0, 0
    for w in range(windows):
        window = list(tokens[w * ctx:(w + 1) * ctx])
        if bos is not None:
            window[0] = bos
        runner.reset()
        logits = runner.prefill(window[:first + 1])
        for j in range(first, ctx - 1):
            nll -= log_prob(logits, window[j + 1])
            count += 1
            if j + 1 < ctx - 1:
                logits = runner._forward([window[j + 1]])
        if progress is not None:
            progress(w + 1, math.exp(nll / count))
    return PerplexityResult(math.exp(nll / count), count, windows, ctx, len(tokens))
