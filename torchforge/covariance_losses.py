"""Losses that keep entropy from collapsing by the token covariance: Clip-Cov and KL-Cov.

A token's contribution to the covariance between its log-prob and its advantage,
``cov_t = (A_t - mean(A)) * (log_probs_t - mean(log_probs))``, is what drives the policy's
entropy down (Cui et al.); these losses restrain the few tokens where it is largest.

Same contract as :mod:`torchforge.losses`: ``(loss, metrics)``, float32, the
``aggregation`` argument, nothing from masked positions, 0 on an empty batch.
"""

from __future__ import annotations

import torch

from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    check_log_probs,
    check_non_negative,
    check_per_token,
    check_positive,
    reraise_as,
)
from torchforge.losses import ppo_surrogate
from torchforge.ratios import clamp_log_ratio, ratio_metrics
from torchforge.reduce import Aggregation, masked_mean

__all__ = ["clip_cov_loss", "kl_cov_loss"]


def _covariance(A, log_probs, mask) -> torch.Tensor:
    """Per-token ``(A - mean A) * (log_probs - mean log_probs)``, means over counted tokens."""
    lp = torch.where(mask, log_probs.detach().float(), 0.0)
    A = A.expand(mask.shape)
    return (A - masked_mean(A, mask)) * (lp - masked_mean(lp, mask))


