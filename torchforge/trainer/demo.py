"""The embedded default task: a copy task for a tiny Llama with a character tokenizer, all local.

``torchforge train`` with no arguments trains on this, so that a fresh machine with no
model hub can run the whole pipeline on a CPU: 300 steps in about a minute on an idle 2-core
CPU (about 0.13 s a step; several times longer on a busy machine). Tests and notebooks use
the same pieces. The model and tokenizer come from :mod:`torchforge.loop.tiny_model` and are
re-exported here, so that ``from torchforge.trainer.demo import CopyDigitsReward,
char_tokenizer, copy_digits_dataset, tiny_llama`` gives the whole task.

The task: the prompt is three digits and ``=`` (``"407="``); the completion should repeat
them (``"407"``) and stop. The reward gives 1/4 per digit in the right position and 1/4
for the end-of-sequence token right after the third digit, so a randomly initialized
model scores about 1/15 (one vocabulary entry in 15 per position) and a model that has
learned the task scores 1 and stops on its own.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from torchforge.loop.rewards import RewardFunction
from torchforge.loop.tiny_model import SPECIAL_TOKENS, char_tokenizer, tiny_llama
from torchforge.trainer.config import RLConfig

# char_tokenizer and tiny_llama live in the loop (torchforge.loop.tiny_model), which may use
# them; they are re-exported here, where the demo's users import them with the task
__all__ = ["char_tokenizer", "tiny_llama", "copy_digits_dataset", "CopyDigitsReward", "demo_config"]


def copy_digits_dataset(num_prompts: int, *, num_digits: int = 3, seed: int = 0) -> list[dict[str, str]]:
    """Prompts ``"ddd="`` with their ``target`` digits, drawn uniformly.

    Args:
        num_prompts: how many rows.
        num_digits: digits per prompt.
        seed: seed of the ``random.Random`` that draws the digits.

    Returns:
        A list of ``{"prompt": "407=", "target": "407"}`` dicts.

    Example:
        >>> copy_digits_dataset(2, seed=1)
        [{'prompt': '291=', 'target': '291'}, {'prompt': '417=', 'target': '417'}]
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        rows.append({"prompt": f"{digits}=", "target": digits})
    return rows


class CopyDigitsReward(RewardFunction):
    """Partial credit for copying the prompt's digits, and for stopping right after them.

    ``reward = (sum_i [completion[i] == digits[i]] + stopped - extra) / (n + 1)`` over the
    ``n`` digits of the prompt (the characters before ``=``), where ``stopped`` is 1 when
    the completion ends with the end-of-sequence token right after ``n`` tokens (judged
    from ``completion_ids``; without them, from the text: exactly ``n`` characters) and
    ``extra`` counts the characters after the n-th. Running on costs what stopping earns,
    so a digit in the stop position is not rewarded along with the copy before it: the
    model learns to copy *and stop*.

    Args:
        eos_token_id: the end-of-sequence id (default: :func:`char_tokenizer`'s ``<eos>``).

    Returns:
        A reward function: ``compute(completions, prompts, completion_ids=None)`` -> list
        of floats, 1 for a copy that stops.

    Example:
        >>> reward = CopyDigitsReward()
        >>> reward.compute(["407", "4x", ""], ["407=", "407=", "407="])
        [1.0, 0.25, 0.0]
        >>> reward.compute(["407", "4071"], ["407=", "407="], completion_ids=[[8, 4, 11, 2], [8, 4, 11, 5]])
        [1.0, 0.5]
    """

    name = "copy_digits"

    def __init__(self, eos_token_id: int = SPECIAL_TOKENS.index("<eos>")) -> None:
        self.eos_token_id = eos_token_id

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str],
                 completion_ids: Sequence[Sequence[int]] | None = None, **columns: Any) -> list[float]:
        return self.compute(completions, prompts, completion_ids=completion_ids)

    def compute(self, completions: Sequence[str], prompts: Sequence[str],
                completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        rewards = []
        for b, (completion, prompt) in enumerate(zip(completions, prompts)):
            digits = prompt.split("=", 1)[0]
            n = len(digits)
            hits = sum(x == y for x, y in zip(completion, digits))
            if completion_ids is not None:
                ids = list(completion_ids[b])
                stopped = len(ids) == n + 1 and ids[-1] == self.eos_token_id
            else:
                stopped = len(completion) == n
            extra = max(len(completion) - n, 0)
            rewards.append((hits + float(stopped) - extra) / (n + 1))
        return rewards


def demo_config(**overrides: Any) -> RLConfig:
    """The settings ``torchforge train`` uses with no config: GRPO on the copy task, on a CPU.

    16 prompts x 8 samples per step, completions of at most 4 tokens (3 digits and eos),
    a learning rate suited to a 2-layer model trained from scratch, no KL (there is no
    pretrained behaviour to stay close to), float32, 300 steps.

    Args:
        **overrides: fields of RLConfig to change.

    Returns:
        RLConfig.

    Example:
        >>> demo_config(max_steps=10).max_steps
        10
    """
    values = dict(
        algorithm="grpo", learning_rate=1e-3, num_generations=8, prompts_per_step=16,
        max_completion_length=4, kl_coef=0.0, mixed_precision="fp32", gradient_checkpointing=False,
        max_steps=300, save_steps=100, logging_steps=1,
    )
    values.update(overrides)
    return RLConfig.from_dict(values)
