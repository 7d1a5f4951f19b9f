"""Masked reductions and loss aggregation: the one place that reduces over tokens, rows,
micro-batches and ranks.

All maths is float32 whatever the input dtype (the statistics of ``masked_var`` and
``masked_whiten`` sum centred values, and combine their few scalar sums in float64), positions where ``mask`` is False never
reach the result (a NaN there does not leak), and an empty mask gives a finite value
(0, or the documented ``fill``), never NaN.

Statistics over several ranks are the same functions: ``masked_mean``, ``masked_var``
and ``masked_whiten`` take ``sum_over_ranks``, a function that sums a tensor over every
rank (``torchforge.distributed.sum_over_ranks``; the identity when None). Every statistic
is computed from sums (the count, the sum, then the squared deviations about the global
mean), and each sum goes through it, so N processes get the statistics of the whole batch.
This module never imports ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchforge.batch import is_batch
from torchforge.errors import (
    InvalidArgumentError,
    ShapeError,
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
    "pooled_var",
    "masked_whiten",
    "masked_min",
    "masked_max",
    "aggregate",
    "Aggregation",
    "AGGREGATION_MODES",
]

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

SumOverRanks = Callable[[torch.Tensor], torch.Tensor]


def _check_not_batch(fn: str, name: str, values) -> None:
    if is_batch(values):
        raise InvalidArgumentError(
            f"{fn}: {name} is a {type(values).__name__}; expected a tensor. The reductions read "
            f"no batch key: pass the tensors, e.g. {fn}(batch.advantages, batch.mask)"
        )


def _masked(fn: str, values: torch.Tensor, mask: torch.Tensor, name: str = "values") -> torch.Tensor:
    """``values`` (the argument ``name``) in float32 with masked-out positions set to 0."""
    _check_not_batch(fn, name, values)
    check_tensor(fn, name, values)
    check_float(fn, name, values)
    check_mask(fn, mask, name, values)
    # where, not multiplication: NaN * 0 is NaN.
    return torch.where(mask, values.float(), 0.0)


def _check_dim(fn: str, dim, values: torch.Tensor, tuples: bool = False) -> None:
    """``dim`` is None or an int in [-ndim, ndim) (a tuple of them where ``tuples``)."""
    if dim is None:
        return
    for d in (dim if tuples and isinstance(dim, tuple) else (dim,)):
        if isinstance(d, bool) or not isinstance(d, int) or not -values.ndim <= d < max(values.ndim, 1):
            raise InvalidArgumentError(
                f"{fn}: dim={dim!r} for values of {values.ndim} dimensions; expected None or an int in "
                f"[{-values.ndim}, {max(values.ndim, 1)})"
            )


def _check_ranks(fn: str, dim: int | None, sum_over_ranks: SumOverRanks | None) -> None:
    if sum_over_ranks is not None and dim is not None:
        raise InvalidArgumentError(
            f"{fn}: sum_over_ranks with dim={dim}; statistics over ranks reduce every dimension "
            "(each rank holds different rows), so pass dim=None"
        )
    if sum_over_ranks is not None and not callable(sum_over_ranks):
        raise InvalidArgumentError(
            f"{fn}: sum_over_ranks is a {type(sum_over_ranks).__name__}; expected a function "
            "tensor -> tensor summed over ranks (torchforge.distributed.sum_over_ranks) or None"
        )


def _over_ranks(fn: str, sum_over_ranks: SumOverRanks | None, *sums: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each scalar of ``sums`` summed over ranks, in float64, with one call of ``sum_over_ranks``."""
    if sum_over_ranks is None:
        return sums
    packed = torch.stack([s.double() for s in sums])
    total = sum_over_ranks(packed)
    if not (isinstance(total, torch.Tensor) and total.shape == packed.shape):
        seen = tuple(total.shape) if isinstance(total, torch.Tensor) else type(total).__name__
        raise ShapeError(
            f"{fn}: sum_over_ranks returned {seen} for a tensor of shape {tuple(packed.shape)}; "
            "expected a tensor of the same shape (the elementwise sum over ranks)"
        )
    return tuple(total.to(packed.device, torch.float64).unbind(0))


