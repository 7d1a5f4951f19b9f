"""Policy and value losses: importance ratios, clipped surrogates, value regression.

Every loss returns ``(loss, metrics)``: a float32 scalar, and a dict of detached float32
scalar tensors (no ``.item()``, so the losses compile with ``torch.compile(fullgraph=True)``
and never force a device sync). The loss is reduced by the ``aggregation`` argument;
the metrics are reduced over *this* call's counted tokens by the same reducer
(:mod:`torchforge.reduce`): masked means, except ``ratio_max`` (a masked max) and
``ratio_min`` (a masked min), which must be combined over micro-batches and ranks with a
max / min, not a mean.

``aggregation`` is the same in every loss: a mode name (``"token-mean"``,
``"seq-mean-token-mean"``, ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``) or an
:class:`~torchforge.reduce.Aggregation` carrying the global token / sequence counts and the
data-parallel size; see :func:`~torchforge.reduce.aggregate` for what each mode means and
how the counts make the loss exact across micro-batches and ranks.

Numerics: float32 maths whatever the input dtype; positions where ``mask`` is False never
reach the loss, the metrics or the gradient (a NaN there does not leak); an empty mask,
or a batch with no rows or no tokens (B = 0, T = 0), gives a loss of 0 with zero gradient
and finite metrics.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    ShapeError,
    check_choice,
    check_float,
    check_mask,
    check_non_negative,
    check_positive,
    check_same_shape,
    check_tensor,
    shape_str,
)
from torchforge.kl import KL_ESTIMATORS, KL_GRADIENTS, _estimate
from torchforge.reduce import (
    Aggregation,
    masked_mean,
    masked_sum,
)

__all__ = [
    "RATIO_LEVELS",
    "cispo_loss",
    "clip_cov_loss",
    "gmpo_loss",
    "grpo_loss",
    "kl_cov_loss",
    "policy_ratio",
    "ppo_loss",
    "reinforce_loss",
    "sapo_loss",
    "value_loss",
]

RATIO_LEVELS = ("token", "sequence")


# --- checks -----------------------------------------------------------------------------

def _check_log_probs(fn: str, log_probs, mask, **others) -> None:
    """``log_probs`` a float [B, T]; ``mask`` bool [B, T]; every tensor in ``others`` float [B, T]."""
    check_tensor(fn, "log_probs", log_probs, ndim=2)
    check_float(fn, "log_probs", log_probs)
    check_mask(fn, mask, "log_probs", log_probs)
    for name, x in others.items():
        check_same_shape(fn, name, x, "log_probs", log_probs)
        check_float(fn, name, x)


def _per_token(fn: str, name: str, x, log_probs: torch.Tensor) -> torch.Tensor:
    """``x`` of shape [B] (returned as [B, 1], broadcast over T on purpose) or [B, T],
    detached float32.

    A NaN in ``x`` where nothing is counted reaches neither the loss (``aggregate`` drops
    those positions) nor the gradient: every loss multiplies ``x`` into a term whose
    input, the log-ratio or the log-prob, is a ``where`` on the mask, whose backward
    zeroes those positions."""
    check_tensor(fn, name, x)
    check_float(fn, name, x)
    B, T = log_probs.shape
    if x.dim() == 1 and x.shape[0] == B:
        return x.detach().float().unsqueeze(-1)
    if x.shape != log_probs.shape:
        raise ShapeError(
            f"{fn}: {name} has shape {shape_str(x)} but log_probs has shape {shape_str(log_probs)}; "
            f"expected ({B},) or ({B}, {T})"
        )
    return x.detach().float()


def _check_clip(fn: str, clip_low, clip_high, dual_clip=None) -> float:
    """Validate the clip options; return ``clip_high`` (defaulting to ``clip_low``)."""
    if not 0 <= clip_low <= 1:
        raise InvalidArgumentError(f"{fn}: clip_low must be in [0, 1], got {clip_low}")
    clip_high = clip_low if clip_high is None else clip_high
    check_non_negative(fn, "clip_high", clip_high)
    if dual_clip is not None and not dual_clip > 1:
        raise InvalidArgumentError(
            f"{fn}: dual_clip must be > 1 (the cap is dual_clip * |advantages|), got {dual_clip}"
        )
    return clip_high


def _aggregate(fn: str, per_token: torch.Tensor, mask: torch.Tensor, aggregation, count=None) -> torch.Tensor:
    """``aggregate(per_token, mask, **aggregation)``, its errors naming the loss ``fn``.

    ``count``: this call's token count ``mask.sum()`` when the loss has it already; a
    mode name without global counts then reuses it instead of counting again."""
    aggregation = Aggregation.of(aggregation)
    if count is not None and aggregation.num_tokens is None and aggregation.dp_size == 1:
        aggregation = dataclasses.replace(aggregation, num_tokens=count)
    try:
        return aggregation(per_token, mask)
    except (InvalidArgumentError, ShapeError) as error:
        raise type(error)(str(error).replace("aggregate: ", f"{fn}: aggregation ", 1)) from None


def _masked_log_ratio(log_probs, old_log_probs, mask) -> torch.Tensor:
    """``log_probs - old_log_probs`` in float32, exactly 0 where ``mask`` is False.

    ``torch.where`` (not a product with the mask) also zeroes the *gradient* there, so a
    NaN at a masked position reaches neither the loss nor ``log_probs.grad``.
    """
    return torch.where(mask, log_probs.float() - old_log_probs.detach().float(), 0.0)


def _clamp_log_ratio(log_ratio: torch.Tensor, max_log_ratio: float) -> torch.Tensor:
    """``clamp(log_ratio, -max_log_ratio, max_log_ratio)``; zero gradient where clamped.

    Written as ``hardtanh`` (the same clamp) because its backward is one elementwise
    kernel where ``torch.clamp``'s is several (bench_losses.py: about 0.1x of the
    minimal PPO formula, eager CPU)."""
    return F.hardtanh(log_ratio, -max_log_ratio, max_log_ratio)


# --- ratios -----------------------------------------------------------------------------

def _sequence_log_ratio(log_ratio, mask) -> torch.Tensor:
    """GSPO-token: ``sg(l_b) + log_ratio - sg(log_ratio)`` with ``l_b`` the masked mean
    log-ratio of row b. The value is ``l_b`` at every position of row b; the gradient
    w.r.t. ``log_probs_bt`` is 1, as in the token case."""
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = log_ratio.detach().sum(-1, keepdim=True) / lengths
    return seq_log_ratio + (log_ratio - log_ratio.detach())


@batch_args
def policy_ratio(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    max_log_ratio: float = 20.0,
) -> torch.Tensor:
    """Importance ratio between the trained policy and the policy that sampled the tokens.

    With ``log_ratio = log_probs - old_log_probs`` (0 where ``mask`` is False):

    - ``level="token"`` (PPO, GRPO): ``ratio = exp(clamp(log_ratio, -max_log_ratio,
      max_log_ratio))``.
    - ``level="sequence"`` (GSPO): ``s_b = exp(clamp(sum_t log_ratio_bt / n_b))`` with
      ``n_b = sum_t mask_bt`` (the geometric mean of the token ratios, length-normalized),
      broadcast over the tokens in GSPO-token form:
      ``ratio_bt = sg(s_b) * exp(log_probs_bt - sg(log_probs_bt))``. Its value is ``s_b``
      at every token; its gradient is ``s_b * grad log_probs_bt``. Averaged over the
      sequence's tokens (``seq-mean-token-mean``, as in the paper) this is exactly the
      gradient of GSPO's sequence objective, ``grad s_b = s_b * mean_t grad log_probs_bt``,
      and it lets a per-token advantage weigh each token.

    Args:
        log_probs: [B, T] float log pi of the sampled tokens (carries grad).
        old_log_probs: [B, T] float log pi_old of the same tokens (detached).
        mask: [B, T] bool, True = the token counts.
        level: ``"token"`` or ``"sequence"``.
        max_log_ratio: clamp on the (token or sequence) log-ratio so that ``exp`` stays
            finite; > 0. Clamped tokens get zero gradient.

    Returns:
        [B, T] float32 ratio; 1 at masked positions (``"token"``), ``s_b`` on every
        position of row b (``"sequence"``; 1 for a row with no counted token).

    Example:
        >>> import torch
        >>> lp = torch.tensor([[0.0, -1.0]]); old = torch.tensor([[-1.0, -1.0]])
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> policy_ratio(lp, old, mask)                       # exp(1), exp(0)
        tensor([[2.7183, 1.0000]])
        >>> policy_ratio(lp, old, mask, level="sequence")     # exp((1 + 0) / 2)
        tensor([[1.6487, 1.6487]])

    References:
        PPO, https://arxiv.org/abs/1707.06347; GSPO (sequence ratio and GSPO-token),
        https://arxiv.org/abs/2507.18071

    Note:
        The clamp at ``max_log_ratio = 20`` is verl's; TRL does not clamp.
    """
    fn = "policy_ratio"
    _check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_choice(fn, "level", level, RATIO_LEVELS)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, mask)
    if level == "sequence":
        log_ratio = _sequence_log_ratio(log_ratio, mask)
    return torch.exp(_clamp_log_ratio(log_ratio, max_log_ratio))


def _ratio_metrics(log_ratio, ratio, mask, count, max_log_ratio: float, *, token_ratio=None) -> dict[str, torch.Tensor]:
    """``approx_kl``, ``ratio_mean``, ``ratio_min``, ``ratio_max`` over the ``count``
    counted tokens.

    ``approx_kl`` is the k3 estimate of KL(pi_old || pi) on tokens sampled from pi_old,
    ``mean(exp(log_ratio) - 1 - log_ratio)``, from the *token* log-ratio whatever the
    ratio the loss weighs by (``token_ratio``, its exp, when the caller has it); the
    ratio statistics are those of ``ratio`` ([B, T] or [B, 1]).

    ``log_ratio`` is 0 where ``mask`` is False (:func:`_masked_log_ratio`), so there the
    token ratio is 1 and both ``token_ratio - 1`` and k3 are 0: their plain sums are the
    masked sums, with no ``where`` and no extra pass over the mask.
    """
    weighs_by_token_ratio = ratio is token_ratio
    token_lr = log_ratio.detach().clamp(-max_log_ratio, max_log_ratio)
    token_ratio = torch.exp(token_lr) if token_ratio is None else token_ratio.detach()
    ratio = ratio.detach().expand(mask.shape)
    num = torch.count_nonzero(mask)
    excess = token_ratio - 1                                    # 0 where masked
    ratio_sum = excess.sum() + num if weighs_by_token_ratio else masked_sum(ratio, mask)
    ratio_mean = ratio_sum / count
    k3 = excess.sub_(token_lr)                                  # token_ratio - 1 - token_lr
    # masked min and max with one fill and one aminmax: the positions not counted take the
    # mean of the counted ratios, which lies between their min and max (to within one
    # rounding), so it moves neither extremum.
    filled = torch.where(mask, ratio, ratio_mean)
    ratio_min, ratio_max = torch.aminmax(filled) if filled.numel() else (ratio_mean, ratio_mean)
    counted = num > 0                                           # else 0, as masked_min / max
    return {"approx_kl": k3.sum() / count, "ratio_mean": ratio_mean,
            "ratio_min": torch.where(counted, ratio_min, 0.0), "ratio_max": torch.where(counted, ratio_max, 0.0)}


def _frac(flags: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Fraction of the ``count`` counted tokens where the bool ``flags`` ([B, T] or [B, 1]) hold."""
    return masked_sum(flags.expand(mask.shape).float(), mask) / count


