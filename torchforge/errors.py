"""One exception family for bad input, and the checks that raise it.

Every message names the function, the argument, what was seen and what was
expected, e.g. ``ppo_loss: advantages has shape (8,) but log_probs has shape
(8, 128); expected (8,) or (8, 128)``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import torch

__all__ = [
    "TorchforgeError",
    "ShapeError",
    "DTypeError",
    "InvalidArgumentError",
    "MissingKeyError",
    "reraise_as",
]


class TorchforgeError(Exception):
    """Base class of every error torchforge raises on bad input."""


class ShapeError(TorchforgeError, ValueError):
    """A tensor has a shape that does not fit the others (nothing broadcasts silently)."""


class DTypeError(TorchforgeError, TypeError):
    """A tensor has the wrong dtype (e.g. a float mask, integer logits)."""


class InvalidArgumentError(TorchforgeError, ValueError):
    """A hyperparameter or a value is outside its domain (temperature <= 0, unknown mode)."""


class MissingKeyError(TorchforgeError, KeyError):
    """A batch passed as first argument lacks a key the function needs."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


def shape_str(x: torch.Tensor) -> str:
    return str(tuple(x.shape))


def check_tensor(fn: str, name: str, x, *, ndim: int | Sequence[int] | None = None) -> None:
    """Raise unless ``x`` is a tensor with ``ndim`` dimensions (one value or several)."""
    if not isinstance(x, torch.Tensor):
        raise TorchforgeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is None:
        return
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if x.dim() not in allowed:
        dims = " or ".join(str(d) for d in allowed)
        raise ShapeError(f"{fn}: {name} has shape {shape_str(x)}; expected {dims} dimensions")


