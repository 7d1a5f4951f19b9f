"""Off-policy corrections and data filters.

- :func:`truncated_importance_weights` (TIS): detached, capped weights between the
  training engine's log-probs and the generation engine's (``rollout_log_probs``);
- :func:`ratio_mask` (MIS / IcePop): drop tokens or whole sequences whose ratio leaves
  ``[low, high]``;
- :func:`overlong_penalty`: DAPO's soft length penalty;
- :func:`zero_std_groups`: the groups whose rewards are all equal (DAPO dynamic sampling).

None of them carries gradient; all are float32 (or bool) whatever the input dtype.
"""

from __future__ import annotations

import math

import torch

from torchforge.advantages import _deviations, _groups
from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    check_choice,
    check_float,
    check_mask,
    check_same_shape,
    check_tensor,
)

__all__ = [
    "truncated_importance_weights",
    "ratio_mask",
    "overlong_penalty",
    "zero_std_groups",
    "CORRECTION_LEVELS",
]

CORRECTION_LEVELS = ("token", "sequence")


def _log_ratio(fn, old_log_probs, rollout_log_probs, mask) -> torch.Tensor:
    """``old_log_probs - rollout_log_probs`` in float32, detached, 0 where ``mask`` is False."""
    check_tensor(fn, "old_log_probs", old_log_probs, ndim=2)
    check_float(fn, "old_log_probs", old_log_probs)
    check_same_shape(fn, "rollout_log_probs", rollout_log_probs, "old_log_probs", old_log_probs)
    check_float(fn, "rollout_log_probs", rollout_log_probs)
    check_mask(fn, mask, "old_log_probs", old_log_probs)
    diff = old_log_probs.detach().float() - rollout_log_probs.detach().float()
    return torch.where(mask, diff, 0.0)


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
    of the sampled tokens, 0 where masked):

    - ``level="token"``: ``weights = min(exp(log_ratio), cap)``;
    - ``level="sequence"``: ``weights_bt = min(exp(sum_t log_ratio_bt), cap)``, the
      importance weight of the whole sequence (the product of the token ratios),
      broadcast over its tokens.

    Computed as ``exp(min(log_ratio, log(cap)))``, so nothing overflows. Multiply the
    per-token policy loss by them (``weights=`` of :func:`~torchforge.losses.ppo_loss`).

    Args:
        old_log_probs: [B, T] float log-probs of the sampled tokens under the trainer's
            policy at sampling time (``log_probs.detach()`` when on-policy).
        rollout_log_probs: [B, T] float log-probs reported by the generation engine.
        mask: [B, T] bool, True = the token counts.
        level: ``"token"`` or ``"sequence"``.
        cap: the truncation C > 0 (finite).

    Returns:
        [B, T] float32 weights in ``[0, cap]``, detached; 0 where ``mask`` is False.

    Example:
        >>> import torch
        >>> old = torch.log(torch.tensor([[0.5, 0.9]])); rollout = torch.log(torch.tensor([[0.25, 0.9]]))
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> truncated_importance_weights(old, rollout, mask)                # ratios 2, 1
        tensor([[2., 1.]])
        >>> truncated_importance_weights(old, rollout, mask, cap=1.5, level="sequence")
        tensor([[1.5000, 1.5000]])

    References:
        F. Yao, L. Liu et al., "Your efficient RL framework secretly brings you off-policy
        RL training", https://fengyao.notion.site/off-policy-rl (2025); truncated IS:
        Espeholt et al., IMPALA, https://arxiv.org/abs/1802.01561

    Note:
        The sequence weight is the product of the token ratios (verl's sequence-level
        TIS), not their geometric mean: it is the importance weight of the sample. It
        degenerates fast with length; prefer ``"token"`` or :func:`ratio_mask`.
    """
    fn = "truncated_importance_weights"
    log_ratio = _log_ratio(fn, old_log_probs, rollout_log_probs, mask)
    check_choice(fn, "level", level, CORRECTION_LEVELS)
    if not (0 < cap < math.inf):
        raise InvalidArgumentError(f"{fn}: cap must be a finite number > 0, got {cap}")
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    weights = torch.exp(log_ratio.clamp(max=math.log(cap)))
    return torch.where(mask, weights, 0.0)


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
    """A new mask without the tokens (or sequences) whose train / rollout ratio leaves [low, high].

    With ``log_ratio = old_log_probs - rollout_log_probs``:

    - ``level="token"`` (IcePop): ``new_mask = mask & (low <= exp(log_ratio) <= high)``;
    - ``level="sequence"`` (sequence MIS): ``r_b = exp(sum_t log_ratio_bt / n_b)``, the
      geometric mean of the counted token ratios, and ``new_mask = mask & (low <= r_b <=
      high)``: a sequence is kept or dropped whole.

    Compared in log space (``log(low) <= log_ratio <= log(high)``).

    IcePop's full correction ``M(k) = k * 1[low <= k <= high]`` composes as
    ``weights = truncated_importance_weights(..., cap=high)`` with the mask from here.

    Args:
        old_log_probs: [B, T] float log pi_train of the sampled tokens at sampling time.
        rollout_log_probs: [B, T] float log pi_rollout from the generation engine.
        mask: [B, T] bool, True = the token counts.
        low: lower bound on the ratio, >= 0 (IcePop: 0.5).
        high: upper bound, > low (IcePop: 5 in the Ring-1T paper; 2 also common).
        level: ``"token"`` or ``"sequence"``.

    Returns:
        [B, T] bool: a new tensor (``mask`` is not modified).

    Example:
        >>> import torch
        >>> old = torch.log(torch.tensor([[0.9, 0.9, 0.9]]))
        >>> rollout = torch.log(torch.tensor([[0.9, 0.1, 0.8]]))
        >>> mask = torch.ones(1, 3, dtype=torch.bool)
        >>> ratio_mask(old, rollout, mask, low=0.5, high=2.0)       # ratios 1, 9, 1.125
        tensor([[ True, False,  True]])
        >>> ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence")  # 9^(1/3) * ...
        tensor([[False, False, False]])

    References:
        IcePop: Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for
        Trillion-Scale Thinking Model" (Ring-1T), https://arxiv.org/abs/2510.18855;
        masked importance sampling: F. Yao et al., https://fengyao.notion.site/off-policy-rl

    Note:
        The sequence level uses the geometric mean, not the product of the ratios (the
        sequence importance weight): the product drifts with length (1.01 per token is
        about 21 after 300 tokens), so fixed bounds on it would drop long sequences for
        mismatches that short ones pass; the geometric mean is length-normalized (verl's
        "geometric" rejection mode). A row with no counted token stays all False.
    """
    fn = "ratio_mask"
    log_ratio = _log_ratio(fn, old_log_probs, rollout_log_probs, mask)
    check_choice(fn, "level", level, CORRECTION_LEVELS)
    if not (0 <= low < high):
        raise InvalidArgumentError(f"{fn}: expected 0 <= low < high, got low={low}, high={high}")
    if level == "sequence":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.sum(-1, keepdim=True) / lengths
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high) if high < math.inf else math.inf
    return mask & (log_ratio >= log_low) & (log_ratio <= log_high)


@batch_args
def overlong_penalty(
    lengths: torch.Tensor,
    *,
    max_length: int,
    buffer_length: int,
    penalty: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment: a reward term for responses near or over the limit.

    With ``L = lengths``, ``L_max = max_length``, ``L_cache = buffer_length``:

    ``overlong_penalty = 0`` if ``L <= L_max - L_cache``;
    ``-penalty * (L - (L_max - L_cache)) / L_cache`` if ``L_max - L_cache < L <= L_max``;
    ``-penalty`` if ``L > L_max``.

    Add it to the sequence rewards before computing advantages.

    Args:
        lengths: [B] int or float response lengths (e.g. ``mask.sum(-1)``).
        max_length: L_max, >= 1.
        buffer_length: L_cache, in [0, max_length]; 0 gives a hard penalty above L_max.
        penalty: the size of the full penalty, >= 0 (DAPO: 1).

    Returns:
        [B] float32 penalties in ``[-penalty, 0]``.

    Example:
        >>> import torch
        >>> overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_length=20, buffer_length=4)
        tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])

    References:
        DAPO, section 3.4 "Overlong Reward Shaping", https://arxiv.org/abs/2503.14476
    """
    fn = "overlong_penalty"
    check_tensor(fn, "lengths", lengths, ndim=1)
    if lengths.dtype == torch.bool or lengths.is_complex():
        raise InvalidArgumentError(f"{fn}: lengths has dtype {lengths.dtype}; expected an integer or float tensor")
    if not (isinstance(max_length, int) and max_length >= 1):
        raise InvalidArgumentError(f"{fn}: max_length must be an int >= 1, got {max_length!r}")
    if not (isinstance(buffer_length, int) and 0 <= buffer_length <= max_length):
        raise InvalidArgumentError(
            f"{fn}: buffer_length must be an int in [0, max_length={max_length}], got {buffer_length!r}"
        )
    if not penalty >= 0:
        raise InvalidArgumentError(f"{fn}: penalty must be >= 0, got {penalty}")
    lengths = lengths.float()
    if buffer_length == 0:
        return torch.where(lengths > max_length, -float(penalty), 0.0)
    excess = (lengths - (max_length - buffer_length)) / buffer_length
    return 0.0 - penalty * excess.clamp(0.0, 1.0)  # 0 - 0 = +0, not -0


