"""``RLTrainer(environment_factory=...)``: a step's batch from multi-turn episodes.

:class:`EpisodeRollout` is the trainer's rollout strategy
(:mod:`torchforge.trainer.rollouts`) when it has an environment factory: it plays G
episodes of each of this process's rows with fresh environments
(:func:`torchforge.loop.environments.rollout_episodes`), sets the rewards, and returns the
episodes' record with the batch; its metrics are summed over processes with the step's.

Rewards: ``rewards_b = w_env * (sum_k r_bk + s_b) + sum_f w_f * r_fb``: the environment's
turn rewards summed over the episode, plus ``s_b`` when the environment factory scores
whole episodes (``score_episodes(envs, num_generations=G, faulted=...) -> (s [B], parts)``,
as :class:`torchforge.loop.verifiers_env.VerifiersEnvironment` does with its rubric; each
part is logged as ``rewards/environment/<name>/``), weighted by the environment's
``reward_weight`` (default 1.0), plus the reward functions when there are any (each sees the episode's
transcript, model and observation text after the prompt, as its ``completion``; a sample
that no function applies to adds 0). ``batch.rewards`` is [B], so GRPO's groups are the G
episodes of a row; PPO places it at the episode's last model token and its GAE skips the
observation tokens (the mask's gaps).

A vision-language model (``RLTrainer(processor=...)``): a row's ``images`` are the prompt's
(where ``reset``'s ``{"type": "image"}`` parts put them), an observation may bring more
(``StepResult(..., images=...)``), the batch carries them all, and the reward functions get
the row's PIL images as ``images``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from torchforge.batch import Batch
from torchforge.errors import InvalidArgumentError
from torchforge.loop.engines import GenerationEngine
from torchforge.loop.environments import Episodes, episode_metrics, rollout_episodes
from torchforge.loop.rewards import score_rewards
from torchforge.trainer.rollouts import RolloutStrategy, ScoredBatch

__all__ = ["EpisodeRollout"]

NO_LIMIT = 2**31 - 1


@dataclass
class EpisodeRollout(RolloutStrategy):
    """G multi-turn episodes of each row, scored by the environment and the reward functions.

    Args:
        environment_factory: makes one environment per episode (``reset(row)``,
            ``step(action)``); its ``reward_weight`` (default 1.0) weighs the environment's
            rewards, and a ``score_episodes`` method, when it has one, scores whole episodes.
        processor: a vision-language model's processor, or None.
        The other arguments as :class:`~torchforge.trainer.rollouts.RolloutStrategy`'s.

    Returns:
        The strategy: ``strategy(rows, ids, engine) -> ScoredBatch`` whose ``episodes`` is the
        :class:`~torchforge.loop.environments.Episodes` record.
    """

    environment_factory: Callable[[], Any]
    processor: Any = None

    def __call__(self, rows: list[dict[str, Any]], ids: list[int], engine: GenerationEngine) -> ScoredBatch:
        cfg, G = self.config, self.config.num_generations
        envs = [self.environment_factory() for _ in range(len(rows) * G)]
        images = None
        if self.processor is not None:  # the rows' images: the prompts' (torchforge.trainer.vision_task)
            from torchforge.loop.vision import row_images

            images = [row_images(row, where=f"dataset row {i}") for row, i in zip(rows, ids)]
        with self.autocast():
            batch, record = rollout_episodes(
                self.model, self.tokenizer, envs, rows=rows, num_generations=G, max_turns=cfg.max_turns,
                max_new_tokens_per_turn=cfg.max_completion_length, max_total_tokens=cfg.max_total_tokens or NO_LIMIT,
                step_timeout=cfg.step_timeout, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                stop_token_ids=self.stop_ids, seed=cfg.seed, episode_ids=ids, engine=engine, images=images,
                processor=self.processor,
            )
        per_function = self._score(batch, self._prompts(batch, rows), rows, record, envs, images)
        return ScoredBatch(batch, per_function, rows, episodes=record)

    def metric_sums(self, scored: ScoredBatch) -> dict[str, torch.Tensor]:
        return {f"episodes/{k}": v for k, v in scored.episodes.metric_sums(scored.batch.truncated.cpu()).items()}

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """``episodes/turns_mean``, ``episodes/env_seconds_per_step``, ``episodes/truncated_frac``,
        ``episodes/faulted_frac``, ``episodes/reward_per_turn`` (:func:`~torchforge.loop.environments.episode_metrics`)."""
        return episode_metrics({k.removeprefix("episodes/"): v for k, v in sums.items() if k.startswith("episodes/")})

    def _prompts(self, batch: Batch, rows: list[dict[str, Any]]) -> list[str]:
        """The N prompts as text: a row's string prompt, else its first observation as tokenized."""
        G = self.config.num_generations
        firsts = [p[batch.prompt_mask[i * G]].tolist() for i, p in enumerate(batch.prompt_tokens[::G])]
        text = self.tokenizer.batch_decode(firsts, skip_special_tokens=True)
        return [p if isinstance(p, str) else t for p, t in zip((row.get("prompt") for row in rows), text)]

    def _score(self, batch: Batch, prompts: list[str], rows: list[dict[str, Any]], record: Episodes,
               envs: list[Any], images: list[list[Any]] | None = None) -> dict[str, torch.Tensor]:
        """Set ``batch.rewards`` [B] (environment and reward functions, weighted); return the parts:
        name -> float64 [B] unweighted scores: ``environment`` (its turn rewards and its own
        score), ``environment/<name>`` for each part of that score, and each reward function's."""
        G = self.config.num_generations
        env_returns, env_parts = record.returns, {}
        scorer = getattr(self.environment_factory, "score_episodes", None)
        if callable(scorer):  # e.g. a verifiers rubric: the whole episodes, each row's G together
            scores, env_parts = scorer(envs, num_generations=G, faulted=record.faulted.tolist())
            env_returns = env_returns + scores.to(env_returns)
        total = float(getattr(envs[0], "reward_weight", 1.0)) * env_returns
        per_function = {"environment": env_returns, **{f"environment/{k}": v for k, v in env_parts.items()}}
        if self.reward_functions:
            ids = [row[:n] for row, n in zip(batch.tokens.tolist(), record.lengths.tolist())]
            transcripts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            columns = self._columns(rows)
            if images is not None:  # the reward functions see the rows' PIL images
                columns["images"] = [im for im in images for _ in range(G)]
                columns.pop("image", None)
            scores, parts = score_rewards(
                self.reward_functions, prompts=[p for p in prompts for _ in range(G)], completions=transcripts,
                completion_ids=ids, columns=columns, weights=self.config.reward_weights,
            )
            total = total + scores.nan_to_num(0.0)
            if "environment" in parts:
                raise InvalidArgumentError("RLTrainer: a reward function is named 'environment'; expected another name "
                                           "(the environment's rewards are logged under it)")
            per_function.update(parts)
        batch.rewards = total.to(batch.tokens.device)
        return per_function
