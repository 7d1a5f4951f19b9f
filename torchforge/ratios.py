"""Importance ratios between two policies on the sampled tokens, and their statistics.

``log_ratio = log_probs - other_log_probs`` on the counted tokens (exactly 0 elsewhere),
per token or per sequence, where a sequence's log-ratio is the mean of its tokens' (the
geometric mean of the token ratios, length-normalized: GSPO's ratio, and the
``"sequence"`` level of the off-policy corrections). The losses weigh by
:func:`policy_ratio`, pi / pi_old; :mod:`torchforge.corrections` by pi_old / pi_rollout,
from the same log-ratio.

Because the log-ratio is exactly 0 where ``mask`` is False, every ratio the losses weigh
tokens by is exactly 1 there: a clip never fires, ``ratio - 1`` and k3 are 0, so the loss
metrics' counts and sums are plain sums over the batch (see :func:`ratio_metrics`).

The pieces every policy loss shares are public here: :func:`clamp_log_ratio` (the clamp
before ``exp``), :func:`sequence_log_ratio` (GSPO-token's sequence log-ratio) and
:func:`ratio_metrics` (the ratio statistics each loss reports).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchforge.batch import batch_args
from torchforge.errors import (
    ShapeError,
    check_choice,
    check_float,
    check_log_probs,
    check_positive,
    check_same_shape,
    check_tensor,
    reraise_as,
    shape_str,
)
from torchforge.reduce import masked_max, masked_mean, masked_min

__all__ = ["RATIO_LEVELS", "clamp_log_ratio", "policy_ratio", "ratio_metrics", "sequence_log_ratio"]

RATIO_LEVELS = ("token", "sequence")


def _masked_log_ratio(log_probs, other_log_probs, mask) -> torch.Tensor:
    """``log_probs - other_log_probs`` in float32 (``other_log_probs`` detached), exactly 0
    where ``mask`` is False.

    ``torch.where`` (not a product with the mask) also zeroes the *gradient* there, so a
    NaN at a masked position reaches neither the loss nor ``log_probs.grad``.
    """
    return torch.where(mask, log_probs.float() - other_log_probs.detach().float(), 0.0)


def clamp_log_ratio(log_ratio: torch.Tensor, *, max_log_ratio: float = 20.0) -> torch.Tensor:
    """The log-ratio clamped before ``exp``, so that every ratio stays finite.

    ``clamp(log_ratio, -max_log_ratio, max_log_ratio)``; zero gradient where clamped.

    Args:
        log_ratio: [B, T] (any shape) float log-ratio, e.g. ``log_probs - old_log_probs``.
        max_log_ratio: the bound; > 0.

    Returns:
        float tensor of the shape of ``log_ratio``.

    Example:
        >>> import torch
        >>> clamp_log_ratio(torch.tensor([-50.0, 0.5, 50.0]))
        tensor([-20.0000,   0.5000,  20.0000])

    Note:
        The clamp at 20 is verl's; TRL does not clamp. Written as ``hardtanh`` (the same
        clamp) because its backward is one elementwise kernel where ``torch.clamp``'s is
        several.
    """
    fn = "clamp_log_ratio"
    check_tensor(fn, "log_ratio", log_ratio)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    return F.hardtanh(log_ratio, -max_log_ratio, max_log_ratio)


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token's sequence log-ratio: the row's mean log-ratio, with each token's gradient.

    ``l_b = sum_t log_ratio_bt mask_bt / n_b`` (``n_b = sum_t mask_bt``) and
    ``seq_log_ratio_bt = sg(l_b) + log_ratio_bt - sg(log_ratio_bt)``: its value is ``l_b``
    at every position of row b, its gradient w.r.t. ``log_ratio_bt`` is 1, as in the token
    case. ``exp`` of it is the GSPO-token ratio of :func:`policy_ratio`.

    Args:
        log_ratio: [B, T] float token log-ratio (carries grad).
        mask: [B, T] bool, True = the token counts.

    Returns:
        [B, T] float32; ``l_b`` on every position of row b (0 for a row with no counted token).

    Example:
        >>> import torch
        >>> lr = torch.tensor([[1.0, 0.0, 5.0]], requires_grad=True)
        >>> s = sequence_log_ratio(lr, torch.tensor([[True, True, False]]))
        >>> s.detach()                        # (1 + 0) / 2 everywhere
        tensor([[0.5000, 0.5000, 0.5000]])
        >>> s[0, 0].backward(); lr.grad       # the token's own gradient
        tensor([[1., 0., 0.]])

    References:
        GSPO (sequence ratio and GSPO-token), https://arxiv.org/abs/2507.18071
    """
    fn = "sequence_log_ratio"
    check_tensor(fn, "log_ratio", log_ratio, ndim=2)
    with reraise_as(fn):  # masked_mean checks the mask
        row_mean = masked_mean(log_ratio.detach(), mask, dim=-1).unsqueeze(-1)
    return row_mean + (log_ratio.float() - log_ratio.detach().float())


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
    check_log_probs(fn, log_probs, mask, old_log_probs=old_log_probs)
    check_choice(fn, "level", level, RATIO_LEVELS)
    check_positive(fn, "max_log_ratio", max_log_ratio)
    log_ratio = _masked_log_ratio(log_probs, old_log_probs, mask)
    if level == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, mask)
    return torch.exp(clamp_log_ratio(log_ratio, max_log_ratio=max_log_ratio))


