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

The settings of :class:`RLConfig` reach the hooks ready-made, so a custom algorithm uses
them without re-implementing them:

- ``self.weights``: the [B, T] per-token weights of the micro-batch from
  ``rollout_correction`` (truncated importance weights or a ratio mask, from
  ``rollout_log_probs`` against ``old_log_probs``) times ``top_entropy_quantile``'s
  high-entropy mask (``self.entropy_threshold``: the step's threshold), computed by
  :meth:`Algorithm.correction_weights`, or None; :meth:`Algorithm.policy_gradient_loss` and the built-in
  losses pass them as ``weights=`` (the mask stays);
- ``self.kl_coef``: the current KL coefficient (``kl_coef``, or the adaptive one when
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
from collections.abc import Iterator

import torch
from torch import nn

from torchforge.advantages import (
    gae,
    group_advantages,
    kl_penalized_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)
from torchforge.batch import Batch
from torchforge.corrections import (
    high_entropy_mask,
    ratio_mask,
    truncated_importance_weights,
)
from torchforge.covariance_losses import clip_cov_loss, kl_cov_loss
from torchforge.distributed import sum_over_ranks
from torchforge.errors import TorchforgeError
from torchforge.kl import approx_kl
from torchforge.loop import ValueModel, micro_batches, micro_batches_by_tokens
from torchforge.losses import grpo_loss, ppo_loss, reinforce_loss
from torchforge.reduce import Aggregation, masked_mean, masked_whiten
from torchforge.trainer.config import RLConfig
from torchforge.trust_region_losses import cispo_loss, gmpo_loss, sapo_loss
from torchforge.value_losses import value_loss

__all__ = ["GRPO", "PPO", "REINFORCE", "Algorithm", "algorithm_from_name"]

Metrics = dict[str, torch.Tensor]

_RATIO_LEVEL = {"ppo": "token", "gspo": "sequence"}


def _kl_metric(batch: Batch) -> Metrics:
    """``{"kl": masked mean k3 estimate of KL(pi || ref)}`` when ``batch`` has reference log-probs."""
    if batch.ref_log_probs is None:
        return {}
    kl = approx_kl(batch.log_probs.detach(), batch.ref_log_probs, estimator="k3")
    return {"kl": masked_mean(kl, batch.mask)}


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
    _batch: Batch | None = None
    _aggregation: Aggregation | None = None
    _metrics: Metrics | None = None
    _weights: torch.Tensor | None = None
    _kl_coef: float | None = None
    #: [K] weights of the reward functions, for [B, K] rewards (set by the trainer); None: all 1
    reward_weights: list[float] | None = None
    #: the step's entropy threshold of ``top_entropy_quantile`` (set by the trainer each step)
    entropy_threshold: torch.Tensor | None = None

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
    def kl_coef(self) -> float:
        """The current KL coefficient: ``config.kl_coef``, or the adaptive one the trainer sets."""
        return self.config.kl_coef if self._kl_coef is None else self._kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self._kl_coef = float(value)

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
    def bind(self, batch: Batch, aggregation: Aggregation,
             weights: torch.Tensor | None = None) -> Iterator[None]:
        """Make ``batch``, ``aggregation`` and ``weights`` the current ones while the body runs (trainer use)."""
        self._batch, self._aggregation, self._weights, self._metrics = batch, aggregation, weights, None
        try:
            yield
        finally:
            self._batch, self._aggregation, self._weights = None, None, None

    def _current(self, what: str):
        if self._batch is None:
            raise TorchforgeError(
                f"{self.name}.{what} is only available inside compute_loss (while the trainer "
                "processes a batch)"
            )
        return self._batch

    @property
    def batch(self) -> Batch:
        """The micro-batch being processed."""
        return self._current("batch")

    @property
    def mask(self) -> torch.Tensor:
        """[B, T] bool mask of the micro-batch being processed."""
        return self._current("mask").mask

    @property
    def weights(self) -> torch.Tensor | None:
        """[B, T] float per-token weights of the micro-batch (``rollout_correction``), or None."""
        self._current("weights")
        return self._weights

    @property
    def group_size(self) -> int:
        """G, completions per prompt."""
        return self.config.num_generations

    @property
    def aggregation(self) -> Aggregation:
        """The loss aggregation of this optimizer step, with its global counts."""
        self._current("aggregation")
        return self._aggregation

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

        ``policy_loss="ppo"`` (default): ``ppo_loss(log_probs, batch.old_log_probs,
        advantages, mask)`` with the config's clip range, whose on-policy gradient is the
        REINFORCE gradient ``-A grad log pi``; ``"gspo"``: the same with sequence ratios
        (``ratio_level="sequence"``); ``"cispo"``, ``"sapo"``, ``"gmpo"``, ``"clip_cov"``,
        ``"kl_cov"``: ``<name>_loss`` with the config's hyperparameters; ``"reinforce"``:
        ``reinforce_loss`` (no ratio). Always aggregated with the step's aggregation, with
        ``self.weights`` (``rollout_correction``) as the loss's ``weights=``.

        Args:
            log_probs: [B, T] log-probs (carrying grad).
            advantages: [B] or [B, T].

        Returns:
            ``(loss, metrics)``: the scalar loss and its metrics (``clip_frac_low``,
            ``ratio_max``, ...), as the loss returns them.
        """
        cfg, old, mask, agg, w = self.config, self.batch.old_log_probs, self.mask, self.aggregation, self.weights
        name = cfg.policy_loss
        if name in ("ppo", "gspo"):
            return ppo_loss(log_probs, old, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                            dual_clip=cfg.dual_clip, ratio_level=_RATIO_LEVEL[name], weights=w, aggregation=agg)
        if name == "cispo":
            return cispo_loss(log_probs, old, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                              weights=w, aggregation=agg)
        if name == "sapo":
            return sapo_loss(log_probs, old, advantages, mask, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg,
                             weights=w, aggregation=agg)
        if name == "gmpo":
            return gmpo_loss(log_probs, old, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                             aggregation=agg)
        if name == "clip_cov":
            return clip_cov_loss(log_probs, old, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                 select_frac=cfg.cov_select_frac, cov_low=cfg.cov_low, cov_high=cfg.cov_high,
                                 aggregation=agg)
        if name == "kl_cov":
            return kl_cov_loss(log_probs, old, advantages, mask, select_frac=cfg.cov_select_frac,
                               kl_coef=cfg.kl_cov_coef, aggregation=agg)
        return reinforce_loss(log_probs, advantages, mask, weights=w, aggregation=agg)

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
        mask = batch.mask
        # every side 0 where the mask is False (as grpo_loss): a NaN there cannot reach the gradient
        kl = approx_kl(torch.where(mask, batch.log_probs.float(), 0.0),
                       torch.where(mask, batch.ref_log_probs.float(), 0.0),
                       old_log_probs=torch.where(mask, batch.old_log_probs.float(), 0.0),
                       estimator=cfg.kl_estimator, gradient=cfg.kl_gradient)
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
        if cfg.policy_loss in ("ppo", "gspo"):  # GRPO's equation: one aggregate of surrogate + kl_coef * KL
            return grpo_loss(
                batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask,
                batch.ref_log_probs if cfg.kl_coef > 0 else None,
                kl_coef=self.kl_coef, kl_estimator=cfg.kl_estimator, kl_gradient=cfg.kl_gradient,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                ratio_level=_RATIO_LEVEL[cfg.policy_loss], weights=self.weights, aggregation=self.aggregation,
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
