"""TRL 1.16's GRPO loss, every ``loss_type``, as a function of tensors on torchforge's primitives.

A TRL user swaps TRL's loss for this one with one import, keeping TRL's names::

    from torchforge.compat.trl import grpo_loss, loss_kwargs

    loss, metrics = grpo_loss(per_token_logps, old_per_token_logps, advantages, completion_mask,
                              ref_per_token_logps, **loss_kwargs(grpo_config))

``grpo_loss`` equals ``GRPOTrainer._compute_loss`` on the same log-probs (value and
gradient; tests/compat/test_trl.py calls TRL's own method beside it), and
:func:`vllm_importance_sampling_ratio` equals the ``importance_sampling_ratio`` that
``_generate_and_score_completions`` computes for ``use_vllm=True``. Nothing here imports
trl: ``loss_kwargs`` and ``importance_sampling_kwargs`` read a ``GRPOConfig`` by attribute.

How each TRL option maps onto torchforge:

==================================  ==================================================================
TRL (``GRPOConfig``)                torchforge
==================================  ==================================================================
``loss_type="grpo"``, ``"sapo"``    ``aggregation=Aggregation("seq-mean-token-mean",
                                    num_sequences=B * gradient_accumulation_steps)``
``"bnpo"``                          ``Aggregation("token-mean", num_tokens=N * gradient_accumulation_steps)``
``"dr_grpo"``                       ``Aggregation("seq-mean-token-sum-norm", num_sequences=B * GA,
                                    norm_length=max_completion_length)``
``"dapo"``, ``"cispo"``, ``"vespo"``  ``Aggregation("token-mean", num_tokens=num_items_in_batch * GA,
                                    dp_size=num_processes * steps_per_generation)``
``"luspo"``                         ``Aggregation("seq-mean-token-sum", num_sequences=B * GA)``
``grpo``/``bnpo``/``dr_grpo``/      :func:`~torchforge.losses.ppo_surrogate` with ``clip_low=epsilon``,
``dapo``/``luspo`` surrogate        ``clip_high=epsilon_high``, ``dual_clip=delta``, ``max_log_ratio=inf``
``"cispo"``                         :func:`~torchforge.trust_region_losses.cispo_loss` with
                                    ``clip_low=1`` (no lower bound), ``clip_high=epsilon_high - 1``
``"sapo"``                          :func:`~torchforge.trust_region_losses.sapo_loss` with
                                    ``tau_pos=sapo_temperature_pos``, ``tau_neg=sapo_temperature_neg``
``"vespo"``                         :func:`~torchforge.losses.reinforce_loss` weighted by VESPO's
                                    gamma weights (computed here: torchforge has no VESPO primitive)
``importance_sampling_level``       ``"token"``: ``ratio_level="token"``; ``"sequence"``: GSPO (see the Note)
``beta``, k3 against the reference  ``beta * aggregate(approx_kl(estimator="k3", max_ratio=inf))``
``use_bias_correction_kl=True``     the k3 estimate times the ratio pi / pi_old with its gradient
                                    (``approx_kl(gradient="bias-corrected")`` at token level)
``top_entropy_quantile``            ``weights *= high_entropy_mask(entropies, mask, quantile=...)``
``off_policy_mask_threshold``       ``weights *=`` the OPSM keep mask (A >= 0 or mean KL <= threshold)
``vllm_importance_sampling_*``      :func:`vllm_importance_sampling_ratio`:
                                    ``truncated_importance_weights`` (``*_truncate``),
                                    ``truncated_importance_weights * ratio_mask`` (``*_mask``), at
                                    ``level="token"`` or ``"sequence-product"``; its result is
                                    ``importance_sampling_ratio=`` here, multiplied into ``weights``
``entropy_coef`` (static)           ``loss - entropy_coef * aggregate(entropies, mask) / GA``
==================================  ==================================================================

Where TRL's behaviour differs from the native primitives, this module reproduces TRL's:

- no clamp on the log-ratio before ``exp`` (``max_log_ratio=inf``; the native default is
  20, verl's) and Schulman's k3 as written (``max_ratio=inf``; natively k3 continues along
  its tangent beyond ``ref / pi = 2``): at log-ratios of +-50 TRL's values are e^50 and so
  are these;
- ``grpo``, ``dr_grpo``, ``luspo`` and ``sapo`` divide by every row of the micro-batch, rows
  with no counted token included (natively ``S`` counts non-empty rows only), and every
  loss type except the ``num_items_in_batch`` ones divides by the gradient accumulation
  steps (as TRL does; the native counts are the step's);
- ``vllm_importance_sampling_ratio``: a token whose sampling log-prob is NaN gets ratio 1
  (TRL's ``nan_to_num``), where the native corrections give it weight 0; the sequence
  modes use the product of the token ratios (``level="sequence-product"``); the mask modes
  keep the ratio's value on the kept tokens (IcePop's ``k * 1[low <= k <= high]``), not 1.

and where it keeps torchforge's contract instead:

- float32 maths whatever the input dtype (TRL computes in the input's dtype): the results
  agree with TRL's float64 to float32 rounding, about 1e-7 relative;
- a NaN at a position where ``completion_mask`` is 0 reaches neither the loss nor the
  gradient (TRL multiplies by the mask, so ``NaN * 0`` leaks into its loss);
- metrics are this call's (TRL gathers them over processes) and finite on an empty mask
  (TRL's ``clip_ratio/low_min`` / ``high_max`` are NaN there).

Note:
    ``importance_sampling_level="sequence"``: TRL's ratio is ``s_b = exp(mean_t log_ratio)``,
    one per row with its gradient spread over the row. The clipped losses compute exactly
    that: :func:`~torchforge.losses.ppo_surrogate` on the [B, 1] row log-ratios (each row a
    one-token batch row), its per-row term spread over the row's tokens, then TRL's weights
    and normalizer. SAPO uses the native GSPO-token form (value ``s_b``, gradient ``s_b *
    grad log_probs_bt`` per token), which gives TRL's value and gradient under every TRL
    normalizer when the advantages and weights are constant over a row; its weights (IS
    ratio, entropy and OPSM masks) are therefore replaced by their row mean over the
    counted tokens (which leaves TRL's loss and gradient unchanged). The advantages must be
    [B] at that level (TRL's own are). CISPO's ratio is a detached weight: its sequence
    level needs no such step. The bias-corrected KL multiplies by ``s_b`` itself, as TRL
    does.
"""