def _sum(x: torch.Tensor, dim: int | None, keepdim: bool = False) -> torch.Tensor:
    return x.sum() if dim is None else x.sum(dim, keepdim=keepdim)


def _count(mask: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The number of True positions of the bool ``mask`` (int64), over ``dim`` or all.

    One op counts every mask: ``count_nonzero`` takes about half the time of
    ``mask.sum()`` eagerly, and under ``torch.compile`` a loss and its metrics counting
    the same mask share one count (identical ops are computed once)."""
    count = torch.count_nonzero(mask, dim)
    return count.unsqueeze(dim) if keepdim and dim is not None else count


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

    Note:
        The masked reductions take tensors only, not a ``Batch``: their ``values`` is any
        tensor, not the critic's ``values`` key (reading that key silently was a trap).
    """
    masked = _masked("masked_sum", values, mask)
    _check_dim("masked_sum", dim, values, tuples=True)
    return _sum(masked, dim)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    dim: int | None = None,
    sum_over_ranks: SumOverRanks | None = None,
) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is True.

    ``masked_mean = S / max(n, 1)`` with ``S = sum_i values_i mask_i`` and
    ``n = sum_i mask_i``, each summed over ranks by ``sum_over_ranks``; an empty mask
    gives 0.

    Args:
        values: [...] float tensor.
        mask: bool tensor of the shape of ``values``.
        dim: dimension to reduce; None reduces all.
        sum_over_ranks: sums a tensor over every rank
            (``torchforge.distributed.sum_over_ranks``); then the mean is that of the
            counted values of every rank. Only with ``dim=None``. None: this process only.

    Returns:
        float32 tensor: scalar, or ``values`` without ``dim``.

    Example:
        >>> import torch
        >>> masked_mean(torch.tensor([[1., 3.], [5., 7.]]), torch.tensor([[True, True], [False, False]]), dim=1)
        tensor([2., 0.])
    """
    fn = "masked_mean"
    _check_ranks(fn, dim, sum_over_ranks)
    masked = _masked(fn, values, mask)
    _check_dim(fn, dim, values, tuples=True)
    if sum_over_ranks is None:
        return _sum(masked, dim) / _count(mask, dim).clamp(min=1)
    total, count = _over_ranks(fn, sum_over_ranks, masked.sum(), _count(mask))
    return (total / count.clamp(min=1)).float()


def _deviation_and_var(
    fn: str,
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None,
    unbiased: bool,
    sum_over_ranks: SumOverRanks | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``values - mean`` (float32, any value where masked), ``mean`` and ``var`` (float64), in two passes.

    Pass 1 sums the count and the values; pass 2 the deviations ``d = values - shift``
    about ``shift``, the float32 mean of pass 1, and their squares, and
    ``M2 = sum d^2 - (sum d)^2 / n`` (the corrected two-pass algorithm: the second term
    removes the rounding of the shift) and ``mean = shift + sum d / n``. The [B, T] tensors
    and their sums stay float32: the values are centred before they are squared and summed,
    so an offset (rewards near 1e4) costs no precision; the few scalar sums combine (and
    go through ``sum_over_ranks``) in float64. The deviation from the float64 mean is
    ``d - (mean - shift)``.
    """
    _check_ranks(fn, dim, sum_over_ranks)
    x = _masked(fn, values, mask)
    _check_dim(fn, dim, values)
    count, total = _over_ranks(fn, sum_over_ranks, _count(mask, dim, keepdim=True), _sum(x, dim, keepdim=True))
    shift = (total / count.clamp(min=1)).float().detach()
    # d M2 / d mean = -2 sum (x - mean) = 0 over the whole batch, so the mean is a constant
    # in M2: the gradient is then exact on every rank, whose share of M2 alone would not be.
    d = torch.where(mask, x - shift, 0.0)
    squared, first = _over_ranks(fn, sum_over_ranks, _sum(d.square(), dim, keepdim=True), _sum(d, dim, keepdim=True))
    squared, first, count = squared.double(), first.double(), count.double()
    m2 = (squared - first**2 / count.clamp(min=1)).clamp(min=0)
    denominator = count - 1 if unbiased else count
    var = torch.where(denominator > 0, m2 / denominator.clamp(min=1), 0.0)
    correction = first / count.clamp(min=1)  # mean - shift
    mean = shift.double() + correction
    deviation = d - correction.float().detach()
    if torch.is_grad_enabled() and x.requires_grad:  # the gradient through the mean
        deviation = deviation - (mean - mean.detach()).float()
    return deviation, mean, var


