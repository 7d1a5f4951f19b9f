"""Length reward: DAPO's soft overlong penalty, tied to the run's ``max_completion_length``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import RewardFunction
from torchforge.reward_shaping import overlong_penalty

__all__ = ["OverlongPenalty"]


class OverlongPenalty(RewardFunction):
    """A reward term in ``[-penalty, 0]`` for completions near or over the length limit (DAPO).

    With ``L`` the completion's token count (its counted tokens, stop token included),
    ``L_max = max_completion_length`` and ``L_cache = buffer_length``, the reward is
    :func:`torchforge.reward_shaping.overlong_penalty`: 0 up to ``L_max - L_cache``, then
    falling linearly to ``-penalty`` at ``L_max``. A completion cut by the limit (``L =
    L_max``, no stop token) gets the full ``-penalty``. Add it to an accuracy reward.

    Args:
        max_completion_length: L_max; pass the run's ``RLConfig.max_completion_length``
            (or build with :meth:`from_config`).
        buffer_length: L_cache, in [0, L_max]; default ``L_max // 4`` (DAPO: 4096 of 20480
            tokens, a fifth; a quarter keeps some room on short runs).
        penalty: the size of the full penalty, >= 0.

    Returns:
        A reward function: ``fn(prompts=..., completions=..., completion_ids=...) -> list[float]``.

    Example:
        >>> fn = OverlongPenalty(max_completion_length=8, buffer_length=4)
        >>> fn(prompts=["q"] * 3, completions=["", "", ""], completion_ids=[[1] * 4, [1] * 6, [1] * 8])
        [0.0, -0.5, -1.0]

    References:
        DAPO, section 3.4 "Overlong Reward Shaping", https://arxiv.org/abs/2503.14476
    """

    name = "overlong_penalty"

    def __init__(self, *, max_completion_length: int, buffer_length: int | None = None, penalty: float = 1.0) -> None:
        if not (isinstance(max_completion_length, int) and max_completion_length >= 1):
            raise InvalidArgumentError(
                f"OverlongPenalty: max_completion_length must be an int >= 1, got {max_completion_length!r}")
        self.max_completion_length = max_completion_length
        self.buffer_length = max_completion_length // 4 if buffer_length is None else buffer_length
        self.penalty = penalty
        overlong_penalty(torch.zeros(0), max_length=max_completion_length,  # validate the settings now
                         buffer_length=self.buffer_length, penalty=penalty)

    @classmethod
    def from_config(cls, config: Any, *, buffer_length: int | None = None, penalty: float = 1.0) -> OverlongPenalty:
        """The penalty for a run's config (an ``RLConfig``): its ``max_completion_length``.

        Args:
            config: an object with ``max_completion_length``.
            buffer_length: L_cache (default a quarter of the limit).
            penalty: the size of the full penalty.

        Returns:
            An OverlongPenalty.
        """
        return cls(max_completion_length=config.max_completion_length, buffer_length=buffer_length, penalty=penalty)

    def score(self, lengths: Sequence[int]) -> list[float]:
        """The penalty of each completion length.

        Args:
            lengths: B token counts.

        Returns:
            B floats in ``[-penalty, 0]``.
        """
        return overlong_penalty(torch.tensor(list(lengths), dtype=torch.long), max_length=self.max_completion_length,
                                buffer_length=self.buffer_length, penalty=self.penalty).tolist()

    def compute(self, completions, prompts):
        raise InvalidArgumentError("OverlongPenalty.compute: needs completion_ids (token counts); call the object "
                                   "with keyword arguments, or use .score(lengths)")

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str],
                 completion_ids: Sequence[Sequence[int]] | None = None, **columns: Any) -> list[float]:
        if completion_ids is None:
            raise InvalidArgumentError("OverlongPenalty: completion_ids is None; expected the B completions' token "
                                       "ids (score_rewards passes them)")
        if len(completion_ids) != len(completions):
            raise InvalidArgumentError(f"OverlongPenalty: {len(completion_ids)} completion_ids for "
                                       f"{len(completions)} completions; expected one each")
        return self.score([len(ids) for ids in completion_ids])
