"""Tests for torchforge.ratios: policy_ratio (token and sequence level) and the ratio metrics."""

import math

import pytest
import torch

from tests._losses_common import _data, _grad
from torchforge.errors import InvalidArgumentError, ShapeError
from torchforge.losses import ppo_loss
from torchforge.ratios import RATIO_LEVELS, policy_ratio
from torchforge.reduce import masked_max, masked_mean, masked_min, masked_sum

# --- the sequence (GSPO) ratio ----------------------------------------------------------

def test_gspo_sequence_ratio_and_gradient():
    lp, old, adv, mask = _data(seed=5, spread=0.05)
    mask[:, 0] = True
    ratio = policy_ratio(lp, old, mask, level="sequence")
    n = mask.sum(-1)
    s = torch.exp(torch.where(mask, lp - old, 0.0).sum(-1) / n)
    torch.testing.assert_close(ratio, s[:, None].expand_as(ratio))
    # Gradient: the paper's sequence objective J = -(1/S) sum_b s_b A_b (all inside the
    # clip here), s_b differentiated through the mean, equals ppo_loss's GSPO-token form
    # with seq-mean-token-mean.
    lp1 = lp.clone().requires_grad_()
    s1 = torch.exp(torch.where(mask, lp1 - old, 0.0).sum(-1) / n)
    (-(s1 * adv).mean()).backward()
    loss, grad, metrics = _grad(ppo_loss, lp, old, adv, mask, ratio_level="sequence",
                                aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-(s * adv).mean().item(), rel=1e-5)
    torch.testing.assert_close(grad, lp1.grad, atol=1e-7, rtol=1e-5)
    # policy_ratio's own gradient (GSPO-token): d ratio_bt / d lp_bt = s_b, nothing across tokens.
    lp2 = lp.clone().requires_grad_()
    policy_ratio(lp2, old, mask, level="sequence")[0, 0].backward()
    expected = torch.zeros_like(lp); expected[0, 0] = s[0]
    torch.testing.assert_close(lp2.grad, expected)
    torch.testing.assert_close(metrics["ratio_mean"], (s * n).sum() / n.sum())


# --- metrics: max / min ---------------------------------------------------------------

def test_ratio_max_and_min_are_masked_extrema():
    lp = torch.tensor([[0.5, -0.5, 9.0], [0.1, 0.2, 0.0]]); old = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    _, m = ppo_loss(lp, old, torch.tensor([1.0, -1.0]), mask)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.5), rel=1e-6)   # 9.0 is masked
    assert m["ratio_min"].item() == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert "ratio_max" in m and "ratio_min" in m


@pytest.mark.parametrize("ratio_level", RATIO_LEVELS)
@pytest.mark.parametrize("per_token_advantages", [False, True])
@pytest.mark.parametrize("shift", [0.3, -0.3])
def test_metrics_equal_the_masked_reductions(ratio_level, per_token_advantages, shift):
    # Every counted ratio on one side of 1 (a masked position, ratio 1 there, must win
    # neither extremum), NaN where masked, a fully masked row, clipped tokens of both signs.
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 7, generator=g) * 2
    lp = old + shift + 0.4 * torch.rand(4, 7, generator=g) * (1 if shift > 0 else -1)
    mask = torch.rand(4, 7, generator=g) > 0.3
    mask[2] = False
    A = torch.randn(4, 7, generator=g) if per_token_advantages else torch.tensor([1.0, -1.0, 2.0, -0.5])
    lp, old = lp.masked_fill(~mask, float("nan")), old.masked_fill(~mask, float("nan"))
    _, m = ppo_loss(lp, old, A, mask, ratio_level=ratio_level, dual_clip=1.2)

    n = mask.sum()
    lr = torch.where(mask, lp - old, 0.0)
    ratio = policy_ratio(lp, old, mask, level=ratio_level)
    token_ratio = torch.exp(lr)
    A = A.unsqueeze(-1).expand(4, 7) if A.dim() == 1 else A
    clipped = (((ratio < 0.8) & (A < 0)) | ((ratio > 1.2) & (A > 0))) & mask
    expected = {
        "clip_frac_low": masked_sum((clipped & (A < 0)).float(), mask) / n,
        "clip_frac_high": masked_sum((clipped & (A > 0)).float(), mask) / n,
        "dual_clip_frac": masked_sum(((ratio > 1.2) & (A < 0)).float(), mask) / n,
        "approx_kl": masked_mean(token_ratio - 1 - lr, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_min": masked_min(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
    }
    assert (expected["ratio_min"] > 1) if shift > 0 else (expected["ratio_max"] < 1)
    for key, value in expected.items():
        torch.testing.assert_close(m[key], value.float(), rtol=1e-6, atol=1e-7, msg=key)


def test_policy_ratio_bad_inputs():
    lp, old, _, mask = _data(4, 6)
    with pytest.raises(InvalidArgumentError, match="policy_ratio: max_log_ratio must be > 0"):
        policy_ratio(lp, old, mask, max_log_ratio=0)
    with pytest.raises(InvalidArgumentError, match="policy_ratio: level is 'seq'; expected one of 'token', 'sequence'"):
        policy_ratio(lp, old, mask, level="seq")
    with pytest.raises(ShapeError, match=r"policy_ratio: old_log_probs has shape \(4, 5\) but log_probs"):
        policy_ratio(lp, old[:, :5], mask)