def masked_var(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    dim: int | None = None,
    unbiased: bool = True,
    sum_over_ranks: SumOverRanks | None = None,
) -> torch.Tensor:
    """Variance of ``values`` over the positions where ``mask`` is True.

    With ``n = sum_i mask_i``, ``mean = sum_i values_i mask_i / n`` and
    ``M2 = sum_i mask_i (values_i - mean)^2`` (each sum over ranks by ``sum_over_ranks``):
    ``masked_var = M2 / (n - 1)`` (``/ n`` when ``unbiased=False``).

    Args:
        values: [...] float tensor.
        mask: bool tensor of the shape of ``values``.
        dim: dimension to reduce; None reduces all.
        unbiased: apply Bessel's correction.
        sum_over_ranks: sums a tensor over every rank
            (``torchforge.distributed.sum_over_ranks``): the variance of every rank's
            counted values. Only with ``dim=None``. None: this process only.

    Returns:
        float32 tensor: scalar, or ``values`` without ``dim``.

    Note:
        With fewer counted positions than the correction needs (n <= 1 unbiased, n = 0
        biased) the variance is returned as 0 rather than NaN or an error (TRL's
        ``masked_var`` raises): one sample has no spread. Two passes (the mean, then
        the deviations about it, squared and summed in float32 once centred; the scalar
        sums combined in float64), so a constant offset (rewards near 1e4) does not
        change the result.

    Example:
        >>> import torch
        >>> masked_var(torch.tensor([1., 3., 100.]), torch.tensor([True, True, False]))
        tensor(2.)
    """
    _, _, var = _deviation_and_var("masked_var", values, mask, dim, unbiased, sum_over_ranks)
    return (var if dim is None else var.squeeze(dim)).float()


