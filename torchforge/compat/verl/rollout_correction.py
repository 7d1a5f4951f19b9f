"""verl 0.9.1's rollout correction (``verl.trainer.ppo.rollout_corr_helper``) on torchforge's
off-policy corrections: the importance weights, rejection masks and diagnostics that verl's
``bypass_mode`` policy loss (:func:`~torchforge.compat.verl.compute_policy_loss_bypass_mode`)
and its trainer compute between the generation engine's log-probs and the trainer's.

Same names, parameters, defaults and returns as verl's (metric dicts of Python floats, the
IS weights of :func:`compute_rollout_correction_and_rejection_mask` under
``.batch["rollout_is_weights"]`` as verl's ``DataProto`` holds them); verl is never imported.

========================================  ==================================================================
verl ``rollout_corr_helper``              torchforge
========================================  ==================================================================
``compute_rollout_correction_weights``    :func:`~torchforge.corrections.truncated_importance_weights`
                                          (TIS, ``threshold``) or ``exp(log_ratio)`` times
                                          :func:`~torchforge.corrections.ratio_mask` (IcePop,
                                          ``"lower_upper"``), of the token's log-ratio or the
                                          sequence's sum (``rollout_is="sequence"``: the product, natively
                                          ``level="sequence-product"``), clamped at +-20 as verl does
``compute_rollout_rejection_mask``        :func:`~torchforge.kl.approx_kl`'s k1 / k2 / k3 of the trainer
                                          against the rollout (k3 unbounded, ``max_ratio=inf``), per
                                          token or the row's sum, mean or max (:mod:`torchforge.reduce`)
``compute_offpolicy_metrics``             ``masked_mean`` / ``masked_sum`` of the log-probs and ratios
========================================  ==================================================================

Where verl's behaviour differs from the native corrections, these functions reproduce verl's:
the IS weights are the trainer / rollout ratio clamped at ``exp(+-20)`` before truncation
(natively only the cap applies); a rejection *changes the mask* (the native filters return
weights and keep the mask, so that a token-mean still divides by every counted token: here,
as in verl, a rejected token leaves the denominator); the sequence level is the product of
the token ratios (natively ``level="sequence"`` is their geometric mean); batch
normalization (``rollout_is_batch_normalize``) divides the weights by their mean, over ranks
when ``torch.distributed`` is initialized.

and where they keep torchforge's contract instead: float32 maths whatever the input dtype
(the results agree with verl's float64 to float32 rounding); the metrics reach the host in
one transfer (verl calls ``.item()`` once per metric); a NaN log-ratio on a counted token
gets weight 0 and is never kept by a rejection test (verl's weight and statistics are NaN
there); a ``response_mask`` with values other than 0 and 1 raises.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from tensordict import TensorDict

from torchforge.corrections import ratio_mask, truncated_importance_weights
from torchforge.errors import InvalidArgumentError, check_same_shape, check_tensor
from torchforge.kl import approx_kl
from torchforge.reduce import masked_max, masked_mean, masked_min, masked_sum, masked_var

from .losses import _response_mask

__all__ = [
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "RolloutISWeights",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
]

_PREFIX = "torchforge.compat.verl."
SAFETY_BOUND = 20.0  # verl clamps every log-ratio here before exp
SUPPORTED_ROLLOUT_RS_OPTIONS = frozenset({
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
})
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS = frozenset({"token_k1", "token_k2", "token_k3"})


class RolloutISWeights:
    """What verl's ``DataProto`` carries of the IS weights: ``.batch["rollout_is_weights"]``."""

    def __init__(self, rollout_is_weights: torch.Tensor):
        self.batch = TensorDict({"rollout_is_weights": rollout_is_weights}, batch_size=rollout_is_weights.shape[:1])

    def __repr__(self) -> str:
        return f"RolloutISWeights(rollout_is_weights={tuple(self.batch['rollout_is_weights'].shape)})"


# --- thresholds ------------------------------------------------------------------------------

