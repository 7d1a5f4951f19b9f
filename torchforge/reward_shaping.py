"""Reward shaping: terms added to the sequence rewards before the advantages are computed.

- :func:`overlong_penalty`: DAPO's soft overlong punishment, 0 up to ``L_max - L_cache``
  tokens, then falling linearly to ``-penalty`` at ``L_max`` (a hard penalty above
  ``L_max`` with ``L_cache = 0``).

Results are float32 [B] reward terms whatever the lengths' dtype (int or float).
``torchforge.rewards.OverlongPenalty`` wraps it as a reward function tied to the run's
``max_completion_length``. The KL penalty in the reward, a token-level shaping,
is :func:`torchforge.returns.kl_penalized_rewards`, next to the returns it feeds.

References:
    DAPO, section 3.4 "Overlong Reward Shaping", https://arxiv.org/abs/2503.14476
"""

from __future__ import annotations

import torch

from torchforge.errors import InvalidArgumentError, check_non_negative, check_tensor

__all__ = ["overlong_penalty"]


def overlong_penalty(
    lengths: torch.Tensor,
    *,
    max_length: int,
    buffer_length: int,
    penalty: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment: a reward term for responses near or over the limit.

    With ``L = lengths``, ``L_max = max_length``, ``L_cache = buffer_length``:

    ``overlong_penalty = 0`` if ``L <= L_max - L_cache``;
    ``-penalty * (L - (L_max - L_cache)) / L_cache`` if ``L_max - L_cache < L <= L_max``;
    ``-penalty`` if ``L > L_max``.

    Add it to the sequence rewards before computing advantages.

    Args:
        lengths: [B] int or float response lengths (e.g. ``mask.sum(-1)``).
        max_length: L_max, >= 1.
        buffer_length: L_cache, in [0, max_length]; 0 gives a hard penalty above L_max.
        penalty: the size of the full penalty, >= 0 (DAPO: 1).

    Returns:
        [B] float32 penalties in ``[-penalty, 0]``.

    Example:
        >>> import torch
        >>> overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_length=20, buffer_length=4)
        tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])

    References:
        DAPO, section 3.4 "Overlong Reward Shaping", https://arxiv.org/abs/2503.14476
    """
    fn = "overlong_penalty"
    check_tensor(fn, "lengths", lengths, ndim=1)
    if lengths.dtype == torch.bool or lengths.is_complex():
        raise InvalidArgumentError(f"{fn}: lengths has dtype {lengths.dtype}; expected an integer or float tensor")
    if not (isinstance(max_length, int) and max_length >= 1):
        raise InvalidArgumentError(f"{fn}: max_length must be an int >= 1, got {max_length!r}")
    if not (isinstance(buffer_length, int) and 0 <= buffer_length <= max_length):
        raise InvalidArgumentError(
            f"{fn}: buffer_length must be an int in [0, max_length={max_length}], got {buffer_length!r}"
        )
    check_non_negative(fn, "penalty", penalty, finite=True)
    lengths = lengths.float()
    if buffer_length == 0:
        return torch.where(lengths > max_length, -float(penalty), 0.0)
    excess = (lengths - (max_length - buffer_length)) / buffer_length
    return 0.0 - penalty * excess.clamp(0.0, 1.0)  # 0 - 0 = +0, not -0
