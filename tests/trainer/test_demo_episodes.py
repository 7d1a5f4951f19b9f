"""The embedded multi-turn task: AskThenCopy's two turns and the demo's settings."""

import pytest

from torchforge.loop.environments import StepResult
from torchforge.trainer.demo_episodes import AskThenCopy, multi_turn_demo_config


@pytest.mark.parametrize("first, second, rewards", [
    ("=", "407", [0.2, 0.8]),            # asks, then copies all three digits
    ("=x", "4x7", [0.2, 0.8 * 2 / 3]),   # an ask is any action starting with "="
    ("=", "", [0.2, 0.0]),
    ("4", None, [0.0]),                  # does not ask: the episode ends with nothing
])
def test_ask_then_copy_hand_derived(first, second, rewards):
    env = AskThenCopy()
    assert env.reset({"prompt": "407=", "target": "407"}) == "="  # nothing revealed yet
    result = env.step(first)
    if second is None:
        assert result == StepResult(None, 0.0, True)
        return
    assert result == StepResult("407=", 0.2, False)  # the digits, revealed
    last = env.step(second)
    assert last.done and last.observation is None
    assert [result.reward, last.reward] == pytest.approx(rewards)


def test_reset_starts_a_new_episode_on_the_new_row():
    env = AskThenCopy()
    env.reset({"target": "111"})
    env.step("=")
    env.reset({"target": "222"})
    assert env.step("=") == StepResult("222=", 0.2, False)


def test_multi_turn_demo_config_takes_overrides():
    config = multi_turn_demo_config(max_steps=3)
    assert (config.max_steps, config.max_turns, config.max_total_tokens, config.max_completion_length) == (3, 2, 16, 4)