@batch_args
def zero_std_groups(
    rewards: torch.Tensor, *, group_size: int | None = None, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Flag the samples of the groups whose rewards are all equal (no learning signal).

    With the rewards in groups (contiguous blocks of ``G = group_size`` samples per
    prompt, or the rows sharing a ``group_ids`` value),
    ``zero_std_groups[b] = max_g r_g == min_g r_g`` over the finite rewards of b's group
    (a group with one or no finite reward counts as all-equal). DAPO's dynamic sampling
    keeps ``~zero_std_groups(rewards, group_size=G)``. These are exactly the groups to which
    ``group_advantages`` (and every group estimator) gives advantage 0: both use one test.

    Args:
        rewards: [B] float sequence rewards; NaN (or +-inf) = no reward.
        group_size: G >= 1 contiguous samples per prompt; B must be a multiple of G.
        group_ids: [B] integer group id of each row (any order, any sizes), instead of
            ``group_size``.

    Returns:
        [B] bool, True on every sample of an all-equal group (one flag per sample, so it
        indexes the batch directly; ``.view(-1, G)[:, 0]`` gives one per group).

    Example:
        >>> import torch
        >>> zero_std_groups(torch.tensor([1., 1., 0., 1., float("nan"), 2.]), group_size=2)
        tensor([ True,  True, False, False,  True,  True])

    References:
        DAPO, section 3.2 "Dynamic Sampling", https://arxiv.org/abs/2503.14476

    Note:
        The test is exact equality (float32, or float64 kept as is), not ``std < eps``: a
        float residue in the std cannot flip it, and a constant added to every reward does
        not change it. DAPO filters groups whose accuracy is 0 or 1; for binary rewards
        this is the same thing.
    """
    fn = "zero_std_groups"
    check_tensor(fn, "rewards", rewards, ndim=1)
    groups = _groups(fn, rewards, group_size, group_ids)
    _, _, tied = _deviations(groups, rewards)
    return groups.expand(tied)
