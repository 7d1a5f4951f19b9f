"""The loop's building blocks over a Hugging Face causal LM: rollout, log-probs, values, update.

Plain functions; :class:`torchforge.trainer.RLTrainer` calls them in order, and a
handwritten loop can call them too:

1. :func:`rollout` samples ``num_generations`` completions per prompt -> a ``Batch``.
2. :func:`decode_completions` turns them into text for the reward functions.
3. :func:`policy_log_probs` computes token log-probs (and entropy) from the last hidden
   states and the LM head with :func:`torchforge.log_probs.fused_token_log_probs`: the
   [B, T, V] logits never exist.
4. :func:`accumulate_gradients` runs one optimizer step's micro-batches with exact loss
   aggregation (global token / sequence counts), then :func:`optimizer_step` clips and steps.

Generation goes through an engine (:mod:`torchforge.loop.engines`): Hugging Face
``generate`` by default, vLLM in process or as a server (:mod:`torchforge.loop.vllm_engine`).

:func:`evaluate` scores sampled and greedy completions of held-out prompts (pass@k).
"""

from torchforge.loop.engines import Completion, GenerationEngine, HFEngine, SamplingSettings, request_seeds
from torchforge.loop.environments import Environment, Episodes, StepResult, episode_metrics, rollout_episodes
from torchforge.loop.evaluate import evaluate, pass_at_k
from torchforge.loop.packing import PACKABLE_ATTENTION, Packing, check_packable, completion_lengths, pack_sequences
from torchforge.loop.policy import (
    ValueModel,
    head_transform,
    policy_log_probs,
    rollout_log_prob_gap,
)
from torchforge.loop.rewards import RewardError, RewardFunction, score_rewards
from torchforge.loop.rollout import (
    completion_mask,
    completion_stop_ids,
    completions_batch,
    decode_completions,
    rollout,
)
from torchforge.loop.metrics import Metric, StepMetrics
from torchforge.loop.update import (
    accumulate_gradients,
    micro_batches,
    micro_batches_by_tokens,
    optimizer_step,
    sequence_tokens,
)

__all__ = [
    "rollout",
    "completions_batch",
    "GenerationEngine",
    "SamplingSettings",
    "Completion",
    "HFEngine",
    "request_seeds",
    "completion_stop_ids",
    "completion_mask",
    "decode_completions",
    "policy_log_probs",
    "head_transform",
    "rollout_log_prob_gap",
    "ValueModel",
    "Environment",
    "StepResult",
    "Episodes",
    "rollout_episodes",
    "episode_metrics",
    "RewardFunction",
    "RewardError",
    "score_rewards",
    "micro_batches",
    "micro_batches_by_tokens",
    "sequence_tokens",
    "pack_sequences",
    "Packing",
    "check_packable",
    "completion_lengths",
    "PACKABLE_ATTENTION",
    "accumulate_gradients",
    "Metric",
    "StepMetrics",
    "optimizer_step",
    "evaluate",
    "pass_at_k",
]
