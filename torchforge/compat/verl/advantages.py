"""verl 0.9.1's advantage side of ``verl.trainer.ppo.core_algos`` on torchforge's primitives.

The advantage estimators (``compute_*_advantage*``, by verl's names, parameters, defaults
and ``(advantages, returns)`` tuples), the registry that picks them by name
(:func:`get_adv_estimator_fn`, :class:`AdvantageEstimator`), the KL in the reward
(:func:`compute_rewards`, :func:`kl_penalty`, the KL controllers) and PF-PPO's resampling.
Each equals verl's function on the same inputs (tests/compat/test_verl_advantages.py calls
both). ``index`` is verl's: a [B] array of group ids of any hashable type (uids), grouped
by equality as verl's dict does; ``response_mask`` is verl's 0/1 mask of any dtype. A
verl ``config`` (OmegaConf ``DictConfig``, verl's ``AlgoConfig``, a dict or any object) is
read by key or attribute; nothing here imports verl or omegaconf.

How each verl function maps onto torchforge:

==================================================  ==============================================================
verl (``core_algos``)                               torchforge
==================================================  ==============================================================
``compute_gae_advantage_return``                    :func:`~torchforge.returns.gae`, then verl's carry over masked
                                                    positions and ``masked_whiten`` (mean, var of :mod:`~torchforge.reduce`)
``compute_grpo_outcome_advantage``,                 :func:`~torchforge.advantages.group_advantages` (``scale="group"``,
``compute_grpo_vectorized_outcome_advantage``       or ``"none"`` without ``norm_adv_by_std_in_grpo``), ``group_ids=``
``compute_gdpo_outcome_advantage``                  the GRPO twin per reward key, weighted sum, verl's token whitening
``compute_grpo_passk_outcome_advantage``            :func:`~torchforge.advantages.best_minus_second_advantages`
``compute_reinforce_plus_plus_baseline_...``        ``group_advantages(scale="none")``, then verl's token whitening
``compute_rloo_outcome_advantage``,                 :func:`~torchforge.advantages.rloo_advantages`
``compute_rloo_vectorized_outcome_advantage``
``compute_opo_outcome_advantage``                   :func:`~torchforge.advantages.opo_advantages`
``compute_reinforce_plus_plus_outcome_advantage``   :func:`~torchforge.returns.discounted_returns`, verl's whitening
``compute_remax_outcome_advantage``                 ``discounted_returns(gamma=1)`` minus the baseline
``compute_gpg_outcome_advantage``                   ``group_advantages(scale="none")`` times ``B / #nonzero``
``compute_optimal_token_baseline_advantage``,       ``discounted_returns(gamma=1)`` and the per-step baseline
``compute_multi_turn_optimal_token_baseline_...``   ``sum W G / sum W`` (torchforge has no OTB primitive)
``compute_rewards``                                 ``scores - kl_ratio * approx_kl(estimator="k1")`` (with gradient)
``kl_penalty``, ``kl_penalty_forward``              :func:`~torchforge.kl.approx_kl` (``"k3+"``: k2's gradient)
``AdaptiveKLController``, ``get_kl_controller``     :func:`~torchforge.kl.adaptive_kl_coef` as the update
``compute_pf_ppo_reweight_data``                    resampling by score weights (no torchforge primitive)
==================================================  ==============================================================

Where verl's behaviour differs from the native primitives, these twins reproduce verl's
(each function's Note says which applies):

- a group of one sample: verl's baseline is 0 (GRPO: ``A = r / (1 + epsilon)``; RLOO, OPO,
  RF++-baseline, GPG: ``A = r``; verl's vectorized RLOO: 0), where natively such a group
  has no baseline and gets 0; verl's pass@k raises;
- a NaN (or infinite) reward: natively it is "no reward" (left out, advantage 0); verl's
  arithmetic spreads it (its group, or for token recursions every earlier token of its
  row, or through the whitening the whole batch), and so do these twins, to the same
  positions (``NaN * 0`` included, where verl multiplies by the mask);
- verl's whitening: mean and unbiased variance over the counted tokens, applied at every
  position (GAE's advantages are not multiplied by the mask afterwards), and fewer than
  two counted tokens raise (verl's ``masked_var``); native ``masked_whiten`` writes 0
  where masked and gives 0 for fewer than two;
- GAE, REINFORCE++ and ReMax: verl carries the running value over masked positions, so a
  masked position holds the value of the next counted token (0 after the last);
  natively every masked position is 0;
- ``kl_penalty``'s k3: verl clamps ``log r`` at +-20 and k3 at +-10 (no gradient beyond,
  about 2.5 nats below the reference), where native k3 continues along its tangent
  beyond ``ref / pi = max_ratio`` (bounded, never a zero gradient);
- ties: verl divides its group's rounding residue by ``epsilon``; natively an all-equal
  group is exactly 0. In float64 verl's residue is ~1e-11 and the twins give 0 (the
  value in exact arithmetic), with ``epsilon=0`` an exact tie is verl's 0 / 0 = NaN.

and where they keep torchforge's contract instead:

- float32 maths (the primitives'): results are float32 and agree with verl's float64 to
  float32 rounding (deviations from the group mean are formed in the input's precision,
  so reward offsets of 1e4 cost nothing there; whitening of values near 1e4 with a spread
  of 1 costs float32 rounding of the values, as verl's own float32 does);
- bad input raises torchforge's errors (``ValueError`` / ``TypeError`` subclasses) where
  verl asserts or raises ``ValueError`` / ``NotImplementedError``.
"""

from __future__ import annotations

import copy
import math
from enum import Enum

import numpy as np
import torch
import torch.nn.functional as F

from torchforge.advantages import (
    best_minus_second_advantages,
    group_advantages,
    opo_advantages,
    rloo_advantages,
)
from torchforge.errors import (
    InvalidArgumentError,
    ShapeError,
    check_float,
    check_same_shape,
    check_tensor,
    reraise_as,
    shape_str,
)
from torchforge.kl import _k3, adaptive_kl_coef, approx_kl
from torchforge.ratios import clamp_log_ratio
from torchforge.reduce import masked_mean, masked_var
from torchforge.returns import _compact, _compaction, _expand, discounted_returns, gae

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_pf_ppo_reweight_data",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_forward",
    "register_adv_est",
]

_PREFIX = "torchforge.compat.verl."
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


# --- verl's inputs ---------------------------------------------------------------------------

def _get(config, name: str, default=None):
    """``config[name]`` / ``config.name`` (DictConfig, AlgoConfig, dict, namespace), else ``default``."""
    if config is None:
        return default
    if hasattr(config, "get"):
        return config.get(name, default)
    return getattr(config, name, default)