def check_float(fn: str, name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise DTypeError(f"{fn}: {name} has dtype {x.dtype}; expected a floating-point tensor")


def check_integer(fn: str, name: str, x: torch.Tensor) -> None:
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise DTypeError(f"{fn}: {name} has dtype {x.dtype}; expected an integer tensor (token ids)")


def check_same_shape(fn: str, name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise unless ``x`` has exactly the shape of ``ref``."""
    check_tensor(fn, name, x)
    if x.shape != ref.shape:
        raise ShapeError(
            f"{fn}: {name} has shape {shape_str(x)} but {ref_name} has shape {shape_str(ref)}; "
            f"expected {shape_str(ref)}"
        )


def check_mask(fn: str, mask: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise unless ``mask`` is a bool tensor of the shape of ``ref``."""
    check_same_shape(fn, "mask", mask, ref_name, ref)
    if mask.dtype != torch.bool:
        raise DTypeError(
            f"{fn}: mask has dtype {mask.dtype}; expected torch.bool (True = the token counts). "
            "Hint: pass mask.bool()"
        )


def _check_bound(fn: str, name: str, value, bound: str, holds, finite: bool) -> None:
    if isinstance(value, (str, bool)):
        raise InvalidArgumentError(f"{fn}: {name} must be a number {bound}, got {value!r}")
    try:
        ok = bool(holds(value))
    except (TypeError, RuntimeError):  # not a number, or a tensor of several values
        raise InvalidArgumentError(f"{fn}: {name} must be a number {bound}, got {value!r}") from None
    if not ok:
        raise InvalidArgumentError(f"{fn}: {name} must be {bound}, got {value}")
    if finite and not math.isfinite(value):
        raise InvalidArgumentError(f"{fn}: {name} must be finite and {bound}, got {value}")


def check_positive(fn: str, name: str, value: float, *, finite: bool = False) -> None:
    """``value > 0`` (and finite with ``finite=True``), else an error naming ``fn`` and ``name``."""
    _check_bound(fn, name, value, "> 0", lambda v: v > 0, finite)


def check_non_negative(fn: str, name: str, value: float, *, finite: bool = False) -> None:
    """``value >= 0`` (and finite with ``finite=True``), else an error naming ``fn`` and ``name``."""
    _check_bound(fn, name, value, ">= 0", lambda v: v >= 0, finite)


def check_choice(fn: str, name: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise InvalidArgumentError(
            f"{fn}: {name} is {value!r}; expected one of {', '.join(repr(c) for c in choices)}"
        )


def check_log_probs(fn: str, log_probs, mask, **others: torch.Tensor) -> None:
    """Raise unless ``log_probs`` is a float [B, T], ``mask`` a bool [B, T], and every
    tensor in ``others`` (by its argument name) a float of the shape of ``log_probs``."""
    check_tensor(fn, "log_probs", log_probs, ndim=2)
    check_float(fn, "log_probs", log_probs)
    check_mask(fn, mask, "log_probs", log_probs)
    for name, x in others.items():
        check_same_shape(fn, name, x, "log_probs", log_probs)
        check_float(fn, name, x)


def check_per_token(fn: str, name: str, x, log_probs: torch.Tensor) -> torch.Tensor:
    """``x`` (the argument ``name``), a float [B] or [B, T] beside the [B, T] ``log_probs``,
    detached in float32: [B] comes back as [B, 1], broadcast over T on purpose; any other
    shape raises.

    A NaN in ``x`` where nothing is counted reaches neither a loss (``aggregate`` drops
    those positions) nor its gradient: every loss multiplies ``x`` into a term whose
    input, the log-ratio or the log-prob, is a ``where`` on the mask, whose backward
    zeroes those positions, or into a detached coefficient that is itself such a ``where``."""
    check_tensor(fn, name, x)
    check_float(fn, name, x)
    B, T = log_probs.shape
    if x.dim() == 1 and x.shape[0] == B:
        return x.detach().float().unsqueeze(-1)
    if x.shape != log_probs.shape:
        raise ShapeError(
            f"{fn}: {name} has shape {shape_str(x)} but log_probs has shape {shape_str(log_probs)}; "
            f"expected ({B},) or ({B}, {T})"
        )
    return x.detach().float()


def check_clip(fn: str, clip_low, clip_high, dual_clip=None) -> float:
    """Raise unless ``clip_low`` is in [0, 1], ``clip_high`` >= 0 (or None) and
    ``dual_clip`` > 1 (or None); return ``clip_high``, which defaults to ``clip_low``."""
    if not 0 <= clip_low <= 1:
        raise InvalidArgumentError(f"{fn}: clip_low must be in [0, 1], got {clip_low}")
    clip_high = clip_low if clip_high is None else clip_high
    check_non_negative(fn, "clip_high", clip_high)
    if dual_clip is not None and not dual_clip > 1:
        raise InvalidArgumentError(
            f"{fn}: dual_clip must be > 1 (the cap is dual_clip * |advantages|), got {dual_clip}"
        )
    return clip_high


def check_temperature(fn: str, temperature) -> float:
    """Raise unless ``temperature`` is a finite number > 0; return it as a float."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise InvalidArgumentError(f"{fn}: temperature must be a number, got {type(temperature).__name__}")
    check_positive(fn, "temperature", temperature)
    if math.isinf(temperature):
        raise InvalidArgumentError(f"{fn}: temperature must be finite, got {temperature}")
    return float(temperature)


@contextlib.contextmanager
def reraise_as(fn: str, argument: str | None = None) -> Iterator[None]:
    """Report the torchforge errors raised inside the block as ``fn``'s own.

    A primitive built on another public one names itself in its errors: a message
    ``"<callee>: <rest>"`` raised inside comes out as ``"<fn>: <rest>"``, or as
    ``"<fn>: <argument> <rest>"`` when the callee checks what ``fn`` received as
    ``argument`` (e.g. ``aggregate`` checking a loss's ``aggregation``). The error keeps
    its class; nothing else is caught.

    Args:
        fn: the name of the function the errors are reported by.
        argument: the argument of ``fn`` the callee checks, prefixed to the message;
            None leaves the message as the callee wrote it.

    Returns:
        A context manager.

    Example:
        >>> import torch
        >>> from torchforge.reduce import aggregate
        >>> def my_loss(per_token, mask, *, num_tokens=None):
        ...     with reraise_as("my_loss", "aggregation"):
        ...         return aggregate(per_token, mask, num_tokens=num_tokens)
        >>> my_loss(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), num_tokens=-1)
        Traceback (most recent call last):
        ...
        torchforge.errors.InvalidArgumentError: my_loss: aggregation num_tokens must be >= 0, got -1
    """
    try:
        yield
    except TorchforgeError as error:
        _, _, rest = str(error).partition(": ")
        raise type(error)(f"{fn}: {argument} {rest}" if argument else f"{fn}: {rest}") from None
