"""Tests for torchforge.losses: PPO, GRPO, REINFORCE, and the contract every loss
shares (empty mask, NaN at masked positions, empty batches, per-rank global counts, compile)."""

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tests._losses_common import _data, _grad
from tests.reference import (
    aggregate_ref,
    cispo_per_token64,
    gmpo_per_row64,
    grpo_per_token64,
    kl_cov_all_selected_per_token64,
    ppo_metrics_ref,
    ppo_per_token64,
    ppo_per_token_ref,
    row_mean64,
    sapo_per_token64,
    token_mean64,
    verl_low_var_kl_ref,
)
from torchforge.batch import Batch
from torchforge.covariance_losses import clip_cov_loss, kl_cov_loss
from torchforge.errors import DTypeError, InvalidArgumentError, ShapeError
from torchforge.kl import approx_kl
from torchforge.losses import grpo_loss, ppo_loss, ppo_surrogate, reinforce_loss
from torchforge.ratios import policy_ratio
from torchforge.reduce import AGGREGATION_MODES, Aggregation, aggregate
from torchforge.trust_region_losses import cispo_loss, gmpo_loss, sapo_loss
from torchforge.value_losses import value_loss

SETTINGS = settings(max_examples=30, deadline=None)
NAN = float("nan")


def _all_losses():
    """(name, call(lp, mask) -> (loss, metrics)) for every loss, on fixed side inputs."""
    def make(B, T, seed=3):
        g = torch.Generator().manual_seed(seed)
        old = -torch.rand(B, T, generator=g)
        ref = -torch.rand(B, T, generator=g)
        adv = torch.randn(B, generator=g)
        w = torch.rand(B, T, generator=g)
        ret = torch.randn(B, T, generator=g)
        return {
            "ppo": lambda lp, m, **k: ppo_loss(lp, old, adv, m, w, dual_clip=3.0, **k),
            "ppo_seq": lambda lp, m, **k: ppo_loss(lp, old, adv, m, ratio_level="sequence", **k),
            "grpo": lambda lp, m, **k: grpo_loss(lp, old, adv, m, ref, kl_coef=0.1, **k),
            "reinforce": lambda lp, m, **k: reinforce_loss(lp, adv, m, w, **k),
            "cispo": lambda lp, m, **k: cispo_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.3, **k),
            "value": lambda lp, m, **k: value_loss(lp, old, ret, m, clip=0.1, **k),
            "grpo_st": lambda lp, m, **k: grpo_loss(lp, old, adv, m, ref, kl_coef=0.1,
                                                    kl_gradient="straight-through", **k),
            "grpo_bc": lambda lp, m, **k: grpo_loss(lp, old, adv, m, ref, kl_coef=0.1,
                                                    kl_gradient="bias-corrected", **k),
            "sapo": lambda lp, m, **k: sapo_loss(lp, old, adv, m, w, **k),
            "gmpo": lambda lp, m, **k: gmpo_loss(lp, old, adv, m, **k),
            "clip_cov": lambda lp, m, **k: clip_cov_loss(lp, old, adv, m, select_frac=0.1, cov_low=0.0,
                                                         generator=torch.Generator().manual_seed(0), **k),
            "kl_cov": lambda lp, m, **k: kl_cov_loss(lp, old, adv, m, select_frac=0.1, **k),
        }
    return make


# Clip-Cov and KL-Cov select tokens by the covariance of *this call's* tokens (as verl):
# split over ranks they select differently, so they are left out of the per-rank test.
LOCAL_LOSS_NAMES = ["ppo", "ppo_seq", "grpo", "grpo_st", "grpo_bc", "reinforce", "cispo", "value", "sapo", "gmpo"]
LOSS_NAMES = LOCAL_LOSS_NAMES + ["clip_cov", "kl_cov"]


# --- hand-derived cases -----------------------------------------------------------------

def test_ppo_hand_derived_clip_and_metrics():
    # Three tokens, A = (+1, -1, +1) per row... one row per token for clarity:
    #   r = 1.5, A = +1 -> clipped to 1.2: loss -1.2, clip_high
    #   r = 0.5, A = -1 -> max(0.5, 0.8) = 0.8: loss +0.8, clip_low
    #   r = 1.1, A = +1 -> inside: loss -1.1
    # token-mean: (-1.2 + 0.8 - 1.1) / 3 = -0.5
    lp = torch.log(torch.tensor([[1.5], [0.5], [1.1]]))
    old = torch.zeros(3, 1)
    adv = torch.tensor([1.0, -1.0, 1.0])
    mask = torch.ones(3, 1, dtype=torch.bool)
    loss, grad, metrics = _grad(ppo_loss, lp, old, adv, mask)
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    # Only the inside token gets gradient: d(-A r)/d lp = -A r / N = -1.1 / 3
    torch.testing.assert_close(grad, torch.tensor([[0.0], [0.0], [-1.1 / 3]]), atol=1e-6, rtol=0)
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert metrics["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert metrics["ratio_min"].item() == pytest.approx(0.5, rel=1e-6)
    assert metrics["ratio_max"].item() == pytest.approx(1.5, rel=1e-6)
    assert metrics["ratio_mean"].item() == pytest.approx(3.1 / 3, rel=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1)) / 3
    assert metrics["approx_kl"].item() == pytest.approx(k3, rel=1e-5)
    for value in metrics.values():
        assert value.dtype == torch.float32 and value.dim() == 0 and not value.requires_grad