def _number(fn: str, name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidArgumentError(f"{fn}: {name} has {text!r}, expected a number") from None


def _is_thresholds(fn: str, spec) -> tuple[float, float | None]:
    """``rollout_is_threshold`` as ``(upper, lower)``: a number (TIS: lower None) or
    ``"lower_upper"`` (IcePop), with ``0 < lower <= upper``."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise InvalidArgumentError(
            f"{fn}: rollout_is_threshold is {spec!r}; expected a number (TIS) or 'lower_upper' (IcePop)")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        if "_" in text:
            lower_text, upper_text = text.split("_", 1)
            lower = _number(fn, "rollout_is_threshold", lower_text)
            upper = _number(fn, "rollout_is_threshold", upper_text)
        else:
            upper = _number(fn, "rollout_is_threshold", text)
    else:
        upper = float(spec)
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise InvalidArgumentError(
            f"{fn}: rollout_is_threshold is {spec!r}; expected upper > 0 and, for 'lower_upper', 0 < lower <= upper")
    return upper, lower


def _rs_options(fn: str, rollout_rs) -> list[str]:
    """The comma-separated ``rollout_rs`` options, each once, in order."""
    if not isinstance(rollout_rs, str):
        raise InvalidArgumentError(f"{fn}: rollout_rs is {rollout_rs!r}; expected options such as 'token_k1,seq_sum_k3'")
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    unknown = [o for o in options if o not in SUPPORTED_ROLLOUT_RS_OPTIONS]
    if unknown or not options:
        raise InvalidArgumentError(
            f"{fn}: rollout_rs has {unknown or rollout_rs!r}; expected options among "
            f"{', '.join(sorted(SUPPORTED_ROLLOUT_RS_OPTIONS))}")
    return options


def _rs_thresholds(fn: str, options: list[str], spec) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs_threshold`` as ``{option: (lower, upper)}``: one entry shared by every
    option or one per option; a k1 option takes ``"lower_upper"`` ratio bounds (a single
    number u means ``1/u_u``), the others a single upper bound (lower None)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise InvalidArgumentError(f"{fn}: rollout_rs_threshold is {spec!r}; expected a number or a string such as "
                                   f"'0.5_2.0,0.01'")
    entries = [str(spec)] if not isinstance(spec, str) else [s.strip() for s in spec.split(",") if s.strip()]
    if len(entries) not in (1, len(options)):
        raise InvalidArgumentError(
            f"{fn}: rollout_rs_threshold has {len(entries)} entries for {len(options)} rollout_rs options; "
            f"expected 1 (shared) or {len(options)}")
    entries = entries * len(options) if len(entries) == 1 else entries
    thresholds = {}
    for option, entry in zip(options, entries):
        if option.endswith("k1"):
            lower_text, upper_text = entry.split("_", 1) if "_" in entry else (None, entry)
            upper = _number(fn, "rollout_rs_threshold", upper_text)
            lower = 1.0 / upper if lower_text is None else _number(fn, "rollout_rs_threshold", lower_text)
            if not 0 < lower <= upper:
                raise InvalidArgumentError(
                    f"{fn}: rollout_rs_threshold for {option} is {entry!r}; expected 0 < lower <= upper")
        else:
            if "_" in entry:
                raise InvalidArgumentError(
                    f"{fn}: rollout_rs_threshold for {option} is {entry!r}; expected one upper bound (no '_')")
            lower, upper = None, _number(fn, "rollout_rs_threshold", entry)
            if not upper > 0:
                raise InvalidArgumentError(f"{fn}: rollout_rs_threshold for {option} is {entry!r}; expected > 0")
        thresholds[option] = (lower, upper)
    return thresholds


# --- inputs and metrics ----------------------------------------------------------------------

def _inputs(fn: str, log_ratio, response_mask, name: str = "log_ratio") -> tuple[torch.Tensor, torch.Tensor]:
    """The detached [B, T] ``log_ratio`` (the argument ``name``) and the bool mask, checked
    once per call; a mask that counts no token raises, as in verl."""
    check_tensor(fn, name, log_ratio, ndim=2)
    mask = _response_mask(fn, response_mask, log_ratio, name)
    if not bool(mask.any()):
        raise InvalidArgumentError(f"{fn}: response_mask counts no token; expected at least one (verl raises too)")
    return log_ratio.detach(), mask


def _floats(metrics: dict) -> dict[str, float]:
    """Tensor metrics as Python floats, in one transfer to the host."""
    tensors = {k: v.detach().double().reshape(()) for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    values = dict(zip(tensors, torch.stack(list(tensors.values())).tolist())) if tensors else {}
    return {k: values[k] if k in values else float(v) for k, v in metrics.items()}


def _std(values: torch.Tensor) -> torch.Tensor:
    """torch's unbiased std, 0 for fewer than two values (verl's guard)."""
    return values.std() if values.numel() > 1 else values.new_zeros(())


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """verl's population std of ``x = clamp(values, low, high)`` over the counted tokens, 0
    for a single token. verl computes ``sqrt(E[x^2] - E[x]^2)``; ``masked_var``'s two passes
    give the same in float32 without the cancellation (equal clamped values: exactly 0)."""
    std = masked_var(values.clamp(min=low, max=high), mask, unbiased=False).sqrt()
    return torch.where(mask.sum() > 1, std, 0.0)


def _global_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over the counted values, of every rank when ``torch.distributed`` is initialized."""
    if dist.is_available() and dist.is_initialized():
        from torchforge.distributed import sum_over_ranks

        return masked_mean(values, mask, sum_over_ranks=sum_over_ranks)
    return masked_mean(values, mask)


