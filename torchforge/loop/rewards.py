"""Reward functions and reward scoring.

Two kinds of reward function are accepted, in any mix:

- a :class:`RewardFunction` subclass with ``compute(completions, prompts) -> list[float]``
  (the product card's API);
- any callable with TRL's keyword signature, ``fn(prompts=..., completions=...,
  completion_ids=..., **columns) -> list[float | None]``, where ``columns`` are the other
  fields of the dataset rows and ``None`` means "not applicable to this sample".

:func:`score_rewards` calls each one, checks what it returned, and combines them:
``reward_b = sum_f w_f * r_fb`` over the functions that apply to sample ``b`` (NaN when
none applies; the advantage estimators leave NaN rewards out of the group statistics).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from torchforge.errors import InvalidArgumentError, TorchforgeError

__all__ = ["RewardFunction", "RewardError", "reward_name", "score_rewards"]


class RewardError(TorchforgeError):
    """A reward function raised, or returned something other than one number per completion."""


class RewardFunction:
    """Base class of the card's reward functions: override :meth:`compute`.

    Subclasses may set ``name`` (used in metrics; default: the class name) and
    ``weight`` (default 1.0). A ``RewardFunction`` is also a TRL-style callable, so it
    can be passed anywhere a plain reward callable is.

    Args:
        None.

    Returns:
        A reward function object.

    Example:
        >>> class Length(RewardFunction):
        ...     def compute(self, completions, prompts):
        ...         return [float(len(c)) for c in completions]
        >>> Length()(prompts=["a", "b"], completions=["xy", ""])
        [2.0, 0.0]
    """

    name: str | None = None
    weight: float = 1.0

    def compute(self, completions: Sequence[str], prompts: Sequence[str]) -> list[float | None]:
        """Score each completion.

        Args:
            completions: the B decoded completions.
            prompts: the B prompts they answer (each prompt repeated G times, in groups).

        Returns:
            B floats (or None for "not applicable").
        """
        raise NotImplementedError(f"{type(self).__name__}.compute is not implemented")

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        return self.compute(completions, prompts)


def reward_name(fn: Callable) -> str:
    """The name under which a reward function's metrics are logged.

    Args:
        fn: a RewardFunction or a callable.

    Returns:
        ``fn.name`` when set, else the function's or class's ``__name__``.
    """
    name = getattr(fn, "name", None)
    if name:
        return str(name)
    return getattr(fn, "__name__", type(fn).__name__)


def _as_float(fn_name: str, index: int, value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
        isinstance(value, torch.Tensor) and value.numel() == 1
    ):
        raise RewardError(
            f"score_rewards: reward function {fn_name!r} returned {value!r} (a {type(value).__name__}) "
            f"for completion {index}; expected a float or None"
        )
    value = float(value)
    if math.isnan(value):
        raise RewardError(
            f"score_rewards: reward function {fn_name!r} returned NaN for completion {index}; "
            "return None for 'not applicable'"
        )
    return value


def score_rewards(
    reward_functions: Sequence[Callable],
    *,
    prompts: Sequence[str],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]] | None = None,
    columns: dict[str, Sequence[Any]] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call every reward function on the B completions and combine their scores.

    ``rewards_b = sum_f w_f * r_fb`` over the functions whose ``r_fb`` is not None;
    NaN when every function returned None for sample ``b``.

    Args:
        reward_functions: RewardFunction objects and / or TRL-style callables.
        prompts: B prompt strings.
        completions: B completion strings.
        completion_ids: B lists of completion token ids (passed to callables).
        columns: other dataset fields, each a list of B values (passed to callables).
        weights: one weight per function; default each function's ``weight`` attribute
            (1.0 when it has none).

    Returns:
        ``(rewards, per_function)``: float64 [B] combined rewards, and name -> float64 [B]
        unweighted scores of each function (NaN where it returned None). float64, as the
        functions' Python floats: near 1e4 float32 keeps steps of 1e-3, which would round
        a spread of 0.01 before the group statistics see it.

    Raises:
        RewardError: a function raised (chained), returned a non-sequence, a wrong number
            of values, a non-number, or NaN.

    Example:
        >>> total, parts = score_rewards(
        ...     [lambda prompts, completions, **kw: [1.0, None]],
        ...     prompts=["p", "p"], completions=["a", "b"])
        >>> total
        tensor([1., nan], dtype=torch.float64)
    """
    fn = "score_rewards"
    if not reward_functions:
        raise InvalidArgumentError(f"{fn}: reward_functions is empty; expected at least one reward function")
    B = len(completions)
    if len(prompts) != B:
        raise InvalidArgumentError(f"{fn}: {len(prompts)} prompts but {B} completions; expected one prompt per completion")
    if weights is None:
        weights = [float(getattr(f, "weight", 1.0)) for f in reward_functions]
    if len(weights) != len(reward_functions):
        raise InvalidArgumentError(
            f"{fn}: {len(weights)} weights for {len(reward_functions)} reward functions; expected one each"
        )
    columns = dict(columns or {})
    per_function: dict[str, torch.Tensor] = {}
    weighted = []
    for reward_fn, weight in zip(reward_functions, weights):
        name = reward_name(reward_fn)
        try:
            values = reward_fn(prompts=list(prompts), completions=list(completions),
                               completion_ids=completion_ids, **columns)
        except Exception as error:
            raise RewardError(f"{fn}: reward function {name!r} raised {type(error).__name__}: {error}") from error
        if not isinstance(values, (list, tuple, torch.Tensor)) or len(values) != B:
            got = f"{len(values)} values" if hasattr(values, "__len__") else repr(values)
            raise RewardError(
                f"{fn}: reward function {name!r} returned {got} for {B} completions; expected a list of {B} floats"
            )
        scores = torch.tensor([_as_float(name, i, v) for i, v in enumerate(values)], dtype=torch.float64)
        key, k = name, 1
        while key in per_function:  # two functions of the same name keep separate metrics
            k += 1
            key = f"{name}_{k}"
        per_function[key] = scores
        weighted.append(weight * scores)
    stacked = torch.stack(weighted)
    applies = ~stacked.isnan()
    total = torch.where(applies, stacked, 0.0).sum(0)
    total = torch.where(applies.any(0), total, math.nan)
    return total, per_function