@pytest.mark.parametrize(("n", "log_ratio"), [(5, -0.2), (11, -0.0871), (3, 0.0123), (45, 0.1)])
def test_ratio_extrema_are_exactly_the_counted_ones(n, log_ratio):
    # Every counted token at the same ratio, padding after them: ratio_min and ratio_max are
    # that ratio bit for bit. (Padding filled with the mean ratio, as an earlier version
    # did, lands a rounding away from it at the first two cases.)
    lp = torch.full((2, n + 3), log_ratio); old = torch.zeros(2, n + 3)
    mask = torch.zeros(2, n + 3, dtype=torch.bool); mask[:, :n] = True
    adv = torch.tensor([1.0, -1.0])
    want = torch.exp(torch.tensor(log_ratio))
    cispo = functools.partial(cispo_loss, clip_low=0.2, clip_high=0.3)
    for loss in (ppo_loss, grpo_loss, cispo, sapo_loss):
        _, metrics = loss(lp, old, adv, mask)
        assert metrics["ratio_min"] == want and metrics["ratio_max"] == want, loss


def test_asymmetric_clip_high():
    # r = 1.25, A = 1: clip_high=0.28 leaves it inside (-1.25); the default 0.2 clips (-1.2).
    lp = torch.log(torch.tensor([[1.25]])); old = torch.zeros(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool); adv = torch.ones(1)
    assert ppo_loss(lp, old, adv, mask, clip_high=0.28)[0].item() == pytest.approx(-1.25, rel=1e-6)
    assert ppo_loss(lp, old, adv, mask)[0].item() == pytest.approx(-1.2, rel=1e-6)


@given(seed=st.integers(0, 10_000), token_adv=st.booleans(),
       mode=st.sampled_from(AGGREGATION_MODES))
@SETTINGS
def test_inside_clip_equals_unclipped_surrogate(seed, token_adv, mode):
    lp, old, adv, mask = _data(seed=seed, spread=0.05, token_adv=token_adv)  # |log r| < 0.18 w.h.p.
    lp = old + (lp - old).clamp(-0.15, 0.15)                                 # r in (0.86, 1.17)
    loss, grad, metrics = _grad(ppo_loss, lp, old, adv, mask, aggregation=mode)
    lp2 = lp.clone().requires_grad_()
    a = adv if token_adv else adv[:, None].expand_as(lp)
    surrogate = aggregate(-a * torch.exp(lp2 - old), mask, mode=mode)
    surrogate.backward()
    torch.testing.assert_close(loss, surrogate.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, lp2.grad, atol=1e-6, rtol=1e-5)
    assert metrics["clip_frac_low"] == 0 and metrics["clip_frac_high"] == 0


def test_on_policy_gradient_is_masked_mean_of_minus_a_grad_log_pi():
    # lp == old: ratio 1 everywhere, d loss / d lp_bt = -A_b / N on counted tokens.
    _, old, adv, mask = _data(seed=1)
    _, grad, _ = _grad(ppo_loss, old, old, adv, mask)
    expected = torch.where(mask, -adv[:, None] / mask.sum(), 0.0)
    torch.testing.assert_close(grad, expected, atol=1e-7, rtol=1e-6)


def test_clipped_tokens_get_zero_gradient():
    # Row 0: A > 0 and r = 2 > 1.2; row 1: A < 0 and r = 0.5 < 0.8: both clipped.
    # Row 2: A > 0, r = 0.5 (min picks the unclipped term) -> gradient -A r / N.
    lp = torch.log(torch.tensor([[2.0], [0.5], [0.5]])); old = torch.zeros(3, 1)
    adv = torch.tensor([1.0, -1.0, 2.0]); mask = torch.ones(3, 1, dtype=torch.bool)
    _, grad, _ = _grad(ppo_loss, lp, old, adv, mask)
    torch.testing.assert_close(grad, torch.tensor([[0.0], [0.0], [-2.0 * 0.5 / 3]]))


def test_dual_clip_caps_loss_for_negative_advantages():
    # A = -2, r = 10, c = 3: the ordinary clipped loss is max(20, 2 * 0.8) = 20;
    # the dual clip caps it at -c A = 6, with zero gradient.
    lp = torch.log(torch.tensor([[10.0, 2.0]])); old = torch.zeros(1, 2)
    adv = torch.tensor([-2.0]); mask = torch.tensor([[True, False]])
    loss, grad, metrics = _grad(ppo_loss, lp, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx(6.0, rel=1e-6)
    assert grad.abs().sum() == 0
    assert metrics["dual_clip_frac"].item() == 1.0
    assert ppo_loss(lp, old, adv, mask)[0].item() == pytest.approx(20.0, rel=1e-5)
    # Below the cap (r = 2 < 3) nothing changes, and positive advantages are never capped.
    lp2 = torch.log(torch.tensor([[2.0]]))
    one = torch.ones(1, 1, dtype=torch.bool)
    assert ppo_loss(lp2, old[:, :1], adv, one, dual_clip=3.0)[0].item() == pytest.approx(4.0, rel=1e-6)
    assert ppo_loss(lp, old, -adv, mask, dual_clip=3.0)[0].item() == pytest.approx(-2.4, rel=1e-6)


def test_gspo_clips_whole_sequences():
    # Row 0: geometric mean ratio exp(0.5) = 1.65 > 1.2 with A > 0: every token clipped,
    # although token 1's own ratio (1.0) is inside.
    lp = torch.tensor([[1.0, 0.0]]); old = torch.zeros(1, 2); mask = torch.ones(1, 2, dtype=torch.bool)
    loss, grad, metrics = _grad(ppo_loss, lp, old, torch.ones(1), mask, ratio_level="sequence")
    assert loss.item() == pytest.approx(-1.2, rel=1e-6)
    assert grad.abs().sum() == 0 and metrics["clip_frac_high"].item() == 1.0


def test_reinforce_hand_derived():
    # loss = -(2 log 0.5 + (-1) log 0.25) / 2; gradient -A / N
    lp = torch.log(torch.tensor([[0.5], [0.25]])); adv = torch.tensor([2.0, -1.0])
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, grad, _ = _grad(reinforce_loss, lp, adv, mask)
    assert loss.item() == pytest.approx(-(2 * math.log(0.5) - math.log(0.25)) / 2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.0], [0.5]]))


