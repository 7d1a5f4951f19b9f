"""The critic's loss: PPO's clipped value regression.

Same contract as :mod:`torchforge.losses`: ``(loss, metrics)``, float32, the
``aggregation`` argument, nothing from masked positions, 0 on an empty batch.
"""

from __future__ import annotations

import torch

from torchforge.batch import batch_args
from torchforge.errors import (
    check_float,
    check_mask,
    check_non_negative,
    check_same_shape,
    check_tensor,
    reraise_as,
)
from torchforge.reduce import Aggregation

__all__ = ["value_loss"]


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
    ``vf_loss1 = (values - returns)**2``, ``vf_loss2 = (values_clipped - returns)**2``,
    ``vf_loss = 0.5 * max(vf_loss1, vf_loss2)`` (``0.5 * vf_loss1`` with ``clip=None``),
    ``loss = aggregate(vf_loss, mask)``.

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
        The terms are formed from the errors ``values - returns`` and ``old_values -
        returns``, which float32 subtracts exactly when the two are close (Sterbenz): with
        returns near 1e4 (an ulp of 1e-3) ``old_values + clip`` would round, the errors do not.
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

    # The equation in terms of the errors values - returns and old_values - returns, 0 where
    # masked (wheres, not products with the mask: a NaN there reaches neither the loss nor
    # the gradient); values_clipped - returns = old_error + clamp(error - old_error, ...).
    returns = returns.detach().float()
    error = torch.where(mask, values.float() - returns, 0.0)
    old_error = torch.where(mask, old_values.detach().float() - returns, 0.0)
    vf_loss1 = error**2                                         # (values - returns)**2
    if clip is None:
        vf_loss = 0.5 * vf_loss1
        metrics = {"clip_frac": torch.zeros((), device=values.device)}
    else:
        clipped_error = old_error + torch.clamp(error - old_error, -clip, clip)  # values_clipped - returns
        vf_loss2 = clipped_error**2
        vf_loss = 0.5 * torch.maximum(vf_loss1, vf_loss2)
        with torch.no_grad():
            count = torch.count_nonzero(mask).clamp(min=1)
            # never where masked: both terms are 0 there
            metrics = {"clip_frac": torch.count_nonzero(vf_loss2 > vf_loss1) / count}
    with reraise_as(fn, "aggregation"):
        loss = Aggregation.of(aggregation)(vf_loss, mask)
    return loss, metrics
