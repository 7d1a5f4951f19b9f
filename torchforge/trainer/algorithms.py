"""``Algorithm``: the algorithm side of a run, as a few overridable hooks; GRPO, PPO, REINFORCE.

The trainer owns the infrastructure (sampling, log-probs, micro-batches, exact aggregation
across accumulation steps and ranks, the optimizer); an algorithm says how advantages
and the loss are computed. The hooks are called in this order for each sampled batch:

1. ``prepare(batch)`` once, on this process's whole batch (whole groups): advantages,
   values, returns — anything that needs the batch, not a micro-batch.
2. ``compute_loss(micro_batch)`` for every micro-batch of every pass, with
   ``micro_batch.log_probs`` (carrying grad), ``old_log_probs``, ``rewards``,
   ``advantages`` (when ``prepare`` set them), ``ref_log_probs`` (when a reference is
   used), ``rollout_log_probs`` (the sampler's) and ``mask``.

The trainer hands the algorithm one :class:`StepContext` per step (``self.context``): the
step's KL coefficient, reward weights and entropy threshold, and inside ``compute_loss``
the micro-batch, its aggregation and its per-token weights. Nothing else is written onto
the algorithm. The settings of :class:`RLConfig` reach the hooks ready-made, so a custom
algorithm uses them without re-implementing them:

- ``self.weights``: the [B, T] per-token weights of the micro-batch from
  ``rollout_correction`` (truncated importance weights or a ratio mask, from
  ``rollout_log_probs`` against ``old_log_probs``) times ``top_entropy_quantile``'s
  high-entropy mask (``self.entropy_threshold``: the step's threshold), computed by
  :meth:`Algorithm.correction_weights`, or None; :meth:`Algorithm.policy_gradient_loss` and the built-in
  losses pass them as ``weights=`` (the mask stays);
- ``self.kl_coef``: the step's KL coefficient (``kl_coef``, or the adaptive one when
  ``kl_target`` is set), used by :meth:`Algorithm.kl_penalty` and the built-in algorithms;
- ``batch.rewards``: [B] (the weighted sum of the reward functions, clipped with
  ``reward_clip``), or [B, K] with ``reward_aggregation="normalize_then_sum"``, which
  :meth:`Algorithm.compute_advantages` turns into GDPO advantages with
  ``self.reward_weights``;
- ``ref_log_probs``: the reference policy's, refreshed every ``ref_model_sync_steps``.
- ``prepare(batch)`` sees, with ``dynamic_sampling``, only groups whose rewards differ
  (unless the rounds ran out: then dropped groups fill the batch), always the step's size.

One rule for losses: every loss returns ``(loss, metrics)`` — a scalar tensor and a dict
of scalar metrics of the micro-batch. torchforge's losses (``ppo_loss``, ``sapo_loss``, ...),
:meth:`Algorithm.policy_gradient_loss` and ``compute_loss`` alike; so a ``compute_loss``
may return a loss function's result as it is. Metrics are means over the micro-batch's
counted tokens, except those named ``*_max`` / ``*_min``, which are extremes; the trainer
combines them over micro-batches and processes as token-weighted means, maxima and minima.
``self.log(name=value)`` adds a metric from any hook.

Inside ``compute_loss`` the helpers know the micro-batch being processed, so that the
product card's two-line custom algorithm works as written::

    class CustomAlgorithm(Algorithm):
        def compute_loss(self, batch):
            advantages = self.compute_advantages(batch.rewards)
            return self.policy_gradient_loss(batch.log_probs, advantages)

``self.mask``, ``self.group_size``, ``self.aggregation`` (the mode with the global counts
of the step) and ``self.batch`` are those of the current micro-batch.

Capability flags (``needs_reference``, ``needs_old_log_probs_in_prepare``) are bool
attributes: a class attribute (``needs_reference = True``), or a property where the answer
depends on ``self.config``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from torchforge.advantages import group_advantages, rloo_advantages
from torchforge.batch import Batch
from torchforge.corrections import ratio_mask, truncated_importance_weights
from torchforge.distributed import sum_over_ranks
from torchforge.entropy_selection import high_entropy_mask
from torchforge.errors import TorchforgeError
from torchforge.kl import approx_kl
from torchforge.loop import ValueModel, micro_batches, micro_batches_by_tokens
from torchforge.losses import grpo_loss, ppo_loss, reinforce_loss
from torchforge.reduce import Aggregation, masked_mean, masked_whiten
from torchforge.returns import gae, kl_penalized_rewards, reinforce_pp_advantages
from torchforge.trainer.config import RLConfig
from torchforge.trainer.policy_losses import POLICY_LOSS_REGISTRY
from torchforge.value_losses import value_loss

__all__ = ["GRPO", "PPO", "REINFORCE", "Algorithm", "StepContext", "algorithm_from_name"]

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepContext:
    """What the trainer hands an algorithm for the step it trains.

    The trainer binds one per step around ``prepare`` and the update
    (:meth:`Algorithm.using`), and one per micro-batch around ``compute_loss``
    (:meth:`Algorithm.bind`, which adds ``batch``, ``aggregation`` and ``weights``). The
    algorithm's ``kl_coef``, ``reward_weights``, ``entropy_threshold``, ``batch``, ``mask``,
    ``aggregation`` and ``weights`` read it.

    Args:
        step: the 0-based step.
        kl_coef: this step's KL coefficient (``config.kl_coef``, or the adaptive one of
            ``kl_target``); None: the algorithm's own (``config.kl_coef`` unless set).
        reward_weights: the [K] weights of the reward functions, for [B, K] rewards
            (``reward_aggregation="normalize_then_sum"``); None: all 1.
        entropy_threshold: the step's entropy threshold of ``top_entropy_quantile``; None: off.
        batch: the micro-batch ``compute_loss`` processes (None outside it).
        aggregation: the step's loss aggregation, with its global counts.
        weights: the micro-batch's [B, T] per-token weights (``rollout_correction``, the
            entropy mask), or None.

    Returns:
        The context.

    Example:
        >>> import dataclasses
        >>> context = StepContext(step=3, kl_coef=0.05)
        >>> algorithm = Algorithm()
        >>> with algorithm.using(context):
        ...     algorithm.kl_coef
        0.05
    """

    step: int = 0
    kl_coef: float | None = None
    reward_weights: list[float] | None = None
    entropy_threshold: torch.Tensor | None = None
    batch: Batch | None = None
    aggregation: Aggregation | None = None
    weights: torch.Tensor | None = None


def _token_kl(batch: Batch, *, estimator: str = "k3", gradient: str = "estimator", detach: bool = False) -> torch.Tensor:
    """[B, T] ``approx_kl`` of the batch's log-probs against ``ref_log_probs`` (``old_log_probs``
    for the bias-corrected gradient), 0 where the mask is False (as ``grpo_loss``): a NaN
    there reaches neither the value nor the gradient. The one KL of the algorithms: the
    penalty of :meth:`Algorithm.kl_penalty` and the logged ``kl``."""
    log_probs = batch.log_probs.detach() if detach else batch.log_probs
    return approx_kl(log_probs, batch.ref_log_probs, old_log_probs=batch.old_log_probs, mask=batch.mask,
                     estimator=estimator, gradient=gradient)


def _kl_metric(batch: Batch) -> Metrics:
    """``{"kl": masked mean k3 estimate of KL(pi || ref)}`` when ``batch`` has reference log-probs."""
    if batch.ref_log_probs is None:
        return {}
    return {"kl": masked_mean(_token_kl(batch, detach=True), batch.mask)}


class Algorithm:
    """Base class: GRPO-style group advantages and the clipped policy-gradient loss.

    Override ``compute_loss`` (and optionally ``prepare``, ``compute_advantages``,
    ``policy_gradient_loss``, ``modules`` and the capability flags ``needs_reference``,
    ``needs_old_log_probs_in_prepare``). Hyperparameters come from the trainer's
    :class:`RLConfig` (``self.config``; each algorithm has its own, ``RLConfig()`` until
    the trainer calls ``setup``). A subclass ``__init__`` need not call ``super().__init__()``.

    The rule of every loss here: ``compute_loss`` and ``policy_gradient_loss`` return
    ``(loss, metrics)``, a scalar tensor and a dict name -> scalar, as torchforge's losses
    (``ppo_loss``, ``sapo_loss``, ...) do (metrics named ``*_max`` / ``*_min`` are extremes, the
    others means over the counted tokens).

    Args:
        None.

    Returns:
        An algorithm to pass as ``RLTrainer(algorithm=...)``.

    Example:
        >>> class CustomAlgorithm(Algorithm):
        ...     def compute_loss(self, batch):
        ...         advantages = self.compute_advantages(batch.rewards)
        ...         return self.policy_gradient_loss(batch.log_probs, advantages)
        >>> CustomAlgorithm().name
        'CustomAlgorithm'
    """

    #: compute ``old_log_probs`` with a no-grad forward before ``prepare`` (otherwise the
    #: first pass takes them from its own forward, detached: exactly the same numbers)
    needs_old_log_probs_in_prepare: bool = False
    # immutable class-level defaults (None), so that a subclass __init__ need not call super()
    _config: RLConfig | None = None
    _context: StepContext | None = None
    _metrics: Metrics | None = None
    _kl_coef: float | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def config(self) -> RLConfig:
        """This algorithm's config: the trainer's after ``setup``, a fresh ``RLConfig()`` before."""
        if self._config is None:
            self._config = RLConfig()
        return self._config

    @config.setter
    def config(self, config: RLConfig) -> None:
        self._config = config

    def setup(self, config: RLConfig, policy: nn.Module) -> None:
        """Called once by the trainer before training, with its config and (unwrapped) policy.

        Args:
            config: the run's config.
            policy: the policy model, before sharding (build extra modules from it here).

        Returns:
            None.
        """
        self.config = config

    @property
    def context(self) -> StepContext:
        """The :class:`StepContext` of the step being trained (an empty one outside a step)."""
        return self._context if self._context is not None else StepContext()

    @property
    def kl_coef(self) -> float:
        """The step's KL coefficient: the context's (the trainer's, adaptive with ``kl_target``),
        else the one set on this algorithm, else ``config.kl_coef``."""
        if self.context.kl_coef is not None:
            return self.context.kl_coef
        return self.config.kl_coef if self._kl_coef is None else self._kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:  # for an algorithm used outside a trainer
        self._kl_coef = float(value)

    @property
    def reward_weights(self) -> list[float] | None:
        """The step's [K] weights of the reward functions, for [B, K] rewards; None: all 1."""
        return self.context.reward_weights

    @property
    def entropy_threshold(self) -> torch.Tensor | None:
        """The step's entropy threshold of ``top_entropy_quantile``, or None."""
        return self.context.entropy_threshold

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must compute ``ref_log_probs`` (a frozen copy of the policy).

        The base class needs none; GRPO, PPO and REINFORCE need one when ``kl_coef > 0``.
        """
        return False

    def modules(self) -> dict[str, nn.Module]:
        """Extra trainable modules (a critic): sharded, optimized and checkpointed with the policy.

        Args:
            None.

        Returns:
            name -> module; none in the base class.
        """
        return {}

    # --- the micro-batch being processed ---------------------------------------------------

    @contextlib.contextmanager
    def using(self, context: StepContext) -> Iterator[None]:
        """Make ``context`` this algorithm's while the body runs (the trainer's, once per step).

        Args:
            context: the step's :class:`StepContext`.

        Returns:
            A context manager; the previous context is back afterwards.
        """
        if not isinstance(context, StepContext):
            raise TorchforgeError(f"{self.name}.using: context is a {type(context).__name__}; expected a StepContext")
        previous, self._context = self._context, context
        try:
            yield
        finally:
            self._context = previous

    def bind(self, batch: Batch, aggregation: Aggregation,
             weights: torch.Tensor | None = None) -> contextlib.AbstractContextManager[None]:
        """The step's context with ``batch``, ``aggregation`` and ``weights`` as the micro-batch's,
        while the body runs (the trainer's, around ``compute_loss``); :meth:`log` starts empty.

        Args:
            batch: the micro-batch.
            aggregation: the step's aggregation with its global counts.
            weights: its [B, T] per-token weights, or None.

        Returns:
            A context manager.
        """
        self._metrics = None
        return self.using(dataclasses.replace(self.context, batch=batch, aggregation=aggregation, weights=weights))

    def _current(self, what: str) -> StepContext:
        if self.context.batch is None:
            raise TorchforgeError(
                f"{self.name}.{what} is only available inside compute_loss (while the trainer "
                "processes a batch)"
            )
        return self.context

    @property
    def batch(self) -> Batch:
        """The micro-batch being processed."""
        return self._current("batch").batch

    @property
    def mask(self) -> torch.Tensor:
        """[B, T] bool mask of the micro-batch being processed."""
        return self._current("mask").batch.mask

    @property
    def weights(self) -> torch.Tensor | None:
        """[B, T] float per-token weights of the micro-batch (``rollout_correction``), or None."""
        return self._current("weights").weights

    @property
    def group_size(self) -> int:
        """G, completions per prompt."""
        return self.config.num_generations

    @property
    def aggregation(self) -> Aggregation:
        """The loss aggregation of this optimizer step, with its global counts."""
        return self._current("aggregation").aggregation

    def log(self, **metrics: torch.Tensor | float) -> None:
        """Record scalar metrics of this micro-batch from any hook; the trainer logs them.

        Args:
            **metrics: name -> scalar: a mean over the micro-batch's counted tokens, or an
                extreme when the name ends in ``_max`` / ``_min``.

        Returns:
            None.
        """
        if self._metrics is None:
            self._metrics = {}
        for key, value in metrics.items():
            self._metrics[key] = torch.as_tensor(value).detach().float()

    def pop_metrics(self) -> Metrics:
        """The metrics recorded with :meth:`log` since the last call (trainer use)."""
        metrics, self._metrics = self._metrics or {}, None
        return metrics

    # --- hooks -------------------------------------------------------------------------------

    def prepare(self, batch: Batch) -> None:
        """Fill per-batch quantities (e.g. ``batch.advantages``) before the passes; no-op here.

        Args:
            batch: this process's whole batch (whole groups), modified in place.

        Returns:
            None.
        """

    def compute_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group-normalized advantages of ``rewards`` (groups of ``self.group_size``).

        ``A = (r - mean_group) / (std_group + eps)`` with ``config.advantage_scale``;
        ``"batch"`` divides by the std of the rewards of every process (the same on 1
        process as on N). [B, K] rewards (``reward_aggregation="normalize_then_sum"``):
        GDPO, each reward normalized in its group, summed with ``self.reward_weights`` and
        divided by the batch std of the sum (all processes). Every process must call it
        together (a collective) when ``advantage_scale="batch"`` or the rewards are [B, K].

        Args:
            rewards: [B] rewards of whole groups, or [B, K].

        Returns:
            [B] float32 advantages.
        """
        weights = self.reward_weights if rewards.dim() == 2 else None
        return group_advantages(rewards, group_size=self.group_size, scale=self.config.advantage_scale,
                                reward_weights=weights, sum_over_ranks=sum_over_ranks)

    def correction_weights(self, batch: Batch, entropy: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor | None, Metrics]:
        """The per-token weights of ``rollout_correction`` and ``top_entropy_quantile``, and their metrics.

        From ``log_ratio = old_log_probs - rollout_log_probs`` (trainer against sampler):
        ``"tis"``: ``truncated_importance_weights(level, cap=rollout_is_cap)``; ``"mask"``:
        ``ratio_mask(low=rollout_mask_low, high=rollout_mask_high, level)`` (IcePop at the
        token level, MIS at a sequence level); ``"none"``: None. With ``top_entropy_quantile <
        1``, times ``high_entropy_mask(entropy, mask, threshold=self.entropy_threshold)``.
        The trainer calls it before ``compute_loss`` and binds the result as ``self.weights``.

        Args:
            batch: the micro-batch, with ``old_log_probs``, ``rollout_log_probs`` and ``mask``.
            entropy: [B, T] token entropies of the policy (needed with ``top_entropy_quantile``).

        Returns:
            ``(weights, metrics)``: [B, T] float32 weights or None, and
            ``{"rollout/is_weight_mean": masked mean weight, "rollout/masked_frac": fraction
            of counted tokens with weight 0}`` (rollout correction), ``{"entropy_threshold",
            "frac_high_entropy"}`` (top entropy).
        """
        cfg = self.config
        weights, metrics = self._rollout_weights(batch)
        if cfg.top_entropy_quantile < 1:
            if entropy is None or self.entropy_threshold is None:
                raise TorchforgeError(
                    f"{self.name}.correction_weights: top_entropy_quantile={cfg.top_entropy_quantile} needs the "
                    "token entropies and the step's entropy_threshold; expected both (the trainer sets them)"
                )
            kept = high_entropy_mask(entropy.detach(), batch.mask, quantile=cfg.top_entropy_quantile,
                                     threshold=self.entropy_threshold)
            weights = kept if weights is None else weights * kept
            metrics.update(entropy_threshold=self.entropy_threshold.detach().float(),
                           frac_high_entropy=masked_mean(kept, batch.mask))
        return weights, metrics

    def _rollout_weights(self, batch: Batch) -> tuple[torch.Tensor | None, Metrics]:
        cfg = self.config
        if cfg.rollout_correction == "none":
            return None, {}
        if batch.rollout_log_probs is None:
            raise TorchforgeError(
                f"{self.name}.correction_weights: rollout_correction={cfg.rollout_correction!r} but the batch "
                "has no rollout_log_probs; expected the sampler's log-probs (or rollout_correction='none')"
            )
        old, rollout, mask = batch.old_log_probs.detach(), batch.rollout_log_probs, batch.mask
        if cfg.rollout_correction == "tis":
            weights = truncated_importance_weights(old, rollout, mask, level=cfg.rollout_correction_level,
                                                   cap=cfg.rollout_is_cap)
        else:
            weights = ratio_mask(old, rollout, mask, low=cfg.rollout_mask_low, high=cfg.rollout_mask_high,
                                 level=cfg.rollout_correction_level)
        return weights, {"rollout/is_weight_mean": masked_mean(weights, mask),
                         "rollout/masked_frac": masked_mean((weights == 0).float(), mask)}

    def policy_gradient_loss(self, log_probs: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """The policy-gradient loss of the current micro-batch named by ``config.policy_loss``.

        The entry of :data:`~torchforge.trainer.policy_losses.POLICY_LOSS_REGISTRY` named by
        ``config.policy_loss``, with the config's settings: ``"ppo"`` (default) is
        ``ppo_loss(log_probs, batch.old_log_probs, advantages, mask)`` with the config's clip
        range, whose on-policy gradient is the REINFORCE gradient ``-A grad log pi``;
        ``"gspo"`` the same with sequence ratios; ``"reinforce"`` is ``reinforce_loss`` (no
        ratio). Always aggregated with the step's aggregation, with ``self.weights``
        (``rollout_correction``) as the loss's ``weights=``.

        Args:
            log_probs: [B, T] log-probs (carrying grad).
            advantages: [B] or [B, T].

        Returns:
            ``(loss, metrics)``: the scalar loss and its metrics (``clip_frac_low``,
            ``ratio_max``, ...), as the loss returns them.
        """
        loss = POLICY_LOSS_REGISTRY[self.config.policy_loss]
        return loss(self.config, log_probs, self.batch.old_log_probs, advantages, self.mask, weights=self.weights,
                    aggregation=self.aggregation)

    def kl_penalty(self, batch: Batch) -> tuple[torch.Tensor, Metrics]:
        """The KL(pi || ref) term of the loss, ``self.kl_coef * aggregation(kl)``, and its ``kl`` metric.

        ``kl = approx_kl(log_probs, ref_log_probs, old_log_probs=..., estimator=kl_estimator,
        gradient=kl_gradient)`` per token; 0 (and no metric) when ``kl_coef == 0``.

        Args:
            batch: the micro-batch (``log_probs``, ``ref_log_probs``, ``old_log_probs``, ``mask``).

        Returns:
            ``(loss, metrics)``: the scalar term and ``{"kl": masked mean of kl}``.
        """
        cfg = self.config
        if self.kl_coef == 0 or batch.ref_log_probs is None:
            return torch.zeros((), device=batch.log_probs.device), {}
        kl = _token_kl(batch, estimator=cfg.kl_estimator, gradient=cfg.kl_gradient)
        return self.kl_coef * self.aggregation(kl, batch.mask), {"kl": masked_mean(kl.detach(), batch.mask)}

    def compute_loss(self, batch: Batch) -> tuple[torch.Tensor, Metrics]:
        """The loss of one micro-batch: here, the policy-gradient loss of group advantages.

        Args:
            batch: the micro-batch (see the module docstring for its fields).

        Returns:
            ``(loss, metrics)``: a scalar tensor and a dict of scalar metrics.
        """
        advantages = batch.advantages if batch.advantages is not None else self.compute_advantages(batch.rewards)
        return self.policy_gradient_loss(batch.log_probs, advantages)


class GRPO(Algorithm):
    """Group Relative Policy Optimization: group-normalized advantages, clipped loss, KL in the loss.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` per sequence, then
    ``grpo_loss`` (the clipped surrogate plus ``kl_coef * k3``), aggregated with
    ``config.loss_aggregation``; with another ``config.policy_loss``, that loss plus
    :meth:`Algorithm.kl_penalty`. ``advantage_scale="none"`` with
    ``loss_aggregation="seq-mean-token-sum-norm"`` is Dr. GRPO; ``clip_high=0.28`` with
    ``token-mean`` is DAPO's loss.

    Args:
        None.

    Returns:
        The algorithm.

    Example:
        >>> GRPO().name
        'GRPO'

    References:
        DeepSeekMath, https://arxiv.org/abs/2402.03300
    """

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coef > 0

    def prepare(self, batch: Batch) -> None:
        batch.advantages = self.compute_advantages(batch.rewards)

    def compute_loss(self, batch: Batch):
        cfg = self.config
        loss = POLICY_LOSS_REGISTRY[cfg.policy_loss]
        if loss.loss is ppo_loss:  # GRPO's equation: one aggregate of surrogate + kl_coef * KL
            return grpo_loss(
                batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask,
                batch.ref_log_probs if cfg.kl_coef > 0 else None, weights=self.weights,
                kl_coef=self.kl_coef, kl_estimator=cfg.kl_estimator, kl_gradient=cfg.kl_gradient,
                **loss.kwargs(cfg), aggregation=self.aggregation,
            )
        pg_loss, metrics = self.policy_gradient_loss(batch.log_probs, batch.advantages)
        kl_loss, kl_metrics = self.kl_penalty(batch)
        return pg_loss + kl_loss, {**metrics, **kl_metrics}


class PPO(Algorithm):
    """PPO with a learned critic: KL in the reward, GAE, clipped policy and value losses.

    Token rewards ``r_t = score * [t = last] - kl_coef * (old_log_probs - ref_log_probs)_t``,
    values ``V_t`` from a critic (the policy's decoder, copied, with a scalar head),
    ``(A, R) = gae(r, V, mask, gamma, lam)``, ``A`` whitened over the batch (all ranks), then
    ``loss = ppo_loss(A) + value_coef * value_loss(V, V_old, R, clip=value_clip)`` (the
    policy term from :meth:`Algorithm.policy_gradient_loss`: ``config.policy_loss``).

    Args:
        None.

    Returns:
        The algorithm.

    Example:
        >>> PPO().needs_old_log_probs_in_prepare
        True

    References:
        PPO, https://arxiv.org/abs/1707.06347; InstructGPT, https://arxiv.org/abs/2203.02155;
        GAE, https://arxiv.org/abs/1506.02438

    Note:
        A NaN reward ("not applicable") counts as 0 here: GAE has no way to leave a
        sequence out of the critic's targets.
    """

    needs_old_log_probs_in_prepare = True

    critic: ValueModel | None = None

    def setup(self, config: RLConfig, policy: nn.Module) -> None:
        super().setup(config, policy)
        self.critic = ValueModel(policy)

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coef > 0

    def modules(self) -> dict[str, nn.Module]:
        return {"critic": self.critic}

    @torch.no_grad()
    def prepare(self, batch: Batch) -> None:
        cfg = self.config
        if cfg.micro_batch_tokens is not None:
            parts = micro_batches_by_tokens(batch, cfg.micro_batch_tokens, group_size=cfg.num_generations)
        else:
            parts = micro_batches(batch, cfg.micro_batch_size or batch.batch_size[0])
        batch.old_values = torch.cat([self.critic(part) for part in parts])
        rewards = batch.rewards.nan_to_num(0.0)
        ref = batch.ref_log_probs if cfg.kl_coef > 0 else batch.old_log_probs
        token_rewards = kl_penalized_rewards(rewards, batch.old_log_probs, ref, batch.mask, kl_coef=self.kl_coef)
        advantages, batch.returns = gae(token_rewards, batch.old_values, batch.mask, gamma=cfg.gamma, lam=cfg.lam)
        batch.advantages = masked_whiten(advantages, batch.mask, sum_over_ranks=sum_over_ranks)  # all ranks

    def compute_loss(self, batch: Batch):
        cfg = self.config
        pg_loss, metrics = self.policy_gradient_loss(batch.log_probs, batch.advantages)
        vf_loss, vf_metrics = value_loss(self.critic(batch), batch.old_values, batch.returns, batch.mask,
                                         clip=cfg.value_clip, aggregation=self.aggregation)
        metrics.update(pg_loss=pg_loss.detach(), value_loss=vf_loss.detach(),
                       value_clip_frac=vf_metrics["clip_frac"], **_kl_metric(batch))
        return pg_loss + cfg.value_coef * vf_loss, metrics


class REINFORCE(Algorithm):
    """REINFORCE with a leave-one-out (RLOO) or REINFORCE++ baseline: ``loss = -A log pi``.

    ``reinforce_baseline="rloo"``: ``A_i = r_i - mean_{j != i} r_j`` per sequence, and a
    ``kl_coef * k3`` term in the loss as GRPO. ``"reinforce++"``: token returns of
    ``score - kl_coef * k1`` (KL in the reward), whitened over the batch of every process
    (``reinforce_pp_advantages(..., sum_over_ranks=sum_over_ranks)``);
    ``"reinforce++-baseline"``: the group mean subtracted from the scores first.

    Args:
        None.

    Returns:
        The algorithm.

    Example:
        >>> REINFORCE().name
        'REINFORCE'

    References:
        RLOO, https://arxiv.org/abs/2402.14740; REINFORCE++, https://arxiv.org/abs/2501.03262
    """

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_coef > 0

    @property
    def _kl_in_reward(self) -> bool:
        return self.config.reinforce_baseline != "rloo" and self.config.kl_coef > 0

    @property
    def needs_old_log_probs_in_prepare(self) -> bool:  # the k1 reward needs them
        return self._kl_in_reward

    def prepare(self, batch: Batch) -> None:
        cfg = self.config
        if cfg.reinforce_baseline == "rloo":
            batch.advantages = rloo_advantages(batch.rewards, group_size=self.group_size)
            return
        rewards, group_size = batch.rewards, None
        if cfg.reinforce_baseline == "reinforce++-baseline":
            group_size = self.group_size  # NaN rewards are left out of the group mean
        else:
            rewards = rewards.nan_to_num(0.0)  # no baseline to leave a NaN out of: it counts as 0
        if self._kl_in_reward:  # center first, then shape (reinforce_pp_advantages' Note)
            if group_size is not None:
                rewards, group_size = group_advantages(rewards, group_size=group_size, scale="none"), None
            rewards = kl_penalized_rewards(rewards, batch.old_log_probs, batch.ref_log_probs, batch.mask,
                                           kl_coef=self.kl_coef)
        batch.advantages = reinforce_pp_advantages(rewards, batch.mask, gamma=cfg.gamma, group_size=group_size,
                                                   sum_over_ranks=sum_over_ranks)  # whitened over all ranks

    def compute_loss(self, batch: Batch):
        loss, metrics = reinforce_loss(batch.log_probs, batch.advantages, batch.mask, weights=self.weights,
                                       aggregation=self.aggregation)
        if self._kl_in_reward:
            return loss, {**metrics, **_kl_metric(batch)}
        kl_loss, kl_metrics = self.kl_penalty(batch)
        return loss + kl_loss, {**metrics, **kl_metrics}


_BUILT_IN = {"grpo": GRPO, "ppo": PPO, "reinforce": REINFORCE}


def algorithm_from_name(name: str) -> Algorithm:
    """A built-in algorithm by its config name.

    Args:
        name: "grpo", "ppo" or "reinforce".

    Returns:
        A new instance.
    """
    if name not in _BUILT_IN:
        raise TorchforgeError(f"algorithm_from_name: unknown algorithm {name!r}; expected one of {sorted(_BUILT_IN)}")
    return _BUILT_IN[name]()
