"""Group-relative advantage estimators: group-normalized (GRPO, Dr. GRPO, GDPO),
leave-one-out (RLOO), Pass@k training (analytical, and best-minus-second) and OPO, with the one test of a group whose rewards
are all equal (``zero_std_groups``, DAPO's dynamic-sampling filter).

Conventions shared by every function here:

- Maths in float32 whatever the input dtype; results are float32.
- ``rewards`` are sequence rewards, [B] (or [B, K] for GDPO); NaN (and +-inf) means "no
  reward": left out of every statistic, advantage 0.
- Groups (the G samples of one prompt) are contiguous blocks of ``group_size`` rows, or
  the rows sharing a ``group_ids`` value (any order, any sizes); pass exactly one. A group
  whose finite rewards are all exactly equal gets advantage 0 in every group estimator
  (exactly the groups ``zero_std_groups`` flags), and adding a constant to every reward
  changes no advantage.
- ``mask`` [B, T] bool (OPO only, for the response lengths), True where the token counts.
- No Python branch depends on tensor values, so every function compiles with
  ``torch.compile(fullgraph=True)``, except with ``group_ids`` (one synchronization to
  size the table of groups) and ``passk_advantages`` (it checks that rewards are 0 / 1).

Discounted returns and the token-level estimators built on them (REINFORCE++, ReMax, GAE)
are in :mod:`torchforge.returns`.

References:
    GRPO (DeepSeekMath), https://arxiv.org/abs/2402.03300; Dr. GRPO,
    https://arxiv.org/abs/2503.20783; GDPO, https://arxiv.org/abs/2601.05242; RLOO,
    https://arxiv.org/abs/2402.14740; Pass@k training, https://arxiv.org/abs/2508.10751;
    inference-time objectives (best-minus-second), https://arxiv.org/abs/2503.19595; OPO, https://arxiv.org/abs/2505.23585; DAPO, https://arxiv.org/abs/2503.14476
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
    check_tensor,
    shape_str,
)
from torchforge.reduce import masked_var, pooled_var

__all__ = [
    "GROUP_SCALES",
    "best_minus_second_advantages",
    "group_advantages",
    "opo_advantages",
    "passk_advantages",
    "rloo_advantages",
    "zero_std_groups",
]

GROUP_SCALES = ("group", "batch", "none")

_TINY = torch.finfo(torch.float32).tiny


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
def best_minus_second_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Pass@k advantages by best-minus-second: only each group's best sample gets a signal.

    For the objective ``E[max_i r_i]`` over the k = G samples of a prompt (pass@k for binary
    rewards), the leave-one-out baseline of the maximum gives every sample but the best
    advantage 0, and the best one its margin over the runner-up. With ``r_max`` and
    ``r_second`` the largest and second-largest finite rewards of the group (``r_second
    = r_max`` when the maximum is shared) and ``std_g`` the unbiased standard deviation of
    its finite rewards:

    ``A_best = (r_max - r_second) / (std_g + eps)`` (``scale="none"``: ``r_max - r_second``),
    ``A_i = 0`` for every other sample.

    Args:
        rewards: [B] float sequence rewards (any real values); NaN = no reward.
        group_size: G samples per prompt, contiguous.
        group_ids: [B] integer group id of each row (any order, any sizes), instead of
            ``group_size``.
        scale: ``"group"`` (divide by ``std_g + eps``, as GRPO) or ``"none"``.
        eps: added to ``std_g`` (>= 0).

    Returns:
        [B] float32 advantages, non-zero only at the best finite reward of a group whose
        maximum is unique; 0 for NaN rewards, for groups with fewer than two finite
        rewards and for groups whose maximum is shared (a tie has margin 0, exactly).

    Note:
        The margin is formed in the input's precision before the cast (``r - max_g r``),
        so an offset of 1e4 added to every reward changes no advantage. verl's
        ``compute_grpo_passk_outcome_advantage`` computes the same thing with a loop over
        groups and ``torch.topk``; it raises for a group of one sample and gives NaN to a
        group with a NaN reward (``torchforge.compat.verl`` reproduces that). For binary
        rewards with the exact Pass@k expectation over k-subsets, see
        :func:`passk_advantages`.

    Example:
        >>> import torch
        >>> r = torch.tensor([1.0, 0.5, 0.0, 0.2, 3.0, 3.0, 1.0, 0.0])
        >>> best_minus_second_advantages(r, group_size=4, scale="none")  # 1 - 0.5; a tie: 0
        tensor([0.5000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000])
        >>> best_minus_second_advantages(r[:4], group_size=4, eps=0.0)   # 0.5 / std(r)
        tensor([1.1496, 0.0000, 0.0000, 0.0000])

    References:
        Y. Tang et al., "Optimizing Language Models for Inference Time Objectives using
        Reinforcement Learning", https://arxiv.org/abs/2503.19595
    """
    fn = "best_minus_second_advantages"
    check_tensor(fn, "rewards", rewards, ndim=1)
    groups = _groups(fn, rewards, group_size, group_ids)
    check_choice(fn, "scale", scale, ("group", "none"))
    check_non_negative(fn, "eps", eps)
    d, valid, d_sum, _ = _shifted(groups, rewards)             # d = r - r_max <= 0; 0 where no reward
    best = (d == 0) & (valid > 0)
    n, n_best = groups.sum(valid), groups.sum(best.float())
    runner_up = groups.amax(torch.where(best | (valid == 0), -math.inf, d))  # r_second - r_max, or -inf
    unique = (n >= 2) & (n_best == 1)
    margin = torch.where(unique, -runner_up, 0.0)              # r_max - r_second
    if scale == "group":
        centered = d - valid * groups.expand(d_sum.float() / n.clamp(min=1))
        std_g = groups.sum(centered.square() * valid).div_((n - 1).clamp(min=1)).sqrt_()
        margin = margin * _scale_factor(std_g, eps)
    return groups.flat(torch.where(best, groups.expand(margin), 0.0)) + 0.0


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
    check_tensor(fn, "mask", mask, ndim=2)
    check_mask(fn, mask, "mask", mask)
    if mask.shape[0] != rewards.shape[0]:
        raise ShapeError(
            f"{fn}: rewards has shape {shape_str(rewards)} but mask has shape {shape_str(mask)}; "
            f"expected ({mask.shape[0]},)"
        )
    d, valid, _, tied = _deviations(groups, rewards)
    lengths = groups.view(torch.count_nonzero(mask, -1).float()) * valid
    total = groups.sum(lengths)
    b = groups.sum(lengths * d) / total.clamp(min=1)
    kept = (~tied & (total > 0)).float()
    return groups.flat((d - groups.expand(b)) * (valid * groups.expand(kept))) + 0.0


# --- the groups every estimator above gives 0 ----------------------------------------------

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