def ratio_metrics(
    log_ratio: torch.Tensor,
    ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    weighing_ratio: torch.Tensor | None = None,
    num_tokens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The ratio statistics every policy loss reports, over the counted tokens.

    With ``N`` the counted tokens, ``log_ratio`` the (clamped) token log-ratio
    ``log pi - log pi_old``, 0 where ``mask`` is False, and ``ratio = exp(log_ratio)``, so
    1 there:

    ``approx_kl = sum(ratio - 1 - log_ratio) / N``, the k3 estimate of KL(pi_old || pi) on
    tokens sampled from pi_old; with ``w = weighing_ratio`` (the ratio the loss weighs
    tokens by, when it is not the token ratio: GSPO's, GMPO's sequence ratio), else
    ``w = ratio``: ``ratio_mean = sum(w * mask) / N``, ``ratio_min`` and ``ratio_max`` the
    masked min and max of ``w``. All 0 on an empty mask.

    Args:
        log_ratio: [B, T] float clamped token log-ratio, 0 where ``mask`` is False.
        ratio: [B, T] float ``exp(log_ratio)``.
        mask: [B, T] bool, True = the token counts.
        weighing_ratio: optional [B, T] or [B, 1] (one per sequence) float ratio the loss
            weighs tokens by.
        num_tokens: ``count_nonzero(mask)`` when the caller has counted it already (a loss
            that divides its own metrics by it); None counts it here.

    Returns:
        dict of detached float32 scalars: ``approx_kl``, ``ratio_mean``, ``ratio_min``,
        ``ratio_max`` (combine ``ratio_min`` / ``ratio_max`` over micro-batches and ranks
        with min / max, the others as token-weighted means).

    Example:
        >>> import torch
        >>> log_ratio = torch.tensor([[0.5, -0.5, 0.0]])   # the last token is masked
        >>> m = ratio_metrics(log_ratio, log_ratio.exp(), torch.tensor([[True, True, False]]))
        >>> m["ratio_max"], m["ratio_min"]
        (tensor(1.6487), tensor(0.6065))
        >>> m["approx_kl"]                    # (e^0.5 - 1.5 + e^-0.5 - 0.5) / 2
        tensor(0.1276)

    Note:
        ``approx_kl`` and, without ``weighing_ratio``, ``ratio_mean`` are plain sums over
        the batch: they rely on ``log_ratio`` being 0 (and ``ratio`` 1) where nothing is
        counted, as every log-ratio of the losses is.
    """
    fn = "ratio_metrics"
    check_tensor(fn, "log_ratio", log_ratio, ndim=2)
    check_float(fn, "log_ratio", log_ratio)
    check_same_shape(fn, "ratio", ratio, "log_ratio", log_ratio)
    check_float(fn, "ratio", ratio)
    if weighing_ratio is not None:
        check_tensor(fn, "weighing_ratio", weighing_ratio, ndim=2)
        check_float(fn, "weighing_ratio", weighing_ratio)
        if weighing_ratio.shape not in (log_ratio.shape, log_ratio.shape[:1] + (1,)):
            B, T = log_ratio.shape
            raise ShapeError(
                f"{fn}: weighing_ratio has shape {shape_str(weighing_ratio)} but log_ratio has shape "
                f"{shape_str(log_ratio)}; expected ({B}, {T}) or ({B}, 1)"
            )
    with torch.no_grad():
        w = ratio if weighing_ratio is None else weighing_ratio.expand(log_ratio.shape)
        with reraise_as(fn):  # masked_min and masked_max check the mask
            ratio_min, ratio_max = masked_min(w, mask), masked_max(w, mask)
        num_tokens = torch.count_nonzero(mask) if num_tokens is None else num_tokens
        count = num_tokens.clamp(min=1)
        excess = ratio.float() - 1                             # 0 where masked
        approx_kl = (excess - log_ratio.float()).sum() / count  # k3 = ratio - 1 - log ratio
        if weighing_ratio is None:
            ratio_sum = excess.sum() + num_tokens              # ratio is 1 where masked
        else:
            ratio_sum = torch.where(mask, w.float(), 0.0).sum()
        return {"approx_kl": approx_kl, "ratio_mean": ratio_sum / count, "ratio_min": ratio_min,
                "ratio_max": ratio_max}
