"""Tests for torchforge.corrections: TIS weights, ratio masks, unscored tokens."""


import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._losses_common import _log_prob_pair as _data
from tests.reference import ratio_mask_ref, truncated_importance_weights_ref
from torchforge.batch import Batch
from torchforge.corrections import (
    CORRECTION_LEVELS,
    ratio_mask,
    truncated_importance_weights,
    unscored_tokens,
)
from torchforge.errors import DTypeError, InvalidArgumentError, ShapeError
from torchforge.losses import ppo_loss

SETTINGS = settings(max_examples=30, deadline=None)
NAN = float("nan")


# --- truncated importance weights -------------------------------------------------------

def test_tis_hand_derived():
    # ratios 2, 0.5, 4 (masked); cap 3: token weights 2, 0.5, 0; product 2 * 0.5 = 1, and
    # geometric mean sqrt(2 * 0.5) = 1. Row 2: ratios 4, 1: product 4 -> cap 3, geometric 2.
    old = torch.log(torch.tensor([[0.4, 0.1, 0.8], [0.8, 0.2, 0.1]]))
    rollout = torch.log(torch.tensor([[0.2, 0.2, 0.2], [0.2, 0.2, 0.1]]))
    mask = torch.tensor([[True, True, False], [True, True, False]])
    torch.testing.assert_close(truncated_importance_weights(old, rollout, mask, cap=3.0),
                               torch.tensor([[2.0, 0.5, 0.0], [3.0, 1.0, 0.0]]))
    torch.testing.assert_close(truncated_importance_weights(old, rollout, mask, cap=3.0, level="sequence-product"),
                               torch.tensor([[1.0, 1.0, 0.0], [3.0, 3.0, 0.0]]))
    torch.testing.assert_close(truncated_importance_weights(old, rollout, mask, cap=3.0, level="sequence"),
                               torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(truncated_importance_weights(old, rollout, mask, cap=1.5),
                               torch.tensor([[1.5, 0.5, 0.0], [1.5, 1.0, 0.0]]))


@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       level=st.sampled_from(CORRECTION_LEVELS), cap=st.sampled_from([0.5, 2.0, 10.0]),
       spread=st.sampled_from([0.5, 50.0]))  # 50: log-ratios far past log(cap), sums past exp's range
@SETTINGS
def test_tis_matches_reference(B, T, seed, level, cap, spread):
    old, rollout, mask = _data(B, T, seed, spread)
    out = truncated_importance_weights(old, rollout, mask, level=level, cap=cap)
    torch.testing.assert_close(out.double(), truncated_importance_weights_ref(old, rollout, mask, level, cap),
                               rtol=1e-5, atol=1e-6)
    assert out.dtype == torch.float32 and (out <= cap).all() and (out >= 0).all()


def test_tis_detached_finite_and_nan_safe():
    old, rollout, mask = _data(seed=1)
    old = old.clone().requires_grad_()
    big = torch.where(mask, old * 100, NAN)  # huge log-ratios, NaN where masked
    w = truncated_importance_weights(big, rollout, mask, level="sequence-product", cap=2.0)
    assert not w.requires_grad and torch.isfinite(w).all()
    assert torch.all(w[~mask] == 0)


def test_tis_weights_compose_with_ppo_loss():
    old, rollout, mask = _data(seed=2)
    adv = torch.randn(4)
    w = truncated_importance_weights(old, rollout, mask)
    loss, _ = ppo_loss(old, old, adv, mask, w)  # on-policy: per-token loss -A * w
    expected = torch.where(mask, -adv[:, None] * w, 0.0).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)


# --- ratio masks ------------------------------------------------------------------------

