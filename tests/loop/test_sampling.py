"""Seeded sampling: uniform numbers, exact draws from the filtered distribution, determinism."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchforge.loop.sampling import SeededSampler, hash_uniform, sample_keys

N = 200_000


def _draw(probs: torch.Tensor, n: int = N, **kwargs) -> torch.Tensor:
    """Frequencies of n draws of the sampler from one distribution."""
    sampler = SeededSampler(sample_keys(0, torch.arange(n)), prompt_length=0, **kwargs)
    scores = sampler(torch.zeros(n, 0, dtype=torch.long), probs.log().expand(n, -1))
    return torch.bincount(scores.argmax(-1), minlength=len(probs)).double() / n


def _assert_frequencies(freq: torch.Tensor, expected: torch.Tensor, n: int = N) -> None:
    # each frequency within 5 standard errors of its probability (a 1e-6 false-alarm rate)
    se = (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= 5 * se + 1e-12).all(), (freq, expected)


def test_hash_uniform_is_uniform_and_deterministic():
    u = hash_uniform(torch.arange(100_000), step=3)
    assert u.dtype == torch.float64 and ((u > 0) & (u < 1)).all()
    # mean 1/2 and variance 1/12, to 5 standard errors
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / len(u))
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / len(u))
    assert torch.equal(u, hash_uniform(torch.arange(100_000), step=3))
    # neighbouring keys and steps are not correlated
    v = hash_uniform(torch.arange(100_000), step=4)
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < 0.02
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.02


def test_sampler_draws_from_the_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    _assert_frequencies(_draw(p), p.double())


def test_temperature_top_k_top_p_match_their_definitions():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tempered = p.double() ** 0.5 / (p.double() ** 0.5).sum()  # softmax(log p / 2)
    _assert_frequencies(_draw(p, temperature=2.0), tempered)
    top2 = torch.tensor([0.5, 0.3, 0, 0], dtype=torch.float64) / 0.8
    _assert_frequencies(_draw(p, top_k=2), top2)
    # top_p = 0.75: 0.5 alone is below it, 0.5 + 0.3 reaches it -> the two most likely
    _assert_frequencies(_draw(p, top_p=0.75), top2)
    # top_p = 0.85: needs the third token too
    top3 = torch.tensor([0.5, 0.3, 0.15, 0], dtype=torch.float64) / 0.95
    _assert_frequencies(_draw(p, top_p=0.85), top3)


def test_recorded_log_probs_are_those_of_the_sampling_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampler = SeededSampler(sample_keys(1, torch.arange(64)), prompt_length=2, top_k=3)
    scores = sampler(torch.zeros(64, 2, dtype=torch.long), p.log().expand(64, -1))
    choice = scores.argmax(-1)
    filtered = torch.tensor([0.5, 0.3, 0.15]) / 0.95
    torch.testing.assert_close(sampler.log_probs[0], filtered.log()[choice])
    # the returned scores select exactly one token
    assert ((scores == 0).sum(-1) == 1).all() and torch.isinf(scores).sum() == 64 * 3


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**40), ids=st.lists(st.integers(0, 10**9), min_size=1, max_size=8, unique=True))
def test_a_sample_depends_only_on_its_seed_and_id(seed, ids):
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    ids_t = torch.tensor(ids)

    def draws(order):
        sampler = SeededSampler(sample_keys(seed, ids_t[order]), prompt_length=0)
        return sampler(torch.zeros(len(order), 0, dtype=torch.long), logits.expand(len(order), -1)).argmax(-1)

    forward = draws(torch.arange(len(ids)))
    backward = draws(torch.arange(len(ids)).flip(0))
    assert torch.equal(forward, backward.flip(0))


def test_keys_differ_between_seeds_and_ids():
    keys = sample_keys(0, torch.arange(1000))
    assert len(set(keys.tolist())) == 1000
    assert not torch.equal(keys, sample_keys(1, torch.arange(1000)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_scores(dtype):
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampler = SeededSampler(sample_keys(0, torch.arange(N)), prompt_length=0)
    scores = sampler(torch.zeros(N, 0, dtype=torch.long), p.log().to(dtype).expand(N, -1))
    freq = torch.bincount(scores.argmax(-1), minlength=4).double() / N
    exact = torch.softmax(p.log().to(dtype).double(), -1)  # what the rounded logits say
    _assert_frequencies(freq, exact)
