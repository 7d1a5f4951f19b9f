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

Vision-language models (:mod:`torchforge.loop.vision`): a prompt's or an observation's images
go through the model's processor (:func:`encode_vision_prompts`), and a ``Batch`` carries
their inputs in ``vision`` (:func:`stack_vision`), which :func:`policy_log_probs` passes to
the forward (:func:`vision_model_inputs`).
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
from torchforge.loop.vision import (
    VisionInputs,
    cat_vision,
    check_dataset_images,
    check_vision_model_folder,
    is_processor_folder,
    encode_vision_prompts,
    image_placeholders,
    images_processor,
    is_processor,
    is_vision_config,
    is_vision_tower_name,
    join_vision,
    load_images,
    load_processor,
    placeholder_ids,
    row_images,
    stack_vision,
    token_type_inputs,
    uses_mrope,
    vision_model_inputs,
    vision_tower_parameters,
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
    # vision-language models (torchforge.loop.vision)
    "VisionInputs",
    "load_images",
    "row_images",
    "check_dataset_images",
    "is_vision_config",
    "check_vision_model_folder",
    "is_processor_folder",
    "images_processor",
    "load_processor",
    "is_processor",
    "encode_vision_prompts",
    "join_vision",
    "image_placeholders",
    "stack_vision",
    "cat_vision",
    "vision_model_inputs",
    "token_type_inputs",
    "uses_mrope",
    "vision_tower_parameters",
    "is_vision_tower_name",
    "placeholder_ids",
]
