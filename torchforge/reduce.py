"""Masked reductions and loss aggregation.

All maths is float32 whatever the input dtype, positions where ``mask`` is False never
reach the result (a NaN there does not leak), and an empty mask gives 0, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    check_choice,
    check_float,
    check_mask,
    check_non_negative,
    check_positive,
    check_tensor,
)

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "aggregate",
    "Aggregation",
    "AGGREGATION_MODES",
]

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _masked(fn: str, values: torch.Tensor, mask: torch.Tensor, name: str = "values") -> torch.Tensor:
    """``values`` (the argument ``name``) in float32 with masked-out positions set to 0."""
    check_tensor(fn, name, values)
    check_float(fn, name, values)
    check_mask(fn, mask, name, values)
    # where, not multiplication: NaN * 0 is NaN.
    return torch.where(mask, values.float(), 0.0)


@batch_args
def masked_sum(values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is True.

    ``masked_sum = sum_i values_i * mask_i`` (over ``dim``, or everything).

    Args:
        values: [...] float tensor.
        mask: bool tensor of the shape of ``values``; True = counts.
        dim: dimension to reduce; None reduces all.

    Returns:
        float32 tensor: scalar, or ``values`` without ``dim``.

    Example:
        >>> import torch
        >>> masked_sum(torch.tensor([1., 2., float("nan")]), torch.tensor([True, True, False]))
        tensor(3.)
    """
    masked = _masked("masked_sum", values, mask)
    return masked.sum() if dim is None else masked.sum(dim)


@batch_args
def masked_mean(values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is True.

    ``masked_mean = sum_i values_i mask_i / max(sum_i mask_i, 1)``; an empty mask gives 0.

    Args:
        values: [...] float tensor.
        mask: bool tensor of the shape of ``values``.
        dim: dimension to reduce; None reduces all.

    Returns:
        float32 tensor: scalar, or ``values`` without ``dim``.

    Example:
        >>> import torch
        >>> masked_mean(torch.tensor([[1., 3.], [5., 7.]]), torch.tensor([[True, True], [False, False]]), dim=1)
        tensor([2., 0.])
    """
    masked = _masked("masked_mean", values, mask)
    if dim is None:
        return masked.sum() / mask.sum().clamp(min=1)
    return masked.sum(dim) / mask.sum(dim).clamp(min=1)


@batch_args
def masked_var(
    values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None, unbiased: bool = True
) -> torch.Tensor:
    """Variance of ``values`` over the positions where ``mask`` is True.

    ``masked_var = sum_i mask_i (values_i - mean)^2 / (n - 1)`` with ``n = sum_i mask_i``
    (``/ n`` when ``unbiased=False``).

    Args:
        values: [...] float tensor.
        mask: bool tensor of the shape of ``values``.
        dim: dimension to reduce; None reduces all.
        unbiased: apply Bessel's correction.

    Returns:
        float32 tensor: scalar, or ``values`` without ``dim``.

    Note:
        With fewer counted positions than the correction needs (n <= 1 unbiased, n = 0
        biased) the variance is returned as 0 rather than NaN or an error (TRL's
        ``masked_var`` raises): one sample has no spread.

    Example:
        >>> import torch
        >>> masked_var(torch.tensor([1., 3., 100.]), torch.tensor([True, True, False]))
        tensor(2.)
    """
    masked = _masked("masked_var", values, mask)
    count = mask.sum() if dim is None else mask.sum(dim)
    total = masked.sum() if dim is None else masked.sum(dim, keepdim=True)
    mean = total / (count if dim is None else count.unsqueeze(dim)).clamp(min=1)
    squared = torch.where(mask, (masked - mean) ** 2, 0.0)
    sq_sum = squared.sum() if dim is None else squared.sum(dim)
    denominator = count - 1 if unbiased else count
    return torch.where(denominator > 0, sq_sum / denominator.clamp(min=1), 0.0)


@batch_args
def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalize ``values`` to zero mean and unit variance over the counted positions.

    ``whitened = (values - mean) / sqrt(var + eps)`` with the masked mean and (unbiased)
    variance over all dimensions; with ``shift_mean=False`` the mean is added back.

    Args:
        values: [...] float tensor.
        mask: bool tensor of the shape of ``values``.
        shift_mean: subtract the mean (True) or keep it (False, as in TRL's ``whiten``).
        eps: added to the variance before the square root.

    Returns:
        float32 tensor of the shape of ``values``; 0 where ``mask`` is False. A new
        tensor: the input is not modified.

    Example:
        >>> import torch
        >>> masked_whiten(torch.tensor([1., 3., 9.]), torch.tensor([True, True, False]), eps=0.0)
        tensor([-0.7071,  0.7071,  0.0000])
    """
    check_non_negative("masked_whiten", "eps", eps)
    masked = _masked("masked_whiten", values, mask)
    mean = masked.sum() / mask.sum().clamp(min=1)
    var = masked_var(values, mask) + eps
    # Constant values (var + eps == 0) whiten to 0, not to 0 * inf = NaN; the inner where
    # keeps rsqrt away from 0 so that its gradient (0 * inf) cannot be NaN either.
    positive = var > 0
    whitened = (masked - mean) * torch.where(positive, torch.rsqrt(torch.where(positive, var, 1.0)), 0.0)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0)


