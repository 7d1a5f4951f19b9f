"""The convenience layer of the product card: ``RLTrainer``, ``RLConfig``, ``Algorithm`` and
the ``torchforge`` command, over the loop's functions."""

from torchforge.trainer.algorithms import (
    GRPO,
    PPO,
    REINFORCE,
    Algorithm,
    algorithm_from_name,
)
from torchforge.trainer.config import RLConfig
from torchforge.trainer.trainer import RLTrainer

__all__ = ["RLTrainer", "RLConfig", "Algorithm", "GRPO", "PPO", "REINFORCE", "algorithm_from_name"]