def _frac_by_sign(flags: torch.Tensor, A: torch.Tensor, mask: torch.Tensor, count: torch.Tensor):
    """``(_frac(flags & (A < 0)), _frac(flags & (A > 0)))``; one count per row when ``A`` is [B, 1]."""
    flags = flags & mask
    if A.shape[-1] == 1:
        per_row = torch.count_nonzero(flags, dim=-1)
        A = A.squeeze(-1)
        return (per_row * (A < 0)).sum() / count, (per_row * (A > 0)).sum() / count
    return torch.count_nonzero(flags & (A < 0)) / count, torch.count_nonzero(flags & (A > 0)) / count


# --- the PPO surrogate -----------------------------------------------------------------

def _ppo_per_token(fn, log_probs, old_log_probs, advantages, mask, weights, *,
                   clip_low, clip_high, dual_clip, ratio_level, max_log_ratio):
    """The per-token loss of :func:`ppo_loss` (weights applied), its metrics, the
    token log-ratio (0 where masked), whose ratio the bias-corrected KL of
    :func:`grpo_loss` reuses, and the token count (clamped at 1) the metrics divide by."""
    _check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    clip_high = _check_clip(fn, clip_low, clip_high, dual_clip)
    check_choice(fn, "ratio_level", ratio_level, RATIO_LEVELS)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    A = _per_token(fn, "advantages", advantages, log_probs)

    log_ratio = _masked_log_ratio(log_probs, old_log_probs, mask)
    weighing_log_ratio = _sequence_log_ratio(log_ratio, mask) if ratio_level == "sequence" else log_ratio
    ratio = torch.exp(_clamp_log_ratio(weighing_log_ratio, max_log_ratio))
    pg_loss1 = -A * ratio
    pg_loss2 = -A * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)
    if dual_clip is not None:
        pg_loss3 = -A * dual_clip
        pg_loss = torch.where(A < 0, torch.minimum(pg_loss, pg_loss3), pg_loss)
    if weights is not None:
        pg_loss = pg_loss * _per_token(fn, "weights", weights, log_probs)

    with torch.no_grad():
        # A token is clipped when the clip takes its gradient: ratio < 1 - clip_low with
        # A < 0, ratio > 1 + clip_high with A > 0; the dual clip: ratio > c with A < 0.
        # pg_loss2 > pg_loss1 is exactly "the clip is active" (_frac_by_sign keeps the
        # counted tokens of it).
        count = torch.count_nonzero(mask).clamp(min=1)
        clip_frac_low, clip_frac_high = _frac_by_sign(pg_loss2 > pg_loss1, A, mask, count)
        metrics = {"clip_frac_low": clip_frac_low, "clip_frac_high": clip_frac_high}
        if dual_clip is not None:
            metrics["dual_clip_frac"] = _frac_by_sign(ratio > dual_clip, A, mask, count)[0]
        token_ratio = ratio if ratio_level == "token" else None
        metrics.update(_ratio_metrics(log_ratio, ratio, mask, count, max_log_ratio, token_ratio=token_ratio))
    return pg_loss, metrics, log_ratio, count


