"""One optimizer step: micro-batches of whole groups, exact gradient accumulation, clipping.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import torch

from torchforge.batch import Batch
from torchforge.distributed import global_counts, world_size
from torchforge.errors import InvalidArgumentError
from torchforge.reduce import Aggregation

# --- the update ----------------------------------------------------------------------------

def micro_batches(batch: Batch, size: int) -> Iterator[Batch]:
    """Consecutive slices of ``size`` rows (the last one may be shorter).

    Args:
        batch: a Batch of B rows.
        size: rows per micro-batch, >= 1.

    Returns:
        An iterator of Batch views.

    Example:
        >>> batch = Batch(mask=torch.ones(5, 2, dtype=torch.bool), batch_size=[5])
        >>> [part.batch_size[0] for part in micro_batches(batch, 2)]
        [2, 2, 1]
    """
    if not (isinstance(size, int) and size >= 1):
        raise InvalidArgumentError(f"micro_batches: size must be an int >= 1, got {size!r}")
    for start in range(0, batch.batch_size[0], size):
        yield batch[start:start + size]


def accumulate_gradients(
    parts: Sequence[Batch],
    loss_fn: Callable[[Batch, Aggregation], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    *,
    mode: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward every micro-batch of one optimizer step, with exact aggregation.

    The token and sequence counts of the whole step (all micro-batches, all ranks) are
    all-reduced once (:func:`torchforge.distributed.global_counts`) and handed to every
    micro-batch's loss as an ``Aggregation``: the accumulated gradient, averaged over ranks
    by DDP / FSDP, is then the gradient of the whole batch's loss in one process.

    Args:
        parts: the micro-batches of this step on this rank (each with ``mask``).
        loss_fn: ``(micro_batch, aggregation) -> (loss, metrics)``; it runs the forward.
        mode: the aggregation mode.
        norm_length: constant length of ``seq-mean-token-sum-norm``.

    Returns:
        ``(loss, metrics)``: the step's loss on this rank (the sum over micro-batches,
        detached) and, per metric, its token-weighted sum over micro-batches divided by
        this rank's tokens (local means; reduce across ranks as sums for logging). A
        metric named ``*_max`` / ``*_min`` (:func:`metric_reduction`) is an extreme: its
        max / min over the micro-batches with counted tokens (``-inf`` / ``+inf`` when
        none has any; reduce across ranks with
        :func:`torchforge.distributed.reduce_metric_extrema`). A metric named ``*_loss``
        is a term of the loss, aggregated as the loss is: summed over micro-batches like
        the loss (over ranks: summed, then divided by the number of ranks, as the loss).

    Example:
        >>> w = torch.nn.Parameter(torch.tensor(2.0))
        >>> batch = Batch(mask=torch.tensor([[True, True], [True, False]]), batch_size=[2])
        >>> loss_fn = lambda part, agg: (agg(w * part.mask.float(), part.mask), {})
        >>> loss, _ = accumulate_gradients(list(micro_batches(batch, 1)), loss_fn)
        >>> loss, w.grad   # token-mean over the 3 tokens of both micro-batches: 2 * 3 / 3
        (tensor(2.), tensor(1.))
    """
    num_tokens, num_sequences = global_counts([p.mask for p in parts])
    aggregation = Aggregation(mode, num_tokens=num_tokens, num_sequences=num_sequences,
                              dp_size=world_size(), norm_length=norm_length)
    total = torch.zeros((), dtype=torch.float32)
    combined: dict[str, torch.Tensor] = {}
    local_tokens = sum(int(p.mask.sum()) for p in parts)
    for part in parts:
        loss, metrics = loss_fn(part, aggregation)
        loss.backward()
        total += loss.detach().float().cpu()
        weight = int(part.mask.sum())
        for key, value in metrics.items():
            value = torch.as_tensor(value).detach().float().cpu()
            kind = metric_reduction(key)
            if kind == "mean":
                combined[key] = combined.get(key, 0.0) + weight * value
            elif kind == "sum":
                combined[key] = combined.get(key, 0.0) + value
            else:  # an empty micro-batch's extreme is a fill value, not a token's: it never wins
                fill = torch.tensor(-math.inf if kind == "max" else math.inf)
                value = value if weight else fill
                combined[key] = (torch.maximum if kind == "max" else torch.minimum)(combined.get(key, fill), value)
    return total, {k: v / max(local_tokens, 1) if metric_reduction(k) == "mean" else v for k, v in combined.items()}


def metric_reduction(name: str) -> str:
    """How a loss metric combines over micro-batches and ranks: "max", "min", "sum" or "mean".

    A metric named ``*_max`` (``ratio_max``) is a maximum and ``*_min`` a minimum: a mean
    of per-micro-batch maxima is not the maximum of the batch. A metric named ``*_loss``
    (PPO's ``pg_loss``, ``value_loss``) is a term of the loss, computed with the step's
    global counts as the loss is: each micro-batch's value is its share, so the shares add
    up (a token-weighted mean of them would depend on the micro-batch size). Every other
    metric is a mean over counted tokens, combined as a token-weighted mean.

    Args:
        name: the metric's name.

    Returns:
        "max", "min", "sum" or "mean".

    Example:
        >>> [metric_reduction(k) for k in ("ratio_max", "ratio_min", "value_loss", "clip_frac_low")]
        ['max', 'min', 'sum', 'mean']
    """
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    if name.endswith("_loss"):
        return "sum"
    return "mean"


def optimizer_step(
    parameters: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    max_grad_norm: float | None = 1.0,
) -> float:
    """Clip the global gradient norm, step the optimizer (and scheduler), zero the gradients.

    Args:
        parameters: the trained parameters (plain or FSDP2 DTensors).
        optimizer: the optimizer.
        scheduler: an LR scheduler, or None.
        max_grad_norm: clip threshold; None disables clipping (the norm is still measured).

    Returns:
        The gradient norm before clipping (over all ranks' shards).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> optimizer_step([w], torch.optim.SGD([w], lr=0.1), max_grad_norm=1.0)
        5.0
    """
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, math.inf if max_grad_norm is None else max_grad_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
