"""Off-policy corrections between the generation engine and the trainer.

- :func:`truncated_importance_weights` (TIS): detached, capped weights between the
  training engine's log-probs and the generation engine's (``rollout_log_probs``);
- :func:`ratio_mask` (MIS / IcePop): 0/1 weights that drop tokens or whole sequences
  whose ratio leaves ``[low, high]``;
- :func:`unscored_tokens`: the counted tokens whose log-ratio is NaN, which the two above
  give weight 0.

Every ratio is formed at one of ``CORRECTION_LEVELS``: per token, per sequence (the
geometric mean of the token ratios) or per sequence as the product, always in log space
(``exp(min(log_ratio, log(cap)))``, bounds compared as logs), so nothing overflows.

The filters return float 0/1 *weights* for the losses' ``weights=`` argument, never a new
mask: the mask stays, so a token-mean still divides by every counted token (as verl,
TRL, OpenRLHF and the IcePop paper do), and weights compose by multiplication
(``weights = tis * ratio_mask(...) * high_entropy_mask(...)``, the last from
:mod:`torchforge.entropy_selection`).

None of them carries gradient; all are float32 (or bool) whatever the input dtype.

References:
    F. Yao, L. Liu et al., "Your efficient RL framework secretly brings you off-policy RL
    training", https://fengyao.notion.site/off-policy-rl (2025); IcePop (Ring-1T),
    https://arxiv.org/abs/2510.18855; IMPALA, https://arxiv.org/abs/1802.01561
"""

from __future__ import annotations

import math

import torch

from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    check_choice,
    check_float,
    check_mask,
    check_same_shape,
    check_tensor,
)
from torchforge.reduce import masked_mean

__all__ = [
    "CORRECTION_LEVELS",
    "ratio_mask",
    "truncated_importance_weights",
    "unscored_tokens",
]

# How a sequence's ratio is formed from its token log-ratios, for every correction here:
# "token": each token its own; "sequence": the geometric mean exp(mean_t log_ratio)
# (length-normalized, as GSPO's ratio); "sequence-product": the product exp(sum_t log_ratio),
# the importance weight of the whole sample.
CORRECTION_LEVELS = ("token", "sequence", "sequence-product")


def _log_ratio(fn, old_log_probs, rollout_log_probs, mask) -> torch.Tensor:
    """``old_log_probs - rollout_log_probs`` in float32, detached, 0 where ``mask`` is False."""
    check_tensor(fn, "old_log_probs", old_log_probs, ndim=2)
    check_float(fn, "old_log_probs", old_log_probs)
    check_same_shape(fn, "rollout_log_probs", rollout_log_probs, "old_log_probs", old_log_probs)
    check_float(fn, "rollout_log_probs", rollout_log_probs)
    check_mask(fn, mask, "old_log_probs", old_log_probs)
    return torch.where(mask, old_log_probs.detach().float() - rollout_log_probs.detach().float(), 0.0)


