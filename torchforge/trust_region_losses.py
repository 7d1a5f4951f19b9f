"""Alternatives to PPO's hard token clip as the trust region: CISPO, SAPO, GMPO.

- CISPO clips the importance *weight* and detaches it, so a clipped token keeps its
  REINFORCE gradient (PPO's clip removes it);
- SAPO replaces the clip by a smooth sigmoid gate of the ratio;
- GMPO weighs a sequence by the geometric mean of its token ratios, clipped token by token
  in log space.

Same contract as :mod:`torchforge.losses`: ``(loss, metrics)``, float32, the
``aggregation`` argument, nothing from masked positions, 0 on an empty batch.
"""

from __future__ import annotations

import torch

from torchforge.batch import batch_args
from torchforge.errors import (
    check_clip,
    check_log_probs,
    check_non_negative,
    check_per_token,
    check_positive,
    reraise_as,
)
from torchforge.ratios import clamp_log_ratio, ratio_metrics
from torchforge.reduce import Aggregation, masked_mean

__all__ = ["cispo_loss", "gmpo_loss", "sapo_loss"]


@batch_args
def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float,
    clip_high: float,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio.

    ``pg_loss = -sg(clamp(ratio, 1 - clip_low, 1 + clip_high)) * A * log_probs`` with
    the token ratio of :func:`policy_ratio`; ``loss = aggregate(weights * pg_loss,
    mask)``. The weight is detached and the gradient flows through ``log_probs``, so a
    clipped token still gets gradient ``-clamp(ratio) * A * grad log pi`` (PPO's clip
    gives it none).

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        weights: optional [B] or [B, T] float per-token weights; detached.
        clip_low: lower bound ``1 - clip_low`` on the weight; in [0, 1] (1 = no lower
            bound, as in MiniMax-M1).
        clip_high: upper bound ``1 + clip_high``; >= 0.
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.
        with_metrics: compute the metrics (the default); False returns ``{}`` for them and
            skips their cost (the same loss and gradient, bit for bit), as in :func:`ppo_loss`.

    Returns:
        ``(loss, metrics)``: ``clip_frac_low`` / ``clip_frac_high`` (fraction of counted
        tokens whose weight was clipped below / above, whatever the sign of A),
        ``approx_kl``, ``ratio_mean``, ``ratio_min``, ``ratio_max`` as in :func:`ppo_loss`.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.8]])).requires_grad_()
        >>> old = torch.log(torch.tensor([[0.4]]))
        >>> loss, _ = cispo_loss(lp, old, torch.tensor([1.0]), torch.tensor([[True]]),
        ...                      clip_low=1.0, clip_high=0.2)
        >>> loss.backward()
        >>> lp.grad                           # ratio 2 clipped to 1.2: grad = -1.2 * A
        tensor([[-1.2000]])

    References:
        MiniMax-M1, https://arxiv.org/abs/2506.13585
    """
    fn = "cispo_loss"
    check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    clip_high = check_clip(fn, clip_low, clip_high)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    A = check_per_token(fn, "advantages", advantages, log_probs)
    if weights is not None:
        weights = check_per_token(fn, "weights", weights, log_probs)

    # sg: the ratio is a detached weight. Wheres, not products with the mask: a NaN where
    # masked reaches neither value nor gradient (the coefficient is 0 there, and aggregate's
    # where drops the product).
    log_ratio = torch.where(mask, log_probs.detach().float() - old_log_probs.detach().float(), 0.0)
    log_ratio = clamp_log_ratio(log_ratio, max_log_ratio=max_log_ratio)
    ratio = torch.exp(log_ratio)                                # exactly 1 where masked
    coef = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A
    if weights is not None:
        coef = coef * weights
    pg_loss = torch.where(mask, coef, 0.0) * log_probs.float()
    metrics = {}
    if with_metrics:
        with torch.no_grad():
            num_tokens = torch.count_nonzero(mask)
            count = num_tokens.clamp(min=1)
            metrics = {
                "clip_frac_low": torch.count_nonzero(ratio < 1 - clip_low) / count,   # never where masked
                "clip_frac_high": torch.count_nonzero(ratio > 1 + clip_high) / count,
            }
            metrics.update(ratio_metrics(log_ratio, ratio, mask, num_tokens=num_tokens))
    with reraise_as(fn, "aggregation"):
        loss = Aggregation.of(aggregation)(pg_loss, mask)
    return loss, metrics


@batch_args
def sapo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: PPO's hard clip replaced by a smooth, temperature-controlled gate.

    With the token ``ratio`` of :func:`policy_ratio`, ``A = advantages`` and
    ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``:

    ``gate = (4 / tau) * sigmoid(tau * (ratio - 1))``, ``pg_loss = -A * gate``,
    ``loss = aggregate(weights * pg_loss, mask)``.

    The gradient is ``-A * w * ratio * grad log pi`` with ``w = 4 s (1 - s)``,
    ``s = sigmoid(tau * (ratio - 1))``: ``w = 1`` on-policy (the plain policy gradient)
    and decays smoothly as the ratio leaves 1, faster for the larger ``tau``.

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        weights: optional [B] or [B, T] float per-token weights; detached.
        tau_pos: gate temperature where ``A > 0``; > 0.
        tau_neg: gate temperature where ``A <= 0``; > 0 (the paper sets it above
            ``tau_pos``: negative-advantage tokens are damped faster).
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.
        with_metrics: compute the metrics (the default); False returns ``{}`` for them and
            skips their cost (the same loss and gradient, bit for bit), as in :func:`ppo_loss`.

    Returns:
        ``(loss, metrics)``: ``gate_weight_mean``, the masked mean of ``w``; ``approx_kl``,
        ``ratio_mean``, ``ratio_min``, ``ratio_max`` as in :func:`ppo_loss`.

    Example:
        >>> import torch
        >>> lp = torch.zeros(1, 2, requires_grad=True)
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> loss, metrics = sapo_loss(lp, lp.detach(), torch.tensor([1.0]), mask)
        >>> loss                              # gate(1) = (4 / tau) / 2 = 2 for tau = 1
        tensor(-2., grad_fn=<DivBackward0>)
        >>> loss.backward(); lp.grad          # on-policy: -A / 2 per token
        tensor([[-0.5000, -0.5000]])

    References:
        SAPO, C. Gao et al., "Soft Adaptive Policy Optimization",
        https://arxiv.org/abs/2511.20347

    Note:
        The defaults ``tau_pos = 1.0``, ``tau_neg = 1.05`` are TRL's. The gate's value
        carries an offset ``2 / tau`` at ratio 1 (so the loss is not 0 on-policy); only
        its gradient matters. That gradient, ``-A 4 s (1 - s) ratio / N`` under
        token-mean, goes through sigmoid's backward, which forms ``1 - s`` from ``s``:
        with ``tau = 1``, past ratio ~10 (``s`` within 1e-4 of 1) it keeps only float32's
        absolute precision at 1, an error up to ~5e-7 ``ratio |A| / N`` on a gradient that
        is itself below 5e-3 ``|A| / N`` there (relative error ~1e-3 at ratio 10, ~1 at
        17). ``exp(logsigmoid(.))`` is more precise there, and 2.7x slower.
    """
    fn = "sapo_loss"
    check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_positive(fn, "tau_pos", tau_pos, finite=True)
    check_positive(fn, "tau_neg", tau_neg, finite=True)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    A = check_per_token(fn, "advantages", advantages, log_probs)
    if weights is not None:
        weights = check_per_token(fn, "weights", weights, log_probs)

    # A where, not a product with the mask: a NaN where masked reaches neither value nor gradient.
    log_ratio = torch.where(mask, log_probs.float() - old_log_probs.detach().float(), 0.0)
    log_ratio = clamp_log_ratio(log_ratio, max_log_ratio=max_log_ratio)
    ratio = torch.exp(log_ratio)                                # exactly 1 where masked
    tau = torch.where(A > 0, tau_pos, tau_neg)
    # pg_loss = -A * gate, gate = (4 / tau) * sigmoid(tau * (ratio - 1)), times weights: the
    # detached factors form one coefficient, so one product lies on the gradient's path.
    coef = -A * (4 / tau)
    if weights is not None:
        coef = coef * weights
    pg_loss = coef * torch.sigmoid(tau * (ratio - 1))
    metrics = {}
    if with_metrics:
        with torch.no_grad():
            num_tokens = torch.count_nonzero(mask)
            s = torch.sigmoid(tau * (ratio - 1))
            gate_weight = (4 * s * (1 - s)).expand(mask.shape)      # 1 where masked (the ratio is 1)
            metrics = {"gate_weight_mean": torch.where(mask, gate_weight, 0.0).sum() / num_tokens.clamp(min=1)}
            metrics.update(ratio_metrics(log_ratio, ratio, mask, num_tokens=num_tokens))
    with reraise_as(fn, "aggregation"):
        loss = Aggregation.of(aggregation)(pg_loss, mask)
    return loss, metrics