@batch_args
def ppo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss, with clip-higher, dual-clip, GSPO ratios and IS weights.

    With ``log_ratio = log_probs - old_log_probs`` (0 where ``mask`` is False),
    ``ratio = exp(clamp(log_ratio, -max_log_ratio, max_log_ratio))`` (GSPO: the row's
    mean log-ratio, see :func:`policy_ratio`) and ``A = advantages``:

    ``pg_loss1 = -A * ratio``, ``pg_loss2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)``,
    ``pg_loss = max(pg_loss1, pg_loss2)``; with ``dual_clip = c``:
    ``pg_loss = min(pg_loss, -c * A)`` where ``A < 0`` (the loss of a negative-advantage
    token is capped at ``c * |A|`` however large its ratio grows). Then
    ``loss = aggregate(weights * pg_loss, mask)``.

    Args:
        log_probs: [B, T] float log pi of the sampled tokens (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] (one per sequence, broadcast over T) or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        weights: optional [B] or [B, T] float per-token weights >= 0 (e.g. truncated
            importance weights from :mod:`torchforge.corrections`); detached.
        clip_low: lower clip ``1 - clip_low``; in [0, 1].
        clip_high: upper clip ``1 + clip_high``; default ``clip_low`` (DAPO's clip-higher
            sets it larger, e.g. 0.28).
        dual_clip: ``c > 1`` caps the loss at ``-c * A`` for ``A < 0``; None disables.
        ratio_level: ``"token"`` (PPO / GRPO) or ``"sequence"`` (GSPO).
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: float32 scalar, and detached float32 scalars over this
        call's counted tokens: ``clip_frac_low`` (ratio < 1 - clip_low and A < 0), ``clip_frac_high``
        (ratio > 1 + clip_high and A > 0): the fractions of counted tokens whose gradient
        the clip takes; ``dual_clip_frac`` (ratio > c and A < 0, when ``dual_clip`` is
        set); ``approx_kl``, the k3 estimate of KL(pi_old || pi) from the token
        log-ratio, ``mean(ratio - 1 - log_ratio)``; ``ratio_mean``; ``ratio_min`` and
        ``ratio_max`` (a masked min / max: combine them over micro-batches and ranks with
        min / max). All 0 on an empty mask.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.6, 0.3]])).requires_grad_()
        >>> old = torch.log(torch.tensor([[0.4, 0.3]]))
        >>> mask = torch.tensor([[True, True]])
        >>> # ratios 1.5 (clipped to 1.2) and 1.0, A = 1: loss = -(1.2 + 1.0) / 2
        >>> loss, metrics = ppo_loss(lp, old, torch.tensor([1.0]), mask)
        >>> loss
        tensor(-1.1000, grad_fn=<DivBackward0>)
        >>> metrics["clip_frac_high"]
        tensor(0.5000)
        >>> # An entropy bonus composes from token_entropy and aggregate:
        >>> from torchforge.log_probs import token_entropy
        >>> from torchforge.reduce import aggregate
        >>> logits = torch.zeros(1, 2, 4, requires_grad=True)     # uniform over 4 tokens
        >>> entropy = aggregate(token_entropy(logits), mask)      # log 4
        >>> total = loss - 0.01 * entropy
        >>> round(entropy.item(), 4)
        1.3863

    References:
        PPO, https://arxiv.org/abs/1707.06347; dual-clip PPO, https://arxiv.org/abs/1912.09729;
        DAPO (clip-higher, token-mean), https://arxiv.org/abs/2503.14476;
        GSPO, https://arxiv.org/abs/2507.18071

    Note:
        ``clip_high`` is the *offset* above 1 (TRL's ``epsilon_high``, verl's
        ``clip_ratio_high``). The log-ratio is clamped at ``max_log_ratio`` before ``exp``
        (verl clamps at 20 too; TRL does not); a clamped token gets zero gradient.
        Metrics are local to this call; the trainer combines them over micro-batches and
        ranks (means weighted by tokens, ``ratio_max`` / ``ratio_min`` by max / min).
    """
    fn = "ppo_loss"
    pg_loss, metrics, _, count = _ppo_per_token(
        fn, log_probs, old_log_probs, advantages, mask, weights, clip_low=clip_low,
        clip_high=clip_high, dual_clip=dual_clip, ratio_level=ratio_level, max_log_ratio=max_log_ratio,
    )
    return _aggregate(fn, pg_loss, mask, aggregation, count), metrics


@batch_args
def grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_log_probs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    *,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_gradient: str = "estimator",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss: the PPO clipped surrogate plus a per-token KL penalty to a reference.

    ``per_token = weights * pg_loss + kl_coef * kl`` with ``pg_loss`` exactly as in
    :func:`ppo_loss` and ``kl = approx_kl(log_probs, ref_log_probs, old_log_probs,
    estimator=kl_estimator, gradient=kl_gradient)``, then ``loss = aggregate(per_token,
    mask)``: both terms are reduced the same way.

    Which KL gradient (on samples of pi; see :func:`~torchforge.kl.approx_kl`):

    ==============================================  ============================  ==============================
    ``kl_estimator``, ``kl_gradient``               gradient in expectation       the same as
    ==============================================  ============================  ==============================
    ``"k3"``, ``"estimator"`` (default)             grad KL(ref || pi)            DeepSeekMath; TRL's default
                                                                                  (``use_bias_correction_kl=False``);
                                                                                  verl ``kl_loss_type="low_var_kl"``
    ``"k3"``, ``"straight-through"``                grad KL(pi || ref)            verl ``kl_loss_type="k3+"``
    ``"k3"``, ``"bias-corrected"``                  grad KL(pi || ref)            TRL ``use_bias_correction_kl=True``
                                                                                  (DeepSeek-V3.2)
    ``"k2"``, ``"estimator"``                       grad KL(pi || ref)            verl ``"mse"`` / ``"k2"``
    ``"k1"``, ``"estimator"``                       0                             verl ``"kl"`` / ``"k1"``
    ==============================================  ============================  ==============================

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        ref_log_probs: [B, T] float log pi_ref; needed only when ``kl_coef > 0``.
        weights: optional [B] or [B, T] float per-token weights on the surrogate; detached.
        kl_coef: weight of the KL term (beta in the paper); >= 0.
        kl_estimator: one of ``KL_ESTIMATORS`` (``"k3"`` as in DeepSeekMath).
        kl_gradient: one of ``KL_GRADIENTS``: ``"estimator"``, ``"straight-through"``,
            ``"bias-corrected"`` (the ratio is the token ratio pi / pi_old, with gradient).
        clip_low, clip_high, dual_clip, ratio_level, max_log_ratio: as in :func:`ppo_loss`.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: the metrics of :func:`ppo_loss` plus ``kl``, the masked mean
        of the (unscaled) KL estimate (0 when ``kl_coef == 0``).

    Example:
        >>> import torch
        >>> lp = torch.zeros(2, 3, requires_grad=True)
        >>> mask = torch.ones(2, 3, dtype=torch.bool)
        >>> loss, metrics = grpo_loss(lp, lp.detach(), torch.tensor([1.0, -1.0]), mask,
        ...                           ref_log_probs=torch.zeros(2, 3), kl_coef=0.1)
        >>> loss.item(), metrics["kl"].item()       # ratios 1: -(1 - 1) / 2, KL(pi, pi) = 0
        (0.0, 0.0)

    References:
        GRPO (DeepSeekMath), https://arxiv.org/abs/2402.03300; k3, J. Schulman,
        http://joschu.net/blog/kl-approx.html; the KL gradients, Tang and Munos,
        https://arxiv.org/abs/2506.09477; DeepSeek-V3.2, https://arxiv.org/abs/2512.02556

    Note:
        ``weights`` multiply the surrogate only, not the KL term (as verl applies
        rollout importance weights). With the original GRPO's per-sequence averaging use
        ``aggregation="seq-mean-token-mean"``; the default ``token-mean`` is DAPO's.
        k3 is bounded at the extremes (see :func:`~torchforge.kl.approx_kl`): verl
        clamps its value at +-10, which leaves no gradient on a token more than about
        2.5 nats below the reference; here the gradient stays, at most 1 in magnitude.
    """
    fn = "grpo_loss"
    check_non_negative(fn, "kl_coef", kl_coef)
    check_choice(fn, "kl_estimator", kl_estimator, KL_ESTIMATORS)
    check_choice(fn, "kl_gradient", kl_gradient, KL_GRADIENTS)
    if kl_coef > 0 and ref_log_probs is None:
        raise InvalidArgumentError(
            f"{fn}: kl_coef={kl_coef} needs ref_log_probs ([B, T] log-probs under the "
            "reference policy); pass them, or kl_coef=0"
        )
    pg_loss, metrics, log_ratio, count = _ppo_per_token(
        fn, log_probs, old_log_probs, advantages, mask, weights, clip_low=clip_low,
        clip_high=clip_high, dual_clip=dual_clip, ratio_level=ratio_level, max_log_ratio=max_log_ratio,
    )
    per_token = pg_loss
    if kl_coef > 0:
        check_same_shape(fn, "ref_log_probs", ref_log_probs, "log_probs", log_probs)
        check_float(fn, "ref_log_probs", ref_log_probs)
        # kl = approx_kl(log_probs, ref_log_probs, old_log_probs=old_log_probs, ...) on the
        # counted tokens; its log-ratio is 0 where masked, so a NaN there reaches nothing.
        kl_log_ratio = torch.where(mask, log_probs.float() - ref_log_probs.detach().float(), 0.0)
        rho = torch.exp(_clamp_log_ratio(log_ratio, max_log_ratio)) if kl_gradient == "bias-corrected" else None
        kl = _estimate(kl_log_ratio, kl_estimator, kl_gradient, 2.0, rho)  # approx_kl's max_ratio
        per_token = per_token + kl_coef * kl
        with torch.no_grad():  # kl is 0 where masked (its log-ratio is): a plain sum
            metrics["kl"] = kl.detach().sum() / count
    else:
        metrics["kl"] = torch.zeros((), device=log_probs.device)
    return _aggregate(fn, per_token, mask, aggregation, count), metrics


