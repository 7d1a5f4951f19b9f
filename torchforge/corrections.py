"""Off-policy corrections and data filters.

- :func:`truncated_importance_weights` (TIS): detached, capped weights between the
  training engine's log-probs and the generation engine's (``rollout_log_probs``);
- :func:`ratio_mask` (MIS / IcePop): 0/1 weights that drop tokens or whole sequences
  whose ratio leaves ``[low, high]``;
- :func:`unscored_tokens`: the counted tokens whose log-ratio is NaN, which the two above
  give weight 0;
- :func:`high_entropy_mask` and :func:`entropy_threshold`: train on the top-entropy
  tokens only ("Beyond the 80/20 rule");
- :func:`overlong_penalty`: DAPO's soft length penalty;
- :func:`zero_std_groups`: the groups whose rewards are all equal (DAPO dynamic sampling).

The filters return float 0/1 *weights* for the losses' ``weights=`` argument, never a new
mask: the mask stays, so a token-mean still divides by every counted token (as verl,
TRL, OpenRLHF and the IcePop paper do), and weights compose by multiplication
(``weights = tis * ratio_mask(...) * high_entropy_mask(...)``).

None of them carries gradient; all are float32 (or bool) whatever the input dtype.
"""

from __future__ import annotations

import math

import torch

from torchforge.advantages import _deviations, _groups
from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    ShapeError,
    check_choice,
    check_float,
    check_mask,
    check_non_negative,
    check_same_shape,
    check_tensor,
    shape_str,
)
from torchforge.ratios import _masked_log_ratio
from torchforge.reduce import masked_mean

__all__ = [
    "CORRECTION_LEVELS",
    "entropy_threshold",
    "high_entropy_mask",
    "overlong_penalty",
    "ratio_mask",
    "truncated_importance_weights",
    "unscored_tokens",
    "zero_std_groups",
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
    return _masked_log_ratio(old_log_probs.detach(), rollout_log_probs, mask)


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


def _check_quantile(fn: str, quantile) -> None:
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0 < quantile <= 1:
        raise InvalidArgumentError(
            f"{fn}: quantile must be a number in (0, 1], the fraction of tokens kept (the paper: 0.2), "
            f"got {quantile!r}"
        )


def _counted_entropy(fn: str, entropy: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    check_tensor(fn, "entropy", entropy)
    check_float(fn, "entropy", entropy)
    if mask is None:
        return entropy.detach().float().reshape(-1)
    check_mask(fn, mask, "entropy", entropy)
    return entropy.detach().float()[mask]


def entropy_threshold(
    entropy: torch.Tensor, mask: torch.Tensor | None = None, *, quantile: float
) -> torch.Tensor:
    """The entropy above which the top ``quantile`` of the counted tokens lie.

    ``tau = Q_{1 - quantile}({entropy_i : mask_i})``, the (1 - quantile)-quantile with
    linear interpolation (``torch.quantile``'s default, as TRL), computed by sorting (no
    size limit). For a threshold exact over a whole optimizer step, pass every counted
    entropy of the step: ``torch.cat([e[m] for e, m in micro_batches])`` on one process,
    and ``torchforge.distributed.gather_over_ranks`` of that over ranks, with ``mask=None``.

    Args:
        entropy: [...] float token entropies (e.g. [B, T]); detached.
        mask: bool of the shape of ``entropy``, True = the token counts; None: all count.
        quantile: the fraction of tokens kept, in (0, 1] (the paper and TRL: 0.2).

    Returns:
        float32 scalar; 0 when nothing is counted; NaN when a counted entropy is NaN
        (whatever the quantile: the tokens' order is unknown).

    Example:
        >>> import torch
        >>> entropy_threshold(torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]), quantile=0.25)  # Q_0.75
        tensor(0.4000)

    References:
        S. Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
        Reinforcement Learning for LLM Reasoning", https://arxiv.org/abs/2506.01939
    """
    fn = "entropy_threshold"
    _check_quantile(fn, quantile)
    values = _counted_entropy(fn, entropy, mask).sort().values
    n = values.shape[0]
    if n == 0:
        return torch.zeros((), device=entropy.device)
    position = (1.0 - quantile) * (n - 1)
    lower, upper = values[math.floor(position)], values[math.ceil(position)]
    threshold = lower + (upper - lower) * (position - math.floor(position))
    return torch.where(values[-1].isnan(), values[-1], threshold)  # NaN sorts last: any NaN makes it NaN


def high_entropy_mask(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    quantile: float,
    threshold: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """0/1 weights that keep only the top-``quantile`` highest-entropy tokens ("forking tokens").

    ``high_entropy_mask = float(mask & (entropy >= tau))`` with
    ``tau = entropy_threshold(entropy, mask, quantile=quantile)`` unless ``threshold`` is
    given. The paper's objective is DAPO's with ``1[H_t >= tau]`` inside the token sum and
    the normalization over all tokens unchanged, so pass this as ``weights=`` of the loss
    and keep ``mask`` (as TRL multiplies its loss by the entropy mask).

    Args:
        entropy: [B, T] float entropies of the policy at each token (``token_entropy``);
            detached.
        mask: [B, T] bool, True = the token counts.
        quantile: the fraction of counted tokens kept, in (0, 1] (the paper and TRL's
            ``top_entropy_quantile``: 0.2; 1 keeps every token).
        threshold: the entropy threshold to use instead of this batch's: pass
            :func:`entropy_threshold` of every counted token of the optimizer step (all
            micro-batches, all ranks) to make the selection exact across them. ``quantile``
            is then only checked.

    Returns:
        [B, T] float32 weights in {0, 1}, detached; 0 where ``mask`` is False.

    Example:
        >>> import torch
        >>> entropy = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 9.0]])
        >>> mask = torch.tensor([[True, True, True], [True, True, False]])
        >>> high_entropy_mask(entropy, mask, quantile=0.4)  # top 40% of 5 counted: 2.0, 1.5
        tensor([[0., 1., 0.],
                [1., 0., 0.]])

    References:
        S. Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
        Reinforcement Learning for LLM Reasoning", https://arxiv.org/abs/2506.01939;
        TRL ``GRPOConfig.top_entropy_quantile``.

    Note:
        Ties at the threshold are kept (``>=``, as TRL), so slightly more than ``quantile``
        of the tokens can be kept. The paper computes the threshold over the training
        batch; TRL over each micro-batch gathered across processes; ``threshold`` gives
        the whole step's. A NaN entropy at a counted token is never kept (and, with
        ``threshold=None``, makes the sorted quantile NaN: nothing is kept).
    """
    fn = "high_entropy_mask"
    _check_quantile(fn, quantile)
    check_tensor(fn, "entropy", entropy, ndim=2)
    check_float(fn, "entropy", entropy)
    check_mask(fn, mask, "entropy", entropy)
    if threshold is None:
        threshold = entropy_threshold(entropy, mask, quantile=quantile)
    elif isinstance(threshold, torch.Tensor) and threshold.numel() != 1:
        raise ShapeError(f"{fn}: threshold has shape {shape_str(threshold)}; expected a scalar")
    return (mask & (entropy.detach().float() >= threshold)).float()


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
    check_non_negative(fn, "penalty", penalty, finite=True)
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
    tied = _deviations(groups, rewards)[-1]
    return groups.rows(tied)
