"""Policy and value losses: importance ratios, clipped surrogates, value regression.

Every loss returns ``(loss, metrics)``: a float32 scalar, and a dict of detached float32
scalar tensors (no ``.item()``, so the losses compile with ``torch.compile(fullgraph=True)``
and never force a device sync). Metrics are masked means over *this* call's counted tokens,
for logging; the loss itself is reduced by the ``aggregation`` argument.

``aggregation`` is the same in every loss: a mode name (``"token-mean"``,
``"seq-mean-token-mean"``, ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``) or an
:class:`~torchforge.reduce.Aggregation` carrying the global token / sequence counts and the
data-parallel size; see :func:`~torchforge.reduce.aggregate` for what each mode means and
how the counts make the loss exact across micro-batches and ranks.

Numerics: float32 maths whatever the input dtype; positions where ``mask`` is False never
reach the loss, the metrics or the gradient (a NaN there does not leak); an empty mask
gives a loss of 0 with zero gradient and finite metrics.
"""

from __future__ import annotations

import math

import torch

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
from torchforge.kl import KL_ESTIMATORS, approx_kl
from torchforge.reduce import AGGREGATION_MODES, Aggregation

__all__ = [
    "policy_ratio",
    "ppo_loss",
    "grpo_loss",
    "reinforce_loss",
    "cispo_loss",
    "value_loss",
    "RATIO_LEVELS",
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


def _per_token(fn: str, name: str, x, ref: torch.Tensor) -> torch.Tensor:
    """``x`` of shape [B] (returned as [B, 1], broadcast over T on purpose) or [B, T], float32."""
    check_tensor(fn, name, x)
    check_float(fn, name, x)
    B, T = ref.shape
    if x.dim() == 1 and x.shape[0] == B:
        return x.float().unsqueeze(-1)
    if x.shape != ref.shape:
        raise ShapeError(
            f"{fn}: {name} has shape {shape_str(x)} but log_probs has shape {shape_str(ref)}; "
            f"expected ({B},) or ({B}, {T})"
        )
    return x.float()


def _check_clip(fn: str, clip_low, clip_high, dual_clip) -> float:
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


def _safe_log_ratio(log_probs, old_log_probs, mask):
    """``log_probs - old_log_probs`` in float32, exactly 0 where ``mask`` is False.

    ``torch.where`` (not a product with the mask) also zeroes the *gradient* there, so a
    NaN at a masked position reaches neither the loss nor ``log_probs.grad``.
    """
    return torch.where(mask, log_probs.float() - old_log_probs.detach().float(), 0.0)


# --- ratios -----------------------------------------------------------------------------

def _value_log_ratio(log_ratio, mask, level: str) -> torch.Tensor:
    """The log of the ratio each token is weighed by, with the gradient of its log-prob.

    token: ``log_ratio`` itself. sequence (GSPO-token): ``sg(l_b) + log_ratio -
    sg(log_ratio)`` with ``l_b`` the masked mean log-ratio of row b: the value is ``l_b``
    at every position; the gradient w.r.t. ``log_probs_bt`` is 1, as in the token case.
    """
    if level == "token":
        return log_ratio
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
    """
    fn = "policy_ratio"
    _check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_choice(fn, "level", level, RATIO_LEVELS)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    value_log_ratio = _value_log_ratio(_safe_log_ratio(log_probs, old_log_probs, mask), mask, level)
    return torch.exp(value_log_ratio.clamp(-max_log_ratio, max_log_ratio))


def _frac(flags: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (flags & mask).sum().float() / count


# --- the PPO surrogate -----------------------------------------------------------------

def _log_bounds(advantages, clip_low: float, clip_high: float, dual_clip, max_log_ratio: float):
    """Per-token bounds on the log-ratio that make ``-A * exp(clamp(.))`` the PPO loss.

    For ``A > 0``: ``max(-A r, -A clip(r)) = -A min(r, 1 + clip_high)``; for ``A < 0``:
    ``= |A| max(r, 1 - clip_low)``, and the dual clip caps it at ``|A| c``, i.e. ``r <= c``.
    Intersected with ``[-max_log_ratio, max_log_ratio]``.
    """
    m = max_log_ratio
    low = max(math.log(1 - clip_low), -m) if clip_low < 1 else -m
    high = min(math.log1p(clip_high), m)
    cap = m if dual_clip is None else min(math.log(dual_clip), m)
    negative = advantages < 0
    log_lower = torch.where(negative, low, -m)
    log_upper = torch.where(advantages > 0, high, torch.where(negative, cap, m))
    return log_lower, log_upper


class _ClippedSurrogate(torch.autograd.Function):
    """Per-token PPO loss ``neg_scale * exp(clamp(value_log_ratio, log_lower, log_upper))``.

    ``-neg_scale = A * weights * mask`` (exactly 0 at masked positions, so is the loss); the
    PPO clip, the dual-clip cap and the ``max_log_ratio`` clamp are one clamp of the
    log-ratio between per-token bounds (:func:`_log_bounds`). Where the clamp is inactive
    the loss is ``neg_scale * ratio``, whose derivative w.r.t. ``log_probs`` is the loss
    itself; where it is active the derivative is 0. The forward saves that derivative,
    so the backward is one product: no ``where`` and no chain through maximum, clamp and
    exp (the main saving in eager mode, where ``where`` is slow on CPU). The ``where``
    that zeroes the log-ratio at masked positions runs outside autograd, so a NaN there
    reaches neither the loss nor the gradient.

    Returns ``(pg_loss, log_ratio, inactive, below)``, the last three without gradient,
    for the metrics: the token log-ratio (0 where masked), and float 0/1 flags of "clamp
    inactive" and "clamped from below".
    """

    @staticmethod
    def forward(ctx, log_probs, old_log_probs, mask, lengths, neg_scale, log_lower, log_upper, sequence):
        dtype = torch.promote_types(log_probs.dtype, torch.float32)  # float32, or float64 for gradcheck
        log_ratio = torch.where(mask, log_probs.to(dtype) - old_log_probs.to(dtype), 0.0)
        if sequence:  # GSPO: every token weighed by the row's mean log-ratio
            value_log_ratio = log_ratio.sum(-1, keepdim=True) / lengths.clamp(min=1)
        else:
            value_log_ratio = log_ratio
        clamped = torch.clamp(value_log_ratio, log_lower, log_upper)
        pg_loss = neg_scale * torch.exp(clamped)
        # 1.0 where the clamp is inactive, as float32 directly (bool tensors are slow on CPU).
        shape = torch.broadcast_shapes(clamped.shape, pg_loss.shape)
        inactive = torch.eq(clamped.expand(shape), value_log_ratio.expand(shape),
                            out=torch.empty(shape, dtype=pg_loss.dtype, device=pg_loss.device))
        below = torch.lt(value_log_ratio.expand(shape), log_lower.expand(shape),
                         out=torch.empty(shape, dtype=pg_loss.dtype, device=pg_loss.device))
        ctx.save_for_backward(pg_loss * inactive)
        ctx.dtype = log_probs.dtype
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(log_ratio, inactive, below)
        return pg_loss, log_ratio, inactive, below

    @staticmethod
    def backward(ctx, grad_pg_loss, *unused):
        (d_pg_loss,) = ctx.saved_tensors
        if grad_pg_loss is None:
            return (None,) * 8
        return (grad_pg_loss * d_pg_loss).to(ctx.dtype), None, None, None, None, None, None, None


def _per_token_scale(fn, advantages, weights, mask, maskf, lengths, log_probs):
    """``A * weights`` (detached, float32) and ``-A * weights * mask``, 0 wherever masked.

    A [B] value of a row with no counted token is set to 0 first (a NaN there must not
    leak); a [B, T] value is zeroed at masked positions with a ``where``.
    """
    signed = _per_token(fn, "advantages", advantages, log_probs).detach()
    if weights is not None:
        signed = signed * _per_token(fn, "weights", weights, log_probs).detach()
    if signed.shape[-1] == 1:
        signed = torch.where(lengths > 0, signed, 0.0)
        return signed, -signed * maskf
    signed = torch.where(mask, signed, 0.0)
    return signed, -signed


def _row_count(x: torch.Tensor, selector: torch.Tensor) -> torch.Tensor:
    """``sum(x * selector)`` for [B, T] x and a [B, 1] or [B, T] 0/1 selector."""
    if selector.shape[-1] == 1:
        return (x.sum(-1, keepdim=True) * selector).sum()
    return (x * selector).sum()


def _ppo_terms(fn, log_probs, old_log_probs, advantages, mask, weights, clip_low, clip_high,
               dual_clip, ratio_level, max_log_ratio):
    """Per-token PPO loss [B, T] (0 at masked positions, weights applied), row lengths
    [B, 1] and the metrics."""
    _check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    clip_high = _check_clip(fn, clip_low, clip_high, dual_clip)
    check_choice(fn, "ratio_level", ratio_level, RATIO_LEVELS)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    maskf = mask.float()
    lengths = maskf.sum(-1, keepdim=True)  # exact: at most T per row
    signed, neg_scale = _per_token_scale(fn, advantages, weights, mask, maskf, lengths, log_probs)
    log_lower, log_upper = _log_bounds(signed, clip_low, clip_high, dual_clip, max_log_ratio)
    if torch.compiler.is_compiling():
        # Under torch.compile the plain autograd form is faster: the compiler fuses the
        # where / compare / clamp chain, forward and backward, that the Function avoids.
        log_ratio = _safe_log_ratio(log_probs, old_log_probs, mask)
        value_log_ratio = _value_log_ratio(log_ratio, mask, ratio_level)
        clamped = torch.clamp(value_log_ratio, log_lower, log_upper)
        pg_loss = neg_scale * torch.exp(clamped)
        log_ratio = log_ratio.detach()
        inactive = (clamped == value_log_ratio).detach().float().expand_as(pg_loss)
        below = (value_log_ratio < log_lower).detach().float().expand_as(pg_loss)
    else:
        pg_loss, log_ratio, inactive, below = _ClippedSurrogate.apply(
            log_probs, old_log_probs.detach(), mask, lengths, neg_scale, log_lower, log_upper,
            ratio_level == "sequence",
        )

    with torch.no_grad():
        count = lengths.long().sum()
        denominator = count.clamp(min=1).float()
        # A token is clipped when the clip takes its gradient: ratio < 1 - clip_low with
        # A < 0 (clamped from below), ratio > 1 + clip_high with A > 0 (from above); the
        # dual clip: ratio > c with A < 0 (from above). At token level masked positions
        # have log-ratio 0, inside every bound; at sequence level they are masked here.
        clipped = 1 - inactive
        if ratio_level == "sequence":
            clipped, below = clipped * maskf, below * maskf
        above = clipped - below
        negative, positive = (signed < 0).float(), (signed > 0).float()
        metrics = {
            "clip_frac_low": _row_count(below, negative) / denominator,
            "clip_frac_high": _row_count(above, positive) / denominator,
        }
        if dual_clip is not None:
            metrics["dual_clip_frac"] = _row_count(above, negative) / denominator
        metrics.update(_ratio_metrics(log_ratio, maskf, lengths, count, sequence=ratio_level == "sequence",
                                      max_log_ratio=max_log_ratio))
    return pg_loss, lengths, count, metrics


def _ratio_metrics(log_ratio, maskf, lengths, count, *, sequence: bool, max_log_ratio: float):
    """Masked ``ratio_mean`` / ``ratio_min`` / ``ratio_max`` and ``approx_kl``; 0 when empty.

    ``log_ratio`` is the token log-ratio, 0 at masked positions, so sums over it need no
    mask. ``approx_kl`` is the k3 estimate of KL(pi_old || pi) on tokens sampled from
    pi_old, ``mean(exp(lr) - 1 - lr)``, from the token log-ratio whatever the level. Min
    and max are taken on the log-ratio (exp is monotone), with masked positions filled
    with the mean, which lies between them.
    """
    m = max_log_ratio
    denominator = count.clamp(min=1).float()
    nonempty = count > 0
    token_lr = log_ratio.clamp(-m, m)
    expm1_sum = (torch.exp(token_lr) - 1).sum()  # exp - 1 is 2-3x faster than expm1 on CPU
    lr_sum = token_lr.sum()
    if sequence:  # one value per row, counted n_b times
        row_lr = (log_ratio.sum(-1, keepdim=True) / lengths.clamp(min=1)).clamp(-m, m)
        ratio_sum = (torch.exp(row_lr) * lengths).sum()
        mean = (row_lr * lengths).sum() / denominator
        lr_min, lr_max = torch.aminmax(torch.where(lengths > 0, row_lr, mean))
    else:
        ratio_sum = expm1_sum + count
        mean = lr_sum / denominator
        # token_lr - mean * maskf is token_lr - mean where counted and 0 where masked;
        # adding mean back puts the masked positions at the mean.
        lr_min, lr_max = torch.aminmax(torch.addcmul(token_lr, maskf, -mean))
        lr_min, lr_max = lr_min + mean, lr_max + mean
    return {
        "approx_kl": (expm1_sum - lr_sum) / denominator,
        "ratio_mean": ratio_sum / denominator,
        "ratio_min": torch.where(nonempty, torch.exp(lr_min), 0.0),
        "ratio_max": torch.where(nonempty, torch.exp(lr_max), 0.0),
    }


def _aggregate_zeroed(fn: str, per_token: torch.Tensor, lengths, count, aggregation):
    """``aggregate(per_token, mask, ...)`` for a ``per_token`` that is exactly 0 wherever
    ``mask`` is False: the same modes, counts and ``dp_size`` rule, computed with plain
    sums (no ``where`` forward or backward). The tests check it equals ``aggregate``.
    """
    agg = Aggregation.of(aggregation)
    check_choice(fn, "aggregation mode", agg.mode, AGGREGATION_MODES)
    if not (isinstance(agg.dp_size, int) and agg.dp_size >= 1):
        raise InvalidArgumentError(f"{fn}: aggregation dp_size must be an int >= 1, got {agg.dp_size!r}")
    for name, value in (("num_tokens", agg.num_tokens), ("num_sequences", agg.num_sequences)):
        if value is not None and not isinstance(value, torch.Tensor):  # no device sync
            check_non_negative(fn, f"aggregation {name}", value)
    if agg.mode == "token-mean":
        if agg.num_tokens is None and agg.dp_size > 1:
            raise InvalidArgumentError(
                f"{fn}: aggregation dp_size={agg.dp_size} needs num_tokens, the token count over "
                "all ranks; without it the per-rank means do not average to the global mean"
            )
        count = count if agg.num_tokens is None else agg.num_tokens
        return agg.dp_size * per_token.sum() / _clamp_count(count)
    if agg.num_sequences is None and agg.dp_size > 1:
        raise InvalidArgumentError(
            f"{fn}: aggregation dp_size={agg.dp_size} with mode={agg.mode!r} needs num_sequences, "
            "the count of sequences over all ranks"
        )
    count = (lengths > 0).sum() if agg.num_sequences is None else agg.num_sequences
    if agg.mode == "seq-mean-token-mean":
        total = (per_token.sum(-1, keepdim=True) / lengths.clamp(min=1)).sum()
    elif agg.mode == "seq-mean-token-sum":
        total = per_token.sum()
    else:
        length = per_token.shape[-1] if agg.norm_length is None else agg.norm_length
        check_positive(fn, "aggregation norm_length", length)
        total = per_token.sum() / length
    return agg.dp_size * total / _clamp_count(count)


def _clamp_count(count):
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


# --- policy losses ----------------------------------------------------------------------

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

    With ``ratio = policy_ratio(log_probs, old_log_probs, mask, level=ratio_level)`` and
    ``A = advantages``:

    ``pg_loss1 = -A * ratio``, ``pg_loss2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)``,
    ``pg_loss = max(pg_loss1, pg_loss2)``; with ``dual_clip = c``:
    ``pg_loss = min(pg_loss, -c * A)`` where ``A < 0`` (the loss of a negative-advantage
    token is capped at ``c * |A|`` however large its ratio grows). Then
    ``loss = aggregation(weights * pg_loss, mask)``.

    Args:
        log_probs: [B, T] float log pi of the sampled tokens (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] (one per sequence, broadcast over T) or [B, T] float.
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
        ``(loss, metrics)``: float32 scalar, and detached float32 scalars (masked, local):
        ``clip_frac_low`` (ratio < 1 - clip_low and A < 0), ``clip_frac_high`` (ratio >
        1 + clip_high and A > 0) — the tokens the clip takes the gradient from;
        ``dual_clip_frac`` (ratio > c and A < 0, when ``dual_clip`` is set); ``approx_kl``,
        the k3 estimate of KL(pi_old || pi) from the token log-ratio, ``mean(ratio - 1 -
        log_ratio)``; ``ratio_mean``, ``ratio_min``, ``ratio_max`` (0 on an empty mask).

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
        Implementation: the clip, the dual-clip cap and that clamp are one clamp of the
        log-ratio between per-token bounds, ``pg_loss = -A * exp(clamp(log_ratio, lower,
        upper))``, with a hand-written backward (gradient ``pg_loss`` where the clamp is
        inactive, 0 where it is active); the reference tests check it against the
        textbook ``max(pg_loss1, pg_loss2)``. Metrics are local masked means for
        logging; all-reduce them yourself across ranks if needed.
    """
    pg_loss, lengths, count, metrics = _ppo_terms(
        "ppo_loss", log_probs, old_log_probs, advantages, mask, weights,
        clip_low, clip_high, dual_clip, ratio_level, max_log_ratio,
    )
    return _aggregate_zeroed("ppo_loss", pg_loss, lengths, count, aggregation), metrics


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
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    max_log_ratio: float = 20.0,
    aggregation: str | Aggregation = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss: the PPO clipped surrogate plus a per-token KL penalty to a reference.

    ``per_token = weights * pg_loss + kl_coef * approx_kl(log_probs, ref_log_probs,
    estimator=kl_estimator)`` with ``pg_loss`` exactly as in :func:`ppo_loss`, then
    ``loss = aggregation(per_token, mask)``: both terms are reduced the same way.

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float.
        mask: [B, T] bool, True = the token counts.
        ref_log_probs: [B, T] float log pi_ref; needed only when ``kl_coef > 0``.
        weights: optional [B] or [B, T] float per-token weights on the surrogate; detached.
        kl_coef: weight of the KL term (beta in the paper); >= 0.
        kl_estimator: one of ``KL_ESTIMATORS`` (``"k3"`` as in DeepSeekMath).
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
        http://joschu.net/blog/kl-approx.html

    Note:
        ``weights`` multiply the surrogate only, not the KL term (as verl applies
        rollout importance weights). With the original GRPO's per-sequence averaging use
        ``aggregation="seq-mean-token-mean"``; the default ``token-mean`` is DAPO's.
    """
    fn = "grpo_loss"
    check_non_negative(fn, "kl_coef", kl_coef)
    check_choice(fn, "kl_estimator", kl_estimator, KL_ESTIMATORS)
    if kl_coef > 0 and ref_log_probs is None:
        raise InvalidArgumentError(
            f"{fn}: kl_coef={kl_coef} needs ref_log_probs ([B, T] log-probs under the "
            "reference policy); pass them, or kl_coef=0"
        )
    per_token, lengths, count, metrics = _ppo_terms(
        fn, log_probs, old_log_probs, advantages, mask, weights,
        clip_low, clip_high, dual_clip, ratio_level, max_log_ratio,
    )
    if kl_coef > 0:
        check_same_shape(fn, "ref_log_probs", ref_log_probs, "log_probs", log_probs)
        check_float(fn, "ref_log_probs", ref_log_probs)
        # Zero both sides at masked positions so that a NaN there cannot reach the gradient.
        kl = approx_kl(
            torch.where(mask, log_probs.float(), 0.0), torch.where(mask, ref_log_probs.float(), 0.0),
            estimator=kl_estimator, max_log_ratio=max_log_ratio,
        )
        per_token = per_token + kl_coef * kl
        with torch.no_grad():
            metrics["kl"] = kl.detach().sum() / mask.sum().clamp(min=1).float()
    else:
        metrics["kl"] = torch.zeros((), device=log_probs.device)
    return _aggregate_zeroed(fn, per_token, lengths, count, aggregation), metrics


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

    ``per_token = -weights * advantages * log_probs``, ``loss = aggregation(per_token, mask)``;
    its gradient is ``-A grad log pi``, the score-function estimator.

    Args:
        log_probs: [B, T] float log pi of the sampled tokens (carries grad).
        advantages: [B] or [B, T] float (returns, or returns minus a baseline).
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
    advantages = _per_token(fn, "advantages", advantages, log_probs).detach()  # a target, as in ppo_loss
    lp = torch.where(mask, log_probs.float(), 0.0)
    per_token = -advantages * lp
    if weights is not None:
        per_token = per_token * _per_token(fn, "weights", weights, log_probs).detach()
    with torch.no_grad():
        metrics = {"log_prob_mean": lp.detach().sum() / mask.sum().clamp(min=1).float()}
    return Aggregation.of(aggregation)(per_token, mask), metrics


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

    ``per_token = -sg(clamp(ratio, 1 - clip_low, 1 + clip_high)) * A * log_probs`` with
    the token ratio of :func:`policy_ratio`; ``loss = aggregation(weights * per_token,
    mask)``. The weight is detached and the gradient flows through ``log_probs``, so a
    clipped token still gets gradient ``-clamp(ratio) * A * grad log pi`` (PPO's clip
    gives it none).

    Args:
        log_probs: [B, T] float log pi (carries grad).
        old_log_probs: [B, T] float log pi_old (detached).
        advantages: [B] or [B, T] float.
        mask: [B, T] bool, True = the token counts.
        weights: optional [B] or [B, T] float per-token weights; detached.
        clip_low: lower bound ``1 - clip_low`` on the weight; in [0, 1] (1 = no lower
            bound, as in MiniMax-M1).
        clip_high: upper bound ``1 + clip_high``; >= 0.
        max_log_ratio: clamp on the log-ratio before ``exp``; > 0.
        aggregation: a mode name or an Aggregation with global counts; see ``aggregate``.

    Returns:
        ``(loss, metrics)``: ``clip_frac_low`` / ``clip_frac_high`` (fraction of tokens
        whose weight was clipped below / above, whatever the sign of A), ``approx_kl``,
        ``ratio_mean``, ``ratio_min``, ``ratio_max`` as in :func:`ppo_loss`.

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
    advantages = _per_token(fn, "advantages", advantages, log_probs).detach()  # a target, as in ppo_loss
    clip_high = _check_clip(fn, clip_low, clip_high, None)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    log_ratio = _safe_log_ratio(log_probs, old_log_probs, mask).detach()
    ratio = torch.exp(log_ratio.clamp(-max_log_ratio, max_log_ratio))
    lp = torch.where(mask, log_probs.float(), 0.0)
    per_token = -ratio.clamp(1 - clip_low, 1 + clip_high) * advantages * lp
    if weights is not None:
        per_token = per_token * _per_token(fn, "weights", weights, log_probs).detach()
    with torch.no_grad():
        count = mask.sum()
        denominator = count.clamp(min=1).float()
        metrics = {  # masked positions have ratio exactly 1, inside the bounds
            "clip_frac_low": (ratio < 1 - clip_low).sum().float() / denominator,
            "clip_frac_high": (ratio > 1 + clip_high).sum().float() / denominator,
        }
        metrics.update(_ratio_metrics(log_ratio, mask.float(), None, count, sequence=False,
                                      max_log_ratio=max_log_ratio))
    return Aggregation.of(aggregation)(per_token, mask), metrics


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
    (``0.5 * (values - returns)**2`` with ``clip=None``), ``loss = aggregation(per_token,
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
            metrics = {"clip_frac": _frac(loss2 > loss1, mask, mask.sum().clamp(min=1).float())}
    return Aggregation.of(aggregation)(per_token, mask), metrics
