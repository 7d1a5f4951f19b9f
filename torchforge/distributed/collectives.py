"""Collectives that make a step exact across ranks: global counts, sums for the masked
statistics of :mod:`torchforge.reduce`, and metrics reduced as sums or as extrema.

Every function is the identity in a single process (no process group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchforge.distributed.process_group import _collective_device, is_distributed
from torchforge.errors import InvalidArgumentError, check_mask, check_tensor
from torchforge.reduce import masked_whiten

# --- exact counts and metrics ------------------------------------------------------------

def global_counts(masks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and sequence counts of one whole optimizer step, over micro-batches and ranks.

    ``num_tokens = sum_ranks sum_micro sum_bt mask_bt`` and
    ``num_sequences = sum_ranks sum_micro sum_b [sum_t mask_bt > 0]``, with one
    ``all_reduce`` (SUM) of a 2-element tensor. Pass them to
    ``Aggregation(mode, num_tokens=..., num_sequences=..., dp_size=world_size())`` for
    every micro-batch of the step: summing the micro-batch losses (gradient accumulation)
    and averaging over ranks (DDP / FSDP) then gives exactly the single-process loss.

    Args:
        masks: the [B, T] bool masks of every micro-batch of this optimizer step on this
            rank (B and T may differ between micro-batches). Every rank must call this the
            same number of times (it is a collective).

    Returns:
        ``(num_tokens, num_sequences)``: two int64 scalars, identical on every rank, on
        the device of the masks (the CUDA device under nccl).

    Example:
        >>> import torch
        >>> m1 = torch.tensor([[True, True, False], [False, False, False]])
        >>> m2 = torch.tensor([[True, False, False]])
        >>> global_counts([m1, m2])  # 3 tokens, 2 non-empty sequences
        (tensor(3), tensor(2))

    Note:
        A sequence with no counted token is not counted, as in ``aggregate``'s
        ``seq-*`` modes (a row dropped whole by a filter does not dilute the loss).
    """
    fn = "global_counts"
    if isinstance(masks, torch.Tensor):
        masks = [masks]
    if len(masks) == 0:
        raise InvalidArgumentError(
            f"{fn}: masks is empty; expected the [B, T] masks of the micro-batches of one step"
        )
    device = None
    counts = None
    for i, mask in enumerate(masks):
        check_tensor(fn, f"masks[{i}]", mask, ndim=2)
        check_mask(fn, mask, f"masks[{i}]", mask)
        if device is None:
            device = _collective_device(mask.device)
            counts = torch.zeros(2, dtype=torch.int64, device=device)
        counts[0] += mask.sum().to(device)
        counts[1] += mask.any(-1).sum().to(device)
    if is_distributed():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts[0], counts[1]


