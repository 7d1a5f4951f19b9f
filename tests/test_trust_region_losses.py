"""Tests for torchforge.trust_region_losses: CISPO, SAPO, GMPO."""

import math

import pytest
import torch

from tests._losses_common import _data, _grad
from tests.reference import aggregate_ref, gmpo_loss_ref, gmpo_per_token_ref, sapo_per_token_ref
from torchforge.errors import InvalidArgumentError, ShapeError
from torchforge.losses import ppo_loss
from torchforge.reduce import AGGREGATION_MODES
from torchforge.testing import check_policy_loss
from torchforge.trust_region_losses import cispo_loss, gmpo_loss, sapo_loss

# --- CISPO ------------------------------------------------------------------------------

def test_cispo_gradient_on_clipped_tokens():
    # r = 2 (clipped to 1.3) and r = 0.5 (clipped to 0.8), A = +1 / -1; CISPO keeps a
    # gradient -clip(r) A / N through log pi on both, where PPO gives 0.
    lp = torch.log(torch.tensor([[0.8], [0.1]])); old = torch.log(torch.tensor([[0.4], [0.2]]))
    adv = torch.tensor([1.0, -1.0]); mask = torch.ones(2, 1, dtype=torch.bool)
    loss, grad, metrics = _grad(cispo_loss, lp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    torch.testing.assert_close(grad, torch.tensor([[-1.3 / 2], [0.8 / 2]]))
    expected = (-1.3 * math.log(0.8) + 0.8 * math.log(0.1)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_frac_high"].item() == 0.5 and metrics["clip_frac_low"].item() == 0.5
    _, ppo_grad, _ = _grad(ppo_loss, lp, old, adv, mask, clip_high=0.3)
    assert ppo_grad.abs().sum() == 0


# --- SAPO -------------------------------------------------------------------------------

def test_sapo_hand_derived():
    # r = e^0.5 with A = 2 (tau_pos = 1): gate = 4 sigmoid(r - 1); r = 1 with A = -1
    # (tau_neg = 1.05): gate = (4 / 1.05) / 2. Gradient: -A * 4 s (1 - s) * r / N.
    lp = torch.tensor([[0.5, 0.0]]); old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, grad, m = _grad(sapo_loss, lp, old, torch.tensor([[2.0, -1.0]]), mask)
    r = math.exp(0.5); s = 1 / (1 + math.exp(-(r - 1)))
    assert loss.item() == pytest.approx((-2 * 4 * s + (4 / 1.05) / 2) / 2, rel=1e-6)
    assert grad[0, 0].item() == pytest.approx(-2 * 4 * s * (1 - s) * r / 2, rel=1e-5)
    assert grad[0, 1].item() == pytest.approx(1 * 1.0 / 2, rel=1e-5)
    assert m["gate_weight_mean"].item() == pytest.approx((4 * s * (1 - s) + 1) / 2, rel=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_sapo_matches_reference(seed):
    lp, old, adv, mask = _data(5, 7, seed=seed, spread=0.5, token_adv=seed % 2 == 0)
    loss, _ = sapo_loss(lp, old, adv, mask, tau_pos=0.7, tau_neg=1.3)
    want = sapo_per_token_ref(lp, old, adv, mask, 0.7, 1.3).sum() / max(int(mask.sum()), 1)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)


def test_sapo_passes_the_policy_loss_checks():
    check_policy_loss(sapo_loss, max_examples=10)


def test_sapo_bad_inputs():
    lp, old, adv, mask = _data(2, 3)
    with pytest.raises(InvalidArgumentError, match="sapo_loss: tau_neg must be > 0, got 0"):
        sapo_loss(lp, old, adv, mask, tau_neg=0)
    with pytest.raises(InvalidArgumentError, match="sapo_loss: tau_pos must be finite and > 0, got inf"):
        sapo_loss(lp, old, adv, mask, tau_pos=float("inf"))  # the gate would be 0 and its gradient NaN
    with pytest.raises(ShapeError, match=r"sapo_loss: advantages has shape \(3,\)"):
        sapo_loss(lp, old, torch.zeros(3), mask)


# --- GMPO -------------------------------------------------------------------------------

def test_gmpo_hand_derived_sign_aware_clip():
    # Row 0, A = 1: log-ratios 0.5 -> 0.4 (clipped above), -0.9 (kept: A > 0 clips above
    # only); ratio exp(-0.25). Row 1, A = -2: 0.5 kept, -0.9 -> -0.4; ratio exp(0.05).
    lp = torch.tensor([[0.5, -0.9], [0.5, -0.9]]); old = torch.zeros(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, grad, m = _grad(gmpo_loss, lp, old, torch.tensor([1.0, -2.0]), mask)
    r0, r1 = math.exp(-0.25), math.exp(0.05)
    assert loss.item() == pytest.approx((-r0 + 2 * r1) / 2, rel=1e-6)
    # d/d lp: -A_b * ratio_b / n_b / S where unclipped, 0 where clipped
    expected = torch.tensor([[0.0, -r0 / 4], [2 * r1 / 4, 0.0]])
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-8)
    assert m["clip_frac_high"].item() == pytest.approx(0.25) and m["clip_frac_low"].item() == pytest.approx(0.25)


@pytest.mark.parametrize("seed", range(4))
def test_gmpo_matches_reference(seed):
    lp, old, adv, mask = _data(5, 7, seed=seed, spread=0.5, token_adv=seed % 2 == 1)
    mask[0] = False
    loss, _ = gmpo_loss(lp, old, adv, mask, clip_low=0.3, clip_high=0.2)
    assert loss.item() == pytest.approx(gmpo_loss_ref(lp, old, adv, mask, 0.3, 0.2), rel=1e-5, abs=1e-6)



def test_gmpo_weights_scale_each_tokens_share_of_its_row():
    # Row 0: A = 1, log-ratios 0.2 and 0.0 (inside the clip): ratio_0 = exp(0.1); row 1:
    # A = -1, log-ratios 0 and 0: ratio_1 = 1. Per token the loss is w_bt * (-A_b ratio_b);
    # seq-mean-token-mean averages it over each row's counted tokens, then over rows:
    # weights (1, 0) on row 0 keep half of its term; (2, 2) on row 1 double it.
    lp = torch.tensor([[0.2, 0.0], [0.0, 0.0]]); old = torch.zeros(2, 2)
    mask = torch.ones(2, 2, dtype=torch.bool); adv = torch.tensor([1.0, -1.0])
    w = torch.tensor([[1.0, 0.0], [2.0, 2.0]])
    loss, grad, m = _grad(gmpo_loss, lp, old, adv, mask, w)
    r0 = math.exp(0.1)
    assert loss.item() == pytest.approx((-r0 / 2 + 2 * 1.0) / 2, rel=1e-6)
    # The zero-weight token still counts in ratio_0 (a geometric mean over both tokens): the
    # gradient of -(1/2) exp((lp_00 + lp_01) / 2) / 2 is -r0 / 8 on both of row 0's tokens;
    # row 1's: 2 * exp(mean) / 2 / 2 = 1/2 per token.
    torch.testing.assert_close(grad, torch.tensor([[-r0 / 8, -r0 / 8], [0.5, 0.5]]), rtol=1e-6, atol=1e-8)
    # the weights do not change the metrics (ratio_b is unweighted)
    _, _, m_plain = _grad(gmpo_loss, lp, old, adv, mask)
    for key in m_plain:
        torch.testing.assert_close(m[key], m_plain[key], msg=key)


def test_gmpo_unit_weights_equal_no_weights_and_row_weights_scale_rows():
    lp, old, adv, mask = _data(5, 7, seed=7, spread=0.5)
    mask[1] = False
    plain, plain_grad, _ = _grad(gmpo_loss, lp, old, adv, mask)
    ones, ones_grad, _ = _grad(gmpo_loss, lp, old, adv, mask, torch.ones(5, 7))
    assert torch.equal(ones, plain) and torch.equal(ones_grad, plain_grad)
    # One weight per sequence ([B]) multiplies that sequence's -A_b ratio_b: the default
    # aggregation is then the weighted mean of the rows' terms over the rows with a token.
    w = torch.tensor([0.5, 3.0, 0.0, 2.0, 1.0])
    loss, _ = gmpo_loss(lp, old, adv, mask, w)
    per_token = gmpo_per_token_ref(lp, old, adv, mask, 0.4, 0.4)
    rows = [b for b in range(5) if mask[b].any()]
    expected = sum(float(w[b]) * per_token[b][int(mask[b].nonzero()[0])] for b in rows) / len(rows)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_gmpo_with_weights_matches_reference(mode, seed):
    lp, old, adv, mask = _data(5, 7, seed=seed, spread=0.5, token_adv=seed % 2 == 1)
    mask[0] = False
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(5, 7, generator=g) if seed != 2 else torch.rand(5, generator=g)
    loss, _ = gmpo_loss(lp, old, adv, mask, w, clip_low=0.3, clip_high=0.2, aggregation=mode)
    per_token = torch.tensor(gmpo_per_token_ref(lp, old, adv, mask, 0.3, 0.2, w), dtype=torch.float64)
    assert loss.item() == pytest.approx(aggregate_ref(per_token, mask, mode), rel=1e-5, abs=1e-6)

def test_gmpo_passes_the_policy_loss_checks():
    check_policy_loss(gmpo_loss, aggregation="seq-mean-token-mean", advantage_level="sequence", max_examples=10)


def test_gmpo_bad_inputs():
    lp, old, adv, mask = _data(2, 3)
    with pytest.raises(InvalidArgumentError, match="gmpo_loss: clip_low must be >= 0, got -0.1"):
        gmpo_loss(lp, old, adv, mask, clip_low=-0.1)
    with pytest.raises(ShapeError, match=r"gmpo_loss: weights has shape \(3,\) but log_probs has shape \(2, 3\)"):
        gmpo_loss(lp, old, adv, mask, torch.ones(3))


def test_cispo_bad_inputs():
    lp, old, adv, mask = _data(4, 6)
    with pytest.raises(TypeError):
        cispo_loss(lp, old, adv, mask)  # clip_low and clip_high are required
    with pytest.raises(InvalidArgumentError, match="cispo_loss: clip_low must be in \\[0, 1\\], got 1.5"):
        cispo_loss(lp, old, adv, mask, clip_low=1.5, clip_high=0.2)
