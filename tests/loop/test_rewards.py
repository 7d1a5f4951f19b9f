"""Reward scoring: both kinds of reward function, weights, None, and the error paths."""

import math

import pytest
import torch

from torchforge.trainer.demo import CopyDigitsReward
from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import RewardError, RewardFunction, reward_name, score_rewards

PROMPTS = ["12=", "12=", "34="]
COMPLETIONS = ["12", "1", "x"]


class Length(RewardFunction):
    def compute(self, completions, prompts):
        return [float(len(c)) for c in completions]


def starts_with_one(prompts, completions, **kwargs):
    return [1.0 if c.startswith("1") else None for c in completions]


def test_weighted_sum_over_the_functions_that_apply():
    total, parts = score_rewards([Length(), starts_with_one], prompts=PROMPTS, completions=COMPLETIONS,
                                 weights=[0.5, 2.0])
    # row 0: 0.5 * 2 + 2 * 1; row 1: 0.5 * 1 + 2 * 1; row 2: 0.5 * 1 (starts_with_one is None)
    torch.testing.assert_close(total, torch.tensor([3.0, 2.5, 0.5], dtype=torch.float64))  # the functions' floats
    assert list(parts) == ["Length", "starts_with_one"]
    assert torch.isnan(parts["starts_with_one"][2]) and parts["Length"].tolist() == [2.0, 1.0, 1.0]


def test_nan_when_no_function_applies():
    total, _ = score_rewards([starts_with_one], prompts=PROMPTS, completions=COMPLETIONS)
    assert total[:2].tolist() == [1.0, 1.0] and math.isnan(total[2])


def test_callables_get_ids_and_dataset_columns():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(ids=completion_ids, answer=answer)
        return [0.0] * len(completions)

    score_rewards([spy], prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1], [2], [3]],
                  columns={"answer": ["a", "a", "b"]})
    assert seen == {"ids": [[1], [2], [3]], "answer": ["a", "a", "b"]}


def test_weight_attribute_and_name():
    class Weighted(Length):
        name = "len"
        weight = 3.0

    total, parts = score_rewards([Weighted()], prompts=PROMPTS, completions=COMPLETIONS)
    assert total.tolist() == [6.0, 3.0, 3.0] and list(parts) == ["len"]
    assert reward_name(starts_with_one) == "starts_with_one"


def test_copy_digits_reward_gives_partial_credit_and_pays_for_stopping():
    # (digits right + stopped after 3 - characters past 3) / 4; without ids, stopped = 3 characters
    assert CopyDigitsReward().compute(["407", "400", "7", "4077"], ["407="] * 4) == [1.0, 0.75, 0.0, 0.5]
    # with the ids: eos (2) right after the copy; a pad (0) that decodes to nothing is not a stop
    ids = [[8, 4, 11, 2], [8, 4, 11, 0], [8, 4, 11, 11]]
    assert CopyDigitsReward().compute(["407", "407", "4077"], ["407="] * 3, completion_ids=ids) == [1.0, 0.75, 0.5]


def test_a_raising_function_is_named():
    def broken(prompts, completions, **kwargs):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"score_rewards: reward function 'broken' raised KeyError: 'answer'"):
        score_rewards([broken], prompts=PROMPTS, completions=COMPLETIONS)


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0], r"reward function 'bad' returned 1 values for 3 completions; expected a list of 3 floats"),
        (None, r"reward function 'bad' returned None for 3 completions"),
        ([1.0, "yes", 0.0], r"reward function 'bad' returned 'yes' \(a str\) for completion 1; expected a float or None"),
        ([1.0, float("nan"), 0.0], r"reward function 'bad' returned NaN for completion 1; return None"),
        ([True, 1.0, 0.0], r"returned True \(a bool\) for completion 0"),
    ],
)
def test_wrong_returns_stop_with_the_function_named(returned, message):
    def bad(prompts, completions, **kwargs):
        return returned

    with pytest.raises(RewardError, match=message):
        score_rewards([bad], prompts=PROMPTS, completions=COMPLETIONS)


def test_argument_errors():
    with pytest.raises(InvalidArgumentError, match="reward_functions is empty"):
        score_rewards([], prompts=PROMPTS, completions=COMPLETIONS)
    with pytest.raises(InvalidArgumentError, match="2 prompts but 3 completions"):
        score_rewards([Length()], prompts=PROMPTS[:2], completions=COMPLETIONS)
    with pytest.raises(InvalidArgumentError, match="1 weights for 2 reward functions"):
        score_rewards([Length(), starts_with_one], prompts=PROMPTS, completions=COMPLETIONS, weights=[1.0])
    with pytest.raises(NotImplementedError, match="RewardFunction.compute is not implemented"):
        RewardFunction().compute(["a"], ["b"])