@batch_args
def reinforce_loss(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE policy-gradient loss ``-A log pi``.

    ``per_token = -weights * advantages * log_probs``, ``loss = aggregate(per_token, mask)``;
    its gradient is ``-A grad log pi``, the score-function estimator.

    Args:
        log_probs: [B, T] float log pi of the sampled tokens (carries grad).
        advantages: [B] or [B, T] float (returns, or returns minus a baseline); detached.
        mask: [B, T] bool, True = the token counts.
        weights: optional [B] or [B, T] float per-token weights; detached.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``; metrics: ``log_prob_mean``, the masked mean of log pi.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> loss, _ = reinforce_loss(lp, torch.tensor([2.0]), torch.tensor([[True, False]]))
        >>> loss                              # -2 * log(0.5)
        tensor(1.3863)

    References:
        R. J. Williams, "Simple statistical gradient-following algorithms for connectionist
        reinforcement learning" (1992); RLOO for LLMs, https://arxiv.org/abs/2402.14740
    """
    fn = "reinforce_loss"
    _check_log_probs(fn, log_probs, mask)
    A = _per_token(fn, "advantages", advantages, log_probs)
    lp = torch.where(mask, log_probs.float(), 0.0)
    pg_loss = -A * lp
    if weights is not None:
        pg_loss = pg_loss * _per_token(fn, "weights", weights, log_probs)
    with torch.no_grad():
        metrics = {"log_prob_mean": masked_mean(lp, mask)}
    return _aggregate(fn, pg_loss, mask, aggregation), metrics


@batch_args
def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_low: float,
    clip_high: float,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio.

    ``pg_loss = -sg(clamp(ratio, 1 - clip_low, 1 + clip_high)) * A * log_probs`` with
    the token ratio of :func:`policy_ratio`; ``loss = aggregate(weights * pg_loss,
    mask)``. The weight is detached and the gradient flows through ``log_probs``, so a
    clipped token still gets gradient ``-clamp(ratio) * A * grad log pi`` (PPO's clip
    gives it none).

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        weights: optional [B] or [B, T] float per-token weights; detached.
        clip_low: lower bound ``1 - clip_low`` on the weight; in [0, 1] (1 = no lower
            bound, as in MiniMax-M1).
        clip_high: upper bound ``1 + clip_high``; >= 0.
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: ``clip_frac_low`` / ``clip_frac_high`` (fraction of counted
        tokens whose weight was clipped below / above, whatever the sign of A),
        ``approx_kl``, ``ratio_mean``, ``ratio_min``, ``ratio_max`` as in :func:`ppo_loss`.

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.8]])).requires_grad_()
        >>> old = torch.log(torch.tensor([[0.4]]))
        >>> loss, _ = cispo_loss(lp, old, torch.tensor([1.0]), torch.tensor([[True]]),
        ...                      clip_low=1.0, clip_high=0.2)
        >>> loss.backward()
        >>> lp.grad                           # ratio 2 clipped to 1.2: grad = -1.2 * A
        tensor([[-1.2000]])

    References:
        MiniMax-M1, https://arxiv.org/abs/2506.13585
    """
    fn = "cispo_loss"
    _check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    clip_high = _check_clip(fn, clip_low, clip_high)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    A = _per_token(fn, "advantages", advantages, log_probs)

    log_ratio = _masked_log_ratio(log_probs, old_log_probs, mask).detach()
    ratio = torch.exp(_clamp_log_ratio(log_ratio, max_log_ratio))
    lp = torch.where(mask, log_probs.float(), 0.0)
    pg_loss = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * A * lp
    if weights is not None:
        pg_loss = pg_loss * _per_token(fn, "weights", weights, log_probs)

    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        metrics = {
            "clip_frac_low": _frac(ratio < 1 - clip_low, mask, count),
            "clip_frac_high": _frac(ratio > 1 + clip_high, mask, count),
        }
        metrics.update(_ratio_metrics(log_ratio, ratio, mask, count, max_log_ratio, token_ratio=ratio))
    return _aggregate(fn, pg_loss, mask, aggregation, count), metrics


@batch_args
def sapo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: PPO's hard clip replaced by a smooth, temperature-controlled gate.

    With the token ``ratio`` of :func:`policy_ratio`, ``A = advantages`` and
    ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``:

    ``gate = (4 / tau) * sigmoid(tau * (ratio - 1))``, ``pg_loss = -A * gate``,
    ``loss = aggregate(weights * pg_loss, mask)``.

    The gradient is ``-A * w * ratio * grad log pi`` with ``w = 4 s (1 - s)``,
    ``s = sigmoid(tau * (ratio - 1))``: ``w = 1`` on-policy (the plain policy gradient)
    and decays smoothly as the ratio leaves 1, faster for the larger ``tau``.

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        weights: optional [B] or [B, T] float per-token weights; detached.
        tau_pos: gate temperature where ``A > 0``; > 0.
        tau_neg: gate temperature where ``A <= 0``; > 0 (the paper sets it above
            ``tau_pos``: negative-advantage tokens are damped faster).
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: ``gate_weight_mean``, the masked mean of ``w``; ``approx_kl``,
        ``ratio_mean``, ``ratio_min``, ``ratio_max`` as in :func:`ppo_loss`.

    Example:
        >>> import torch
        >>> lp = torch.zeros(1, 2, requires_grad=True)
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> loss, metrics = sapo_loss(lp, lp.detach(), torch.tensor([1.0]), mask)
        >>> loss                              # gate(1) = (4 / tau) / 2 = 2 for tau = 1
        tensor(-2., grad_fn=<DivBackward0>)
        >>> loss.backward(); lp.grad          # on-policy: -A / 2 per token
        tensor([[-0.5000, -0.5000]])

    References:
        SAPO, C. Gao et al., "Soft Adaptive Policy Optimization",
        https://arxiv.org/abs/2511.20347

    Note:
        The defaults ``tau_pos = 1.0``, ``tau_neg = 1.05`` are TRL's. The gate's value
        carries an offset ``2 / tau`` at ratio 1 (so the loss is not 0 on-policy); only
        its gradient matters.
    """
    fn = "sapo_loss"
    _check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_positive(fn, "tau_pos", tau_pos)
    check_positive(fn, "tau_neg", tau_neg)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    A = _per_token(fn, "advantages", advantages, log_probs)

    log_ratio = _masked_log_ratio(log_probs, old_log_probs, mask)
    ratio = torch.exp(_clamp_log_ratio(log_ratio, max_log_ratio))
    tau = torch.where(A > 0, tau_pos, tau_neg)
    gate = (4 / tau) * torch.sigmoid(tau * (ratio - 1))
    pg_loss = -A * gate
    if weights is not None:
        pg_loss = pg_loss * _per_token(fn, "weights", weights, log_probs)

    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        s = torch.sigmoid(tau * (ratio - 1))
        metrics = {"gate_weight_mean": masked_sum((4 * s * (1 - s)).expand(mask.shape), mask) / count}
        metrics.update(_ratio_metrics(log_ratio, ratio, mask, count, max_log_ratio, token_ratio=ratio))
    return _aggregate(fn, pg_loss, mask, aggregation, count), metrics


@batch_args
def gmpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "seq-mean-token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: the geometric mean of the token ratios, clipped token by token in log space.

    With ``log_ratio = log_probs - old_log_probs`` (0 where ``mask`` is False) and
    ``A = advantages``, each token's log-ratio is clipped on the side its advantage
    pushes it (PPO's min, in log space):

    ``clipped = min(log_ratio, clip_high)`` where ``A > 0``, ``max(log_ratio, -clip_low)``
    where ``A < 0`` (0 where ``A == 0``); ``ratio_b = exp(sum_t clipped_bt / n_b)``,
    ``A_b = sum_t A_bt / n_b`` (over the counted tokens), ``pg_loss_b = -A_b * ratio_b``
    at every counted token of row b, ``loss = aggregate(pg_loss, mask)`` (by default
    ``seq-mean-token-mean``: the mean over sequences, as in the paper).

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached. The paper's advantages are per
            sequence; per-token ones are averaged over the row (as verl does).
        mask: [B, T] bool, True = the token counts.
        clip_low: the log-ratio of a token with ``A < 0`` is kept above ``-clip_low``; >= 0.
        clip_high: the log-ratio of a token with ``A > 0`` is kept below ``clip_high``; >= 0.
        max_log_ratio: clamp on the sequence log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: ``clip_frac_low`` / ``clip_frac_high`` (fractions of counted
        tokens clipped with ``A < 0`` / ``A > 0``); ``approx_kl`` from the token log-ratio;
        ``ratio_mean``, ``ratio_min``, ``ratio_max`` of the sequence ratio ``ratio_b``
        (each token counted).

    Example:
        >>> import torch
        >>> lp = torch.tensor([[0.5, 0.1]], requires_grad=True)
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> # A > 0: log-ratios 0.5 -> 0.4 and 0.1; ratio = exp((0.4 + 0.1) / 2)
        >>> loss, _ = gmpo_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), mask)
        >>> loss
        tensor(-1.2840, grad_fn=<DivBackward0>)

    References:
        GMPO, Y. Zhao et al., "Geometric-Mean Policy Optimization",
        https://arxiv.org/abs/2507.20673

    Note:
        The defaults ``clip_low = clip_high = 0.4`` are the paper's range
        ``(e^-0.4, e^0.4)``; the bounds are in log space, unlike ``ppo_loss``'s. verl
        averages the loss over every row (``torch.mean``), empty ones included; the
        default aggregation here counts only rows with a counted token.
    """
    fn = "gmpo_loss"
    _check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_non_negative(fn, "clip_low", clip_low)
    check_non_negative(fn, "clip_high", clip_high)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    A = _per_token(fn, "advantages", advantages, log_probs).expand(mask.shape)

    log_ratio = _masked_log_ratio(log_probs, old_log_probs, mask)
    clipped = torch.where(
        A > 0, log_ratio.clamp(max=clip_high), torch.where(A < 0, log_ratio.clamp(min=-clip_low), 0.0)
    )
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = clipped.sum(-1, keepdim=True) / lengths
    ratio = torch.exp(_clamp_log_ratio(seq_log_ratio, max_log_ratio))
    seq_A = masked_sum(A, mask, dim=-1).unsqueeze(-1) / lengths
    pg_loss = (-seq_A * ratio).expand(mask.shape)

    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        metrics = {
            "clip_frac_low": _frac((log_ratio < -clip_low) & (A < 0), mask, count),
            "clip_frac_high": _frac((log_ratio > clip_high) & (A > 0), mask, count),
        }
        metrics.update(_ratio_metrics(log_ratio, ratio, mask, count, max_log_ratio))
    return _aggregate(fn, pg_loss, mask, aggregation, count), metrics


def _covariance(A, log_probs, mask) -> torch.Tensor:
    """Per-token ``(A - mean A) * (log_probs - mean log_probs)``, means over counted tokens."""
    lp = torch.where(mask, log_probs.detach().float(), 0.0)
    A = A.expand(mask.shape)
    return (A - masked_mean(A, mask)) * (lp - masked_mean(lp, mask))


def _first_k(keys: torch.Tensor, selectable: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Bool [B, T]: the ``k`` selectable positions with the smallest ``keys`` (all of them
    if fewer). ``k`` is a tensor (no device sync); ``k_max >= k`` is known from the shape,
    so one ``topk`` of ``k_max`` does it."""
    keys = torch.where(selectable, keys, torch.inf).flatten()
    k_max = min(k_max, keys.numel())
    index = torch.topk(keys, k_max, largest=False, sorted=True).indices
    chosen = torch.zeros_like(keys, dtype=torch.bool)
    chosen[index] = torch.arange(k_max, device=keys.device) < k
    return selectable & chosen.view(selectable.shape)


def _selection_count(fn, select_frac, mask) -> tuple[torch.Tensor, int]:
    """``k = max(floor(select_frac * N), 1)`` with N the counted tokens (a tensor: no
    sync), and its bound from the shape, ``max(floor(select_frac * B * T), 1)``."""
    if not 0 < select_frac <= 1:
        raise InvalidArgumentError(f"{fn}: select_frac must be in (0, 1], got {select_frac}")
    return torch.floor(select_frac * mask.sum()).clamp(min=1), max(int(select_frac * mask.numel()), 1)


@batch_args
def clip_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    select_frac: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    generator: torch.Generator | None = None,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: the PPO loss, with the gradient of a few high-covariance tokens detached.

    With ``pg_loss`` the clipped surrogate of :func:`ppo_loss` and, over the counted
    tokens, ``cov_t = (A_t - mean(A)) * (log_probs_t - mean(log_probs))`` (the token's
    contribution to the covariance that drives entropy collapse):

    the candidates are the counted tokens not already clipped by PPO with
    ``cov_low < cov_t < cov_high``; ``k = max(floor(select_frac * N), 1)`` of them (N the
    counted tokens) are drawn uniformly at random; ``pg_loss_t = sg(pg_loss_t)`` at the
    drawn tokens (no gradient), ``loss = aggregate(pg_loss, mask)``.

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        clip_low, clip_high: the PPO clip, as in :func:`ppo_loss`.
        select_frac: the fraction r of counted tokens whose gradient is detached; in (0, 1].
        cov_low, cov_high: the covariance band the detached tokens are drawn from;
            ``cov_low < cov_high``.
        generator: the ``torch.Generator`` of the random draw (on the device of
            ``log_probs``); None uses the global one.
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: ``cov_clip_frac``, the fraction of counted tokens detached;
        ``clip_frac_low``, ``clip_frac_high``, ``approx_kl``, ``ratio_mean``,
        ``ratio_min``, ``ratio_max`` as in :func:`ppo_loss`.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -3.0, -5.0, -7.0]], requires_grad=True)
        >>> A = torch.tensor([[2.0, 1.0, -1.0, -2.0]]); mask = torch.ones(1, 4, dtype=torch.bool)
        >>> # cov = (A - 0) * (lp + 4) = [6, 1, 1, 6]; in (1, 7): the two with cov 6;
        >>> # k = floor(0.5 * 4) = 2 of them are detached
        >>> loss, m = clip_cov_loss(lp, lp.detach(), A, mask, select_frac=0.5, cov_high=7.0)
        >>> m["cov_clip_frac"]
        tensor(0.5000)

    References:
        G. Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
        Language Models", https://arxiv.org/abs/2505.22617

    Note:
        Defaults (r = 2e-4, band (1, 5)) are the paper's and verl's. The covariance uses
        the means of this call's counted tokens, as verl does (not global ones). verl
        multiplies the drawn tokens' loss by 0; the paper detaches their gradient, as
        here: the gradient is the same, the loss value keeps their term.
    """
    fn = "clip_cov_loss"
    pg_loss, metrics, log_ratio, count = _ppo_per_token(
        fn, log_probs, old_log_probs, advantages, mask, None, clip_low=clip_low,
        clip_high=clip_high, dual_clip=None, ratio_level="token", max_log_ratio=max_log_ratio,
    )
    if not cov_low < cov_high:
        raise InvalidArgumentError(f"{fn}: cov_low must be < cov_high, got cov_low={cov_low}, cov_high={cov_high}")
    k, k_max = _selection_count(fn, select_frac, mask)
    with torch.no_grad():
        A = _per_token(fn, "advantages", advantages, log_probs)
        cov = _covariance(A, log_probs, mask)
        clip_high = clip_low if clip_high is None else clip_high
        ratio = torch.exp(_clamp_log_ratio(log_ratio.detach(), max_log_ratio))
        clipped = ((ratio < 1 - clip_low) & (A < 0)) | ((ratio > 1 + clip_high) & (A > 0))
        candidates = mask & ~clipped & (cov > cov_low) & (cov < cov_high)
        draw = torch.rand(mask.shape, generator=generator, device=log_probs.device)
        detached = _first_k(draw, candidates, k, k_max)
        metrics["cov_clip_frac"] = _frac(detached, mask, count)
    pg_loss = torch.where(detached, pg_loss.detach(), pg_loss)
    return _aggregate(fn, pg_loss, mask, aggregation, count), metrics


@batch_args
def kl_cov_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    select_frac: float = 2e-4,
    kl_coef: float = 1.0,
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: the unclipped surrogate, with a KL penalty on the highest-covariance tokens.

    With the token ``ratio`` and ``log_ratio`` of :func:`policy_ratio` and, over the
    counted tokens, ``cov_t = (A_t - mean(A)) * (log_probs_t - mean(log_probs))``:

    the ``k = max(floor(select_frac * N), 1)`` counted tokens of largest ``cov_t`` (N the
    counted tokens) are selected; ``pg_loss = -A * ratio + kl_coef * |log_ratio| *
    selected``, ``loss = aggregate(pg_loss, mask)``. No clip: the penalty replaces it.

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        select_frac: the fraction k of counted tokens penalized; in (0, 1].
        kl_coef: the penalty's weight (beta in the paper); >= 0.
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: ``kl_cov_frac``, the fraction of counted tokens penalized;
        ``kl_abs``, the masked mean of ``|log_ratio|``; ``approx_kl``, ``ratio_mean``,
        ``ratio_min``, ``ratio_max`` as in :func:`ppo_loss`.

    Example:
        >>> import torch
        >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.5, -2.0]]); mask = torch.ones(1, 2, dtype=torch.bool)
        >>> # cov = (A - 0) * (lp + 1.5) = [0.5, 0.5]; k = 1: a tie, topk takes the first
        >>> loss, m = kl_cov_loss(lp, old, torch.tensor([[1.0, -1.0]]), mask, select_frac=0.5)
        >>> loss                              # (-e^0.5 + |0.5| + 1) / 2
        tensor(-0.0744, grad_fn=<DivBackward0>)

    References:
        G. Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
        Language Models", https://arxiv.org/abs/2505.22617

    Note:
        Defaults (k = 2e-4, beta = 1) are verl's. The covariance uses the means of this
        call's counted tokens, as verl does. Ties in ``cov`` are broken by ``torch.topk``,
        as in verl (on CPU, the earlier position).
    """
    fn = "kl_cov_loss"
    _check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_non_negative(fn, "kl_coef", kl_coef)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    k, k_max = _selection_count(fn, select_frac, mask)
    A = _per_token(fn, "advantages", advantages, log_probs)

    log_ratio = _masked_log_ratio(log_probs, old_log_probs, mask)
    ratio = torch.exp(_clamp_log_ratio(log_ratio, max_log_ratio))
    with torch.no_grad():
        selected = _first_k(-_covariance(A, log_probs, mask), mask, k, k_max)
    pg_loss = -A * ratio + torch.where(selected, kl_coef * log_ratio.abs(), 0.0)

    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        metrics = {"kl_cov_frac": _frac(selected, mask, count), "kl_abs": masked_sum(log_ratio.abs(), mask) / count}
        metrics.update(_ratio_metrics(log_ratio, ratio, mask, count, max_log_ratio, token_ratio=ratio))
    return _aggregate(fn, pg_loss, mask, aggregation, count), metrics


@batch_args
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value-function loss of PPO.

    ``values_clipped = old_values + clamp(values - old_values, -clip, clip)``,
    ``per_token = 0.5 * max((values - returns)**2, (values_clipped - returns)**2)``
    (``0.5 * (values - returns)**2`` with ``clip=None``), ``loss = aggregate(per_token,
    mask)``.

    Args:
        values: [B, T] float critic outputs (carry grad).
        old_values: [B, T] float critic outputs at sampling time (detached).
        returns: [B, T] float regression targets (detached).
        mask: [B, T] bool, True = the token counts.
        clip: the clip range eps (absolute, in value units); >= 0; None = unclipped.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``; metrics: ``clip_frac``, the fraction of counted tokens where
        the clipped term is the larger one (its gradient is 0 there).

    Example:
        >>> import torch
        >>> v = torch.tensor([[1.0, 0.5]]); mask = torch.ones(1, 2, dtype=torch.bool)
        >>> # token 1: v moved 1.0 from v_old = 0 and is clipped to 0.2: 0.5 * (0.2 - 2)^2
        >>> loss, metrics = value_loss(v, torch.tensor([[0.0, 0.5]]), torch.tensor([[2.0, 0.5]]), mask)
        >>> loss, metrics["clip_frac"]        # (1.62 + 0) / 2
        (tensor(0.8100), tensor(0.5000))

    References:
        PPO, https://arxiv.org/abs/1707.06347; the clipped value loss of OpenAI baselines,
        discussed in https://arxiv.org/abs/2005.12729

    Note:
        ``clip`` is absolute, as in verl's ``cliprange_value`` and TRL's ``cliprange_value``.
    """
    fn = "value_loss"
    check_tensor(fn, "values", values, ndim=2)
    check_float(fn, "values", values)
    check_mask(fn, mask, "values", values)
    for name, x in (("old_values", old_values), ("returns", returns)):
        check_same_shape(fn, name, x, "values", values)
        check_float(fn, name, x)
    if clip is not None:
        check_non_negative(fn, "clip", clip)
    # error = values - returns and old_error = old_values - returns, 0 where masked (where
    # also keeps a NaN there out of the gradient); values - old_values = error - old_error.
    returns = returns.detach().float()
    error = torch.where(mask, values.float() - returns, 0.0)
    if clip is None:
        per_token = 0.5 * error**2
        metrics = {"clip_frac": torch.zeros((), device=values.device)}
    else:
        old_error = torch.where(mask, old_values.detach().float() - returns, 0.0)
        loss1 = error**2
        loss2 = (old_error + (error - old_error).clamp(-clip, clip)) ** 2
        per_token = 0.5 * torch.maximum(loss1, loss2)
        with torch.no_grad():
            metrics = {"clip_frac": _frac(loss2 > loss1, mask, mask.sum().clamp(min=1))}
    return _aggregate(fn, per_token, mask, aggregation), metrics
