"""One optimizer step: micro-batches of whole groups (by rows or by a token budget), exact
gradient accumulation, clipping.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import torch

from torchforge.batch import Batch
from torchforge.distributed import global_counts, reduce_metric_extrema, world_size
from torchforge.loop.metrics import Metric, StepMetrics, metric_reduction
from torchforge.errors import InvalidArgumentError, ShapeError, shape_str
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


def sequence_tokens(batch: Batch) -> torch.Tensor:
    """Tokens a forward runs for each row: its real prompt tokens and its completion up to
    the last counted token, ``n_b + L_b`` (:func:`torchforge.loop.completion_lengths`).

    Args:
        batch: a Batch with ``prompt_mask`` [B, P] and ``mask`` [B, T].

    Returns:
        [B] int64.

    Example:
        >>> batch = Batch(prompt_mask=torch.tensor([[False, True], [True, True]]),
        ...               mask=torch.tensor([[True, False, True], [True, False, False]]), batch_size=[2])
        >>> sequence_tokens(batch)
        tensor([4, 3])
    """
    from torchforge.loop.packing import completion_lengths

    return batch.prompt_mask.bool().sum(-1) + completion_lengths(batch.mask.bool())


def _parts_needed(units: list[int], limit: int) -> int:
    """Contiguous parts of at most ``limit`` tokens (a unit above it alone) that ``units`` needs."""
    parts, used = 0, 0
    for u in units:
        if parts == 0 or used + u > limit:
            parts, used = parts + 1, u
        else:
            used += u
    return parts


def _split(units: list[int], limit: int) -> list[list[int]]:
    """The greedy contiguous split of unit indices into parts of at most ``limit`` tokens."""
    parts: list[list[int]] = []
    used = 0
    for i, u in enumerate(units):
        if not parts or used + u > limit:
            parts.append([i])
            used = u
        else:
            parts[-1].append(i)
            used += u
    return parts


def _balanced_split(units: list[int], k: int) -> list[list[int]]:
    """Unit indices in exactly ``k`` contiguous parts (fewer only if there are fewer units)
    under the least limit that k parts can keep, a unit above it being a part of its own:
    a group above the budget never lets its neighbours' part grow past the budget too."""
    if not units:
        return []
    low, high = 0, sum(units)
    while low < high:  # the least limit that k contiguous parts can keep
        mid = (low + high) // 2
        low, high = (low, mid) if _parts_needed(units, mid) <= k else (mid + 1, high)
    parts = _split(units, low)
    while len(parts) < k:  # split the largest part that can be split, at its most even point
        size = [sum(units[i] for i in part) if len(part) > 1 else -1 for part in parts]
        j = max(range(len(parts)), key=lambda p: size[p])
        if size[j] < 0:
            break
        part = parts[j]
        cut = min(range(1, len(part)), key=lambda c: max(sum(units[i] for i in part[:c]),
                                                         sum(units[i] for i in part[c:])))
        parts[j:j + 1] = [part[:cut], part[cut:]]
    return parts


