"""verl 0.9.1's policy losses (``compute_policy_loss_*``), value and entropy losses and
``agg_loss``, on torchforge's primitives.

Each function has verl's name, verl's parameters in verl's order with verl's defaults, and
returns what verl returns: ``(pg_loss, pg_metrics)`` with verl's metric names and Python
floats (``compute_policy_loss`` its 4-tuple of tensors, ``compute_value_loss``
``(vf_loss, vf_clipfrac)``). ``config`` is verl's ``ActorConfig``, an OmegaConf
``DictConfig``, a plain ``dict`` or any object with those field names, read by key or
attribute (verl is never imported); ``None`` or a missing field gives the value verl's code
falls back to, else ``ActorConfig``'s default. ``config.global_batch_info`` (``dp_size``,
``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``) is passed to
:func:`agg_loss` as verl passes it.

==================================  ==================================================================
verl ``core_algos``                 torchforge
==================================  ==================================================================
``agg_loss``                        :class:`~torchforge.reduce.Aggregation`: ``token-mean`` with
                                    ``num_tokens=batch_num_tokens``; ``seq-mean-*`` with
                                    ``num_sequences=global_batch_size``, ``norm_length=loss_scale_factor``;
                                    ``token-sum`` as ``token-mean`` with ``num_tokens=1``; ``dp_size``
``compute_policy_loss_vanilla``,    :func:`~torchforge.losses.ppo_surrogate` (``clip_low=clip_ratio_low``,
``compute_policy_loss``             ``clip_high=clip_ratio_high``, ``dual_clip=clip_ratio_c``)
``compute_policy_loss_gspo``        :func:`~torchforge.ratios.sequence_log_ratio` (GSPO-token), then
                                    ``ppo_surrogate`` of that log-ratio (see the Note there)
``compute_policy_loss_sapo``        :func:`~torchforge.trust_region_losses.sapo_loss`
``compute_policy_loss_cispo``       :func:`~torchforge.trust_region_losses.cispo_loss`
``compute_policy_loss_geo_mean``    :func:`~torchforge.trust_region_losses.gmpo_loss`, mean over every row
``compute_policy_loss_clip_cov``    ``ppo_surrogate`` and the covariance of
                                    :func:`~torchforge.covariance_losses.clip_cov_loss`, verl's draw
``compute_policy_loss_kl_cov``      :func:`~torchforge.covariance_losses.kl_cov_loss`'s selection and
                                    penalty (with ``rollout_is_weights``, which it does not take)
``compute_policy_loss_gpg``,        :func:`~torchforge.losses.reinforce_loss`
``compute_policy_loss_reinforce``
``compute_policy_loss_dppo_tv``,    ``reinforce_loss`` weighted by ``sg(min(ratio, clip_ratio_c))`` times
``compute_policy_loss_dppo_kl``     DPPO's trust-region mask (computed here: no native DPPO)
``compute_policy_loss_dro``         ``reinforce_loss`` plus ``dro_beta`` times the k2 of
                                    :func:`~torchforge.kl.approx_kl`
``compute_policy_loss_bypass_mode``  ``compute_policy_loss_vanilla`` or ``_reinforce`` on the mask and
                                    weights of :mod:`.rollout_correction` (verl's ``rollout_corr_helper``)
``compute_value_loss``              :func:`~torchforge.value_losses.value_loss` (``clip=cliprange_value``)
``compute_entropy_loss``            :func:`~torchforge.log_probs.token_entropy`, then ``agg_loss``
``get_policy_loss_fn``              the twin registered under verl's name
==================================  ==================================================================

Where verl's behaviour differs from the native primitives, these functions reproduce verl's:
the clamps on the log-ratio (20 in vanilla, SAPO, CISPO, DPPO; none in Clip-Cov, KL-Cov,
GMPO, DRO; GSPO's one-sided clamp at 10, where the native ``ratio_level="sequence"`` clamps
the sequence log-ratio at +-20), verl's ``ppo_kl`` metric (the mean of ``-log_ratio``, where
the native metrics report k3), Clip-Cov's random draw (``torch.randperm``, so that one seed
draws the same tokens) and its zeroed loss (natively detached), SAPO's and GMPO's fixed
aggregations, GMPO's mean over every row.

and where they keep torchforge's contract instead:

- float32 maths whatever the input dtype (verl computes in the input's): the results agree
  with verl's float64 to float32 rounding, about 1e-7 relative;
- an empty mask (with this call's counts) gives a loss of 0 and zero gradient, where verl
  divides 0 by 0 (NaN); a NaN where the mask is 0 reaches neither the loss nor the gradient
  (verl's ``loss_mat * loss_mask`` lets it into the ``seq-mean`` modes);
- ``response_mask`` is a 0/1 mask (bool, int or float); other values raise (verl's
  ``masked_sum`` would weigh by them).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch

from torchforge.covariance_losses import _covariance, _first_k, _selection_count
from torchforge.errors import (
    InvalidArgumentError,
    check_choice,
    check_clip,
    check_float,
    check_per_token,
    check_same_shape,
    check_tensor,
    reraise_as,
)
from torchforge.kl import approx_kl
from torchforge.log_probs import token_entropy
from torchforge.losses import ppo_surrogate, reinforce_loss
from torchforge.ratios import _masked_log_ratio, clamp_log_ratio, sequence_log_ratio
from torchforge.reduce import Aggregation, masked_mean
from torchforge.trust_region_losses import gmpo_loss, sapo_loss
from torchforge.value_losses import value_loss

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "agg_loss",
    "compute_entropy_loss",
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "get_policy_loss_fn",
    "register_policy_loss",
]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_PREFIX = "torchforge.compat.verl."


# --- reading verl's config and inputs ---------------------------------------------------------

def _option(config, name: str, default=None):
    """``config``'s field ``name`` (by key for a mapping, else by attribute); ``default``
    where it is absent or None, as verl's ``x if x is not None else default``."""
    if config is None:
        return default
    value = config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    return default if value is None else value


def _clip_range(config) -> tuple[float, float]:
    """verl's ``(clip_ratio_low, clip_ratio_high)``, each defaulting to ``clip_ratio``."""
    clip_ratio = _option(config, "clip_ratio", 0.2)
    return _option(config, "clip_ratio_low", clip_ratio), _option(config, "clip_ratio_high", clip_ratio)


def _policy_loss_option(config, name: str, default):
    """A field of verl's ``config.policy_loss`` sub-config."""
    return _option(_option(config, "policy_loss"), name, default)


def _batch_info(config) -> dict:
    """``config.global_batch_info``: the keyword arguments verl passes to ``agg_loss``."""
    return dict(_option(config, "global_batch_info", {}))


