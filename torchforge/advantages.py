"""Advantage estimators and returns: group-normalized (GRPO, Dr. GRPO, GDPO), leave-one-out
(RLOO), Pass@k training, OPO, ReMax, discounted reward-to-go, REINFORCE++, KL-shaped
rewards and GAE.

Conventions shared by every function here:

- Maths in float32 whatever the input dtype; results are float32.
- ``mask`` [B, T] bool, True where the token counts. Positions with mask False *inside*
  a sequence (tool or observation tokens of a multi-turn rollout) are skipped: the
  recursions run over the counted tokens only, as if the masked ones were cut out of the
  row, and values or rewards stored there are never read (a NaN there does not leak).
  Every [B, T] result is exactly 0 where ``mask`` is False.
- ``rewards`` for the token-level functions is either [B, T] (token rewards, read at
  counted positions only) or [B] (one reward per sequence, placed on the last counted
  token of its row; a row with no counted token drops it).
- Groups (the G samples of one prompt) are contiguous blocks of ``group_size`` rows, or
  the rows sharing a ``group_ids`` value (any order, any sizes); pass exactly one. A group
  whose finite rewards are all exactly equal gets advantage 0 in every group estimator,
  and adding a constant to every reward changes no advantage.
- No Python branch depends on tensor values, so every function compiles with
  ``torch.compile(fullgraph=True)``, except with ``group_ids`` (one synchronization to
  size the table of groups) and ``passk_advantages`` (it checks that rewards are 0 / 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from torchforge.batch import batch_args
from torchforge.errors import (
    DTypeError,
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
from torchforge.kl import approx_kl
from torchforge.reduce import _count, masked_var, masked_whiten, pooled_var

__all__ = [
    "GROUP_SCALES",
    "discounted_returns",
    "gae",
    "group_advantages",
    "kl_penalized_rewards",
    "opo_advantages",
    "passk_advantages",
    "reinforce_pp_advantages",
    "remax_advantages",
    "rloo_advantages",
]

GROUP_SCALES = ("group", "batch", "none")

_TINY = torch.finfo(torch.float32).tiny


# --- input checks ------------------------------------------------------------------------

def _check_gamma(fn: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0):
        raise InvalidArgumentError(f"{fn}: {name} must be a float in [0, 1], got {value!r}")


def _raise_rewards_shape(fn: str, rewards: torch.Tensor, mask: torch.Tensor):
    raise ShapeError(
        f"{fn}: rewards has shape {shape_str(rewards)} but mask has shape {shape_str(mask)}; "
        f"expected ({mask.shape[0]},) or {shape_str(mask)}"
    )


# --- groups ------------------------------------------------------------------------------

class _Groups:
    """How the B rows of a batch fall into groups: contiguous blocks of ``size`` rows, or by
    ``index`` ([B] int64 in [0, count)).

    Per-row tensors live in ``view(x)``'s layout: [count, size, ...] for contiguous groups
    (so per-group statistics broadcast without copies), [B, ...] by index. ``sum`` and
    ``amax`` reduce them to per-group statistics ([count, 1, ...] or [count, ...]),
    ``expand`` puts a statistic next to each row, ``flat`` returns to [B, ...].
    """

    def __init__(self, size: int | None, index: torch.Tensor | None, count: int):
        self.size, self.index, self.count = size, index, count

    def view(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.index is not None else x.reshape(self.count, self.size, *x.shape[1:])

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.index is not None else x.reshape(self.count * self.size, *x.shape[2:])

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.index is None:  # a matmul with ones: on CPU much faster than sum(1) over small G
            ones = x.new_ones(self.size, 1)
            return x @ ones if x.dim() == 2 else torch.matmul(ones.t(), x)
        # scatter_add_, not index_add_: on CPU about 1.5x faster for [B] sums
        return x.new_zeros(self.count, *x.shape[1:]).scatter_add_(0, self._index_like(x), x)

    def _index_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.index.view(-1, *([1] * (x.dim() - 1))).expand_as(x)

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            return x.new_full((self.count, *x.shape[1:]), -math.inf).scatter_reduce_(0, self._index_like(x), x, "amax")
        if x.dim() == 3 or x.numel() == 0:
            return x.amax(1, keepdim=True)
        # max-pools over windows of G: on CPU 2-3x faster than amax(1) for G < 32, and
        # fastest in steps of 4 (4 then 4 beats one window of 16)
        y, k = x.reshape(1, -1), self.size
        while k > 8 and k % 4 == 0:
            y, k = torch.max_pool1d(y, 4, 4), k // 4
        return torch.max_pool1d(y, k, k).view(self.count, 1)

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        return s if self.index is None else s.index_select(0, self.index)

    def rows(self, s: torch.Tensor) -> torch.Tensor:
        """A per-group statistic repeated on each of the B rows: [B, ...]."""
        if self.index is not None:
            return s.index_select(0, self.index)
        return s.expand(self.count, self.size, *s.shape[2:]).reshape(self.count * self.size, *s.shape[2:])


def _groups(fn: str, rewards: torch.Tensor, group_size, group_ids, *, min_size: int = 1) -> _Groups:
    """Check ``rewards`` ([B] or [B, K] float) and exactly one of ``group_size`` / ``group_ids``."""
    check_tensor(fn, "rewards", rewards, ndim=(1, 2))
    check_float(fn, "rewards", rewards)
    B = rewards.shape[0]
    if (group_size is None) == (group_ids is None):
        raise InvalidArgumentError(
            f"{fn}: pass exactly one of group_size (contiguous groups of G rows) and group_ids "
            f"([B] group id of each row), got group_size={group_size!r} and "
            f"group_ids={'None' if group_ids is None else 'a tensor'}"
        )
    if group_ids is None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < min_size:
            raise InvalidArgumentError(f"{fn}: group_size must be an int >= {min_size}, got {group_size!r}")
        if B % group_size != 0:
            raise ShapeError(
                f"{fn}: rewards has shape {shape_str(rewards)}, not a multiple of group_size={group_size}; "
                "expected B = prompts x G with each prompt's G samples contiguous (or pass group_ids)"
            )
        return _Groups(group_size, None, B // group_size)
    check_tensor(fn, "group_ids", group_ids, ndim=1)
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise DTypeError(f"{fn}: group_ids has dtype {group_ids.dtype}; expected an integer tensor")
    if group_ids.shape[0] != B:
        raise ShapeError(
            f"{fn}: group_ids has shape {shape_str(group_ids)} but rewards has shape {shape_str(rewards)}; "
            f"expected ({B},)"
        )
    ids = group_ids.to(device=rewards.device, dtype=torch.int64)
    if B == 0:
        return _Groups(None, ids, 0)
    low, high = ids.aminmax()
    if low >= 0 and high < B:  # ids already index a [B] table: no sort needed
        return _Groups(None, ids, int(high) + 1)
    unique, index = torch.unique(ids, return_inverse=True)
    return _Groups(None, index, unique.numel())


def _deviations(groups: _Groups, rewards: torch.Tensor):
    """``(d, valid, d_sum, tied)``: the rewards minus their group's largest finite reward.

    ``d = r - max_g r`` (float32, <= 0) at finite rewards and 0 elsewhere, formed in the
    input's precision (float64 stays float64) before the cast, so that a constant added to
    every reward cancels exactly; ``valid`` is 1.0 where ``r`` is finite, else 0.0 (both in
    ``groups.view`` layout). Per group: ``d_sum``, the float32 sum of ``d``, and ``tied``
    (bool), True where the finite rewards are all equal (or fewer than two): every
    ``d <= 0``, and ``r - max_g r == 0`` exactly when ``r == max_g r``, so the group is tied
    exactly when the sum of its ``d`` (in the input's precision) is 0.
    """
    d, valid, d_sum, _ = _shifted(groups, rewards)
    return d, valid, d_sum.float(), ~(d_sum < 0)


def _shifted(groups: _Groups, rewards: torch.Tensor):
    """``(d, valid, d_sum, neg_high)``: :func:`_deviations` without ``tied``, ``d_sum`` still
    in the input's precision, and ``neg_high = -max_g r`` per group (+inf for a group with
    no finite reward).

    Four passes over the rewards and one max-pool, with 0 / 1 weights and ``nan_to_num``
    instead of bool masks and ``where`` (on CPU several times faster for these shapes): a
    non-finite reward is -inf in ``r_ninf``, so it is never the maximum, ``r_ninf - high`` is
    -inf (NaN in a group with no finite reward) exactly there, and one ``nan_to_num`` zeroes it.
    """
    r = groups.view(rewards.double() if rewards.dtype == torch.float64 else rewards.float())
    r_ninf = torch.nan_to_num(r, nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
    # neg_high and valid carry no gradient (high cancels in r - mean_g, valid is piecewise constant)
    neg_high = 0.0 - groups.amax(r_ninf.detach())
    valid = torch.gt(r_ninf.detach(), -math.inf, out=torch.empty_like(r_ninf))  # 1.0 where finite
    # r + (0 - high) is r - high, but never -0.0 (-0.0 - 0.0 is -0.0; 0 - high is never -0.0):
    # no estimator then needs a last pass to turn -0.0 into 0.0
    d = (r_ninf + groups.expand(neg_high)).nan_to_num_(nan=0.0, neginf=0.0)
    return d.float(), valid.float(), groups.sum(d), neg_high


def _centered(groups: _Groups, rewards: torch.Tensor):
    """``(centered, n, neg_high, mean_d)``: ``r - mean_g`` over the finite rewards (0 at the
    others) in ``groups.view`` layout, the float32 count of finite rewards of each group, and
    ``mean_g = mean_d - neg_high`` as its two parts (``neg_high = -max_g r`` in the input's
    precision, as :func:`_shifted`).

    A tied group is exactly 0: its deviations ``r - max_g r`` are all exactly 0, and so is
    their mean. No entry is -0.0 (``d`` never is, and ``x - x`` is +0.0); every factor
    applied to ``centered`` is finite and positive, so it stays 0, and +0.0.
    """
    d, valid, d_sum, neg_high = _shifted(groups, rewards)
    n = groups.sum(valid)
    mean_d = d_sum.float().div_(n.clamp(min=1))  # d_sum is a fresh tensor: in place
    # d - mean_d at the finite rewards, d = 0 at the others: one pass
    return torch.addcmul(d, valid, groups.expand(mean_d), value=-1), n, neg_high, mean_d


def _batch_std(values: torch.Tensor, mask: torch.Tensor, sum_over_ranks) -> torch.Tensor:
    """Unbiased std of ``values`` over ``mask`` (over every rank through ``sum_over_ranks``);
    [K] stds of the K columns of [B, K] values."""
    if values.dim() == 1:
        return masked_var(values, mask, sum_over_ranks=sum_over_ranks).sqrt()
    return torch.stack([_batch_std(v, m, sum_over_ranks) for v, m in zip(values.unbind(1), mask.unbind(1))])


def _scale_factor(std: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / (std + eps)``, finite even for ``std = eps = 0`` (where the deviations are 0)."""
    denominator = std + eps
    if eps < _TINY:  # else std + eps >= eps >= _TINY already
        denominator = denominator.clamp_(min=_TINY)
    return denominator.reciprocal_()