def test_grpo_adds_kl_aggregated_the_same_way():
    lp, old, adv, mask = _data(seed=8)
    ref = old - 0.2
    for mode in AGGREGATION_MODES:
        loss, _, metrics = _grad(grpo_loss, lp, old, adv, mask, ref, kl_coef=0.05, aggregation=mode)
        pg, _ = ppo_loss(lp, old, adv, mask, aggregation=mode)
        kl = approx_kl(lp, ref)
        expected = pg + 0.05 * aggregate(kl, mask, mode=mode)
        torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(metrics["kl"], aggregate(kl, mask))
    # kl_coef = 0: no reference needed, equals ppo_loss.
    loss, _ = grpo_loss(lp, old, adv, mask)
    torch.testing.assert_close(loss, ppo_loss(lp, old, adv, mask)[0])


# --- reference loops --------------------------------------------------------------------

@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       mode=st.sampled_from(AGGREGATION_MODES), token_adv=st.booleans(),
       clip_high=st.sampled_from([None, 0.28]), dual_clip=st.sampled_from([None, 2.0]),
       level=st.sampled_from(["token", "sequence"]), with_weights=st.booleans())
@SETTINGS
def test_ppo_matches_reference(B, T, seed, mode, token_adv, clip_high, dual_clip, level, with_weights):
    lp, old, adv, mask = _data(B, T, seed, spread=0.5, p_mask=0.6, token_adv=token_adv)
    weights = torch.rand(B, T) if with_weights else None
    loss, metrics = ppo_loss(lp, old, adv, mask, weights, clip_high=clip_high, dual_clip=dual_clip,
                             ratio_level=level, aggregation=mode)
    per_token = ppo_per_token_ref(lp, old, adv, mask, 0.2, clip_high, dual_clip, level, weights)
    expected = aggregate_ref(torch.tensor(per_token, dtype=torch.float64), mask, mode)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    if level == "token" and weights is None:
        ref = ppo_metrics_ref(lp, old, adv, mask, 0.2, clip_high, dual_clip)
        assert set(metrics) == set(ref)
        for key, value in ref.items():
            assert metrics[key].item() == pytest.approx(value, rel=1e-5, abs=1e-6), key


# --- properties shared by every loss ----------------------------------------------------

