"""value_loss: PPO's clipped value regression, hand-derived and against the reference loop.
The contract every loss shares (empty masks, NaN at masked positions, compile) is tested
over all of them in tests/test_losses.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._losses_common import _grad
from tests.reference import aggregate_ref, value_per_token_ref
from torchforge.errors import InvalidArgumentError, ShapeError
from torchforge.reduce import AGGREGATION_MODES
from torchforge.value_losses import value_loss

SETTINGS = settings(max_examples=30, deadline=None)


def test_value_loss_hand_derived():
    # token 0: v = 1 from v_old = 0, R = 2, eps = 0.2: max((1-2)^2, (0.2-2)^2) = 3.24 -> 1.62,
    #          clipped term active: zero gradient.
    # token 1: v = 0.5, v_old = 0.4, R = 0: max(0.25, 0.25) -> 0.125, gradient (v - R) / N.
    v = torch.tensor([[1.0, 0.5]]); v_old = torch.tensor([[0.0, 0.4]]); ret = torch.tensor([[2.0, 0.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, grad, metrics = _grad(value_loss, v, v_old, ret, mask)
    assert loss.item() == pytest.approx((1.62 + 0.125) / 2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.25]]))
    assert metrics["clip_frac"].item() == 0.5
    loss, grad, _ = _grad(value_loss, v, v_old, ret, mask, clip=None)
    assert loss.item() == pytest.approx((0.5 + 0.125) / 2, rel=1e-6)


@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       mode=st.sampled_from(AGGREGATION_MODES), clip=st.sampled_from([None, 0.1, 0.5]),
       offset=st.sampled_from([0.0, 1e4, -1e4]))
@SETTINGS
def test_value_loss_matches_reference(B, T, seed, mode, clip, offset):
    # offset: returns of 1e4 (float32's ulp there is 1e-3), values and old values beside
    # them. v_old + clip rounds at that ulp, so the clipped value is formed from the
    # errors v - R and v_old - R, which float32 subtracts exactly (Sterbenz), as the
    # float64 reference does from the same inputs.
    g = torch.Generator().manual_seed(seed)
    v, v_old, ret = torch.randn(3, B, T, generator=g) + offset
    mask = torch.rand(B, T, generator=g) < 0.6
    loss, _ = value_loss(v, v_old, ret, mask, clip=clip, aggregation=mode)
    expected = aggregate_ref(torch.tensor(value_per_token_ref(v, v_old, ret, mask, clip)), mask, mode)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_value_loss_bad_inputs():
    v = torch.zeros(4, 6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    with pytest.raises(InvalidArgumentError, match="value_loss: clip must be >= 0, got -1"):
        value_loss(v, v, v, mask, clip=-1)
    with pytest.raises(ShapeError, match=r"value_loss: returns has shape \(4, 5\) but values has shape \(4, 6\)"):
        value_loss(v, v, v[:, :5], mask)