from __future__ import annotations

import math

import torch

from torchforge.corrections import ratio_mask, truncated_importance_weights
from torchforge.entropy_selection import high_entropy_mask
from torchforge.errors import (
    InvalidArgumentError,
    ShapeError,
    check_choice,
    check_float,
    check_same_shape,
    check_tensor,
    reraise_as,
    shape_str,
)
from torchforge.kl import approx_kl
from torchforge.losses import ppo_surrogate, reinforce_loss
from torchforge.reduce import Aggregation, aggregate, masked_max, masked_mean, masked_min
from torchforge.trust_region_losses import cispo_loss, sapo_loss

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "VLLM_IMPORTANCE_SAMPLING_MODES",
    "grpo_loss",
    "importance_sampling_kwargs",
    "loss_kwargs",
    "vllm_importance_sampling_ratio",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
VLLM_IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")    # PPO's clip: TRL's clip_ratio/* metrics
_GLOBAL_NORMALIZER = ("dapo", "cispo", "vespo")            # divided by num_items_in_batch
_LOSS_OPTIONS = (
    "loss_type", "epsilon", "epsilon_high", "delta", "beta", "use_bias_correction_kl",
    "importance_sampling_level", "max_completion_length", "top_entropy_quantile",
    "off_policy_mask_threshold", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
    "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef",
    "gradient_accumulation_steps", "steps_per_generation",
)


def _as_mask(fn: str, completion_mask: torch.Tensor, per_token_logps: torch.Tensor) -> torch.Tensor:
    """TRL's 0/1 ``completion_mask`` (any dtype) as torchforge's bool mask."""
    check_tensor(fn, "completion_mask", completion_mask)
    check_same_shape(fn, "completion_mask", completion_mask, "per_token_logps", per_token_logps)
    return completion_mask.bool()