def _mask(fn: str, response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """verl's 0/1 ``response_mask`` (any dtype) as torchforge's bool mask, the shape of ``like``."""
    check_tensor(fn, "response_mask", response_mask, ndim=2)
    check_same_shape(fn, "response_mask", response_mask, "token_level_rewards", like)
    return response_mask.bool()


def _rewards(fn: str, token_level_rewards: torch.Tensor, name: str = "token_level_rewards") -> torch.Tensor:
    check_tensor(fn, name, token_level_rewards, ndim=2)
    check_float(fn, name, token_level_rewards)
    return token_level_rewards.detach()


def _group_ids(fn: str, index, B: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``index`` ([B] group ids of any hashable type) as ``(ids, counts)``: [B] int64
    in ``[0, G)`` and [G] float32 group sizes. Equal ids share a group, as in verl's dict."""
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    index = np.asarray(index)
    if index.ndim != 1 or index.shape[0] != B:
        raise ShapeError(f"{fn}: index has shape {index.shape} but the batch has {B} rows; expected ({B},)")
    if index.dtype.kind in "iub":  # integers: torch.unique, no Python loop
        ids = torch.unique(torch.from_numpy(index.astype(np.int64)), return_inverse=True)[1]
    else:
        table: dict = {}
        ids = torch.tensor([table.setdefault(u, len(table)) for u in index.tolist()], dtype=torch.int64)
    ids = ids.to(device)
    counts = torch.bincount(ids, minlength=int(ids.max()) + 1 if B else 0).float()
    return ids, counts


def _group_sum(x: torch.Tensor, ids: torch.Tensor, G: int) -> torch.Tensor:
    """Per-group sums of the [B] (or [B, T]) ``x`` in its own dtype, NaN and inf kept (verl's)."""
    return x.new_zeros(G, *x.shape[1:]).index_add_(0, ids, x)


def _times_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``x * response_mask``: 0 where masked, but NaN stays NaN there (``NaN * 0``)."""
    return x * mask.to(x.dtype)


def _whiten(fn: str, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_whiten``: ``(values - mean) / sqrt(var + 1e-8)`` at *every* position,
    with torchforge's masked mean and unbiased variance over the counted tokens; fewer than
    two counted tokens raise, as verl's ``masked_var`` does."""
    n = int(torch.count_nonzero(mask))
    if n < 2:
        raise InvalidArgumentError(
            f"{fn}: response_mask counts {n} token(s); verl's masked_whiten needs at least 2 (its "
            "masked_var raises ValueError); pass a batch with more counted tokens"
        )
    with reraise_as(fn):
        mean, var = masked_mean(values, mask), masked_var(values, mask)
    return (values.float() - mean) * torch.rsqrt(var + 1e-8)


def _poisoned(*tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: True at t where any of ``tokens`` is non-finite at some t' >= t of the
    row, the positions verl's reverse recursions (``x_t = r_t + gamma x_{t+1}``) turn NaN."""
    bad = ~torch.isfinite(tokens[0])
    for x in tokens[1:]:
        bad = bad | ~torch.isfinite(x)
    return bad.flip(-1).cummax(-1).values.flip(-1)


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0.0)


def _carry_left(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` [B, T] (0 where masked) with each masked position holding the value of the next
    counted token of its row, 0 after the last: what verl's masked loops carry there."""
    T = mask.shape[-1]
    position = torch.where(mask, torch.arange(T, device=mask.device), T)
    following = position.flip(-1).cummin(-1).values.flip(-1)
    return torch.nn.functional.pad(x, (0, 1)).gather(1, following)


# --- GRPO and the group baselines -----------------------------------------------------------------

def _grpo(fn, scores, ids, counts, epsilon, norm) -> torch.Tensor:
    """verl's GRPO scalar per row, [B] float32, on :func:`group_advantages`.

    The primitive gives ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g``) with its tie
    guard and NaN as "no reward"; verl's choices are then put back: a group of one has
    mean 0 and std 1, a group with a non-finite reward spreads it (its mean and std are NaN
    or inf), and with ``epsilon = 0`` an exact tie is 0 / 0."""
    G = counts.shape[0]
    with reraise_as(fn):
        A = group_advantages(scores, group_ids=ids, scale="group" if norm else "none", eps=epsilon)
    single = counts[ids] == 1
    total = _group_sum(scores, ids, G)[ids]                     # non-finite exactly where verl's mean is
    spread = ~torch.isfinite(total) & ~single
    A = torch.where(single, (scores / (1 + epsilon) if norm else scores).float(), A)
    A = torch.where(spread, math.nan if norm else (scores - total).float(), A)
    if norm and epsilon == 0:
        deviation = group_advantages(scores, group_ids=ids, scale="none")
        tied = ~single & ~spread & (_group_sum(deviation.abs(), ids, G)[ids] == 0)
        A = torch.where(tied, math.nan, A)                       # verl: 0 / (0 + 0)
    return A


def _centered(fn, scores, ids, counts) -> torch.Tensor:
    """verl's ``r - mean_g`` (a group of one: ``r``), [B] float32."""
    return _grpo(fn, scores, ids, counts, 0.0, norm=False)


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: torch.Tensor,
    lam: torch.Tensor,
):
    """verl's GAE: torchforge's :func:`~torchforge.returns.gae`, carried and whitened as verl does.

    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}`` over the
    counted tokens (masked ones skipped), ``returns = A + values``, then
    ``advantages = (A - mean) / sqrt(var + 1e-8)`` (verl's ``masked_whiten``).

    Args:
        token_level_rewards: [B, T] float token rewards.
        values: [B, T] float critic values.
        response_mask: [B, T] 0/1 (any dtype).
        gamma: discount in [0, 1] (a number or a 0-dim tensor).
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``: [B, T] float32 each, as verl's, at every position.

    Example:
        >>> import torch
        >>> r = torch.tensor([[0., 1.], [0., 0.]]); v = torch.zeros(2, 2); m = torch.ones(2, 2)
        >>> adv, ret = compute_gae_advantage_return(r, v, m, gamma=1.0, lam=1.0)
        >>> ret     # the undiscounted returns: V = 0
        tensor([[1., 1.],
                [0., 0.]])

    Note:
        verl's masked loop leaves at a masked position the advantage of the next counted
        token (0 after the last) and its returns are that plus ``values`` there; its
        whitened advantages are not multiplied by the mask. Native ``gae`` writes 0 at
        every masked position and does not whiten. A non-finite reward or value makes its
        position and every earlier one of its row NaN (verl's ``NaN * 0`` in the carry),
        and through the whitening every position of the batch if one of them is counted.
        Fewer than two counted tokens raise (verl's ``masked_var`` does).

    References:
        GAE, https://arxiv.org/abs/1506.02438
    """
    fn = _PREFIX + "compute_gae_advantage_return"
    r = _rewards(fn, token_level_rewards)
    check_same_shape(fn, "values", values, "token_level_rewards", r)
    mask = _mask(fn, response_mask, r)
    v = values.detach()
    with reraise_as(fn):
        advantages, _ = gae(_finite(r), _finite(v), mask, gamma=float(gamma), lam=float(lam))
    advantages = torch.where(_poisoned(r, v), math.nan, _carry_left(advantages, mask))
    returns = advantages + v.float()
    return _whiten(fn, advantages, mask), returns


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO (outcome reward): each row's summed reward, normalized in its group.

    ``r = token_level_rewards.sum(-1)``; ``A = (r - mean_g) / (std_g + epsilon)`` (without
    ``norm_adv_by_std_in_grpo``: ``r - mean_g``, Dr. GRPO), unbiased std, on every token:
    ``A * response_mask``.

    Args:
        token_level_rewards: [B, T] float (the sum over T is the sequence reward).
        response_mask: [B, T] 0/1 (any dtype).
        index: [B] group id of each row (verl's ``uid``; any hashable values).
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the std (GRPO) or not (Dr. GRPO).
        config: verl's ``AlgoConfig`` (unused, as in verl).

    Returns:
        ``(advantages, returns)``: the same [B, T] float32 tensor twice.

    Example:
        >>> import numpy as np, torch
        >>> r = torch.tensor([[1.], [0.], [5.]]); m = torch.ones(3, 1)
        >>> adv, _ = compute_grpo_outcome_advantage(r, m, np.array(["a", "a", "b"]), epsilon=0.0)
        >>> adv.T   # (1 - 0.5) / std([1, 0]); a group of one: 5 / (1 + 0)
        tensor([[ 0.7071, -0.7071,  5.0000]])

    Note:
        The native :func:`~torchforge.advantages.group_advantages` gives 0 to a group of
        one (no baseline), leaves a NaN reward out of its group (advantage 0) and gives an
        all-equal group exactly 0; verl gives ``r / (1 + epsilon)``, NaN to the whole
        group (every token: ``NaN * 0``) and its rounding residue over ``epsilon``. The
        first two are reproduced; a tie gives 0 (verl's value in exact arithmetic: a
        residue of ~1e-11 in float64), or NaN with ``epsilon=0`` (verl's 0 / 0).

    References:
        GRPO (DeepSeekMath), https://arxiv.org/abs/2402.03300; Dr. GRPO,
        https://arxiv.org/abs/2503.20783
    """
    fn = _PREFIX + "compute_grpo_outcome_advantage"
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    scores = r.sum(-1)
    ids, counts = _group_ids(fn, index, scores.shape[0], scores.device)
    advantages = _times_mask(_grpo(fn, scores, ids, counts, epsilon, norm_adv_by_std_in_grpo).unsqueeze(-1), mask)
    return advantages, advantages


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorized GRPO: the same advantages as :func:`compute_grpo_outcome_advantage`.

    Args and Returns: as :func:`compute_grpo_outcome_advantage`.

    Example:
        >>> import numpy as np, torch
        >>> adv, _ = compute_grpo_vectorized_outcome_advantage(torch.tensor([[1.], [0.]]), torch.ones(2, 1),
        ...                                                    np.array([7, 7]), epsilon=0.0)
        >>> adv.T
        tensor([[ 0.7071, -0.7071]])

    Note:
        verl's vectorized version computes its group statistics in float32
        (``group_mean_std``), so at reward offsets of 1e4 it loses about 1e-3 against its
        own loop version; this twin forms the deviations in the input's precision, as the
        loop's twin does (the two verl functions agree with it at ordinary magnitudes).
        verl's ``as_torch_index`` also merges ids that are numeric strings or near-integer
        floats of one value (``"1"`` and ``1``); here, as in verl's loop, ids group by
        equality.
    """
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon,
                                          norm_adv_by_std_in_grpo, config)


def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
    non_tensor_batch: dict | None = None,
    batch: dict | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GDPO: each reward normalized in its group (GRPO), a weighted sum, then whitened.

    ``A_k = grpo(r_k)`` per reward key k, ``s = sum_k w_k A_k * response_mask``,
    ``A = (s - mean) / sqrt(var + 1e-8) * response_mask`` over the counted tokens.

    Args:
        token_level_rewards: [B, T] float; the one reward when the keys are not given.
        response_mask: [B, T] 0/1.
        index: [B] group ids.
        epsilon, norm_adv_by_std_in_grpo: as GRPO.
        config: verl's ``AlgoConfig``: ``gdpo_reward_keys`` (needed with
            ``non_tensor_batch`` and ``batch``), ``gdpo_reward_weights`` (default all 1).
        non_tensor_batch: ``{key: [B] scores}`` of each reward key.
        batch: verl's batch; needed (with ``config`` and ``non_tensor_batch``) to read the
            keys, as in verl, which places each score on the last response token (the sum
            over T is then the score itself, which is what is used here).

    Returns:
        ``(advantages, returns)``: the same [B, T] float32 tensor twice.

    Example:
        >>> import numpy as np, torch
        >>> adv, _ = compute_gdpo_outcome_advantage(torch.tensor([[1.], [0.]]), torch.ones(2, 1), np.array([0, 0]))
        >>> adv.T   # grpo gives +-0.7071, whitened over the two tokens: +-0.7071
        tensor([[ 0.7071, -0.7071]])

    Note:
        Native GDPO (``group_advantages`` with [B, K] rewards and ``reward_weights``)
        divides the weighted sum by its batch std over the sequences; verl whitens over
        the tokens (a long response weighs more) with ``1e-8`` inside the square root.

    References:
        GDPO, https://arxiv.org/abs/2601.05242
    """
    fn = _PREFIX + "compute_gdpo_outcome_advantage"
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    scores, weights = [r.sum(-1)], None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = _get(config, "gdpo_reward_keys")
        if not keys:
            raise InvalidArgumentError(
                f"{fn}: GDPO needs config.gdpo_reward_keys, the reward keys of non_tensor_batch "
                "(e.g. ['format_reward', 'accuracy_reward']); set it"
            )
        missing = [key for key in keys if key not in non_tensor_batch]
        if missing:
            raise InvalidArgumentError(
                f"{fn}: reward keys {missing} are not in non_tensor_batch (it has {list(non_tensor_batch)}); "
                "return them from compute_score"
            )
        scores = [torch.tensor(np.asarray(non_tensor_batch[key], dtype=np.float32), device=r.device) for key in keys]
        if _get(config, "gdpo_reward_weights") is not None:
            weights = [float(w) for w in _get(config, "gdpo_reward_weights")]
    weights = weights or [1.0] * len(scores)
    if len(weights) != len(scores):
        raise ShapeError(f"{fn}: {len(weights)} gdpo_reward_weights for {len(scores)} reward keys; expected one each")
    ids, counts = _group_ids(fn, index, r.shape[0], r.device)
    s = sum(w * _grpo(fn, x, ids, counts, epsilon, norm_adv_by_std_in_grpo) for w, x in zip(weights, scores))
    advantages = _times_mask(_whiten(fn, _times_mask(s.unsqueeze(-1), mask), mask), mask)
    return advantages, advantages


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's pass@k advantage: only each group's best sample, ``(r_max - r_second) / (std_g + epsilon)``.

    On :func:`~torchforge.advantages.best_minus_second_advantages` (``scale="group"``, or
    ``"none"``): every other sample gets 0, and so does a group whose maximum is shared.

    Args:
        token_level_rewards: [B, T] float (summed over T).
        response_mask: [B, T] 0/1.
        index: [B] group ids; every group needs at least 2 samples.
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: unused, as in verl: ``config`` decides.
        config: verl's ``AlgoConfig``, needed: its ``norm_adv_by_std_in_grpo`` (default True).

    Returns:
        ``(advantages, returns)``: the same [B, T] float32 tensor twice.

    Example:
        >>> import numpy as np, torch
        >>> r = torch.tensor([[1.], [0.5], [0.]]); cfg = {"norm_adv_by_std_in_grpo": False}
        >>> compute_grpo_passk_outcome_advantage(r, torch.ones(3, 1), np.zeros(3), config=cfg)[0].T
        tensor([[0.5000, 0.0000, 0.0000]])

    Note:
        verl reads ``norm_adv_by_std_in_grpo`` from ``config`` only (the argument of that
        name is ignored), and so does this twin. A group with a NaN (or infinite) reward:
        the native primitive leaves it out; verl's ``torch.topk`` ranks NaN first, so the
        first NaN row gets NaN (std NaN; without the std, NaN or inf from
        ``r_max - r_second``) and the others 0, as here. A group of one raises, as in verl.

    References:
        Y. Tang et al., "Optimizing Language Models for Inference Time Objectives using
        Reinforcement Learning", https://arxiv.org/abs/2503.19595
    """
    fn = _PREFIX + "compute_grpo_passk_outcome_advantage"
    if config is None:
        raise InvalidArgumentError(f"{fn}: config is needed (verl reads norm_adv_by_std_in_grpo from it); pass "
                                   "the algorithm config")
    norm = bool(_get(config, "norm_adv_by_std_in_grpo", True))
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    scores = r.sum(-1)
    ids, counts = _group_ids(fn, index, scores.shape[0], scores.device)
    if bool((counts < 2).any()):
        raise InvalidArgumentError(f"{fn}: pass@k needs at least 2 samples per group, got a group of "
                                   f"{int(counts.min())}; check index")
    with reraise_as(fn):
        A = best_minus_second_advantages(scores, group_ids=ids, scale="group" if norm else "none", eps=epsilon)
    bad = ~torch.isfinite(_group_sum(scores, ids, counts.shape[0]))
    for g in bad.nonzero().flatten().tolist():  # degenerate groups: verl's top-2 with NaN ranked first
        rows = (ids == g).nonzero().flatten()
        group = scores[rows]
        top, where = torch.topk(group, 2)
        A[rows] = 0.0
        A[rows[where[0]]] = math.nan if norm else float(top[0] - top[1])
    advantages = _times_mask(A.unsqueeze(-1), mask)
    return advantages, advantages


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's REINFORCE++-baseline: the group-centred reward on every token, whitened over the batch.

    ``x = (r - mean_g) * response_mask``, ``A = (x - mean) / sqrt(var + 1e-8) * response_mask``.

    Args:
        token_level_rewards: [B, T] float (summed over T).
        response_mask: [B, T] 0/1.
        index: [B] group ids.
        epsilon: unused (verl's signature).
        config: unused.

    Returns:
        ``(advantages, returns)``: the same [B, T] float32 tensor twice.

    Example:
        >>> import numpy as np, torch
        >>> adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(
        ...     torch.tensor([[1., 0.], [0., 0.]]), torch.ones(2, 2), np.array([0, 0]))
        >>> adv   # centred: +-0.5 on each token, whitened over the 4 tokens
        tensor([[ 0.8660,  0.8660],
                [-0.8660, -0.8660]])

    Note:
        As :func:`~torchforge.returns.reinforce_pp_advantages` with groups, except that a
        group of one keeps its reward (verl's mean 0) and a NaN reward spreads (here as in
        verl: the whole batch when it is counted), and verl's whitening raises for fewer
        than two counted tokens.

    References:
        REINFORCE++, https://arxiv.org/abs/2501.03262
    """
    fn = _PREFIX + "compute_reinforce_plus_plus_baseline_outcome_advantage"
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    scores = r.sum(-1)
    ids, counts = _group_ids(fn, index, scores.shape[0], scores.device)
    x = _times_mask(_centered(fn, scores, ids, counts).unsqueeze(-1).expand(mask.shape), mask)
    advantages = _times_mask(_whiten(fn, x, mask), mask)
    return advantages, advantages


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's RLOO: each reward minus the mean of the rest of its group, ``n / (n - 1) (r - mean_g)``.

    Args:
        token_level_rewards: [B, T] float (summed over T).
        response_mask: [B, T] 0/1.
        index: [B] group ids.
        epsilon, config: unused (verl's signature).

    Returns:
        ``(advantages, returns)``: the same [B, T] float32 tensor twice.

    Example:
        >>> import numpy as np, torch
        >>> r = torch.tensor([[3.], [0.], [0.], [2.]])
        >>> compute_rloo_outcome_advantage(r, torch.ones(4, 1), np.array([0, 0, 0, 1]))[0].T
        tensor([[ 3.0000, -1.5000, -1.5000,  2.0000]])

    Note:
        On :func:`~torchforge.advantages.rloo_advantages`; verl keeps the reward of a
        group of one (no leave-one-out baseline: ``A = r``) where the primitive gives 0,
        and spreads a NaN reward over its group where the primitive leaves it out.

    References:
        RLOO, https://arxiv.org/abs/2402.14740
    """
    fn = _PREFIX + "compute_rloo_outcome_advantage"
    A, mask = _rloo(fn, token_level_rewards, response_mask, index, single_keeps_reward=True)
    advantages = _times_mask(A.unsqueeze(-1), mask)
    return advantages, advantages


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorized RLOO: as :func:`compute_rloo_outcome_advantage`, but a group of one gets 0.

    Args and Returns: as :func:`compute_rloo_outcome_advantage`.

    Example:
        >>> import numpy as np, torch
        >>> r = torch.tensor([[3.], [0.], [0.], [2.]])
        >>> compute_rloo_vectorized_outcome_advantage(r, torch.ones(4, 1), np.array([0, 0, 0, 1]))[0].T
        tensor([[ 3.0000, -1.5000, -1.5000,  0.0000]])

    Note:
        verl's two RLOO functions differ on a group of one (``r`` in the loop, 0 here, the
        native primitive's value), and a non-finite reward of a group of one is NaN here
        (``NaN * 0``). ``index`` must be sortable (verl's ``np.unique``); here any hashable
        ids group by equality.
    """
    fn = _PREFIX + "compute_rloo_vectorized_outcome_advantage"
    A, mask = _rloo(fn, token_level_rewards, response_mask, index, single_keeps_reward=False)
    advantages = _times_mask(A.unsqueeze(-1), mask)
    return advantages, advantages


def _rloo(fn, token_level_rewards, response_mask, index, single_keeps_reward):
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    scores = r.sum(-1)
    ids, counts = _group_ids(fn, index, scores.shape[0], scores.device)
    with reraise_as(fn):
        A = rloo_advantages(scores, group_ids=ids)
    n = counts[ids].to(scores.dtype)
    total = _group_sum(scores, ids, counts.shape[0])[ids]
    single = n == 1
    spread = ~torch.isfinite(total) & (~single | ~torch.as_tensor(single_keeps_reward))
    # verl's arithmetic where it spreads: (n r - sum_g r) / (n - 1), times 0 for a group of one
    A = torch.where(spread, ((n * scores - total) / (n - 1).clamp(min=1) * (~single)).float(), A)
    if single_keeps_reward:
        A = torch.where(single, scores.float(), A)
    return A, mask


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's OPO: each reward minus its group's length-weighted mean, ``b = sum l r / sum l``.

    Args:
        token_level_rewards: [B, T] float (summed over T).
        response_mask: [B, T] 0/1 (``l`` = its row sums).
        index: [B] group ids.
        epsilon, config: unused (verl's signature).

    Returns:
        ``(advantages, returns)``: the same [B, T] float32 tensor twice.

    Example:
        >>> import numpy as np, torch
        >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> r = torch.tensor([[0., 0., 1.], [0., 0., 0.]])
        >>> compute_opo_outcome_advantage(r, m, np.array([0, 0]))[0]  # b = (3*1 + 1*0) / 4
        tensor([[ 0.2500,  0.2500,  0.2500],
                [-0.7500, -0.0000, -0.0000]])

    Note:
        On :func:`~torchforge.advantages.opo_advantages`; verl gives a group of one the
        baseline 0 (``A = r``; natively 0), a group whose responses are all empty the
        baseline 0 / 0 (NaN), and spreads a NaN reward over its group: reproduced here.

    References:
        OPO, https://arxiv.org/abs/2505.23585
    """
    fn = _PREFIX + "compute_opo_outcome_advantage"
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    scores = r.sum(-1)
    ids, counts = _group_ids(fn, index, scores.shape[0], scores.device)
    with reraise_as(fn):
        A = opo_advantages(scores, mask, group_ids=ids)
    G = counts.shape[0]
    lengths = response_mask.detach().sum(-1).to(scores.dtype)
    weighted, total = _group_sum(lengths * scores, ids, G)[ids], _group_sum(lengths, ids, G)[ids]
    single = counts[ids] == 1
    spread = ~torch.isfinite(weighted) | (total == 0)            # verl's baseline is NaN or inf there
    A = torch.where(spread & ~single, (scores - weighted / total).float(), A)
    A = torch.where(single, scores.float(), A)
    advantages = _times_mask(A.unsqueeze(-1), mask)
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config=None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's REINFORCE++: discounted returns over the counted tokens, whitened over the batch.

    ``returns_t = r_t + gamma returns_{t+1}`` over the counted tokens (0 where masked),
    ``A = (returns - mean) / sqrt(var + 1e-8) * response_mask``.

    Args:
        token_level_rewards: [B, T] float token rewards.
        response_mask: [B, T] 0/1.
        config: verl's ``AlgoConfig``, needed: its ``gamma``.

    Returns:
        ``(advantages, returns)``: [B, T] float32 each.

    Example:
        >>> import torch
        >>> adv, ret = compute_reinforce_plus_plus_outcome_advantage(
        ...     torch.tensor([[0., 1.], [0., 0.]]), torch.ones(2, 2), config={"gamma": 0.5})
        >>> ret
        tensor([[0.5000, 1.0000],
                [0.0000, 0.0000]])

    Note:
        On :func:`~torchforge.returns.discounted_returns` (masked tokens skipped, as
        verl's carry does); :func:`~torchforge.returns.reinforce_pp_advantages` is the
        same without verl's raise for fewer than two counted tokens. A non-finite reward
        makes every earlier position of its row NaN (verl's ``NaN * 0`` in the carry).

    References:
        REINFORCE++, https://arxiv.org/abs/2501.03262
    """
    fn = _PREFIX + "compute_reinforce_plus_plus_outcome_advantage"
    if config is None:
        raise InvalidArgumentError(f"{fn}: config is needed (verl reads gamma from it); pass the algorithm config")
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    with reraise_as(fn):
        returns = discounted_returns(_finite(r), mask, gamma=float(_get(config, "gamma")))
    returns = torch.where(_poisoned(r), math.nan, returns)
    advantages = _times_mask(_whiten(fn, returns, mask), mask)
    return advantages, returns


def _reward_to_go(fn: str, r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``(r * mask).flip(-1).cumsum(-1).flip(-1)``: the undiscounted returns of the counted
    tokens at every position (a masked one holds the next counted token's), NaN spread left."""
    with reraise_as(fn):
        returns = discounted_returns(_finite(r), mask, gamma=1.0)
    return torch.where(_poisoned(r), math.nan, _carry_left(returns, mask))


def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config=None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ReMax: the reward-to-go minus the greedy completion's reward, ``A = returns - b * mask``.

    Args:
        token_level_rewards: [B, T] float token rewards.
        reward_baselines: [B] float reward of each prompt's greedy completion.
        response_mask: [B, T] 0/1.
        config: unused (verl's signature).

    Returns:
        ``(advantages, returns)``: [B, T] float32 each.

    Example:
        >>> import torch
        >>> adv, ret = compute_remax_outcome_advantage(torch.tensor([[0., 1.]]), torch.tensor([0.25]),
        ...                                            torch.tensor([[1, 1]]))
        >>> adv
        tensor([[0.7500, 0.7500]])

    Note:
        As :func:`~torchforge.returns.remax_advantages` at counted tokens; verl's returns
        at a masked position are those of the next counted token (its reverse cumsum runs
        over every position), and a NaN reward or baseline spreads (the primitive gives
        that row 0).

    References:
        ReMax, https://arxiv.org/abs/2310.10505
    """
    fn = _PREFIX + "compute_remax_outcome_advantage"
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    check_tensor(fn, "reward_baselines", reward_baselines, ndim=1)
    if reward_baselines.shape[0] != r.shape[0]:
        raise ShapeError(f"{fn}: reward_baselines has shape {shape_str(reward_baselines)} but token_level_rewards "
                         f"has shape {shape_str(r)}; expected ({r.shape[0]},)")
    returns = _reward_to_go(fn, r, mask)
    advantages = returns - _times_mask(reward_baselines.detach().float().unsqueeze(-1), mask)
    return advantages, returns


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config=None,
    **kwargs,
):
    """verl's GPG: ``A = alpha (r - mean_g) / f_norm`` with ``alpha = B / #(r != 0)``.

    Args:
        token_level_rewards: [B, T] float (summed over T).
        response_mask: [B, T] 0/1.
        index: [B] group ids.
        epsilon: unused (verl's signature).
        f_norm: divides the advantages.
        alpha: unused: verl overwrites it with ``B / max(#nonzero rewards, 1)``.
        config: unused.

    Returns:
        ``(advantages, returns)``: the same [B, T] float32 tensor twice.

    Example:
        >>> import numpy as np, torch
        >>> r = torch.tensor([[1.], [0.], [0.], [0.]])   # alpha = 4 / 1
        >>> compute_gpg_outcome_advantage(r, torch.ones(4, 1), np.array([0, 0, 1, 1]))[0].T
        tensor([[ 2., -2.,  0.,  0.]])

    Note:
        On ``group_advantages(scale="none")``; a group of one keeps its reward (verl's
        mean 0) and a NaN reward spreads over its group (and counts as non-zero).

    References:
        GPG, https://arxiv.org/abs/2504.02546
    """
    fn = _PREFIX + "compute_gpg_outcome_advantage"
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    scores = r.sum(-1)
    B = scores.shape[0]
    ids, counts = _group_ids(fn, index, B, scores.device)
    alpha = B / torch.count_nonzero(scores).clamp(min=1)
    A = alpha * _centered(fn, scores, ids, counts) / f_norm
    advantages = _times_mask(A.float().unsqueeze(-1), mask)
    return advantages, advantages


# --- optimal token baseline ----------------------------------------------------------------------

def _path_variance(fn, old_log_probs, sum_pi_squared, rollout_is_weights, mask):
    """OTB's ``W_t = sum_{j <= t} (1 - 2 pi_j + sum pi^2) rho_j^2 m_j`` (verl's arithmetic, so
    its NaN spread forward too)."""
    check_same_shape(fn, "old_log_probs", old_log_probs, "response_mask", mask)
    check_same_shape(fn, "sum_pi_squared", sum_pi_squared, "response_mask", mask)
    w = 1 - 2 * torch.exp(old_log_probs.detach().float()) + sum_pi_squared.detach().float()
    if rollout_is_weights is not None:
        check_same_shape(fn, "rollout_is_weights", rollout_is_weights, "response_mask", mask)
        w = w * rollout_is_weights.detach().float() ** 2
    return _times_mask(w, mask).cumsum(-1)


def _zero_tail(lengths: torch.Tensor, ids: torch.Tensor, G: int, member: torch.Tensor):
    """Per row: ``(longest, cut)``: True for the unique longest row of its group when it is
    strictly longer than the runner-up (among ``member`` rows), and the runner-up's length."""
    L = torch.where(member, lengths, -1)
    longest = L.new_full((G,), -1).scatter_reduce_(0, ids, L, "amax")
    is_max = member & (L == longest[ids])
    n_max = torch.zeros(G, dtype=torch.long, device=L.device).index_add_(0, ids, is_max.long())
    second = L.new_full((G,), -1).scatter_reduce_(0, ids, torch.where(is_max, -1, L), "amax")
    return is_max & (n_max[ids] == 1) & (second[ids] >= 0), second[ids].clamp(min=0)


def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's optimal token baseline (OTB): a per-position baseline weighted by path variance.

    With ``G_t`` the undiscounted reward-to-go and ``W_t = sum_{j <= t} (1 - 2 pi_j +
    sum pi^2) rho_j^2`` over the counted tokens, for each group of N > 1 rows and position t:
    ``B_t = sum_i G_t W_t m_t / (sum_i W_t m_t + epsilon)``; ``A = (G - B) * response_mask``.
    With ``handle_zero_tail``, a group's unique longest row gets ``B = 0`` from the
    runner-up's length on.

    Args:
        token_level_rewards: [B, T] float token rewards.
        response_mask: [B, T] 0/1.
        index: [B] group ids.
        old_log_probs: [B, T] float log-probs of the sampled tokens (``pi = exp``).
        sum_pi_squared: [B, T] float ``sum_v pi(v)^2`` per position.
        rollout_is_weights: [B, T] float IS weights ``rho`` or None.
        handle_zero_tail: zero the baseline of the longest row's unique tail.
        epsilon: added to the denominator.

    Returns:
        ``(advantages, returns)``: [B, T] float32 each.

    Example:
        >>> import numpy as np, torch
        >>> r = torch.tensor([[1.], [0.]]); m = torch.ones(2, 1)
        >>> adv, _ = compute_optimal_token_baseline_advantage(r, m, np.zeros(2), torch.zeros(2, 1) - 9,
        ...                                                   torch.zeros(2, 1), epsilon=0.0)
        >>> adv.T   # equal weights W: the baseline is the mean reward 0.5
        tensor([[ 0.5000, -0.5000]])

    Note:
        torchforge has no OTB primitive: the returns are
        :func:`~torchforge.returns.discounted_returns` (``gamma=1``, carried over masked
        positions as verl's reverse cumsum does), the baseline verl's equation over
        group sums. A group of one has baseline 0 (``A = G``).

    References:
        verl's optimal token baseline (``core_algos``, 0.7+); the variance-optimal
        baseline, e.g. Greensmith et al., JMLR 5 (2004)
    """
    fn = _PREFIX + "compute_optimal_token_baseline_advantage"
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    returns = _reward_to_go(fn, r, mask)
    W = _path_variance(fn, old_log_probs, sum_pi_squared, rollout_is_weights, mask)
    ids, counts = _group_ids(fn, index, r.shape[0], r.device)
    G, m = counts.shape[0], mask.float()
    numerator = _group_sum(returns * W * m, ids, G)
    denominator = _group_sum(W * m, ids, G) + epsilon
    baselines = torch.where((counts[ids] > 1).unsqueeze(-1), (numerator / denominator)[ids], 0.0)
    if handle_zero_tail:
        longest, cut = _zero_tail(torch.count_nonzero(mask, -1), ids, G, counts[ids] > 1)
        tail = longest.unsqueeze(-1) & (torch.arange(mask.shape[-1], device=mask.device) >= cut.unsqueeze(-1))
        baselines = baselines.masked_fill(tail, 0.0)
    advantages = _times_mask(returns - baselines, mask)
    return advantages, returns


def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's multi-turn OTB: :func:`compute_optimal_token_baseline_advantage` over the counted tokens.

    Each row's counted tokens are moved to the left (tool / observation tokens cut out),
    so the baseline at the k-th counted token averages the rows' k-th counted tokens:
    ``B_k = sum_i G_k W_k / (sum_i W_k + epsilon)`` over the group's non-empty rows.

    Args and Returns: as :func:`compute_optimal_token_baseline_advantage`.

    Example:
        >>> import numpy as np, torch
        >>> r = torch.tensor([[0., 1.], [0., 0.]]); m = torch.tensor([[0, 1], [1, 0]])
        >>> adv, _ = compute_multi_turn_optimal_token_baseline_advantage(
        ...     r, m, np.zeros(2), torch.zeros(2, 2) - 9, torch.zeros(2, 2), epsilon=0.0)
        >>> adv   # the first counted tokens of the two rows share the baseline 0.5
        tensor([[ 0.0000,  0.5000],
                [-0.5000,  0.0000]])

    Note:
        The compaction is :mod:`torchforge.returns`' (the one GAE and the returns use).
        Rows with no counted token are in no group (verl's), so they do not count
        towards N.
    """
    fn = _PREFIX + "compute_multi_turn_optimal_token_baseline_advantage"
    r = _rewards(fn, token_level_rewards)
    mask = _mask(fn, response_mask, r)
    returns = _reward_to_go(fn, r, mask)
    W = _path_variance(fn, old_log_probs, sum_pi_squared, rollout_is_weights, mask)
    ids, _ = _group_ids(fn, index, r.shape[0], r.device)
    dest, width, _ = _compaction(mask)
    # compact, masked positions to the discarded column: verl's all_returns / all_w_values
    R_c = _compact(returns, dest, width, mask)[:, :width]
    W_c = _compact(W, dest, width, mask)[:, :width]
    lengths = torch.count_nonzero(mask, -1)
    member = lengths > 0
    G = int(ids.max()) + 1 if ids.numel() else 0
    n = torch.zeros(G, device=r.device).index_add_(0, ids, member.float())
    keep = member.float().unsqueeze(-1)
    b = _group_sum(R_c * W_c * keep, ids, G) / (_group_sum(W_c * keep, ids, G) + epsilon)
    baselines = torch.where((member & (n[ids] > 1)).unsqueeze(-1), b[ids], 0.0)
    if handle_zero_tail:
        longest, cut = _zero_tail(lengths, ids, G, member & (n[ids] > 1))
        tail = longest.unsqueeze(-1) & (torch.arange(width, device=r.device) >= cut.unsqueeze(-1))
        baselines = baselines.masked_fill(tail, 0.0)
    advantages = _expand(R_c - baselines, dest, mask)
    return _times_mask(advantages, mask), returns


# --- the KL in the reward ---------------------------------------------------------------------------

def compute_rewards(token_level_scores, old_log_prob, ref_log_prob, kl_ratio):
    """verl's token rewards with the KL penalty: ``token_level_scores - kl_ratio * (old - ref)``.

    Args:
        token_level_scores: [B, T] float scores.
        old_log_prob: [B, T] float log-probs of the sampled tokens.
        ref_log_prob: [B, T] float reference log-probs.
        kl_ratio: the KL coefficient.

    Returns:
        [B, T] float32, with the gradient of every input (as verl's).

    Example:
        >>> import torch
        >>> compute_rewards(torch.tensor([[1.0]]), torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), 0.1)
        tensor([[0.9500]])

    Note:
        The native :func:`~torchforge.returns.kl_penalized_rewards` places a sequence
        reward on the last counted token, masks, and detaches (a reward carries no
        gradient); verl's is this plain expression (k1), with its gradient, unmasked.
    """
    fn = _PREFIX + "compute_rewards"
    check_tensor(fn, "token_level_scores", token_level_scores)
    with reraise_as(fn):
        kl = approx_kl(old_log_prob, ref_log_prob, estimator="k1")
    return token_level_scores.float() - kl * kl_ratio


def kl_penalty_forward(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """verl's KL estimate per token, by name: ``"kl"``/``"k1"``, ``"abs"``, ``"mse"``/``"k2"``, ``"low_var_kl"``/``"k3"``.

    ``k1 = logprob - ref``, ``abs = |k1|``, ``k2 = k1^2 / 2``, and verl's k3:
    ``k3 = clamp(exp(l) - l - 1, -10, 10)`` with ``l = clamp(ref - logprob, -20, 20)``.

    Args:
        logprob: [B, T] float log-probs (with grad).
        ref_logprob: [B, T] float reference log-probs.
        kl_penalty: the estimator's name.

    Returns:
        [B, T] float32 estimates, differentiable.

    Example:
        >>> import torch
        >>> kl_penalty_forward(torch.tensor([-30.0, 0.0]), torch.tensor([0.0, 0.0]), "low_var_kl")
        tensor([10.,  0.])

    Note:
        Native :func:`~torchforge.kl.approx_kl` k3 continues along its tangent beyond
        ``ref / pi = max_ratio`` (bounded gradient, never zero); verl's clamps leave a
        token about 2.5 nats below the reference with no gradient. This twin is
        ``approx_kl(max_ratio=inf)`` with verl's clamps. ``"full"`` (the vocabulary KL) is
        :func:`torchforge.kl.exact_kl` on logits; verl raises for it, and so does this.
    """
    fn = _PREFIX + "kl_penalty_forward"
    if kl_penalty not in KL_PENALTIES:
        hint = "; for the full-vocabulary KL use torchforge.exact_kl on logits" if kl_penalty == "full" else ""
        raise InvalidArgumentError(f"{fn}: kl_penalty={kl_penalty!r} is not one of {KL_PENALTIES}{hint}")
    with reraise_as(fn):
        if kl_penalty in ("kl", "k1"):
            return approx_kl(logprob, ref_logprob, estimator="k1")
        if kl_penalty == "abs":
            return approx_kl(logprob, ref_logprob, estimator="abs")
        if kl_penalty in ("mse", "k2"):
            return approx_kl(logprob, ref_logprob, estimator="k2")
        for name, x in (("logprob", logprob), ("ref_logprob", ref_logprob)):
            check_tensor(fn, name, x)
            check_float(fn, name, x)
        check_same_shape(fn, "ref_logprob", ref_logprob, "logprob", logprob)
        # verl's clamps, as hardtanh (one backward kernel where torch.clamp's takes several)
        log_r = clamp_log_ratio(ref_logprob.float() - logprob.float(), max_log_ratio=20.0)
        # approx_kl's k3 (max_ratio=inf) of the clamped log r, with no second pass to form log r
        return F.hardtanh(_k3(log_r, math.inf), -10.0, 10.0)


def kl_penalty(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty) -> torch.FloatTensor:
    """verl's KL penalty: :func:`kl_penalty_forward`, or with a ``"+"`` suffix its value with k2's gradient.

    ``"k3+"`` (any estimator with ``+``): value ``kl_penalty_forward(..., "k3")``,
    gradient that of ``k2 = (logprob - ref)^2 / 2``, unbiased for ``grad KL(pi || ref)``.

    Args:
        logprob: [B, T] float log-probs (with grad).
        ref_logprob: [B, T] float reference log-probs.
        kl_penalty: the estimator's name, optionally ending in ``"+"``.

    Returns:
        [B, T] float32 estimates, differentiable.

    Example:
        >>> import torch
        >>> lp = torch.tensor([-1.0], requires_grad=True)
        >>> kl = kl_penalty(lp, torch.tensor([0.0]), "k3+"); kl.backward()
        >>> round(kl.item(), 4), lp.grad   # k3 at l = 1: e - 2; the gradient of k2: lp - ref
        (0.7183, tensor([-1.]))

    References:
        J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html;
        Y. Tang and R. Munos, https://arxiv.org/abs/2506.09477
    """
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward = kl_penalty_forward(logprob, ref_logprob, base)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward
    with reraise_as(_PREFIX + "kl_penalty"):
        backward = approx_kl(logprob, ref_logprob, estimator="k2")   # the straight-through gradient
    return backward - backward.detach() + forward.detach()


class AdaptiveKLController:
    """verl's adaptive KL controller (Ziegler et al.): ``value`` moves towards ``target``.

    ``update`` applies :func:`torchforge.kl.adaptive_kl_coef`:
    ``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``.

    Example:
        >>> c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10_000)
        >>> c.update(0.2, n_steps=1000); round(c.value, 6)
        0.102

    Note:
        ``adaptive_kl_coef`` raises for ``n_steps > 5 * horizon`` (the coefficient
        could turn negative), where verl goes on.

    References:
        https://arxiv.org/abs/1909.08593
    """

    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl, n_steps):
        self.value = adaptive_kl_coef(self.value, current_kl, target=self.target, horizon=self.horizon,
                                      num_steps=int(n_steps))


class FixedKLController:
    """verl's fixed KL controller: ``value`` stays ``kl_coef``; ``update`` does nothing."""

    def __init__(self, kl_coef):
        self.value = kl_coef

    def update(self, current_kl, n_steps):
        pass


def get_kl_controller(kl_ctrl):
    """verl's controller from its ``kl_ctrl`` config: ``type`` ``"fixed"`` or ``"adaptive"``
    (``kl_coef``, ``target_kl``, ``horizon``), read by key or attribute.

    Example:
        >>> get_kl_controller({"type": "fixed", "kl_coef": 0.001}).value
        0.001
    """
    fn = _PREFIX + "get_kl_controller"
    kind = _get(kl_ctrl, "type")
    if kind == "fixed":
        return FixedKLController(kl_coef=_get(kl_ctrl, "kl_coef"))
    if kind == "adaptive":
        horizon = _get(kl_ctrl, "horizon")
        if not horizon > 0:
            raise InvalidArgumentError(f"{fn}: kl_ctrl.horizon must be > 0, got {horizon}")
        return AdaptiveKLController(init_kl_coef=_get(kl_ctrl, "kl_coef"), target_kl=_get(kl_ctrl, "target_kl"),
                                    horizon=horizon)
    raise InvalidArgumentError(f"{fn}: kl_ctrl.type must be 'fixed' or 'adaptive', got {kind!r}")


# --- PF-PPO ---------------------------------------------------------------------------------------

def compute_pf_ppo_reweight_data(data, reweight_method: str = "pow", weight_pow: float = 2.0):
    """verl's PF-PPO resampling: draw B rows with replacement, weighted by their scores.

    ``s = token_level_scores.sum(-1)``; weights ``|s|^weight_pow`` (``"pow"``), 1 at the
    batch's max and min score else 0 (``"max_min"``), 0.4 at the max else 0.1
    (``"max_random"``), plus 1e-8; ``torch.multinomial`` draws the rows (the global RNG,
    as verl: the same seed draws the same rows), and every field of ``data`` is indexed
    by them.

    Args:
        data: verl's ``DataProto`` (any object with ``batch`` holding
            ``"token_level_scores"``, ``non_tensor_batch`` and ``meta_info``).
        reweight_method: ``"pow"``, ``"max_min"`` or ``"max_random"``.
        weight_pow: the power of ``"pow"``.

    Returns:
        A deep copy of ``data`` with the resampled rows (meta-info lists of length B too).

    Note:
        A data filter, not a computation on torchforge's primitives (torchforge has no
        resampling step).

    References:
        PF-PPO, https://arxiv.org/abs/2409.06957
    """
    fn = _PREFIX + "compute_pf_ppo_reweight_data"
    scores = data.batch["token_level_scores"].sum(dim=-1)
    with torch.no_grad():
        if reweight_method == "pow":
            weights = torch.pow(torch.abs(scores), weight_pow)
        elif reweight_method == "max_min":
            weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
        elif reweight_method == "max_random":
            weights = torch.where(scores == scores.max(), 0.4, 0.1)
        else:
            raise InvalidArgumentError(f"{fn}: reweight_method={reweight_method!r} is not one of "
                                       "('pow', 'max_min', 'max_random')")
        weights = torch.clamp(weights + 1e-8, min=1e-8)
    B = scores.shape[0]
    rows = torch.multinomial(weights, B, replacement=True)
    rows_np = rows.numpy()
    out = copy.deepcopy(data)
    out.batch = type(data.batch)({key: tensor[rows] for key, tensor in data.batch.items()})
    out.batch.batch_size = data.batch.batch_size
    out.non_tensor_batch = {key: value[rows_np] if isinstance(value, np.ndarray) else [value[i] for i in rows_np]
                            for key, value in data.non_tensor_batch.items()}
    out.meta_info = {key: [value[i] for i in rows_np] if isinstance(value, list) and len(value) == B else value
                     for key, value in data.meta_info.items()}
    return out


# --- the registry ----------------------------------------------------------------------------------

class AdvantageEstimator(str, Enum):
    """verl's estimator names (its ``AdvantageEstimator`` values), for :func:`get_adv_estimator_fn`."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


ADV_ESTIMATOR_REGISTRY = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
    "grpo_vectorized": compute_grpo_vectorized_outcome_advantage,
    "optimal_token_baseline": compute_optimal_token_baseline_advantage,
    "tir_optimal_token_baseline": compute_multi_turn_optimal_token_baseline_advantage,
    "gdpo": compute_gdpo_outcome_advantage,
}


def register_adv_est(name_or_enum):
    """verl's decorator: register ``fn`` under a name (or an :class:`AdvantageEstimator`)."""
    def decorator(fn):
        name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
        if ADV_ESTIMATOR_REGISTRY.get(name, fn) is not fn:
            raise InvalidArgumentError(f"{_PREFIX}register_adv_est: {name!r} is already registered "
                                       f"({ADV_ESTIMATOR_REGISTRY[name].__name__}); pick another name")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn
    return decorator


def get_adv_estimator_fn(name_or_enum):
    """The twin registered under verl's estimator name (a string or an ``AdvantageEstimator``,
    torchforge's or verl's own).

    Example:
        >>> get_adv_estimator_fn("grpo").__name__
        'compute_grpo_outcome_advantage'
    """
    name = name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise InvalidArgumentError(f"{_PREFIX}get_adv_estimator_fn: unknown advantage estimator {name!r}; "
                                   f"expected one of {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]
