"""Ready-made reward functions for reasoning RL, usable anywhere a reward function is.

Each is a :class:`torchforge.loop.RewardFunction` and a TRL-style callable
(``fn(prompts=..., completions=..., completion_ids=..., **columns)``), so it goes straight
into ``RLTrainer(reward_functions=[...])``, :func:`torchforge.loop.score_rewards` or a TRL
trainer:

- :class:`MathAccuracy`: the final boxed / tagged answer equals the reference
  mathematically (math-verify; ``pip install 'torchforge[math]'``);
- :class:`ExactMatch`: the final answer equals the reference as normalized text;
- :class:`ThinkAnswerFormat`: ``<think>...</think><answer>...</answer>``;
- :class:`OverlongPenalty`: DAPO's soft penalty near ``max_completion_length``;
- :class:`RewardModel`: a trained reward model (a local sequence classifier with one label);
- :class:`LLMJudge`: a causal LM asked to grade each completion, through a generation engine.

The answer rewards read the reference from a dataset column (``answer`` by default,
``answer_key=`` to change it).
"""

from torchforge.rewards.answers import (
    ExactMatch,
    MathAccuracy,
    extract_answer,
    normalize_answer,
)
from torchforge.rewards.format import ThinkAnswerFormat
from torchforge.rewards.length import OverlongPenalty
from torchforge.rewards.judge import LLMJudge
from torchforge.rewards.reward_model import RewardModel

__all__ = [
    "ExactMatch",
    "LLMJudge",
    "MathAccuracy",
    "OverlongPenalty",
    "RewardModel",
    "ThinkAnswerFormat",
    "extract_answer",
    "normalize_answer",
]
