"""Tests for torchforge.corrections: TIS weights, ratio masks, overlong penalty, zero-std groups."""


import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tests.reference import (
    high_entropy_mask_ref,
    overlong_penalty_ref,
    ratio_mask_ref,
    truncated_importance_weights_ref,
    zero_std_groups_ref,
)
from torchforge.batch import Batch
from torchforge.corrections import (
    CORRECTION_LEVELS,
    entropy_threshold,
    high_entropy_mask,
    overlong_penalty,
    ratio_mask,
    truncated_importance_weights,
    unscored_tokens,
    zero_std_groups,
)
from torchforge.errors import DTypeError, InvalidArgumentError, ShapeError, TorchforgeError
from torchforge.losses import ppo_loss

SETTINGS = settings(max_examples=30, deadline=None)
NAN = float("nan")


def _data(B=4, T=6, seed=0, spread=0.5, p_mask=0.7):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 3
    old = rollout + spread * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < p_mask
    return old, rollout, mask


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


# --- high-entropy tokens ----------------------------------------------------------------

def test_high_entropy_mask_hand_derived():
    # 5 counted entropies 0.1, 2.0, 0.3, 1.5, 0.2 (9.0 masked). quantile 0.4 keeps the top
    # 40%: sorted 0.1 0.2 0.3 1.5 2.0, tau = Q_0.6 at position 0.6 * 4 = 2.4:
    # 0.3 + 0.4 * (1.5 - 0.3) = 0.78 -> keeps 2.0 and 1.5.
    entropy = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    torch.testing.assert_close(entropy_threshold(entropy, mask, quantile=0.4), torch.tensor(0.78))
    assert high_entropy_mask(entropy, mask, quantile=0.4).tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert high_entropy_mask(entropy, mask, quantile=1.0).tolist() == mask.float().tolist()  # all counted
    # 1 - 0.2 = 0.8 -> position 3.2: 1.5 + 0.2 * 0.5 = 1.6 -> keeps 2.0 only
    assert high_entropy_mask(entropy, mask, quantile=0.2).tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    # a given threshold wins over this batch's
    assert high_entropy_mask(entropy, mask, quantile=0.2, threshold=0.25).tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    # empty: nothing kept, threshold 0
    none = torch.zeros_like(mask)
    assert high_entropy_mask(entropy, none, quantile=0.2).sum() == 0 and entropy_threshold(entropy, none, quantile=0.2) == 0
    assert high_entropy_mask(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), quantile=0.2).shape == (0, 3)
    # a NaN counted entropy: the order is unknown, so the threshold is NaN and nothing is kept, at any
    # quantile (sorted last, the NaN was read at 0.2 and skipped at 0.5); a NaN where masked changes nothing
    e = torch.tensor([[0.1, 0.2, 0.3, 0.4, float("nan")]])
    for quantile in (0.2, 0.5, 1.0):
        assert entropy_threshold(e, quantile=quantile).isnan()
        assert high_entropy_mask(e, torch.ones_like(e, dtype=torch.bool), quantile=quantile).sum() == 0
    counted = torch.tensor([[True, True, True, True, False]])
    torch.testing.assert_close(entropy_threshold(e, counted, quantile=0.5), torch.tensor(0.25))


@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       quantile=st.sampled_from([0.05, 0.2, 0.5, 0.8, 1.0]))
@SETTINGS
def test_high_entropy_mask_matches_reference_and_torch_quantile(B, T, seed, quantile):
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) < 0.7
    out = high_entropy_mask(entropy.masked_fill(~mask, NAN), mask, quantile=quantile)  # NaN outside never leaks
    assert out.dtype == torch.float32
    assert torch.equal(out.double(), high_entropy_mask_ref(entropy, mask, quantile))
    if mask.any():
        torch.testing.assert_close(entropy_threshold(entropy, mask, quantile=quantile),
                                   torch.quantile(entropy[mask], 1 - quantile), rtol=1e-6, atol=1e-6)
        kept = out.sum().item()
        assert kept >= math.floor(quantile * mask.sum().item())  # at least the top fraction (ties kept)


