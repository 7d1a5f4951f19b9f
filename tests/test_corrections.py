"""Tests for torchforge.corrections: TIS weights, ratio masks, overlong penalty, zero-std groups."""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tests.reference import (
    overlong_penalty_ref,
    ratio_mask_ref,
    truncated_importance_weights_ref,
    zero_std_groups_ref,
)
from torchforge.batch import Batch
from torchforge.corrections import overlong_penalty, ratio_mask, truncated_importance_weights, zero_std_groups
from torchforge.errors import DTypeError, InvalidArgumentError, ShapeError
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
    # ratios 2, 0.5, 4 (masked); cap 3: token weights 2, 0.5, 0; sequence: 2 * 0.5 = 1.
    old = torch.log(torch.tensor([[0.4, 0.1, 0.8]])); rollout = torch.log(torch.tensor([[0.2, 0.2, 0.2]]))
    mask = torch.tensor([[True, True, False]])
    torch.testing.assert_close(truncated_importance_weights(old, rollout, mask, cap=3.0),
                               torch.tensor([[2.0, 0.5, 0.0]]))
    torch.testing.assert_close(truncated_importance_weights(old, rollout, mask, cap=3.0, level="sequence"),
                               torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(truncated_importance_weights(old, rollout, mask, cap=1.5),
                               torch.tensor([[1.5, 0.5, 0.0]]))


@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       level=st.sampled_from(["token", "sequence"]), cap=st.sampled_from([0.5, 2.0, 10.0]))
@SETTINGS
def test_tis_matches_reference(B, T, seed, level, cap):
    old, rollout, mask = _data(B, T, seed)
    out = truncated_importance_weights(old, rollout, mask, level=level, cap=cap)
    torch.testing.assert_close(out.double(), truncated_importance_weights_ref(old, rollout, mask, level, cap),
                               rtol=1e-5, atol=1e-6)
    assert out.dtype == torch.float32 and (out <= cap).all() and (out >= 0).all()


def test_tis_detached_finite_and_nan_safe():
    old, rollout, mask = _data(seed=1)
    old = old.clone().requires_grad_()
    big = torch.where(mask, old * 100, NAN)  # huge log-ratios, NaN where masked
    w = truncated_importance_weights(big, rollout, mask, level="sequence", cap=2.0)
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
    # sequence level: geometric mean (9 * 1.125)^(1/3) = 2.16 > 2 -> drop the row; with the
    # middle token masked: (1.125)^(1/2) = 1.06 -> keep the two counted tokens.
    old = torch.log(torch.tensor([[0.9, 0.9, 0.9]])); rollout = torch.log(torch.tensor([[0.9, 0.1, 0.8]]))
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert ratio_mask(old, rollout, mask, low=0.5, high=2.0).tolist() == [[True, False, True]]
    assert ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence").tolist() == [[False] * 3]
    mask[0, 1] = False
    assert ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence").tolist() == [[True, False, True]]
    assert ratio_mask(old, rollout, mask, low=0.5, high=2.0) is not mask


@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       level=st.sampled_from(["token", "sequence"]), bounds=st.sampled_from([(0.5, 2.0), (0.0, 1.5), (0.9, 5.0)]))
@SETTINGS
def test_ratio_mask_matches_reference(B, T, seed, level, bounds):
    old, rollout, mask = _data(B, T, seed)
    out = ratio_mask(old, rollout, mask, low=bounds[0], high=bounds[1], level=level)
    assert out.dtype == torch.bool
    assert torch.equal(out, ratio_mask_ref(old, rollout, mask, *bounds, level))
    assert not (out & ~mask).any()  # only ever removes tokens


def test_ratio_mask_nan_at_masked_positions():
    old, rollout, mask = _data(seed=3)
    clean = ratio_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence")
    dirty = ratio_mask(torch.where(mask, old, NAN), torch.where(mask, rollout, NAN), mask,
                       low=0.5, high=2.0, level="sequence")
    assert torch.equal(clean, dirty)


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
    assert torch.equal(m, ratio_mask(old.bfloat16().float(), rollout.bfloat16().float(), mask, low=0.5, high=2.0))
    assert zero_std_groups(torch.ones(4, dtype=torch.bfloat16), group_size=2).all()


def test_batch_and_tensordict_calling():
    old, rollout, mask = _data(seed=5)
    batch = Batch(old_log_probs=old, rollout_log_probs=rollout, mask=mask, rewards=torch.arange(4.0), batch_size=[4])
    torch.testing.assert_close(truncated_importance_weights(batch), truncated_importance_weights(old, rollout, mask))
    td = batch.to_tensordict()
    assert torch.equal(ratio_mask(td, low=0.5, high=2.0), ratio_mask(old, rollout, mask, low=0.5, high=2.0))
    assert zero_std_groups(batch, group_size=2).tolist() == [False] * 4
    td2 = TensorDict(lengths=torch.tensor([1, 30]), batch_size=[2])
    torch.testing.assert_close(overlong_penalty(td2, max_length=20, buffer_length=5), torch.tensor([0.0, -1.0]))


def test_bad_inputs():
    old, rollout, mask = _data()
    with pytest.raises(ShapeError, match=r"truncated_importance_weights: rollout_log_probs has shape \(4, 5\) but old_log_probs has shape \(4, 6\)"):
        truncated_importance_weights(old, rollout[:, :5], mask)
    with pytest.raises(InvalidArgumentError, match="truncated_importance_weights: cap must be a finite number > 0, got 0"):
        truncated_importance_weights(old, rollout, mask, cap=0)
    with pytest.raises(InvalidArgumentError, match="truncated_importance_weights: level is 'geo'"):
        truncated_importance_weights(old, rollout, mask, level="geo")
    with pytest.raises(DTypeError, match="ratio_mask: mask has dtype torch.int64"):
        ratio_mask(old, rollout, mask.long(), low=0.5, high=2.0)
    with pytest.raises(InvalidArgumentError, match="ratio_mask: expected 0 <= low < high, got low=2.0, high=0.5"):
        ratio_mask(old, rollout, mask, low=2.0, high=0.5)
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
        "overlong": lambda: overlong_penalty(torch.tensor([3, 9, 12]), max_length=10, buffer_length=4),
        "zero_std": lambda: zero_std_groups(torch.tensor([1.0, 1.0, NAN, 2.0]), group_size=2),
    }
    for name, call in calls.items():
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(), call(), msg=name)
