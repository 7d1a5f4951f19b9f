"""``RLTrainer(environment_factory=...)``: a step's batch from multi-turn episodes.

The trainer calls these in place of its single-turn rollout and scoring when it has an
environment factory: :func:`rollout_step` plays G episodes of each of this process's rows
(:func:`torchforge.loop.environments.rollout_episodes`), :func:`score_step` sets the
rewards, and :func:`step_metrics` adds the episode metrics (summed over processes).

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
"""

from __future__ import annotations

from typing import Any

import torch

from torchforge.batch import Batch
from torchforge.distributed import reduce_metric_sums
from torchforge.errors import InvalidArgumentError
from torchforge.loop.environments import episode_metrics, rollout_episodes
from torchforge.loop.rewards import score_rewards

__all__ = ["rollout_step", "score_step", "step_metrics"]

NO_LIMIT = 2**31 - 1


def rollout_step(trainer: Any, rows: list[dict[str, Any]], ids: list[int]) -> tuple[Batch, list[str]]:
    """Play ``num_generations`` episodes of each row with fresh environments.

    Args:
        trainer: the RLTrainer (its config, model, tokenizer, stop ids, environment factory).
        rows: this process's N dataset rows of the step.
        ids: their N global ids (seeds the samples).

    Returns:
        ``(batch, prompts)``: the episodes' Batch (``rewards`` still per token) and the N
        prompts as text; the :class:`~torchforge.loop.environments.Episodes` record is kept
        as ``trainer.episodes`` for :func:`score_step` and :func:`step_metrics`.
    """
    cfg, G = trainer.config, trainer.config.num_generations
    envs = [trainer.environment_factory() for _ in range(len(rows) * G)]
    with trainer._autocast_context():
        batch, trainer.episodes = rollout_episodes(
            trainer.model, trainer.tokenizer, envs, rows=rows, num_generations=G, max_turns=cfg.max_turns,
            max_new_tokens_per_turn=cfg.max_completion_length, max_total_tokens=cfg.max_total_tokens or NO_LIMIT,
            step_timeout=cfg.step_timeout, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            stop_token_ids=trainer.stop_ids, seed=cfg.seed, episode_ids=ids, engine=trainer.engine,
        )
    trainer.environment_weight = float(getattr(envs[0], "reward_weight", 1.0))
    trainer.episode_envs = envs  # for an environment factory that scores the episodes itself (score_step)
    prompts = [row.get("prompt") for row in rows]
    firsts = [p[batch.prompt_mask[i * G]].tolist() for i, p in enumerate(batch.prompt_tokens[::G])]
    text = trainer.tokenizer.batch_decode(firsts, skip_special_tokens=True)
    return batch, [p if isinstance(p, str) else t for p, t in zip(prompts, text)]


def score_step(trainer: Any, batch: Batch, prompts: list[str], rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Set ``batch.rewards`` [B] (environment and reward functions, weighted); return the parts.

    Args:
        trainer: the RLTrainer, after :func:`rollout_step`.
        batch: the episodes' Batch.
        prompts: the N prompts.
        rows: the N rows (their fields reach the reward functions).

    Returns:
        name -> float64 [B] unweighted scores: ``environment`` (its turn rewards and its own
        score), ``environment/<name>`` for each part of that score, and each reward function's.
    """
    G, record = trainer.config.num_generations, trainer.episodes
    env_returns, env_parts = record.returns, {}
    scorer = getattr(trainer.environment_factory, "score_episodes", None)
    if callable(scorer):  # e.g. a verifiers rubric: the whole episodes, each row's G together
        scores, env_parts = scorer(trainer.episode_envs, num_generations=G, faulted=record.faulted.tolist())
        env_returns = env_returns + scores.to(env_returns)
    total = trainer.environment_weight * env_returns
    per_function = {"environment": env_returns, **{f"environment/{k}": v for k, v in env_parts.items()}}
    if trainer.reward_functions:
        ids = [row[:n] for row, n in zip(batch.tokens.tolist(), record.lengths.tolist())]
        transcripts = trainer.tokenizer.batch_decode(ids, skip_special_tokens=True)
        columns = {key: [row[key] for row in rows for _ in range(G)] for key in rows[0] if key != "prompt"}
        scores, parts = score_rewards(
            trainer.reward_functions, prompts=[p for p in prompts for _ in range(G)], completions=transcripts,
            completion_ids=ids, columns=columns, weights=trainer.config.reward_weights,
        )
        total = total + scores.nan_to_num(0.0)
        if "environment" in parts:
            raise InvalidArgumentError("RLTrainer: a reward function is named 'environment'; expected another name "
                                       "(the environment's rewards are logged under it)")
        per_function.update(parts)
    batch.rewards = total.to(batch.tokens.device)
    return per_function


def step_metrics(record: Any, batch: Batch) -> dict[str, float]:
    """The episode metrics of the step, over every process (every process calls this).

    Args:
        record: the episodes of the step's batch (what :func:`rollout_step` left as
            ``trainer.episodes`` when it sampled that batch).
        batch: the step's batch.

    Returns:
        ``episodes/turns_mean``, ``episodes/env_seconds_per_step``, ``episodes/truncated_frac``,
        ``episodes/faulted_frac``, ``episodes/reward_per_turn``.
    """
    return episode_metrics(reduce_metric_sums(record.metric_sums(batch.truncated.cpu())))