def _response_mask(fn: str, response_mask, like: torch.Tensor, like_name: str = "log_prob",
                   name: str = "response_mask") -> torch.Tensor:
    """verl's 0/1 mask (bool, int or float) as torchforge's bool mask, of the shape of ``like``."""
    check_tensor(fn, name, response_mask)
    check_same_shape(fn, name, response_mask, like_name, like)
    if response_mask.dtype == torch.bool:
        return response_mask
    # One pass and one read-back. An integer is 0 or 1 iff it lies in [0, 1]; a float m iff
    # m - m^2 = 0: that is negative outside [0, 1] and positive inside (0, 1), down to the
    # smallest subnormal (whose square rounds to 0); NaN fails both bounds.
    if response_mask.is_floating_point():
        values, upper = torch.addcmul(response_mask, response_mask, response_mask, value=-1), 0
    else:
        values, upper = response_mask, 1
    low, high = (x.item() for x in torch.aminmax(values)) if values.numel() else (0, 0)
    if not (0 <= low and high <= upper):
        raise InvalidArgumentError(
            f"{fn}: {name} has values other than 0 and 1; expected a 0/1 mask (1 = the token counts)"
        )
    return response_mask.bool()


def _aggregation(fn: str, loss_agg_mode: str, dp_size: int = 1, batch_num_tokens=None, global_batch_size=None,
                 loss_scale_factor=None, *, num_tokens=None) -> Aggregation:
    """verl's ``agg_loss`` options as an :class:`Aggregation` (``token-sum``: a token mean over 1);
    ``num_tokens``: this call's token count where the caller has it (token-mean without
    ``batch_num_tokens`` then counts nothing again)."""
    check_choice(fn, "loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    if loss_agg_mode == "token-sum":
        return Aggregation("token-mean", num_tokens=1, dp_size=dp_size)
    if loss_agg_mode == "token-mean":
        return Aggregation("token-mean", num_tokens=num_tokens if batch_num_tokens is None else batch_num_tokens,
                           dp_size=dp_size)
    return Aggregation(loss_agg_mode, num_sequences=global_batch_size, dp_size=dp_size, norm_length=loss_scale_factor)


def _log_ratio(fn: str, log_prob, old_log_prob, mask: torch.Tensor, old_name: str = "old_log_prob"):
    """``log_prob - old_log_prob`` in float32 (``old_log_prob`` detached), 0 where masked,
    once both are float tensors of one shape (verl's argument names in the error)."""
    check_tensor(fn, "log_prob", log_prob)
    check_float(fn, "log_prob", log_prob)
    check_same_shape(fn, old_name, old_log_prob, "log_prob", log_prob)
    check_float(fn, old_name, old_log_prob)
    return _masked_log_ratio(log_prob, old_log_prob, mask)


def _ppo_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> float:
    """verl's ``actor/ppo_kl``: the masked mean of ``-log_ratio`` (k1 of KL(pi_old || pi))."""
    return masked_mean(-log_ratio.detach(), mask).item()


def _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower) -> dict[str, float]:
    return {"actor/pg_clipfrac": float(pg_clipfrac), "actor/ppo_kl": float(ppo_kl),
            "actor/pg_clipfrac_lower": float(pg_clipfrac_lower)}


# --- agg_loss ---------------------------------------------------------------------------------