@pytest.mark.parametrize("name", LOCAL_LOSS_NAMES)
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_per_rank_losses_with_global_counts_add_up(name, mode):
    # Two ranks with half the rows each, global counts, dp_size=2: the mean of the
    # per-rank losses (what DDP does to gradients) equals the one-process loss; so do
    # the gradients.
    B, T = 6, 5
    calls = _all_losses()(B, T)
    lp, _, _, mask = _data(B, T, seed=2)
    mask[1] = False  # an empty row
    full, full_grad, _ = _grad(calls[name], lp, mask, aggregation=mode)
    tokens, sequences = mask.sum(), (mask.sum(-1) > 0).sum()
    agg = Aggregation(mode, num_tokens=tokens, num_sequences=sequences, dp_size=2)
    lp_ranks = lp.clone().requires_grad_()
    total = 0
    for rows in (slice(0, 3), slice(3, 6)):
        # A rank's local batch: the other rank's rows masked out (they add nothing; the
        # global counts, not the local ones, normalize).
        sub_mask = torch.zeros_like(mask); sub_mask[rows] = mask[rows]
        total = total + calls[name](lp_ranks, sub_mask, aggregation=agg)[0] / 2
    total.backward()
    torch.testing.assert_close(total.detach(), full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp_ranks.grad, full_grad, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_empty_mask_gives_finite_zero_and_zero_gradient(name, mode):
    lp = -torch.rand(3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    loss, grad, metrics = _grad(_all_losses()(3, 4)[name], lp, mask, aggregation=mode)
    assert loss.item() == 0 and torch.all(grad == 0)
    for key, value in metrics.items():
        assert torch.isfinite(value) and value.item() == 0, key


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_nan_at_masked_positions_does_not_leak(name):
    lp, _, _, mask = _data(4, 6, seed=4)
    mask[2] = False
    calls = _all_losses()(4, 6)
    loss, grad, metrics = _grad(calls[name], lp, mask)
    dirty = torch.where(mask, lp, NAN)
    loss2, grad2, metrics2 = _grad(calls[name], dirty, mask)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grad2, grad)
    for key in metrics:
        torch.testing.assert_close(metrics2[key], metrics[key])


def test_nan_in_side_inputs_at_masked_positions_does_not_leak():
    lp, old, adv, mask = _data(4, 6, seed=6, token_adv=True)
    mask[1] = False
    ref, w = old - 0.1, torch.rand(4, 6)
    dirty = lambda x: torch.where(mask, x, NAN)
    for token_adv in (True, False):
        a = adv if token_adv else adv[:, 0]
        a_dirty = dirty(a) if token_adv else torch.where(mask.any(-1), a, NAN)
        clean = _grad(grpo_loss, lp, old, a, mask, ref, w, kl_coef=0.1, ratio_level="sequence")
        nan = _grad(grpo_loss, lp, dirty(old), a_dirty, mask, dirty(ref), dirty(w), kl_coef=0.1,
                    ratio_level="sequence")
        torch.testing.assert_close(nan[0], clean[0]); torch.testing.assert_close(nan[1], clean[1])
        for key in clean[2]:
            torch.testing.assert_close(nan[2][key], clean[2][key])
    v = _grad(value_loss, lp, dirty(old), dirty(ref), mask)
    torch.testing.assert_close(v[0], _grad(value_loss, lp, old, ref, mask)[0])
    assert torch.isfinite(v[1]).all()
    c = _grad(cispo_loss, lp, dirty(old), dirty(adv), mask, dirty(w), clip_low=0.2, clip_high=0.2)
    clean = _grad(cispo_loss, lp, old, adv, mask, w, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(c[0], clean[0]); torch.testing.assert_close(c[1], clean[1])
    r = _grad(reinforce_loss, dirty(lp), dirty(adv), mask, dirty(w))
    clean = _grad(reinforce_loss, lp, adv, mask, w)
    for got, want in zip(r, clean):
        torch.testing.assert_close(got, want)
    assert (r[1][~mask] == 0).all()


# The policy losses whose metrics can be switched off (the value and covariance losses cannot).
WITH_METRICS_NAMES = ["ppo", "ppo_seq", "grpo", "grpo_st", "grpo_bc", "reinforce", "cispo", "sapo", "gmpo"]


@pytest.mark.parametrize("name", WITH_METRICS_NAMES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_without_metrics_the_loss_and_gradient_are_identical(name, mode):
    # with_metrics=False skips only the no-grad statistics: the same loss and gradient, bit for bit.
    lp, _, _, mask = _data(5, 7, seed=8, spread=0.5)
    call = _all_losses()(5, 7)[name]
    loss, grad, metrics = _grad(call, lp, mask, aggregation=mode)
    loss_off, grad_off, metrics_off = _grad(call, lp, mask, aggregation=mode, with_metrics=False)
    assert metrics and metrics_off == {}
    assert torch.equal(loss_off, loss) and torch.equal(grad_off, grad)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ppo_surrogate_without_metrics_is_identical(level):
    lp, old, adv, mask = _data(5, 7, seed=9, spread=0.5, token_adv=True)
    x, y = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    pg, ratio, metrics = ppo_surrogate(x, old, adv, mask, clip_high=0.28, dual_clip=3.0, ratio_level=level)
    pg_off, ratio_off, metrics_off = ppo_surrogate(y, old, adv, mask, clip_high=0.28, dual_clip=3.0,
                                                   ratio_level=level, with_metrics=False)
    assert metrics and metrics_off == {}
    assert torch.equal(pg_off, pg) and torch.equal(ratio_off, ratio)
    (pg.sum() + ratio.sum()).backward()
    (pg_off.sum() + ratio_off.sum()).backward()
    assert torch.equal(y.grad, x.grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_masked_equals_sliced(mode):
    # Masking the last 3 columns equals slicing them off, for every loss.
    lp, old, adv, mask = _data(4, 8, seed=10, p_mask=1.0)
    ref, w = old - 0.3, torch.rand(4, 8)
    mask[:, 5:] = False
    k = 5
    pairs = [
        (lambda n: ppo_loss(lp[:, :n], old[:, :n], adv, mask[:, :n], w[:, :n], dual_clip=2.0,
                            ratio_level="sequence", aggregation=mode)),
        (lambda n: grpo_loss(lp[:, :n], old[:, :n], adv, mask[:, :n], ref[:, :n], kl_coef=0.1,
                             aggregation=mode)),
        (lambda n: reinforce_loss(lp[:, :n], adv, mask[:, :n], w[:, :n], aggregation=mode)),
        (lambda n: cispo_loss(lp[:, :n], old[:, :n], adv, mask[:, :n], clip_low=0.2, clip_high=0.2,
                              aggregation=mode)),
        (lambda n: value_loss(lp[:, :n], old[:, :n], ref[:, :n], mask[:, :n], aggregation=mode)),
    ]
    for call in pairs:
        (a, ma), (b, mb) = call(8), call(k)
        torch.testing.assert_close(a, b)
        for key in ma:
            torch.testing.assert_close(ma[key], mb[key], msg=key)


def test_masked_equals_sliced_ppo_tensors():
    lp, old, adv, mask = _data(4, 8, seed=10, p_mask=1.0)
    mask[:, 5:] = False
    a, ma = ppo_loss(lp, old, adv, mask, dual_clip=2.0)
    b, mb = ppo_loss(lp[:, :5], old[:, :5], adv, mask[:, :5], dual_clip=2.0)
    torch.testing.assert_close(a, b)
    for key in ma:
        torch.testing.assert_close(ma[key], mb[key])


def test_ppo_gradient_is_the_textbook_formula():
    # d pg_loss / d lp = -A * ratio where the clip is inactive, 0 where it is active
    # (token level); GSPO-token: -A * s_b at every counted token of a row inside the clip.
    lp, old, _, mask = _data(3, 5, seed=21, spread=0.4)
    adv = torch.tensor([1.0, -1.0, 0.5])
    _, grad, _ = _grad(ppo_loss, lp, old, adv, mask)
    ratio = torch.exp(torch.where(mask, lp - old, 0.0))
    A = adv[:, None]
    inside = torch.where(A > 0, ratio <= 1.2, ratio >= 0.8)
    expected = torch.where(mask & inside, -A * ratio, 0.0) / mask.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-8)
    _, grad, _ = _grad(ppo_loss, lp, old, adv, mask, ratio_level="sequence")
    n = mask.sum(-1, keepdim=True)
    s = torch.exp(torch.where(mask, lp - old, 0.0).sum(-1, keepdim=True) / n.clamp(min=1))
    inside = torch.where(A > 0, s <= 1.2, s >= 0.8)
    expected = torch.where(mask & inside, -A * s, 0.0) / mask.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-8)


def test_bf16_inputs_give_float32():
    lp, old, adv, mask = _data(4, 6, seed=11)
    calls = {
        "ppo": lambda x, y: ppo_loss(x, y, adv, mask),
        "grpo": lambda x, y: grpo_loss(x, y, adv, mask, y, kl_coef=0.1),
        "cispo": lambda x, y: cispo_loss(x, y, adv, mask, clip_low=0.2, clip_high=0.2),
        "reinforce": lambda x, y: reinforce_loss(x, adv, mask),
        "value": lambda x, y: value_loss(x, y, y, mask),
    }
    for name, call in calls.items():
        x = lp.bfloat16().requires_grad_()
        loss, metrics = call(x, old.bfloat16())
        loss.backward()
        assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16, name
        ref, _ = call(lp.bfloat16().float(), old.bfloat16().float())
        torch.testing.assert_close(loss.detach(), ref, atol=1e-5, rtol=1e-5)
        assert all(v.dtype == torch.float32 for v in metrics.values())


def test_batch_and_tensordict_calling():
    lp, old, adv, mask = _data(4, 6, seed=12)
    batch = Batch(log_probs=lp, old_log_probs=old, advantages=adv, mask=mask, ref_log_probs=old,
                  values=lp, old_values=old, returns=old, batch_size=[4])
    expected = ppo_loss(lp, old, adv, mask, clip_high=0.3)[0]
    torch.testing.assert_close(ppo_loss(batch, clip_high=0.3)[0], expected)
    torch.testing.assert_close(ppo_loss(batch.to_tensordict(), clip_high=0.3)[0], expected)
    torch.testing.assert_close(grpo_loss(batch, kl_coef=0.1)[0], grpo_loss(lp, old, adv, mask, old, kl_coef=0.1)[0])
    torch.testing.assert_close(value_loss(batch)[0], value_loss(lp, old, old, mask)[0])
    torch.testing.assert_close(reinforce_loss(batch)[0], reinforce_loss(lp, adv, mask)[0])
    torch.testing.assert_close(policy_ratio(batch), policy_ratio(lp, old, mask))
    td = TensorDict(log_probs=lp, old_log_probs=old, advantages=adv, mask=mask, batch_size=[4])
    torch.testing.assert_close(cispo_loss(td, clip_low=0.2, clip_high=0.2)[0],
                               cispo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)[0])


def test_bad_inputs():
    lp, old, adv, mask = _data(4, 6)
    with pytest.raises(ShapeError, match=r"ppo_loss: advantages has shape \(6,\) but log_probs has shape \(4, 6\); expected \(4,\) or \(4, 6\)"):
        ppo_loss(lp, old, torch.zeros(6), mask)
    with pytest.raises(ShapeError, match=r"ppo_loss: old_log_probs has shape \(4, 5\) but log_probs"):
        ppo_loss(lp, old[:, :5], adv, mask)
    with pytest.raises(DTypeError, match="ppo_loss: mask has dtype torch.float32; expected torch.bool"):
        ppo_loss(lp, old, adv, mask.float())
    with pytest.raises(ShapeError, match=r"ppo_loss: weights has shape \(3,\)"):
        ppo_loss(lp, old, adv, mask, torch.ones(3))
    with pytest.raises(ShapeError, match=r"ppo_loss: log_probs has shape \(24,\); expected 2 dimensions"):
        ppo_loss(lp.flatten(), old.flatten(), adv, mask.flatten())
    with pytest.raises(InvalidArgumentError, match="ppo_loss: clip_low must be in \\[0, 1\\], got 1.5"):
        ppo_loss(lp, old, adv, mask, clip_low=1.5)
    with pytest.raises(InvalidArgumentError, match="ppo_loss: dual_clip must be > 1"):
        ppo_loss(lp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(InvalidArgumentError, match="ppo_loss: ratio_level is 'seq'; expected one of 'token', 'sequence'"):
        ppo_loss(lp, old, adv, mask, ratio_level="seq")
    with pytest.raises(InvalidArgumentError, match="ppo_loss: aggregation mode is 'mean'"):
        ppo_loss(lp, old, adv, mask, aggregation="mean")
    with pytest.raises(InvalidArgumentError, match="ppo_loss: aggregation dp_size=2 needs num_tokens"):
        ppo_loss(lp, old, adv, mask, aggregation=Aggregation(dp_size=2))
    with pytest.raises(InvalidArgumentError, match="ppo_loss: aggregation num_tokens must be >= 0, got -1"):
        ppo_loss(lp, old, adv, mask, aggregation=Aggregation(num_tokens=-1))
    with pytest.raises(InvalidArgumentError, match="grpo_loss: kl_coef=0.1 needs ref_log_probs"):
        grpo_loss(lp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(InvalidArgumentError, match="grpo_loss: kl_estimator is 'k4'"):
        grpo_loss(lp, old, adv, mask, kl_estimator="k4")
    with pytest.raises(DTypeError, match="reinforce_loss: advantages has dtype torch.int64"):
        reinforce_loss(lp, torch.ones(4, dtype=torch.long), mask)


def test_extreme_log_ratios_stay_finite():
    lp = torch.tensor([[60.0, -60.0]], requires_grad=True); old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    for adv in (torch.tensor([1.0]), torch.tensor([-1.0])):
        loss, metrics = ppo_loss(lp, old, adv, mask)
        (g,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(policy_ratio(lp, old, mask)).all()


# --- at the extremes: log-ratios of +-50 -------------------------------------------------

def _extreme_data(B, T, seed, token_adv):
    """Log-ratios uniform in [-50, 50], -50 and 50 themselves included: far past the clamp
    at +-20 every loss documents (exp(20) = 4.9e8), where a ratio of 5e21 would swamp any
    token-mean."""
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=g)
    x = 100 * torch.rand(B, T, generator=g) - 50
    x.view(-1)[0], x.view(-1)[-1] = 50.0, -50.0
    ref = old - 100 * torch.rand(B, T, generator=g) + 50
    adv = torch.randn((B, T) if token_adv else (B,), generator=g)
    weights = torch.rand(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.7
    return old + x, old, ref, adv, weights, mask


EXTREME_LOSSES = {  # name: (torchforge, float64 per-token (gmpo: per-row) equation, its reduction)
    "ppo": (lambda lp, old, ref, adv, w, m: ppo_loss(lp, old, adv, m),
            lambda lp, old, ref, adv, w, m: ppo_per_token64(lp, old, adv, m), token_mean64),
    "ppo dual-clip, clip-higher, weights": (
        lambda lp, old, ref, adv, w, m: ppo_loss(lp, old, adv, m, w, clip_high=0.28, dual_clip=3.0),
        lambda lp, old, ref, adv, w, m: ppo_per_token64(lp, old, adv, m, clip_high=0.28, dual_clip=3.0, weights=w),
        token_mean64),
    "gspo": (lambda lp, old, ref, adv, w, m: ppo_loss(lp, old, adv, m, ratio_level="sequence"),
             lambda lp, old, ref, adv, w, m: ppo_per_token64(lp, old, adv, m, level="sequence"), token_mean64),
    "grpo k3": (lambda lp, old, ref, adv, w, m: grpo_loss(lp, old, adv, m, ref, kl_coef=0.04),
                lambda lp, old, ref, adv, w, m: grpo_per_token64(lp, old, adv, m, ref, kl_coef=0.04), token_mean64),
    "grpo k3 straight-through": (
        lambda lp, old, ref, adv, w, m: grpo_loss(lp, old, adv, m, ref, kl_coef=0.04, kl_gradient="straight-through"),
        lambda lp, old, ref, adv, w, m: grpo_per_token64(lp, old, adv, m, ref, 0.04, "straight-through"), token_mean64),
    "grpo k3 bias-corrected": (
        lambda lp, old, ref, adv, w, m: grpo_loss(lp, old, adv, m, ref, kl_coef=0.04, kl_gradient="bias-corrected"),
        lambda lp, old, ref, adv, w, m: grpo_per_token64(lp, old, adv, m, ref, 0.04, "bias-corrected"), token_mean64),
    "cispo": (lambda lp, old, ref, adv, w, m: cispo_loss(lp, old, adv, m, clip_low=1.0, clip_high=0.2),
              lambda lp, old, ref, adv, w, m: cispo_per_token64(lp, old, adv, m, 1.0, 0.2), token_mean64),
    "sapo": (lambda lp, old, ref, adv, w, m: sapo_loss(lp, old, adv, m, tau_pos=1.0, tau_neg=1.05),
             lambda lp, old, ref, adv, w, m: sapo_per_token64(lp, old, adv, m, 1.0, 1.05), token_mean64),
    "gmpo": (lambda lp, old, ref, adv, w, m: gmpo_loss(lp, old, adv, m, clip_low=0.4, clip_high=0.4),
             lambda lp, old, ref, adv, w, m: gmpo_per_row64(lp, old, adv, m, 0.4, 0.4), row_mean64),
    # every token selected: no ranking of float32 covariances that float64 could order otherwise
    "kl_cov": (lambda lp, old, ref, adv, w, m: kl_cov_loss(lp, old, adv, m, select_frac=1.0, kl_coef=0.7),
               lambda lp, old, ref, adv, w, m: kl_cov_all_selected_per_token64(lp, old, adv, m, 0.7), token_mean64),
}


@given(name=st.sampled_from(sorted(EXTREME_LOSSES)), B=st.integers(1, 5), T=st.integers(1, 8),
       seed=st.integers(0, 10_000), token_adv=st.booleans())
@SETTINGS
def test_losses_at_log_ratios_of_50_match_the_float64_equations(name, B, T, seed, token_adv):
    # Value and gradient of each loss, float32 inputs, against its equation in float64
    # with the documented clamp. The tolerance is float32's: a log-ratio near 20 carries an
    # absolute rounding of ~2e-6 (its ulp), so the ratio a relative one of ~2e-6, and a GSPO
    # row mean adds the rounding of T of them; the loss, a sum of terms of either sign up to
    # |A| exp(20), is compared relative to the same reduction of the terms' magnitudes. A
    # missed clamp is off by up to exp(30) = 1e13, a lost gradient by all of it.
    lp, old, ref, adv, w, mask = _extreme_data(B, T, seed, token_adv)
    ours, per_token, reduce = EXTREME_LOSSES[name]
    loss, grad, metrics = _grad(ours, lp, old, ref, adv, w, mask)
    lp64 = lp.double().requires_grad_()
    terms = per_token(lp64, old.double(), ref.double(), adv.double(), w.double(), mask)
    want = reduce(terms, mask)
    (want_grad,) = torch.autograd.grad(want, lp64)
    magnitude = reduce(terms.detach().abs(), mask).item()
    assert abs(loss.item() - want.item()) <= 5e-5 * magnitude + 1e-7, (loss.item(), want.item())
    # SAPO's gate derivative is sigmoid's backward, s (1 - s) from s: once s nears 1 (ratio
    # >~ 10) 1 - s keeps float32's absolute precision at 1 (1.2e-7), not a relative one, so
    # its gradient -A 4 s (1 - s) ratio / N is exact to ~5e-7 ratio |A| / N (see sapo_loss's
    # Note); where that gradient is not ~0 the ratio is < 20: within 1e-5 |A| / N.
    atol = 1e-5 * adv.abs().max().item() / max(int(mask.sum()), 1) if name == "sapo" else 1e-7
    torch.testing.assert_close(grad.double(), want_grad, rtol=5e-5, atol=atol)
    assert all(torch.isfinite(v) for v in metrics.values())


@given(B=st.integers(1, 5), T=st.integers(1, 8), seed=st.integers(0, 10_000), dual_clip=st.sampled_from([None, 3.0]))
@SETTINGS
def test_ppo_metrics_at_log_ratios_of_50_are_those_of_the_clamped_ratio(B, T, seed, dual_clip):
    # The metrics describe the ratio the loss used: exp of the log-ratio clamped at +-20.
    lp, old, _, adv, _, mask = _extreme_data(B, T, seed, token_adv=False)
    _, metrics = ppo_loss(lp, old, adv, mask, dual_clip=dual_clip)
    clamped = old + (lp - old).clamp(-20.0, 20.0)
    for key, value in ppo_metrics_ref(clamped, old, adv, mask, 0.2, None, dual_clip).items():
        assert metrics[key].item() == pytest.approx(value, rel=5e-5, abs=1e-6), key


# --- torch.compile ----------------------------------------------------------------------

def test_every_loss_compiles_fullgraph_and_matches_eager():
    # Dynamo with fullgraph=True raises on any graph break; aot_eager also traces the
    # backward (incl. the custom autograd.Function) without inductor's code generation.
    import torch._dynamo
    torch._dynamo.reset()
    lp, old, adv, mask = _data(4, 6, seed=13)
    ref, w = old - 0.1, torch.rand(4, 6)
    calls = {
        "policy_ratio": lambda x: (policy_ratio(x, old, mask, level="sequence"), {}),
        "ppo": lambda x: ppo_loss(x, old, adv, mask, w, dual_clip=3.0, clip_high=0.28),
        "ppo_seq": lambda x: ppo_loss(x, old, adv, mask, ratio_level="sequence",
                                      aggregation="seq-mean-token-mean"),
        "grpo": lambda x: grpo_loss(x, old, adv, mask, ref, kl_coef=0.1,
                                    aggregation=Aggregation("seq-mean-token-sum-norm", num_sequences=4)),
        "reinforce": lambda x: reinforce_loss(x, adv, mask),
        "cispo": lambda x: cispo_loss(x, old, adv, mask, clip_low=1.0, clip_high=0.2),
        "value": lambda x: value_loss(x, old, ref, mask),
    }
    for name, call in calls.items():
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        x1, x2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        out1, m1 = call(x1)
        out2, m2 = compiled(x2)
        out1.sum().backward(); out2.sum().backward()
        torch.testing.assert_close(out2, out1, msg=name)
        torch.testing.assert_close(x2.grad, x1.grad, msg=name)
        for key in m1:
            torch.testing.assert_close(m2[key], m1[key], msg=f"{name} {key}")


@pytest.mark.slow  # about 25 s of inductor compilation on 2 cores
def test_ppo_loss_compiles_with_inductor():
    import torch._dynamo
    torch._dynamo.reset()
    lp, old, adv, mask = _data(8, 16, seed=14)
    fn = lambda x: ppo_loss(x, old, adv, mask, dual_clip=3.0)
    compiled = torch.compile(fn, fullgraph=True)
    x1, x2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    (l1, m1), (l2, m2) = fn(x1), compiled(x2)
    l1.backward(); l2.backward()
    torch.testing.assert_close(l2, l1)
    torch.testing.assert_close(x2.grad, x1.grad)
    for key in m1:
        torch.testing.assert_close(m2[key], m1[key])


@pytest.mark.parametrize("name", ["ppo_loss", "grpo_loss", "reinforce_loss", "cispo_loss"])
def test_advantages_are_a_target_and_get_no_gradient(name):
    import torchforge as L

    lp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    adv = torch.tensor([1.5], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    if name == "reinforce_loss":
        loss, _ = L.reinforce_loss(lp, adv, mask)
    elif name == "cispo_loss":
        loss, _ = L.cispo_loss(lp, lp.detach(), adv, mask, clip_low=0.2, clip_high=0.2)
    else:
        loss, _ = getattr(L, name)(lp, lp.detach(), adv, mask)
    loss.backward()
    assert adv.grad is None
    torch.testing.assert_close(lp.grad, torch.full((1, 2), -0.75))  # -A / N on-policy


# --- empty inputs (B = 0, T = 0) --------------------------------------------------------

@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_empty_batch_gives_zero_loss_zero_gradient_finite_metrics(name, shape, mode):
    # Regression: B = 0 or T = 0 raised "aminmax(): ... empty dimension".
    # (seq-mean-token-sum-norm gets an explicit length: its default, T, is 0 here.)
    B, T = shape
    lp = torch.zeros(B, T)
    loss, grad, metrics = _grad(_all_losses()(B, T)[name], lp, torch.zeros(B, T, dtype=torch.bool),
                                aggregation=Aggregation(mode, norm_length=8))
    assert loss.item() == 0 and grad.shape == (B, T)
    for key, value in metrics.items():
        assert torch.isfinite(value) and value.item() == 0, key


# --- the KL term of grpo_loss ------------------------------------------------------------

def _kl_term_grad(lp, old, ref, mask, coef, **kwargs):
    """Gradient of grpo_loss's KL term alone (advantages 0, so the surrogate adds nothing)."""
    lp = lp.clone().requires_grad_()
    loss, _ = grpo_loss(lp, old, torch.zeros(lp.shape[0]), mask, ref, kl_coef=coef, **kwargs)
    loss.backward()
    return lp.grad


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_grpo_kl_gradient_forms_match_their_formulas(estimator):
    # x = lp - ref; N counted tokens, token-mean, coef c:
    #   estimator:        c * d k / d x / N
    #   straight-through: c * x / N                      (the gradient of k2)
    #   bias-corrected:   c * (d k / d x * rho + k * rho) / N with rho = exp(lp - old)
    # (k3 as written holds where ref / pi <= 2, i.e. lp - ref >= -log 2: asserted below.)
    g = torch.Generator().manual_seed(5)
    lp = -torch.rand(3, 4, generator=g); ref = lp + 0.3 * torch.randn(3, 4, generator=g)
    assert (lp - ref).min() > -math.log(2)
    old = lp + 0.1 * torch.randn(3, 4, generator=g)
    mask = torch.rand(3, 4, generator=g) < 0.8
    N, c = mask.sum(), 0.3
    x = (lp - ref).double()
    dk = {"k1": torch.ones_like(x), "k2": x, "k3": 1 - torch.exp(-x), "abs": torch.sign(x)}[estimator]
    k = {"k1": x, "k2": x**2 / 2, "k3": torch.exp(-x) - 1 + x, "abs": x.abs()}[estimator]
    rho = torch.exp((lp - old).double())
    expected = {
        "estimator": c * dk / N,
        "straight-through": c * x / N,
        "bias-corrected": c * (dk * rho + k * rho) / N,
    }
    for form, want in expected.items():
        got = _kl_term_grad(lp, old, ref, mask, c, kl_estimator=estimator, kl_gradient=form)
        torch.testing.assert_close(got.double(), torch.where(mask, want, 0.0), rtol=1e-5, atol=1e-7, msg=form)


def test_grpo_bias_corrected_kl_value_is_k3_times_ratio():
    lp = torch.tensor([[-1.0, -2.0]]); old = torch.tensor([[-1.5, -2.0]]); ref = torch.tensor([[-1.2, -1.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, m = grpo_loss(lp, old, torch.zeros(1), mask, ref, kl_coef=1.0, kl_gradient="bias-corrected")
    x = torch.tensor([0.2, -0.5])  # ref / pi <= 2: k3 as written
    k3 = torch.exp(-x) - 1 + x
    expected = (k3 * torch.exp(torch.tensor([0.5, 0.0]))).mean()
    assert m["kl"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_grpo_kl_gradient_at_extremes_is_within_2x_of_verl_low_var_kl():
    # 256 tokens near the reference (|lp - ref| ~ 0.1) and 3 tokens 3, 5.5 and 8 nats
    # below it; coefficient 0.04, token-mean. verl's low_var_kl clamps k3 at 10, so those
    # three get no gradient there; unbounded k3 would give them ~3000 (a norm 1,500x
    # verl's); the bounded k3 gives each at most 1.
    g = torch.Generator().manual_seed(0)
    ref = -torch.rand(1, 256, generator=g) * 2
    lp = ref + 0.1 * torch.randn(1, 256, generator=g)
    lp[0, [10, 100, 200]] = ref[0, [10, 100, 200]] - torch.tensor([3.0, 5.5, 8.0])
    mask = torch.ones(1, 256, dtype=torch.bool)
    ours = _kl_term_grad(lp, lp, ref, mask, 0.04)
    x = lp.clone().requires_grad_()
    (0.04 * verl_low_var_kl_ref(x, ref).mean()).backward()
    ratio = ours.norm() / x.grad.norm()
    assert 0.5 <= ratio <= 2.0, ratio
    assert torch.all(ours[0, [10, 100, 200]] != 0)  # no cliff: the drifted tokens keep a gradient
    # where verl does not clamp (|lp - ref| small), the two agree exactly
    near = torch.ones(256, dtype=torch.bool); near[[10, 100, 200]] = False
    torch.testing.assert_close(ours[0, near], x.grad[0, near], rtol=1e-5, atol=1e-9)


def test_grpo_kl_bad_inputs():
    lp, old, adv, mask = _data(2, 3)
    with pytest.raises(InvalidArgumentError, match="grpo_loss: kl_gradient is 'k2'; expected one of 'estimator'"):
        grpo_loss(lp, old, adv, mask, old, kl_coef=0.1, kl_gradient="k2")


def test_new_losses_compile_fullgraph_and_match_eager():
    import torch._dynamo
    torch._dynamo.reset()
    lp, old, adv, mask = _data(4, 6, seed=13)
    calls = {
        "sapo": lambda x: sapo_loss(x, old, adv, mask),
        "gmpo": lambda x: gmpo_loss(x, old, adv, mask),
        "kl_cov": lambda x: kl_cov_loss(x, old, adv, mask, select_frac=0.2),
        "grpo_bc": lambda x: grpo_loss(x, old, adv, mask, old - 0.1, kl_coef=0.1, kl_gradient="bias-corrected"),
    }
    for name, call in calls.items():
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        x1, x2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        (out1, m1), (out2, m2) = call(x1), compiled(x2)
        out1.backward(); out2.backward()
        torch.testing.assert_close(out2, out1, msg=name)
        torch.testing.assert_close(x2.grad, x1.grad, msg=name)
        for key in m1:
            torch.testing.assert_close(m2[key], m1[key], msg=f"{name} {key}")

