"""Importance ratios between two policies on the sampled tokens, and their statistics.

``log_ratio = log_probs - other_log_probs`` on the counted tokens (exactly 0 elsewhere),
per token or per sequence, where a sequence's log-ratio is the mean of its tokens' (the
geometric mean of the token ratios, length-normalized: GSPO's ratio, and the
``"sequence"`` level of the off-policy corrections). The losses weigh by
:func:`policy_ratio`, pi / pi_old; :mod:`torchforge.corrections` by pi_old / pi_rollout,
from the same log-ratio.

Because the log-ratio is exactly 0 where ``mask`` is False, every ratio the losses weigh
tokens by is exactly 1 there: a clip never fires, ``ratio - 1`` and k3 are 0, so the loss
metrics' counts and sums are plain sums over the batch (see :func:`_ratio_metrics`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchforge.batch import batch_args
from torchforge.errors import (
    check_choice,
    check_float,
    check_mask,
    check_positive,
    check_same_shape,
    check_tensor,
)
from torchforge.reduce import masked_max, masked_mean, masked_min, masked_sum

__all__ = ["RATIO_LEVELS", "policy_ratio"]

RATIO_LEVELS = ("token", "sequence")


def _check_log_probs(fn: str, log_probs, mask, **others) -> None:
    """``log_probs`` a float [B, T]; ``mask`` bool [B, T]; every tensor in ``others`` float [B, T]."""
    check_tensor(fn, "log_probs", log_probs, ndim=2)
    check_float(fn, "log_probs", log_probs)
    check_mask(fn, mask, "log_probs", log_probs)
    for name, x in others.items():
        check_same_shape(fn, name, x, "log_probs", log_probs)
        check_float(fn, name, x)


def _masked_log_ratio(log_probs, other_log_probs, mask) -> torch.Tensor:
    """``log_probs - other_log_probs`` in float32 (``other_log_probs`` detached), exactly 0
    where ``mask`` is False.

    ``torch.where`` (not a product with the mask) also zeroes the *gradient* there, so a
    NaN at a masked position reaches neither the loss nor ``log_probs.grad``.
    """
    return torch.where(mask, log_probs.float() - other_log_probs.detach().float(), 0.0)


def _clamp_log_ratio(log_ratio: torch.Tensor, max_log_ratio: float) -> torch.Tensor:
    """``clamp(log_ratio, -max_log_ratio, max_log_ratio)``; zero gradient where clamped.

    Written as ``hardtanh`` (the same clamp) because its backward is one elementwise
    kernel where ``torch.clamp``'s is several."""
    return F.hardtanh(log_ratio, -max_log_ratio, max_log_ratio)


def _sequence_log_ratio(log_ratio, mask) -> torch.Tensor:
    """GSPO-token: ``sg(l_b) + log_ratio - sg(log_ratio)`` with ``l_b`` the mean log-ratio
    of row b. The value is ``l_b`` at every position of row b; the gradient w.r.t.
    ``log_probs_bt`` is 1, as in the token case."""
    return masked_mean(log_ratio.detach(), mask, dim=-1).unsqueeze(-1) + (log_ratio - log_ratio.detach())


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

    Note:
        The clamp at ``max_log_ratio = 20`` is verl's; TRL does not clamp.
    """
    fn = "policy_ratio"
    _check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_choice(fn, "level", level, RATIO_LEVELS)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, mask)
    if level == "sequence":
        log_ratio = _sequence_log_ratio(log_ratio, mask)
    return torch.exp(_clamp_log_ratio(log_ratio, max_log_ratio))


def _ratio_metrics(log_ratio, ratio, mask, num_tokens, count, *, weighing_ratio=None) -> dict[str, torch.Tensor]:
    """``approx_kl``, ``ratio_mean``, ``ratio_min``, ``ratio_max`` over the counted tokens.

    ``log_ratio`` is the clamped token log-ratio, 0 where ``mask`` is False, and ``ratio``
    its ``exp``, so 1 there: ``ratio - 1`` and k3 are 0 there and their plain sums are the
    masked sums. ``num_tokens`` is ``count_nonzero(mask)``, ``count`` the same clamped at 1
    (the divisor). ``approx_kl`` is the k3 estimate of KL(pi_old || pi) on tokens sampled
    from pi_old, ``mean(ratio - 1 - log_ratio)``, always from the token ratio; the ratio
    statistics are of ``weighing_ratio`` ([B, T] or [B, 1]) when the loss weighs by
    another ratio (GSPO, GMPO), else of ``ratio``. The extrema are ``masked_min`` /
    ``masked_max`` (0 on an empty mask).
    """
    excess = ratio - 1                                          # 0 where masked
    approx_kl = (excess - log_ratio).sum() / count              # k3 = ratio - 1 - log ratio
    if weighing_ratio is None:
        weighing_ratio, ratio_sum = ratio, excess.sum() + num_tokens
    else:
        weighing_ratio = weighing_ratio.expand(mask.shape)
        ratio_sum = masked_sum(weighing_ratio, mask)
    return {"approx_kl": approx_kl, "ratio_mean": ratio_sum / count,
            "ratio_min": masked_min(weighing_ratio, mask), "ratio_max": masked_max(weighing_ratio, mask)}
