"""Discounted returns and the token-level advantages built on them: reward-to-go,
REINFORCE++, ReMax, KL-shaped token rewards and GAE.

Conventions shared by every function here:

- Maths in float32 whatever the input dtype; results are float32.
- ``mask`` [B, T] bool, True where the token counts. Positions with mask False *inside*
  a sequence (tool or observation tokens of a multi-turn rollout) are skipped: the
  recursions run over the counted tokens only, as if the masked ones were cut out of the
  row, and values or rewards stored there are never read (a NaN there does not leak).
  Every [B, T] result is exactly 0 where ``mask`` is False.
- ``rewards`` is either [B, T] (token rewards, read at counted positions only) or [B]
  (one reward per sequence, placed on the last counted token of its row; a row with no
  counted token drops it).
- The recursions ``y_k = x_k + factor * y_{k+1}`` are not a Python loop over time: each
  row's counted tokens are moved to the left (a cumsum and a scatter), the reverse
  discounted sum is a two-level blocked scan (matmuls with [K, K] matrices of powers of
  the discount, all <= 1, formed in float64 and rounded once), and the result is gathered
  back. The outputs agree with the loop to float32 rounding.
- REINFORCE++-baseline subtracts the group mean of :func:`torchforge.advantages.group_advantages`
  (``scale="none"``) before the returns; the group-relative estimators live there.
- No Python branch depends on tensor values, so every function compiles with
  ``torch.compile(fullgraph=True)``, except :func:`reinforce_pp_advantages` with
  ``group_ids`` (one synchronization to size the table of groups).

References:
    Sutton & Barto, "Reinforcement Learning: An Introduction", 2nd ed., section 3.3;
    GAE, https://arxiv.org/abs/1506.02438; REINFORCE++, https://arxiv.org/abs/2501.03262;
    ReMax, https://arxiv.org/abs/2310.10505; InstructGPT, https://arxiv.org/abs/2203.02155
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchforge.advantages import group_advantages
from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    ShapeError,
    check_float,
    check_mask,
    check_non_negative,
    check_same_shape,
    check_tensor,
    reraise_as,
    shape_str,
)
from torchforge.kl import approx_kl
from torchforge.reduce import masked_whiten

__all__ = [
    "discounted_returns",
    "gae",
    "kl_penalized_rewards",
    "reinforce_pp_advantages",
    "remax_advantages",
]


# --- input checks ------------------------------------------------------------------------

def _check_gamma(fn: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0):
        raise InvalidArgumentError(f"{fn}: {name} must be a float in [0, 1], got {value!r}")


def _raise_rewards_shape(fn: str, rewards: torch.Tensor, mask: torch.Tensor):
    raise ShapeError(
        f"{fn}: rewards has shape {shape_str(rewards)} but mask has shape {shape_str(mask)}; "
        f"expected ({mask.shape[0]},) or {shape_str(mask)}"
    )


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


_EIGHT_ONES = 0x0101010101010101  # eight True flags read as one little-endian int64


def _right_padded(mask: torch.Tensor) -> bool:
    """True when no masked token comes before a counted one in any row of ``mask`` [B, T].

    Reads the flags eight at a time as int64 words (a pass over T / 8 words instead of
    shifted bool compares, ~3x faster on a CPU): a row is right-padded when each word is a
    run of leading ones (``w * 255 + 1`` a power of 256, 0 mod 2**64 for a full word) and
    a non-zero word follows only full ones. False (the general path) under ``torch.compile``,
    where the data-dependent branch would break the graph, and when T % 8 != 0.
    """
    B, T = mask.shape
    if T == 0 or T % 8 or torch.compiler.is_compiling():
        return False
    w = mask.contiguous().view(torch.uint8).view(torch.int64)  # [B, T / 8]
    x = w * 255 + 1
    if not bool(((x & (x - 1)) == 0).all()):  # some word is not a run of leading ones
        return False
    return not bool(((w[:, 1:] != 0) & (w[:, :-1] != _EIGHT_ONES)).any())


def _compaction(mask: torch.Tensor):
    """Where each counted token lands when a row's counted tokens are moved to the left.

    Returns ``(dest, width, K)``: ``dest`` [B, T] int64, the compact index of each counted
    token and ``width + 1`` for the others, or None when the mask is right-padded (no
    masked token before a counted one: every token stays where it is); ``width``, T rounded
    up to a multiple of K, the scan block. A compact buffer has ``width + 2`` columns: column
    ``width`` is always 0 (the value after the last counted token) and column ``width + 1``
    takes the rest.
    """
    T = mask.shape[-1]
    K = _block_size(T) if T > 8 else max(T, 1)
    width = -(-T // K) * K
    if _right_padded(mask):  # nothing moves
        return None, width, K
    # mask ? count - 1 : width + 1, in int32 arithmetic (bool cumsum / masked_fill are slow on CPU)
    m = mask.to(torch.int32)
    count = torch.cumsum(m, -1, dtype=torch.int32)
    dest = ((count - (width + 2)) * m + (width + 1)).long()
    return dest, width, K


def _compact(x: torch.Tensor, dest: torch.Tensor | None, width: int, mask: torch.Tensor) -> torch.Tensor:
    """[B, width + 2] rows of ``x`` [B, T] with counted tokens moved left, zeros after them
    (column ``width + 1`` holds the masked entries: slice it off). ``dest`` None (a
    right-padded mask): ``x`` zeroed where masked, padded with zero columns."""
    if dest is None:
        return torch.nn.functional.pad(torch.where(mask, x, 0.0), (0, width + 2 - x.shape[-1]))
    return x.new_zeros(x.shape[0], width + 2).scatter_(1, dest, x)


def _check_rewards(fn: str, rewards: torch.Tensor, mask: torch.Tensor) -> None:
    """``rewards`` is [B, T] (the shape of ``mask``) or [B] float."""
    check_tensor(fn, "rewards", rewards, ndim=(1, 2))
    check_float(fn, "rewards", rewards)
    if (rewards.shape != mask.shape) if rewards.dim() == 2 else (rewards.shape[0] != mask.shape[0]):
        _raise_rewards_shape(fn, rewards, mask)


def _compact_rewards(fn: str, rewards: torch.Tensor, mask: torch.Tensor, dest: torch.Tensor | None, width: int):
    """[B, width] compact float32 token rewards (the one place rewards are checked and placed):
    [B, T] rewards read at counted positions, [B] rewards on the last counted token of each
    row (a row with no counted token drops it). :func:`_expand` gives the [B, T] form."""
    _check_rewards(fn, rewards, mask)
    rewards = rewards.detach()
    if rewards.dim() == 2:
        return _compact(rewards.float(), dest, width, mask)[:, :width]
    n = torch.count_nonzero(mask, -1).unsqueeze(-1)
    last = (n - 1).masked_fill_(n == 0, width + 1)
    out = rewards.new_zeros(rewards.shape[0], width + 2, dtype=torch.float32)
    return out.scatter_(1, last, rewards.float().unsqueeze(-1))[:, :width]


def _expand(y: torch.Tensor, dest: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_compact`: [B, width] back to [B, T], exactly 0 where masked."""
    if dest is None:
        return torch.where(mask, y[:, :mask.shape[-1]], 0.0)
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
    return _expand(_reverse_discounted_cumsum(compact, gamma, K), dest, mask)


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
        with reraise_as(fn):  # the baseline of REINFORCE++-baseline: r - mean_g, its checks named for this function
            rewards = group_advantages(rewards, group_size=group_size, group_ids=group_ids, scale="none")
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
    token_rewards = _expand(_compact_rewards(fn, rewards, mask, dest, width), dest, mask)
    with reraise_as(fn):  # approx_kl's checks, named for this function
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
    r_c = _compact_rewards(fn, rewards, mask, dest, width)
    values = values.detach().float()
    v_ext = _compact(values, dest, width, mask)
    v_c, v_next = v_ext[:, :width], v_ext[:, 1:width + 1]  # V[t_{n+1}] = 0: column width is 0
    delta = torch.add(r_c - v_c, v_next, alpha=float(gamma))  # 0 after the last counted token
    adv_c = _reverse_discounted_cumsum(delta, float(gamma) * float(lam), K)
    return _expand(adv_c, dest, mask), _expand(adv_c + v_c, dest, mask)
