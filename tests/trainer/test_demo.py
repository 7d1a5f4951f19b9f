"""The embedded demo task: the copy data, its reward and the demo's settings (the tokenizer and
model it trains are tested in tests/loop/test_tiny_model.py)."""

import collections

import pytest

from torchforge.errors import InvalidArgumentError
from torchforge.loop import tiny_model
from torchforge.loop.tiny_model import SPECIAL_TOKENS
from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, demo_config, tiny_llama

EOS = SPECIAL_TOKENS.index("<eos>")


def test_the_demo_gives_the_whole_task_in_one_import():
    # README and notebooks: from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, ...
    assert char_tokenizer is tiny_model.char_tokenizer and tiny_llama is tiny_model.tiny_llama
    assert CopyDigitsReward().eos_token_id == char_tokenizer().eos_token_id


def test_copy_digits_rows_are_seeded_and_their_digits_uniform():
    rows = copy_digits_dataset(2000, seed=3)
    assert rows == copy_digits_dataset(2000, seed=3) and rows != copy_digits_dataset(2000, seed=4)
    assert all(row["prompt"] == row["target"] + "=" and len(row["target"]) == 3 for row in rows)
    counts = collections.Counter("".join(row["target"] for row in rows))
    assert set(counts) == set("0123456789")
    assert max(abs(n - 600) for n in counts.values()) < 100  # 6000 draws: sd of a count is about 23
    assert [len(r["target"]) for r in copy_digits_dataset(3, num_digits=5)] == [5, 5, 5]


@pytest.mark.parametrize("completion, ids, expected", [
    ("407", [8, 4, 11, EOS], 1.0),        # copied, and stopped right after
    ("407", [8, 4, 11], 0.75),            # copied, cut at the length limit: no stop
    ("470", [8, 11, 4, EOS], 0.5),        # one digit in place, and the stop
    ("4071", [8, 4, 11, 5], 0.5),         # ran on: the extra character costs what stopping earns
    ("40712", [8, 4, 11, 5, 6], 0.25),
    ("", [EOS], 0.0),                     # stopped at once: eos after 0 tokens, not after 3
])
def test_copy_digits_reward_hand_derived(completion, ids, expected):
    reward = CopyDigitsReward()
    assert reward.compute([completion], ["407="], completion_ids=[ids]) == [pytest.approx(expected)]
    # TRL-style call with the dataset's columns as keyword arguments
    assert reward(prompts=["407="], completions=[completion], completion_ids=[ids], target=["407"]) == [
        pytest.approx(expected)]


def test_demo_config_is_the_copy_task_and_takes_overrides():
    config = demo_config(max_steps=7, num_generations=4)
    assert (config.algorithm, config.max_steps, config.num_generations, config.max_completion_length) == (
        "grpo", 7, 4, 4)
    with pytest.raises(InvalidArgumentError, match="max_stepz"):
        demo_config(max_stepz=1)