# --- importance weights ----------------------------------------------------------------------

def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's truncated (TIS) or masked (IcePop) importance weights pi_train / pi_rollout.

    With ``l`` the log-ratio of the level (``rollout_is="token"``: each token's;
    ``"sequence"``: the row's sum over counted tokens, broadcast), clamped at +-20, and
    ``w = exp(l)`` on counted tokens (0 elsewhere):

    - ``rollout_is_threshold`` a number ``C``: ``min(w, C)`` (TIS);
    - ``"lower_upper"``: ``w`` where ``lower <= w <= upper``, else 0 (IcePop);
    - ``rollout_is_batch_normalize``: then divided by their mean (over tokens, or over rows
      for ``"sequence"``; over ranks when ``torch.distributed`` is initialized), unless
      that mean is at most 1e-8.

    Args:
        log_ratio: [B, T] float ``log pi_train - log pi_rollout``.
        response_mask: [B, T] 0/1 mask counting at least one token.
        rollout_is: ``"token"`` or ``"sequence"``.
        rollout_is_threshold: the cap, or ``"lower_upper"``.
        rollout_is_batch_normalize: normalize the weights to mean 1.

    Returns:
        ``(rollout_is_weights, metrics)``: [B, T] float32 detached weights, 0 where not
        counted; verl's ``rollout_is_*`` metrics (floats).

    Example:
        >>> import torch
        >>> log_ratio = torch.log(torch.tensor([[3.0, 0.5]]))
        >>> compute_rollout_correction_weights(log_ratio, torch.ones(1, 2))[0]          # min(3, 2), 0.5
        tensor([[2.0000, 0.5000]])
        >>> compute_rollout_correction_weights(log_ratio, torch.ones(1, 2), rollout_is_threshold="0.8_2")[0]
        tensor([[0., 0.]])

    References:
        F. Yao et al., "Your efficient RL framework secretly brings you off-policy RL
        training" (TIS), https://fengyao.notion.site/off-policy-rl; IcePop,
        https://arxiv.org/abs/2510.18855
    """
    fn = _PREFIX + "compute_rollout_correction_weights"
    log_ratio, mask = _inputs(fn, log_ratio, response_mask)
    weights, metrics = _is_weights(fn, log_ratio, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
    return weights, _floats(metrics)


def _is_weights(fn, log_ratio, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize):
    """The weights and their metrics (tensors), from :func:`_inputs`' log-ratio and bool mask."""
    if rollout_is not in ("token", "sequence"):
        raise InvalidArgumentError(f"{fn}: rollout_is is {rollout_is!r}; expected 'token' or 'sequence'")
    upper, lower = _is_thresholds(fn, rollout_is_threshold)
    if rollout_is == "token":
        level_log_ratio = log_ratio
    else:
        level_log_ratio = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)
    safe = level_log_ratio.float().clamp(-SAFETY_BOUND, SAFETY_BOUND).expand_as(log_ratio)
    rollout = torch.zeros_like(safe)  # the corrections take two log-probs: here their difference and 0
    raw = torch.where(mask, safe.exp(), 0.0)
    if lower is None:
        weights = truncated_importance_weights(safe, rollout, mask, cap=upper)
    else:  # ratio_mask's bounds are strict: lower == upper keeps only the ratio equal to both
        high = upper if lower < upper else math.nextafter(upper, math.inf)
        weights = raw * ratio_mask(safe, rollout, mask, low=lower, high=high)
    metrics = _is_metrics(weights, raw, level_log_ratio, mask, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask)
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = _global_mean(weights, mask)
        else:
            mean = _global_mean(masked_mean(weights, mask, dim=-1), mask.any(-1))
        normalize = mean > 1e-8  # a tensor test, no sync: the factor is 1 where verl skips
        factor = torch.where(normalize, mean, 1.0)
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: float | None = None,
) -> dict[str, float]:
    """verl's diagnostics of the IS weights: mean, max, min, the fractions beyond the
    bounds (of the raw weights, or in log space of the sequences' log-ratios), std and
    effective sample size of the weights clamped at the cap, and per-row statistics.

    Args:
        rollout_is_weights: [B, T] the applied weights.
        raw_rollout_is_weights: [B, T] ``exp(log_ratio)`` before TIS / IcePop.
        log_ratio_for_metrics: [B, T] token log-ratios, or [B, 1] the rows' sums.
        response_mask: [B, T] 0/1 mask counting at least one token.
        rollout_is: ``"token"`` or ``"sequence"``.
        rollout_is_threshold: the upper bound.
        rollout_is_threshold_lower: the lower bound; None: ``1 / rollout_is_threshold``.

    Returns:
        ``{"rollout_is_mean": ..., "rollout_is_eff_sample_size": ..., ...}``: floats.

    Example:
        >>> import torch
        >>> w = torch.tensor([[2.0, 0.5]])
        >>> compute_is_metrics(w, w, w.log(), torch.ones(1, 2), "token", 2.0)["rollout_is_mean"]
        1.25
    """
    fn = _PREFIX + "compute_is_metrics"
    if rollout_is not in ("token", "sequence"):
        raise InvalidArgumentError(f"{fn}: rollout_is is {rollout_is!r}; expected 'token' or 'sequence'")
    weights, mask = _inputs(fn, rollout_is_weights, response_mask, "rollout_is_weights")
    check_same_shape(fn, "raw_rollout_is_weights", raw_rollout_is_weights, "rollout_is_weights", rollout_is_weights)
    return _floats(_is_metrics(weights.float(), raw_rollout_is_weights.detach().float(),
                               log_ratio_for_metrics.detach(), mask, rollout_is, rollout_is_threshold,
                               rollout_is_threshold_lower))