def micro_batches_by_tokens(batch: Batch, max_tokens: int, *, group_size: int = 1) -> list[Batch]:
    """Consecutive micro-batches of whole groups, each up to ``max_tokens`` tokens, the same
    number on every data-parallel rank.

    A row's tokens are :func:`sequence_tokens` (real prompt tokens plus the completion up
    to its last counted token: what a padding-free forward runs). Each rank needs
    ``k_r`` = the fewest consecutive parts of at most ``max_tokens`` tokens (a group above
    the budget is a part of its own); every rank then splits its groups into exactly
    ``k = max_r k_r`` consecutive parts (one all-reduce MAX) whose largest token count is
    the smallest possible, so that every rank runs the same number of forwards and
    backwards (as FSDP / DDP need) and the tokens are spread evenly over them. Rows keep
    their order: concatenating the parts gives the batch back. With the global token counts
    of :func:`accumulate_gradients` the loss is exact whatever the split.

    Args:
        batch: a Batch of B rows with ``prompt_mask`` [B, P] and ``mask`` [B, T].
        max_tokens: the token budget of a micro-batch, >= 1.
        group_size: rows per group (G), kept together; B must be a multiple of it.

    Returns:
        A list of ``k`` Batch views (a rank with fewer groups than ``k`` gets empty ones at
        the end: they still run a forward).

    Example:
        >>> mask = torch.arange(6) < torch.tensor([6, 2, 2, 1, 3])[:, None]  # completions of 6, 2, 2, 1, 3 tokens
        >>> batch = Batch(prompt_mask=torch.ones(5, 2, dtype=torch.bool), mask=mask, batch_size=[5])
        >>> [part.batch_size[0] for part in micro_batches_by_tokens(batch, 10)]   # 8 | 4 + 4 | 3 + 5 tokens
        [1, 2, 2]
    """
    fn = "micro_batches_by_tokens"
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidArgumentError(f"{fn}: max_tokens={max_tokens!r}; expected an int >= 1")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise InvalidArgumentError(f"{fn}: group_size={group_size!r}; expected an int >= 1")
    B = batch.batch_size[0]
    if B % group_size:
        raise ShapeError(f"{fn}: the batch has {B} rows, not a multiple of group_size={group_size}; "
                         "expected whole groups")
    if batch.mask.dim() != 2 or batch.prompt_mask.dim() != 2:
        raise ShapeError(f"{fn}: mask {shape_str(batch.mask)}, prompt_mask {shape_str(batch.prompt_mask)}; "
                         "expected [B, T] and [B, P]")
    units = sequence_tokens(batch).view(-1, group_size).sum(-1).tolist() if B else []
    k = max(_parts_needed(units, max_tokens), 1)
    if world_size() > 1:  # the same number of micro-batches on every rank
        k = int(reduce_metric_extrema({"parts": float(k)}, {})["parts"])
    parts = _balanced_split(units, k)
    out = [batch[part[0] * group_size:(part[-1] + 1) * group_size] for part in parts]
    return out + [batch[B:B] for _ in range(k - len(out))]


def accumulate_gradients(
    parts: Sequence[Batch],
    loss_fn: Callable[[Batch, Aggregation], tuple[torch.Tensor, dict[str, Any]]],
    *,
    mode: str = "token-mean",
    norm_length: int | None = None,
    metrics: StepMetrics | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward every micro-batch of one optimizer step, with exact aggregation.

    The token and sequence counts of the whole step (all micro-batches, all ranks) are
    all-reduced once (:func:`torchforge.distributed.global_counts`) and handed to every
    micro-batch's loss as an ``Aggregation``: the accumulated gradient, averaged over ranks
    by DDP / FSDP, is then the gradient of the whole batch's loss in one process.

    Args:
        parts: the micro-batches of this step on this rank (each with ``mask``).
        loss_fn: ``(micro_batch, aggregation) -> (loss, metrics)``; it runs the forward.
            Its metrics are scalar tensors, reduced as their names say
            (:func:`~torchforge.loop.metrics.metric_reduction`), or
            :class:`~torchforge.loop.metrics.Metric` values stating their reduction.
        mode: the aggregation mode.
        norm_length: constant length of ``seq-mean-token-sum-norm``.
        metrics: a :class:`~torchforge.loop.metrics.StepMetrics` to accumulate the metrics
            into (each micro-batch weighted by its counted tokens); default: a new one.

    Returns:
        ``(loss, metrics)``: this rank's share of the step's loss (the sum over
        micro-batches, detached; the ranks' shares average to the loss) and
        ``metrics.local()``: token-weighted means over the micro-batches, the extreme of
        the micro-batches with counted tokens for ``*_max`` / ``*_min`` (``-inf`` /
        ``+inf`` when none has any), and for a term of the loss (``*_loss``, computed with
        the global counts, as the loss) this rank's share: summed over micro-batches and
        divided by the number of ranks, so that the ranks' shares add up to the term.
        Nothing leaves the device: :meth:`~torchforge.loop.metrics.StepMetrics.reduce`
        combines the ranks once.

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
    metrics = metrics if metrics is not None else StepMetrics()
    total = None
    for part in parts:
        loss, part_metrics = loss_fn(part, aggregation)
        loss.backward()
        total = loss.detach().float() if total is None else total + loss.detach().float()
        tokens = torch.count_nonzero(part.mask)
        for key, value in part_metrics.items():
            if not isinstance(value, Metric) and metric_reduction(key) == "sum":  # a loss term: its rank's share
                value = torch.as_tensor(value) / aggregation.dp_size
            metrics.add(key, value, weight=tokens)
    total = torch.zeros((), dtype=torch.float32) if total is None else total
    return total, metrics.local()


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