def pooled_var(
    counts: torch.Tensor,
    means: torch.Tensor,
    m2: torch.Tensor,
    *,
    unbiased: bool = True,
    sum_over_ranks: SumOverRanks | None = None,
) -> torch.Tensor:
    """Variance of the union of parts, from each part's count, mean and squared deviations.

    Part i holds ``n_i = counts_i`` values with mean ``mean_i`` and
    ``M2_i = sum (value - mean_i)^2``; with ``n = sum_i n_i`` and
    ``mean = sum_i n_i mean_i / n`` (each sum over ranks by ``sum_over_ranks``):
    ``M2 = sum_i M2_i + sum_i n_i (mean_i - mean)^2`` (Chan et al.) and
    ``pooled_var = M2 / (n - 1)`` (``/ n`` when ``unbiased=False``). The result equals
    :func:`masked_var` of all the values, without another pass over them: callers that
    already hold per-group statistics (the group estimators) get the batch variance from
    [groups]-sized tensors.

    Args:
        counts: [P] (any shape) number of values of each part (float or int, >= 0).
        means: mean of each part, the shape of ``counts``; any finite value where the
            count is 0.
        m2: sum of the squared deviations from its mean of each part, the shape of
            ``counts``; or their total, a scalar (only the total enters ``M2``).
        unbiased: apply Bessel's correction.
        sum_over_ranks: sums a tensor over every rank
            (``torchforge.distributed.sum_over_ranks``): the variance of the parts of
            every rank. None: this process only.

    Returns:
        float32 scalar; 0 when there are too few values (as :func:`masked_var`).

    Example:
        >>> import torch
        >>> # parts [1, 3] and [5]: all values 1, 3, 5 have variance 4
        >>> pooled_var(torch.tensor([2., 1.]), torch.tensor([2., 5.]), torch.tensor([2., 0.]))
        tensor(4.)

    Note:
        The sums accumulate in float64 (the parts' statistics are few), in two passes
        over the parts (the mean, then the deviations about it), so a constant offset
        of every value does not change the result.
    """
    fn = "pooled_var"
    _check_ranks(fn, None, sum_over_ranks)
    for name, x in (("counts", counts), ("means", means), ("m2", m2)):
        _check_not_batch(fn, name, x)
        check_tensor(fn, name, x)
    if not (counts.shape == means.shape and m2.shape in (counts.shape, ())):
        raise ShapeError(
            f"{fn}: counts, means and m2 have shapes {tuple(counts.shape)}, {tuple(means.shape)} and "
            f"{tuple(m2.shape)}; expected one shape (one entry per part), m2 possibly a scalar (the total)"
        )
    n_i, mean_i = counts.double().flatten(), means.double().flatten()
    n, total = _over_ranks(fn, sum_over_ranks, n_i.sum(), n_i @ mean_i)
    deviation = mean_i - total / n.clamp(min=1)               # mean_i - mean
    (m2_sum,) = _over_ranks(fn, sum_over_ranks, m2.double().sum() + (n_i * deviation) @ deviation)
    denominator = n - 1 if unbiased else n
    return torch.where(denominator > 0, m2_sum.clamp(min=0) / denominator.clamp(min=1), 0.0).float()


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    sum_over_ranks: SumOverRanks | None = None,
) -> torch.Tensor:
    """Normalize ``values`` to zero mean and unit variance over the counted positions.

    ``whitened = (values - mean) / sqrt(var + eps)`` with the masked mean and (unbiased)
    variance of :func:`masked_var` over all dimensions (and over all ranks with
    ``sum_over_ranks``); with ``shift_mean=False`` the mean is added back.

    Args:
        values: [...] float tensor.
        mask: bool tensor of the shape of ``values``.
        shift_mean: subtract the mean (True) or keep it (False, as in TRL's ``whiten``).
        eps: added to the variance before the square root.
        sum_over_ranks: sums a tensor over every rank
            (``torchforge.distributed.sum_over_ranks``): whiten with the statistics of the
            whole batch over all ranks, so that N processes equal one. None: this process.

    Returns:
        float32 tensor of the shape of ``values``; 0 where ``mask`` is False. A new
        tensor: the input is not modified.

    Example:
        >>> import torch
        >>> masked_whiten(torch.tensor([1., 3., 9.]), torch.tensor([True, True, False]), eps=0.0)
        tensor([-0.7071,  0.7071,  0.0000])

    Note:
        Constant values (``var + eps == 0``) whiten to 0, not to NaN. With
        ``sum_over_ranks`` the gradient flows through this rank's share of the sums; the
        other ranks' shares are constants.
    """
    fn = "masked_whiten"
    check_non_negative(fn, "eps", eps)
    deviation, mean, var = _deviation_and_var(fn, values, mask, None, True, sum_over_ranks)
    var = var + eps
    # The inner where keeps rsqrt away from 0 so that its gradient (0 * inf) cannot be NaN.
    positive = var > 0
    scale = torch.where(positive, torch.rsqrt(torch.where(positive, var, 1.0)), 0.0).float()
    whitened = deviation * scale
    if not shift_mean:
        whitened = whitened + mean.float()
    return torch.where(mask, whitened, 0.0)


def _masked_extremum(fn: str, values, mask, dim, fill, largest: bool) -> torch.Tensor:
    if not isinstance(fill, (int, float)) or isinstance(fill, bool) or math.isnan(fill):
        raise InvalidArgumentError(f"{fn}: fill must be a number (not NaN), got {fill!r}")
    _check_not_batch(fn, "values", values)
    check_tensor(fn, "values", values)
    check_float(fn, "values", values)
    check_mask(fn, mask, "values", values)
    _check_dim(fn, dim, values)
    blank = -torch.inf if largest else torch.inf
    filled = torch.where(mask, values.float(), blank)
    if (filled.numel() == 0) if dim is None else (filled.shape[dim] == 0):
        shape = () if dim is None else filled.sum(dim).shape
        return torch.full(shape, float(fill), device=values.device)
    reduce = torch.amax if largest else torch.amin
    extremum = reduce(filled) if dim is None else reduce(filled, dim)
    return torch.where(_count(mask, dim) > 0, extremum, float(fill))