def _first_k(keys: torch.Tensor, selectable: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Bool [B, T]: the ``k`` selectable positions with the smallest ``keys`` (all of them
    if fewer). ``k`` is a tensor (no device sync); ``k_max >= k`` is known from the shape,
    so one ``topk`` of ``k_max`` does it."""
    keys = torch.where(selectable, keys, torch.inf).flatten()
    k_max = min(k_max, keys.numel())
    index = torch.topk(keys, k_max, largest=False, sorted=True).indices
    chosen = torch.zeros_like(keys, dtype=torch.bool)
    chosen[index] = torch.arange(k_max, device=keys.device) < k
    return selectable & chosen.view(selectable.shape)


def _selection_count(fn, select_frac, num_tokens, mask) -> tuple[torch.Tensor, int]:
    """``k = max(floor(select_frac * N), 1)`` with ``N = num_tokens`` the counted tokens (a
    tensor: no sync), and its bound from the shape, ``max(floor(select_frac * B * T), 1)``."""
    if not 0 < select_frac <= 1:
        raise InvalidArgumentError(f"{fn}: select_frac must be in (0, 1], got {select_frac}")
    return torch.floor(select_frac * num_tokens).clamp(min=1), max(int(select_frac * mask.numel()), 1)


@batch_args
def clip_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    select_frac: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    generator: torch.Generator | None = None,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: the PPO loss, with the gradient of a few high-covariance tokens detached.

    With ``pg_loss`` the clipped surrogate of :func:`ppo_loss` and, over the counted
    tokens, ``cov_t = (A_t - mean(A)) * (log_probs_t - mean(log_probs))`` (the token's
    contribution to the covariance that drives entropy collapse):

    the candidates are the counted tokens not already clipped by PPO with
    ``cov_low < cov_t < cov_high``; ``k = max(floor(select_frac * N), 1)`` of them (N the
    counted tokens) are drawn uniformly at random; ``pg_loss_t = sg(pg_loss_t)`` at the
    drawn tokens (no gradient), ``loss = aggregate(pg_loss, mask)``.

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        clip_low, clip_high: the PPO clip, as in :func:`ppo_loss`.
        select_frac: the fraction r of counted tokens whose gradient is detached; in (0, 1].
        cov_low, cov_high: the covariance band the detached tokens are drawn from;
            ``cov_low < cov_high``.
        generator: the ``torch.Generator`` of the random draw (on the device of
            ``log_probs``); None uses the global one.
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: ``cov_clip_frac``, the fraction of counted tokens detached;
        ``clip_frac_low``, ``clip_frac_high``, ``approx_kl``, ``ratio_mean``,
        ``ratio_min``, ``ratio_max`` as in :func:`ppo_loss`.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -3.0, -5.0, -7.0]], requires_grad=True)
        >>> A = torch.tensor([[2.0, 1.0, -1.0, -2.0]]); mask = torch.ones(1, 4, dtype=torch.bool)
        >>> # cov = (A - 0) * (lp + 4) = [6, 1, 1, 6]; in (1, 7): the two with cov 6;
        >>> # k = floor(0.5 * 4) = 2 of them are detached
        >>> loss, m = clip_cov_loss(lp, lp.detach(), A, mask, select_frac=0.5, cov_high=7.0)
        >>> m["cov_clip_frac"]
        tensor(0.5000)

    References:
        G. Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
        Language Models", https://arxiv.org/abs/2505.22617

    Note:
        Defaults (r = 2e-4, band (1, 5)) are the paper's and verl's. The covariance uses
        the means of this call's counted tokens, as verl does (not global ones). verl
        multiplies the drawn tokens' loss by 0; the paper detaches their gradient, as
        here: the gradient is the same, the loss value keeps their term.
    """
    fn = "clip_cov_loss"
    with reraise_as(fn):
        pg_loss, ratio, metrics = ppo_surrogate(
            log_probs, old_log_probs, advantages, mask, clip_low=clip_low, clip_high=clip_high,
            max_log_ratio=max_log_ratio,
        )
    if not cov_low < cov_high:
        raise InvalidArgumentError(f"{fn}: cov_low must be < cov_high, got cov_low={cov_low}, cov_high={cov_high}")
    num_tokens = torch.count_nonzero(mask)
    k, k_max = _selection_count(fn, select_frac, num_tokens, mask)
    with torch.no_grad():
        A = check_per_token(fn, "advantages", advantages, log_probs)
        cov = _covariance(A, log_probs, mask)
        clip_high = clip_low if clip_high is None else clip_high
        clipped = ((ratio < 1 - clip_low) & (A < 0)) | ((ratio > 1 + clip_high) & (A > 0))
        candidates = mask & ~clipped & (cov > cov_low) & (cov < cov_high)
        draw = torch.rand(mask.shape, generator=generator, device=log_probs.device)
        detached = _first_k(draw, candidates, k, k_max)
        metrics["cov_clip_frac"] = torch.count_nonzero(detached) / num_tokens.clamp(min=1)
    pg_loss = torch.where(detached, pg_loss.detach(), pg_loss)
    with reraise_as(fn, "aggregation"):
        loss = Aggregation.of(aggregation)(pg_loss, mask)
    return loss, metrics


@batch_args
def kl_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    select_frac: float = 2e-4,
    kl_coef: float = 1.0,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: the unclipped surrogate, with a KL penalty on the highest-covariance tokens.

    With the token ``ratio`` and ``log_ratio`` of :func:`policy_ratio` and, over the
    counted tokens, ``cov_t = (A_t - mean(A)) * (log_probs_t - mean(log_probs))``:

    the ``k = max(floor(select_frac * N), 1)`` counted tokens of largest ``cov_t`` (N the
    counted tokens) are selected; ``pg_loss = -A * ratio + kl_coef * |log_ratio| *
    selected``, ``loss = aggregate(pg_loss, mask)``. No clip: the penalty replaces it.

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        select_frac: the fraction k of counted tokens penalized; in (0, 1].
        kl_coef: the penalty's weight (beta in the paper); >= 0.
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: ``kl_cov_frac``, the fraction of counted tokens penalized;
        ``kl_abs``, the masked mean of ``|log_ratio|``; ``approx_kl``, ``ratio_mean``,
        ``ratio_min``, ``ratio_max`` as in :func:`ppo_loss`.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.5, -2.0]]); mask = torch.ones(1, 2, dtype=torch.bool)
        >>> # cov = (A - 0) * (lp + 1.5) = [0.5, 0.5]; k = 1: a tie, topk takes the first
        >>> loss, m = kl_cov_loss(lp, old, torch.tensor([[1.0, -1.0]]), mask, select_frac=0.5)
        >>> loss                              # (-e^0.5 + |0.5| + 1) / 2
        tensor(-0.0744, grad_fn=<DivBackward0>)

    References:
        G. Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
        Language Models", https://arxiv.org/abs/2505.22617

    Note:
        Defaults (k = 2e-4, beta = 1) are verl's. The covariance uses the means of this
        call's counted tokens, as verl does. Ties in ``cov`` are broken by ``torch.topk``,
        as in verl (on CPU, the earlier position).
    """
    fn = "kl_cov_loss"
    check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_non_negative(fn, "kl_coef", kl_coef)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    num_tokens = torch.count_nonzero(mask)
    k, k_max = _selection_count(fn, select_frac, num_tokens, mask)
    A = check_per_token(fn, "advantages", advantages, log_probs)

    # A where, not a product with the mask: a NaN where masked reaches neither value nor gradient.
    log_ratio = torch.where(mask, log_probs.float() - old_log_probs.detach().float(), 0.0)
    clamped_log_ratio = clamp_log_ratio(log_ratio, max_log_ratio=max_log_ratio)
    ratio = torch.exp(clamped_log_ratio)
    with torch.no_grad():
        selected = _first_k(-_covariance(A, log_probs, mask), mask, k, k_max)
    pg_loss = -A * ratio + torch.where(selected, kl_coef * log_ratio.abs(), 0.0)

    with torch.no_grad():
        count = num_tokens.clamp(min=1)
        metrics = {"kl_cov_frac": torch.count_nonzero(selected) / count,
                   "kl_abs": log_ratio.abs().sum() / count}  # 0 where masked
        metrics.update(ratio_metrics(clamped_log_ratio, ratio, mask, num_tokens=num_tokens))
    with reraise_as(fn, "aggregation"):
        loss = Aggregation.of(aggregation)(pg_loss, mask)
    return loss, metrics
