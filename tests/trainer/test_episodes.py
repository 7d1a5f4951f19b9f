"""RLTrainer(environment_factory=...): multi-turn episodes in the trainer, the YAML key, the demo."""

import math

import pytest
import torch

from torchforge.errors import InvalidArgumentError
from torchforge.loop.environments import Environment, StepResult
from torchforge.trainer.demo_episodes import AskThenCopy, multi_turn_demo_config
from torchforge.trainer.trainer import RLTrainer


def small(tmp_path, **overrides):
    values = dict(max_steps=1, prompts_per_step=2, num_generations=4, progress_bar=False,
                  output_dir=str(tmp_path), save_steps=None)
    values.update(overrides)
    return multi_turn_demo_config(**values)


def test_a_step_with_an_environment(tmp_path):
    trainer = RLTrainer(config=small(tmp_path), environment_factory=AskThenCopy)
    assert trainer.reward_functions == []        # optional with an environment
    metrics = trainer.train_step(0)
    for key in ("episodes/turns_mean", "episodes/env_seconds_per_step", "episodes/truncated_frac",
                "episodes/reward_per_turn", "rewards/environment/mean"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert 1.0 <= metrics["episodes/turns_mean"] <= 2.0
    assert metrics["reward"] == pytest.approx(metrics["rewards/environment/mean"])


def test_environment_and_reward_functions_are_summed_weighted(tmp_path):
    class Weighted(AskThenCopy):
        reward_weight = 0.5

    def transcript_length(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = RLTrainer(config=small(tmp_path, reward_weights=[2.0]), environment_factory=Weighted,
                        reward_functions=[transcript_length])
    scored = trainer.sample_step(0)
    batch, parts, lengths = scored.batch, scored.per_function, scored.episodes.lengths
    # the function saw the transcript: model and environment tokens after the prompt (no specials)
    transcripts = trainer.tokenizer.batch_decode([row[:n] for row, n in zip(batch.tokens.tolist(), lengths.tolist())],
                                                 skip_special_tokens=True)
    torch.testing.assert_close(parts["transcript_length"],
                               torch.tensor([float(len(t)) for t in transcripts], dtype=torch.float64))
    torch.testing.assert_close(parts["environment"], scored.episodes.returns)
    torch.testing.assert_close(batch.rewards, 0.5 * parts["environment"] + 2.0 * parts["transcript_length"])


def test_groups_are_the_episodes_of_a_row(tmp_path):
    seen = []

    class Recording(AskThenCopy):
        def reset(self, row):
            seen.append(row["target"])
            return super().reset(row)

    trainer = RLTrainer(config=small(tmp_path), environment_factory=Recording)
    trainer.sample(0)
    assert len(seen) == 8 and len(set(seen[:4])) == 1 and len(set(seen[4:])) == 1


def test_ppo_with_an_environment(tmp_path):
    trainer = RLTrainer(config=small(tmp_path, algorithm="ppo"), environment_factory=AskThenCopy)
    metrics = trainer.train_step(0)
    assert math.isfinite(metrics["loss"]) and "value_loss" in metrics


def test_a_faulty_environment_does_not_stop_the_run(tmp_path):
    class Broken(Environment):
        def reset(self, row):
            return "="

        def step(self, action):
            raise RuntimeError("the tool is down")

    trainer = RLTrainer(config=small(tmp_path, max_steps=2), environment_factory=Broken)
    summary = trainer.train()
    assert summary["steps"] == 2 and trainer.history[-1]["episodes/faulted_frac"] == 1.0
    assert trainer.history[-1]["reward"] == 0.0


def test_without_environment_or_reward_functions_is_an_error(tmp_path):
    from torchforge.trainer.demo import char_tokenizer, copy_digits_dataset, tiny_llama

    tokenizer = char_tokenizer()
    with pytest.raises(InvalidArgumentError, match="reward_functions is empty"):
        RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=small(tmp_path), reward_functions=[],
                  train_dataset=copy_digits_dataset(4))


def test_the_yaml_environment_key(tmp_path):
    from torchforge.trainer.cli import build_trainer, load_run_config

    values = load_run_config("examples/multi_turn.yaml", [f"output_dir={tmp_path}", "max_steps=1",
                                                          "prompts_per_step=2", "progress_bar=false"])
    trainer = build_trainer(values)
    assert trainer.environment_factory is AskThenCopy and trainer.config.max_turns == 2
    assert "episodes/turns_mean" in trainer.train_step(0)


def test_the_demo_environment():
    env = AskThenCopy()
    assert env.reset({"target": "407"}) == "="
    assert env.step("x") == StepResult(None, 0.0, True)          # did not ask: over
    env.reset({"target": "407"})
    assert env.step("=") == StepResult("407=", 0.2, False)
    assert env.step("407") == StepResult(None, 0.8, True)


@pytest.mark.slow
def test_the_multi_turn_demo_learns(tmp_path):
    """GRPO on ask-then-copy: the model learns to ask, then starts to copy (a few minutes on a CPU)."""
    trainer = RLTrainer(config=multi_turn_demo_config(max_steps=40, progress_bar=False, output_dir=str(tmp_path),
                                                      save_steps=None), environment_factory=AskThenCopy)
    rewards, turns = [], []
    for step in range(40):
        metrics = trainer.train_step(step)
        rewards.append(metrics["reward"])
        turns.append(metrics["episodes/turns_mean"])
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.06 and last > 0.12 and last > 3 * first, (first, last)
    assert sum(turns[-5:]) / 5 > 1.7      # most episodes now ask, and get a second turn
