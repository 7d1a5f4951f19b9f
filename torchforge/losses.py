"""Policy losses of the PPO family: the clipped surrogate (PPO, GRPO) and REINFORCE.

Every loss returns ``(loss, metrics)``: a float32 scalar, and a dict of detached float32
scalar tensors (no ``.item()``, so the losses compile with ``torch.compile(fullgraph=True)``
and never force a device sync). The loss is reduced by the ``aggregation`` argument;
the metrics are reduced over *this* call's counted tokens: means, except ``ratio_max`` (a
masked max) and ``ratio_min`` (a masked min), which must be combined over micro-batches and
ranks with a max / min, not a mean.

``aggregation`` is the same in every loss: a mode name (``"token-mean"``,
``"seq-mean-token-mean"``, ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``) or an
:class:`~torchforge.reduce.Aggregation` carrying the global token / sequence counts and the
data-parallel size; see :func:`~torchforge.reduce.aggregate` for what each mode means and
how the counts make the loss exact across micro-batches and ranks.

The per-token surrogate they share is public, :func:`ppo_surrogate`: a loss of your own
adds its terms to it before one ``aggregate``. The alternatives to PPO's clip live beside
this module: CISPO, SAPO and GMPO in :mod:`torchforge.trust_region_losses`, Clip-Cov and
KL-Cov in :mod:`torchforge.covariance_losses`; the ratios in :mod:`torchforge.ratios`; the
critic's loss in :mod:`torchforge.value_losses`.

Numerics: float32 maths whatever the input dtype; positions where ``mask`` is False never
reach the loss, the metrics or the gradient (a NaN there does not leak); an empty mask,
or a batch with no rows or no tokens (B = 0, T = 0), gives a loss of 0 with zero gradient
and finite metrics.
"""

from __future__ import annotations

import torch

from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    check_choice,
    check_clip,
    check_float,
    check_log_probs,
    check_non_negative,
    check_per_token,
    check_positive,
    check_same_shape,
    reraise_as,
)
from torchforge.kl import KL_ESTIMATORS, KL_GRADIENTS, approx_kl
from torchforge.ratios import RATIO_LEVELS, clamp_log_ratio, ratio_metrics, sequence_log_ratio
from torchforge.reduce import Aggregation, masked_mean

__all__ = ["grpo_loss", "ppo_loss", "ppo_surrogate", "reinforce_loss"]


