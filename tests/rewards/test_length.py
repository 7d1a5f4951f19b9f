"""The overlong penalty reward: DAPO's shaping by token count, tied to max_completion_length."""

import pytest

from torchforge.errors import InvalidArgumentError
from torchforge.rewards import OverlongPenalty
from torchforge.trainer.config import RLConfig


def test_overlong_penalty_hand_cases():
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, then -(L - 6) / 4, -1 from 10 on
    fn = OverlongPenalty(max_completion_length=10, buffer_length=4)
    ids = [[1] * n for n in (0, 6, 7, 8, 10)]
    assert fn(prompts=["q"] * 5, completions=[""] * 5, completion_ids=ids) == [0.0, 0.0, -0.25, -0.5, -1.0]


def test_default_buffer_and_penalty_size():
    fn = OverlongPenalty(max_completion_length=8, penalty=0.5)    # buffer 8 // 4 = 2: 0 up to 6 tokens
    assert fn.buffer_length == 2 and fn.score([6, 7, 8]) == [0.0, -0.25, -0.5]
    assert OverlongPenalty(max_completion_length=8, buffer_length=0).score([8, 9]) == [0.0, -1.0]


def test_from_config_uses_the_run_limit():
    fn = OverlongPenalty.from_config(RLConfig(max_completion_length=16), buffer_length=8)
    assert fn.max_completion_length == 16 and fn.score([8, 12, 16]) == [0.0, -0.5, -1.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_completion_length": 0}, "OverlongPenalty: max_completion_length must be an int >= 1, got 0"),
    ({"max_completion_length": 4, "buffer_length": 5}, r"buffer_length must be an int in \[0, max_length=4\], got 5"),
    ({"max_completion_length": 4, "penalty": -1.0}, "penalty must be >= 0, got -1.0"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        OverlongPenalty(**kwargs)


def test_needs_completion_ids():
    fn = OverlongPenalty(max_completion_length=4)
    with pytest.raises(InvalidArgumentError, match="OverlongPenalty: completion_ids is None"):
        fn(prompts=["q"], completions=["a"])
    with pytest.raises(InvalidArgumentError, match="OverlongPenalty: 2 completion_ids for 1 completions"):
        fn(prompts=["q"], completions=["a"], completion_ids=[[1], [2]])
