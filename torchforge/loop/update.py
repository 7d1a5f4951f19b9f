"""One optimizer step: micro-batches of whole groups (by rows or by a token budget), exact
gradient accumulation, clipping.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import torch

from torchforge.batch import Batch
from torchforge.distributed import global_counts, reduce_metric_extrema, world_size
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
    whose largest token count is the smallest possible."""
    if not units:
        return []
    low, high = max(units), sum(units)
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