def _aggregation(loss_type, mask, num_items_in_batch, max_completion_length,
                 gradient_accumulation_steps, steps_per_generation, num_processes) -> Aggregation:
    """TRL's normalizer of ``loss_type`` as an :class:`Aggregation` (see the module's table)."""
    B = mask.shape[0]
    GA = gradient_accumulation_steps
    if loss_type in ("grpo", "sapo"):
        return Aggregation("seq-mean-token-mean", num_sequences=B * GA)
    if loss_type == "bnpo":
        return Aggregation("token-mean", num_tokens=torch.count_nonzero(mask) * GA)
    if loss_type == "dr_grpo":
        return Aggregation("seq-mean-token-sum-norm", num_sequences=B * GA, norm_length=max_completion_length)
    if loss_type == "luspo":
        return Aggregation("seq-mean-token-sum", num_sequences=B * GA)
    # TRL: sum / (num_items_in_batch / num_processes * GA / steps_per_generation)
    N = torch.count_nonzero(mask) if num_items_in_batch is None else num_items_in_batch
    N = N.clamp(min=1) if isinstance(N, torch.Tensor) else max(N, 1)
    return Aggregation("token-mean", num_tokens=N * GA, dp_size=num_processes * steps_per_generation)


def _gamma_weights(advantages, log_ratio, mask, importance_sampling_ratio, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's detached sequence weight ``phi(w) = exp(lambda + k log w - lambda w)``, [B, 1].

    ``log w = clamp(sum_t clamp(log_ratio, +-20) + sum_t clamp(log is_ratio, log 1e-8, 20),
    log 1e-8, 20)``, with ``(k, lambda)`` the positive pair where ``A >= 0``, else the
    negative one (the clamps are TRL's)."""
    lower = math.log(1e-8)
    with torch.no_grad():
        log_w = torch.where(mask, log_ratio.clamp(-20.0, 20.0), 0.0).sum(-1, keepdim=True)
        if importance_sampling_ratio is not None:
            log_is = torch.log(importance_sampling_ratio.float()).clamp(lower, 20.0)
            if log_is.shape == mask.shape:  # TRL's ratio is 1 where masked (log 0); a NaN there reaches nothing
                log_is = torch.where(mask, log_is, 0.0)
            log_w = log_w + log_is.sum(-1, keepdim=True)
        log_w = log_w.clamp(lower, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, k_pos, k_neg)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    ref_per_token_logps: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    sampling_per_token_logps: torch.Tensor | None = None,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    importance_sampling_level: str = "token",
    max_completion_length: int = 512,
    num_items_in_batch: int | torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    off_policy_mask_threshold: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    entropy_coef: float = 0.0,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int | None = None,
    num_processes: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL 1.16's ``GRPOTrainer._compute_loss``, every ``loss_type``, from the log-probs.

    With ``log_ratio = per_token_logps - old_per_token_logps``, ``coef_1 = exp(log_ratio)``
    (``"sequence"``: ``exp`` of the row's mean log-ratio), ``A = advantages`` and
    ``w = importance_sampling_ratio * entropy_mask * off_policy_mask`` (each when enabled):

    - ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: ``pg = -min(min(coef_1, delta) A,
      clamp(coef_1, 1 - epsilon, 1 + epsilon_high) A)``;
    - ``cispo``: ``pg = -sg(min(coef_1, epsilon_high)) A per_token_logps``;
    - ``sapo``: ``pg = -A (4 / tau) sigmoid(tau (coef_1 - 1))``, ``tau`` the positive or
      negative temperature by the sign of A;
    - ``vespo``: ``pg = -phi A per_token_logps`` with VESPO's gamma weight ``phi`` (which
      takes the IS ratio inside instead of ``w``);

    then ``per_token = w pg + beta k3`` (``k3 = exp(ref - logp) - (ref - logp) - 1``, times
    ``coef_1`` with ``use_bias_correction_kl``), reduced by ``loss_type``'s normalizer (the
    module's table), minus ``entropy_coef`` times the mean entropy.

    Args:
        per_token_logps: [B, T] float log-probs of the completion tokens (carries grad).
        old_per_token_logps: [B, T] float log-probs at sampling time, or None
            (``per_token_logps.detach()``, as TRL when it skips them).
        advantages: [B] (or [B, T] at ``importance_sampling_level="token"``) float.
        completion_mask: [B, T] 0/1 (int, float or bool): TRL's ``completion_mask``
            (times ``tool_mask`` where TRL has one).
        ref_per_token_logps: [B, T] float reference log-probs; needed when ``beta != 0``.
        importance_sampling_ratio: [B, T] or [B, 1]: :func:`vllm_importance_sampling_ratio`'s
            result (TRL's ``inputs["importance_sampling_ratio"]``), or None (no vLLM correction).
        entropies: [B, T] float token entropies; needed for ``top_entropy_quantile < 1``,
            ``entropy_coef != 0`` and the ``"entropy"`` metric.
        sampling_per_token_logps: [B, T] float log-probs from the generation engine, read by
            ``off_policy_mask_threshold`` (default: ``old_per_token_logps``, as TRL).
        loss_type, epsilon, epsilon_high, delta, beta, use_bias_correction_kl,
        importance_sampling_level, max_completion_length, top_entropy_quantile,
        off_policy_mask_threshold, sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos,
        vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, entropy_coef,
        gradient_accumulation_steps, steps_per_generation: ``GRPOConfig``'s fields of
            those names and defaults (``steps_per_generation=None`` is
            ``gradient_accumulation_steps``, as GRPOConfig sets it); ``delta``, when set,
            must exceed ``1 + epsilon_high`` (TRL's recommendation; below it TRL's two-sided
            clip is not a dual clip). ``gradient_accumulation_steps`` is TRL's
            ``current_gradient_accumulation_steps`` (1 for an evaluation step).
        num_items_in_batch: the counted tokens of the generation batch over all processes
            (TRL's ``inputs["num_items_in_batch"]``), for ``dapo``, ``cispo``, ``vespo``;
            None: this call's.
        num_processes: the data-parallel processes (``accelerator.num_processes``).

    Returns:
        ``(loss, metrics)``: the float32 scalar TRL's ``_compute_loss`` returns, and
        detached float32 scalars under TRL's metric names: ``kl`` (``beta != 0``),
        ``entropy`` (with ``entropies``), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
        ``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max`` (the
        clipped loss types), ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ``policy_loss``
        (``entropy_coef != 0``).

    Example:
        >>> import torch
        >>> lp = torch.log(torch.tensor([[0.6, 0.3]])).requires_grad_()
        >>> old = torch.log(torch.tensor([[0.4, 0.3]]))
        >>> # ratios 1.5 (clipped to 1.2) and 1.0, A = 1: -(1.2 + 1.0) / 2 tokens
        >>> loss, metrics = grpo_loss(lp, old, torch.tensor([1.0]), torch.tensor([[1, 1]]), loss_type="grpo")
        >>> round(loss.item(), 4), metrics["clip_ratio/high_mean"].item()
        (-1.1, 0.5)

    References:
        TRL ``GRPOTrainer`` (v1.16), https://github.com/huggingface/trl; GRPO,
        https://arxiv.org/abs/2402.03300; DAPO, https://arxiv.org/abs/2503.14476; Dr. GRPO,
        https://arxiv.org/abs/2503.20783; GSPO, https://arxiv.org/abs/2507.18071; CISPO
        (MiniMax-M1), https://arxiv.org/abs/2506.13585; SAPO, https://arxiv.org/abs/2511.20347;
        INTELLECT-2 (delta), https://arxiv.org/abs/2505.07291

    Note:
        See the module's docstring for where TRL differs from the native primitives and
        which side this function takes.
    """
    fn = "torchforge.compat.trl.grpo_loss"
    check_choice(fn, "loss_type", loss_type, LOSS_TYPES)
    check_choice(fn, "importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    check_tensor(fn, "per_token_logps", per_token_logps, ndim=2)
    check_float(fn, "per_token_logps", per_token_logps)
    mask = _as_mask(fn, completion_mask, per_token_logps)
    for name, x in (("old_per_token_logps", old_per_token_logps), ("sampling_per_token_logps", sampling_per_token_logps)):
        if x is not None:
            check_same_shape(fn, name, x, "per_token_logps", per_token_logps)
            check_float(fn, name, x)
    if importance_sampling_ratio is not None:
        check_tensor(fn, "importance_sampling_ratio", importance_sampling_ratio)
        check_float(fn, "importance_sampling_ratio", importance_sampling_ratio)
        B, T = per_token_logps.shape
        if importance_sampling_ratio.shape not in ((B, T), (B, 1)):
            raise ShapeError(
                f"{fn}: importance_sampling_ratio has shape {shape_str(importance_sampling_ratio)}; expected "
                f"({B}, {T}) per token or ({B}, 1) per sequence, as vllm_importance_sampling_ratio returns"
            )
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    steps_per_generation = gradient_accumulation_steps if steps_per_generation is None else steps_per_generation
    sequence = importance_sampling_level == "sequence"
    if sequence and advantages.dim() != 1:
        raise ShapeError(
            f"{fn}: advantages has shape {shape_str(advantages)}; importance_sampling_level='sequence' "
            f"needs one advantage per sequence, shape ({per_token_logps.shape[0]},)"
        )
    if delta is not None and loss_type in _CLIPPED and not delta > 1 + epsilon_high:
        raise InvalidArgumentError(
            f"{fn}: delta={delta} must be > 1 + epsilon_high = {1 + epsilon_high} (TRL's recommendation); "
            "set it larger, or delta=None"
        )
    if loss_type == "cispo" and not epsilon_high >= 1:
        raise InvalidArgumentError(
            f"{fn}: loss_type='cispo' caps the ratio at epsilon_high itself, got {epsilon_high}; "
            "set epsilon_high >= 1 (ScaleRL recommends 5.0)"
        )
    if beta != 0 and ref_per_token_logps is None:
        raise InvalidArgumentError(f"{fn}: beta={beta} needs ref_per_token_logps; pass them, or beta=0.0")
    needs_entropies = top_entropy_quantile < 1.0 or entropy_coef != 0
    if needs_entropies and entropies is None:
        raise InvalidArgumentError(
            f"{fn}: top_entropy_quantile={top_entropy_quantile}, entropy_coef={entropy_coef} need "
            "entropies ([B, T] token entropies); pass them"
        )
    with reraise_as(fn):
        A = advantages.detach().float()
        A_tok = A.unsqueeze(-1) if A.dim() == 1 else A

        # The detached weights TRL multiplies into the policy term: OPSM, entropy mask, vLLM IS.
        weights = None
        if off_policy_mask_threshold is not None:
            sampling = old if sampling_per_token_logps is None else sampling_per_token_logps
            kl_div = torch.nan_to_num(sampling.detach().float() - per_token_logps.detach().float(), nan=0.0)
            avg_seq_kl = masked_mean(kl_div, mask, dim=-1).unsqueeze(-1)
            weights = ((A_tok >= 0) | (avg_seq_kl <= off_policy_mask_threshold)).float().expand(mask.shape)
        entropy_mask = None
        if top_entropy_quantile < 1.0:
            entropy_mask = high_entropy_mask(entropies.detach(), mask, quantile=top_entropy_quantile)
            weights = entropy_mask if weights is None else weights * entropy_mask
        if importance_sampling_ratio is not None and loss_type != "vespo":
            is_ratio = importance_sampling_ratio.detach().float()    # [B, T], or [B, 1]: one per row
            weights = is_ratio if weights is None else weights * is_ratio
        if weights is not None and sequence and loss_type == "sapo" and weights.shape[-1] != 1:
            weights = masked_mean(weights.expand(mask.shape), mask, dim=-1)  # constant over the row: TRL's GSPO
        if weights is not None and weights.shape != mask.shape:
            weights = weights.reshape(-1)                   # [B, 1] as [B]: a weight per sequence
        # TRL's sequence log-ratio, one per row with its gradient (each token's: 1 / n_b)
        seq_log_ratio = None
        if sequence and (loss_type in _CLIPPED + ("cispo", "sapo") or (beta != 0 and use_bias_correction_kl)):
            seq_log_ratio = masked_mean(per_token_logps.float() - old.detach().float(), mask, dim=-1).unsqueeze(-1)

        agg = _aggregation(loss_type, mask, num_items_in_batch, max_completion_length,
                           gradient_accumulation_steps, steps_per_generation, num_processes)
        token_old = old
        if sequence and loss_type in ("cispo", "sapo"):
            # Old log-probs whose token log-ratio is the row's, sg(log_probs - l_b): a token-level
            # loss then sees GSPO-token's ratio, value s_b and gradient s_b grad log_probs per token.
            token_old = per_token_logps.detach().float() - seq_log_ratio.detach()

        # The policy term.
        if loss_type in _CLIPPED and sequence:
            # GSPO as TRL computes it: one clipped term per row, of the row's log-ratio (a
            # [B, 1] batch of one-token rows), then spread over the row for TRL's weights and normalizer.
            rows = mask.any(-1, keepdim=True)
            pg_rows, _, _ = ppo_surrogate(
                seq_log_ratio, torch.zeros_like(seq_log_ratio), A, rows, clip_low=epsilon, clip_high=epsilon_high,
                dual_clip=delta, max_log_ratio=math.inf, with_metrics=False,
            )
            pg_loss = pg_rows.expand(mask.shape)
            if weights is not None:
                # per-token weights are 0 where masked (a where): a NaN weight there would reach
                # the row's gradient, which sums over the row's tokens
                w = weights.reshape(mask.shape[0], -1)
                pg_loss = pg_loss * (torch.where(mask, w, 0.0) if w.shape == mask.shape else w)
            loss = agg(pg_loss, mask)
        elif loss_type in _CLIPPED:
            pg_loss, _, _ = ppo_surrogate(
                per_token_logps, old, A, mask, weights, clip_low=epsilon, clip_high=epsilon_high,
                dual_clip=delta, max_log_ratio=math.inf, with_metrics=False,
            )
            loss = agg(pg_loss, mask)
        elif loss_type == "cispo":
            loss, _ = cispo_loss(per_token_logps, token_old, A, mask, weights, clip_low=1.0,
                                 clip_high=epsilon_high - 1, max_log_ratio=math.inf, aggregation=agg,
                                 with_metrics=False)
        elif loss_type == "sapo":
            loss, _ = sapo_loss(per_token_logps, token_old, A, mask, weights, tau_pos=sapo_temperature_pos,
                                tau_neg=sapo_temperature_neg, max_log_ratio=math.inf, aggregation=agg,
                                with_metrics=False)
        else:  # vespo
            log_ratio = per_token_logps.detach().float() - old.detach().float()
            phi = _gamma_weights(A_tok, log_ratio, mask, importance_sampling_ratio, vespo_k_pos,
                                 vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)
            vespo_weights = phi if weights is None else phi * weights
            loss, _ = reinforce_loss(per_token_logps, A, mask, vespo_weights.expand(mask.shape), aggregation=agg,
                                     with_metrics=False)

        # The KL term: k3 as written, times the ratio with its gradient when bias-corrected.
        per_token_kl = None
        if beta != 0:
            check_same_shape(fn, "ref_per_token_logps", ref_per_token_logps, "per_token_logps", per_token_logps)
            if use_bias_correction_kl and not sequence:
                per_token_kl = approx_kl(per_token_logps, ref_per_token_logps.detach(), old_log_probs=old,
                                         mask=mask, gradient="bias-corrected", max_ratio=math.inf,
                                         max_log_ratio=math.inf)
            else:
                per_token_kl = approx_kl(per_token_logps, ref_per_token_logps.detach(), mask=mask,
                                         max_ratio=math.inf)
                if use_bias_correction_kl:  # TRL's sequence coef_1 = exp(mean_t log_ratio), with its gradient
                    per_token_kl = per_token_kl * torch.exp(seq_log_ratio)
            loss = loss + beta * agg(per_token_kl, mask)

        policy_loss = loss.detach() * (1 if loss_type in _GLOBAL_NORMALIZER else gradient_accumulation_steps)
        if entropy_coef != 0:
            counted = mask if entropy_mask is None else mask & (entropy_mask > 0)
            loss = loss - entropy_coef * aggregate(entropies, counted) / gradient_accumulation_steps

    metrics = _metrics(per_token_logps, old, A_tok, mask, loss_type, seq_log_ratio, epsilon, epsilon_high, delta,
                       per_token_kl, entropies, phi if loss_type == "vespo" else None)
    if entropy_coef != 0:
        metrics["policy_loss"] = policy_loss
    return loss, metrics


def _metrics(per_token_logps, old, A, mask, loss_type, seq_log_ratio, epsilon, epsilon_high, delta,
             per_token_kl, entropies, phi) -> dict[str, torch.Tensor]:
    """TRL's loss metrics, this call's: token means over the mask, or row means at sequence level
    (``seq_log_ratio``, [B, 1], given there)."""
    with torch.no_grad():
        B = mask.shape[0]
        sequence = seq_log_ratio is not None
        num_tokens = torch.count_nonzero(mask).clamp(min=1)

        def global_mean(x):  # x [B, T], or [B, 1] at sequence level: one value per row, every row
            if x.shape[-1] == 1 and mask.shape[-1] != 1:
                return x.float().sum() / max(B, 1)
            return masked_mean(x.float(), mask)

        def fraction(flags):  # bool [B, T]: of the counted tokens; [B, 1] at sequence level: of every row
            if flags.shape[-1] == 1 and mask.shape[-1] != 1:
                return torch.count_nonzero(flags) / max(B, 1)
            return torch.count_nonzero(flags & mask) / num_tokens

        metrics = {}
        if loss_type in _CLIPPED + ("cispo",):   # the clip statistics read TRL's coef_1
            if sequence:
                log_ratio = seq_log_ratio.detach()
            else:  # any value where masked (a NaN too): every flag below is counted with the mask
                log_ratio = per_token_logps.detach().float() - old.detach().float()
            coef_1 = torch.exp(log_ratio)
        if per_token_kl is not None:
            metrics["kl"] = masked_mean(per_token_kl.detach(), mask)
        if entropies is not None:
            metrics["entropy"] = masked_mean(entropies.detach(), mask)
        if loss_type in _CLIPPED:
            if delta is not None:
                coef_1 = coef_1.clamp(max=delta)
            low = (coef_1 < 1 - epsilon) & (A < 0)
            high = (coef_1 > 1 + epsilon_high) & (A > 0)            # never with low: A > 0
            if sequence:  # one flag per row, every row
                low_rows, high_rows = low.reshape(-1).float(), high.reshape(-1).float()
                lengths, total = 1, max(B, 1)
                counted_rows = torch.ones(B, dtype=torch.bool, device=mask.device)
            else:  # per counted row
                low_rows = torch.count_nonzero(low & mask, -1)
                high_rows = torch.count_nonzero(high & mask, -1)
                lengths, total = torch.count_nonzero(mask, -1).clamp(min=1), num_tokens
                counted_rows = mask.any(-1)
            low_count, high_count = low_rows.sum(), high_rows.sum()
            metrics["clip_ratio/low_mean"] = low_count / total
            metrics["clip_ratio/high_mean"] = high_count / total
            metrics["clip_ratio/region_mean"] = (low_count + high_count) / total
            metrics["clip_ratio/low_min"] = masked_min(low_rows / lengths, counted_rows)
            metrics["clip_ratio/high_max"] = masked_max(high_rows / lengths, counted_rows)
        elif loss_type == "cispo":
            metrics["cispo_clip_ratio"] = fraction((coef_1 > epsilon_high) & (A > 0))
        elif loss_type == "vespo":
            metrics["vespo/phi_seq_mean"] = global_mean(phi)
        return metrics


def vllm_importance_sampling_ratio(
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    vllm_importance_sampling_mode: str = "sequence_mask",
    vllm_importance_sampling_clip_min: float | None = None,
    vllm_importance_sampling_clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's vLLM importance-sampling correction: the ratio trainer / sampler, truncated or masked.

    With ``d = old_per_token_logps - sampling_per_token_logps`` on the counted tokens (0
    where masked, and where ``d`` is NaN: TRL's ``nan_to_num``), ``r = exp(d)`` per token
    (``token_*``) or ``r_b = exp(sum_t d_bt)`` per row (``sequence_*``), and
    ``[lo, hi] = [clip_min, clip_max]``:

    - ``*_truncate``: ``clamp(r, lo, hi)`` (TIS);
    - ``*_mask``: ``r * 1[lo <= r <= hi]`` (IcePop / MIS: the ratio where kept, 0 where not).

    Args:
        old_per_token_logps: [B, T] float trainer log-probs of the sampled tokens.
        sampling_per_token_logps: [B, T] float generation-engine log-probs (NaN where
            unscored).
        completion_mask: [B, T] 0/1 (times ``tool_mask`` where TRL has one).
        vllm_importance_sampling_mode: one of ``VLLM_IMPORTANCE_SAMPLING_MODES``.
        vllm_importance_sampling_clip_min: ``lo`` (None: no lower bound).
        vllm_importance_sampling_clip_max: ``hi``; needed (TRL's default: 3.0).

    Returns:
        ``(importance_sampling_ratio, metrics)``: [B, T] (``token_*``) or [B, 1]
        (``sequence_*``) float32, detached, equal to TRL's everywhere (where masked too:
        TRL's value at ``r = 1``); pass it as ``importance_sampling_ratio=`` of
        :func:`grpo_loss`. Metrics, under TRL's names:
        ``sampling/sampling_logp_difference/mean`` and ``/max`` (of ``|d|`` over the counted,
        scored tokens), ``sampling/importance_sampling_ratio/min``, ``/mean``, ``/max``
        (over the counted tokens, or every row); 0 when nothing is counted.

    Example:
        >>> import torch
        >>> old = torch.log(torch.tensor([[0.5, 0.9]])); sampling = torch.log(torch.tensor([[0.25, 0.9]]))
        >>> ratio, _ = vllm_importance_sampling_ratio(old, sampling, torch.tensor([[1, 1]]),
        ...                                           vllm_importance_sampling_mode="token_truncate",
        ...                                           vllm_importance_sampling_clip_max=1.5)
        >>> ratio                             # ratios 2 (truncated to 1.5) and 1
        tensor([[1.5000, 1.0000]])

    References:
        F. Yao, L. Liu et al., "Your efficient RL framework secretly brings you off-policy RL
        training", https://fengyao.notion.site/off-policy-rl (2025); IcePop,
        https://arxiv.org/abs/2510.18855
    """
    fn = "torchforge.compat.trl.vllm_importance_sampling_ratio"
    mode = vllm_importance_sampling_mode
    check_choice(fn, "vllm_importance_sampling_mode", mode, VLLM_IMPORTANCE_SAMPLING_MODES)
    lo, hi = vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max
    if hi is None or not (lo is None or lo < hi):
        raise InvalidArgumentError(
            f"{fn}: expected vllm_importance_sampling_clip_max set and above clip_min, got "
            f"clip_min={lo}, clip_max={hi}"
        )
    check_tensor(fn, "old_per_token_logps", old_per_token_logps, ndim=2)
    mask = _as_mask(fn, completion_mask, old_per_token_logps)
    old = old_per_token_logps.detach().float()
    scored = torch.isnan(old - sampling_per_token_logps.detach().float())
    sampling = torch.where(scored, old, sampling_per_token_logps.detach().float())  # d = 0: ratio 1
    level = "token" if mode.startswith("token") else "sequence-product"
    with reraise_as(fn):
        ratio = truncated_importance_weights(old, sampling, mask, level=level, cap=hi)
        if mode.endswith("truncate"):
            if lo is not None:
                ratio = ratio.clamp(min=lo)
            at_one = min(max(1.0, -math.inf if lo is None else lo), hi)
        else:
            ratio = ratio * ratio_mask(old, sampling, mask, low=0.0 if lo is None else lo, high=hi, level=level)
            at_one = float((lo is None or lo <= 1.0) and 1.0 <= hi)
        if level == "token":
            ratio = torch.where(mask, ratio, at_one)   # TRL's value where masked: r = 1
            counted = mask
        else:
            row = masked_max(ratio, mask, dim=-1)          # every counted token holds the row's ratio
            ratio = torch.where(mask.any(-1), row, at_one).unsqueeze(-1)
            counted = torch.ones_like(ratio, dtype=torch.bool)
        diff = (old - sampling_per_token_logps.detach().float()).abs()
        valid = mask & ~scored
    with torch.no_grad():
        metrics = {
            "sampling/sampling_logp_difference/mean": masked_mean(diff, valid),
            "sampling/sampling_logp_difference/max": masked_max(diff, valid),
            "sampling/importance_sampling_ratio/min": masked_min(ratio, counted),
            "sampling/importance_sampling_ratio/mean": masked_mean(ratio, counted),
            "sampling/importance_sampling_ratio/max": masked_max(ratio, counted),
        }
    return ratio, metrics


def loss_kwargs(args) -> dict:
    """The keyword arguments of :func:`grpo_loss` read from a TRL ``GRPOConfig`` (by attribute).

    Args:
        args: a ``trl.GRPOConfig`` (or any object with its field names).

    Returns:
        dict: each option of :func:`grpo_loss` that ``args`` has, by its name.

    Example:
        >>> from types import SimpleNamespace
        >>> loss_kwargs(SimpleNamespace(loss_type="grpo", beta=0.04))
        {'loss_type': 'grpo', 'beta': 0.04}
    """
    if getattr(args, "use_adaptive_entropy", False):
        raise InvalidArgumentError(
            "torchforge.compat.trl.loss_kwargs: use_adaptive_entropy=True is trainer state (the "
            "coefficient changes between steps); pass that step's entropy_coef instead"
        )
    return {name: getattr(args, name) for name in _LOSS_OPTIONS if hasattr(args, name)}


def importance_sampling_kwargs(args) -> dict:
    """The keyword arguments of :func:`vllm_importance_sampling_ratio` read from a ``GRPOConfig``.

    Args:
        args: a ``trl.GRPOConfig`` (or any object with its field names).

    Returns:
        dict: ``vllm_importance_sampling_mode``, ``_clip_min``, ``_clip_max`` where ``args`` has them.

    Example:
        >>> from types import SimpleNamespace
        >>> importance_sampling_kwargs(SimpleNamespace(vllm_importance_sampling_mode="token_mask"))
        {'vllm_importance_sampling_mode': 'token_mask'}
    """
    names = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
             "vllm_importance_sampling_clip_max")
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