def test_high_entropy_mask_exact_across_micro_batches():
    # The threshold of the whole step, applied to each micro-batch, selects exactly what
    # one pass over the whole batch selects; each micro-batch's own threshold does not.
    g = torch.Generator().manual_seed(0)
    entropy = torch.cat([torch.rand(4, 8, generator=g), 3 + torch.rand(4, 8, generator=g)])  # second half higher
    mask = torch.rand(8, 8, generator=g) < 0.8
    whole = high_entropy_mask(entropy, mask, quantile=0.2)
    micro = [(entropy[:4], mask[:4]), (entropy[4:], mask[4:])]
    tau = entropy_threshold(torch.cat([e[m] for e, m in micro]), quantile=0.2)
    exact = torch.cat([high_entropy_mask(e, m, quantile=0.2, threshold=tau) for e, m in micro])
    assert torch.equal(exact, whole)
    local = torch.cat([high_entropy_mask(e, m, quantile=0.2) for e, m in micro])
    assert not torch.equal(local, whole)


def test_high_entropy_mask_bad_inputs():
    entropy, mask = torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool)
    for q in (0, 1.5, -0.1, True, "0.2"):
        with pytest.raises(InvalidArgumentError, match=r"high_entropy_mask: quantile must be a number in \(0, 1\]"):
            high_entropy_mask(entropy, mask, quantile=q)
    with pytest.raises(ShapeError, match=r"high_entropy_mask: mask has shape \(2, 2\) but entropy has shape \(2, 3\)"):
        high_entropy_mask(entropy, mask[:, :2], quantile=0.2)
    with pytest.raises(ShapeError, match=r"high_entropy_mask: threshold has shape \(2,\); expected a scalar"):
        high_entropy_mask(entropy, mask, quantile=0.2, threshold=torch.zeros(2))
    with pytest.raises(DTypeError, match="entropy_threshold: entropy has dtype torch.int64"):
        entropy_threshold(entropy.long(), quantile=0.2)
    with pytest.raises(InvalidArgumentError, match=r"entropy_threshold: quantile must be a number in \(0, 1\]"):
        entropy_threshold(entropy, quantile=0.0)


# --- overlong penalty -------------------------------------------------------------------

def test_overlong_penalty_hand_derived():
    # L_max = 20, L_cache = 4: free up to 16; at 18, -(18 - 16) / 4 = -0.5; at 20, -1; above, -1.
    out = overlong_penalty(torch.tensor([10, 16, 17, 18, 20, 25]), max_length=20, buffer_length=4, penalty=2.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0, -2.0]))
    hard = overlong_penalty(torch.tensor([20, 21]), max_length=20, buffer_length=0)
    torch.testing.assert_close(hard, torch.tensor([0.0, -1.0]))


@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=8), max_length=st.integers(1, 30),
       buffer=st.integers(0, 30), penalty=st.sampled_from([0.5, 1.0]))
@SETTINGS
def test_overlong_penalty_matches_reference(lengths, max_length, buffer, penalty):
    buffer = min(buffer, max_length)
    x = torch.tensor(lengths)
    out = overlong_penalty(x, max_length=max_length, buffer_length=buffer, penalty=penalty)
    if buffer == 0:
        expected = torch.tensor([-penalty if n > max_length else 0.0 for n in lengths])
    else:
        expected = overlong_penalty_ref(x, max_length, buffer, penalty)
    torch.testing.assert_close(out, expected.float())
    sorted_out = overlong_penalty(x.sort().values, max_length=max_length, buffer_length=buffer, penalty=penalty)
    assert torch.all(sorted_out[1:] <= sorted_out[:-1])


# --- zero-std groups --------------------------------------------------------------------

def test_zero_std_groups_hand_derived():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, NAN, NAN, 0.5, NAN, 0.5, 0.5])
    # groups of 3: all 1 -> True; (0, 1, 1) -> False; (NaN, NaN, 0.5) -> True (one value);
    # (NaN, 0.5, 0.5) -> True (NaN left out)
    assert zero_std_groups(r, group_size=3).tolist() == [True] * 3 + [False] * 3 + [True] * 3 + [True] * 3
    # Exact equality: 0.1 + 0.2 = 0.30000000000000004 != 0.3 in float64 (kept in float64).
    r2 = torch.tensor([0.1 + 0.2, 0.3, 0.3, 0.3], dtype=torch.float64)
    assert zero_std_groups(r2, group_size=2).tolist() == [False, False, True, True]