@batch_args
def gmpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "seq-mean-token-mean",
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: the geometric mean of the token ratios, clipped token by token in log space.

    With ``log_ratio = log_probs - old_log_probs`` (0 where ``mask`` is False) and
    ``A = advantages``, each token's log-ratio is clipped on the side its advantage
    pushes it (PPO's min, in log space):

    ``clipped = min(log_ratio, clip_high)`` where ``A > 0``, ``max(log_ratio, -clip_low)``
    where ``A < 0`` (0 where ``A == 0``); ``ratio_b = exp(sum_t clipped_bt / n_b)``,
    ``A_b = sum_t A_bt / n_b`` (over the counted tokens), ``pg_loss_b = -A_b * ratio_b``
    at every counted token of row b, ``loss = aggregate(weights * pg_loss, mask)`` (by
    default ``seq-mean-token-mean``: the mean over sequences, as in the paper).

    ``weights`` scale each token's share of its row's term, as in :func:`ppo_loss`; with
    the default aggregation row b weighs ``mean_t weights_bt`` (its counted tokens), so
    one weight per sequence (``[B]``, e.g. sequence-level importance weights) multiplies
    that sequence's ``-A_b * ratio_b``. A token's weight does not enter ``ratio_b`` or ``A_b``.

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached. The paper's advantages are per
            sequence; per-token ones are averaged over the row (as verl does).
        mask: [B, T] bool, True = the token counts.
        weights: optional [B] or [B, T] float per-token weights >= 0 (e.g. truncated
            importance weights from :mod:`torchforge.corrections`); detached.
        clip_low: the log-ratio of a token with ``A < 0`` is kept above ``-clip_low``; >= 0.
        clip_high: the log-ratio of a token with ``A > 0`` is kept below ``clip_high``; >= 0.
        max_log_ratio: clamp on the sequence log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.
        with_metrics: compute the metrics (the default); False returns ``{}`` for them and
            skips their cost (the same loss and gradient, bit for bit), as in :func:`ppo_loss`.

    Returns:
        ``(loss, metrics)``: ``clip_frac_low`` / ``clip_frac_high`` (fractions of counted
        tokens clipped with ``A < 0`` / ``A > 0``); ``approx_kl`` from the token log-ratio;
        ``ratio_mean``, ``ratio_min``, ``ratio_max`` of the sequence ratio ``ratio_b``
        (each token counted).

    Example:
        >>> import torch
        >>> lp = torch.tensor([[0.5, 0.1]], requires_grad=True)
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> # A > 0: log-ratios 0.5 -> 0.4 and 0.1; ratio = exp((0.4 + 0.1) / 2)
        >>> loss, _ = gmpo_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), mask)
        >>> loss
        tensor(-1.2840, grad_fn=<DivBackward0>)

    References:
        GMPO, Y. Zhao et al., "Geometric-Mean Policy Optimization",
        https://arxiv.org/abs/2507.20673

    Note:
        The defaults ``clip_low = clip_high = 0.4`` are the paper's range
        ``(e^-0.4, e^0.4)``; the bounds are in log space, unlike ``ppo_loss``'s. verl
        averages the loss over every row (``torch.mean``), empty ones included; the
        default aggregation here counts only rows with a counted token.
    """
    fn = "gmpo_loss"
    check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_non_negative(fn, "clip_low", clip_low)
    check_non_negative(fn, "clip_high", clip_high)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    A = check_per_token(fn, "advantages", advantages, log_probs).expand(mask.shape)
    if weights is not None:
        weights = check_per_token(fn, "weights", weights, log_probs)

    # A where, not a product with the mask: a NaN where masked reaches neither value nor gradient.
    log_ratio = torch.where(mask, log_probs.float() - old_log_probs.detach().float(), 0.0)
    clipped = torch.where(
        A > 0, log_ratio.clamp(max=clip_high), torch.where(A < 0, log_ratio.clamp(min=-clip_low), 0.0)
    )
    seq_log_ratio = masked_mean(clipped, mask, dim=-1).unsqueeze(-1)
    ratio = torch.exp(clamp_log_ratio(seq_log_ratio, max_log_ratio=max_log_ratio))
    seq_A = masked_mean(A, mask, dim=-1).unsqueeze(-1)
    pg_loss = (-seq_A * ratio).expand(mask.shape)
    if weights is not None:
        pg_loss = pg_loss * weights
    metrics = {}
    if with_metrics:
        with torch.no_grad():
            # log_ratio is 0 where masked: neither clip flag holds there
            num_tokens = torch.count_nonzero(mask)
            count = num_tokens.clamp(min=1)
            metrics = {
                "clip_frac_low": torch.count_nonzero((log_ratio < -clip_low) & (A < 0)) / count,
                "clip_frac_high": torch.count_nonzero((log_ratio > clip_high) & (A > 0)) / count,
            }
            token_log_ratio = clamp_log_ratio(log_ratio, max_log_ratio=max_log_ratio)
            metrics.update(ratio_metrics(token_log_ratio, torch.exp(token_log_ratio), mask, weighing_ratio=ratio,
                                         num_tokens=num_tokens))
    with reraise_as(fn, "aggregation"):
        loss = Aggregation.of(aggregation)(pg_loss, mask)
    return loss, metrics
