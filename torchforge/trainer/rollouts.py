"""How ``RLTrainer`` samples and scores a step's batch: its rollout strategy.

A strategy is made once, from what it uses (the model, tokenizer, reward functions and the
run's settings), and called with this process's dataset rows of a step and the generation
engine to sample with (the trainer's ``engine``, which a run may replace); it returns what it made, a :class:`ScoredBatch`, and writes nothing onto the
trainer, so the generator thread of asynchronous training and the trainer's own step
never share a half-made step.

- :class:`SingleTurnRollout`: G completions of each prompt
  (:func:`torchforge.loop.rollout`), scored by the reward functions;
- :class:`~torchforge.trainer.episodes.EpisodeRollout`: G multi-turn episodes of each row
  with an environment factory (``RLTrainer(environment_factory=...)``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from torchforge.batch import Batch
from torchforge.errors import InvalidArgumentError
from torchforge.loop import decode_completions, rollout
from torchforge.loop.engines import GenerationEngine
from torchforge.loop.environments import Episodes
from torchforge.loop.rewards import score_rewards

__all__ = ["RolloutStrategy", "ScoredBatch", "SingleTurnRollout", "render_prompt"]


@dataclass
class ScoredBatch:
    """One step's batch on this process, sampled and scored.

    Args:
        batch: the Batch, ``rewards`` set (the weighted sum the update sees).
        per_function: name -> [B] unweighted scores of each reward function (NaN: not
            applicable); with episodes also ``environment`` and its parts.
        rows: the N dataset rows sampled (row ``b // G`` for sample ``b``).
        episodes: the multi-turn record (:class:`~torchforge.trainer.episodes.EpisodeRollout`),
            else None.
        reward_failures: ``rewards/<name>/timeouts`` and ``/crashes``: completions whose guarded
            reward function timed out or crashed while this batch was scored (this process's
            counts, to sum over processes).

    Returns:
        The record.

    Example:
        >>> scored = ScoredBatch(Batch(tokens=torch.zeros(2, 1, dtype=torch.long), batch_size=[2]), {}, [{"prompt": "1="}])
        >>> scored.rows, scored.episodes
        ([{'prompt': '1='}], None)
    """

    batch: Batch
    per_function: dict[str, torch.Tensor]
    rows: list[dict[str, Any]]
    episodes: Episodes | None = None
    reward_failures: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RolloutStrategy:
    """What every rollout strategy is made from; call it with a step's rows.

    Args:
        config: the run's ``RLConfig`` (sampling settings, ``num_generations``, reward weights).
        model: the policy (the engine samples with it, or with its own copy of the weights).
        tokenizer: its tokenizer.
        stop_ids: the token ids that end a completion.
        reward_functions: the (guarded) reward functions.
        autocast: the trainer's mixed-precision context, entered around sampling.
        device: where ``batch.rewards`` goes.

    Returns:
        The strategy: ``strategy(rows, ids, engine) -> ScoredBatch``.
    """

    config: Any
    model: nn.Module
    tokenizer: Any
    stop_ids: list[int]
    reward_functions: list[Callable]
    autocast: Callable[[], AbstractContextManager]
    device: torch.device

    def __call__(self, rows: list[dict[str, Any]], ids: list[int], engine: GenerationEngine) -> ScoredBatch:
        """Sample G completions (or episodes) of each row and score them.

        Args:
            rows: this process's N dataset rows of the step.
            ids: their N global ids in the data stream (they seed the samples).
            engine: the generation engine that samples.

        Returns:
            The :class:`ScoredBatch` of B = N * G samples.
        """
        raise NotImplementedError

    def metric_sums(self, scored: ScoredBatch) -> dict[str, torch.Tensor]:
        """Sums and counts of the strategy's own metrics for ``scored``, to add over processes.

        Args:
            scored: the batch being trained.

        Returns:
            name -> scalar tensor; none for a single turn.
        """
        return {}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The strategy's metrics from :meth:`metric_sums` added over every process.

        Args:
            sums: the added sums.

        Returns:
            name -> float; none for a single turn.
        """
        return {}

    def _columns(self, rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
        """Each row field but the prompt, repeated for its G samples: the reward functions' keywords."""
        G = self.config.num_generations
        return {key: [row[key] for row in rows for _ in range(G)] for key in rows[0] if key != "prompt"}


@dataclass
class SingleTurnRollout(RolloutStrategy):
    """G completions of each row's prompt, scored by the reward functions (the default).

    A prompt is a string, or chat messages rendered with the tokenizer's chat template;
    ``batch.rewards`` is the weighted sum of the reward functions (``RLConfig.reward_weights``,
    else each function's ``weight``). Made as :class:`RolloutStrategy` is, and with
    ``processor`` for a vision-language model: each row's images (``images``, and the
    ``{"type": "image"}`` parts of its chat prompt) go through the processor, the batch
    carries their vision inputs, and the reward functions get the PIL images as ``images``
    (:mod:`torchforge.trainer.vision_task`).
    """

    processor: Any = None

    def __call__(self, rows: list[dict[str, Any]], ids: list[int], engine: GenerationEngine) -> ScoredBatch:
        cfg, G = self.config, self.config.num_generations
        images, columns = None, self._columns(rows)
        if self.processor is not None:
            from torchforge.trainer.vision_task import row_prompt_and_images

            rendered = [row_prompt_and_images(self.processor, row, f"dataset row {i}") for row, i in zip(rows, ids)]
            prompts, images = [p for p, _ in rendered], [im for _, im in rendered]
            columns["images"] = [im for im in images for _ in range(G)]  # the reward functions see PIL images
            columns.pop("image", None)
        else:
            prompts = [render_prompt(self.tokenizer, row["prompt"]) for row in rows]
        with self.autocast():
            batch = rollout(self.model, self.tokenizer, prompts, num_generations=G,
                            max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                            top_p=cfg.top_p, top_k=cfg.top_k, stop_token_ids=self.stop_ids,
                            seed=cfg.seed, prompt_ids=ids, engine=engine, images=images, processor=self.processor)
        completions, completion_ids = decode_completions(self.tokenizer, batch)
        rewards, per_function = score_rewards(
            self.reward_functions, prompts=[p for p in prompts for _ in range(G)], completions=completions,
            completion_ids=completion_ids, columns=columns, weights=cfg.reward_weights,
        )
        batch.rewards = rewards.to(self.device)
        return ScoredBatch(batch, per_function, rows)


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], *, caller: str = "RLTrainer") -> str:
    """A dataset row's prompt as text: a string as it is; chat messages through the tokenizer's
    chat template, with the generation prompt.

    Args:
        tokenizer: the tokenizer (its ``chat_template`` for a list of messages).
        prompt: a string, or a list of chat messages (``{"role": ..., "content": ...}``).
        caller: the name an error starts with (``RLTrainer``, ``evaluate``).

    Returns:
        The text to sample from.

    Example:
        >>> render_prompt(None, "2+2=")
        '2+2='
    """
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidArgumentError(
            f"{caller}: a prompt is a list of chat messages but the tokenizer has no chat_template; "
            "expected a string prompt, or a tokenizer with a chat template"
        )
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