@given(G=st.integers(1, 4), groups=st.integers(1, 5), seed=st.integers(0, 10_000))
@SETTINGS
def test_zero_std_groups_matches_reference(G, groups, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 2, (groups * G,), generator=g).float()
    r[torch.rand(groups * G, generator=g) < 0.2] = NAN
    assert torch.equal(zero_std_groups(r, group_size=G), zero_std_groups_ref(r, G))


# --- shared -----------------------------------------------------------------------------

def test_bf16_inputs():
    old, rollout, mask = _data(seed=4)
    w = truncated_importance_weights(old.bfloat16(), rollout.bfloat16(), mask)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, truncated_importance_weights(old.bfloat16().float(), rollout.bfloat16().float(), mask))
    m = ratio_mask(old.bfloat16(), rollout.bfloat16(), mask, low=0.5, high=2.0)
    e = high_entropy_mask(old.abs().bfloat16(), mask, quantile=0.3)
    assert torch.equal(e, high_entropy_mask(old.abs().bfloat16().float(), mask, quantile=0.3))
    assert torch.equal(m, ratio_mask(old.bfloat16().float(), rollout.bfloat16().float(), mask, low=0.5, high=2.0))
    assert zero_std_groups(torch.ones(4, dtype=torch.bfloat16), group_size=2).all()


def test_batch_and_tensordict_calling():
    old, rollout, mask = _data(seed=5)
    batch = Batch(old_log_probs=old, rollout_log_probs=rollout, mask=mask, rewards=torch.arange(4.0), batch_size=[4])
    torch.testing.assert_close(truncated_importance_weights(batch), truncated_importance_weights(old, rollout, mask))
    td = batch.to_tensordict()
    assert torch.equal(ratio_mask(td, low=0.5, high=2.0), ratio_mask(old, rollout, mask, low=0.5, high=2.0))
    assert zero_std_groups(batch, group_size=2).tolist() == [False] * 4
    # "lengths" is no batch key: overlong_penalty takes the tensor (e.g. batch.mask.sum(-1))
    td2 = TensorDict(lengths=torch.tensor([1, 30]), batch_size=[2])
    with pytest.raises(TorchforgeError, match="overlong_penalty: lengths must be a torch.Tensor, got TensorDict"):
        overlong_penalty(td2, max_length=20, buffer_length=5)
    torch.testing.assert_close(overlong_penalty(td2["lengths"], max_length=20, buffer_length=5), torch.tensor([0.0, -1.0]))
    # entropy is no batch key either: the entropy filters take tensors
    with pytest.raises(TorchforgeError, match="high_entropy_mask: entropy must be a torch.Tensor, got"):
        high_entropy_mask(batch, mask, quantile=0.2)


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
    with pytest.raises(InvalidArgumentError, match="overlong_penalty: penalty must be finite and >= 0, got inf"):
        overlong_penalty(torch.tensor([5, 12]), max_length=10, buffer_length=2, penalty=float("inf"))
    with pytest.raises(InvalidArgumentError, match=r"overlong_penalty: buffer_length must be an int in \[0, max_length=10\], got 11"):
        overlong_penalty(torch.tensor([1]), max_length=10, buffer_length=11)
    with pytest.raises(ShapeError, match=r"overlong_penalty: lengths has shape \(2, 1\); expected 1 dimensions"):
        overlong_penalty(torch.ones(2, 1), max_length=10, buffer_length=2)
    with pytest.raises(ShapeError, match=r"zero_std_groups: rewards has shape \(5,\), not a multiple of group_size=2"):
        zero_std_groups(torch.ones(5), group_size=2)
    with pytest.raises(InvalidArgumentError, match="zero_std_groups: group_size must be an int >= 1, got 0"):
        zero_std_groups(torch.ones(4), group_size=0)
    with pytest.raises(DTypeError, match="zero_std_groups: rewards has dtype torch.int64"):
        zero_std_groups(torch.ones(4, dtype=torch.long), group_size=2)


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
        "high_entropy": lambda: high_entropy_mask(old.abs(), mask, quantile=0.2, threshold=0.5),
        "overlong": lambda: overlong_penalty(torch.tensor([3, 9, 12]), max_length=10, buffer_length=4),
        "zero_std": lambda: zero_std_groups(torch.tensor([1.0, 1.0, NAN, 2.0]), group_size=2),
    }
    for name, call in calls.items():
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(), call(), msg=name)
