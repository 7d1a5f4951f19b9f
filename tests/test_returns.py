"""Tests for torchforge.returns: discounted returns, GAE, REINFORCE++, ReMax, KL-shaped rewards."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tests._losses_common import _check_compiled, _close, _random_tokens
from tests.reference import discounted_returns_ref, gae_ref, remax_advantages_ref
from torchforge.batch import Batch
from torchforge.errors import DTypeError, InvalidArgumentError, ShapeError, TorchforgeError
from torchforge.kl import approx_kl
from torchforge.reduce import masked_whiten
from torchforge.returns import (
    discounted_returns,
    gae,
    kl_penalized_rewards,
    reinforce_pp_advantages,
    remax_advantages,
)

NAN = float("nan")


# --- discounted_returns -------------------------------------------------------------------

def test_discounted_returns_hand_derived():
    # counted t = 0, 2, 3 (t=1 a tool token): token rewards 1, -, 2, 4; gamma = 0.5
    # R3 = 4, R2 = 2 + 0.5 * 4 = 4, R0 = 1 + 0.5 * 4 = 3; reward 99 at t=1 and NaN at t=4 ignored
    rewards = torch.tensor([[1.0, 99.0, 2.0, 4.0, NAN]])
    mask = torch.tensor([[True, False, True, True, False]])
    out = discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[3.0, 0.0, 4.0, 4.0, 0.0]]))
    # sequence reward on the last counted token (t=3): 1, then 0.5, 0.25 going back
    out = discounted_returns(torch.tensor([1.0]), mask, gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[0.25, 0.0, 0.5, 1.0, 0.0]]))


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(0, 140), seed=st.integers(0, 2**16),
       gamma=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]), seq=st.booleans(), p=st.sampled_from([0.3, 0.8, 1.0]))
def test_discounted_returns_matches_reference(B, T, seed, gamma, seq, p):
    rewards, _, mask = _random_tokens(B, T, seed, p)
    if seq:
        rewards = torch.randn(B, generator=torch.Generator().manual_seed(seed + 1))
    out = discounted_returns(rewards, mask, gamma=gamma)
    _close(out, discounted_returns_ref(rewards, mask, gamma))


def test_discounted_returns_bad_inputs():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ShapeError, match=r"discounted_returns: rewards has shape \(2, 4\) but mask has shape \(2, 3\)"):
        discounted_returns(torch.zeros(2, 4), mask)
    with pytest.raises(ShapeError, match=r"discounted_returns: rewards has shape \(3,\) but mask has shape \(2, 3\)"):
        discounted_returns(torch.zeros(3), mask)
    with pytest.raises(DTypeError, match="discounted_returns: mask has dtype torch.float32"):
        discounted_returns(torch.zeros(2, 3), mask.float())
    with pytest.raises(InvalidArgumentError, match=r"discounted_returns: gamma must be a float in \[0, 1\], got 1.5"):
        discounted_returns(torch.zeros(2, 3), mask, gamma=1.5)


# --- gae ----------------------------------------------------------------------------------

def test_gae_hand_derived():
    # counted t = 0, 2 (t=1 tool token, t=3 padding); gamma = 0.9, lam = 0.5
    # delta2 = r2 + 0 - V2 = 1 - 0.5 = 0.5 -> A2 = 0.5
    # delta0 = r0 + 0.9 * V2 - V0 = 0 + 0.45 - 0.2 = 0.25 -> A0 = 0.25 + 0.45 * 0.5 = 0.475
    rewards = torch.tensor([[0.0, 5.0, 1.0, NAN]])
    values = torch.tensor([[0.2, NAN, 0.5, 7.0]])
    mask = torch.tensor([[True, False, True, False]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.475, 0.0, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.675, 0.0, 1.0, 0.0]]))


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(0, 300), seed=st.integers(0, 2**16),
       gamma=st.sampled_from([0.0, 0.5, 0.99, 1.0]), lam=st.sampled_from([0.0, 0.3, 0.95, 1.0]),
       p=st.sampled_from([0.2, 0.7, 1.0]))
def test_gae_matches_reference_any_mask(B, T, seed, gamma, lam, p):
    rewards, values, mask = _random_tokens(B, T, seed, p)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    adv_ref, ret_ref = gae_ref(rewards, values, mask, gamma, lam)
    _close(adv, adv_ref)
    _close(ret, ret_ref)


@pytest.mark.parametrize("T", [1000, 4096])
def test_gae_long_sequences_match_reference(T):
    rewards, values, mask = _random_tokens(2, T, seed=T, p_keep=0.9)
    rewards = rewards * 0.1
    for gamma, lam in [(1.0, 1.0), (1.0, 0.95), (0.999, 0.999)]:
        adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
        adv_ref, ret_ref = gae_ref(rewards, values, mask, gamma, lam)
        _close(adv, adv_ref)
        _close(ret, ret_ref)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 80), seed=st.integers(0, 2**16), gamma=st.sampled_from([0.5, 0.9, 1.0]))
def test_gae_lambda_one_is_returns_minus_values(B, T, seed, gamma):
    rewards, values, mask = _random_tokens(B, T, seed)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=1.0)
    expected = discounted_returns(rewards, mask, gamma=gamma)
    _close(ret, expected)
    _close(adv, torch.where(mask, expected - values, 0.0))


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_gae_zero_values_is_reward_to_go(B, T, seed):
    rewards, _, mask = _random_tokens(B, T, seed)
    adv, ret = gae(rewards, torch.zeros(B, T), mask, gamma=1.0, lam=1.0)
    to_go = torch.stack([torch.where(mask[b], rewards[b], 0.0).flip(0).cumsum(0).flip(0) for b in range(B)])
    _close(adv, torch.where(mask, to_go, 0.0))
    _close(ret, adv)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_gae_ignores_masked_positions(B, T, seed):
    rewards, values, mask = _random_tokens(B, T, seed, p_keep=0.6)
    adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    junk = torch.randn(B, T) * 100
    junk[:, ::3] = NAN
    adv2, ret2 = gae(torch.where(mask, rewards, junk), torch.where(mask, values, -junk), mask, gamma=0.99, lam=0.95)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(0, 70), seed=st.integers(0, 2**16), holes=st.booleans())
def test_right_padded_check_reads_the_mask_as_defined(B, T, seed, holes):
    # the int64-word check against its definition: no masked token before a counted one
    import torchforge.returns as returns

    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.randint(0, T + 1, (B, 1), generator=g)
    if holes:
        mask = mask ^ (torch.rand(B, T, generator=g) < 0.05)
    defined = T > 0 and T % 8 == 0 and not bool((mask[:, 1:] & ~mask[:, :-1]).any())
    assert returns._right_padded(mask) == defined


@pytest.mark.parametrize("T", [8, 64, 1000, 4096])
def test_gae_on_right_padded_rows_equals_the_compacted_path_bitwise(T, monkeypatch):
    # right-padded rows skip the compaction; forcing it gives the very same floats
    import torchforge.returns as returns

    g = torch.Generator().manual_seed(T)
    rewards, values = torch.randn(6, T, generator=g), torch.randn(6, T, generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor([[0], [1], [T // 3], [T // 2], [T - 1], [T]])
    assert returns._right_padded(mask)
    fast = [gae(rewards, values, mask, gamma=0.99, lam=0.95), gae(rewards[:, -1], values, mask, gamma=1.0, lam=1.0),
            discounted_returns(rewards, mask, gamma=0.9)]
    monkeypatch.setattr(returns, "_right_padded", lambda mask: False)
    slow = [gae(rewards, values, mask, gamma=0.99, lam=0.95), gae(rewards[:, -1], values, mask, gamma=1.0, lam=1.0),
            discounted_returns(rewards, mask, gamma=0.9)]
    for a, b in zip(fast, slow):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y)
    adv_ref, ret_ref = gae_ref(rewards, values, mask, 0.99, 0.95)
    _close(fast[0][0], adv_ref)
    _close(fast[0][1], ret_ref)


def test_gae_masked_equals_sliced():
    # A row with gaps equals the same row with the masked tokens cut out.
    rewards, values, mask = _random_tokens(1, 50, seed=3, p_keep=0.6)
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    keep = mask[0]
    adv_s, ret_s = gae(rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum()), dtype=torch.bool),
                       gamma=0.97, lam=0.9)
    torch.testing.assert_close(adv[:, keep], adv_s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret[:, keep], ret_s, rtol=1e-6, atol=1e-6)


def test_gae_empty_mask_and_sequence_rewards():
    adv, ret = gae(torch.full((2, 5), NAN), torch.full((2, 5), NAN), torch.zeros(2, 5, dtype=torch.bool))
    assert torch.equal(adv, torch.zeros(2, 5)) and torch.equal(ret, torch.zeros(2, 5))
    _, values, mask = _random_tokens(3, 20, seed=1)
    seq = torch.tensor([1.0, -2.0, 0.5])
    adv, ret = gae(seq, values, mask, gamma=0.99, lam=0.95)
    token = torch.zeros(3, 20)
    last = mask.cumsum(-1).argmax(-1)  # first index reaching the row's count: the last counted token
    token[torch.arange(3), last] = seq
    adv_ref, ret_ref = gae_ref(token, values, mask, 0.99, 0.95)
    _close(adv, adv_ref)
    _close(ret, ret_ref)


def test_gae_bf16_batch_and_no_grad():
    rewards, values, mask = _random_tokens(3, 17, seed=2)
    values = values.bfloat16().requires_grad_()
    adv, ret = gae(rewards.bfloat16(), values, mask)
    assert adv.dtype == ret.dtype == torch.float32 and not adv.requires_grad
    adv_ref, _ = gae_ref(rewards.bfloat16().float(), values.detach().float(), mask, 1.0, 0.95)
    _close(adv, adv_ref)
    batch = Batch(rewards=rewards, values=values.detach().float(), mask=mask, batch_size=[3])
    out = gae(batch, gamma=1.0, lam=0.95)
    expected = gae(rewards, values.detach().float(), mask)
    torch.testing.assert_close(out[0], expected[0])
    td = TensorDict({"rewards": rewards, "values": values.detach().float(), "mask": mask}, batch_size=[3])
    torch.testing.assert_close(gae(td)[1], expected[1])


def test_gae_bad_inputs():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ShapeError, match=r"gae: values has shape \(2, 4\) but mask has shape \(2, 3\)"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), mask)
    with pytest.raises(ShapeError, match=r"gae: mask has shape \(3,\); expected 2 dimensions"):
        gae(torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(DTypeError, match="gae: mask has dtype torch.int64"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), mask.long())
    with pytest.raises(InvalidArgumentError, match=r"gae: lam must be a float in \[0, 1\], got -0.1"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), mask, lam=-0.1)
    with pytest.raises(ShapeError, match=r"gae: rewards has shape \(2, 3, 1\); expected 1 or 2 dimensions"):
        gae(torch.zeros(2, 3, 1), torch.zeros(2, 3), mask)


# --- reinforce_pp_advantages --------------------------------------------------------------

def test_reinforce_pp_hand_derived():
    # returns with gamma=1: row 0 [1, 1], row 1 [0, 0]; mean 0.5, unbiased var 1/3
    # -> +-0.5 / sqrt(1/3) = +-0.8660
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask)
    torch.testing.assert_close(adv, torch.tensor([[0.8660254, 0.8660254], [-0.8660254, -0.8660254]]))


def test_reinforce_pp_matches_composition():
    rewards, _, mask = _random_tokens(6, 30, seed=5)
    seq = torch.randn(6)
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.9)
    ref = masked_whiten(discounted_returns_ref(rewards, mask, 0.9).float(), mask)
    _close(adv, ref)
    # baseline variant: group mean of the sequence rewards subtracted first
    adv = reinforce_pp_advantages(seq, mask, gamma=0.9, group_size=3)
    centered = seq - seq.view(2, 3).mean(-1).repeat_interleave(3)
    ref = masked_whiten(discounted_returns_ref(centered, mask, 0.9).float(), mask)
    _close(adv, ref)
    with pytest.raises(ShapeError, match=r"reinforce_pp_advantages: with groups \(group_size / group_ids\), rewards must be \[B\]"):
        reinforce_pp_advantages(rewards, mask, group_size=3)
    with pytest.raises(ShapeError, match=r"reinforce_pp_advantages: rewards has shape \(6,\), not a multiple of group_size=4"):
        reinforce_pp_advantages(seq, mask, group_size=4)


# --- kl_penalized_rewards -----------------------------------------------------------------

def test_kl_penalized_rewards_bad_inputs_name_it():
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ShapeError, match=r"kl_penalized_rewards: ref_log_probs has shape \(2, 4\)"):
        kl_penalized_rewards(torch.zeros(2), lp, torch.zeros(2, 4), mask, kl_coef=0.1)
    with pytest.raises(InvalidArgumentError, match="kl_penalized_rewards: estimator is 'k5'"):
        kl_penalized_rewards(torch.zeros(2), lp, lp, mask, kl_coef=0.1, estimator="k5")
    with pytest.raises(InvalidArgumentError, match="kl_penalized_rewards: kl_coef must be finite and >= 0, got inf"):
        kl_penalized_rewards(torch.zeros(2), lp, lp, mask, kl_coef=float("inf"))
    with pytest.raises(TorchforgeError, match="kl_penalized_rewards: rewards must be a torch.Tensor, got list"):
        kl_penalized_rewards([1.0, 2.0], lp, lp, mask, kl_coef=0.1)
    with pytest.raises(TorchforgeError, match="gae: rewards must be a torch.Tensor, got list"):
        gae([1.0, 2.0], lp, mask)


def test_kl_penalized_rewards_hand_derived_and_reference():
    # k1 = log_probs - ref = 0.5 at t=0, 0 at t=1; reward 1 on t=1 (last counted); t=2 masked
    lp = torch.tensor([[-1.0, -1.0, NAN]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    out = kl_penalized_rewards(torch.tensor([1.0]), lp, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.0, 0.0]]))
    _, lp, mask = _random_tokens(4, 12, seed=9)
    ref = lp + 0.3 * torch.randn(4, 12)
    seq = torch.randn(4)
    lp.requires_grad_()
    for estimator in ("k1", "k3"):
        out = kl_penalized_rewards(seq, lp, ref, mask, kl_coef=0.2, estimator=estimator)
        assert not out.requires_grad
        token = discounted_returns(seq, mask, gamma=0.0)  # the reward on the last counted token only
        expected = torch.where(mask, token - 0.2 * approx_kl(lp.detach(), ref, estimator=estimator), 0.0)
        torch.testing.assert_close(out, expected)
    with pytest.raises(InvalidArgumentError, match="kl_penalized_rewards: kl_coef must be >= 0, got -1"):
        kl_penalized_rewards(seq, lp, ref, mask, kl_coef=-1)
    with pytest.raises(ShapeError, match=r"kl_penalized_rewards: log_probs has shape \(4, 11\) but mask has shape \(4, 12\)"):
        kl_penalized_rewards(seq, lp[:, :11], ref, mask, kl_coef=0.1)


# --- torch.compile ------------------------------------------------------------------------

def _compile_cases(B=8, T=37):
    rewards, values, mask = _random_tokens(B, T, seed=11)
    seq = torch.randn(B)
    seq[1] = NAN
    lp, ref = torch.randn(B, T), torch.randn(B, T)
    return [
        (discounted_returns, (rewards, mask), dict(gamma=0.9)),
        (reinforce_pp_advantages, (seq.nan_to_num(), mask), dict(group_size=4)),
        (kl_penalized_rewards, (seq.nan_to_num(), lp, ref, mask), dict(kl_coef=0.1)),
        (gae, (rewards, values, mask), dict(gamma=0.99, lam=0.95)),
        (gae, (seq.nan_to_num(), values, mask), dict(gamma=1.0, lam=1.0)),
        (remax_advantages, (seq, seq.flip(0), mask), {}),
    ]


def test_compiles_fullgraph_without_graph_breaks():
    # the second shape makes dynamo retrace with dynamic shapes: that path must not break either
    _check_compiled(_compile_cases() + _compile_cases(12, 70), "aot_eager")


@pytest.mark.slow
def test_compiles_fullgraph_inductor():
    _check_compiled(_compile_cases() + _compile_cases(12, 70), "inductor")


# --- group_ids (REINFORCE++-baseline) -------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 6), G=st.integers(2, 6), seed=st.integers(0, 2**16), far_ids=st.booleans())
def test_reinforce_pp_group_ids_on_a_permuted_batch_equal_contiguous_groups(groups, G, seed, far_ids):
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    r = torch.randint(0, 4, (B,), generator=g).float() / 3
    r[torch.rand(B, generator=g) < 0.15] = NAN
    mask = torch.rand(B, 5, generator=g) < 0.7
    ids = torch.arange(groups).repeat_interleave(G)
    if far_ids:  # ids outside [0, B): the torch.unique path
        ids = ids * 1000 - 7
    perm = torch.randperm(B, generator=g)
    expected = reinforce_pp_advantages(r.nan_to_num(0.0), mask, group_size=G)[perm]
    got = reinforce_pp_advantages(r.nan_to_num(0.0)[perm], mask[perm], group_ids=ids[perm])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_reinforce_pp_group_ids_bad_inputs():
    r = torch.zeros(4)
    with pytest.raises(ShapeError, match=r"reinforce_pp_advantages: group_ids has shape \(2, 2\)"):
        reinforce_pp_advantages(r, torch.ones(4, 2, dtype=torch.bool), group_ids=torch.zeros(2, 2, dtype=torch.long))


# --- remax_advantages -------------------------------------------------------------------------

def test_remax_hand_derived_and_reference():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    out = remax_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.25, 0.5]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.75, 0.75, 0.0], [-0.5, -0.5, -0.5]]))
    rewards, _, mask = _random_tokens(5, 9, seed=3)
    base = torch.randn(5)
    base[2] = NAN
    _close(remax_advantages(rewards, base, mask), remax_advantages_ref(rewards, base, mask))
    seq = torch.randn(5)
    seq[0] = NAN
    out = remax_advantages(seq, base, mask)
    _close(out, remax_advantages_ref(seq, base, mask))
    assert out[0].eq(0).all() and out[2].eq(0).all()
    batch = Batch(rewards=seq, mask=mask, batch_size=[5])
    torch.testing.assert_close(remax_advantages(batch, baseline_rewards=base), out)


def test_remax_bad_inputs():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ShapeError, match=r"remax_advantages: baseline_rewards has shape \(3,\) but mask has shape \(2, 3\); expected \(2,\)"):
        remax_advantages(torch.zeros(2), torch.zeros(3), mask)
    with pytest.raises(ShapeError, match=r"remax_advantages: rewards has shape \(3,\) but mask has shape \(2, 3\)"):
        remax_advantages(torch.zeros(3), torch.zeros(2), mask)
    with pytest.raises(DTypeError, match="remax_advantages: baseline_rewards has dtype torch.int64"):
        remax_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), mask)


# --- empty batches ------------------------------------------------------------------------

def test_empty_batches():
    e, m = torch.zeros(0), torch.zeros(0, 5, dtype=torch.bool)
    assert remax_advantages(e, e, m).shape == (0, 5)
