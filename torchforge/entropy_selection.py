"""Token selection by entropy: train on the high-entropy minority ("forking") tokens only.

- :func:`entropy_threshold`: the entropy above which the top ``quantile`` of the counted
  tokens lie (a sorted quantile with linear interpolation, as ``torch.quantile``, of any
  size; pass every counted entropy of the step to make it global);
- :func:`high_entropy_mask`: 0/1 weights that keep the tokens at or above that threshold.

As the off-policy filters of :mod:`torchforge.corrections`, the mask is returned as float
0/1 *weights* for the losses' ``weights=`` argument, never a new mask: the token-mean
still divides by every counted token (the paper keeps DAPO's normalization), and weights
compose by multiplication. Entropies are read detached, in float32; a NaN entropy at a
counted token is never kept, and one outside the mask never leaks.

References:
    S. Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
    Reinforcement Learning for LLM Reasoning", https://arxiv.org/abs/2506.01939;
    TRL ``GRPOConfig.top_entropy_quantile``
"""

from __future__ import annotations

import math

import torch

from torchforge.errors import (
    InvalidArgumentError,
    ShapeError,
    check_float,
    check_mask,
    check_tensor,
    shape_str,
)

__all__ = [
    "entropy_threshold",
    "high_entropy_mask",
]


def _check_quantile(fn: str, quantile) -> None:
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0 < quantile <= 1:
        raise InvalidArgumentError(
            f"{fn}: quantile must be a number in (0, 1], the fraction of tokens kept (the paper: 0.2), "
            f"got {quantile!r}"
        )


def _counted_entropy(fn: str, entropy: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    check_tensor(fn, "entropy", entropy)
    check_float(fn, "entropy", entropy)
    if mask is None:
        return entropy.detach().float().reshape(-1)
    check_mask(fn, mask, "entropy", entropy)
    return entropy.detach().float()[mask]


def entropy_threshold(
    entropy: torch.Tensor, mask: torch.Tensor | None = None, *, quantile: float
) -> torch.Tensor:
    """The entropy above which the top ``quantile`` of the counted tokens lie.

    ``tau = Q_{1 - quantile}({entropy_i : mask_i})``, the (1 - quantile)-quantile with
    linear interpolation (``torch.quantile``'s default, as TRL), computed by sorting (no
    size limit). For a threshold exact over a whole optimizer step, pass every counted
    entropy of the step: ``torch.cat([e[m] for e, m in micro_batches])`` on one process,
    and ``torchforge.distributed.gather_over_ranks`` of that over ranks, with ``mask=None``.

    Args:
        entropy: [...] float token entropies (e.g. [B, T]); detached.
        mask: bool of the shape of ``entropy``, True = the token counts; None: all count.
        quantile: the fraction of tokens kept, in (0, 1] (the paper and TRL: 0.2).

    Returns:
        float32 scalar; 0 when nothing is counted; NaN when a counted entropy is NaN
        (whatever the quantile: the tokens' order is unknown).

    Example:
        >>> import torch
        >>> entropy_threshold(torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]), quantile=0.25)  # Q_0.75
        tensor(0.4000)

    References:
        S. Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
        Reinforcement Learning for LLM Reasoning", https://arxiv.org/abs/2506.01939
    """
    fn = "entropy_threshold"
    _check_quantile(fn, quantile)
    values = _counted_entropy(fn, entropy, mask).sort().values
    n = values.shape[0]
    if n == 0:
        return torch.zeros((), device=entropy.device)
    position = (1.0 - quantile) * (n - 1)
    lower, upper = values[math.floor(position)], values[math.ceil(position)]
    threshold = lower + (upper - lower) * (position - math.floor(position))
    return torch.where(values[-1].isnan(), values[-1], threshold)  # NaN sorts last: any NaN makes it NaN


def high_entropy_mask(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    quantile: float,
    threshold: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """0/1 weights that keep only the top-``quantile`` highest-entropy tokens ("forking tokens").

    ``high_entropy_mask = float(mask & (entropy >= tau))`` with
    ``tau = entropy_threshold(entropy, mask, quantile=quantile)`` unless ``threshold`` is
    given. The paper's objective is DAPO's with ``1[H_t >= tau]`` inside the token sum and
    the normalization over all tokens unchanged, so pass this as ``weights=`` of the loss
    and keep ``mask`` (as TRL multiplies its loss by the entropy mask).

    Args:
        entropy: [B, T] float entropies of the policy at each token (``token_entropy``);
            detached.
        mask: [B, T] bool, True = the token counts.
        quantile: the fraction of counted tokens kept, in (0, 1] (the paper and TRL's
            ``top_entropy_quantile``: 0.2; 1 keeps every token).
        threshold: the entropy threshold to use instead of this batch's: pass
            :func:`entropy_threshold` of every counted token of the optimizer step (all
            micro-batches, all ranks) to make the selection exact across them. ``quantile``
            is then only checked.

    Returns:
        [B, T] float32 weights in {0, 1}, detached; 0 where ``mask`` is False.

    Example:
        >>> import torch
        >>> entropy = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 9.0]])
        >>> mask = torch.tensor([[True, True, True], [True, True, False]])
        >>> high_entropy_mask(entropy, mask, quantile=0.4)  # top 40% of 5 counted: 2.0, 1.5
        tensor([[0., 1., 0.],
                [1., 0., 0.]])

    References:
        S. Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
        Reinforcement Learning for LLM Reasoning", https://arxiv.org/abs/2506.01939;
        TRL ``GRPOConfig.top_entropy_quantile``.

    Note:
        Ties at the threshold are kept (``>=``, as TRL), so slightly more than ``quantile``
        of the tokens can be kept. The paper computes the threshold over the training
        batch; TRL over each micro-batch gathered across processes; ``threshold`` gives
        the whole step's. A NaN entropy at a counted token is never kept (and, with
        ``threshold=None``, makes the sorted quantile NaN: nothing is kept).
    """
    fn = "high_entropy_mask"
    _check_quantile(fn, quantile)
    check_tensor(fn, "entropy", entropy, ndim=2)
    check_float(fn, "entropy", entropy)
    check_mask(fn, mask, "entropy", entropy)
    if threshold is None:
        threshold = entropy_threshold(entropy, mask, quantile=quantile)
    elif isinstance(threshold, torch.Tensor) and threshold.numel() != 1:
        raise ShapeError(f"{fn}: threshold has shape {shape_str(threshold)}; expected a scalar")
    return (mask & (entropy.detach().float() >= threshold)).float()
