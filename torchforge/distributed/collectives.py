"""Collectives that make a step exact across ranks: global counts and summed metrics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchforge.distributed.process_group import _collective_device, is_distributed
from torchforge.errors import InvalidArgumentError, check_mask, check_tensor

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



def whiten_over_ranks(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """``masked_whiten`` with the mean and variance of the whole batch over all ranks.

    ``(values - mean) / sqrt(var + eps)`` at counted positions (0 elsewhere), where ``mean``
    and the unbiased ``var`` are those of every counted value on every rank, computed in
    two passes (sum, then squared deviations) with one all-reduce each in float64. Whitening
    each rank's shard on its own would give each rank different statistics, and the
    update would depend on the number of processes.

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
    fn = "whiten_over_ranks"
    check_tensor(fn, "values", values)
    check_mask(fn, mask, "values", values)
    if not eps >= 0:
        raise InvalidArgumentError(f"{fn}: eps must be >= 0, got {eps!r}")
    x = torch.where(mask, values.double(), 0.0)
    first = reduce_metric_sums({"n": mask.sum(), "sum": x.sum()})
    n = first["n"]
    mean = first["sum"] / n.clamp(min=1)
    deviation = torch.where(mask, x - mean.to(x.device), 0.0)
    var = reduce_metric_sums({"sq": (deviation ** 2).sum()})["sq"] / (n - 1).clamp(min=1)
    var = var if n > 1 else torch.zeros((), dtype=torch.float64)
    scale = torch.rsqrt(var + eps) if var + eps > 0 else torch.zeros((), dtype=torch.float64)
    return (deviation * scale.to(x.device)).float()
