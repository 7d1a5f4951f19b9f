"""``RLConfig``: every setting of a training run, validated up front."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torchforge.advantages import GROUP_SCALES
from torchforge.corrections import CORRECTION_LEVELS
from torchforge.distributed.parallelize import MIXED_PRECISIONS, STRATEGIES
from torchforge.errors import InvalidArgumentError
from torchforge.kl import KL_ESTIMATORS, KL_GRADIENTS
from torchforge.loop.engines import check_engine_settings
from torchforge.reduce import AGGREGATION_MODES
from torchforge.trainer.async_generation import PARTIAL_ROLLOUTS
from torchforge.trainer.lora import check_lora_settings
from torchforge.trainer.policy_losses import POLICY_LOSS_REGISTRY
from torchforge.trainer.tracking import check_report_to

__all__ = ["RLConfig", "ALGORITHMS", "LR_SCHEDULERS", "REINFORCE_BASELINES", "POLICY_LOSSES",
           "ROLLOUT_CORRECTIONS", "REWARD_AGGREGATIONS", "PROXIMAL_LOG_PROBS"]

ALGORITHMS = ("grpo", "ppo", "reinforce")
LR_SCHEDULERS = ("constant", "linear", "cosine")
REINFORCE_BASELINES = ("rloo", "reinforce++", "reinforce++-baseline")
#: the names of ``RLConfig.policy_loss``: the entries of :data:`~torchforge.trainer.policy_losses.POLICY_LOSS_REGISTRY`
POLICY_LOSSES = tuple(POLICY_LOSS_REGISTRY)
#: ``RLConfig.rollout_correction``: none, truncated importance weights, or a ratio mask
ROLLOUT_CORRECTIONS = ("none", "tis", "mask")
#: ``RLConfig.reward_aggregation``: one reward of the weighted sum, or GDPO's per-reward normalization
REWARD_AGGREGATIONS = ("weighted_sum", "normalize_then_sum")
#: ``RLConfig.proximal_log_probs``: what the policy loss's ratio is taken against
PROXIMAL_LOG_PROBS = ("recomputed", "sampler")


@dataclass
class RLConfig:
    """Settings of an RL run; the first nine are the product card's, with its defaults.

    Args:
        algorithm: "grpo", "ppo" or "reinforce" (ignored when RLTrainer gets an
            ``algorithm`` object).
        learning_rate: peak learning rate of AdamW.
        num_generations: G, completions sampled per prompt.
        max_completion_length: the token limit of a completion.
        kl_coef: weight of the KL(pi || ref) penalty; 0 needs no reference model.
        distributed_strategy: "fsdp", "ddp" or "none" (used when several processes run).
        mixed_precision: "bf16", or "fp32" / "no" / None (full precision), as
            ``DistributedConfig``'s; "bf16" falls back to fp32, with a warning, on a
            machine without bf16 support on its accelerator (a CPU).
        gradient_checkpointing: recompute activations in backward to save memory.
        output_dir: where metrics, checkpoints, the final model and plots go.
        prompts_per_step: prompts per step over all processes (B = that x G).
        micro_batch_size: sequences per forward / backward on one process (gradient
            accumulation splits the step); a multiple of G. None: the whole local batch.
        micro_batch_tokens: instead of ``micro_batch_size``, a token budget per forward /
            backward: consecutive whole groups fill each micro-batch up to this many tokens
            (real prompt tokens + completion tokens; a group above it runs alone), every
            process running the same number of micro-batches, balanced by tokens
            (:func:`torchforge.loop.micro_batches_by_tokens`). None: off.
        padding_free: run the policy's, the reference's and the critic's forwards on
            sequences packed end to end with per-sequence position ids, no padding
            (:func:`torchforge.loop.pack_sequences`); the log-probs, values and gradients
            equal the padded forward's. A model that cannot be packed (state-space or
            recurrent layers, an attention that ignores position ids) is refused when the
            trainer starts. TRL's ``padding_free``, verl's ``use_remove_padding``.
            Vision-language models are refused (their image inputs do not pack exactly).
        train_vision_tower: for a vision-language model, train its vision tower and
            projector too (full weights, or LoRA adapters with ``lora``); False (the
            default) freezes them and trains the language model only.
        num_iterations: optimizer steps (passes) per sampled batch, as TRL's; > 1 makes
            the later passes off-policy, handled by the clipped ratio.
        temperature, top_p, top_k: sampling; the training log-probs use the same temperature.
        clip_low, clip_high, dual_clip: PPO clip range ``[1 - clip_low, 1 + clip_high]``
            (clip_high defaults to clip_low) and dual-clip constant.
        loss_aggregation: one of ``AGGREGATION_MODES`` (see ``torchforge.aggregate``).
        advantage_scale: GRPO: "group" (std of the group), "batch" or "none" (Dr. GRPO).
        kl_estimator: estimator of the KL term in the loss (GRPO, REINFORCE): "k1", "k2",
            "k3" or "abs". PPO and REINFORCE++ put a k1 penalty in the reward instead.
        kl_gradient: the gradient form of that KL term (``torchforge.kl.KL_GRADIENTS``):
            "estimator", "straight-through" or "bias-corrected".
        reinforce_baseline: REINFORCE: "rloo", "reinforce++" or "reinforce++-baseline".
        policy_loss: the policy-gradient loss of GRPO, PPO and ``Algorithm.policy_gradient_loss``
            (one of ``POLICY_LOSSES``): "ppo" (``ppo_loss``, the clipped surrogate), "gspo"
            (``ppo_loss(ratio_level="sequence")``), "cispo", "sapo", "gmpo", "clip_cov",
            "kl_cov" (``<name>_loss``) or "reinforce" (``reinforce_loss``, no ratio). The
            clipped ones take ``clip_low`` / ``clip_high``; ``dual_clip`` is ppo / gspo only.
            REINFORCE keeps ``reinforce_loss``.
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for positive / negative advantages.
        cov_select_frac, cov_low, cov_high, kl_cov_coef: Clip-Cov / KL-Cov: the fraction of
            tokens selected by their covariance (per micro-batch), Clip-Cov's covariance
            window, KL-Cov's penalty weight.
        entropy_coef: weight of an entropy bonus on the counted tokens,
            ``loss - entropy_coef * aggregation(entropy, mask)`` (every algorithm); 0: none.
        mask_truncated_completions: completions cut by ``max_completion_length`` count for
            nothing: their tokens leave the mask (the loss, its token counts and metrics) and
            their reward is NaN, "not applicable", so group statistics (the advantages, the
            logged ``frac_reward_zero_std``) are those of the other completions (DAPO; TRL's
            option of the same name). The logged ``reward`` and lengths are still those of
            every sampled completion.
        dynamic_sampling, max_sampling_rounds: DAPO's dynamic sampling: groups whose rewards
            are all equal (``zero_std_groups``: no learning signal) are dropped and more
            prompts are sampled, up to ``max_sampling_rounds`` rounds per step in all, until
            every process has its share of informative groups; if the rounds run out, the
            batch is filled with dropped groups (advantage 0, their tokens still counted).
            Every process draws the same number of rounds (a collective decides), so the
            batch shape and the global token counts stay exact. Round r > 0 of step s takes
            the prompts at stream position ``(r * total_steps + s) * prompts_per_step`` (past
            the run's own prompts: the regular schedule and resume are unchanged). Logged:
            ``dynamic_sampling/rounds``, ``dynamic_sampling/prompts_drawn`` (all processes),
            ``dynamic_sampling/filled_groups``; the step's other metrics (``reward``,
            ``frac_reward_zero_std``) are those of the kept batch. Groups are judged on the
            scored rewards (before ``mask_truncated_completions``). Single-turn runs only.
        rollout_correction: correct for a sampler that differs numerically from training,
            from ``rollout_log_probs`` against the old log-probs
            (:mod:`torchforge.corrections`), as per-token weights of the policy loss (the
            mask, hence the token counts, stays): "none"; "tis", truncated importance
            weights ``truncated_importance_weights(level=rollout_correction_level,
            cap=rollout_is_cap)``; "mask", 0/1 weights ``ratio_mask(low=rollout_mask_low,
            high=rollout_mask_high, level=rollout_correction_level)`` (level "token":
            IcePop; "sequence" / "sequence-product": MIS). Logged: ``rollout/is_weight_mean``,
            ``rollout/masked_frac`` (with ``rollout/kl``, logged always). Needs a policy loss
            with weights (not gmpo, clip_cov, kl_cov).
        top_entropy_quantile: train on the top-``q`` highest-entropy counted tokens only
            ("Beyond the 80/20 rule"; TRL's option of the same name): 0/1 per-token weights
            ``high_entropy_mask(entropy, mask, threshold=tau)`` of the policy loss, with
            ``tau = entropy_threshold`` of the step's counted tokens (all micro-batches and
            processes, from a no-grad forward before the update), multiplied with the
            rollout correction's; logged ``entropy_threshold``, ``frac_high_entropy``.
            1.0: every token (off); needs a policy loss with weights, as above.
        rollout_correction_level: one of ``CORRECTION_LEVELS`` ("token", "sequence": the
            geometric mean of a row's ratios, "sequence-product": their product).
        rollout_is_cap: the truncation C of "tis" (> 0).
        rollout_mask_low, rollout_mask_high: the kept ratio window of "mask", 0 <= low < high.
        reward_aggregation: several reward functions: "weighted_sum" (one reward,
            ``sum_k w_k r_k``) or "normalize_then_sum" (GDPO: each reward normalized in its
            group, then summed with the weights and scaled by the batch std:
            ``group_advantages`` of the [B, K] rewards; GRPO or a custom algorithm's
            ``compute_advantages``).
        reward_clip: clip the reward the update sees (after the weighted sum; each reward
            with "normalize_then_sum"): a number c clips to ``[-c, c]``, a pair
            ``[low, high]`` to that window (stored as ``[low, high]``); None: no clipping.
            NaN ("not applicable") stays NaN.
        kl_target, kl_horizon: adaptive KL (Ziegler et al.; ``torchforge.kl.adaptive_kl_coef``):
            after every step the coefficient, starting at ``kl_coef``, moves toward holding
            the step's ``kl`` at ``kl_target``, with ``num_steps`` the step's sequences (as
            TRL and verl count); logged as ``kl_coef`` and checkpointed. None: fixed ``kl_coef``.
        ref_model_sync_steps: TR-DPO-style: copy the policy's weights into the reference
            policy every N steps; None: the reference stays the initial policy.
            Not with LoRA (the reference is the policy with its adapters off).
        gamma, lam: discount and GAE lambda (PPO; gamma also for REINFORCE++).
        value_coef, value_clip: PPO: weight of the value loss and its clip range.
        max_grad_norm: gradient-norm clip; None disables it.
        weight_decay: AdamW weight decay.
        lr_scheduler: "constant", "linear" (to 0) or "cosine" (to 0), over the run's steps;
            every optimizer step of a step (``num_iterations``) uses that step's rate.
        warmup_steps: linear warm-up, in steps.
        num_train_epochs: passes over the dataset when ``max_steps`` is None.
        max_steps: steps of the run, each a sampled batch and its ``num_iterations``
            optimizer steps (overrides num_train_epochs).
        seed: seeds the data order and the sampling.
        logging_steps: log every N steps.
        save_steps: checkpoint every N steps (and always at the end); None: only at the end.
        resume: continue from the last checkpoint in ``output_dir``.
        stop_token_ids: extra ids that end a completion (eos is always one).
        reward_weights: one weight per reward function (default: each one's ``weight``).
        progress_bar: show a progress bar.
        eval_steps: score ``RLTrainer(eval_dataset=...)`` every N steps; None: never.
        num_eval_generations: k, sampled completions per eval prompt (pass@1 and pass@k).
        eval_correct_threshold: an eval completion is correct when its reward is >= this.
        lora: LoRA settings (``rank``, ``alpha``, ``dropout``, ``target_modules``, ``merge``;
            :mod:`torchforge.trainer.lora`, needs ``torchforge[lora]``); None: full fine-tuning.
        max_turns: model turns per episode with ``RLTrainer(environment_factory=...)``
            (``max_completion_length`` is then the limit of one turn).
        max_total_tokens: tokens of an episode after its prompt (model and environment
            tokens); None: no limit but ``max_turns``.
        step_timeout: seconds an environment's ``step`` may take before its episode ends
            (faulted); None waits forever.
        engine: what samples the completions (``torchforge.loop.engines``): "hf" (Hugging
            Face ``generate`` with the seeded sampler, on the trained weights themselves),
            "hf-process" (the same sampler in a worker process, on a shared-memory copy: CPU
            only, what lets ``async_generation`` overlap without sharing the GIL),
            "vllm" (vLLM in this process; ``torchforge[vllm]``) or "vllm-server" (a ``vllm
            serve`` process: started here, or ``engine_args: {url: ...}``).
        engine_args: keyword arguments of the engine (``VLLMEngine`` / ``VLLMServerEngine``:
            ``dtype``, ``max_model_len``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``,
            ``enforce_eager``, ``url``, ... and any ``vllm.LLM`` argument); checked before the
            model loads.
        engine_sync_steps: push the trained weights into the engine every N steps (1: after
            every step, on-policy); 0: never (only to measure what stale weights cost: the
            ``rollout/*`` gap grows). Ignored by "hf", which samples with the trained weights.
        reward_timeout: seconds a reward function's call may take (per completion with
            ``reward_processes``); past it the completions get ``reward_on_failure`` and
            ``rewards/<name>/timeouts`` counts them. None: no limit (the default path,
            unchanged). Reward models and judges (``in_process``) are never timed out.
        reward_processes: > 0: the reward functions (not reward models or judges) score each
            completion alone in a pool of that many worker processes (per training process),
            so a grader that hangs or crashes (segfault, ``os._exit``) on one completion costs
            that completion ``reward_on_failure`` (``rewards/<name>/crashes``), not the run.
            The functions must pickle (module-level), and a training script needs
            ``if __name__ == "__main__":`` (workers import the main module). 0: in the training process.
        reward_on_failure: the reward of a completion whose reward call timed out or crashed;
            None: "not applicable" (left out of the group statistics).
        report_to: where metrics go besides ``metrics.jsonl`` (TRL's key): a list of
            ``"tensorboard"`` (default), ``"wandb"`` (``torchforge[wandb]``), ``"trackio"``
            (``torchforge[trackio]``), or one name, or ``"none"``. The trackers get the run's
            config and every logged metric; a resumed run continues the same tracker run.
        run_name: the run's name in wandb / trackio; None: the ``output_dir`` folder's name.
        async_generation: sample the next steps' batches in a generator thread while this
            step trains (:mod:`torchforge.trainer.async_generation`), with a copy of the
            policy for "hf" (a vLLM engine is already one); False: sample, then train.
        max_staleness: with ``async_generation``, k >= 0: the batch of step s is sampled with
            weights of step >= s - k (admission: none is ever discarded); 0 samples every
            batch with the previous step's weights, as the synchronous run does.
        partial_rollouts: with ``async_generation``, a batch in flight when new weights
            arrive: "finish" (on its own weights; its tokens keep their version) or
            "restart" (sampled again with the new ones).
        proximal_log_probs: the ``old_log_probs`` the policy loss clips against: "recomputed"
            (the weights at the start of the step, pi_prox; the sampler's distance from them
            is ``rollout_correction``'s: decoupled PPO) or "sampler" (the engine's own
            log-probs mu, as TRL's asynchronous trainer; ``rollout_correction`` then has
            nothing left to correct).
        generator_threads: with ``async_generation``, torch's CPU threads in the generator
            thread (e.g. half the cores each for sampling and training); None: torch's default.

    Returns:
        The validated config; ``InvalidArgumentError`` names the first bad field.

    Example:
        >>> RLConfig(algorithm="grpo", num_generations=4).clip_high
        0.2
        >>> RLConfig(num_generations=4, micro_batch_size=6)
        Traceback (most recent call last):
        ...
        torchforge.errors.InvalidArgumentError: RLConfig: micro_batch_size=6 is not a multiple of num_generations=4; expected whole groups per micro-batch (advantages are computed per group)
    """

    algorithm: str = "grpo"
    learning_rate: float = 1e-6
    num_generations: int = 4
    max_completion_length: int = 512
    kl_coef: float = 0.1
    distributed_strategy: str = "fsdp"
    mixed_precision: str | None = "bf16"
    gradient_checkpointing: bool = True
    output_dir: str = "./torchforge-output"

    prompts_per_step: int = 8
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = None
    padding_free: bool = False
    train_vision_tower: bool = False
    num_iterations: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    loss_aggregation: str = "token-mean"
    advantage_scale: str = "group"
    kl_estimator: str = "k3"
    kl_gradient: str = "estimator"
    reinforce_baseline: str = "rloo"
    policy_loss: str = "ppo"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cov_select_frac: float = 2e-4
    cov_low: float = 1.0
    cov_high: float = 5.0
    kl_cov_coef: float = 1.0
    entropy_coef: float = 0.0
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    rollout_correction: str = "none"
    rollout_correction_level: str = "token"
    rollout_is_cap: float = 2.0
    rollout_mask_low: float = 0.5
    rollout_mask_high: float = 2.0
    top_entropy_quantile: float = 1.0
    reward_aggregation: str = "weighted_sum"
    reward_clip: float | list[float] | None = None
    kl_target: float | None = None
    kl_horizon: float = 10000.0
    ref_model_sync_steps: int | None = None
    gamma: float = 1.0
    lam: float = 0.95
    value_coef: float = 0.5
    value_clip: float | None = 0.2
    max_grad_norm: float | None = 1.0
    weight_decay: float = 0.0
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    num_train_epochs: float = 1.0
    max_steps: int | None = None
    seed: int = 0
    logging_steps: int = 1
    save_steps: int | None = None
    resume: bool = False
    stop_token_ids: list[int] | None = None
    reward_weights: list[float] | None = None
    progress_bar: bool = True
    eval_steps: int | None = None
    num_eval_generations: int = 4
    eval_correct_threshold: float = 1.0
    lora: dict[str, Any] | None = None
    max_turns: int = 1
    max_total_tokens: int | None = None
    step_timeout: float | None = 60.0
    engine: str = "hf"
    engine_args: dict[str, Any] | None = None
    engine_sync_steps: int = 1
    reward_timeout: float | None = None
    reward_processes: int = 0
    reward_on_failure: float | None = 0.0
    report_to: list[str] | str = dataclasses.field(default_factory=lambda: ["tensorboard"])
    run_name: str | None = None
    async_generation: bool = False
    max_staleness: int = 1
    partial_rollouts: str = "finish"
    proximal_log_probs: str = "recomputed"
    generator_threads: int | None = None

    def __post_init__(self) -> None:
        fn = "RLConfig"

        def bad(name: str, expected: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{fn}: {name}={getattr(self, name)!r}; expected {expected}")

        def choice(name: str, choices) -> None:
            if getattr(self, name) not in choices:
                raise bad(name, f"one of {list(choices)}")

        def positive_int(name: str, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "an int >= 1" + (" or None" if optional else ""))

        def in_range(name: str, low: float, high: float, optional: bool = False, open_low: bool = False,
                     finite: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            expected = f"a {'finite ' if finite else ''}number in {'(' if open_low else '['}{low}, {high}" + (
                ")" if finite else "]")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, expected)
            if not (low < value <= high if open_low else low <= value <= high) or (finite and not math.isfinite(value)):
                raise bad(name, expected)

        choice("algorithm", ALGORITHMS)
        choice("distributed_strategy", STRATEGIES)  # DistributedConfig's lists: one definition
        choice("mixed_precision", MIXED_PRECISIONS)
        choice("loss_aggregation", AGGREGATION_MODES)
        choice("advantage_scale", GROUP_SCALES)
        choice("kl_estimator", KL_ESTIMATORS)
        choice("kl_gradient", KL_GRADIENTS)
        choice("policy_loss", POLICY_LOSSES)
        if not isinstance(self.mask_truncated_completions, bool):
            raise bad("mask_truncated_completions", "True or False")
        choice("reinforce_baseline", REINFORCE_BASELINES)
        if not isinstance(self.dynamic_sampling, bool):
            raise bad("dynamic_sampling", "True or False")
        positive_int("max_sampling_rounds")
        choice("rollout_correction", ROLLOUT_CORRECTIONS)
        choice("rollout_correction_level", CORRECTION_LEVELS)
        in_range("rollout_is_cap", 0, float("inf"), open_low=True)
        in_range("rollout_mask_low", 0, float("inf"))
        in_range("rollout_mask_high", 0, float("inf"), open_low=True)
        if not self.rollout_mask_low < self.rollout_mask_high:
            raise InvalidArgumentError(
                f"{fn}: rollout_mask_low={self.rollout_mask_low!r} and rollout_mask_high="
                f"{self.rollout_mask_high!r}; expected rollout_mask_low < rollout_mask_high"
            )
        in_range("top_entropy_quantile", 0, 1, open_low=True)
        choice("reward_aggregation", REWARD_AGGREGATIONS)
        self.reward_clip = self._checked_reward_clip()
        in_range("kl_target", 0, float("inf"), optional=True, open_low=True)
        in_range("kl_horizon", 0, float("inf"), open_low=True)
        positive_int("ref_model_sync_steps", optional=True)
        choice("lr_scheduler", LR_SCHEDULERS)
        positive_int("eval_steps", optional=True)
        positive_int("num_eval_generations")
        in_range("eval_correct_threshold", float("-inf"), float("inf"))
        self.lora = check_lora_settings(self.lora)
        self.engine_args = check_engine_settings(self.engine, self.engine_args)
        if isinstance(self.engine_sync_steps, bool) or not isinstance(self.engine_sync_steps, int) or self.engine_sync_steps < 0:
            raise bad("engine_sync_steps", "an int >= 0 (1: sync after every step; 0: never)")
        if not isinstance(self.async_generation, bool):
            raise bad("async_generation", "True or False")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise bad("max_staleness", "an int >= 0 (0: every batch sampled with the previous step's weights)")
        choice("partial_rollouts", PARTIAL_ROLLOUTS)
        choice("proximal_log_probs", PROXIMAL_LOG_PROBS)
        positive_int("generator_threads", optional=True)
        for name in ("num_generations", "max_completion_length", "prompts_per_step", "num_iterations",
                     "logging_steps", "max_turns"):
            positive_int(name)
        for name in ("micro_batch_size", "micro_batch_tokens", "max_steps", "save_steps", "max_total_tokens"):
            positive_int(name, optional=True)
        if not isinstance(self.padding_free, bool):
            raise bad("padding_free", "True or False")
        if not isinstance(self.train_vision_tower, bool):
            raise bad("train_vision_tower", "True or False")
        in_range("learning_rate", 0, float("inf"), open_low=True, finite=True)
        in_range("kl_coef", 0, float("inf"), finite=True)
        in_range("temperature", 0, float("inf"), open_low=True, finite=True)
        in_range("top_p", 0, 1, open_low=True)
        in_range("gamma", 0, 1)
        in_range("lam", 0, 1)
        in_range("value_coef", 0, float("inf"), finite=True)
        in_range("entropy_coef", 0, float("inf"), finite=True)
        in_range("value_clip", 0, float("inf"), optional=True)
        in_range("max_grad_norm", 0, float("inf"), optional=True, open_low=True)
        in_range("weight_decay", 0, float("inf"), finite=True)
        in_range("num_train_epochs", 0, float("inf"), open_low=True)
        in_range("step_timeout", 0, float("inf"), optional=True, open_low=True)
        in_range("reward_timeout", 0, float("inf"), optional=True, open_low=True, finite=True)
        if isinstance(self.reward_processes, bool) or not isinstance(self.reward_processes, int) or self.reward_processes < 0:
            raise bad("reward_processes", "an int >= 0 (0: reward functions run in the training process)")
        in_range("reward_on_failure", float("-inf"), float("inf"), optional=True, finite=True)
        self.report_to = check_report_to(self.report_to)
        if self.run_name is not None and not (isinstance(self.run_name, str) and self.run_name):
            raise bad("run_name", "a non-empty string or None")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an int >= 0 (0 disables top-k)")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise bad("warmup_steps", "an int >= 0")
        if self.clip_high is None:
            self.clip_high = self.clip_low
        for entry in POLICY_LOSS_REGISTRY.values():  # every loss's settings, by the loss itself
            entry.check(self)

        # combinations
        G = self.num_generations
        if self.micro_batch_size is not None and self.micro_batch_size % G:
            raise InvalidArgumentError(
                f"{fn}: micro_batch_size={self.micro_batch_size} is not a multiple of num_generations={G}; "
                "expected whole groups per micro-batch (advantages are computed per group)"
            )
        if self.micro_batch_size is not None and self.micro_batch_tokens is not None:
            raise InvalidArgumentError(
                f"{fn}: micro_batch_size={self.micro_batch_size} and micro_batch_tokens={self.micro_batch_tokens}; "
                "expected at most one of them (micro-batches by rows or by a token budget)"
            )
        if self.kl_target is not None and self.prompts_per_step * G > 5 * self.kl_horizon:
            raise InvalidArgumentError(  # adaptive_kl_coef: 1 - 0.2 * sequences / kl_horizon must stay >= 0
                f"{fn}: kl_horizon={self.kl_horizon} with {self.prompts_per_step * G} sequences per step could "
                f"turn the adaptive KL coefficient negative; expected kl_horizon >= {self.prompts_per_step * G / 5:g}"
            )
        if self.algorithm == "grpo" and G < 2:
            raise InvalidArgumentError(
                f"{fn}: algorithm='grpo' with num_generations={G}; expected >= 2 (a group of one has "
                "no baseline: every advantage would be 0)"
            )
        if self.algorithm == "reinforce" and self.reinforce_baseline in ("rloo", "reinforce++-baseline") and G < 2:
            raise InvalidArgumentError(
                f"{fn}: reinforce_baseline={self.reinforce_baseline!r} with num_generations={G}; expected >= 2 "
                "(the baseline comes from the other samples of the group)"
            )
        for name, off in (("rollout_correction", "none"), ("top_entropy_quantile", 1.0)):
            if getattr(self, name) != off and not POLICY_LOSS_REGISTRY[self.policy_loss].takes_weights:
                weighted = [n for n, entry in POLICY_LOSS_REGISTRY.items() if entry.takes_weights]
                raise InvalidArgumentError(
                    f"{fn}: {name}={getattr(self, name)!r} with policy_loss={self.policy_loss!r}; expected "
                    f"a policy loss that takes per-token weights, one of {weighted}"
                )
        if self.reward_aggregation == "normalize_then_sum" and self.algorithm != "grpo":
            raise InvalidArgumentError(
                f"{fn}: reward_aggregation='normalize_then_sum' with algorithm={self.algorithm!r}; expected "
                "algorithm='grpo' (group-normalized advantages; PPO and REINFORCE build theirs from one reward)"
            )
        for name in ("kl_target", "ref_model_sync_steps"):
            if getattr(self, name) is not None and self.kl_coef == 0:
                raise InvalidArgumentError(
                    f"{fn}: {name}={getattr(self, name)!r} with kl_coef=0; expected kl_coef > 0 (there is "
                    "no KL term, hence no reference policy, to adapt or refresh)"
                )
        if self.ref_model_sync_steps is not None and self.lora is not None:
            raise InvalidArgumentError(
                f"{fn}: ref_model_sync_steps={self.ref_model_sync_steps} with lora; expected one of them: with "
                "LoRA the reference is the policy with its adapters off, so it cannot be refreshed separately"
            )
        if self.algorithm == "reinforce" and self.num_iterations != 1:
            raise InvalidArgumentError(
                f"{fn}: algorithm='reinforce' with num_iterations={self.num_iterations}; REINFORCE is "
                "on-policy (no ratio clipping), expected num_iterations=1 (use 'grpo' or 'ppo' for several passes)"
            )

        if self.async_generation and self.dynamic_sampling:
            raise InvalidArgumentError(
                f"{fn}: async_generation with dynamic_sampling; expected one of them (dynamic sampling decides "
                "how many rounds to draw from the whole step's rewards, across processes, before training)"
            )
        if self.async_generation and not 1 <= self.engine_sync_steps <= self.max_staleness + 1:
            raise InvalidArgumentError(
                f"{fn}: async_generation with engine_sync_steps={self.engine_sync_steps} and max_staleness="
                f"{self.max_staleness}; expected 1 <= engine_sync_steps <= max_staleness + 1 (the generator waits "
                "for weights at most max_staleness steps old, so they must be published that often)"
            )

    def _checked_reward_clip(self) -> list[float] | None:
        """``reward_clip`` as ``[low, high]`` (a number c is ``[-c, c]``), or None."""
        clip = self.reward_clip
        if clip is None:
            return None

        def number(x) -> bool:
            return not isinstance(x, bool) and isinstance(x, (int, float)) and not math.isnan(x)

        if number(clip) and clip > 0:
            return [-float(clip), float(clip)]
        if isinstance(clip, (list, tuple)) and len(clip) == 2 and all(map(number, clip)) and clip[0] < clip[1]:
            return [float(clip[0]), float(clip[1])]
        raise InvalidArgumentError(
            f"RLConfig: reward_clip={clip!r}; expected None, a number c > 0 (clip to [-c, c]) or a pair "
            "[low, high] with low < high"
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RLConfig":
        """A config from a dict (e.g. a YAML file), rejecting unknown keys.

        Args:
            values: field name -> value.

        Returns:
            RLConfig.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise InvalidArgumentError(
                f"RLConfig: unknown field(s) {unknown}; expected fields among {sorted(names)}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict (what the run writes to ``output_dir/config.yaml``).

        Args:
            None.

        Returns:
            dict.
        """
        return dataclasses.asdict(self)
