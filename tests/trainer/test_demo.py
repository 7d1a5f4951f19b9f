"""The embedded demo task: the character tokenizer, the tiny Llama, the copy data and reward."""

import collections

import pytest
import torch

from torchforge.errors import InvalidArgumentError
from torchforge.trainer.demo import (
    CHARACTERS,
    SPECIAL_TOKENS,
    CopyDigitsReward,
    char_tokenizer,
    copy_digits_dataset,
    demo_config,
    tiny_llama,
)

EOS = SPECIAL_TOKENS.index("<eos>")


def test_the_tokenizer_maps_each_character_to_one_token_and_back():
    tokenizer = char_tokenizer()
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(CHARACTERS)
    ids = tokenizer(CHARACTERS)["input_ids"]
    assert ids == list(range(len(SPECIAL_TOKENS), len(tokenizer)))
    assert tokenizer.decode(ids) == CHARACTERS
    assert tokenizer("4a")["input_ids"] == [8, SPECIAL_TOKENS.index("<unk>")]  # one token per character
    batch = tokenizer(["1=", "123="], padding=True)["input_ids"]
    assert batch[0][:2] == [tokenizer.pad_token_id] * 2  # left padding, for generate
    assert char_tokenizer(pad_token=False).pad_token is None


def test_tiny_llama_is_seeded_and_leaves_the_global_rng_alone():
    tokenizer = char_tokenizer()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, c = tiny_llama(tokenizer, seed=1), tiny_llama(tokenizer, seed=1), tiny_llama(tokenizer, seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    config = a.config
    assert (config.vocab_size, config.eos_token_id, config.pad_token_id) == (len(tokenizer), EOS, 0)
    assert a.training and a.dtype == torch.float32


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
