"""The trainer's rollout strategies: what a step samples and scores, made from explicit parts."""

import pytest
import torch

from torchforge import RLConfig
from torchforge.errors import InvalidArgumentError
from torchforge.loop import decode_completions, rollout, score_rewards
from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, tiny_llama
from torchforge.trainer.demo_episodes import AskThenCopy, multi_turn_demo_config
from torchforge.trainer.episodes import EpisodeRollout
from torchforge.trainer.rollouts import ScoredBatch, SingleTurnRollout, render_prompt
from torchforge.trainer.trainer import RLTrainer


def _trainer(tmp_path, **kwargs):
    config = RLConfig(max_steps=1, prompts_per_step=2, num_generations=2, max_completion_length=4,
                      progress_bar=False, save_steps=None, output_dir=str(tmp_path), seed=3, mixed_precision="no")
    tokenizer = char_tokenizer()
    return RLTrainer(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=config,
                     reward_functions=[CopyDigitsReward()], train_dataset=copy_digits_dataset(8), **kwargs)


def test_single_turn_is_the_loops_rollout_and_scoring(tmp_path):
    trainer = _trainer(tmp_path)
    assert isinstance(trainer.rollout_strategy, SingleTurnRollout)
    rows, ids = trainer._rows(0)
    scored = trainer.rollout_strategy(rows, ids, trainer.engine)
    cfg = trainer.config
    prompts = [row["prompt"] for row in rows]
    batch = rollout(trainer.model, trainer.tokenizer, prompts, num_generations=2, max_new_tokens=4,
                    stop_token_ids=trainer.stop_ids, seed=cfg.seed, prompt_ids=ids)
    assert torch.equal(scored.batch.tokens, batch.tokens) and torch.equal(scored.batch.mask, batch.mask)
    completions, completion_ids = decode_completions(trainer.tokenizer, batch)
    columns = {k: [row[k] for row in rows for _ in range(2)] for k in rows[0] if k != "prompt"}
    rewards, parts = score_rewards([CopyDigitsReward()], prompts=[p for p in prompts for _ in range(2)],
                                   completions=completions, completion_ids=completion_ids, columns=columns)
    torch.testing.assert_close(scored.batch.rewards, rewards.to(scored.batch.rewards))
    torch.testing.assert_close(scored.per_function["copy_digits"], parts["copy_digits"])
    assert scored.rows == rows and scored.episodes is None and scored.reward_failures == {}


def test_sampling_writes_nothing_onto_the_trainer(tmp_path):
    trainer = _trainer(tmp_path / "single")
    before = set(vars(trainer))
    trainer.sample_step(0)
    assert set(vars(trainer)) == before
    config = multi_turn_demo_config(max_steps=1, prompts_per_step=2, num_generations=2, progress_bar=False,
                                    output_dir=str(tmp_path / "episodes"), save_steps=None)
    trainer = RLTrainer(config=config, environment_factory=AskThenCopy)
    assert isinstance(trainer.rollout_strategy, EpisodeRollout)
    before = set(vars(trainer))
    scored = trainer.sample_step(0)
    assert set(vars(trainer)) == before
    assert isinstance(scored, ScoredBatch) and len(scored.episodes.returns) == 4  # the record travels with the batch
    sums = trainer.rollout_strategy.metric_sums(scored)
    assert float(sums["episodes/episodes"]) == 4.0
    assert trainer.rollout_strategy.metrics({k: float(v) for k, v in sums.items()})["episodes/turns_mean"] == (
        pytest.approx(float(scored.episodes.turns.double().mean())))


def test_render_prompt():
    assert render_prompt(None, "2+2=") == "2+2="
    with pytest.raises(InvalidArgumentError, match="a prompt is a list of chat messages but the tokenizer has no "
                                                   "chat_template"):
        render_prompt(char_tokenizer(), [{"role": "user", "content": "hi"}])