@batch_args
def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
    dp_size: int = 1,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar, exactly across micro-batches and ranks.

    With ``L = per_token``, ``m = mask``, ``n_b = sum_t m_bt``, ``S`` the number of
    sequences with at least one counted token and ``N = sum_bt m_bt``:

    - ``token-mean``: ``sum_bt L_bt m_bt / N`` (every token weighs the same; DAPO).
    - ``seq-mean-token-mean``: ``sum_b (sum_t L_bt m_bt / n_b) / S`` (each sequence weighs
      the same; the original GRPO).
    - ``seq-mean-token-sum``: ``sum_b sum_t L_bt m_bt / S``.
    - ``seq-mean-token-sum-norm``: ``sum_bt L_bt m_bt / (S * norm_length)``: a constant
      denominator, free of length bias (Dr. GRPO). ``norm_length`` defaults to T.

    Exactness: pass the counts of the *whole* optimizer step — ``num_tokens`` (N) and
    ``num_sequences`` (S) summed over every micro-batch and rank — and ``dp_size``, the
    number of data-parallel ranks. The result is then ``dp_size * partial_sum / count``, so
    summing it over micro-batches (gradient accumulation) and averaging over ranks (what
    DDP / FSDP do to gradients) gives exactly the loss of the whole batch in one process.

    Mapping to other libraries:

    ============================  ==========================  ============================
    mode                          TRL ``loss_type``           verl ``loss_agg_mode``
    ============================  ==========================  ============================
    ``token-mean``                ``"dapo"`` (and ``"bnpo"``   ``"token-mean"``
                                  per local batch)
    ``seq-mean-token-mean``       ``"grpo"``                  ``"seq-mean-token-mean"``
    ``seq-mean-token-sum``        —                           ``"seq-mean-token-sum"``
    ``seq-mean-token-sum-norm``   ``"dr_grpo"`` (norm_length  ``"seq-mean-token-sum-norm"``
                                  = max_completion_length)
    ============================  ==========================  ============================

    Args:
        per_token: [B, T] float per-token loss.
        mask: [B, T] bool, True = the token counts.
        mode: one of ``AGGREGATION_MODES``.
        num_tokens: global count N of counted tokens (token-mean); default: this batch's.
        num_sequences: global count S of sequences with a counted token (seq-* modes);
            default: this batch's.
        dp_size: number of data-parallel ranks the loss is averaged over; > 1 needs the
            global count of the mode.
        norm_length: the constant length of ``seq-mean-token-sum-norm`` (default T).

    Returns:
        float32 scalar; 0 (with zero gradient) when nothing is counted.

    Note:
        ``S`` counts only sequences with at least one counted token, as verl does: a
        sequence dropped whole by a filter does not dilute the loss. TRL divides by every
        row; the two agree whenever no row is empty. TRL's ``"bnpo"`` normalizes by the
        tokens of the local batch, which equals ``token-mean`` without global counts.

    Example:
        >>> import torch
        >>> loss = torch.tensor([[1., 1., 0.], [4., 0., 0.]])
        >>> mask = torch.tensor([[True, True, False], [True, False, False]])
        >>> aggregate(loss, mask, mode="token-mean")          # (1 + 1 + 4) / 3
        tensor(2.)
        >>> aggregate(loss, mask, mode="seq-mean-token-mean")  # (1 + 4) / 2
        tensor(2.5000)

    References:
        DAPO, https://arxiv.org/abs/2503.14476; Dr. GRPO, https://arxiv.org/abs/2503.20783
    """
    fn = "aggregate"
    check_tensor(fn, "per_token", per_token, ndim=2)
    check_choice(fn, "mode", mode, AGGREGATION_MODES)
    if not (isinstance(dp_size, int) and dp_size >= 1):
        raise InvalidArgumentError(f"{fn}: dp_size must be an int >= 1, got {dp_size!r}")
    for name, count in (("num_tokens", num_tokens), ("num_sequences", num_sequences)):
        if count is not None and not isinstance(count, torch.Tensor):  # no device sync
            check_non_negative(fn, name, count)
    masked = _masked(fn, per_token, mask, "per_token")

    if mode == "token-mean":
        if num_tokens is None and dp_size > 1:
            raise InvalidArgumentError(
                f"{fn}: dp_size={dp_size} needs num_tokens, the token count over all ranks; "
                "without it the per-rank means do not average to the global mean"
            )
        count = mask.sum() if num_tokens is None else num_tokens
        return dp_size * masked.sum() / _clamp_count(count)

    if num_sequences is None and dp_size > 1:
        raise InvalidArgumentError(
            f"{fn}: dp_size={dp_size} with mode={mode!r} needs num_sequences, the count of "
            "sequences over all ranks"
        )
    lengths = mask.sum(-1)
    count = (lengths > 0).sum() if num_sequences is None else num_sequences
    if mode == "seq-mean-token-mean":
        total = (masked.sum(-1) / lengths.clamp(min=1)).sum()
    elif mode == "seq-mean-token-sum":
        total = masked.sum()
    else:
        length = per_token.shape[-1] if norm_length is None else norm_length
        check_positive(fn, "norm_length", length)
        total = masked.sum() / length
    return dp_size * total / _clamp_count(count)


def _clamp_count(count):
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    return max(count, 1)


@dataclass(frozen=True)
class Aggregation:
    """The aggregation options every loss takes, as one value.

    Losses accept ``aggregation="token-mean"`` (a mode name) or an ``Aggregation``; the
    fields mean exactly what the keyword arguments of :func:`aggregate` mean.

    Args:
        mode: one of ``AGGREGATION_MODES``.
        num_tokens: global token count of the optimizer step.
        num_sequences: global count of sequences with a counted token.
        dp_size: number of data-parallel ranks.
        norm_length: constant length for ``seq-mean-token-sum-norm``.

    Returns:
        An object whose call ``agg(per_token, mask)`` is ``aggregate(per_token, mask, **fields)``.

    Example:
        >>> import torch
        >>> agg = Aggregation("seq-mean-token-mean")
        >>> agg(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool))
        tensor(1.)
    """

    mode: str = "token-mean"
    num_tokens: int | torch.Tensor | None = None
    num_sequences: int | torch.Tensor | None = None
    dp_size: int = 1
    norm_length: int | None = None

    def __call__(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return aggregate(
            per_token, mask, mode=self.mode, num_tokens=self.num_tokens,
            num_sequences=self.num_sequences, dp_size=self.dp_size, norm_length=self.norm_length,
        )

    @staticmethod
    def of(aggregation: "str | Aggregation") -> "Aggregation":
        """An ``Aggregation`` from a mode name or an ``Aggregation``.

        Args:
            aggregation: a mode name or an ``Aggregation``.

        Returns:
            Aggregation.
        """
        return aggregation if isinstance(aggregation, Aggregation) else Aggregation(mode=aggregation)
