"""torchforge: PyTorch-native reinforcement-learning primitives for post-training language models.

The primitives import only torch, tensordict and einops. The loop and trainer names
(``RLTrainer``, ``Algorithm``, ``rollout``...) need transformers and are imported on first
use, so ``import torchforge`` stays light for people who only call the losses.
"""

import importlib

from torchforge.advantages import (
    GROUP_SCALES,
    best_minus_second_advantages,
    group_advantages,
    opo_advantages,
    passk_advantages,
    rloo_advantages,
    zero_std_groups,
)
from torchforge.batch import Batch, batch_args, is_batch
from torchforge.corrections import (
    CORRECTION_LEVELS,
    ratio_mask,
    truncated_importance_weights,
    unscored_tokens,
)
from torchforge.covariance_losses import clip_cov_loss, kl_cov_loss
from torchforge.distributed import (
    SHARDING_STRATEGIES,
    STRATEGIES,
    DistributedConfig,
    barrier,
    export_pretrained,
    gather_over_ranks,
    generation_kwargs,
    global_counts,
    init_distributed,
    is_main_process,
    latest_checkpoint,
    launch,
    load_checkpoint,
    rank,
    reduce_metric_extrema,
    reduce_metric_sums,
    rng_state,
    save_checkpoint,
    set_rng_state,
    shard,
    sum_over_ranks,
    full_weights,
    sync_weights,
    teardown_distributed,
    unwrap_model,
    whiten_over_ranks,
    world_size,
)
from torchforge.entropy_selection import entropy_threshold, high_entropy_mask
from torchforge.errors import (
    DTypeError,
    InvalidArgumentError,
    MissingKeyError,
    ShapeError,
    TorchforgeError,
    reraise_as,
)
from torchforge.kl import (
    KL_ESTIMATORS,
    KL_GRADIENTS,
    adaptive_kl_coef,
    approx_kl,
    exact_kl,
)
from torchforge.log_probs import (
    FUSED_CHUNK_ELEMENTS,
    LOGITS_CHUNK_ELEMENTS,
    chunk_rows,
    fused_token_log_probs,
    row_chunks,
    token_entropy,
    token_log_probs,
)
from torchforge.losses import grpo_loss, ppo_loss, ppo_surrogate, reinforce_loss
from torchforge.ratios import RATIO_LEVELS, clamp_log_ratio, policy_ratio, ratio_metrics, sequence_log_ratio
from torchforge.reduce import (
    AGGREGATION_MODES,
    Aggregation,
    aggregate,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    masked_var,
    masked_whiten,
    pooled_var,
)
from torchforge.returns import (
    discounted_returns,
    gae,
    kl_penalized_rewards,
    reinforce_pp_advantages,
    remax_advantages,
)
from torchforge.reward_shaping import overlong_penalty
from torchforge.trust_region_losses import cispo_loss, gmpo_loss, sapo_loss
from torchforge.value_losses import value_loss

# name -> module, imported on first access (they need transformers)
_LAZY = {
    **dict.fromkeys(["RLTrainer", "RLConfig", "Algorithm", "GRPO", "PPO", "REINFORCE"], "torchforge.trainer"),
    **dict.fromkeys([
        "rollout", "decode_completions", "completion_mask", "policy_log_probs", "ValueModel",
        "accumulate_gradients", "optimizer_step", "micro_batches", "micro_batches_by_tokens", "pack_sequences",
        "check_packable", "Metric", "StepMetrics",
        "RewardFunction", "RewardError", "score_rewards",
        "rollout_episodes", "Environment", "StepResult", "evaluate", "pass_at_k",
        "GenerationEngine", "HFEngine", "SamplingSettings", "Completion", "completions_batch", "request_seeds",
    ], "torchforge.loop"),
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchforge' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    # trainer (the product card's API)
    "RLTrainer",
    "RLConfig",
    "RewardFunction",
    "Algorithm",
    "GRPO",
    "PPO",
    "REINFORCE",
    "DistributedConfig",
    # loop
    "rollout",
    "decode_completions",
    "completion_mask",
    "policy_log_probs",
    "ValueModel",
    "micro_batches",
    "micro_batches_by_tokens",
    "pack_sequences",
    "check_packable",
    "accumulate_gradients",
    "Metric",
    "StepMetrics",
    "optimizer_step",
    "rollout_episodes",
    "evaluate",
    "pass_at_k",
    "Environment",
    "StepResult",
    "GenerationEngine",
    "HFEngine",
    "SamplingSettings",
    "Completion",
    "completions_batch",
    "request_seeds",
    # rewards
    "score_rewards",
    "RewardError",
    # batch
    "Batch",
    "batch_args",
    "is_batch",
    # errors
    "TorchforgeError",
    "ShapeError",
    "DTypeError",
    "InvalidArgumentError",
    "MissingKeyError",
    "reraise_as",
    # log_probs
    "token_log_probs",
    "fused_token_log_probs",
    "token_entropy",
    "chunk_rows",
    "row_chunks",
    "LOGITS_CHUNK_ELEMENTS",
    "FUSED_CHUNK_ELEMENTS",
    # kl
    "approx_kl",
    "exact_kl",
    "adaptive_kl_coef",
    "KL_ESTIMATORS",
    "KL_GRADIENTS",
    # reduce
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "pooled_var",
    "masked_min",
    "masked_max",
    "aggregate",
    "Aggregation",
    "AGGREGATION_MODES",
    # advantages
    "group_advantages",
    "rloo_advantages",
    "passk_advantages",
    "best_minus_second_advantages",
    "opo_advantages",
    "remax_advantages",
    "discounted_returns",
    "reinforce_pp_advantages",
    "kl_penalized_rewards",
    "gae",
    "GROUP_SCALES",
    # losses
    "policy_ratio",
    "clamp_log_ratio",
    "sequence_log_ratio",
    "ratio_metrics",
    "ppo_surrogate",
    "ppo_loss",
    "grpo_loss",
    "reinforce_loss",
    "cispo_loss",
    "sapo_loss",
    "gmpo_loss",
    "clip_cov_loss",
    "kl_cov_loss",
    "value_loss",
    "RATIO_LEVELS",
    # corrections
    "truncated_importance_weights",
    "ratio_mask",
    "unscored_tokens",
    "high_entropy_mask",
    "entropy_threshold",
    "overlong_penalty",
    "zero_std_groups",
    "CORRECTION_LEVELS",
    # distributed
    "shard",
    "init_distributed",
    "teardown_distributed",
    "world_size",
    "rank",
    "is_main_process",
    "barrier",
    "global_counts",
    "reduce_metric_sums",
    "whiten_over_ranks",
    "sum_over_ranks",
    "reduce_metric_extrema",
    "gather_over_ranks",
    "unwrap_model",
    "generation_kwargs",
    "launch",
    "sync_weights",
    "full_weights",
    "STRATEGIES",
    "SHARDING_STRATEGIES",
    # checkpoint
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "export_pretrained",
    "rng_state",
    "set_rng_state",
]
