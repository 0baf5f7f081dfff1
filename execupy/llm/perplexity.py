"""Perplexity of an exported LLM on a text, the way llama.cpp's ``llama-perplexity`` counts it.

    execupy export-llm --gguf model.gguf --max-seq-len 512 --generate-full-logits -o model.pte
    execupy perplexity model.pte --text execupy/llm/data/us_constitution.txt --ctx 512

The text is tokenized once (with BOS when the model adds one) and cut into
non-overlapping windows of ``ctx`` tokens; a trailing part shorter than a window is left
out. Each window starts from an empty KV cache (its first token replaced by BOS when the
model adds one). Only the second half of a window is scored, so that every scored token
has at least ctx/2 tokens of context: with ``first = ctx // 2``, the logits after token
``j`` score token ``j + 1`` for ``j = first .. ctx - 2`` (ctx - 1 - first tokens per window).
PPL = exp(mean negative log-likelihood). Torch-free: it runs the program in our runtime.

A program exported with ``generate_full_logits`` (ExecuTorch's name) returns a row of logits
per token fed, so a window costs ctx / max_prefill_len calls, as llama.cpp scores a batch.
A program that returns the last position only is scored one token per call after the
first half (the same numbers, about max_prefill_len times as many calls).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from execupy.errors import InvalidInputError


@dataclass
class PerplexityResult:
    perplexity: float
    tokens_scored: int
    windows: int
    ctx: int
    text_tokens: int


def log_probs(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """log softmax(logits[i])[targets[i]] for each row i, in float64."""
    x = np.asarray(logits, dtype=np.float64).reshape(len(targets), -1)
    top = x.max(axis=1, keepdims=True)
    norm = np.log(np.exp(x - top).sum(axis=1)) + top[:, 0]
    return x[np.arange(len(targets)), np.asarray(targets)] - norm


def window_log_probs(runner, window: Sequence[int], first: int) -> np.ndarray:
    """log p(window[j + 1] | window[:j + 1]) for j = first .. len(window) - 2, from an empty cache."""
    runner.reset()
    scored = []
    for at, rows in _logit_rows(runner, window[:-1], first):  # the last token is scored, never fed
        skip = max(first - at, 0)  # rows before ``first`` only build the cache
        if skip < len(rows):
            scored.append(log_probs(rows[skip:], window[at + skip + 1:at + len(rows) + 1]))
    return np.concatenate(scored)


def _logit_rows(runner, fed: Sequence[int], first: int) -> Iterator[tuple[int, np.ndarray]]:
    """Feed ``fed`` from an empty cache: (j, rows) where rows[i] are the logits after fed[j + i].
    A full-logits program gives every position, one call per max_prefill_len tokens; else the
    first ``first + 1`` tokens are one prefill (its last row) and the rest go one per call."""
    if runner.full_logits:
        step = runner.meta.max_prefill_len
        for start in range(0, len(fed), step):
            yield start, runner.forward_rows(fed[start:start + step])
        return
    yield first, runner.prefill(fed[:first + 1])[None]
    for j in range(first + 1, len(fed)):
        yield j, runner._forward([fed[j]])[None]


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
    nll, count = 0.0, 0
    for w in range(windows):
        window = list(tokens[w * ctx:(w + 1) * ctx])
        if bos is not None:
            window[0] = bos
        scored = window_log_probs(runner, window, ctx // 2)
        nll -= float(scored.sum())
        count += len(scored)
        if progress is not None:
            progress(w + 1, math.exp(nll / count))
    return PerplexityResult(math.exp(nll / count), count, windows, ctx, len(tokens))