def _check_weights(fn: str, reward_weights, rewards: torch.Tensor) -> torch.Tensor:
    K = rewards.shape[1]
    if reward_weights is None:
        return rewards.new_ones(K, dtype=torch.float32)
    w = torch.as_tensor(reward_weights, dtype=torch.float32, device=rewards.device)
    if w.shape != (K,):
        raise ShapeError(
            f"{fn}: reward_weights has shape {tuple(w.shape)} but rewards has shape {shape_str(rewards)}; "
            f"expected ({K},), one weight per reward"
        )
    if not torch.isfinite(w).all():
        raise InvalidArgumentError(f"{fn}: reward_weights must be finite, got {w.tolist()}")
    return w


@batch_args
def group_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    reward_weights=None,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Group-relative advantages of GRPO: each reward minus its group's mean, optionally scaled.

    With ``r`` the rewards in groups g (the G samples of one prompt: contiguous blocks of
    ``group_size`` rows, or the rows sharing a ``group_ids`` value), ``mean_g`` and ``std_g``
    the mean and unbiased standard deviation of the finite rewards of group g, and
    ``std_batch`` the unbiased standard deviation of all finite rewards of the batch:

    - ``scale="group"``: ``A = (r - mean_g) / (std_g + eps)`` (GRPO);
    - ``scale="batch"``: ``A = (r - mean_g) / (std_batch + eps)`` (TRL's
      ``scale_rewards="batch"``, Lite PPO's group mean + batch std);
    - ``scale="none"``:  ``A = r - mean_g`` (Dr. GRPO).

    Several rewards (GDPO): with [B, K] rewards ``r_k`` and ``reward_weights`` ``w``, each
    reward is normalized in its group as above, ``A_k``, then
    ``s = sum_k w_k * A_k`` and ``A = s / (std_batch(s) + eps)``. The batch mean of ``s`` is
    0 by construction (each ``A_k`` sums to 0 over its group), so it is not subtracted.

    A NaN reward ("not applicable"; also +-inf) is left out of every statistic and gets
    ``A = 0`` (``A_k = 0`` for one column of [B, K] rewards). A group whose finite rewards
    are all exactly equal gets ``A = 0`` exactly, whatever ``scale`` and ``eps``; "equal"
    means equal, so adding a constant to every reward leaves the advantages unchanged.

    Args:
        rewards: [B] float sequence rewards, or [B, K] for K rewards per sample; NaN = no reward.
        group_size: G, the number of contiguous samples per prompt (>= 1).
        group_ids: [B] integer id of each row's group (groups of any size, rows in any
            order, as verl's ``index``), instead of ``group_size``.
        scale: one of ``"group"``, ``"batch"``, ``"none"`` (per reward for [B, K]).
        eps: added to the standard deviation before dividing (>= 0).
        reward_weights: [K] weights of [B, K] rewards (default: all 1); [B, K] only.
        sum_over_ranks: sums a tensor over data-parallel ranks (e.g.
            ``torchforge.distributed.sum_over_ranks``), so that ``std_batch`` is the std of
            the global batch; None: this process's batch.

    Returns:
        [B] float32 advantages.

    Note:
        The standard deviation is unbiased (Bessel's correction, ``/ (n - 1)``), as in TRL
        and verl (``torch.std``); a group with a single valid reward has no spread and gets
        0. ``eps`` is added to the std, not the variance, as TRL (1e-4) and verl (1e-6) do.
        Where other libraries divide a float residue of ~1e-9 by ``std + eps`` and give
        advantages of up to 1e3 for a group of equal rewards (e.g. ``[0.1] * G``), the tie
        test here (``max_g == min_g``) returns exact zeros, and the deviations are formed
        from the group's maximum first, so that an offset of 1e4 does not swamp rewards
        that differ by 1e-4. For [B, K] rewards this is TRL's
        ``multi_objective_aggregation="normalize_then_sum"`` (group std + eps, weighted
        ``nansum``, batch std + eps), except that TRL also subtracts the batch mean of ``s``
        (0 up to rounding), which leaves a residue of ~1e-7 on all-tied groups.
        ``std_batch`` of [B] rewards is pooled from the groups' counts, means and squared
        deviations (:func:`torchforge.reduce.pooled_var`), equal to ``masked_var`` of all
        finite rewards without another pass over them.
        ``group_ids`` in [0, B) index a table directly; other ids are first made dense
        with ``torch.unique`` (a sort). With ``group_ids`` the function synchronizes with
        the device once and does not compile with ``fullgraph=True``.

    Example:
        >>> import torch
        >>> group_advantages(torch.tensor([1., 0., 0.1, 0.1]), group_size=2)
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
        >>> group_advantages(torch.tensor([1., 0., float("nan"), 2.]), group_size=2, scale="none")
        tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
        >>> group_advantages(torch.tensor([2., 1., 0.]), group_ids=torch.tensor([0, 1, 0]), scale="none")
        tensor([ 1.,  0., -1.])

    References:
        GRPO (DeepSeekMath), https://arxiv.org/abs/2402.03300; Dr. GRPO,
        https://arxiv.org/abs/2503.20783; Lite PPO, https://arxiv.org/abs/2508.08221;
        GDPO, https://arxiv.org/abs/2601.05242
    """
    fn = "group_advantages"
    groups = _groups(fn, rewards, group_size, group_ids)
    check_choice(fn, "scale", scale, GROUP_SCALES)
    check_non_negative(fn, "eps", eps)
    if rewards.dim() == 1 and reward_weights is not None:
        raise ShapeError(
            f"{fn}: reward_weights is given but rewards has shape {shape_str(rewards)}; "
            "expected [B, K] rewards (one column per reward) with K weights"
        )
    weights = _check_weights(fn, reward_weights, rewards) if rewards.dim() == 2 else None
    centered, n, neg_high, mean_d = _centered(groups, rewards)
    if scale == "group":  # (the [groups] tensors below are fresh: updated in place)
        std_g = groups.sum(centered.square()).div_((n - 1).clamp_(min=1)).sqrt_()
        advantages = centered * groups.expand(_scale_factor(std_g, eps))
    elif scale == "batch" and rewards.dim() == 1:  # the batch variance pooled from the groups'
        mean_g = mean_d.double() - torch.nan_to_num(neg_high.double(), posinf=0.0)  # no reward: 0
        flat = centered.flatten()
        var = pooled_var(n, mean_g, flat @ flat, sum_over_ranks=sum_over_ranks)  # m2: the total over the groups
        advantages = centered * _scale_factor(var.sqrt(), eps)
    elif scale == "batch":
        advantages = centered * _scale_factor(_batch_std(rewards, torch.isfinite(rewards), sum_over_ranks), eps)
    else:
        advantages = centered
    advantages = groups.flat(advantages)
    if weights is not None:  # GDPO: weighted sum of the normalized rewards, whitened over the batch
        s = advantages @ weights
        std_s = _batch_std(s, torch.isfinite(rewards).any(-1), sum_over_ranks)
        advantages = (s * _scale_factor(std_s, eps)).add_(0.0)  # a sum with negative weights: -0.0 -> 0.0
    return advantages


@batch_args
def rloo_advantages(
    rewards: torch.Tensor, *, group_size: int | None = None, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Leave-one-out advantages of RLOO: each reward minus the mean of the rest of its group.

    ``A_i = r_i - (sum_j r_j - r_i) / (n - 1)`` over the n finite rewards of i's group,
    computed as the equal ``n / (n - 1) * (r_i - mean_g)``.

    A NaN reward is left out of the baselines of the others and gets ``A = 0``; a group with
    fewer than two valid rewards (no baseline) or whose valid rewards are all equal gets 0.

    Args:
        rewards: [B] float sequence rewards; NaN = no reward.
        group_size: G >= 2 samples per prompt, contiguous.
        group_ids: [B] integer group id of each row (any order, any sizes), instead of
            ``group_size``.

    Returns:
        [B] float32 advantages.

    Note:
        NaN rewards and ties are handled exactly as in :func:`group_advantages`, so the two
        estimators stay interchangeable; libraries that compute RLOO with a fixed ``G - 1``
        denominator would instead propagate the NaN to the whole group.

    Example:
        >>> import torch
        >>> rloo_advantages(torch.tensor([3., 0., 0.]), group_size=3)   # 3 - 0, 0 - 1.5
        tensor([ 3.0000, -1.5000, -1.5000])

    References:
        "Buy 4 REINFORCE samples, get a baseline for free!" (Kool et al., 2019),
        https://openreview.net/forum?id=r1lgTGL5DE; RLOO for RLHF (Ahmadian et al., 2024),
        https://arxiv.org/abs/2402.14740
    """
    fn = "rloo_advantages"
    check_tensor(fn, "rewards", rewards, ndim=1)
    groups = _groups(fn, rewards, group_size, group_ids, min_size=2)
    centered, n, _, _ = _centered(groups, rewards)
    # r_i - (sum_j r_j - r_i) / (n - 1) == n / (n - 1) * (r_i - mean); n < 2 is always tied (0)
    return groups.flat(centered.mul_(groups.expand(n / (n - 1).clamp(min=1))))


def _binomial_ratio(top: torch.Tensor, bottom: torch.Tensor, k: int) -> torch.Tensor:
    """``C(top, k) / C(bottom, k)`` for integer-valued float64 ``top <= bottom`` and ``k <= bottom``,
    as ``prod_{j < k} (top - j) / (bottom - j)`` (0 once ``top - j`` reaches 0)."""
    j = torch.arange(k, dtype=top.dtype, device=top.device)
    return ((top.unsqueeze(-1) - j).clamp(min=0) / (bottom.unsqueeze(-1) - j).clamp(min=1)).prod(-1)


@batch_args
def passk_advantages(
    rewards: torch.Tensor,
    *,
    k: int,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Pass@k training advantages: the exact group advantage of the Pass@k reward of k-subsets.

    For a group of ``n`` binary rewards with ``c`` correct (reward 1), the Pass@k reward of a
    random k-subset has mean ``rho`` and standard deviation ``sigma``:

    ``rho = 1 - C(n - c, k) / C(n, k)``,  ``sigma = sqrt(rho * (1 - rho))``;

    a correct sample belongs only to subsets that pass, an incorrect one to subsets that
    pass with probability ``1 - C(n - c - 1, k - 1) / C(n - 1, k - 1)``, so

    ``A_pos = (1 - rho) / (sigma + eps)``,
    ``A_neg = (1 - rho - C(n - c - 1, k - 1) / C(n - 1, k - 1)) / (sigma + eps)``

    (``scale="none"``: without the division). ``k = 1`` is GRPO with the biased group std.

    Args:
        rewards: [B] float rewards in {0, 1} (NaN = no reward, left out of n and c).
        k: the k of Pass@k, 1 <= k (<= G with ``group_size``).
        group_size: G samples per prompt, contiguous.
        group_ids: [B] integer group id of each row, instead of ``group_size``.
        scale: ``"group"`` (divide by ``sigma + eps``, the paper) or ``"none"``.
        eps: added to ``sigma`` (>= 0); the authors' code uses 1e-6.

    Returns:
        [B] float32 advantages; 0 for NaN rewards, for groups with fewer than k finite
        rewards, and for groups where every k-subset passes or none does (``sigma = 0``).

    Note:
        This is the paper's analytical form for binary rewards (its section "analytical
        derivation", and ``calc_adv`` in the authors' code), computed for every group at
        once with the binomial ratios as products of k factors in float64. It differs from
        PKPO's leave-one-out transformation (arXiv 2505.15201), whose ``k = G`` case for
        continuous rewards gives only the best sample ``r_max - r_second``.

    Example:
        >>> import torch
        >>> # n = 4, c = 1, k = 2: rho = 1 - C(3,2)/C(4,2) = 0.5, sigma = 0.5
        >>> # A_pos = 0.5 / 0.5 = 1; A_neg = (0.5 - C(2,1)/C(3,1)) / 0.5 = -1/3
        >>> passk_advantages(torch.tensor([1., 0., 0., 0.]), k=2, group_size=4, eps=0.0)
        tensor([ 1.0000, -0.3333, -0.3333, -0.3333])

    References:
        Pass@k Training for Adaptively Balancing Exploration and Exploitation of Large
        Reasoning Models, https://arxiv.org/abs/2508.10751
    """
    fn = "passk_advantages"
    check_tensor(fn, "rewards", rewards, ndim=1)
    groups = _groups(fn, rewards, group_size, group_ids)
    check_choice(fn, "scale", scale, ("group", "none"))
    check_non_negative(fn, "eps", eps)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (group_size is not None and k > group_size):
        limit = f" and <= group_size={group_size}" if group_size is not None else ""
        raise InvalidArgumentError(f"{fn}: k must be an int >= 1{limit}, got {k!r}")
    r = rewards.float()
    valid = ~torch.isnan(r)
    if not ((r == 0) | (r == 1) | ~valid).all():
        bad = r[valid & (r != 0) & (r != 1)][:3].tolist()
        raise InvalidArgumentError(f"{fn}: rewards must be 0 or 1 (or NaN), got values such as {bad}")
    correct = groups.view(r == 1)
    n = groups.sum(groups.view(valid).double())
    c = groups.sum(correct.double())
    rho = 1 - _binomial_ratio(n - c, n, k)
    sigma = (rho * (1 - rho)).sqrt()
    a_pos = 1 - rho
    a_neg = 1 - rho - _binomial_ratio(n - c - 1, n - 1, k - 1)
    defined = (n >= k) & (sigma > 0)
    if scale == "group":
        factor = torch.where(defined, 1 / (sigma + eps).clamp(min=_TINY), 0.0)
    else:
        factor = defined.double()
    advantages = groups.flat(torch.where(correct, groups.expand(a_pos * factor), groups.expand(a_neg * factor)))
    return torch.where(valid, advantages, 0.0).float() + 0.0


@batch_args
def opo_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """OPO advantages: each reward minus its group's length-weighted mean reward.

    With ``l_i = sum_t mask[i, t]`` the response length of sample i and the sums over the
    finite rewards of i's group: ``b = sum_j l_j * r_j / sum_j l_j`` (the variance-optimal
    baseline when the squared gradient norm of a response grows with its length) and
    ``A_i = r_i - b``.

    Args:
        rewards: [B] float sequence rewards; NaN = no reward.
        mask: [B, T] bool, True = the token counts (gives the lengths).
        group_size: G samples per prompt, contiguous.
        group_ids: [B] integer group id of each row, instead of ``group_size``.

    Returns:
        [B] float32 advantages; 0 for NaN rewards, all-equal groups and groups whose
        finite-reward responses are all empty.

    Note:
        verl's ``compute_opo_outcome_advantage`` gives a group of one sample the baseline 0
        (``A = r``); here, as in :func:`group_advantages`, a group with a single finite
        reward has no baseline and gets 0. OPO is meant for exact on-policy training (one
        gradient step per batch); that is a choice of the loop, not of this estimator.

    Example:
        >>> import torch
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> opo_advantages(torch.tensor([1., 0.]), mask, group_size=2)  # b = (3*1 + 1*0) / 4
        tensor([ 0.2500, -0.7500])

    References:
        On-Policy RL with Optimal Reward Baseline (OPO), https://arxiv.org/abs/2505.23585
    """
    fn = "opo_advantages"
    check_tensor(fn, "rewards", rewards, ndim=1)
    groups = _groups(fn, rewards, group_size, group_ids)
    _check_tokens(fn, mask)
    if mask.shape[0] != rewards.shape[0]:
        raise ShapeError(
            f"{fn}: rewards has shape {shape_str(rewards)} but mask has shape {shape_str(mask)}; "
            f"expected ({mask.shape[0]},)"
        )
    d, valid, _, tied = _deviations(groups, rewards)
    lengths = groups.view(_count(mask, -1).float()) * valid
    total = groups.sum(lengths)
    b = groups.sum(lengths * d) / total.clamp(min=1)
    kept = (~tied & (total > 0)).float()
    return groups.flat((d - groups.expand(b)) * (valid * groups.expand(kept))) + 0.0


# --- reverse discounted sums over the counted tokens -----------------------------------------

def _block_size(length: int) -> int:
    """Block length K of the two-level scan: a power of two near sqrt(length), in [8, 128]."""
    k = 8
    while k * k < length and k < 128:
        k *= 2
    return k


def _discount_matrix(factor: float, size: int, step: int, dtype, device) -> torch.Tensor:
    """[size, size] upper-triangular ``M[i, j] = factor ** (step * (j - i))`` for j >= i, else 0.

    Powers are formed in float64 and rounded once, so even ``factor ** 4096`` is accurate;
    every entry is <= 1, so nothing overflows. ``0 ** 0 = 1`` handles ``factor = 0``.
    """
    idx = torch.arange(size, device=device)
    exponent = (idx.unsqueeze(0) - idx.unsqueeze(1)).to(torch.float64)  # j - i
    powers = torch.pow(torch.tensor(factor, dtype=torch.float64, device=device), exponent.clamp(min=0) * step)
    return torch.where(exponent >= 0, powers, 0.0).to(dtype)


def _reverse_discounted_cumsum(x: torch.Tensor, factor: float, K: int) -> torch.Tensor:
    """``y_k = sum_{j >= k} factor ** (j - k) x_j`` along the last dim of [B, L], L % K == 0.

    Two-level blocked scan: inside blocks of K a matmul with the [K, K] discount matrix; across
    blocks the same recursion on the block sums with factor ** K, again one matmul with an
    [L / K, L / K] matrix; the carry enters each position with factor ** (K - i).
    """
    B, L = x.shape
    if L == 0:
        return x
    nb = L // K
    inner = _discount_matrix(factor, K, 1, x.dtype, x.device)
    local = torch.matmul(x.view(B, nb, K), inner.t())  # [B, nb, K]
    if nb == 1:
        return local.view(B, L)
    outer = _discount_matrix(factor, nb, K, x.dtype, x.device)
    starts = torch.matmul(local[:, :, 0], outer.t())  # y at the first token of each block
    carry = torch.cat([starts[:, 1:], starts.new_zeros(B, 1)], dim=1)  # y at the next block
    exponent = torch.arange(K, 0, -1, device=x.device, dtype=torch.float64)  # K - i
    entry = torch.pow(torch.tensor(factor, dtype=torch.float64, device=x.device), exponent).to(x.dtype)
    return torch.baddbmm(local, carry.unsqueeze(-1), entry.expand(B, 1, K)).view(B, L)


def _compaction(mask: torch.Tensor):
    """Where each counted token lands when a row's counted tokens are moved to the left.

    Returns ``(dest, width, K)``: ``dest`` [B, T] int64, the compact index of each counted
    token and ``width + 1`` for the others; ``width``, T rounded up to a multiple of K, the
    scan block. A compact buffer has ``width + 2`` columns: column ``width`` is always 0
    (the value after the last counted token) and column ``width + 1`` takes the rest.
    """
    T = mask.shape[-1]
    K = _block_size(T) if T > 8 else max(T, 1)
    width = -(-T // K) * K
    # mask ? count - 1 : width + 1, in int32 arithmetic (bool cumsum / masked_fill are slow on CPU)
    m = mask.to(torch.int32)
    count = torch.cumsum(m, -1, dtype=torch.int32)
    dest = ((count - (width + 2)) * m + (width + 1)).long()
    return dest, width, K


def _compact(x: torch.Tensor, dest: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width + 2] rows of ``x`` [B, T] with counted tokens moved left, zeros after them
    (column ``width + 1`` holds the masked entries: slice it off)."""
    return x.new_zeros(x.shape[0], width + 2).scatter_(1, dest, x)


def _check_rewards(fn: str, rewards: torch.Tensor, mask: torch.Tensor) -> None:
    """``rewards`` is [B, T] (the shape of ``mask``) or [B] float."""
    check_tensor(fn, "rewards", rewards, ndim=(1, 2))
    check_float(fn, "rewards", rewards)
    if (rewards.shape != mask.shape) if rewards.dim() == 2 else (rewards.shape[0] != mask.shape[0]):
        _raise_rewards_shape(fn, rewards, mask)


def _compact_rewards(fn: str, rewards: torch.Tensor, mask: torch.Tensor, dest: torch.Tensor, width: int):
    """[B, width] compact float32 token rewards (the one place rewards are checked and placed):
    [B, T] rewards read at counted positions, [B] rewards on the last counted token of each
    row (a row with no counted token drops it). :func:`_expand` gives the [B, T] form."""
    _check_rewards(fn, rewards, mask)
    rewards = rewards.detach()
    if rewards.dim() == 2:
        return _compact(rewards.float(), dest, width)[:, :width]
    n = _count(mask, -1, keepdim=True)
    last = (n - 1).masked_fill_(n == 0, width + 1)
    out = rewards.new_zeros(rewards.shape[0], width + 2, dtype=torch.float32)
    return out.scatter_(1, last, rewards.float().unsqueeze(-1))[:, :width]


def _expand(y: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_compact`: [B, width] back to [B, T], exactly 0 where masked."""
    return torch.nn.functional.pad(y, (0, 2)).gather(1, dest)


def _returns(fn: str, rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    if gamma == 1.0:  # no discount: masked tokens add 0 and skip nothing, a reverse cumsum is exact
        _check_rewards(fn, rewards, mask)
        if rewards.dim() == 1:  # the reward sits on the last counted token: every counted one sees it
            return torch.where(mask, rewards.float().unsqueeze(-1), 0.0)
        token = torch.where(mask, rewards.float(), 0.0)
        return torch.where(mask, token.flip(-1).cumsum(-1).flip(-1), 0.0)
    dest, width, K = _compaction(mask)
    compact = _compact_rewards(fn, rewards, mask, dest, width)
    return _expand(_reverse_discounted_cumsum(compact, gamma, K), dest)


def _check_tokens(fn: str, mask: torch.Tensor) -> None:
    check_tensor(fn, "mask", mask, ndim=2)
    check_mask(fn, mask, "mask", mask)


@batch_args
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0) -> torch.Tensor:
    """Discounted reward-to-go over the counted tokens of each row.

    With ``t_1 < ... < t_n`` the counted positions of a row (mask True) and ``r`` the token
    rewards: ``returns[t_k] = sum_{j >= k} gamma ** (j - k) * r[t_j]``, i.e.
    ``returns[t_k] = r[t_k] + gamma * returns[t_{k+1}]`` with ``returns[t_{n+1}] = 0``;
    masked positions are skipped (no discount, no reward) and get 0.

    Args:
        rewards: [B, T] token rewards, or [B] sequence rewards placed on the last counted
            token of each row.
        mask: [B, T] bool, True = the token counts.
        gamma: discount in [0, 1].

    Returns:
        [B, T] float32 returns, 0 where ``mask`` is False.

    Example:
        >>> import torch
        >>> mask = torch.tensor([[True, False, True, True, False]])
        >>> discounted_returns(torch.tensor([1.]), mask, gamma=0.5)  # 1 on t=3; t=1 skipped
        tensor([[0.2500, 0.0000, 0.5000, 1.0000, 0.0000]])

    References:
        Sutton & Barto, "Reinforcement Learning: An Introduction", 2nd ed., section 3.3;
        REINFORCE++, https://arxiv.org/abs/2501.03262
    """
    fn = "discounted_returns"
    _check_tokens(fn, mask)
    _check_gamma(fn, "gamma", gamma)
    return _returns(fn, rewards, mask, float(gamma))


@batch_args
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """REINFORCE++ advantages: discounted token returns whitened over the whole batch.

    ``A = masked_whiten(discounted_returns(r, mask, gamma=gamma), mask)``, i.e.
    ``(G_t - mean) / sqrt(var + 1e-8)`` with the mean and unbiased variance of the returns
    ``G_t`` over every counted token of the batch (global, not per-prompt, normalization).
    With ``group_size`` or ``group_ids`` (REINFORCE++-baseline), the group mean of the
    sequence rewards is subtracted first: ``r = rewards - mean_g`` (as
    ``group_advantages(..., scale="none")``, so NaN rewards and all-equal groups give 0).

    Args:
        rewards: [B, T] token rewards (e.g. from :func:`kl_penalized_rewards`) or [B]
            sequence rewards; with groups, [B] only.
        mask: [B, T] bool, True = the token counts.
        gamma: discount in [0, 1].
        group_size: G for REINFORCE++-baseline (contiguous groups); None for plain REINFORCE++.
        group_ids: [B] integer group id of each row, instead of ``group_size``.
        sum_over_ranks: sums a tensor over data-parallel ranks (e.g.
            ``torchforge.distributed.sum_over_ranks``): the whitening statistics are then
            those of the global batch; None: this process's batch.

    Returns:
        [B, T] float32 advantages, 0 where ``mask`` is False.

    Note:
        REINFORCE++ puts the KL penalty in the reward; for REINFORCE++-baseline with KL in
        the reward, center first and shape after:
        ``kl_penalized_rewards(group_advantages(r, group_size=G, scale="none"), ...)``, then
        call this without ``group_size`` (the baseline is the mean of the raw scores, not of
        the KL-shaped returns). That is why the group path takes [B] rewards only.

    Example:
        >>> import torch
        >>> mask = torch.ones(2, 2, dtype=torch.bool)
        >>> reinforce_pp_advantages(torch.tensor([1., 0.]), mask)   # returns [[1, 1], [0, 0]]
        tensor([[ 0.8660,  0.8660],
                [-0.8660, -0.8660]])

    References:
        REINFORCE++, https://arxiv.org/abs/2501.03262
    """
    fn = "reinforce_pp_advantages"
    _check_tokens(fn, mask)
    _check_gamma(fn, "gamma", gamma)
    if group_size is not None or group_ids is not None:
        check_tensor(fn, "rewards", rewards)
        if rewards.dim() != 1:
            raise ShapeError(
                f"{fn}: with groups (group_size / group_ids), rewards must be [B] sequence rewards, got "
                f"shape {shape_str(rewards)}; for token rewards, subtract the group mean from the "
                "sequence rewards first and call without groups"
            )
        groups = _groups(fn, rewards, group_size, group_ids)
        rewards = groups.flat(_centered(groups, rewards)[0])
    returns = _returns(fn, rewards, mask, float(gamma))
    return masked_whiten(returns, mask, sum_over_ranks=sum_over_ranks)


@batch_args
def remax_advantages(rewards: torch.Tensor, baseline_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ReMax advantages: the reward-to-go minus the reward of the greedy completion.

    ``A[b, t] = sum_{t' >= t} r[b, t'] - baseline_rewards[b]`` at counted tokens (the
    undiscounted :func:`discounted_returns`), where ``baseline_rewards[b]`` is the reward of
    the greedy (argmax) completion of row b's prompt; 0 where ``mask`` is False.

    Args:
        rewards: [B] sequence rewards (on the last counted token) or [B, T] token rewards.
        baseline_rewards: [B] float reward of the greedy completion for each row's prompt.
        mask: [B, T] bool, True = the token counts.

    Returns:
        [B, T] float32 advantages; a row whose sequence reward or baseline is NaN gets 0.

    Note:
        As verl's ``compute_remax_outcome_advantage``: returns by a reverse cumulative sum
        over the counted tokens, then the baseline subtracted at every counted token; no
        whitening.

    Example:
        >>> import torch
        >>> mask = torch.tensor([[True, True, False], [True, True, True]])
        >>> remax_advantages(torch.tensor([1., 0.]), torch.tensor([0.25, 0.5]), mask)
        tensor([[ 0.7500,  0.7500,  0.0000],
                [-0.5000, -0.5000, -0.5000]])

    References:
        ReMax, https://arxiv.org/abs/2310.10505
    """
    fn = "remax_advantages"
    _check_tokens(fn, mask)
    check_tensor(fn, "baseline_rewards", baseline_rewards, ndim=1)
    check_float(fn, "baseline_rewards", baseline_rewards)
    if baseline_rewards.shape[0] != mask.shape[0]:
        raise ShapeError(
            f"{fn}: baseline_rewards has shape {shape_str(baseline_rewards)} but mask has shape "
            f"{shape_str(mask)}; expected ({mask.shape[0]},)"
        )
    check_tensor(fn, "rewards", rewards, ndim=(1, 2))
    check_float(fn, "rewards", rewards)
    if rewards.shape[0] != mask.shape[0]:
        _raise_rewards_shape(fn, rewards, mask)
    valid = torch.isfinite(baseline_rewards)
    if rewards.dim() == 1:
        valid = valid & torch.isfinite(rewards)
        rewards = torch.where(valid, rewards, 0.0)
    returns = _returns(fn, rewards, mask, 1.0)
    advantages = returns - torch.where(valid, baseline_rewards.float(), 0.0).unsqueeze(-1)
    return torch.where(mask & valid.unsqueeze(-1), advantages, 0.0)


@batch_args
def kl_penalized_rewards(
    rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """Token rewards with the KL penalty in the reward (the classic RLHF / PPO placement).

    ``out[b, t] = r[b, t] - kl_coef * approx_kl(log_probs, ref_log_probs, estimator)[b, t]``
    at counted tokens, where ``r`` is the sequence reward on the last counted token of each
    row (or the given token rewards), and 0 where ``mask`` is False.

    Args:
        rewards: [B] sequence rewards (or [B, T] token rewards).
        log_probs: [B, T] log-probs of the sampled tokens under the policy.
        ref_log_probs: [B, T] log-probs under the reference policy.
        mask: [B, T] bool, True = the token counts.
        kl_coef: weight of the KL penalty (>= 0).
        estimator: ``"k1"`` (default, as in InstructGPT and OpenRLHF), ``"k2"``, ``"k3"`` or
            ``"abs"`` (see :func:`torchforge.approx_kl`).

    Returns:
        [B, T] float32 token rewards, 0 where ``mask`` is False, without gradient.

    Note:
        This is a reward: it is computed from detached inputs and carries no gradient. To
        back-propagate through a KL term, put it in the loss instead (``grpo_loss``).

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -1.0, 0.0]]); ref = torch.tensor([[-1.5, -1.0, 0.0]])
        >>> mask = torch.tensor([[True, True, False]])
        >>> kl_penalized_rewards(torch.tensor([1.]), lp, ref, mask, kl_coef=0.1)  # -0.1*0.5
        tensor([[-0.0500,  1.0000,  0.0000]])

    References:
        InstructGPT, https://arxiv.org/abs/2203.02155; Ziegler et al., "Fine-Tuning Language
        Models from Human Preferences", https://arxiv.org/abs/1909.08593
    """
    fn = "kl_penalized_rewards"
    _check_tokens(fn, mask)
    check_tensor(fn, "log_probs", log_probs)
    check_tensor(fn, "ref_log_probs", ref_log_probs)
    check_same_shape(fn, "log_probs", log_probs, "mask", mask)
    check_non_negative(fn, "kl_coef", kl_coef, finite=True)
    dest, width, _ = _compaction(mask)
    token_rewards = _expand(_compact_rewards(fn, rewards, mask, dest, width), dest)
    try:
        kl = approx_kl(log_probs.detach(), ref_log_probs.detach(), estimator=estimator)
    except (InvalidArgumentError, ShapeError) as error:  # its checks, named for this function
        raise type(error)(str(error).replace("approx_kl: ", f"{fn}: ", 1)) from None
    return (token_rewards - kl_coef * kl).masked_fill_(~mask, 0.0)


@batch_args
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the counted tokens of each row.

    With ``t_1 < ... < t_n`` the counted positions of a row, ``r`` the token rewards and
    ``V`` the values, and ``V[t_{n+1}] = 0`` (no bootstrap after the last counted token):

    ``delta_k = r[t_k] + gamma * V[t_{k+1}] - V[t_k]``,
    ``advantages[t_k] = delta_k + gamma * lam * advantages[t_{k+1}]`` (0 after t_n),
    ``returns[t_k] = advantages[t_k] + V[t_k]``.

    Masked positions inside a row (tool / observation tokens) are skipped: value and running
    advantage carry across them to the next counted token; padding after the last counted
    token contributes nothing. Both outputs are 0 where ``mask`` is False.

    Args:
        rewards: [B, T] token rewards, or [B] sequence rewards placed on the last counted token.
        values: [B, T] critic values.
        mask: [B, T] bool, True = the token counts.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        (advantages, returns): two [B, T] float32 tensors, 0 where ``mask`` is False; not
        whitened (use ``masked_whiten``), computed without gradient.

    Note:
        Instead of the per-timestep reverse Python loop most libraries run, the counted
        tokens of each row are moved to the left (a cumsum and a scatter), the recursion is
        solved as a reverse discounted sum with a two-level blocked scan (matmuls with
        [K, K] matrices of powers of ``gamma * lam``, all <= 1), and the result is gathered
        back. The outputs agree with the loop to float32 rounding. verl's masked loop gives
        the same advantages at counted tokens (it carries them over masked ones instead of
        writing 0); TorchRL's functions treat every position as a step.

    Example:
        >>> import torch
        >>> rewards = torch.tensor([[0., 0., 1.]]); values = torch.tensor([[0.5, 9., 0.5]])
        >>> mask = torch.tensor([[True, False, True]])  # t=1 is a tool token: skipped
        >>> adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
        >>> adv   # [1 - 0.5, -, 1 - 0.5]
        tensor([[0.5000, 0.0000, 0.5000]])
        >>> ret
        tensor([[1., 0., 1.]])

    References:
        Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
        Estimation", https://arxiv.org/abs/1506.02438
    """
    fn = "gae"
    _check_tokens(fn, mask)
    check_tensor(fn, "values", values)
    check_float(fn, "values", values)
    check_same_shape(fn, "values", values, "mask", mask)
    _check_gamma(fn, "gamma", gamma)
    _check_gamma(fn, "lam", lam)
    dest, width, K = _compaction(mask)
    r_c = _compact_rewards(fn, rewards, mask, dest, width)
    v_ext = _compact(values.detach().float(), dest, width)
    v_c, v_next = v_ext[:, :width], v_ext[:, 1:width + 1]  # V[t_{n+1}] = 0: column width is 0
    delta = torch.add(r_c - v_c, v_next, alpha=float(gamma))  # 0 after the last counted token
    adv_c = _reverse_discounted_cumsum(delta, float(gamma) * float(lam), K)
    return _expand(adv_c, dest), _expand(adv_c + v_c, dest)