def _level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The [B, T] log-ratio of ``level``: per token, or the row's (broadcast over its tokens).

    A NaN token log-ratio makes its row's sequence log-ratio NaN: the sequence is unknown.
    """
    if level == "token":
        return log_ratio
    if level == "sequence":
        return masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    return log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)


@batch_args
def truncated_importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
) -> torch.Tensor:
    """Truncated importance weights (TIS) from the generation engine to the trainer.

    With ``log_ratio = old_log_probs - rollout_log_probs`` (log pi_train - log pi_rollout
    of the sampled tokens, 0 where masked) and ``n_b`` the counted tokens of row b:

    - ``level="token"``: ``weights = min(exp(log_ratio), cap)``;
    - ``level="sequence-product"``: ``weights_bt = min(exp(sum_t log_ratio_bt), cap)``,
      the importance weight of the whole sequence (the product of the token ratios),
      broadcast over its tokens (verl's and TRL's sequence-level TIS);
    - ``level="sequence"``: ``weights_bt = min(exp(sum_t log_ratio_bt / n_b), cap)``, the
      geometric mean of the token ratios (verl's "geometric" mode).

    Computed as ``exp(min(log_ratio, log(cap)))``, so nothing overflows. Multiply the
    per-token policy loss by them (``weights=`` of :func:`~torchforge.losses.ppo_loss`).

    Args:
        old_log_probs: [B, T] float log-probs of the sampled tokens under the trainer's
            policy at sampling time (``log_probs.detach()`` when on-policy).
        rollout_log_probs: [B, T] float log-probs reported by the generation engine.
        mask: [B, T] bool, True = the token counts.
        level: one of ``CORRECTION_LEVELS``: ``"token"``, ``"sequence"`` (geometric
            mean) or ``"sequence-product"``.
        cap: the truncation C > 0 (finite).

    Returns:
        [B, T] float32 weights in ``[0, cap]``, detached; 0 where ``mask`` is False and
        where the log-ratio is NaN (see :func:`unscored_tokens`; at the sequence levels,
        on the whole row).

    Example:
        >>> import torch
        >>> old = torch.log(torch.tensor([[0.5, 0.9]])); rollout = torch.log(torch.tensor([[0.25, 0.9]]))
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> truncated_importance_weights(old, rollout, mask)                # ratios 2, 1
        tensor([[2., 1.]])
        >>> truncated_importance_weights(old, rollout, mask, cap=1.5, level="sequence-product")
        tensor([[1.5000, 1.5000]])

    References:
        F. Yao, L. Liu et al., "Your efficient RL framework secretly brings you off-policy
        RL training", https://fengyao.notion.site/off-policy-rl (2025); truncated IS:
        Espeholt et al., IMPALA, https://arxiv.org/abs/1802.01561

    Note:
        ``level="sequence"`` meant the product before ``"sequence-product"`` existed; it
        now means the geometric mean, as in :func:`ratio_mask` and GSPO's sequence ratio,
        so that one word means one thing across torchforge. The product degenerates fast
        with length; prefer ``"token"`` or ``"sequence"``.
    """
    fn = "truncated_importance_weights"
    log_ratio = _log_ratio(fn, old_log_probs, rollout_log_probs, mask)
    check_choice(fn, "level", level, CORRECTION_LEVELS)
    if not (0 < cap < math.inf):
        raise InvalidArgumentError(f"{fn}: cap must be a finite number > 0, got {cap}")
    log_ratio = _level_log_ratio(log_ratio, mask, level)
    weights = torch.exp(log_ratio.clamp(max=math.log(cap)))
    return torch.where(mask & ~torch.isnan(log_ratio), weights, 0.0)


@batch_args
def ratio_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    level: str = "token",
) -> torch.Tensor:
    """0/1 weights that drop the tokens (or sequences) whose train / rollout ratio leaves [low, high].

    With ``log_ratio = old_log_probs - rollout_log_probs`` and ``r`` the ratio of ``level``:

    - ``level="token"`` (IcePop): ``r_bt = exp(log_ratio_bt)``;
    - ``level="sequence"`` (sequence MIS, geometric): ``r_b = exp(sum_t log_ratio_bt / n_b)``,
      the geometric mean of the counted token ratios;
    - ``level="sequence-product"``: ``r_b = exp(sum_t log_ratio_bt)``, the product of the
      token ratios (TRL's and verl's default sequence filter);

    and ``ratio_mask = float(mask & (low <= r <= high))``, compared in log space. A
    sequence level keeps or drops a row whole.

    Pass the result as ``weights=`` of the loss (multiplied with any IS weights) and keep
    ``mask`` as the mask: dropped tokens then contribute 0 while the token-mean still
    divides by every counted token. IcePop's full correction ``M(k) = k * 1[low <= k <=
    high]`` is ``truncated_importance_weights(..., cap=high) * ratio_mask(...)``.

    Args:
        old_log_probs: [B, T] float log pi_train of the sampled tokens at sampling time.
        rollout_log_probs: [B, T] float log pi_rollout from the generation engine.
        mask: [B, T] bool, True = the token counts.
        low: lower bound on the ratio, >= 0 (IcePop: 0.5).
        high: upper bound, > low (IcePop: 5 in the Ring-1T paper; 2 also common).
        level: one of ``CORRECTION_LEVELS``.

    Returns:
        [B, T] float32 weights in {0, 1}, detached; 0 where ``mask`` is False and where the
        log-ratio is NaN (the whole row at a sequence level; see :func:`unscored_tokens`).

    Example:
        >>> import torch
        >>> old = torch.log(torch.tensor([[0.9, 0.9, 0.9]]))
        >>> rollout = torch.log(torch.tensor([[0.9, 0.1, 0.8]]))
        >>> mask = torch.ones(1, 3, dtype=torch.bool)
        >>> ratio_mask(old, rollout, mask, low=0.5, high=2.0)       # ratios 1, 9, 1.125
        tensor([[1., 0., 1.]])
        >>> ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence")  # (9 * 1.125)^(1/3) = 2.16
        tensor([[0., 0., 0.]])

    References:
        IcePop: Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for
        Trillion-Scale Thinking Model" (Ring-1T), https://arxiv.org/abs/2510.18855;
        masked importance sampling: F. Yao et al., https://fengyao.notion.site/off-policy-rl

    Note:
        Weights, not a mask: a filter returned as the loss mask would shrink the
        token-mean denominator to the kept tokens and scale the loss by N_all / N_kept.
        verl, TRL, OpenRLHF and the IcePop paper all keep the denominator of every counted
        token. The product drifts with length (1.01 per token is about 21 after 300
        tokens), so fixed bounds on it drop long sequences for mismatches that short ones
        pass; the geometric mean (``"sequence"``) is length-normalized.
    """
    fn = "ratio_mask"
    log_ratio = _log_ratio(fn, old_log_probs, rollout_log_probs, mask)
    check_choice(fn, "level", level, CORRECTION_LEVELS)
    if not (0 <= low < high):
        raise InvalidArgumentError(f"{fn}: expected 0 <= low < high, got low={low}, high={high}")
    log_ratio = _level_log_ratio(log_ratio, mask, level)
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high) if high < math.inf else math.inf
    return (mask & (log_ratio >= log_low) & (log_ratio <= log_high)).float()  # NaN compares False


@batch_args
def unscored_tokens(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The counted tokens whose log-ratio ``old_log_probs - rollout_log_probs`` is NaN.

    ``unscored_tokens = mask & isnan(old_log_probs - rollout_log_probs)``: a log-prob the
    generation engine (or the trainer) could not give. :func:`truncated_importance_weights`
    and :func:`ratio_mask` give such a token weight 0 (its whole row at a sequence level)
    instead of a NaN loss; log ``unscored_tokens(...).sum()`` as a metric to see how many.

    Args:
        old_log_probs: [B, T] float log pi_train of the sampled tokens.
        rollout_log_probs: [B, T] float log pi_rollout.
        mask: [B, T] bool, True = the token counts.

    Returns:
        [B, T] bool, False wherever ``mask`` is False.

    Example:
        >>> import torch
        >>> old, rollout = torch.zeros(1, 3), torch.tensor([[0.0, float("nan"), float("nan")]])
        >>> unscored_tokens(old, rollout, torch.tensor([[True, True, False]]))
        tensor([[False,  True, False]])

    Note:
        The choice here is to mask such tokens out and count them rather than raise: a
        check that raises needs a device sync and a data-dependent branch (no
        ``torch.compile(fullgraph=True)``), and one unscored token should not stop a long
        run. The loss's mask still counts the token, so the token-mean is unchanged.
    """
    log_ratio = _log_ratio("unscored_tokens", old_log_probs, rollout_log_probs, mask)
    return mask & torch.isnan(log_ratio)
