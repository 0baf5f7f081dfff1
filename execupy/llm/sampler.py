"""Next-token sampling over a logits vector, in numpy (torch-free).

The order of the filters follows llama.cpp / HF: repetition penalty, then temperature,
then top-k, top-p (nucleus) and min-p, then a draw from the renormalized distribution.
Temperature 0 is greedy (argmax, after the repetition penalty). The RNG is a seeded
numpy Generator, so the same seed and logits give the same tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import numpy as np


@dataclass
class SamplerConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; keep tokens with p >= min_p * p(top token)
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already seen
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


class Sampler:
    """Chooses the next token: ``sampler.sample(logits, previous_tokens)``."""

    def __init__(self, config: SamplerConfig | None = None, **kwargs) -> None:
        self.config = config or SamplerConfig(**kwargs)

    @functools.cached_property
    def rng(self) -> np.random.Generator:
        """Made at the first draw (from the seed): greedy decoding never draws, and importing
        numpy.random costs a process 6 MiB resident."""
        return np.random.default_rng(self.config.seed)

    def sample(self, logits: np.ndarray, previous: Iterable[int] = ()) -> int:
        c = self.config
        logits = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
        if c.repetition_penalty != 1.0:
            apply_repetition_penalty(logits, previous, c.repetition_penalty)
        if c.temperature == 0:
            return int(np.argmax(logits))
        probs = softmax(logits / c.temperature)
        probs = filter_probs(probs, c.top_k, c.top_p, c.min_p)
        return int(self.rng.choice(probs.size, p=probs))


def apply_repetition_penalty(logits: np.ndarray, previous: Iterable[int], penalty: float) -> None:
    """CTRL-style penalty, in place: a seen token's positive logit is divided by ``penalty``,
    a negative one multiplied, so it always becomes less likely."""
    seen = np.unique(np.fromiter(previous, dtype=np.int64))
    if seen.size == 0:
        return
    values = logits[seen]
    logits[seen] = np.where(values > 0, values / penalty, values * penalty)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def filter_probs(probs: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Zero the probabilities top-k / top-p / min-p exclude and renormalize."""
    order = np.argsort(-probs, kind="stable")  # most likely first; ties keep id order
    sorted_p = probs[order]
    keep = np.ones(probs.size, dtype=bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        before = np.cumsum(sorted_p) - sorted_p
        keep &= before < top_p
    if min_p > 0.0:
        keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True  # the most likely token always survives
    out = np.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()
