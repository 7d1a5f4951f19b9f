"""KL divergence between the trained policy and a reference policy.

Two tools:

- :func:`approx_kl`: the per-token *sample* estimates k1, k2, k3 and abs of
  KL(pi || ref) from the log-probs of the sampled tokens (what GRPO and PPO-with-KL use);
- :func:`exact_kl`: the full-vocabulary KL(pi || ref) of two sets of logits, chunked so
  that no float32 [B, T, V] tensor is ever built.
"""

from __future__ import annotations

import math

import torch

from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    ShapeError,
    check_choice,
    check_float,
    check_positive,
    check_same_shape,
    check_tensor,
    shape_str,
)
from torchforge.log_probs import _check_temperature, _chunk_rows, _row_chunks

__all__ = ["approx_kl", "exact_kl", "KL_ESTIMATORS"]

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
    - ``k2 = log_ratio**2 / 2``: biased (``E[k2] != KL`` unless pi = ref), low variance,
      >= 0.
    - ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased, low variance, >= 0 (Schulman's
      estimator; ``E_pi[exp(-log_ratio)] = sum_y ref(y) = 1`` makes the extra term
      mean-zero).
    - ``abs = |log_ratio|``: biased, >= 0.

    ``kl = weights * k`` with the ``weights`` detached: for tokens sampled from an older
    policy ``pi_old``, passing ``weights = pi / pi_old`` makes ``E_pi_old[weights * k]``
    equal ``E_pi[k]``.

    Gradients. Used as a loss on on-policy samples, the estimators do not all give the
    gradient of KL(pi || ref): ``E_pi[grad k1] = 0``; ``E_pi[grad k2] = grad KL(pi || ref)``
    (the unbiased gradient); ``E_pi[grad k3] = grad KL(ref || pi)``, the other direction.
    ``straight_through=True`` returns the value of the chosen estimator with the gradient
    of k2: ``kl = k.detach() + (k2 - k2.detach())`` (the bracket is exactly 0, so the
    value is exactly ``k``).

    Args:
        log_probs: [B, T] float log pi of the sampled tokens (any shape is accepted;
            the output has the same one).
        ref_log_probs: [B, T] float log ref of the same tokens.
        weights: optional [B, T] float importance weights; detached.
        estimator: one of ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``.
        straight_through: value of ``estimator``, gradient of k2.
        max_log_ratio: clamp on ``|log_ratio|`` so that ``exp`` never overflows (must
            be > 0; ``float("inf")`` disables it). Clamped positions get zero gradient.

    Returns:
        [B, T] float32 per-token estimates (reduce them with ``aggregate``).

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> approx_kl(lp, lp)
        tensor([[0., 0.]])
        >>> # log_ratio = log 2: k3 = 1/2 - 1 + log 2
        >>> approx_kl(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
        tensor([0.1931])

    References:
        J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html;
        k3 as the GRPO KL term: DeepSeekMath, https://arxiv.org/abs/2402.03300;
        the gradients of the estimators: Y. Tang and R. Munos, "On a few pitfalls in KL
        divergence gradient estimation for RL", https://arxiv.org/abs/2506.09477

    Note:
        The log-ratio is clamped for every estimator (k1 and k2 included), so all four
        see the same ratio; verl clamps it at +-20 for k3 only and then clamps k3 at
        +-10, which we do not. The straight-through option is verl's ``"k3+"``-style
        ``kl_loss_type``, available here for every estimator.
    """
    fn = "approx_kl"
    check_tensor(fn, "log_probs", log_probs)
    check_float(fn, "log_probs", log_probs)
    check_same_shape(fn, "ref_log_probs", ref_log_probs, "log_probs", log_probs)
    check_float(fn, "ref_log_probs", ref_log_probs)
    if weights is not None:
        check_same_shape(fn, "weights", weights, "log_probs", log_probs)
        check_float(fn, "weights", weights)
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
        kl = kl.detach() + (k2 - k2.detach())
    if weights is not None:
        kl = weights.detach().float() * kl
    return kl


def _log_softmax(x: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """``log_softmax(x / temperature)`` of one [c, V] chunk, computed in ``dtype``."""
    if temperature != 1.0:
        x = x.to(dtype, copy=True).div_(temperature)  # one buffer, no rounding in bf16
    return torch.log_softmax(x, dim=-1, dtype=dtype)


def _kl_chunk(x, y, temperature, dtype, masked=False):
    """``p``, ``log p - log q`` and ``log q`` of one [c, V] chunk (three buffers).

    ``masked=True`` applies ``0 log 0 = 0`` where ``p = 0`` (logits of -inf), which the
    fast path, run first on every row, turns into ``0 * inf = NaN``.
    """
    log_p = _log_softmax(x, temperature, dtype)
    log_q = _log_softmax(y, temperature, dtype)
    p = log_p.exp()
    diff = log_p.sub_(log_q)
    if masked:
        diff.masked_fill_(p == 0, 0.0)
    return p, diff, log_q


def _kl_rows(x, y, temperature, dtype, masked=False):
    """``KL = sum_v p_v (log p_v - log q_v)`` [c] of one [c, V] chunk."""
    p, diff, _ = _kl_chunk(x, y, temperature, dtype, masked)
    return p.mul_(diff).sum(-1)  # in place: no fourth buffer


class _ExactKL(torch.autograd.Function):
    """Full-vocabulary KL with a chunked forward and a chunked (recomputing) backward.

    Only the two inputs (and the [N] result) are saved; the backward recomputes the
    softmaxes chunk by chunk, so the only [N, V] buffers are the gradients themselves.
    Rows with -inf logits come out of the fast path as NaN; they alone are recomputed
    with ``0 log 0 = 0`` (one check over the [N] result, no cost otherwise).
    """

    @staticmethod
    def forward(ctx, logits, ref_logits, temperature, chunk_size, dtype):
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for rows in _row_chunks(logits.shape[0], chunk_size):
            out[rows] = _kl_rows(logits[rows], ref_logits[rows], temperature, dtype)
        ctx.masked_rows = torch.isnan(out).nonzero().squeeze(-1)
        for rows in _row_chunks(ctx.masked_rows, chunk_size):
            out[rows] = _kl_rows(logits[rows], ref_logits[rows], temperature, dtype, masked=True)
        # a KL near 0 can sum to a rounding residue below 0 (-4e-18 seen); KL >= 0 exactly
        out.clamp_(min=0.0)
        ctx.save_for_backward(logits, ref_logits, out)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, ref_logits, kl = ctx.saved_tensors
        need_logits, need_ref = ctx.needs_input_grad[:2]
        grad_logits = torch.empty_like(logits) if need_logits else None
        grad_ref = torch.empty_like(ref_logits) if need_ref else None
        temperature, chunk_size, dtype = ctx.temperature, ctx.chunk_size, ctx.dtype
        chunks = [(rows, False) for rows in _row_chunks(logits.shape[0], chunk_size)]
        chunks += [(rows, True) for rows in _row_chunks(ctx.masked_rows, chunk_size)]
        for rows, masked in chunks:  # masked rows overwrite what the fast path wrote
            p, diff, log_q = _kl_chunk(logits[rows], ref_logits[rows], temperature, dtype, masked)
            scale = grad_out[rows].to(dtype).unsqueeze(-1) / temperature
            if need_ref:
                # d KL / d ref_logits_v = (q_v - p_v) / temperature
                grad_ref[rows] = log_q.exp_().sub_(p).mul_(scale).to(grad_ref.dtype)
            if need_logits:
                # d KL / d logits_v = p_v (log p_v - log q_v - KL) / temperature
                grad_logits[rows] = diff.sub_(kl[rows].unsqueeze(-1)).mul_(p.mul_(scale)).to(grad_logits.dtype)
            del p, diff, log_q  # free this chunk before the next one is allocated
        return grad_logits, grad_ref, None, None, None


@batch_args
def exact_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Full-vocabulary KL(pi || ref) at every position, computed chunk by chunk.

    With ``p = softmax(logits / temperature)`` and ``q = softmax(ref_logits /
    temperature)`` over the vocabulary:

    ``kl[b, t] = sum_v p[b, t, v] * (log p[b, t, v] - log q[b, t, v])``

    Its gradients, computed by a chunked backward that recomputes the softmaxes:
    ``d kl / d logits = p * (log p - log q - kl) / temperature`` and
    ``d kl / d ref_logits = (q - p) / temperature`` (the latter only when
    ``ref_logits`` requires grad).

    Args:
        logits: [B, T, V] float logits of the policy pi (any float dtype).
        ref_logits: [B, T, V] float logits of the reference policy (its dtype may differ).
        temperature: > 0; both sets of logits are divided by it first, as in sampling.
        chunk_size: rows (positions) per chunk; default about 8M elements per chunk
            (``LOGITS_CHUNK_ELEMENTS // V``, the policy of every chunked kernel). The
            result does not depend on it.

    Returns:
        [B, T] float32 KL per position (float64 if an input is float64), >= 0. Positions
        where pi gives mass to a token ref gives none are ``inf``.

    Example:
        >>> import torch
        >>> # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 log 2 + 1/2 log(2/3)
        >>> logits = torch.zeros(1, 1, 2)
        >>> ref_logits = torch.log(torch.tensor([[[0.25, 0.75]]]))
        >>> exact_kl(logits, ref_logits)
        tensor([[0.1438]])

    References:
        S. Kullback and R. A. Leibler, "On information and sufficiency" (1951); exact KL
        as a low-variance alternative to sampled estimators: Tang and Munos,
        https://arxiv.org/abs/2506.09477

    Note:
        Used as a loss, ``exact_kl`` gives the exact gradient of KL(pi || ref) at each
        position, with none of the sampling noise (or, for k1 and k3, the wrong
        expected gradient) of :func:`approx_kl`; it needs the reference logits, not only
        the reference log-probs of the sampled tokens.

        ``0 log 0 = 0``: tokens masked to ``-inf`` in ``logits`` contribute nothing. Rows
        with such tokens are found by one check over the [B, T] result (on CUDA, one
        synchronization per call) and only they are recomputed with the masking.

        Memory: the inputs are read in their own dtype, chunk by chunk; no float32 copy
        of a bf16 [B, T, V] tensor and no [B, T, V] softmax is ever built or kept for the
        backward. Forward and backward each hold three float32 [chunk_size, V] buffers
        at a time; the only [B, T, V] buffers are the gradients themselves.
    """
    fn = "exact_kl"
    check_tensor(fn, "logits", logits, ndim=3)
    check_float(fn, "logits", logits)
    check_same_shape(fn, "ref_logits", ref_logits, "logits", logits)
    check_float(fn, "ref_logits", ref_logits)
    if ref_logits.device != logits.device:
        raise InvalidArgumentError(
            f"{fn}: ref_logits is on {ref_logits.device} but logits is on {logits.device}; "
            "expected the same device"
        )
    if logits.shape[-1] == 0:
        raise ShapeError(f"{fn}: logits has shape {shape_str(logits)}; expected a vocabulary V >= 1")
    temperature = _check_temperature(fn, temperature)
    B, T, V = logits.shape
    chunk_size = _chunk_rows(fn, chunk_size, V)

    dtype = torch.promote_types(torch.promote_types(logits.dtype, ref_logits.dtype), torch.float32)
    kl = _ExactKL.apply(
        logits.reshape(B * T, V), ref_logits.reshape(B * T, V), temperature, chunk_size, dtype
    )
    return kl.view(B, T)
