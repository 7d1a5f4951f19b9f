"""KL-divergence estimators between the trained policy and a reference policy."""

from __future__ import annotations

import torch

from torchforge.batch import batch_args
from torchforge.errors import check_choice, check_float, check_positive, check_same_shape, check_tensor

__all__ = ["approx_kl", "KL_ESTIMATORS"]

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


@batch_args
def approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    estimator: str = "k3",
    straight_through: bool = False,
    max_log_ratio: float = 20.0,
) -> torch.Tensor:
    """Per-token sample estimate of KL(pi || ref) from the log-probs of sampled tokens.

    With ``log_ratio = clamp(log_probs - ref_log_probs, -max_log_ratio, max_log_ratio)``
    (``log pi(y) - log ref(y)`` for a token ``y ~ pi``):

    - ``k1 = log_ratio``: unbiased, high variance, can be negative.
    - ``k2 = log_ratio**2 / 2``: biased, low variance, >= 0; its gradient is the unbiased
      gradient of KL(pi || ref) for on-policy samples.
    - ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased, low variance, >= 0 (Schulman).
    - ``abs = |log_ratio|``.

    ``straight_through=True`` returns the value of the chosen estimator with the gradient
    of k2: ``est + k2 - k2.detach()``. ``weights`` (importance weights pi / pi_old for
    samples drawn from an older policy) multiply the estimate and are detached.

    Args:
        log_probs: [B, T] float log pi of the sampled tokens.
        ref_log_probs: [B, T] float log ref of the same tokens.
        weights: optional [B, T] importance weights; detached.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``.
        straight_through: take the gradient from k2 whatever the estimator.
        max_log_ratio: clamp on ``|log_ratio|`` so that ``exp`` never overflows.

    Returns:
        [B, T] float32 per-token estimates (reduce them with ``aggregate``).

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> approx_kl(lp, lp)
        tensor([[0., 0.]])

    References:
        J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html;
        "On a few pitfalls in KL divergence gradient estimation for RL",
        https://arxiv.org/abs/2506.09477
    """
    fn = "approx_kl"
    check_tensor(fn, "log_probs", log_probs)
    check_float(fn, "log_probs", log_probs)
    check_same_shape(fn, "ref_log_probs", ref_log_probs, "log_probs", log_probs)
    check_float(fn, "ref_log_probs", ref_log_probs)
    check_choice(fn, "estimator", estimator, KL_ESTIMATORS)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    log_ratio = (log_probs.float() - ref_log_probs.float()).clamp(-max_log_ratio, max_log_ratio)
    k2 = 0.5 * log_ratio**2
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = k2
    elif estimator == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        kl = log_ratio.abs()
    if straight_through:
        kl = kl.detach() + k2 - k2.detach()
    if weights is not None:
        check_same_shape(fn, "weights", weights, "log_probs", log_probs)
        kl = weights.detach().float() * kl
    return kl
