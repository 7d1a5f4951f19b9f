"""The embedded multi-turn task: ask for the digits, then copy them back. All local, CPU-sized.

An episode of :class:`AskThenCopy` on the tiny Llama and the character tokenizer of
:mod:`torchforge.trainer.demo`::

    prompt        "="                   (nothing revealed yet)
    model turn 1  "=<eos>"              asks: its first character is "="   -> reward 0.2
    observation   "407="                the environment reveals the digits
    model turn 2  "407<eos>"            copies them back                   -> reward 0.8 * 3/3

A first turn that does not ask ends the episode with reward 0. A randomly initialized
model asks about one time in 15 and then copies about one digit in 16, so it scores about
0.02; a model that has learned both turns scores 1. The rows are those of
:func:`torchforge.trainer.demo.copy_digits_dataset` (the environment reads ``target``).

Measured with ``torchforge train --config examples/multi_turn.yaml max_steps=150`` (GRPO,
16 rows x 8 episodes per step) on a shared 2-core CPU: the mean reward goes from 0.02 to
0.30 in 150 steps (median 1.3 s per step); turns per episode from 1.1 to 2.0 by step 60
(it has learned to ask), after which the copy is learned, as in the single-turn demo.
"""

from __future__ import annotations

from typing import Any

from torchforge.loop.environments import Environment, StepResult
from torchforge.trainer.config import RLConfig
from torchforge.trainer.demo import demo_config

__all__ = ["AskThenCopy", "multi_turn_demo_config"]


class AskThenCopy(Environment):
    """Reveal the digits when asked, then score the copy.

    Turn 1: ``reward = ASK_REWARD`` when the action starts with ``"="`` (the episode goes
    on with the observation ``"<digits>="``), else 0 and the episode ends. Turn 2:
    ``reward = COPY_REWARD * (1 / n) * sum_i [action[i] == digits[i]]``, done.

    Args:
        None (one instance per episode; ``reset`` takes the row).

    Returns:
        An environment.

    Example:
        >>> env = AskThenCopy()
        >>> env.reset({"prompt": "407=", "target": "407"})
        '='
        >>> env.step("=")
        StepResult(observation='407=', reward=0.2, done=False)
        >>> env.step("40")
        StepResult(observation=None, reward=0.5333333333333333, done=True)
    """

    ASK_REWARD = 0.2
    COPY_REWARD = 0.8

    def reset(self, row: dict[str, Any]) -> str:
        self.digits, self.turn = str(row["target"]), 0
        return "="

    def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            if action.startswith("="):
                return StepResult(f"{self.digits}=", self.ASK_REWARD, False)
            return StepResult(None, 0.0, True)
        hits = sum(a == b for a, b in zip(action, self.digits))
        return StepResult(None, hits / len(self.digits) * self.COPY_REWARD, True)


def multi_turn_demo_config(**overrides: Any) -> RLConfig:
    """The settings of the multi-turn demo: the copy demo's, with 2 turns of at most 4 tokens.

    Args:
        **overrides: fields of RLConfig to change.

    Returns:
        RLConfig.

    Example:
        >>> multi_turn_demo_config(max_steps=5).max_turns
        2
    """
    values: dict[str, Any] = dict(max_turns=2, max_total_tokens=16, step_timeout=10.0)
    values.update(overrides)
    return demo_config(**values)
