"""Tests for torchforge.errors: the exception family and the check_* helpers."""

import pytest
import torch

from torchforge.errors import (
    DTypeError,
    InvalidArgumentError,
    MissingKeyError,
    ShapeError,
    TorchforgeError,
    check_choice,
    check_float,
    check_integer,
    check_mask,
    check_non_negative,
    check_positive,
    check_same_shape,
    check_tensor,
)


def test_one_family_that_also_matches_the_builtin_errors():
    # Callers may catch TorchforgeError, or the builtin error the problem is.
    for cls, builtin in [
        (ShapeError, ValueError), (DTypeError, TypeError),
        (InvalidArgumentError, ValueError), (MissingKeyError, KeyError),
    ]:
        assert issubclass(cls, TorchforgeError) and issubclass(cls, builtin)
    # KeyError quotes its message; MissingKeyError prints it as written
    assert str(MissingKeyError("f: the batch has no key 'mask'")) == "f: the batch has no key 'mask'"


def test_check_tensor():
    check_tensor("f", "x", torch.zeros(2, 3), ndim=2)
    check_tensor("f", "x", torch.zeros(2, 3), ndim=(2, 3))
    with pytest.raises(TorchforgeError, match="f: x must be a torch.Tensor, got list"):
        check_tensor("f", "x", [1.0])
    with pytest.raises(ShapeError, match=r"f: x has shape \(2, 3\); expected 3 dimensions"):
        check_tensor("f", "x", torch.zeros(2, 3), ndim=3)
    with pytest.raises(ShapeError, match=r"f: x has shape \(4,\); expected 2 or 3 dimensions"):
        check_tensor("f", "x", torch.zeros(4), ndim=(2, 3))


def test_check_dtypes():
    check_float("f", "x", torch.zeros(2, dtype=torch.bfloat16))
    check_integer("f", "tokens", torch.zeros(2, dtype=torch.int32))
    with pytest.raises(DTypeError, match="f: x has dtype torch.int64; expected a floating-point tensor"):
        check_float("f", "x", torch.zeros(2, dtype=torch.long))
    for bad in (torch.float32, torch.bool):
        with pytest.raises(DTypeError, match=f"f: tokens has dtype {bad}; expected an integer tensor"):
            check_integer("f", "tokens", torch.zeros(2, dtype=bad))


def test_check_same_shape_and_mask():
    x = torch.zeros(2, 3)
    check_same_shape("f", "y", torch.ones(2, 3), "x", x)
    check_mask("f", torch.ones(2, 3, dtype=torch.bool), "x", x)
    with pytest.raises(ShapeError, match=r"f: y has shape \(3,\) but x has shape \(2, 3\); expected \(2, 3\)"):
        check_same_shape("f", "y", torch.zeros(3), "x", x)
    with pytest.raises(ShapeError, match=r"f: mask has shape \(2, 1\) but x has shape \(2, 3\)"):
        check_mask("f", torch.ones(2, 1, dtype=torch.bool), "x", x)
    with pytest.raises(DTypeError, match=r"f: mask has dtype torch.float32; expected torch.bool .* Hint: pass mask.bool\(\)"):
        check_mask("f", torch.ones(2, 3), "x", x)


def test_check_values():
    check_positive("f", "temperature", 0.5)
    check_non_negative("f", "eps", 0.0)
    check_choice("f", "mode", "a", ("a", "b"))
    with pytest.raises(InvalidArgumentError, match="f: temperature must be > 0, got 0"):
        check_positive("f", "temperature", 0)
    with pytest.raises(InvalidArgumentError, match="f: temperature must be > 0, got nan"):
        check_positive("f", "temperature", float("nan"))
    with pytest.raises(InvalidArgumentError, match="f: eps must be >= 0, got -1"):
        check_non_negative("f", "eps", -1)
    with pytest.raises(InvalidArgumentError, match="f: mode is 'c'; expected one of 'a', 'b'"):
        check_choice("f", "mode", "c", ("a", "b"))
    # not a number: one named error, not Python's TypeError from the comparison
    for value in ("0.2", True, None, torch.tensor([1.0, 2.0])):
        with pytest.raises(InvalidArgumentError, match="f: clip must be a number > 0, got"):
            check_positive("f", "clip", value)
    with pytest.raises(InvalidArgumentError, match="f: eps must be a number >= 0, got '1'"):
        check_non_negative("f", "eps", "1")
    # finite=True: an infinite hyperparameter is refused; without it, inf is a valid bound
    check_positive("f", "max_ratio", float("inf"))
    with pytest.raises(InvalidArgumentError, match="f: tau must be finite and > 0, got inf"):
        check_positive("f", "tau", float("inf"), finite=True)
    with pytest.raises(InvalidArgumentError, match="f: penalty must be finite and >= 0, got inf"):
        check_non_negative("f", "penalty", float("inf"), finite=True)
    check_non_negative("f", "penalty", torch.tensor(0.5), finite=True)
