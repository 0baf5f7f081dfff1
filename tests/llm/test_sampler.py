"""Sampler: greedy, temperature, top-k, top-p, min-p, repetition penalty, and seeded determinism."""

from __future__ import annotations

import numpy as np
import pytest

from execupy.llm.sampler import Sampler, SamplerConfig, filter_probs, softmax

RNG = np.random.default_rng(0)
LOGITS = RNG.standard_normal(50) * 2


def draws(sampler: Sampler, n: int, logits=LOGITS, previous=()) -> list[int]:
    return [sampler.sample(logits, previous) for _ in range(n)]


def test_greedy_is_argmax_and_ignores_the_seed():
    assert draws(Sampler(seed=1), 5) == [int(np.argmax(LOGITS))] * 5
    assert Sampler(seed=1).sample(LOGITS) == Sampler(seed=2).sample(LOGITS)


def test_same_seed_same_tokens_different_seed_different_tokens():
    make = lambda seed: Sampler(temperature=1.0, top_p=0.95, seed=seed)  # noqa: E731
    assert draws(make(7), 40) == draws(make(7), 40)
    assert draws(make(7), 40) != draws(make(8), 40)


def test_temperature_one_draws_from_the_softmax():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    counts = np.bincount(draws(Sampler(temperature=1.0, seed=3), 4000, logits), minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


def test_low_temperature_sharpens_high_temperature_flattens():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    cold = np.bincount(draws(Sampler(temperature=0.2, seed=4), 2000, logits), minlength=3) / 2000
    hot = np.bincount(draws(Sampler(temperature=5.0, seed=4), 2000, logits), minlength=3) / 2000
    assert cold[0] > 0.85 and hot[0] < 0.45 and hot[2] > 0.25


def test_top_k_limits_the_support():
    top5 = set(np.argsort(-LOGITS)[:5].tolist())
    got = set(draws(Sampler(temperature=2.0, top_k=5, seed=5), 500))
    assert got == top5  # all five appear at this temperature, nothing else does


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.25, 0.15, 0.1])
    np.testing.assert_allclose(filter_probs(probs, top_p=0.7), [0.5 / 0.75, 0.25 / 0.75, 0, 0])
    np.testing.assert_allclose(filter_probs(probs, top_p=0.1), [1, 0, 0, 0])  # the top token always stays


def test_min_p_drops_tokens_far_below_the_top():
    probs = np.array([0.6, 0.3, 0.07, 0.03])
    np.testing.assert_allclose(filter_probs(probs, min_p=0.1), [0.6 / 0.97, 0.3 / 0.97, 0.07 / 0.97, 0])


def test_repetition_penalty_makes_seen_tokens_less_likely():
    logits = np.array([2.0, 1.9, -1.0, -1.1])
    assert Sampler().sample(logits) == 0
    assert Sampler(repetition_penalty=1.5).sample(logits, previous=[0, 0]) == 1  # 2.0 / 1.5 < 1.9
    # A negative logit is multiplied, so it also drops instead of rising.
    penalized = Sampler(temperature=1.0, repetition_penalty=2.0, seed=6)
    counts = np.bincount(draws(penalized, 3000, logits, previous=[2]), minlength=4)
    plain = np.bincount(draws(Sampler(temperature=1.0, seed=6), 3000, logits), minlength=4)
    assert counts[2] < plain[2] / 2


def test_combined_filters_sample_only_survivors():
    probs = softmax(LOGITS / 0.8)
    kept = filter_probs(probs, top_k=10, top_p=0.9, min_p=0.05)
    survivors = set(np.flatnonzero(kept).tolist())
    got = set(draws(Sampler(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, seed=9), 300))
    assert got <= survivors and len(survivors) <= 10
    assert kept.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(min_p=1.5),
                                 dict(repetition_penalty=0)])
def test_invalid_settings_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplerConfig(**bad)