def test_ratio_mask_hand_derived():
    # ratios 1, 9, 1.125 -> token level keeps 1 and 1.125 in [0.5, 2];
    # geometric mean (9 * 1.125)^(1/3) = 2.16 > 2 -> drop the row; product 10.125 > 2 -> drop.
    # With the middle token masked: geometric (1.125)^(1/2) = 1.06, product 1.125 -> keep.
    old = torch.log(torch.tensor([[0.9, 0.9, 0.9]])); rollout = torch.log(torch.tensor([[0.9, 0.1, 0.8]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert ratio_mask(old, rollout, mask, low=0.5, high=2.0).tolist() == [[1.0, 0.0, 1.0]]
    assert ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence").tolist() == [[0.0] * 3]
    assert ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence-product").tolist() == [[0.0] * 3]
    assert ratio_mask(old, rollout, mask, low=0.5, high=20.0, level="sequence-product").tolist() == [[1.0] * 3]
    mask[0, 1] = False
    assert ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence").tolist() == [[1.0, 0.0, 1.0]]
    # 0.9^10 per-token ratio over 10 tokens: geometric 0.9 keeps, product 0.35 drops (the product drifts)
    long_old, long_rollout = torch.full((1, 10), math.log(0.9)), torch.zeros(1, 10)
    long_mask = torch.ones(1, 10, dtype=torch.bool)
    assert ratio_mask(long_old, long_rollout, long_mask, low=0.5, high=2.0, level="sequence").sum() == 10
    assert ratio_mask(long_old, long_rollout, long_mask, low=0.5, high=2.0, level="sequence-product").sum() == 0


@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       level=st.sampled_from(CORRECTION_LEVELS), bounds=st.sampled_from([(0.5, 2.0), (0.0, 1.5), (0.9, 5.0)]),
       spread=st.sampled_from([0.5, 50.0]))
@SETTINGS
def test_ratio_mask_matches_reference(B, T, seed, level, bounds, spread):
    old, rollout, mask = _data(B, T, seed, spread)
    out = ratio_mask(old, rollout, mask, low=bounds[0], high=bounds[1], level=level)
    assert out.dtype == torch.float32 and not out.requires_grad
    assert torch.equal(out.double(), ratio_mask_ref(old, rollout, mask, *bounds, level))
    assert not (out.bool() & ~mask).any()  # only ever removes tokens


def test_ratio_mask_nan_at_masked_positions():
    old, rollout, mask = _data(seed=3)
    for level in CORRECTION_LEVELS:
        clean = ratio_mask(old, rollout, mask, low=0.5, high=2.0, level=level)
        dirty = ratio_mask(torch.where(mask, old, NAN), torch.where(mask, rollout, NAN), mask,
                           low=0.5, high=2.0, level=level)
        assert torch.equal(clean, dirty)


def test_ratio_mask_as_weights_keeps_the_token_mean_denominator():
    # Token-mean over 4 counted tokens, one dropped by the filter: the loss is
    # (sum of the 3 kept per-token losses) / 4, as verl / TRL / OpenRLHF / IcePop; passing
    # the filter as the mask instead would divide by 3 (the old recipe: scaled by 4 / 3).
    log_probs = torch.zeros(1, 4)
    old, rollout = torch.zeros(1, 4), torch.tensor([[0.0, 0.0, 0.0, -5.0]])  # ratio e^5 at the last token
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.tensor([2.0])
    keep = ratio_mask(old, rollout, mask, low=0.5, high=2.0)
    assert keep.tolist() == [[1.0, 1.0, 1.0, 0.0]]
    loss, _ = ppo_loss(log_probs, old, adv, mask, keep)  # on-policy: per-token loss -A * w
    torch.testing.assert_close(loss, torch.tensor(-2.0 * 3 / 4))
    # composes with TIS by multiplication (IcePop's k * 1[low <= k <= high])
    tis = truncated_importance_weights(old, rollout, mask, cap=2.0)
    loss_both, _ = ppo_loss(log_probs, old, adv, mask, tis * keep)
    torch.testing.assert_close(loss_both, torch.tensor(-2.0 * 3 / 4))


def test_nan_log_probs_at_counted_tokens_get_weight_zero_and_are_counted():
    # A NaN rollout log-prob (an engine that could not score a token) never turns the loss
    # into NaN: the token gets weight 0 (its whole row at a sequence level), and
    # unscored_tokens counts it.
    old, rollout, mask = _data(seed=7)
    mask[:, :2] = True
    rollout = rollout.clone()
    rollout[0, 1] = NAN
    old = old.clone()
    old[2, 0] = NAN
    unscored = unscored_tokens(old, rollout, mask)
    assert unscored.sum().item() == 2 and unscored[0, 1] and unscored[2, 0]
    adv = torch.randn(4)
    for level in CORRECTION_LEVELS:
        tis = truncated_importance_weights(old, rollout, mask, level=level)
        keep = ratio_mask(old, rollout, mask, low=0.0, high=math.inf, level=level)
        assert torch.isfinite(tis).all() and tis[0, 1] == 0 and keep[0, 1] == 0 and keep[2, 0] == 0
        if level != "token":
            assert (tis[0] == 0).all() and (keep[0] == 0).all() and (keep[2] == 0).all()
        else:  # the other tokens keep their weights
            assert keep[0, 0] == 1 and tis[0, 0] > 0
        log_probs = torch.where(mask, rollout.nan_to_num(), 0.0)
        loss, _ = ppo_loss(log_probs, log_probs, adv, mask, tis * keep)
        assert torch.isfinite(loss)
    assert not unscored_tokens(old, rollout, torch.zeros_like(mask)).any()


# --- shared -----------------------------------------------------------------------------

def test_bf16_inputs():
    old, rollout, mask = _data(seed=4)
    w = truncated_importance_weights(old.bfloat16(), rollout.bfloat16(), mask)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, truncated_importance_weights(old.bfloat16().float(), rollout.bfloat16().float(), mask))
    m = ratio_mask(old.bfloat16(), rollout.bfloat16(), mask, low=0.5, high=2.0)
    assert torch.equal(m, ratio_mask(old.bfloat16().float(), rollout.bfloat16().float(), mask, low=0.5, high=2.0))


def test_batch_and_tensordict_calling():
    old, rollout, mask = _data(seed=5)
    batch = Batch(old_log_probs=old, rollout_log_probs=rollout, mask=mask, rewards=torch.arange(4.0), batch_size=[4])
    torch.testing.assert_close(truncated_importance_weights(batch), truncated_importance_weights(old, rollout, mask))
    td = batch.to_tensordict()
    assert torch.equal(ratio_mask(td, low=0.5, high=2.0), ratio_mask(old, rollout, mask, low=0.5, high=2.0))


def test_bad_inputs():
    old, rollout, mask = _data()
    with pytest.raises(ShapeError, match=r"truncated_importance_weights: rollout_log_probs has shape \(4, 5\) but old_log_probs has shape \(4, 6\)"):
        truncated_importance_weights(old, rollout[:, :5], mask)
    with pytest.raises(InvalidArgumentError, match="truncated_importance_weights: cap must be a finite number > 0, got 0"):
        truncated_importance_weights(old, rollout, mask, cap=0)
    with pytest.raises(InvalidArgumentError, match="truncated_importance_weights: level is 'geo'"):
        truncated_importance_weights(old, rollout, mask, level="geo")
    with pytest.raises(InvalidArgumentError, match="ratio_mask: level is 'product'; expected one of 'token', 'sequence', 'sequence-product'"):
        ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="product")
    with pytest.raises(DTypeError, match="ratio_mask: mask has dtype torch.int64"):
        ratio_mask(old, rollout, mask.long(), low=0.5, high=2.0)
    with pytest.raises(InvalidArgumentError, match="ratio_mask: expected 0 <= low < high, got low=2.0, high=0.5"):
        ratio_mask(old, rollout, mask, low=2.0, high=0.5)


def test_every_correction_compiles_fullgraph_and_matches_eager():
    import torch._dynamo
    torch._dynamo.reset()
    old, rollout, mask = _data(seed=6)
    calls = {
        "tis": lambda: truncated_importance_weights(old, rollout, mask, level="sequence", cap=2.0),
        "tis_token": lambda: truncated_importance_weights(old, rollout, mask),
        "ratio_mask": lambda: ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence"),
        "ratio_mask_product": lambda: ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence-product"),
        "unscored": lambda: unscored_tokens(old, rollout, mask),
    }
    for name, call in calls.items():
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(), call(), msg=name)
