"""Advantage estimators and returns: group-normalized (GRPO), leave-one-out (RLOO),
discounted reward-to-go, REINFORCE++, KL-shaped rewards and GAE.

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
- No Python branch depends on tensor values, so every function compiles with
  ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations


import torch

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
from torchforge.kl import approx_kl
from torchforge.reduce import masked_whiten

__all__ = [
    "group_advantages",
    "rloo_advantages",
    "discounted_returns",
    "reinforce_pp_advantages",
    "kl_penalized_rewards",
    "gae",
    "GROUP_SCALES",
]

GROUP_SCALES = ("group", "batch", "none")

# A group whose rewards' spread (root-mean-square of r - mean) is at most G * _TIE_RTOL of
# their root-mean-square counts as all equal (a 4x margin over the float32 rounding error of
# the mean of G equal numbers, G * 2**-24): its advantage is exactly 0.
_TIE_RTOL = 2.0**-22
_TINY = torch.finfo(torch.float32).tiny


# --- input checks ------------------------------------------------------------------------

def _check_group(fn: str, rewards: torch.Tensor, group_size, *, min_size: int = 1) -> None:
    check_tensor(fn, "rewards", rewards, ndim=1)
    check_float(fn, "rewards", rewards)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < min_size:
        raise InvalidArgumentError(f"{fn}: group_size must be an int >= {min_size}, got {group_size!r}")
    if rewards.shape[0] % group_size != 0:
        raise ShapeError(
            f"{fn}: rewards has shape {shape_str(rewards)}, which does not split into groups of "
            f"group_size={group_size}; expected B a multiple of {group_size} (B = prompts x G, "
            "each prompt's G samples contiguous)"
        )


def _check_gamma(fn: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0):
        raise InvalidArgumentError(f"{fn}: {name} must be a float in [0, 1], got {value!r}")


def _raise_rewards_shape(fn: str, rewards: torch.Tensor, mask: torch.Tensor):
    raise ShapeError(
        f"{fn}: rewards has shape {shape_str(rewards)} but mask has shape {shape_str(mask)}; "
        f"expected ({mask.shape[0]},) or {shape_str(mask)}"
    )


def _token_rewards(fn: str, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] float32 token rewards, 0 where ``mask`` is False.

    [B, T] rewards are read at counted positions; [B] rewards go on the last counted token.
    """
    check_tensor(fn, "rewards", rewards, ndim=(1, 2))
    check_float(fn, "rewards", rewards)
    if rewards.dim() == 2:
        if rewards.shape != mask.shape:
            _raise_rewards_shape(fn, rewards, mask)
        return rewards.float().masked_fill(~mask, 0.0)
    if rewards.shape[0] != mask.shape[0]:
        _raise_rewards_shape(fn, rewards, mask)
    count = mask.cumsum(-1)
    last = mask & (count == count[:, -1:])
    return rewards.float().unsqueeze(-1).masked_fill(~last, 0.0)


# --- group statistics ---------------------------------------------------------------------

def _group_stats(rewards: torch.Tensor, group_size: int):
    """Per-group statistics over the finite rewards, as [B / G, G] and [B / G, 1] tensors.

    Returns ``(r0, valid, n, centered, kept, spread)``: rewards with non-finite entries set
    to 0, 1.0 where the reward is finite, the count of finite rewards, ``r - mean`` (0 where
    not finite), 1.0 for groups that are not tied (0.0 where all valid rewards are equal)
    and ``sum((r - mean)^2)`` per group.

    Written without bool tensors (float 0/1 weights, sums as matmuls with a ones vector):
    on CPU this is several times faster than masked_fill / where for [B / G, G] shapes.
    """
    r = rewards.float().view(-1, group_size)
    r0 = torch.nan_to_num(r, nan=0.0, posinf=0.0, neginf=0.0)
    valid = torch.nan_to_num(r * 0.0 + 1.0, nan=0.0)  # 1 where finite (inf * 0 is NaN too)
    ones = r.new_ones(group_size, 1)
    n = valid @ ones
    centered = (r0 - (r0 @ ones) / n.clamp(min=1)) * valid
    # Tie: the spread is below the float32 rounding of the mean (|error| <= G * 2**-24 * |r|):
    # sum((r - mean)^2) <= (G * 2**-22)^2 * sum(r^2), which also holds for 0 or 1 valid rewards.
    spread = centered.square() @ ones
    size = (r0.square() @ ones) * (group_size * _TIE_RTOL) ** 2
    kept = (spread > size).to(r0.dtype)
    return r0, valid, n, centered, kept, spread