def _is_metrics(weights, raw, level_log_ratio, mask, rollout_is, upper, lower) -> dict[str, torch.Tensor]:
    lower = 1.0 / upper if lower is None else lower
    m = {}
    if rollout_is == "sequence":  # every row's sum (an empty row's is 0), in log space
        m["rollout_is_max"] = level_log_ratio.max().float().clamp(max=SAFETY_BOUND).exp()
        m["rollout_is_min"] = level_log_ratio.min().float().exp()
        m["rollout_is_mean"] = masked_mean(weights, mask)
        m["rollout_is_ratio_fraction_high"] = (level_log_ratio > math.log(upper)).float().mean()
        m["rollout_is_ratio_fraction_low"] = (level_log_ratio < math.log(lower)).float().mean()
    else:
        m["rollout_is_mean"] = masked_mean(weights, mask)
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).float(), mask)
        m["rollout_is_max"] = masked_max(weights, mask)
        m["rollout_is_min"] = masked_min(weights, mask)
    m["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    clamped = weights.clamp(min=0.0, max=upper)
    normalized = clamped / (masked_mean(clamped, mask) + 1e-8)
    # every weight 0 (IcePop rejecting all): no effective sample, 0 (verl divides by 0 and raises)
    second_moment = masked_mean(normalized.square(), mask)
    m["rollout_is_eff_sample_size"] = torch.where(second_moment > 0, 1.0 / second_moment, 0.0)
    row_means = masked_mean(weights, mask, dim=-1)  # every row, an empty one's 0
    m["rollout_is_seq_mean"] = row_means.mean()
    m["rollout_is_seq_std"] = _std(row_means)
    m["rollout_is_seq_max"] = row_means.max()
    m["rollout_is_seq_min"] = row_means.min()
    m["rollout_is_seq_max_deviation"] = (row_means - 1.0).abs().max()
    raw_row_means = masked_mean(raw, mask, dim=-1)  # before truncation: a capped mean never exceeds the cap
    m["rollout_is_seq_fraction_high"] = (raw_row_means > upper).float().mean()
    m["rollout_is_seq_fraction_low"] = (raw_row_means < lower).float().mean()
    return m


# --- rejection -------------------------------------------------------------------------------

def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's rejection sampling: the response mask without the tokens (or rows) whose
    divergence between the trainer and the rollout leaves its bounds.

    With ``l`` the log-ratio (trainer over rollout) clamped at +-20, the estimates of
    KL(rollout || trainer) per token are ``k1 = -l``, ``k2 = l^2 / 2``, ``k3 = e^l - 1 - l``
    (:func:`~torchforge.kl.approx_kl`, k3 unbounded); an option ``token_k*`` tests each
    token, ``seq_sum_k*`` / ``seq_mean_k*`` / ``seq_max_k*`` the row's sum, mean or max over
    counted tokens and keeps or drops the row whole. k1 is kept inside
    ``[log lower, log upper]``, k2 and k3 at most ``upper``. Every option must pass.

    Args:
        log_ratio: [B, T] float ``log pi_train - log pi_rollout``.
        response_mask: [B, T] 0/1 mask counting at least one token.
        rollout_rs: comma-separated options of ``SUPPORTED_ROLLOUT_RS_OPTIONS``.
        rollout_rs_threshold: one threshold shared, or one per option (comma-separated);
            ``"lower_upper"`` ratio bounds for k1 (a single ``u``: ``1/u`` to ``u``).

    Returns:
        ``(modified_response_mask, metrics)``: ``response_mask`` (its dtype) with the
        rejected tokens 0; verl's ``rollout_rs_*`` metrics (floats).

    Example:
        >>> import torch
        >>> log_ratio = torch.tensor([[0.0, 1.0, -0.1]])
        >>> compute_rollout_rejection_mask(log_ratio, torch.ones(1, 3), "token_k2", 0.1)[0]   # l^2/2: 0, .5, .005
        tensor([[1., 0., 1.]])
    """
    fn = _PREFIX + "compute_rollout_rejection_mask"
    log_ratio, mask = _inputs(fn, log_ratio, response_mask)
    keep, metrics = _rejection(fn, log_ratio, mask, rollout_rs, rollout_rs_threshold)
    return _masked_response(response_mask, keep), _floats(metrics)


def _masked_response(response_mask: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``response_mask`` (a copy, its dtype) with the tokens ``keep`` rejects set to 0."""
    if keep is None:
        return response_mask.clone()
    return torch.where(keep, response_mask, torch.zeros_like(response_mask))


def _rejection(fn, log_ratio, mask, rollout_rs, rollout_rs_threshold):
    """The [B, T] bool keep of every option and the metrics (tensors), from :func:`_inputs`'
    log-ratio and bool mask."""
    options = _rs_options(fn, rollout_rs)
    if rollout_rs_threshold is None:
        raise InvalidArgumentError(f"{fn}: rollout_rs={rollout_rs!r} needs rollout_rs_threshold, got None")
    thresholds = _rs_thresholds(fn, options, rollout_rs_threshold)
    safe = log_ratio.float().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    trainer = torch.zeros_like(safe)
    # approx_kl(log_probs, ref): KL(log_probs' policy || ref's) = KL(rollout || trainer) here;
    # only the estimators the options read
    token_kl = {k: approx_kl(trainer - safe, trainer, estimator=k, max_ratio=math.inf)
                for k in dict.fromkeys(option[-2:] for option in options)}
    rows = mask.any(-1)
    keep = torch.ones_like(mask)
    metrics = {}
    for option in options:
        lower, upper = thresholds[option]
        k1 = option.endswith("k1")
        low, high = (math.log(lower), math.log(upper)) if k1 else (None, upper)
        per_token = token_kl[option[-2:]]
        if option.startswith("token"):
            stat, per_row = per_token, None
        else:
            if option.startswith("seq_sum"):
                per_row = masked_sum(per_token, mask, dim=-1)
            elif option.startswith("seq_mean"):
                per_row = masked_mean(per_token, mask, dim=-1)
            else:
                per_row = masked_max(per_token, mask, dim=-1)
            stat = per_row.unsqueeze(-1).expand_as(per_token)
        passes = (stat <= high) & (stat >= low) if k1 else stat <= high
        keep = keep & passes
        metrics.update(_rs_metrics(option, stat, mask, rows, "token" if per_row is None else "sequence", per_row,
                                   high, low if k1 else 0.0, k1))
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean((~passes).float(), mask)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = masked_mean((mask & ~passes).any(-1).float(), rows)
    metrics["rollout_rs_masked_fraction"] = masked_mean((~keep).float(), mask)
    metrics["rollout_rs_seq_masked_fraction"] = (mask & ~keep).any(-1).float().mean()  # over every row, as verl
    return keep, metrics


def compute_rs_metrics(
    option_name: str,
    rs_statistic: torch.Tensor,
    response_mask: torch.Tensor,
    seq_valid_mask: torch.Tensor,
    *,
    level: str,
    per_sequence_values: torch.Tensor | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> dict[str, float]:
    """verl's diagnostics of one rejection option: the statistic's mean, max, min, the
    fractions beyond the thresholds, its std clamped to them, and per-row statistics.

    Args:
        option_name: the ``rollout_rs`` option, for the metric names.
        rs_statistic: [B, T] the per-token statistic (a row's broadcast for a sequence option).
        response_mask: [B, T] 0/1 mask counting at least one token.
        seq_valid_mask: [B] bool, the rows with a counted token.
        level: ``"token"`` or ``"sequence"``.
        per_sequence_values: [B] the rows' statistic, or None (then the rows' means).
        rollout_rs_threshold: the upper threshold (log of the ratio bound for k1).
        rollout_rs_threshold_lower: the lower one (read where ``apply_lower_threshold``).
        apply_lower_threshold: whether the lower threshold applies (k1 options).

    Returns:
        ``{f"rollout_rs_{option_name}_mean": ..., ...}``: floats.

    Example:
        >>> import torch
        >>> stat = torch.tensor([[0.0, 0.5]])
        >>> compute_rs_metrics("token_k2", stat, torch.ones(1, 2), torch.tensor([True]), level="token",
        ...                    per_sequence_values=None, rollout_rs_threshold=0.1, rollout_rs_threshold_lower=0.0,
        ...                    apply_lower_threshold=False)["rollout_rs_token_k2_fraction_high"]
        0.5
    """
    fn = _PREFIX + "compute_rs_metrics"
    if level not in ("token", "sequence"):
        raise InvalidArgumentError(f"{fn}: level is {level!r}; expected 'token' or 'sequence'")
    stat, mask = _inputs(fn, rs_statistic, response_mask, "rs_statistic")
    per_row = None if per_sequence_values is None else per_sequence_values.detach().float().reshape(-1)
    return _floats(_rs_metrics(option_name, stat.float(), mask, seq_valid_mask.bool(), level,
                               per_row, rollout_rs_threshold, rollout_rs_threshold_lower, apply_lower_threshold))


def _rs_metrics(option, stat, mask, rows, level, per_row, high, low, apply_low) -> dict[str, torch.Tensor]:
    prefix = f"rollout_rs_{option}"
    valid = (masked_mean(stat, mask, dim=-1) if per_row is None else per_row)[rows]
    m = {f"{prefix}_mean": masked_mean(stat, mask)}
    zero = stat.new_zeros((), dtype=torch.float32)
    if level == "sequence":
        m[f"{prefix}_max"], m[f"{prefix}_min"] = valid.max(), valid.min()
        m[f"{prefix}_fraction_high"] = (valid > high).float().mean()
        m[f"{prefix}_fraction_low"] = (valid < low).float().mean() if apply_low else zero
    else:
        m[f"{prefix}_max"], m[f"{prefix}_min"] = masked_max(stat, mask), masked_min(stat, mask)
        m[f"{prefix}_fraction_high"] = masked_mean((stat > high).float(), mask)
        m[f"{prefix}_fraction_low"] = masked_mean((stat < low).float(), mask) if apply_low else zero
    m[f"{prefix}_std"] = _clamped_std(stat, mask, low if apply_low else 0.0, high)
    m[f"{prefix}_seq_mean"] = valid.mean()
    m[f"{prefix}_seq_std"] = _std(valid)
    m[f"{prefix}_seq_max"] = valid.max()
    m[f"{prefix}_seq_min"] = valid.min()
    m[f"{prefix}_seq_max_deviation"] = valid.abs().max()
    m[f"{prefix}_seq_fraction_high"] = (valid > high).float().mean()
    if apply_low:
        m[f"{prefix}_seq_fraction_low"] = (valid < low).float().mean()
    return m


# --- the pipeline and its diagnostics --------------------------------------------------------

def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[RolloutISWeights | None, torch.Tensor, dict[str, float]]:
    """verl's rollout correction in one call: IS weights, rejection mask and off-policy metrics.

    ``log_ratio = old_log_prob - rollout_log_prob``; the weights of
    :func:`compute_rollout_correction_weights` where ``rollout_is`` and
    ``rollout_is_threshold`` are set, the mask of :func:`compute_rollout_rejection_mask`
    where ``rollout_rs`` is, and :func:`compute_offpolicy_metrics`, every metric prefixed
    ``rollout_corr/``.

    Args:
        old_log_prob: [B, T] float log pi_train (the current policy in bypass mode).
        rollout_log_prob: [B, T] float log pi_rollout.
        response_mask: [B, T] 0/1 mask counting at least one token.
        rollout_is, rollout_is_threshold, rollout_is_batch_normalize: as in
            :func:`compute_rollout_correction_weights` (``rollout_is=None``: no weights).
        rollout_rs, rollout_rs_threshold: as in :func:`compute_rollout_rejection_mask`
            (``rollout_rs=None``: no rejection).

    Returns:
        ``(weights, modified_response_mask, metrics)``: the weights under
        ``weights.batch["rollout_is_weights"]`` (None without ``rollout_is``), the mask
        (``response_mask``'s dtype), the metrics (floats).

    Example:
        >>> import torch
        >>> old, rollout = torch.log(torch.tensor([[0.6, 0.3]])), torch.log(torch.tensor([[0.2, 0.3]]))
        >>> weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        ...     old, rollout, torch.ones(1, 2), rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold=2.0)
        >>> weights.batch["rollout_is_weights"], mask        # ratios 3 (capped at 2) and 1; 3 leaves [1/2, 2]
        (tensor([[2., 1.]]), tensor([[0., 1.]]))
    """
    fn = _PREFIX + "compute_rollout_correction_and_rejection_mask"
    old, mask = _inputs(fn, old_log_prob, response_mask, "old_log_prob")
    check_same_shape(fn, "rollout_log_prob", rollout_log_prob, "old_log_prob", old_log_prob)
    rollout = rollout_log_prob.detach()
    log_ratio = old - rollout
    metrics = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = _is_weights(fn, log_ratio, mask, rollout_is, rollout_is_threshold,
                                          rollout_is_batch_normalize)
        metrics.update(is_metrics)
    keep = None
    if rollout_rs is not None:
        keep, rs_metrics = _rejection(fn, log_ratio, mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(_offpolicy_metrics(old, rollout, mask))
    metrics = {f"rollout_corr/{k}": v for k, v in _floats(metrics).items()}
    return (None if weights is None else RolloutISWeights(weights)), _masked_response(response_mask, keep), metrics


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """verl's off-policy diagnostics between the trainer's and the rollout's log-probs.

    Over every row (an empty row's mean log-prob is 0): ``training_ppl`` (the rows' mean of
    ``exp(-mean_t old_log_prob)``), ``training_log_ppl``; with ``rollout_log_prob``:
    ``kl`` (mean of ``rollout - old``, k1 of KL(rollout || trainer)), ``k3_kl`` (unbounded
    k3), ``rollout_ppl``, ``rollout_log_ppl``, ``log_ppl_diff`` (mean, mean abs, max, min
    of the rows' ``mean rollout - mean old``), ``ppl_ratio``, ``chi2_token`` (``E[rho^2] - 1``
    with rho's log clamped at +-20) and ``chi2_seq`` (the rows' ``prod rho``, likewise).

    Args:
        old_log_prob: [B, T] float log pi_train.
        rollout_log_prob: [B, T] float log pi_rollout, or None (the training metrics only).
        response_mask: [B, T] 0/1 mask counting at least one token.

    Returns:
        The metrics without prefix (floats).

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.5, 0.5]]))
        >>> round(compute_offpolicy_metrics(lp, lp, torch.ones(1, 2))["training_ppl"], 4)
        2.0
    """
    fn = _PREFIX + "compute_offpolicy_metrics"
    return _floats(_offpolicy_metrics(*_log_probs(fn, old_log_prob, rollout_log_prob, response_mask)))


def _row_mean_float64(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean log-prob over its counted tokens (0 for an empty row), in float64:
    the perplexities exponentiate it, and exp turns float32's rounding of a mean of -30
    into 2e-6 of relative error."""
    return torch.where(mask, log_probs.double(), 0.0).sum(-1) / mask.sum(-1).clamp(min=1)


def _log_probs(fn, old_log_prob, rollout_log_prob, response_mask):
    """``(old, rollout, mask)`` checked: the detached log-probs (rollout None stays None) and the bool mask."""
    old, mask = _inputs(fn, old_log_prob, response_mask, "old_log_prob")
    if rollout_log_prob is None:
        return old, None, mask
    check_same_shape(fn, "rollout_log_prob", rollout_log_prob, "old_log_prob", old_log_prob)
    return old, rollout_log_prob.detach(), mask


def _offpolicy_metrics(old, rollout, mask) -> dict[str, torch.Tensor]:
    """The metrics (tensors) of :func:`compute_offpolicy_metrics`, from :func:`_log_probs`' checked inputs."""
    old_mean = _row_mean_float64(old, mask)
    m = {"training_ppl": (-old_mean).exp().mean(), "training_log_ppl": (-old_mean).mean()}
    if rollout is None:
        return m
    log_ratio = torch.where(mask, old.float() - rollout.float(), 0.0)
    m["kl"] = masked_mean(-log_ratio, mask)
    m["k3_kl"] = masked_mean(approx_kl(-log_ratio, torch.zeros_like(log_ratio), estimator="k3", max_ratio=math.inf),
                             mask)
    rollout_mean = _row_mean_float64(rollout, mask)
    m["rollout_ppl"] = (-rollout_mean).exp().mean()
    m["rollout_log_ppl"] = (-rollout_mean).mean()
    log_ppl_diff = rollout_mean - old_mean
    m["log_ppl_diff"] = log_ppl_diff.mean()
    m["log_ppl_abs_diff"] = log_ppl_diff.abs().mean()
    m["log_ppl_diff_max"] = log_ppl_diff.max()
    m["log_ppl_diff_min"] = log_ppl_diff.min()
    m["ppl_ratio"] = log_ppl_diff.exp().mean()
    m["chi2_token"] = masked_mean((2 * log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp(), mask) - 1.0
    row_log_ratio = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (2 * row_log_ratio).exp().mean() - 1.0
    return m


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """verl's actor-side diagnostics: :func:`compute_offpolicy_metrics` of the current
    policy against the rollout, prefixed ``rollout_corr/``.

    Args:
        log_prob: [B, T] float log pi (current).
        rollout_log_prob: [B, T] float log pi_rollout.
        response_mask: [B, T] 0/1 mask counting at least one token.

    Returns:
        ``{"rollout_corr/kl": ..., ...}``: floats.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.5, 0.5]]))
        >>> compute_rollout_corr_metrics_from_logprobs(lp, lp, torch.ones(1, 2))["rollout_corr/kl"]
        0.0
    """
    fn = _PREFIX + "compute_rollout_corr_metrics_from_logprobs"
    metrics = _floats(_offpolicy_metrics(*_log_probs(fn, log_prob, rollout_log_prob, response_mask)))
    return {f"rollout_corr/{k}": v for k, v in metrics.items()}


def _field(config, name: str, default):
    """``config``'s ``name`` as verl's ``config.get(name, default)``: unlike ``_option``, an
    explicit None stays None (``rollout_is_threshold=None`` turns the weights off)."""
    return config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