@batch_args
def ppo_surrogate(
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
    with_metrics: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token, unreduced, with the token ratio and the metrics.

    The base of :func:`ppo_loss` (``aggregate`` of it), :func:`grpo_loss` (plus a KL term)
    and :func:`~torchforge.covariance_losses.clip_cov_loss`; a loss of your own can add
    its terms to it before one ``aggregate``.

    With ``log_ratio = log_probs - old_log_probs`` (0 where ``mask`` is False),
    ``ratio = exp(clamp(log_ratio, -max_log_ratio, max_log_ratio))`` (GSPO: the row's
    mean log-ratio, see :func:`~torchforge.ratios.sequence_log_ratio`) and
    ``A = advantages``:

    ``pg_loss1 = -A * ratio``, ``pg_loss2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)``,
    ``pg_loss = max(pg_loss1, pg_loss2)``; with ``dual_clip = c``:
    ``pg_loss = min(pg_loss, -c * A)`` where ``A < 0``; then ``pg_loss = weights * pg_loss``.

    Args:
        log_probs: [B, T] float log pi of the sampled tokens (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] (one per sequence, broadcast over T) or [B, T] float; detached.
        mask: [B, T] bool, True = the token counts.
        weights: optional [B] or [B, T] float per-token weights >= 0; detached.
        clip_low, clip_high, dual_clip, ratio_level, max_log_ratio, with_metrics: as in
            :func:`ppo_loss`.

    Returns:
        ``(pg_loss, ratio, metrics)``: the [B, T] float32 per-token loss (any value where
        ``mask`` is False: reduce it with ``aggregate``); the [B, T] token ratio
        ``exp(clamp(log_ratio))`` with its gradient, 1 where masked (whatever
        ``ratio_level``: a term of your own reuses it, as ``grpo_loss``'s bias-corrected KL
        does); the metrics of :func:`ppo_loss` (``{}`` with ``with_metrics=False``).

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.6, 0.3]])).requires_grad_()
        >>> old = torch.log(torch.tensor([[0.4, 0.3]]))
        >>> # ratios 1.5 (clipped to 1.2) and 1.0, A = 1
        >>> pg_loss, ratio, metrics = ppo_surrogate(lp, old, torch.tensor([1.0]), torch.tensor([[True, True]]))
        >>> pg_loss.detach()
        tensor([[-1.2000, -1.0000]])
        >>> ratio.detach(), metrics["clip_frac_high"]
        (tensor([[1.5000, 1.0000]]), tensor(0.5000))

    References:
        PPO, https://arxiv.org/abs/1707.06347; dual-clip PPO, https://arxiv.org/abs/1912.09729;
        DAPO (clip-higher), https://arxiv.org/abs/2503.14476; GSPO, https://arxiv.org/abs/2507.18071

    Note:
        See :func:`ppo_loss` for how ``max(pg_loss1, pg_loss2)`` is computed and why.
    """
    fn = "ppo_surrogate"
    check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    clip_high = check_clip(fn, clip_low, clip_high, dual_clip)
    check_choice(fn, "ratio_level", ratio_level, RATIO_LEVELS)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    A = check_per_token(fn, "advantages", advantages, log_probs)
    if weights is not None:
        weights = check_per_token(fn, "weights", weights, log_probs)

    # A where, not a product with the mask: a NaN where masked reaches neither value nor gradient.
    log_ratio = torch.where(mask, log_probs.float() - old_log_probs.detach().float(), 0.0)
    token_log_ratio = clamp_log_ratio(log_ratio, max_log_ratio=max_log_ratio)
    token_ratio = torch.exp(token_log_ratio)                    # exactly 1 where masked
    if ratio_level == "token":
        ratio = token_ratio
    else:  # GSPO-token: the row's mean log-ratio, 0 where masked as above
        seq_log_ratio = torch.where(mask, sequence_log_ratio(log_ratio, mask), 0.0)
        ratio = torch.exp(clamp_log_ratio(seq_log_ratio, max_log_ratio=max_log_ratio))
    pg_loss1 = -A * ratio
    pg_loss2 = -A * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_loss = torch.clamp(pg_loss1, min=pg_loss2.detach())      # max(pg_loss1, pg_loss2): see ppo_loss's Note
    if dual_clip is not None:
        pg_loss3 = -A * dual_clip
        pg_loss = torch.where(A < 0, torch.clamp(pg_loss, max=pg_loss3), pg_loss)  # min(pg_loss, pg_loss3)
    if weights is not None:
        pg_loss = pg_loss * weights
    metrics = {}
    if with_metrics:
        with torch.no_grad():
            # The clip takes a token's gradient where pg_loss2 > pg_loss1: ratio < 1 - clip_low
            # with A < 0, ratio > 1 + clip_high with A > 0 (never where masked: the ratio is 1);
            # the dual clip where ratio > c with A < 0.
            num_tokens = torch.count_nonzero(mask)
            count = num_tokens.clamp(min=1)
            clip_frac_low, clip_frac_high = _frac_by_sign(pg_loss2 > pg_loss1, A, count)
            metrics = {"clip_frac_low": clip_frac_low, "clip_frac_high": clip_frac_high}
            if dual_clip is not None:
                metrics["dual_clip_frac"] = _frac_by_sign(ratio > dual_clip, A, count)[0]
            metrics.update(ratio_metrics(token_log_ratio, token_ratio, mask, num_tokens=num_tokens,
                                         weighing_ratio=None if ratio_level == "token" else ratio))
    return pg_loss, token_ratio, metrics


def _frac_by_sign(flags: torch.Tensor, A: torch.Tensor, count: torch.Tensor):
    """The fractions of the ``count`` counted tokens where the bool ``flags`` hold with
    ``A < 0`` and with ``A > 0`` (``flags`` False where nothing is counted); one count per
    row when ``A`` is [B, 1]."""
    if A.shape[-1] == 1:
        per_row = torch.count_nonzero(flags, -1)
        A = A.squeeze(-1)
        return (per_row * (A < 0)).sum() / count, (per_row * (A > 0)).sum() / count
    return torch.count_nonzero(flags & (A < 0)) / count, torch.count_nonzero(flags & (A > 0)) / count


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
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss, with clip-higher, dual-clip, GSPO ratios and IS weights.

    With ``log_ratio = log_probs - old_log_probs`` (0 where ``mask`` is False),
    ``ratio = exp(clamp(log_ratio, -max_log_ratio, max_log_ratio))`` (GSPO: the row's
    mean log-ratio, see :func:`policy_ratio`) and ``A = advantages``:

    ``pg_loss1 = -A * ratio``, ``pg_loss2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)``,
    ``pg_loss = max(pg_loss1, pg_loss2)``; with ``dual_clip = c``:
    ``pg_loss = min(pg_loss, -c * A)`` where ``A < 0`` (the loss of a negative-advantage
    token is capped at ``c * |A|`` however large its ratio grows). Then
    ``loss = aggregate(weights * pg_loss, mask)``, where ``weights * pg_loss`` is
    :func:`ppo_surrogate`.

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
        with_metrics: compute the metrics (the default); False returns ``{}`` for them
            and skips their cost, for a caller that reports statistics of its own. The
            loss and its gradient are the same either way, bit for bit.

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
        ``max(pg_loss1, pg_loss2)`` is computed as ``clamp(pg_loss1, min=sg(pg_loss2))``,
        with the same value and the same gradient: wherever ``pg_loss2`` is the larger the
        clip is active and its gradient is 0, and on a tie (every token inside the clip
        range) the clamp gives the gradient to ``pg_loss1``, equal to ``pg_loss2``'s there.
        ``torch.maximum`` splits each tie in two halves and backpropagates both, which
        makes the textbook formula about 2x slower eagerly on CPU (bench_losses.py).
    """
    fn = "ppo_loss"
    with reraise_as(fn):
        pg_loss, _, metrics = ppo_surrogate(
            log_probs, old_log_probs, advantages, mask, weights, clip_low=clip_low, clip_high=clip_high,
            dual_clip=dual_clip, ratio_level=ratio_level, max_log_ratio=max_log_ratio,
            with_metrics=with_metrics,
        )
    with reraise_as(fn, "aggregation"):
        loss = Aggregation.of(aggregation)(pg_loss, mask)
    return loss, metrics


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
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss: the PPO clipped surrogate plus a per-token KL penalty to a reference.

    ``per_token = weights * pg_loss + kl_coef * kl`` with ``weights * pg_loss`` the
    :func:`ppo_surrogate` of :func:`ppo_loss` and ``kl = approx_kl(log_probs,
    ref_log_probs, old_log_probs, estimator=kl_estimator, gradient=kl_gradient)``, then
    ``loss = aggregate(per_token, mask)``: both terms are reduced the same way.

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
        clip_low, clip_high, dual_clip, ratio_level, max_log_ratio, with_metrics: as in
            :func:`ppo_loss`.
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
    with reraise_as(fn):
        pg_loss, ratio, metrics = ppo_surrogate(
            log_probs, old_log_probs, advantages, mask, weights, clip_low=clip_low, clip_high=clip_high,
            dual_clip=dual_clip, ratio_level=ratio_level, max_log_ratio=max_log_ratio,
            with_metrics=with_metrics,
        )
    if kl_coef > 0:
        check_same_shape(fn, "ref_log_probs", ref_log_probs, "log_probs", log_probs)
        check_float(fn, "ref_log_probs", ref_log_probs)
        # "bias-corrected" is the estimate times the token ratio pi / pi_old with its
        # gradient (as approx_kl computes it): the surrogate's ratio, not a second one.
        bias_corrected = kl_gradient == "bias-corrected"
        kl = approx_kl(log_probs, ref_log_probs.detach(), mask=mask, estimator=kl_estimator,
                       gradient="estimator" if bias_corrected else kl_gradient)
        if bias_corrected:
            kl = kl * ratio
        per_token = torch.add(pg_loss, kl, alpha=kl_coef)     # pg_loss + kl_coef * kl, in one kernel
        if with_metrics:
            with torch.no_grad():  # kl is 0 where masked: a plain sum
                metrics["kl"] = kl.sum() / torch.count_nonzero(mask).clamp(min=1)
    else:
        per_token = pg_loss
        if with_metrics:
            metrics["kl"] = torch.zeros((), device=log_probs.device)
    with reraise_as(fn, "aggregation"):
        loss = Aggregation.of(aggregation)(per_token, mask)
    return loss, metrics


@batch_args
def reinforce_loss(
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    aggregation: str | Aggregation = "token-mean",
    with_metrics: bool = True,
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
        with_metrics: as in :func:`ppo_loss` (False: ``{}``, the same loss and gradient).

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
    check_log_probs(fn, log_probs, mask)
    A = check_per_token(fn, "advantages", advantages, log_probs)
    if weights is not None:
        weights = check_per_token(fn, "weights", weights, log_probs)

    coef = -A if weights is None else -A * weights
    # The detached coefficient is 0 where masked (a where, not a product with the mask); with
    # aggregate's where on the product, a NaN there reaches neither the value nor the gradient.
    pg_loss = torch.where(mask, coef, 0.0) * log_probs.float()

    metrics = {}
    if with_metrics:
        with torch.no_grad():
            metrics["log_prob_mean"] = masked_mean(log_probs.float(), mask)
    with reraise_as(fn, "aggregation"):
        loss = Aggregation.of(aggregation)(pg_loss, mask)
    return loss, metrics