def masked_max(values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None, fill: float = 0.0) -> torch.Tensor:
    """Largest of ``values`` over the positions where ``mask`` is True.

    ``masked_max = max_{i: mask_i} values_i``, and ``fill`` where nothing is counted.

    Args:
        values: [...] float tensor.
        mask: bool tensor of the shape of ``values``.
        dim: dimension to reduce; None reduces all.
        fill: the value of an empty mask (default 0, finite). Pass ``-math.inf`` when
            the result is combined with other maxima (micro-batches, ranks:
            ``torchforge.distributed.reduce_metric_extrema``), so that an empty part
            never wins.

    Returns:
        float32 tensor: scalar, or ``values`` without ``dim``.

    Example:
        >>> import torch
        >>> masked_max(torch.tensor([[1., 9.], [5., 7.]]), torch.tensor([[True, False], [False, False]]), dim=1)
        tensor([1., 0.])

    Note:
        A maximum of maxima is exact; a mean of per-micro-batch maxima (what a token-
        weighted metric average gives) is not a maximum. The gradient goes to the
        counted position(s) holding the maximum, as with ``torch.amax``.
    """
    return _masked_extremum("masked_max", values, mask, dim, fill, largest=True)


def masked_min(values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None, fill: float = 0.0) -> torch.Tensor:
    """Smallest of ``values`` over the positions where ``mask`` is True.

    ``masked_min = min_{i: mask_i} values_i``, and ``fill`` where nothing is counted.

    Args:
        values: [...] float tensor.
        mask: bool tensor of the shape of ``values``.
        dim: dimension to reduce; None reduces all.
        fill: the value of an empty mask (default 0, finite); ``math.inf`` when the result
            is combined with other minima (see :func:`masked_max`).

    Returns:
        float32 tensor: scalar, or ``values`` without ``dim``.

    Example:
        >>> import torch
        >>> masked_min(torch.tensor([3., -1., float("nan")]), torch.tensor([True, True, False]))
        tensor(-1.)
    """
    return _masked_extremum("masked_min", values, mask, dim, fill, largest=False)


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
    _check_not_batch(fn, "per_token", per_token)
    check_tensor(fn, "per_token", per_token, ndim=2)
    check_choice(fn, "mode", mode, AGGREGATION_MODES)
    if not (isinstance(dp_size, int) and dp_size >= 1):
        raise InvalidArgumentError(f"{fn}: dp_size must be an int >= 1, got {dp_size!r}")
    num_tokens = _checked_count(fn, "num_tokens", num_tokens)
    num_sequences = _checked_count(fn, "num_sequences", num_sequences)
    masked = _masked(fn, per_token, mask, "per_token")

    if mode == "token-mean":
        if num_tokens is None and dp_size > 1:
            raise InvalidArgumentError(
                f"{fn}: dp_size={dp_size} needs num_tokens, the token count over all ranks; "
                "without it the per-rank means do not average to the global mean"
            )
        count = _count(mask) if num_tokens is None else num_tokens
        return dp_size * masked.sum() / _clamp_count(count)

    if num_sequences is None and dp_size > 1:
        raise InvalidArgumentError(
            f"{fn}: dp_size={dp_size} with mode={mode!r} needs num_sequences, the count of "
            "sequences over all ranks"
        )
    lengths = _count(mask, -1)
    count = _count(lengths) if num_sequences is None else num_sequences
    if mode == "seq-mean-token-mean":
        total = (masked.sum(-1) / lengths.clamp(min=1)).sum()
    elif mode == "seq-mean-token-sum":
        total = masked.sum()
    else:
        if norm_length is not None:
            check_positive(fn, "norm_length", norm_length, finite=True)
        total = masked.sum() / (max(per_token.shape[-1], 1) if norm_length is None else norm_length)  # T = 0: 0
    return dp_size * total / _clamp_count(count)


def _checked_count(fn: str, name: str, count):
    """A count of ``aggregate``: a number >= 0, or a scalar tensor (its value unchecked: no device sync)."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ShapeError(
                f"{fn}: {name} has shape {tuple(count.shape)}; expected a scalar, the count over every "
                "micro-batch and rank"
            )
        return count.reshape(())  # a [1] count must not make the loss [1]
    if count is not None:
        check_non_negative(fn, name, count, finite=True)
    return count


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