def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> torch.Tensor:
    """verl's ``agg_loss``: a [B, T] loss to a scalar, exact across micro-batches and ranks.

    With ``L = loss_mat``, ``m = loss_mask``, ``N`` = ``batch_num_tokens`` (default: this
    call's counted tokens), ``S`` = ``global_batch_size`` (default: this call's rows with a
    counted token), ``D = dp_size``:

    - ``token-mean``: ``D * sum L m / N``;  ``token-sum``: ``D * sum L m``;
    - ``seq-mean-token-sum``: ``D * sum_b (sum_t L m) / S``;
      ``seq-mean-token-sum-norm``: the same divided by ``loss_scale_factor`` (default T);
    - ``seq-mean-token-mean``: ``D * sum_b (sum_t L m / n_b) / S``.

    Args:
        loss_mat: [B, T] float per-token loss.
        loss_mask: [B, T] 0/1 mask (bool, int or float).
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        dp_size: data-parallel ranks; > 1 needs ``batch_num_tokens`` (token-mean) or
            ``global_batch_size`` (seq-mean modes), as in verl.
        batch_num_tokens: the counted tokens of the global batch.
        global_batch_size: the sequences of the global batch.
        loss_scale_factor: the constant length of ``seq-mean-token-sum-norm``.

    Returns:
        float32 scalar; 0 when nothing is counted (verl: NaN with this call's counts).

    Example:
        >>> import torch
        >>> loss = torch.tensor([[1., 1., 0.], [4., 0., 0.]]); mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> agg_loss(loss, mask, "token-mean"), agg_loss(loss, mask, "seq-mean-token-mean")
        (tensor(2.), tensor(2.5000))

    Note:
        verl divides a row's sum by ``n_b + 1e-8`` in ``seq-mean-token-mean``; here by
        ``max(n_b, 1)`` (:func:`~torchforge.reduce.aggregate`): a relative 1e-8 / n_b, far
        below float32's rounding.
    """
    fn = _PREFIX + "agg_loss"
    check_tensor(fn, "loss_mat", loss_mat, ndim=2)
    mask = _response_mask(fn, loss_mask, loss_mat, "loss_mat", name="loss_mask")
    agg = _aggregation(fn, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    with reraise_as(fn):
        return agg(loss_mat, mask)


# --- the PPO clip: vanilla and the deprecated compute_policy_loss ----------------------------

def _ppo_clip(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_low, clip_high,
              clip_ratio_c, rollout_is_weights, batch_info):
    """verl's dual-clip PPO loss and its three statistics, as tensors."""
    if not clip_ratio_c > 1.0:
        raise InvalidArgumentError(f"{fn}: clip_ratio_c must be > 1.0 (dual-clip PPO), got {clip_ratio_c}")
    mask = _response_mask(fn, response_mask, log_prob)
    agg = _aggregation(fn, loss_agg_mode, **batch_info)
    with reraise_as(fn):
        # clip_low above 1 puts verl's lower bound below 0, which no ratio reaches: as clip_low = 1.
        pg_losses, _, m = ppo_surrogate(log_prob, old_log_prob, advantages, mask, rollout_is_weights,
                                        clip_low=min(clip_low, 1.0), clip_high=clip_high, dual_clip=clip_ratio_c,
                                        max_log_ratio=20.0)
        pg_loss = agg(pg_losses, mask)
        log_ratio = clamp_log_ratio(_log_ratio(fn, log_prob, old_log_prob, mask), max_log_ratio=20.0)
    with torch.no_grad():
        pg_clipfrac = m["clip_frac_low"] + m["clip_frac_high"]      # pg_losses2 > pg_losses1, either sign
        ppo_kl = masked_mean(-log_ratio, mask)
    return pg_loss, pg_clipfrac, ppo_kl, m["dual_clip_frac"]


def compute_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    cliprange=None,
    cliprange_low=None,
    cliprange_high=None,
    clip_ratio_c=3.0,
    loss_agg_mode: str = "token-mean",
):
    """verl's deprecated ``compute_policy_loss``: dual-clip PPO, this call's counts.

    The loss of :func:`compute_policy_loss_vanilla` with the clip range given as arguments
    (``cliprange_low`` / ``cliprange_high`` default to ``cliprange``) and no
    ``global_batch_info``. Warns (``FutureWarning``) as verl does.

    Args:
        old_log_prob, log_prob: [B, T] float log-probs (``log_prob`` carries grad).
        advantages: [B, T] (or [B]) float.
        response_mask: [B, T] 0/1 mask.
        cliprange, cliprange_low, cliprange_high: the PPO clip offsets.
        clip_ratio_c: the dual clip; > 1.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: float32 scalar tensors.

    Example:
        >>> import torch, warnings
        >>> lp = torch.log(torch.tensor([[0.6, 0.3]])); old = torch.log(torch.tensor([[0.4, 0.3]]))
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     pg_loss, clipfrac, _, _ = compute_policy_loss(old, lp, torch.ones(1, 2), torch.ones(1, 2), 0.2)
        >>> pg_loss, clipfrac                 # ratios 1.5 (clipped to 1.2) and 1: -(1.2 + 1) / 2
        (tensor(-1.1000), tensor(0.5000))
    """
    fn = _PREFIX + "compute_policy_loss"
    warnings.warn(f"{fn} is deprecated, as in verl; use {_PREFIX}compute_policy_loss_vanilla",
                  FutureWarning, stacklevel=2)
    clip_low = cliprange if cliprange_low is None else cliprange_low
    clip_high = cliprange if cliprange_high is None else cliprange_high
    if clip_low is None or clip_high is None:
        raise InvalidArgumentError(f"{fn}: needs cliprange (or cliprange_low and cliprange_high), got None")
    return _ppo_clip(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_low, clip_high,
                     clip_ratio_c, None, {})


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``vanilla`` policy loss: PPO's clip with clip-higher and the dual clip.

    With ``log_ratio = clamp(log_prob - old_log_prob, -20, 20)``, ``ratio = exp(log_ratio)``,
    ``A = advantages``: ``pg_losses1 = -A ratio``, ``pg_losses2 = -A clamp(ratio, 1 -
    clip_ratio_low, 1 + clip_ratio_high)``, ``pg = max(pg_losses1, pg_losses2)``, where
    ``A < 0``: ``pg = min(pg, -A clip_ratio_c)``; times ``rollout_is_weights``, then
    :func:`agg_loss` with ``config.global_batch_info``.

    Args:
        old_log_prob: [B, T] float log pi_old.
        log_prob: [B, T] float log pi (carries grad).
        advantages: [B, T] (or [B]) float.
        response_mask: [B, T] 0/1 mask.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        config: verl's ``ActorConfig`` (or a mapping / object with its fields):
            ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c`` (> 1),
            ``global_batch_info``.
        rollout_is_weights: optional [B, T] float importance weights (detached).

    Returns:
        ``(pg_loss, pg_metrics)``: float32 scalar; ``actor/pg_clipfrac`` (tokens where the
        clip is active), ``actor/ppo_kl`` (mean ``-log_ratio``), ``actor/pg_clipfrac_lower``
        (tokens where the dual clip is, ``A < 0`` and ``ratio > clip_ratio_c``), floats.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.6, 0.3]])); old = torch.log(torch.tensor([[0.4, 0.3]]))
        >>> pg_loss, m = compute_policy_loss_vanilla(old, lp, torch.ones(1, 2), torch.ones(1, 2))
        >>> pg_loss, m["actor/pg_clipfrac"]   # ratios 1.5 (clipped to 1.2) and 1: -(1.2 + 1) / 2
        (tensor(-1.1000), 0.5)

    References:
        PPO, https://arxiv.org/abs/1707.06347; dual-clip PPO, https://arxiv.org/abs/1912.09729
    """
    fn = _PREFIX + "compute_policy_loss_vanilla"
    clip_low, clip_high = _clip_range(config)
    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _ppo_clip(
        fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, clip_low, clip_high,
        _option(config, "clip_ratio_c", 3.0), rollout_is_weights, _batch_info(config),
    )
    return pg_loss, _metrics(pg_clipfrac.item(), ppo_kl.item(), pg_clipfrac_lower.item())


# --- DPPO ---------------------------------------------------------------------------------------

def _dppo(fn, divergence, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
          rollout_is_weights):
    """DPPO-Binary-TV / -KL: REINFORCE weighted by the truncated ratio inside the trust region."""
    clip_low, clip_high = _clip_range(config)
    clip_ratio_c = _option(config, "clip_ratio_c", 20.0)
    mask = _response_mask(fn, response_mask, log_prob)
    agg = _aggregation(fn, loss_agg_mode, **_batch_info(config))
    with reraise_as(fn):
        A = check_per_token(fn, "advantages", advantages, log_prob).expand(mask.shape)
        log_ratio = clamp_log_ratio(_log_ratio(fn, log_prob, old_log_prob, mask), max_log_ratio=20.0)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        lp, old = log_prob.detach().float(), old_log_prob.detach().float()
        prob, old_prob = torch.exp(lp), torch.exp(old)
        if divergence == "tv":
            valid_positive = (prob - old_prob) <= clip_high
            valid_negative = (prob - old_prob) >= -clip_low
        else:  # binary KL between Bernoulli(old_prob) and Bernoulli(prob); 1 - p as -expm1(log p)
            binary_kl = old_prob * (old - lp) + (-torch.expm1(old)) * torch.log(
                (-torch.expm1(old) + 1e-8) / (-torch.expm1(lp) + 1e-8))
            valid_positive = (binary_kl <= clip_high) | (prob <= old_prob)
            valid_negative = (binary_kl <= clip_low) | (prob >= old_prob)
        valid = torch.where(A > 0, valid_positive, valid_negative).float()
        weights = ratio.clamp(max=clip_ratio_c) * valid
        if rollout_is_weights is not None:
            weights = weights * check_per_token(fn, "rollout_is_weights", rollout_is_weights, log_prob)
    with reraise_as(fn):
        pg_loss, _ = reinforce_loss(log_prob, A, mask, weights, aggregation=agg, with_metrics=False)
    with torch.no_grad():
        pg_clipfrac = masked_mean(1.0 - valid, mask)
        pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).float() * valid, mask)
    return pg_loss, _metrics(pg_clipfrac.item(), _ppo_kl(log_ratio, mask), pg_clipfrac_lower.item())


_DPPO_DOC = """verl's ``dppo_{name}`` policy loss: DPPO-Binary-{NAME} (arXiv 2602.04879).

    REINFORCE weighted by the truncated, detached ratio inside a trust region on the
    token's probability: with ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``,
    ``p = exp(log_prob)``, ``p_old = exp(old_log_prob)``,
    ``pg = -A sg(min(ratio, clip_ratio_c)) valid log_prob`` (times ``rollout_is_weights``),
    then :func:`agg_loss`, where {valid}

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights:
            as in :func:`compute_policy_loss_vanilla`.
        config: ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` (the divergence
            thresholds), ``clip_ratio_c`` (the truncation; 20 where the config lacks it),
            ``global_batch_info``.

    Returns:
        ``(pg_loss, pg_metrics)``: ``actor/pg_clipfrac`` (tokens outside the trust
        region), ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (tokens inside it whose
        ratio is truncated).

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.5]])); old = torch.log(torch.tensor([[0.4]]))
        >>> pg_loss, m = compute_policy_loss_dppo_{name}(old, lp, torch.ones(1, 1), torch.ones(1, 1))
        >>> round(pg_loss.item(), 4)          # inside the region: -1.25 * log 0.5
        0.8664

    References:
        DPPO, https://arxiv.org/abs/2602.04879

    Note:
        torchforge has no DPPO primitive: the trust region is computed here, on
        :func:`~torchforge.losses.reinforce_loss`.{note}
    """


def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    return _dppo(_PREFIX + "compute_policy_loss_dppo_tv", "tv", old_log_prob, log_prob, advantages, response_mask,
                 loss_agg_mode, config, rollout_is_weights)


compute_policy_loss_dppo_tv.__doc__ = _DPPO_DOC.format(
    name="tv", NAME="TV", note="",
    valid="``valid = p - p_old <= clip_ratio_high`` where ``A > 0``, else ``p - p_old >= -clip_ratio_low``.",
)


def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    return _dppo(_PREFIX + "compute_policy_loss_dppo_kl", "kl", old_log_prob, log_prob, advantages, response_mask,
                 loss_agg_mode, config, rollout_is_weights)


compute_policy_loss_dppo_kl.__doc__ = _DPPO_DOC.format(
    name="kl", NAME="KL",
    valid=("with the binary KL ``d = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / "
           "(1 - p + 1e-8))``, ``valid = d <= clip_ratio_high or p <= p_old`` where ``A > 0``, else "
           "``d <= clip_ratio_low or p >= p_old``."),
    note=(" ``1 - p`` is formed as ``-expm1(log_prob)``, exact in float32 where ``1 - exp`` "
          "cancels (verl's form, in float64, agrees to its rounding)."),
)


# --- GSPO, SAPO, CISPO, GMPO ---------------------------------------------------------------------

def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``gspo`` policy loss: PPO's clip on GSPO-token's sequence ratio.

    With ``l_b`` the row's mean log-ratio, ``s_bt = exp(min(sg(l_b) + log_prob_bt -
    sg(log_prob_bt), 10))`` (value ``exp(min(l_b, 10))``, gradient ``s_bt grad log_prob_bt``,
    none where ``l_b > 10``): ``pg = max(-A s, -A clamp(s, 1 - clip_ratio_low, 1 +
    clip_ratio_high))``, times ``rollout_is_weights``, then :func:`agg_loss`.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
            rollout_is_weights: as in :func:`compute_policy_loss_vanilla` (no dual clip).

    Returns:
        ``(pg_loss, pg_metrics)``: ``actor/pg_clipfrac``, ``actor/ppo_kl`` (of the token
        log-ratio, unclamped), ``actor/pg_clipfrac_lower`` (0.0).

    Example:
        >>> import torch
        >>> old = torch.zeros(1, 2); lp = torch.tensor([[0.4, 0.0]])   # l_b = 0.2: s = e^0.2 > 1.2
        >>> pg_loss, m = compute_policy_loss_gspo(old, lp, torch.ones(1, 2), torch.ones(1, 2))
        >>> pg_loss, m["actor/pg_clipfrac"]
        (tensor(-1.2000), 1.0)

    References:
        GSPO, https://arxiv.org/abs/2507.18071

    Note:
        The native :func:`~torchforge.losses.ppo_loss` with ``ratio_level="sequence"``
        clamps the sequence log-ratio at +-``max_log_ratio`` (20), both sides; verl clamps
        it only above, at 10, and this twin does: at a row mean log-ratio of -50 verl's
        ratio is e^-50 (the native, e^-20). Here ``ppo_surrogate`` is given that clamped
        log-ratio against 0, so its ratio is GSPO-token's.
    """
    fn = _PREFIX + "compute_policy_loss_gspo"
    clip_low, clip_high = _clip_range(config)
    mask = _response_mask(fn, response_mask, log_prob)
    agg = _aggregation(fn, loss_agg_mode, **_batch_info(config))
    with reraise_as(fn):
        log_ratio = _log_ratio(fn, log_prob, old_log_prob, mask)
        seq_log_ratio = torch.clamp(sequence_log_ratio(log_ratio, mask), max=10.0)   # verl's clamp
        clip_low = min(clip_low, 1.0)
        pg_losses, ratio, _ = ppo_surrogate(seq_log_ratio, torch.zeros_like(seq_log_ratio), advantages, mask,
                                            rollout_is_weights, clip_low=clip_low, clip_high=clip_high,
                                            max_log_ratio=math.inf, with_metrics=False)
        pg_loss = agg(pg_losses, mask)
        A = check_per_token(fn, "advantages", advantages, log_prob)
    with torch.no_grad():
        # The clip takes the gradient where it moves the ratio against A's sign: above
        # 1 + clip_high with A > 0, below 1 - clip_low with A < 0 (pg_losses2 > pg_losses1);
        # never where masked, where the ratio is 1.
        ratio = ratio.detach()
        clipped = A * (ratio - ratio.clamp(1 - clip_low, 1 + clip_high)) > 0
        count = torch.count_nonzero(mask).clamp(min=1)
        pg_clipfrac = torch.count_nonzero(clipped) / count
        ppo_kl = -log_ratio.detach().sum() / count            # log_ratio is 0 where masked
    return pg_loss, _metrics(pg_clipfrac.item(), ppo_kl.item(), 0.0)


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``sapo`` policy loss: SAPO's sigmoid gate, always ``seq-mean-token-mean``.

    ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``, ``tau = tau_pos`` where
    ``A > 0`` else ``tau_neg``, ``pg = -A (4 / tau) sigmoid(tau (ratio - 1))`` (times
    ``rollout_is_weights``), then :func:`agg_loss` in ``seq-mean-token-mean`` whatever
    ``loss_agg_mode`` (as verl), with ``config.global_batch_info``.

    Args:
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights: as in
            :func:`compute_policy_loss_vanilla`.
        loss_agg_mode: ignored, as in verl.
        config: ``tau_pos`` (1.0), ``tau_neg`` (1.05), ``global_batch_info``.

    Returns:
        ``(pg_loss, pg_metrics)``: ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower``
        0.0, ``actor/ppo_kl``.

    Example:
        >>> import torch
        >>> lp = torch.zeros(1, 2)
        >>> pg_loss, _ = compute_policy_loss_sapo(lp, lp, torch.ones(1, 2), torch.ones(1, 2))
        >>> pg_loss                           # on-policy: -(4 / 1) * sigmoid(0)
        tensor(-2.)

    References:
        SAPO, https://arxiv.org/abs/2511.20347
    """
    fn = _PREFIX + "compute_policy_loss_sapo"
    mask = _response_mask(fn, response_mask, log_prob)
    agg = _aggregation(fn, "seq-mean-token-mean", **_batch_info(config))
    with reraise_as(fn):
        pg_loss, _ = sapo_loss(log_prob, old_log_prob, advantages, mask, rollout_is_weights,
                               tau_pos=_option(config, "tau_pos", 1.0), tau_neg=_option(config, "tau_neg", 1.05),
                               max_log_ratio=20.0, aggregation=agg, with_metrics=False)
        log_ratio = clamp_log_ratio(_log_ratio(fn, log_prob, old_log_prob, mask), max_log_ratio=20.0)
    return pg_loss, _metrics(0.0, _ppo_kl(log_ratio, mask), 0.0)


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``cispo`` policy loss: REINFORCE weighted by the clipped, detached ratio.

    ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``,
    ``pg = -sg(clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)) A log_prob`` (times
    ``rollout_is_weights``), then :func:`agg_loss`.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
            rollout_is_weights: as in :func:`compute_policy_loss_vanilla`.

    Returns:
        ``(pg_loss, pg_metrics)``: ``actor/pg_clipfrac`` (tokens whose weight is clipped),
        ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (0.0).

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.8]])); old = torch.log(torch.tensor([[0.4]]))
        >>> pg_loss, m = compute_policy_loss_cispo(old, lp, torch.ones(1, 1), torch.ones(1, 1))
        >>> round(pg_loss.item(), 4), m["actor/pg_clipfrac"]   # -1.2 * log 0.8
        (0.2678, 1.0)

    References:
        MiniMax-M1 (CISPO), https://arxiv.org/abs/2506.13585

    Note:
        The loss is the native :func:`~torchforge.trust_region_losses.cispo_loss`'s (same
        clip, ``max_log_ratio=20``), formed here as
        :func:`~torchforge.losses.reinforce_loss` weighted by the clipped ratio so that
        verl's statistics read the same ratio instead of forming it again.
    """
    fn = _PREFIX + "compute_policy_loss_cispo"
    clip_low, clip_high = _clip_range(config)
    mask = _response_mask(fn, response_mask, log_prob)
    num_tokens = torch.count_nonzero(mask)
    agg = _aggregation(fn, loss_agg_mode, **_batch_info(config), num_tokens=num_tokens)
    clip_low = min(clip_low, 1.0)   # above 1, verl's lower bound is below 0, which no ratio reaches
    with reraise_as(fn):
        check_clip(fn, clip_low, clip_high)
        A = check_per_token(fn, "advantages", advantages, log_prob)
        log_ratio = clamp_log_ratio(_log_ratio(fn, log_prob, old_log_prob, mask).detach(), max_log_ratio=20.0)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)                          # 1 where masked: never clipped there
        weights = ratio.clamp(1 - clip_low, 1 + clip_high)    # cispo_loss's sg(clip(ratio)), kept for the metrics
        count = num_tokens.clamp(min=1)
        # ratio != clamp(ratio): the nonzero differences, cast to bool first (a cast is one
        # vectorized pass; count_nonzero on floats, and !=, branch per element on a CPU)
        pg_clipfrac = torch.count_nonzero((ratio - weights).bool()) / count
        ppo_kl = -log_ratio.sum() / count                     # log_ratio is 0 where masked
        if rollout_is_weights is not None:
            weights = weights * check_per_token(fn, "rollout_is_weights", rollout_is_weights, log_prob)
    with reraise_as(fn):
        pg_loss, _ = reinforce_loss(log_prob, A, mask, weights, aggregation=agg, with_metrics=False)
    return pg_loss, _metrics(pg_clipfrac.item(), ppo_kl.item(), 0.0)


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``geo_mean`` policy loss: GMPO, the mean over every row.

    The token log-ratio is clipped in log space on its advantage's side (``min(x,
    clip_ratio_high)`` where ``A > 0``, ``max(x, -clip_ratio_low)`` where ``A < 0``),
    ``ratio_b = exp(mean_t clipped)``, ``A_b = mean_t A``, ``pg_b = -A_b ratio_b`` (times the
    row's geometric mean of ``rollout_is_weights + 1e-10``), ``pg_loss = mean_b pg_b`` over
    all B rows, whatever ``loss_agg_mode`` and ``global_batch_info`` (as verl).

    Args:
        old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights: as in
            :func:`compute_policy_loss_vanilla`.
        loss_agg_mode: ignored, as in verl.

    Returns:
        ``(pg_loss, pg_metrics)``: ``actor/pg_clipfrac`` / ``actor/pg_clipfrac_lower``
        (tokens whose log-ratio is outside ``[-clip_ratio_low, clip_ratio_high]``, with
        ``A > 0`` / ``A < 0``), ``actor/ppo_kl``.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[0.5, 0.1]])   # A > 0: 0.5 -> 0.2; ratio = exp((0.2 + 0.1) / 2)
        >>> pg_loss, _ = compute_policy_loss_geo_mean(torch.zeros(1, 2), lp, torch.ones(1, 2), torch.ones(1, 2))
        >>> pg_loss
        tensor(-1.1618)

    References:
        GMPO, https://arxiv.org/abs/2507.20673

    Note:
        verl counts a token as clipped when its log-ratio leaves the range on either side,
        whatever its advantage's side; the native ``gmpo_loss`` reports only the side the
        clip acts on. The native ratio is clamped at 20 in log space; verl's is not.
    """
    fn = _PREFIX + "compute_policy_loss_geo_mean"
    clip_low, clip_high = _clip_range(config)
    mask = _response_mask(fn, response_mask, log_prob)
    with reraise_as(fn):
        A = check_per_token(fn, "advantages", advantages, log_prob).expand(mask.shape)
        seq_weights = None
        if rollout_is_weights is not None:
            log_w = torch.log(rollout_is_weights.detach().float() + 1e-10)
            seq_weights = torch.exp(masked_mean(log_w, mask, dim=-1))
        pg_loss, _ = gmpo_loss(log_prob, old_log_prob, A, mask, seq_weights, clip_low=clip_low,
                               clip_high=clip_high, max_log_ratio=math.inf,
                               aggregation=Aggregation("seq-mean-token-mean", num_sequences=mask.shape[0]),
                               with_metrics=False)
        log_ratio = _log_ratio(fn, log_prob, old_log_prob, mask)
    with torch.no_grad():
        clipped = (log_ratio < -clip_low) | (log_ratio > clip_high)     # never where masked: 0 there
        pg_clipfrac = masked_mean((clipped & (A > 0)).float(), mask)
        pg_clipfrac_lower = masked_mean((clipped & (A < 0)).float(), mask)
    return pg_loss, _metrics(pg_clipfrac.item(), _ppo_kl(log_ratio, mask), pg_clipfrac_lower.item())


# --- REINFORCE family: GPG, DRO, REINFORCE ---------------------------------------------------------

def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``gpg`` policy loss: ``-A log_prob`` (times ``rollout_is_weights``), :func:`agg_loss`.

    Args:
        old_log_prob: unused, as in verl.
        log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights: as in
            :func:`compute_policy_loss_vanilla`.

    Returns:
        ``(pg_loss, {})``.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> compute_policy_loss_gpg(lp, lp, torch.full((1, 2), 2.0), torch.tensor([[1, 0]]))[0]   # -2 log 0.5
        tensor(1.3863)

    References:
        GPG, https://arxiv.org/abs/2504.02546
    """
    fn = _PREFIX + "compute_policy_loss_gpg"
    mask = _response_mask(fn, response_mask, log_prob)
    agg = _aggregation(fn, loss_agg_mode, **_batch_info(config))
    with reraise_as(fn):
        pg_loss, _ = reinforce_loss(log_prob, advantages, mask, rollout_is_weights, aggregation=agg,
                                    with_metrics=False)
    return pg_loss, {}


def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``dro`` policy loss: REINFORCE with a quadratic log-ratio penalty.

    ``pg = -(A log_prob - 0.5 dro_beta (log_prob - old_log_prob)^2)`` (times
    ``rollout_is_weights``), then :func:`agg_loss`; the penalty is ``dro_beta`` times the
    k2 estimate of :func:`~torchforge.kl.approx_kl` against ``old_log_prob``.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights:
            as in :func:`compute_policy_loss_vanilla`.
        config: ``policy_loss.dro_beta`` (> 0, required), ``global_batch_info``.

    Returns:
        ``(pg_loss, pg_metrics)``: ``actor/ppo_kl``.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0]]); old = torch.tensor([[-2.0]])
        >>> cfg = {"policy_loss": {"dro_beta": 0.5}}
        >>> compute_policy_loss_dro(old, lp, torch.ones(1, 1), torch.ones(1, 1), config=cfg)[0]  # 1 + 0.25
        tensor(1.2500)

    References:
        DRO, https://arxiv.org/abs/2506.18826 (verl's ``dro`` loss)
    """
    fn = _PREFIX + "compute_policy_loss_dro"
    beta = _policy_loss_option(config, "dro_beta", None)
    if beta is None or beta <= 0:
        raise InvalidArgumentError(f"{fn}: policy_loss.dro_beta must be a positive value when using DRO, got {beta}")
    mask = _response_mask(fn, response_mask, log_prob)
    agg = _aggregation(fn, loss_agg_mode, **_batch_info(config))
    with reraise_as(fn):
        log_ratio = _log_ratio(fn, log_prob, old_log_prob, mask)
        pg_loss, _ = reinforce_loss(log_prob, advantages, mask, rollout_is_weights, aggregation=agg,
                                    with_metrics=False)
        k2 = approx_kl(log_prob, old_log_prob.detach(), rollout_is_weights, mask=mask, estimator="k2")
        pg_loss = pg_loss + beta * agg(k2, mask)
    return pg_loss, {"actor/ppo_kl": _ppo_kl(log_ratio, mask)}


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``compute_policy_loss_reinforce``: ``-A log_prob``, IS-weighted, no clip.

    ``pg = -A log_prob`` (times ``rollout_is_weights``), then :func:`agg_loss` (default
    ``seq-mean-token-sum``).

    Args:
        rollout_log_prob: [B, T] float log-probs of the generation engine (for the metric).
        log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights: as in
            :func:`compute_policy_loss_vanilla`.

    Returns:
        ``(pg_loss, pg_metrics)``: ``actor/ppo_kl``, the mean of
        ``rollout_log_prob - log_prob``.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> compute_policy_loss_reinforce(lp, lp, torch.ones(1, 2), torch.ones(1, 2))[0]   # -(log .5 + log .25)
        tensor(2.0794)

    References:
        R. J. Williams, "Simple statistical gradient-following algorithms" (1992)
    """
    fn = _PREFIX + "compute_policy_loss_reinforce"
    mask = _response_mask(fn, response_mask, log_prob)
    agg = _aggregation(fn, loss_agg_mode, **_batch_info(config))
    with reraise_as(fn):
        pg_loss, _ = reinforce_loss(log_prob, advantages, mask, rollout_is_weights, aggregation=agg,
                                    with_metrics=False)
        log_ratio = _log_ratio(fn, log_prob, rollout_log_prob, mask, old_name="rollout_log_prob")
    return pg_loss, {"actor/ppo_kl": _ppo_kl(log_ratio, mask)}


def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``bypass_mode`` policy loss: the rollout's log-probs as pi_old, with verl's
    rollout correction between them and the current policy.

    In bypass mode ``old_log_prob`` *is* the generation engine's. Under no gradient,
    :func:`~torchforge.compat.verl.rollout_correction.compute_rollout_correction_and_rejection_mask`
    of ``log_prob`` against it gives the IS weights and the rejection mask of
    ``config.policy_loss.rollout_correction``; then

    - ``loss_type="ppo_clip"`` (default): :func:`compute_policy_loss_vanilla` on the
      rejected mask, without the weights (the clipped ratio pi / pi_rollout is already the
      correction; the weights would count it twice);
    - ``loss_type="reinforce"``: :func:`compute_policy_loss_reinforce` on the rejected
      mask, times the weights.

    The rejection changes the mask, so a rejected token leaves the token-mean's
    denominator (verl's choice; the native ``ratio_mask`` returns weights and keeps the
    mask instead).

    Args:
        old_log_prob: [B, T] float log pi_rollout (the generation engine's).
        log_prob: [B, T] float log pi (carries grad).
        advantages: [B, T] (or [B]) float.
        response_mask: [B, T] 0/1 mask counting at least one token (verl's rollout
            correction raises on an empty one; so does this).
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        config: verl's ``ActorConfig`` (or a mapping / object with its fields), required:
            the fields of :func:`compute_policy_loss_vanilla` and
            ``policy_loss.rollout_correction`` (``loss_type``, ``rollout_is``,
            ``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``,
            ``rollout_rs_threshold``).
        rollout_is_weights: ignored, as in verl (the weights are computed here).

    Returns:
        ``(pg_loss, pg_metrics)``: the loss's metrics and every ``rollout_corr/`` metric.

    Example:
        >>> import torch
        >>> config = {"policy_loss": {"rollout_correction": {"loss_type": "reinforce", "rollout_is": "token"}}}
        >>> rollout, lp = torch.log(torch.tensor([[0.2, 0.3]])), torch.log(torch.tensor([[0.6, 0.3]]))
        >>> pg_loss, m = compute_policy_loss_bypass_mode(rollout, lp, torch.ones(1, 2), torch.ones(1, 2),
        ...                                              "token-sum", config)
        >>> pg_loss                          # IS weights min(3, 2) and 1: -(2 log 0.6 + log 0.3)
        tensor(2.2256)

    References:
        verl's rollout correction, https://verl.readthedocs.io/en/latest/algo/rollout_corr.html;
        F. Yao et al., https://fengyao.notion.site/off-policy-rl
    """
    from .rollout_correction import _field, compute_rollout_correction_and_rejection_mask

    fn = _PREFIX + "compute_policy_loss_bypass_mode"
    correction = _policy_loss_option(config, "rollout_correction", None)
    if correction is None:
        raise InvalidArgumentError(
            f"{fn}: needs config.policy_loss.rollout_correction (verl's RolloutCorrectionConfig or a mapping), "
            f"got config={type(config).__name__}")
    loss_type = _field(correction, "loss_type", "ppo_clip")
    check_choice(fn, "config.policy_loss.rollout_correction.loss_type", loss_type, ("ppo_clip", "reinforce"))
    with torch.no_grad():
        weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
            log_prob, old_log_prob, response_mask,
            rollout_is=_field(correction, "rollout_is", None),
            rollout_is_threshold=_field(correction, "rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=_field(correction, "rollout_is_batch_normalize", False),
            rollout_rs=_field(correction, "rollout_rs", None),
            rollout_rs_threshold=_field(correction, "rollout_rs_threshold", None),
        )
    if loss_type == "reinforce":
        weights = None if weights is None else weights.batch["rollout_is_weights"]
        pg_loss, pg_metrics = compute_policy_loss_reinforce(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                                            config, weights)
    else:
        pg_loss, pg_metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                                          config, None)
    pg_metrics.update(metrics)
    return pg_loss, pg_metrics


# --- Clip-Cov and KL-Cov -----------------------------------------------------------------------------

def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``clip_cov`` policy loss: PPO's clip, a few high-covariance tokens zeroed.

    With ``ratio = exp(log_prob - old_log_prob)`` (unclamped), ``pg = max(-A ratio, -A
    clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))`` and ``cov = (A - mean A)
    (log_prob - mean log_prob)`` over the counted tokens: the candidates are the counted
    tokens the clip leaves alone with ``clip_cov_lb < cov < clip_cov_ub``;
    ``max(int(clip_cov_ratio N), 1)`` of them, drawn by ``torch.randperm`` over the
    candidates in row-major order (the global generator, as verl), get ``pg = 0``; times
    ``rollout_is_weights``, then :func:`agg_loss`.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights:
            as in :func:`compute_policy_loss_vanilla`.
        config: ``clip_ratio*``, ``policy_loss.clip_cov_ratio`` (2e-4), ``.clip_cov_lb``
            (1.0), ``.clip_cov_ub`` (5.0), ``global_batch_info``.

    Returns:
        ``(pg_loss, pg_metrics)``: ``actor/pg_clipfrac`` (the tokens zeroed),
        ``actor/ppo_kl``.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -3.0, -5.0, -7.0]]); A = torch.tensor([[2.0, 1.0, -1.0, -2.0]])
        >>> cfg = {"policy_loss": {"clip_cov_ratio": 0.5, "clip_cov_ub": 7.0}}
        >>> # cov = A * (lp + 4) = [6, 1, 1, 6]: both tokens with cov 6 are zeroed
        >>> pg_loss, m = compute_policy_loss_clip_cov(lp, lp, A, torch.ones(1, 4), config=cfg)
        >>> pg_loss, m["actor/pg_clipfrac"]   # (-1 + 1) / 4 from the two kept
        (tensor(0.), 0.5)

    References:
        G. Cui et al., https://arxiv.org/abs/2505.22617

    Note:
        The native :func:`~torchforge.covariance_losses.clip_cov_loss` detaches the drawn
        tokens' loss (the paper's gradient; their value stays in the loss), draws them
        with ``torch.rand`` (no device sync) and clamps the log-ratio at 20; this twin
        zeroes them, draws with verl's ``randperm`` and does not clamp, as verl.
    """
    fn = _PREFIX + "compute_policy_loss_clip_cov"
    clip_low, clip_high = _clip_range(config)
    clip_cov_ratio = _policy_loss_option(config, "clip_cov_ratio", 0.0002)
    clip_cov_lb = _policy_loss_option(config, "clip_cov_lb", 1.0)
    clip_cov_ub = _policy_loss_option(config, "clip_cov_ub", 5.0)
    if not clip_cov_ratio > 0:
        raise InvalidArgumentError(f"{fn}: policy_loss.clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    mask = _response_mask(fn, response_mask, log_prob)
    agg = _aggregation(fn, loss_agg_mode, **_batch_info(config))
    with reraise_as(fn):
        pg_losses, ratio, _ = ppo_surrogate(log_prob, old_log_prob, advantages, mask, clip_low=min(clip_low, 1.0),
                                            clip_high=clip_high, max_log_ratio=math.inf)
        A = check_per_token(fn, "advantages", advantages, log_prob).expand(mask.shape)
        log_ratio = _log_ratio(fn, log_prob, old_log_prob, mask)
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_low) & (A < 0)) | ((ratio > 1 + clip_high) & (A > 0))
        cov = _covariance(A, log_prob, mask)
        candidates = torch.nonzero(mask & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub))
        num_tokens = int(torch.count_nonzero(mask))
        clip_num = max(int(clip_cov_ratio * num_tokens), 1)
        if len(candidates) > 0:
            candidates = candidates[torch.randperm(len(candidates)).to(candidates.device)[:clip_num]]
        corr = torch.ones_like(pg_losses)
        corr[candidates[:, 0], candidates[:, 1]] = 0.0
        if rollout_is_weights is not None:
            corr = corr * rollout_is_weights.detach().float()
    pg_loss = agg(pg_losses * corr, mask)
    pg_clipfrac = len(candidates) / num_tokens if num_tokens else 0.0
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": _ppo_kl(log_ratio, mask)}


def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``kl_cov`` policy loss: the unclipped surrogate, a KL penalty on the top-covariance tokens.

    With ``log_ratio = log_prob - old_log_prob`` (unclamped), ``ratio = exp(log_ratio)``
    and ``cov`` as in :func:`compute_policy_loss_clip_cov`: the ``max(int(kl_cov_ratio N),
    1)`` counted tokens of largest ``cov`` get ``pg = -A ratio + ppo_kl_coef |log_ratio|``,
    the others ``pg = -A ratio``; times ``rollout_is_weights``, then :func:`agg_loss`.

    Args:
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights:
            as in :func:`compute_policy_loss_vanilla`.
        config: ``policy_loss.kl_cov_ratio`` (2e-4), ``.ppo_kl_coef`` (1.0 where the
            config lacks it; ``PolicyLossConfig``'s default is 0.1), ``global_batch_info``.

    Returns:
        ``(pg_loss, pg_metrics)``: ``actor/ppo_kl``, the mean of ``|log_ratio|``.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -2.0, -3.0]]); old = torch.tensor([[-1.5, -2.0, -3.0]])
        >>> A = torch.tensor([[2.0, 0.0, -1.0]]); cfg = {"policy_loss": {"kl_cov_ratio": 0.34}}
        >>> # cov = (A - 1/3) * (lp + 2) = [5/3, 0, 4/3]: k = 1, the first is penalized:
        >>> # (-2 e^0.5 + 0.5 + 0 + 1) / 3
        >>> compute_policy_loss_kl_cov(old, lp, A, torch.ones(1, 3), config=cfg)[0]
        tensor(-0.5991)

    References:
        G. Cui et al., https://arxiv.org/abs/2505.22617

    Note:
        The selection and the penalty are :func:`~torchforge.covariance_losses.kl_cov_loss`'s
        (its covariance and top-k); the loss is formed here because ``kl_cov_loss`` takes
        no weights and clamps the log-ratio at 20, which verl does not.
    """
    fn = _PREFIX + "compute_policy_loss_kl_cov"
    kl_cov_ratio = _policy_loss_option(config, "kl_cov_ratio", 0.0002)
    ppo_kl_coef = _policy_loss_option(config, "ppo_kl_coef", 1.0)
    mask = _response_mask(fn, response_mask, log_prob)
    agg = _aggregation(fn, loss_agg_mode, **_batch_info(config))
    with reraise_as(fn):
        A = check_per_token(fn, "advantages", advantages, log_prob).expand(mask.shape)
        log_ratio = _log_ratio(fn, log_prob, old_log_prob, mask)
        k, k_max = _selection_count(fn, kl_cov_ratio, torch.count_nonzero(mask), mask)
    with torch.no_grad():
        selected = _first_k(-_covariance(A, log_prob, mask), mask, k, k_max)
    pg_losses = -A * torch.exp(log_ratio) + torch.where(selected, ppo_kl_coef * log_ratio.abs(), 0.0)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach().float()
    with reraise_as(fn):
        pg_loss = agg(pg_losses, mask)
    return pg_loss, {"actor/ppo_kl": masked_mean(log_ratio.detach().abs(), mask).item()}


# --- entropy and value losses -------------------------------------------------------------------------

def compute_entropy_loss(logits, response_mask, loss_agg_mode: str = "token-mean"):
    """verl's ``compute_entropy_loss``: the token entropy of ``logits``, by :func:`agg_loss`.

    Args:
        logits: [B, T, V] float.
        response_mask: [B, T] 0/1 mask.
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (this call's counts).

    Returns:
        float32 scalar, the aggregated entropy (a loss to subtract: verl's actor does
        ``pg_loss - entropy_coeff * entropy``).

    Example:
        >>> import torch
        >>> compute_entropy_loss(torch.zeros(1, 2, 4), torch.ones(1, 2))   # log 4
        tensor(1.3863)
    """
    fn = _PREFIX + "compute_entropy_loss"
    check_tensor(fn, "logits", logits, ndim=3)
    with reraise_as(fn):
        entropy = token_entropy(logits)
    return agg_loss(entropy, _response_mask(fn, response_mask, entropy, "the entropy of logits"), loss_agg_mode)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl's ``compute_value_loss``: PPO's clipped value loss.

    ``vpredclipped = clamp(vpreds, values - cliprange_value, values + cliprange_value)``,
    ``vf_loss = 0.5 agg_loss(max((vpreds - returns)^2, (vpredclipped - returns)^2))`` with
    the given counts.

    Args:
        vpreds: [B, T] float critic outputs (carry grad).
        returns: [B, T] float targets.
        values: [B, T] float critic outputs at sampling time.
        response_mask: [B, T] 0/1 mask.
        cliprange_value: the absolute clip range; >= 0.
        loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: as
            in :func:`agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``: float32 scalar tensors (the fraction of counted tokens
        where the clipped term is the larger).

    Note:
        :func:`~torchforge.value_losses.value_loss` is given the errors ``vpreds - returns``
        and ``values - returns`` (and returns 0), formed in the inputs' dtype: in float64,
        returns near 1e4 keep their precision, which a cast to float32 first would round
        to 1e-3 (the native primitive forms the same errors after its cast).

    Example:
        >>> import torch
        >>> vpreds = torch.tensor([[1.0, 0.5]]); values = torch.tensor([[0.0, 0.5]])
        >>> compute_value_loss(vpreds, torch.tensor([[2.0, 0.5]]), values, torch.ones(1, 2), 0.2)
        (tensor(0.8100), tensor(0.5000))
    """
    fn = _PREFIX + "compute_value_loss"
    check_tensor(fn, "vpreds", vpreds, ndim=2)
    mask = _response_mask(fn, response_mask, vpreds, "vpreds")
    agg = _aggregation(fn, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    with reraise_as(fn):
        check_same_shape(fn, "returns", returns, "vpreds", vpreds)
        check_same_shape(fn, "values", values, "vpreds", vpreds)
        # The loss depends on the errors only: formed in the inputs' precision, then float32.
        returns = returns.detach()
        vf_loss, m = value_loss(vpreds - returns, values.detach() - returns, torch.zeros_like(returns), mask,
                                clip=cliprange_value, aggregation=agg)
    return vf_loss, m["clip_frac"]


# --- the registry ----------------------------------------------------------------------------------------

POLICY_LOSS_REGISTRY = {
    "vanilla": compute_policy_loss_vanilla,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "dro": compute_policy_loss_dro,
    "cispo": compute_policy_loss_cispo,
    "bypass_mode": compute_policy_loss_bypass_mode,
}


def register_policy_loss(name: str):
    """verl's decorator: register a policy loss of your own under ``name`` (for :func:`get_policy_loss_fn`).

    Args:
        name: the ``policy_loss.loss_mode`` it answers to.

    Returns:
        The decorator, which returns the function unchanged.

    Example:
        >>> @register_policy_loss("my_loss")
        ... def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
        ...             config=None, rollout_is_weights=None):
        ...     return compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)
        >>> get_policy_loss_fn("my_loss") is my_loss
        True
        >>> _ = POLICY_LOSS_REGISTRY.pop("my_loss")
    """
    def decorator(func):
        POLICY_LOSS_REGISTRY[name] = func
        return func

    return decorator


def get_policy_loss_fn(name):
    """The policy loss registered under verl's ``name`` (``config.policy_loss.loss_mode``).

    Args:
        name: one of ``POLICY_LOSS_REGISTRY``'s keys.

    Returns:
        The twin function, e.g. :func:`compute_policy_loss_vanilla` for ``"vanilla"``.

    Example:
        >>> get_policy_loss_fn("cispo") is compute_policy_loss_cispo
        True
    """
    if name not in POLICY_LOSS_REGISTRY:
        raise InvalidArgumentError(
            f"{_PREFIX}get_policy_loss_fn: unsupported loss mode {name!r}; expected one of "
            f"{', '.join(repr(k) for k in POLICY_LOSS_REGISTRY)}"
        )
    return POLICY_LOSS_REGISTRY[name]