def reduce_metric_sums(sums: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
    """Sum scalar metrics over ranks in one collective (the identity in a single process).

    ``out[k] = sum_ranks sums[k]``. Reduce sums and counts, then divide: the mean of a
    metric over all ranks is ``out["reward_sum"] / out["reward_count"]``, not a mean of
    per-rank means (which is wrong when ranks hold different numbers of tokens).

    Args:
        sums: name -> scalar tensor (or Python number). Every rank must pass the same keys
            in the same order (the values are stacked into one tensor).

    Returns:
        dict with the same keys; float64 scalars on the CPU, detached, identical on every
        rank.

    Example:
        >>> import torch
        >>> reduce_metric_sums({"reward_sum": torch.tensor(3.0), "count": torch.tensor(2)})
        {'reward_sum': tensor(3., dtype=torch.float64), 'count': tensor(2., dtype=torch.float64)}
    """
    fn = "reduce_metric_sums"
    if not isinstance(sums, dict):
        raise InvalidArgumentError(f"{fn}: sums must be a dict of scalars, got {type(sums).__name__}")
    if not sums:
        return {}
    values = []
    for key, value in sums.items():
        value = torch.as_tensor(value).detach()
        if value.numel() != 1:
            raise InvalidArgumentError(
                f"{fn}: sums[{key!r}] has shape {tuple(value.shape)}; expected a scalar"
            )
        values.append(value.reshape(()).to("cpu", torch.float64))
    stacked = torch.stack(values)
    if is_distributed():
        device = _collective_device(torch.device("cpu"))
        on_device = stacked.to(device)
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
        stacked = on_device.cpu()
    return dict(zip(sums.keys(), stacked.unbind(0)))


def reduce_metric_extrema(
    maxima: dict[str, torch.Tensor | float], minima: dict[str, torch.Tensor | float]
) -> dict[str, torch.Tensor]:
    """Reduce metrics that are maxima (or minima) over ranks, in one collective.

    ``out[k] = max_ranks maxima[k]`` and ``out[k] = min_ranks minima[k]`` (one
    ``all_reduce`` MAX of the maxima and the negated minima). Metrics such as
    ``ratio_max`` / ``ratio_min`` must be reduced this way: a token-weighted mean of
    per-micro-batch maxima is not the maximum of the batch. Over the micro-batches of one
    rank, take ``max`` / ``min`` of the values before calling this.

    Args:
        maxima: name -> scalar (tensor or number) to take the maximum of. A rank (or a
            micro-batch) with nothing counted passes ``-inf``
            (``masked_max(..., fill=-math.inf)``), which never wins.
        minima: name -> scalar to take the minimum of; ``+inf`` for nothing counted.
            Every rank must pass the same keys in the same order; a name may not be in
            both dicts.

    Returns:
        One dict with the keys of ``maxima`` then ``minima``; float64 scalars on the CPU,
        detached, identical on every rank. A value no rank had stays ``-inf`` / ``+inf``:
        drop it before logging or log it as "nothing counted".

    Example:
        >>> import torch
        >>> reduce_metric_extrema({"ratio_max": torch.tensor(1.5)}, {"ratio_min": 0.5})
        {'ratio_max': tensor(1.5000, dtype=torch.float64), 'ratio_min': tensor(0.5000, dtype=torch.float64)}
    """
    fn = "reduce_metric_extrema"
    for name, metrics in (("maxima", maxima), ("minima", minima)):
        if not isinstance(metrics, dict):
            raise InvalidArgumentError(f"{fn}: {name} must be a dict of scalars, got {type(metrics).__name__}")
    both = sorted(set(maxima) & set(minima))
    if both:
        raise InvalidArgumentError(f"{fn}: {both} are in both maxima and minima; expected each name in one of them")
    values = []
    for name, metrics, sign in (("maxima", maxima, 1.0), ("minima", minima, -1.0)):
        for key, value in metrics.items():
            value = torch.as_tensor(value).detach()
            if value.numel() != 1:
                raise InvalidArgumentError(
                    f"{fn}: {name}[{key!r}] has shape {tuple(value.shape)}; expected a scalar"
                )
            values.append(sign * value.reshape(()).to("cpu", torch.float64))
    if not values:
        return {}
    stacked = torch.stack(values)
    if is_distributed():
        on_device = stacked.to(_collective_device(torch.device("cpu")))
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
        stacked = on_device.cpu()
    signs = torch.tensor([1.0] * len(maxima) + [-1.0] * len(minima), dtype=torch.float64)
    return dict(zip([*maxima, *minima], (signs * stacked).unbind(0)))


class _SumOverRanks(torch.autograd.Function):
    """All-reduce SUM forward; identity backward (this rank's share of the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        total = x.detach().to(_collective_device(x.device), copy=True)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.to(x.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of ``x`` over every rank (one ``all_reduce`` SUM); ``x`` in one process.

    ``out = sum_ranks x``. Pass it as ``sum_over_ranks=`` to ``masked_mean``,
    ``masked_var`` and ``masked_whiten`` (and the advantage estimators that take it) to get
    the statistics of the whole batch over all ranks. Every rank must call it (it is a
    collective) with a tensor of the same shape and dtype.

    Args:
        x: tensor of any shape (the statistics pass a [K] float64 tensor of sums).

    Returns:
        A new tensor of the shape, dtype and device of ``x`` (moved to the CUDA device for
        the collective under nccl, and back). In a single process, ``x`` itself.

    Example:
        >>> import torch
        >>> from torchforge.reduce import masked_var
        >>> masked_var(torch.tensor([1., 3.]), torch.tensor([True, True]), sum_over_ranks=sum_over_ranks)
        tensor(2.)

    Note:
        The gradient of ``out`` with respect to ``x`` is the identity: the gradient flows
        through this rank's share of the sum, the other ranks' shares are constants, and
        no collective runs in the backward pass.
    """
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(f"sum_over_ranks: x must be a torch.Tensor, got {type(x).__name__}")
    if not is_distributed():
        return x
    return _SumOverRanks.apply(x)


def gather_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The 1-D ``values`` of every rank, concatenated in rank order (lengths may differ).

    ``out = cat(values_rank0, values_rank1, ...)``, with one ``all_reduce`` of the lengths
    and one ``all_gather`` of the values padded to the longest. Use it for statistics that
    are not sums, such as the entropy quantile of
    :func:`torchforge.entropy_selection.entropy_threshold`.

    Args:
        values: [N] tensor (N may differ between ranks; dtypes must agree).

    Returns:
        [sum of N over ranks] tensor on the device of ``values``; ``values`` in one process.

    Example:
        >>> import torch
        >>> gather_over_ranks(torch.tensor([1., 2.]))
        tensor([1., 2.])
    """
    fn = "gather_over_ranks"
    check_tensor(fn, "values", values, ndim=1)
    if not is_distributed():
        return values
    device = _collective_device(values.device)
    lengths = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    lengths[dist.get_rank()] = values.shape[0]
    dist.all_reduce(lengths, op=dist.ReduceOp.SUM)
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=values.dtype, device=device)
    padded[: values.shape[0]] = values.detach().to(device)
    gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:n] for g, n in zip(gathered, lengths.tolist())]).to(values.device)


def whiten_over_ranks(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """``masked_whiten`` with the mean and variance of the whole batch over all ranks.

    ``masked_whiten(values, mask, eps=eps, sum_over_ranks=sum_over_ranks)``:
    ``(values - mean) / sqrt(var + eps)`` at counted positions (0 elsewhere), where ``mean``
    and the unbiased ``var`` are those of every counted value on every rank (two float64
    passes, each sum all-reduced). Whitening each rank's shard on its own would give each
    rank different statistics, and the update would depend on the number of processes.

    Args:
        values: [B, T] float values of this rank (e.g. GAE advantages).
        mask: [B, T] bool, True = the value counts.
        eps: added to the variance before the square root, >= 0.

    Returns:
        float32 [B, T]; in a single process, ``masked_whiten(values, mask, eps=eps)``.

    Example:
        >>> import torch
        >>> whiten_over_ranks(torch.tensor([[1., 3., 9.]]), torch.tensor([[True, True, False]]), eps=0.0)
        tensor([[-0.7071,  0.7071,  0.0000]])
    """
    return masked_whiten(values, mask, eps=eps, sum_over_ranks=sum_over_ranks)