@batch_args
def group_advantages(
    rewards: torch.Tensor, *, group_size: int, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages of GRPO: each reward minus its group's mean, optionally scaled.

    With ``r`` the rewards viewed as [B / G, G] groups (the G samples of one prompt are
    contiguous), ``mean_g`` and ``std_g`` the mean and unbiased standard deviation of the
    finite rewards of group g, and ``std_batch`` the unbiased standard deviation of all
    finite rewards of the batch:

    - ``scale="group"``: ``A = (r - mean_g) / (std_g + eps)`` (GRPO);
    - ``scale="batch"``: ``A = (r - mean_g) / (std_batch + eps)`` (TRL's
      ``scale_rewards="batch"``, Lite PPO's group mean + batch std);
    - ``scale="none"``:  ``A = r - mean_g`` (Dr. GRPO).

    A NaN reward ("not applicable"; also +-inf) is left out of every statistic and gets
    ``A = 0``. A group whose valid rewards are all equal gets ``A = 0`` exactly, whatever
    ``scale`` and ``eps``: "equal" up to float32 rounding, i.e. the root-mean-square of
    ``r - mean_g`` is at most ``G * 2**-22`` times that of ``r``.

    Args:
        rewards: [B] float sequence rewards, B = prompts x G, NaN = no reward.
        group_size: G, the number of samples per prompt (>= 1).
        scale: one of ``"group"``, ``"batch"``, ``"none"``.
        eps: added to the standard deviation before dividing (>= 0).

    Returns:
        [B] float32 advantages.

    Note:
        The standard deviation is unbiased (Bessel's correction, ``/ (n - 1)``), as in TRL
        and verl (``torch.std``); a group with a single valid reward has no spread and gets
        0. ``eps`` is added to the std, not the variance, as TRL (1e-4) and verl (1e-6) do.
        Where other libraries divide a float residue of ~1e-9 by ``std + eps`` and give
        advantages of up to 1e3 for a group of equal rewards (e.g. ``[0.1] * G``), the tie
        guard here returns exact zeros.

    Example:
        >>> import torch
        >>> group_advantages(torch.tensor([1., 0., 0.1, 0.1]), group_size=2)
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
        >>> group_advantages(torch.tensor([1., 0., float("nan"), 2.]), group_size=2, scale="none")
        tensor([ 0.5000, -0.5000,  0.0000,  0.0000])

    References:
        GRPO (DeepSeekMath), https://arxiv.org/abs/2402.03300; Dr. GRPO,
        https://arxiv.org/abs/2503.20783; Lite PPO, https://arxiv.org/abs/2508.08221
    """
    fn = "group_advantages"
    _check_group(fn, rewards, group_size)
    check_choice(fn, "scale", scale, GROUP_SCALES)
    check_non_negative(fn, "eps", eps)
    r0, valid, n, centered, kept, spread = _group_stats(rewards, group_size)
    if scale == "group":
        var = spread / (n - 1).clamp(min=1)
        factor = kept / (var.sqrt() + eps).clamp(min=_TINY)  # tied: 0, even with eps=0
    elif scale == "batch":
        n_all = n.sum()
        mean_all = r0.sum() / n_all.clamp(min=1)
        var_all = ((r0 - mean_all) * valid).square().sum() / (n_all - 1).clamp(min=1)
        factor = kept / (var_all.sqrt() + eps).clamp(min=_TINY)
    else:
        factor = kept
    return (centered * factor).add_(0.0).view(-1)  # add 0: -0.0 -> 0.0


@batch_args
def rloo_advantages(rewards: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages of RLOO: each reward minus the mean of the rest of its group.

    ``A_i = r_i - (sum_j r_j - r_i) / (n - 1)`` over the n finite rewards of i's group,
    computed as the equal ``n / (n - 1) * (r_i - mean_g)``.

    A NaN reward is left out of the baselines of the others and gets ``A = 0``; a group with
    fewer than two valid rewards (no baseline) or whose valid rewards are all equal gets 0.

    Args:
        rewards: [B] float sequence rewards, B = prompts x G, NaN = no reward.
        group_size: G >= 2 samples per prompt, contiguous.

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
    _check_group(fn, rewards, group_size, min_size=2)
    _, _, n, centered, kept, _ = _group_stats(rewards, group_size)
    # r_i - (sum_j r_j - r_i) / (n - 1) == n / (n - 1) * (r_i - mean); n < 2 is always tied
    return (centered * (kept * n / (n - 1).clamp(min=1))).add_(0.0).view(-1)


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


def _compact_rewards(fn: str, rewards: torch.Tensor, mask: torch.Tensor, dest: torch.Tensor, width: int):
    """[B, width] compact float32 token rewards from [B, T] or [B] (last counted token) rewards."""
    check_tensor(fn, "rewards", rewards, ndim=(1, 2))
    check_float(fn, "rewards", rewards)
    if rewards.dim() == 2:
        if rewards.shape != mask.shape:
            _raise_rewards_shape(fn, rewards, mask)
        return _compact(rewards.float(), dest, width)[:, :width]
    if rewards.shape[0] != mask.shape[0]:
        _raise_rewards_shape(fn, rewards, mask)
    n = mask.sum(-1, keepdim=True)
    last = (n - 1).masked_fill_(n == 0, width + 1)
    out = rewards.new_zeros(rewards.shape[0], width + 2, dtype=torch.float32)
    return out.scatter_(1, last, rewards.float().unsqueeze(-1))[:, :width]


def _expand(y: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_compact`: [B, width] back to [B, T], exactly 0 where masked."""
    return torch.nn.functional.pad(y, (0, 2)).gather(1, dest)


def _returns(fn: str, rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
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
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, group_size: int | None = None
) -> torch.Tensor:
    """REINFORCE++ advantages: discounted token returns whitened over the whole batch.

    ``A = masked_whiten(discounted_returns(r, mask, gamma=gamma), mask)``, i.e.
    ``(G_t - mean) / sqrt(var + 1e-8)`` with the mean and unbiased variance of the returns
    ``G_t`` over every counted token of the batch (global, not per-prompt, normalization).
    With ``group_size`` (REINFORCE++-baseline), the group mean of the sequence rewards is
    subtracted first: ``r = rewards - mean_g`` (as ``group_advantages(..., scale="none")``,
    so NaN rewards and all-equal groups give 0).

    Args:
        rewards: [B, T] token rewards (e.g. from :func:`kl_penalized_rewards`) or [B]
            sequence rewards; with ``group_size``, [B] only.
        mask: [B, T] bool, True = the token counts.
        gamma: discount in [0, 1].
        group_size: G for REINFORCE++-baseline; None for plain REINFORCE++.

    Returns:
        [B, T] float32 advantages, 0 where ``mask`` is False.

    Note:
        REINFORCE++ puts the KL penalty in the reward; for REINFORCE++-baseline with KL in
        the reward, center first and shape after:
        ``kl_penalized_rewards(group_advantages(r, group_size=G, scale="none"), ...)``, then
        call this without ``group_size`` (the baseline is the mean of the raw scores, not of
        the KL-shaped returns). That is why ``group_size`` takes [B] rewards only.

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
    if group_size is not None:
        check_tensor(fn, "rewards", rewards)
        if rewards.dim() != 1:
            raise ShapeError(
                f"{fn}: with group_size={group_size!r}, rewards must be [B] sequence rewards, got "
                f"shape {shape_str(rewards)}; for token rewards, subtract the group mean from the "
                "sequence rewards first and call without group_size"
            )
        _check_group(fn, rewards, group_size)
        _, _, _, centered, kept, _ = _group_stats(rewards, group_size)
        rewards = (centered * kept).view(-1)
    returns = _returns(fn, rewards, mask, float(gamma))
    return masked_whiten(returns, mask)


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
    check_same_shape(fn, "log_probs", log_probs, "mask", mask)
    check_non_negative(fn, "kl_coef", kl_coef)
    token_rewards = _token_rewards(fn, rewards.detach(), mask)
    kl = approx_kl(log_probs.detach(), ref_log_probs.detach(), estimator=estimator)
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
    r_c = _compact_rewards(fn, rewards.detach(), mask, dest, width)
    v_ext = _compact(values.detach().float(), dest, width)
    v_c, v_next = v_ext[:, :width], v_ext[:, 1:width + 1]  # V[t_{n+1}] = 0: column width is 0
    delta = torch.add(r_c - v_c, v_next, alpha=float(gamma))  # 0 after the last counted token
    adv_c = _reverse_discounted_cumsum(delta, float(gamma) * float(lam), K)
    return _expand(adv_c, dest), _expand(adv_c + v_c, dest)
