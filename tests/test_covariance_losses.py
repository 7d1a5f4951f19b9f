"""Tests for torchforge.covariance_losses: Clip-Cov and KL-Cov."""

import math

import pytest
import torch

from tests._losses_common import _data, _grad
from tests.reference import kl_cov_loss_ref
from torchforge.covariance_losses import clip_cov_loss, kl_cov_loss
from torchforge.errors import InvalidArgumentError, ShapeError
from torchforge.testing import check_policy_loss

# --- Clip-Cov and KL-Cov ----------------------------------------------------------------

def test_clip_cov_detaches_the_drawn_tokens_only():
    # cov = A * (lp + 4) = [6, 1, 1, 6] (means 0 and -4); band (0.5, 7), k = floor(0.5 * 4)
    # = 2 of the 4 candidates are drawn: their gradient is 0, the others keep -A / N.
    lp = torch.tensor([[-1.0, -3.0, -5.0, -7.0]]); A = torch.tensor([[2.0, 1.0, -1.0, -2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    seen = set()
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        loss, grad, m = _grad(clip_cov_loss, lp, lp, A, mask, select_frac=0.5, cov_low=0.5, cov_high=7.0,
                              generator=gen)
        detached = grad[0] == 0
        assert int(detached.sum()) == 2 and m["cov_clip_frac"].item() == 0.5
        torch.testing.assert_close(grad[0][~detached], (-A[0] / 4)[~detached])
        assert loss.item() == pytest.approx(-(2 + 1 - 1 - 2) / 4, abs=1e-7)  # the value is kept
        seen.add(tuple(detached.tolist()))
        # the same generator state draws the same tokens
        _, grad2, _ = _grad(clip_cov_loss, lp, lp, A, mask, select_frac=0.5, cov_low=0.5, cov_high=7.0,
                            generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(grad2, grad)
    assert len(seen) > 1  # the draw is random


def test_clip_cov_skips_tokens_ppo_already_clipped_and_outside_the_band():
    # Token 0: ratio e^1 with A > 0, clipped by PPO; token 3: cov 6 outside (0.5, 5).
    lp = torch.tensor([[-1.0, -3.0, -5.0, -7.0]]); old = lp.clone(); old[0, 0] -= 1.0
    A = torch.tensor([[2.0, 1.0, -1.0, -2.0]]); mask = torch.ones(1, 4, dtype=torch.bool)
    _, grad, m = _grad(clip_cov_loss, lp, old, A, mask, select_frac=1.0, cov_low=0.5, cov_high=5.0)
    assert m["cov_clip_frac"].item() == 0.5  # tokens 1 and 2 (cov 1)
    assert grad[0, 1] == 0 and grad[0, 2] == 0 and grad[0, 3] != 0


def test_clip_cov_passes_the_policy_loss_checks_outside_its_band():
    check_policy_loss(lambda *a: clip_cov_loss(*a, cov_low=1e6, cov_high=2e6), max_examples=10)


def test_kl_cov_hand_derived_and_reference():
    lp = torch.tensor([[-1.0, -2.0]]); old = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, grad, m = _grad(kl_cov_loss, lp, old, torch.tensor([[1.0, -1.0]]), mask, select_frac=0.5)
    # token 0 (cov 0.5, first of the tie) penalized: d/dlp (-e^x + |x|) = -e^0.5 + 1; token 1: +1
    torch.testing.assert_close(grad, torch.tensor([[(-math.exp(0.5) + 1) / 2, 0.5]]))
    assert m["kl_cov_frac"].item() == 0.5 and m["kl_abs"].item() == pytest.approx(0.25)
    for seed in range(4):
        lp, old, adv, mask = _data(6, 8, seed=seed, spread=0.5, token_adv=seed % 2 == 0)
        loss, _ = kl_cov_loss(lp, old, adv, mask, select_frac=0.1, kl_coef=0.7)
        assert loss.item() == pytest.approx(kl_cov_loss_ref(lp, old, adv, mask, 0.1, 0.7), rel=1e-5, abs=1e-6)


def test_kl_cov_passes_the_policy_loss_checks():
    check_policy_loss(lambda *a: kl_cov_loss(*a, select_frac=0.2), max_examples=10)


def test_cov_losses_bad_inputs():
    lp, old, adv, mask = _data(2, 3)
    with pytest.raises(InvalidArgumentError, match="clip_cov_loss: select_frac must be in \\(0, 1\\], got 0"):
        clip_cov_loss(lp, old, adv, mask, select_frac=0)
    with pytest.raises(InvalidArgumentError, match="clip_cov_loss: cov_low must be < cov_high"):
        clip_cov_loss(lp, old, adv, mask, cov_low=5.0, cov_high=1.0)
    with pytest.raises(InvalidArgumentError, match="kl_cov_loss: kl_coef must be >= 0, got -1"):
        kl_cov_loss(lp, old, adv, mask, kl_coef=-1)
    with pytest.raises(ShapeError, match=r"kl_cov_loss: old_log_probs has shape \(2, 2\)"):
        kl_cov_loss(lp, old[:, :2], adv, mask)
