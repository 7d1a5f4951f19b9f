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
import torch.nn.functional as F

from torchforge.batch import batch_args
from torchforge.errors import (
    InvalidArgumentError,
    ShapeError,
    check_choice,
    check_float,
    check_mask,
    check_non_negative,
    check_positive,
    check_same_shape,
    check_temperature,
    check_tensor,
    reraise_as,
    shape_str,
)
from torchforge.log_probs import chunk_rows, row_chunks
from torchforge.ratios import clamp_log_ratio

__all__ = ["KL_ESTIMATORS", "KL_GRADIENTS", "adaptive_kl_coef", "approx_kl", "exact_kl"]

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")

KL_GRADIENTS = ("estimator", "straight-through", "bias-corrected")


def _log_r(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman's ``log r = log ref - log pi``, in float32."""
    return ref_log_probs.float() - log_probs.float()


def _k3(log_r: torch.Tensor, max_ratio: float) -> torch.Tensor:
    """``k3 = (r - 1) - log r`` with ``r = ref / pi``, continued along its tangent beyond
    ``max_ratio``: ``r = max_ratio * (1 + log r - log max_ratio)`` there.

    Value and gradient are continuous; ``|d k3 / d log r| = |r' - 1| <= max(1,
    max_ratio - 1)`` everywhere; exactly Schulman's k3 wherever ``r <= max_ratio``.
    """
    # expm1 keeps the error near r = 1 at the rounding of log r (exp(log r) - 1 would
    # round at 1, and k3 there is (log r)**2 / 2).
    if math.isinf(max_ratio):  # Schulman's k3 as written
        return torch.expm1(log_r) - log_r
    # With w = min(log r, log max_ratio): k3 = k3(w) + k3'(w) * (log r - w), the tangent
    # at w, which is k3 itself while w = log r (log r - w is then exactly 0), and
    # k3'(w) = max_ratio - 1 beyond the knee. hardtanh with no lower bound is the clamp,
    # with a backward of one kernel (torch.clamp's takes several); add's alpha scales
    # the tangent in the same kernel.
    w = F.hardtanh(log_r, -math.inf, math.log(max_ratio))
    return torch.add(torch.expm1(w) - w, log_r - w, alpha=max_ratio - 1)


@batch_args
def approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    weights: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    estimator: str = "k3",
    gradient: str = "estimator",
    max_ratio: float = 2.0,
    max_log_ratio: float = 20.0,
) -> torch.Tensor:
    """Per-token sample estimate of KL(pi || ref) from the log-probs of sampled tokens.

    In Schulman's notation, with ``r = ref / pi`` on a token ``y ~ pi`` and ``log r =
    ref_log_probs - log_probs``:

    - ``k1 = -log r``: unbiased, high variance, can be negative.
    - ``k2 = (log r)**2 / 2``: biased (``E[k2] != KL`` unless pi = ref), low variance,
      >= 0.
    - ``k3 = (r - 1) - log r``: unbiased, low variance, >= 0 (``E_pi[r] = sum_y ref(y) =
      1`` makes the extra term mean-zero). Where ``r > max_ratio`` (pi more than
      ``max_ratio`` times below ref) ``r`` continues along its tangent,
      ``r = max_ratio * (1 + log r - log max_ratio)``; see the Note.
    - ``abs = |log r|``: biased, >= 0.

    ``kl = weights * k`` with the ``weights`` detached: for tokens sampled from an older
    policy ``pi_old``, passing ``weights = pi / pi_old`` makes ``E_pi_old[weights * k]``
    equal ``E_pi[k]``.

    Gradient (``gradient=``). Used as a loss on samples of pi, the estimators do not all
    give the gradient of KL(pi || ref) (Tang and Munos):

    - ``"estimator"``: differentiate ``k`` as written. ``E_pi[grad k1] = 0``;
      ``E_pi[grad k2] = grad KL(pi || ref)``; ``E_pi[grad k3] = grad KL(ref || pi)``, the
      other direction (DeepSeekMath's GRPO, TRL's default, verl's ``low_var_kl``).
    - ``"straight-through"``: the value of ``k``, the gradient of k2:
      ``kl = k.detach() + (k2 - k2.detach())`` (the bracket is exactly 0), so
      ``E_pi[grad] = grad KL(pi || ref)`` (verl's ``"k3+"`` for k3).
    - ``"bias-corrected"``: ``kl = k * rho`` with ``rho = pi / pi_old = exp(log_probs -
      old_log_probs)`` *with* its gradient (the log-ratio clamped at ``max_log_ratio``);
      on-policy (``rho = 1``) its gradient is ``grad k + k grad log pi``, whose mean is
      ``grad E_pi[k]`` = ``grad KL(pi || ref)`` for k1 and k3 (TRL's
      ``use_bias_correction_kl=True``, DeepSeek-V3.2). Needs ``old_log_probs``.

    Args:
        log_probs: [B, T] float log pi of the sampled tokens (any shape is accepted;
            the output has the same one).
        ref_log_probs: [B, T] float log ref of the same tokens.
        weights: optional [B, T] float importance weights; detached.
        old_log_probs: [B, T] float log pi_old of the same tokens; read only by
            ``gradient="bias-corrected"``.
        mask: optional bool of the shape of ``log_probs``, True = the token counts; where
            False the estimate is 0 with no gradient (``log r`` and ``log rho`` are 0
            there, a NaN in any input there reaches nothing). Keyword-only: a batch's mask
            is never read by itself.
        estimator: one of ``KL_ESTIMATORS``: ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``.
        gradient: one of ``KL_GRADIENTS``: ``"estimator"``, ``"straight-through"``,
            ``"bias-corrected"``.
        max_ratio: ``r = ref / pi`` beyond which k3 continues along its tangent; > 1.
        max_log_ratio: clamp on ``log_probs - old_log_probs`` inside ``rho`` (as
            :func:`~torchforge.ratios.policy_ratio`); > 0.

    Returns:
        [B, T] float32 per-token estimates (reduce them with ``aggregate``).

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.5, 0.25]]))
        >>> approx_kl(lp, lp)
        tensor([[0., 0.]])
        >>> # log r = -log 2, r = 1/2: k3 = 1/2 - 1 + log 2
        >>> approx_kl(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
        tensor([0.1931])
        >>> # 19 nats below ref: r = 2 (1 + 19 - log 2), k3 = r - 1 - 19; gradient -1
        >>> x = torch.tensor([-19.0], requires_grad=True)
        >>> kl = approx_kl(x, torch.zeros(1)); kl.backward()
        >>> kl.detach(), x.grad
        (tensor([18.6137]), tensor([-1.]))

    References:
        J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html;
        k3 as the GRPO KL term: DeepSeekMath, https://arxiv.org/abs/2402.03300;
        the gradients of the estimators: Y. Tang and R. Munos, "On a few pitfalls in KL
        divergence gradient estimation for RL", https://arxiv.org/abs/2506.09477;
        the bias-corrected form: DeepSeek-V3.2, https://arxiv.org/abs/2512.02556

    Note:
        Extremes. k1, k2 and abs need no exponential and are exact at any log-ratio,
        value and gradient. k3 holds ``r = exp(log r)``: a token 19 nats below the
        reference would give a value and a gradient of 1.8e8. verl clamps ``log r``
        at +-20 and then k3 at +-10 (so a token more than about 2.5 nats below the
        reference gets no gradient at all); OpenRLHF clamps the log-ratio at +-10 (a
        gradient of up to 2.2e4, then none). Here ``r`` continues along its tangent
        beyond ``max_ratio``: value and gradient stay continuous, the gradient never
        drops to 0 and is bounded by ``max(1, max_ratio - 1)`` in magnitude. With the
        default ``max_ratio = 2`` that bound is 1 on both sides, the bound k3 has by
        itself where pi > ref; k3 is exact wherever pi >= ref / 2, and grows like
        ``|log r|`` (as abs does) beyond. The straight-through form carries the same
        bounded value and the gradient of k2, ``log_probs - ref_log_probs``.
    """
    fn = "approx_kl"
    check_tensor(fn, "log_probs", log_probs)
    check_float(fn, "log_probs", log_probs)
    check_same_shape(fn, "ref_log_probs", ref_log_probs, "log_probs", log_probs)
    check_float(fn, "ref_log_probs", ref_log_probs)
    if weights is not None:
        check_same_shape(fn, "weights", weights, "log_probs", log_probs)
        check_float(fn, "weights", weights)
    if mask is not None:
        check_mask(fn, mask, "log_probs", log_probs)
    check_choice(fn, "estimator", estimator, KL_ESTIMATORS)
    check_choice(fn, "gradient", gradient, KL_GRADIENTS)
    if not max_ratio > 1:
        raise InvalidArgumentError(f"{fn}: max_ratio must be > 1 (a bound on ref / pi), got {max_ratio}")
    check_positive(fn, "max_log_ratio", max_log_ratio)
    if gradient == "bias-corrected":
        if old_log_probs is None:
            raise InvalidArgumentError(
                f"{fn}: gradient='bias-corrected' needs old_log_probs (log pi_old of the "
                "same tokens) for the ratio pi / pi_old; pass them, or another gradient"
            )
        check_same_shape(fn, "old_log_probs", old_log_probs, "log_probs", log_probs)
        check_float(fn, "old_log_probs", old_log_probs)

    # Wheres, not products with the mask: a NaN where masked reaches neither value nor gradient.
    log_r = _log_r(log_probs, ref_log_probs)
    if mask is not None:
        log_r = torch.where(mask, log_r, 0.0)
    rho = None
    if gradient == "bias-corrected":
        log_ratio = log_probs.float() - old_log_probs.detach().float()
        if mask is not None:
            log_ratio = torch.where(mask, log_ratio, 0.0)
        rho = torch.exp(clamp_log_ratio(log_ratio, max_log_ratio=max_log_ratio))
    kl = _estimate(log_r, estimator, gradient, max_ratio, rho)
    if weights is not None:
        weights = weights.detach().float()
        kl = (weights if mask is None else torch.where(mask, weights, 0.0)) * kl
    return kl


