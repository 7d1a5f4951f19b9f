"""Seeded sampling for ``generate``: every sample is a function of its seed and id only.

Hugging Face's sampler draws from the global RNG, so which completion a prompt gets
depends on what else is in the batch, on the number of processes and on the micro-batch
split. :class:`SeededSampler` replaces it by inverse-CDF sampling with counter-based
uniforms: the token drawn for sample ``i`` at step ``t`` is

    the first v with  sum_{w <= v} p(w) > u * sum_w p(w),   u = hash(key_i, t)

an exact draw from ``p`` (the tempered, top-k / top-p filtered distribution) that
depends only on ``(key_i, t)`` and the logits. A run on 2 processes then samples the same
completions as on 1, and a resumed run the same as an uninterrupted one.
"""

from __future__ import annotations

import torch

__all__ = ["SeededSampler", "filter_logits", "hash_uniform", "sample_keys"]

# splitmix64 constants, as signed int64 (torch has no uint64 arithmetic)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (``>>`` is arithmetic on negative values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of 64-bit integers that mixes every bit."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def hash_uniform(keys: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform number in (0, 1) per key: ``u[b] = hash(keys[b], step)``, float64.

    Args:
        keys: [B] int64 per-sample keys (any shape that broadcasts with ``step``).
        step: the generation step (an int, or an int64 tensor of steps).

    Returns:
        float64 in the open interval (0, 1), a deterministic function of (key, step), of
        the broadcast shape of ``keys`` and ``step``.

    Example:
        >>> u = hash_uniform(torch.tensor([1, 2]), 0)
        >>> bool(((u > 0) & (u < 1)).all()), torch.equal(u, hash_uniform(torch.tensor([1, 2]), 0))
        (True, True)
    """
    z = _mix(_mix(keys.to(torch.int64) * _GOLDEN + step))
    # the top 53 bits, centred in their bin: exactly representable, never 0 or 1
    return (_shr(z, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def sample_keys(seed: int, sample_ids: torch.Tensor) -> torch.Tensor:
    """Per-sample keys from a run seed and the samples' global ids."""
    return _mix(sample_ids.to(torch.int64) * _GOLDEN + _mix(torch.tensor(seed, dtype=torch.int64)))


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k, then top-p filtering: the logits outside the kept set become -inf.

    Keeps the ``top_k`` largest logits (0: all; ties with the k-th are kept), then the
    smallest set of most likely tokens whose probability reaches ``top_p`` (a token is
    dropped when the tokens before it already hold ``top_p`` of the mass; 1: all). This is
    the distribution every engine samples from and reports log-probs under.

    Args:
        logits: [..., V] float logits (already divided by the temperature).
        top_k: >= 0.
        top_p: in (0, 1].

    Returns:
        [..., V] logits with -inf outside the kept set.

    Example:
        >>> filter_logits(torch.tensor([[3.0, 2.0, 1.0]]), top_k=2)
        tensor([[3., 2., -inf]])
    """
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already hold top_p of the mass
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class SeededSampler:
    """A ``generate`` logits processor that samples by inverse CDF with hashed uniforms.

    Pass it as ``logits_processor=[sampler]`` with greedy decoding (``do_sample=False``):
    it returns scores that are 0 at the drawn token and -inf elsewhere, so the greedy
    argmax picks the drawn token. It also records ``log p`` of every drawn token under
    the distribution it sampled from (``rollout_log_probs``).

    Args:
        keys: [B] int64 per-sample keys (:func:`sample_keys`).
        prompt_length: P, the (padded) prompt length, to know the step from the ids.
        temperature: > 0; logits are divided by it.
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability is >= top_p; 1 keeps all.
        max_steps: the most tokens a completion can have, to draw every uniform up front
            (the same numbers as drawing them step by step).

    Returns:
        A callable ``(input_ids, scores) -> scores``.

    Example:
        >>> sampler = SeededSampler(torch.tensor([3, 4]), prompt_length=1)
        >>> out = sampler(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 5))
        >>> bool((out.max(-1).values == 0).all()), len(sampler.log_probs)
        (True, 1)
    """

    def __init__(self, keys: torch.Tensor, *, prompt_length: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, max_steps: int | None = None) -> None:
        self.keys = keys
        # all the uniforms of a rollout at once: one small kernel per token less
        self._uniforms = None if max_steps is None else hash_uniform(keys[:, None], torch.arange(max_steps)[None, :])
        self.prompt_length = prompt_length
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.log_probs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_length
        log_p = torch.log_softmax(filter_logits(scores.float() / self.temperature, top_k=self.top_k, top_p=self.top_p), dim=-1)
        cdf = log_p.exp().double().cumsum(-1)
        if self._uniforms is not None and step < self._uniforms.shape[1]:
            u = self._uniforms[:, step, None].to(scores.device)
        else:
            u = hash_uniform(self.keys.to(scores.device), step)[:, None]
        u = u * cdf[:, -1:]
        choice = torch.searchsorted(cdf, u, right=True).clamp(max=scores.shape[-1] - 1)
        self.log_probs.append(log_p.gather(-1, choice).squeeze(-1))
        return torch.full_like(scores, float("-inf")).scatter(-1, choice, 0.0)
