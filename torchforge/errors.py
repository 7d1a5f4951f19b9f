"""One exception family for bad input, and the checks that raise it.

Every message names the function, the argument, what was seen and what was
expected, e.g. ``ppo_loss: advantages has shape (8,) but log_probs has shape
(8, 128); expected (8,) or (8, 128)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "TorchforgeError",
    "ShapeError",
    "DTypeError",
    "InvalidArgumentError",
    "MissingKeyError",
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