def _estimate(log_r: torch.Tensor, estimator: str, gradient: str, max_ratio: float, rho=None) -> torch.Tensor:
    """The body of :func:`approx_kl` from ``log r = log ref - log pi`` (Schulman's
    notation, in which k3 needs no negation; and, for ``"bias-corrected"``,
    ``rho = pi / pi_old`` with its gradient); no checks."""
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r**2
    elif estimator == "k3":
        kl = _k3(log_r, max_ratio)
    else:
        kl = log_r.abs()
    if gradient == "straight-through":
        k2 = 0.5 * log_r**2
        kl = kl.detach() + (k2 - k2.detach())
    elif gradient == "bias-corrected":
        kl = kl * rho
    return kl


def adaptive_kl_coef(
    kl_coef: float | torch.Tensor,
    observed_kl: float | torch.Tensor,
    *,
    target: float,
    horizon: float,
    num_steps: int,
) -> float | torch.Tensor:
    """The adaptive KL controller of Ziegler et al.: the next KL coefficient.

    ``error = clip(observed_kl / target - 1, -0.2, 0.2)``,
    ``kl_coef_next = kl_coef * (1 + error * num_steps / horizon)``: the coefficient grows
    while the observed KL is above the target and shrinks while it is below, by at most
    ``0.2 * num_steps / horizon`` per update.

    Args:
        kl_coef: the current coefficient (beta); >= 0.
        observed_kl: the KL measured over the last ``num_steps`` steps (a number, or a
            scalar tensor: then the result is a tensor too and nothing syncs).
        target: the KL to hold; > 0.
        horizon: the number of steps over which a 20% error changes the coefficient by
            20%; > 0.
        num_steps: steps (or samples, as in the paper) since the last update; >= 0.

    Returns:
        The next coefficient: a float, or a float32 scalar tensor when ``kl_coef`` or
        ``observed_kl`` is a tensor.

    Example:
        >>> adaptive_kl_coef(0.1, 0.2, target=0.1, horizon=10_000, num_steps=1000)  # 0.1 * (1 + 0.2 * 0.1)
        0.10200000000000001
        >>> adaptive_kl_coef(0.1, 0.05, target=0.1, horizon=10_000, num_steps=1000)  # error -0.2
        0.098

    References:
        D. Ziegler et al., "Fine-Tuning Language Models from Human Preferences",
        https://arxiv.org/abs/1909.08593 (section 2.2)

    Note:
        A pure function: the caller keeps the coefficient (TRL's and verl's
        ``AdaptiveKLController`` hold it as state and apply the same update).
    """
    fn = "adaptive_kl_coef"
    check_positive(fn, "target", target)
    check_positive(fn, "horizon", horizon)
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise InvalidArgumentError(f"{fn}: num_steps must be an int >= 0, got {num_steps!r}")
    if num_steps > 5 * horizon:  # 1 - 0.2 * num_steps / horizon < 0: an error of -20% would flip the sign
        raise InvalidArgumentError(
            f"{fn}: num_steps={num_steps} is more than 5 x horizon={horizon}, so the coefficient could turn "
            "negative; expected num_steps <= 5 * horizon"
        )
    for name, value in (("kl_coef", kl_coef), ("observed_kl", observed_kl)):
        if isinstance(value, torch.Tensor):
            if value.dim() != 0 or not value.is_floating_point():
                raise ShapeError(
                    f"{fn}: {name} must be a float scalar tensor, got shape {shape_str(value)} "
                    f"and dtype {value.dtype}"
                )
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgumentError(f"{fn}: {name} must be a number or a scalar tensor, got {type(value).__name__}")
        elif not math.isfinite(value):
            raise InvalidArgumentError(f"{fn}: {name} must be finite, got {value}")
    if not isinstance(kl_coef, torch.Tensor):
        check_non_negative(fn, "kl_coef", kl_coef)
    if isinstance(kl_coef, torch.Tensor) or isinstance(observed_kl, torch.Tensor):
        error = torch.clamp(torch.as_tensor(observed_kl, dtype=torch.float32) / target - 1, -0.2, 0.2)
        return torch.as_tensor(kl_coef, dtype=torch.float32) * (1 + error * num_steps / horizon)
    error = min(max(observed_kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * num_steps / horizon)


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
        for rows in row_chunks(logits.shape[0], chunk_size):
            out[rows] = _kl_rows(logits[rows], ref_logits[rows], temperature, dtype)
        ctx.masked_rows = torch.isnan(out).nonzero().squeeze(-1)
        for rows in row_chunks(ctx.masked_rows, chunk_size):
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
        chunks = [(rows, False) for rows in row_chunks(logits.shape[0], chunk_size)]
        chunks += [(rows, True) for rows in row_chunks(ctx.masked_rows, chunk_size)]
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
    temperature = check_temperature(fn, temperature)
    B, T, V = logits.shape
    with reraise_as(fn):
        chunk_size = chunk_rows(V, chunk_size=chunk_size)

    dtype = torch.promote_types(torch.promote_types(logits.dtype, ref_logits.dtype), torch.float32)
    kl = _ExactKL.apply(
        logits.reshape(B * T, V), ref_logits.reshape(B * T, V), temperature, chunk_size, dtype
    )
    return kl.view(B, T)
