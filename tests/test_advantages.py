"""Tests for torchforge.advantages: GRPO, RLOO, GDPO, Pass@k and OPO advantages, and zero-std groups."""

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tests._losses_common import _check_compiled, _close, _random_tokens
from tests.reference import (
    best_minus_second_advantages_ref,
    gdpo_advantages_ref,
    group_advantages_ref,
    opo_advantages_ref,
    passk_advantages_ref,
    rloo_advantages_ref,
    zero_std_groups_ref,
)
from torchforge.advantages import (
    best_minus_second_advantages,
    group_advantages,
    opo_advantages,
    passk_advantages,
    rloo_advantages,
    zero_std_groups,
)
from torchforge.batch import Batch
from torchforge.errors import (
    DTypeError,
    InvalidArgumentError,
    MissingKeyError,
    ShapeError,
)

NAN = float("nan")


# --- group_advantages ---------------------------------------------------------------------

def test_group_advantages_hand_derived():
    # group 1: [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> +-0.5 / 0.70711 = +-0.70711
    # group 2: [2, 2, ...] tied -> 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.5**0.5, -(0.5**0.5), 0.0, 0.0]), rtol=0, atol=1e-6)
    # scale="none": r - mean; "batch": std of [1, 0, 3, 5] = sqrt(14.75 / 3) = 2.2174
    r = torch.tensor([1.0, 0.0, 3.0, 5.0])
    torch.testing.assert_close(group_advantages(r, group_size=2, scale="none"), torch.tensor([0.5, -0.5, -1.0, 1.0]))
    std = math.sqrt(14.75 / 3)
    torch.testing.assert_close(
        group_advantages(r, group_size=2, scale="batch", eps=0.0),
        torch.tensor([0.5, -0.5, -1.0, 1.0]) / std, rtol=1e-6, atol=1e-6,
    )


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.1, 1e-3, 7.3, -0.3, 1e6])
def test_group_advantages_all_equal_is_exactly_zero(scale, value):
    # [0.1] * G has a float residue in mean/std; other libraries blow it up to ~1e3.
    G = 16
    rewards = torch.cat([torch.full((G,), value), torch.tensor([0.0, 1.0] * (G // 2))])
    adv = group_advantages(rewards, group_size=G, scale=scale, eps=1e-8)
    assert torch.equal(adv[:G], torch.zeros(G))
    assert torch.isfinite(adv).all() and adv[G:].abs().sum() > 0


def test_group_advantages_nan_rewards_are_left_out():
    # group [1, nan, 0, nan]: statistics of [1, 0] -> +-0.70711; NaN -> 0; all-NaN group -> 0
    rewards = torch.tensor([1.0, NAN, 0.0, NAN, NAN, NAN, NAN, NAN, 3.0, NAN, NAN, NAN])
    adv = group_advantages(rewards, group_size=4, eps=0.0)
    s = 0.5**0.5
    expected = torch.tensor([s, 0, -s, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    for scale in ("batch", "none"):
        assert torch.isfinite(group_advantages(rewards, group_size=4, scale=scale)).all()


@settings(max_examples=40, deadline=None)
@given(
    groups=st.integers(1, 6), G=st.integers(1, 8), scale=st.sampled_from(["group", "batch", "none"]),
    seed=st.integers(0, 2**16), nan_p=st.sampled_from([0.0, 0.3]), ties=st.booleans(),
)
def test_group_advantages_matches_reference(groups, G, scale, seed, nan_p, ties):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(groups * G, generator=g)
    if ties:
        rewards = rewards.round()  # many exactly-equal groups
    rewards[torch.rand(groups * G, generator=g) < nan_p] = NAN
    adv = group_advantages(rewards, group_size=G, scale=scale, eps=1e-6)
    _close(adv, group_advantages_ref(rewards, G, scale, 1e-6), rel=1e-5)


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 5), G=st.integers(2, 8), seed=st.integers(0, 2**16),
       scale=st.sampled_from(["group", "batch", "none"]))
def test_group_advantages_zero_mean_and_shift_invariant(groups, G, seed, scale):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(groups * G, generator=g)
    adv = group_advantages(rewards, group_size=G, scale=scale)
    torch.testing.assert_close(adv.view(groups, G).mean(-1), torch.zeros(groups), rtol=0, atol=1e-5)
    shift = torch.randn(groups, generator=g).repeat_interleave(G) * 3
    if scale != "batch":  # batch std mixes groups; per-group shifts change it
        torch.testing.assert_close(group_advantages(rewards + shift, group_size=G, scale=scale), adv,
                                   rtol=0, atol=1e-5)


def test_group_advantages_bf16_and_batch_calling():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.bfloat16)
    adv = group_advantages(rewards, group_size=2)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, group_advantages(rewards.float(), group_size=2))
    batch = Batch(rewards=rewards.float(), batch_size=[4])
    torch.testing.assert_close(group_advantages(batch, group_size=2), group_advantages(rewards.float(), group_size=2))
    td = TensorDict({"rewards": rewards.float()}, batch_size=[4])
    torch.testing.assert_close(rloo_advantages(td, group_size=2), rloo_advantages(rewards.float(), group_size=2))


def test_group_advantages_bad_inputs():
    with pytest.raises(ShapeError, match=r"group_advantages: rewards has shape \(10,\).*group_size=4"):
        group_advantages(torch.zeros(10), group_size=4)
    with pytest.raises(InvalidArgumentError, match="group_advantages: scale is 'std'"):
        group_advantages(torch.zeros(4), group_size=2, scale="std")
    with pytest.raises(InvalidArgumentError, match="group_advantages: group_size must be an int >= 1, got 0"):
        group_advantages(torch.zeros(4), group_size=0)
    with pytest.raises(ShapeError, match=r"group_advantages: rewards has shape \(2, 2, 1\); expected 1 or 2"):
        group_advantages(torch.zeros(2, 2, 1), group_size=2)
    with pytest.raises(DTypeError, match="group_advantages: rewards has dtype torch.int64"):
        group_advantages(torch.zeros(4, dtype=torch.long), group_size=2)
    with pytest.raises(InvalidArgumentError, match="group_advantages: eps must be >= 0"):
        group_advantages(torch.zeros(4), group_size=2, eps=-1.0)
    with pytest.raises(MissingKeyError, match="group_advantages: the batch has no key 'rewards'"):
        group_advantages(TensorDict({}, batch_size=[4]), group_size=2)


# --- rloo_advantages ----------------------------------------------------------------------

def test_rloo_hand_derived():
    # [3, 0, 0]: 3 - (0 + 0) / 2 = 3; 0 - (3 + 0) / 2 = -1.5.  [1, nan, 2]: 1 - 2 = -1, 2 - 1 = 1
    adv = rloo_advantages(torch.tensor([3.0, 0.0, 0.0, 1.0, NAN, 2.0]), group_size=3)
    torch.testing.assert_close(adv, torch.tensor([3.0, -1.5, -1.5, -1.0, 0.0, 1.0]))
    # all equal (float residue) and single valid reward -> exactly 0
    adv = rloo_advantages(torch.tensor([0.1, 0.1, 0.1, 5.0, NAN, NAN]), group_size=3)
    assert torch.equal(adv, torch.zeros(6))


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 5), G=st.integers(2, 8), seed=st.integers(0, 2**16), nan_p=st.sampled_from([0.0, 0.3]))
def test_rloo_matches_reference(groups, G, seed, nan_p):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(groups * G, generator=g)
    rewards[torch.rand(groups * G, generator=g) < nan_p] = NAN
    _close(rloo_advantages(rewards, group_size=G), rloo_advantages_ref(rewards, G))


def test_rloo_bad_inputs():
    with pytest.raises(InvalidArgumentError, match="rloo_advantages: group_size must be an int >= 2, got 1"):
        rloo_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ShapeError, match=r"rloo_advantages: rewards has shape \(5,\)"):
        rloo_advantages(torch.zeros(5), group_size=2)


# --- torch.compile ------------------------------------------------------------------------

def _compile_cases(B=8, T=37):
    _, _, mask = _random_tokens(B, T, seed=11)
    seq = torch.randn(B)
    seq[1] = NAN
    return [
        (group_advantages, (seq,), dict(group_size=4)),
        (group_advantages, (seq,), dict(group_size=4, scale="batch")),
        (rloo_advantages, (seq,), dict(group_size=4)),
        (opo_advantages, (seq, mask), dict(group_size=4)),
    ]


def test_compiles_fullgraph_without_graph_breaks():
    # the second shape makes dynamo retrace with dynamic shapes: that path must not break either
    _check_compiled(_compile_cases() + _compile_cases(12, 70), "aot_eager")


@pytest.mark.slow
def test_compiles_fullgraph_inductor():
    _check_compiled(_compile_cases() + _compile_cases(12, 70), "inductor")


# --- exact ties and offsets (every group estimator) ---------------------------------------

def test_tie_guard_is_exact_equality_not_a_relative_threshold():
    # 1000.0005 is 1000 + 2**-11 in float32: the groups differ, so the advantages are +-0.86,
    # those of the same rewards without the offset (a relative tie threshold gave zeros).
    r = torch.tensor([1000.0, 1000.0005, 1000.0, 1000.0005])
    adv = group_advantages(r, group_size=4)
    torch.testing.assert_close(adv, group_advantages(r - 1000, group_size=4), rtol=0, atol=1e-7)
    torch.testing.assert_close(adv, group_advantages(torch.tensor([0.0, 0.0005, 0.0, 0.0005]), group_size=4),
                               rtol=0, atol=1e-4)
    assert adv[1] > 0.86 and adv[0] < -0.86
    assert not zero_std_groups(r, group_size=4).any()
    # one float32 ulp apart at 1e4 is not a tie either; exactly equal is
    ulp = torch.tensor([1e4, 1e4]).nextafter(torch.tensor([2e4, 2e4]))
    assert (group_advantages(torch.stack([ulp[0], torch.tensor(1e4)]), group_size=2, eps=0.0).abs() > 0.7).all()
    assert group_advantages(torch.full((4,), 1e4), group_size=2, eps=0.0).eq(0).all()


_dyadic = st.integers(-1024, 1024).map(lambda i: i / 64)  # r + c is exact in float32 for |c| <= 1e4


@settings(max_examples=40, deadline=None)
@given(data=st.data(), groups=st.integers(1, 5), G=st.integers(1, 8), offset=st.integers(-10_000, 10_000),
       scale=st.sampled_from(["group", "batch", "none"]), nan=st.booleans())
def test_advantages_unchanged_by_a_constant_up_to_1e4(data, groups, G, offset, scale, nan):
    values = data.draw(st.lists(_dyadic, min_size=groups * G, max_size=groups * G))
    r = torch.tensor(values)
    if nan:
        r[data.draw(st.integers(0, groups * G - 1))] = NAN
    shifted = r + offset
    torch.testing.assert_close(shifted - offset, r, rtol=0, atol=0, equal_nan=True)  # the shift is exact
    torch.testing.assert_close(group_advantages(shifted, group_size=G, scale=scale),
                               group_advantages(r, group_size=G, scale=scale), rtol=0, atol=1e-5)
    torch.testing.assert_close(group_advantages(shifted, group_size=G, scale=scale),
                               group_advantages_ref(r, G, scale, 1e-6).float(), rtol=0, atol=1e-4)
    mask = torch.arange(3)[None, :] < torch.arange(groups * G)[:, None] % 4  # lengths 0..3
    torch.testing.assert_close(opo_advantages(shifted, mask, group_size=G), opo_advantages(r, mask, group_size=G),
                               rtol=0, atol=1e-6)
    assert torch.equal(zero_std_groups(shifted, group_size=G), zero_std_groups(r, group_size=G))
    if G >= 2:
        torch.testing.assert_close(rloo_advantages(shifted, group_size=G), rloo_advantages(r, group_size=G),
                                   rtol=0, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 6), G=st.integers(1, 6), seed=st.integers(0, 2**16), offset=st.sampled_from([0.0, 1e4]))
def test_zero_std_groups_are_exactly_the_zero_advantage_groups(groups, G, seed, offset):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (groups * G,), generator=g).float() / 8 + offset
    r[torch.rand(groups * G, generator=g) < 0.2] = NAN
    flags = zero_std_groups(r, group_size=G)
    assert torch.equal(flags, zero_std_groups_ref(r, G))
    adv = group_advantages(r, group_size=G, eps=0.0).view(groups, G)
    per_group = flags.view(groups, G)[:, 0]
    assert adv[per_group].eq(0).all()
    assert (adv[~per_group].abs().amax(-1) > 0.1).all()  # a group that is not tied has signal


@pytest.mark.parametrize("G", [12, 16, 32, 64])
def test_large_groups_match_reference(G):
    # groups larger than 8 take the group maximum in steps (max-pools of 4): same values
    g = torch.Generator().manual_seed(G)
    r = torch.randint(0, 4, (5 * G,), generator=g).float() / 4 + 1e4
    r[:G] = 1e4 + 0.5  # one tied group
    r[torch.rand(5 * G, generator=g) < 0.2] = NAN
    r[G:2 * G] = NAN  # one group without a finite reward
    r[2 * G + G - 1] = 2e4  # the maximum at a group's last row
    for scale in ("group", "batch", "none"):
        adv = group_advantages(r, group_size=G, scale=scale)
        _close(adv, group_advantages_ref(r, G, scale, 1e-6), rel=1e-5)
        assert adv[:2 * G].eq(0).all()
    _close(rloo_advantages(r, group_size=G), rloo_advantages_ref(r, G))
    assert torch.equal(zero_std_groups(r, group_size=G), zero_std_groups_ref(r, G))


def test_signed_zero_rewards_give_no_negative_zero():
    # [0.0, -0.0]: max = 0.0 and -0.0 - 0.0 = -0.0; the deviations are r + (0 - max) = +0.0
    r = torch.tensor([0.0, -0.0, -0.0, 0.0, 1.0, -0.0, -0.0, NAN])
    outs = [group_advantages(r, group_size=2, scale=s) for s in ("group", "batch", "none")]
    outs += [rloo_advantages(r, group_size=2), group_advantages(r, group_ids=torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))]
    for adv in outs:
        assert adv[:4].eq(0).all() and not adv[adv == 0].signbit().any(), adv


@pytest.mark.parametrize("estimator", ["group", "batch", "none", "rloo"])
def test_group_estimators_pass_gradients(estimator):
    # d sum(w * A) / d r against the same estimator written with plain mean / std (no NaN, no ties)
    g = torch.Generator().manual_seed(3)
    r = torch.randn(4 * 5, generator=g) + 1e3
    w = torch.randn(4 * 5, generator=g)
    ours = r.clone().requires_grad_()
    if estimator == "rloo":
        adv = rloo_advantages(ours, group_size=5)
    else:
        adv = group_advantages(ours, group_size=5, scale=estimator)
    (adv * w).sum().backward()
    plain = r.double().requires_grad_()
    x = plain.view(4, 5)
    centered = x - x.mean(1, keepdim=True)
    expected = {"group": centered / (x.std(1, keepdim=True) + 1e-6), "batch": centered / (plain.std() + 1e-6),
                "none": centered, "rloo": centered * 5 / 4}[estimator]
    (expected.reshape(-1) * w.double()).sum().backward()
    torch.testing.assert_close(ours.grad.double(), plain.grad, rtol=1e-4, atol=1e-4)
    assert ours.grad.abs().sum() > 0.1


# --- group_ids ------------------------------------------------------------------------------

def _estimators(mask):
    return {
        "group": lambda r, **kw: group_advantages(r, **kw),
        "batch": lambda r, **kw: group_advantages(r, scale="batch", **kw),
        "none": lambda r, **kw: group_advantages(r, scale="none", **kw),
        "rloo": lambda r, **kw: rloo_advantages(r, **kw),
        "passk": lambda r, **kw: passk_advantages(r.clamp(0, 1).round(), k=2, **kw),
        "opo": lambda r, **kw: opo_advantages(r, mask, **kw),
        "zero_std": lambda r, **kw: zero_std_groups(r, **kw),
    }


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 6), G=st.integers(2, 6), seed=st.integers(0, 2**16), far_ids=st.booleans())
def test_group_ids_on_a_permuted_batch_equal_contiguous_groups(groups, G, seed, far_ids):
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    r = torch.randint(0, 4, (B,), generator=g).float() / 3
    r[torch.rand(B, generator=g) < 0.15] = NAN
    mask = torch.rand(B, 5, generator=g) < 0.7
    ids = torch.arange(groups).repeat_interleave(G)
    if far_ids:  # ids outside [0, B): the torch.unique path
        ids = ids * 1000 - 7
    perm = torch.randperm(B, generator=g)
    contiguous, permuted = _estimators(mask), _estimators(mask[perm])
    for name in contiguous:
        r_in = r if name != "passk" else r.nan_to_num(0.0)
        expected = contiguous[name](r_in, group_size=G)[perm]
        got = permuted[name](r_in[perm], group_ids=ids[perm])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=name)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 7), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       scale=st.sampled_from(["group", "none"]))
def test_group_ids_with_groups_of_unequal_size_match_each_group_alone(sizes, seed, scale):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 5, (sum(sizes),), generator=g).float()
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    adv = group_advantages(r, group_ids=ids, scale=scale)
    rloo = rloo_advantages(r, group_ids=ids)
    for start, size in zip([0, *torch.tensor(sizes).cumsum(0).tolist()], sizes):
        piece = r[start:start + size]
        _close(adv[start:start + size], group_advantages_ref(piece, size, scale, 1e-6))
        if size >= 2:
            _close(rloo[start:start + size], rloo_advantages_ref(piece, size))


def test_group_ids_and_group_size_bad_inputs():
    r = torch.zeros(4)
    for fn in (group_advantages, rloo_advantages, zero_std_groups):
        name = fn.__name__
        with pytest.raises(InvalidArgumentError, match=f"{name}: pass exactly one of group_size .* and group_ids"):
            fn(r)
        with pytest.raises(InvalidArgumentError, match=f"{name}: pass exactly one of group_size"):
            fn(r, group_size=2, group_ids=torch.zeros(4, dtype=torch.long))
        with pytest.raises(DTypeError, match=f"{name}: group_ids has dtype torch.float32; expected an integer"):
            fn(r, group_ids=torch.zeros(4))
        with pytest.raises(ShapeError, match=rf"{name}: group_ids has shape \(3,\) but rewards has shape \(4,\)"):
            fn(r, group_ids=torch.zeros(3, dtype=torch.long))


# --- GDPO: [B, K] rewards with reward_weights ---------------------------------------------

def test_gdpo_hand_derived():
    # groups of 2, K = 2, weights (1, 0.5), eps = 0:
    # group 1: reward 0 (1, 0) -> +-1/sqrt(2); reward 1 (0, 0) tied -> 0
    # group 2: reward 0 (2, 2) tied -> 0;       reward 1 (5, 3) -> +-1/sqrt(2)
    # s = (1/sqrt2, -1/sqrt2, 0.5/sqrt2, -0.5/sqrt2); batch std = sqrt(1.25 / 3) = sqrt(5/12)
    # A = s / std: (sqrt(1.2), -sqrt(1.2), sqrt(1.2) / 2, -sqrt(1.2) / 2)
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 5.0], [2.0, 3.0]])
    adv = group_advantages(r, group_size=2, reward_weights=[1.0, 0.5], eps=0.0)
    a = math.sqrt(1.2)
    torch.testing.assert_close(adv, torch.tensor([a, -a, a / 2, -a / 2]), rtol=1e-6, atol=1e-7)
    # one column with weight 1 is GRPO followed by a batch whitening
    one = group_advantages(r[:, :1], group_size=2, eps=0.0)
    single = group_advantages(r[:, 0], group_size=2, eps=0.0)
    torch.testing.assert_close(one, single / single.std(), rtol=1e-6, atol=1e-7)
    # every group tied in every reward: exactly 0 (TRL leaves a ~1e-7 residue from the batch mean)
    assert group_advantages(torch.ones(4, 3) * 0.1, group_size=2, reward_weights=[1.0, 2.0, 3.0]).eq(0).all()


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 5), G=st.integers(2, 6), K=st.integers(1, 4), seed=st.integers(0, 2**16),
       nan=st.booleans())
def test_gdpo_matches_reference_and_is_order_free(groups, G, K, seed, nan):
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    r = torch.randint(0, 4, (B, K), generator=g).float()
    if nan:
        r[torch.rand(B, K, generator=g) < 0.2] = NAN
    w = torch.rand(K, generator=g) * 2 - 0.5
    adv = group_advantages(r, group_size=G, reward_weights=w, eps=1e-4)
    _close(adv, gdpo_advantages_ref(r, G, w, 1e-4), rel=1e-5)
    perm = torch.randperm(B, generator=g)
    ids = torch.arange(groups).repeat_interleave(G)
    torch.testing.assert_close(group_advantages(r[perm], group_ids=ids[perm], reward_weights=w, eps=1e-4),
                               adv[perm], rtol=0, atol=1e-5)


def test_gdpo_bad_inputs():
    with pytest.raises(ShapeError, match=r"group_advantages: reward_weights has shape \(3,\) but rewards has shape \(4, 2\); expected \(2,\)"):
        group_advantages(torch.zeros(4, 2), group_size=2, reward_weights=[1.0, 1.0, 1.0])
    with pytest.raises(ShapeError, match=r"group_advantages: reward_weights is given but rewards has shape \(4,\)"):
        group_advantages(torch.zeros(4), group_size=2, reward_weights=[1.0])
    with pytest.raises(InvalidArgumentError, match="group_advantages: reward_weights must be finite"):
        group_advantages(torch.zeros(4, 2), group_size=2, reward_weights=[1.0, float("inf")])


# --- passk_advantages -------------------------------------------------------------------------

def test_passk_hand_derived():
    # n = 4, c = 1, k = 2: rho = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2,
    # A_pos = (1/2) / (1/2) = 1, A_neg = (1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3
    adv = passk_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), k=2, group_size=4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # k = 1 is GRPO with the biased std: rho = 1/4, sigma = sqrt(3)/4: A_pos = sqrt(3), A_neg = -1/sqrt(3)
    adv = passk_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), k=1, group_size=4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]))
    # c = 3 of n = 4 with k = 2: every pair passes: rho = 1, sigma = 0 -> 0; all-wrong groups -> 0
    zero = passk_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]), k=2, group_size=4)
    assert zero.eq(0).all()
    # scale="none": the same numerators; a NaN reward is left out of n (here n = 3, c = 1, k = 2:
    # rho = 1 - C(2,2)/C(3,2) = 2/3, A_pos = 1/3, A_neg = 1/3 - C(1,1)/C(2,1) = -1/6)
    adv = passk_advantages(torch.tensor([1.0, NAN, 0.0, 0.0]), k=2, group_size=4, scale="none")
    torch.testing.assert_close(adv, torch.tensor([1 / 3, 0.0, -1 / 6, -1 / 6]))


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 5), G=st.integers(1, 8), data=st.data(), seed=st.integers(0, 2**16),
       scale=st.sampled_from(["group", "none"]), nan=st.booleans())
def test_passk_matches_reference(groups, G, data, seed, scale, nan):
    k = data.draw(st.integers(1, G))
    g = torch.Generator().manual_seed(seed)
    r = (torch.rand(groups * G, generator=g) < 0.4).float()
    if nan:
        r[torch.rand(groups * G, generator=g) < 0.2] = NAN
    adv = passk_advantages(r, k=k, group_size=G, scale=scale)
    _close(adv, passk_advantages_ref(r, G, k, scale, 1e-6), rel=1e-5)
    if k == 1 and scale == "none":  # Pass@1: the group mean baseline
        _close(adv, group_advantages_ref(r, G, "none", 0.0), rel=1e-6)


def test_passk_bad_inputs():
    with pytest.raises(InvalidArgumentError, match=r"passk_advantages: rewards must be 0 or 1 \(or NaN\), got values such as \[0.5\]"):
        passk_advantages(torch.tensor([1.0, 0.5]), k=1, group_size=2)
    with pytest.raises(InvalidArgumentError, match="passk_advantages: k must be an int >= 1 and <= group_size=2, got 3"):
        passk_advantages(torch.tensor([1.0, 0.0]), k=3, group_size=2)
    with pytest.raises(InvalidArgumentError, match="passk_advantages: k must be an int >= 1, got 0"):
        passk_advantages(torch.tensor([1.0, 0.0]), k=0, group_ids=torch.tensor([0, 0]))
    with pytest.raises(InvalidArgumentError, match="passk_advantages: scale is 'batch'"):
        passk_advantages(torch.tensor([1.0, 0.0]), k=1, group_size=2, scale="batch")
    with pytest.raises(ShapeError, match=r"passk_advantages: rewards has shape \(2, 1\); expected 1"):
        passk_advantages(torch.ones(2, 1), k=1, group_size=2)


# --- opo_advantages ---------------------------------------------------------------------------

def test_opo_hand_derived():
    # lengths (3, 1), rewards (1, 0): b = (3 * 1 + 1 * 0) / 4 = 0.75 -> A = (0.25, -0.75);
    # second group: lengths (2, 2) -> the plain mean 0.5; third: NaN left out, one reward -> 0
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, NAN, 2.0])
    torch.testing.assert_close(opo_advantages(r, mask, group_size=2), torch.tensor([0.25, -0.75, -0.5, 0.5, 0.0, 0.0]))


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 5), G=st.integers(1, 6), T=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_opo_matches_reference(groups, G, T, seed):
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    r = torch.randint(0, 4, (B,), generator=g).float()
    r[torch.rand(B, generator=g) < 0.15] = NAN
    mask = torch.rand(B, T, generator=g) < 0.6
    _close(opo_advantages(r, mask, group_size=G), opo_advantages_ref(r, mask.sum(-1), G))
    # equal lengths: the plain group mean (Dr. GRPO's advantage)
    full = torch.ones(B, 4, dtype=torch.bool)
    _close(opo_advantages(r, full, group_size=G), group_advantages_ref(r, G, "none", 0.0))


def test_opo_bad_inputs():
    with pytest.raises(ShapeError, match=r"opo_advantages: rewards has shape \(4,\) but mask has shape \(3, 2\)"):
        opo_advantages(torch.zeros(4), torch.ones(3, 2, dtype=torch.bool), group_size=2)
    with pytest.raises(DTypeError, match="opo_advantages: mask has dtype torch.int64"):
        opo_advantages(torch.zeros(4), torch.ones(4, 2, dtype=torch.long), group_size=2)


# --- the property kit over the new estimators --------------------------------------------------

def test_check_advantage_estimator_over_the_new_estimators():
    from torchforge.testing import check_advantage_estimator

    def opo_equal_lengths(rewards, *, group_size):
        return opo_advantages(rewards, torch.ones(rewards.shape[0], 3, dtype=torch.bool), group_size=group_size)

    def grpo_by_ids(rewards, *, group_size):
        ids = torch.arange(rewards.shape[0] // group_size).repeat_interleave(group_size)
        return group_advantages(rewards, group_ids=ids)

    check_advantage_estimator(opo_equal_lengths, max_examples=20)
    check_advantage_estimator(grpo_by_ids, max_examples=20)


# --- batch statistics over ranks ----------------------------------------------------------------

def test_batch_scaled_advantages_on_two_processes_equal_one(tmp_path):
    from tests import _adv_dist_worker as W
    from torchforge.distributed import launch

    rc = launch(2, [str(Path(W.__file__)), str(tmp_path)], module=None)
    assert rc == 0, "distributed workers failed (their output is above)"
    shards = [torch.load(tmp_path / f"advantages_rank{r}.pt") for r in range(2)]
    one = W.advantages(W.global_inputs())
    for key, expected in one.items():
        got = torch.cat([s[key] for s in shards])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=key)
    # without the sums over ranks each shard would use its own std: the test can fail
    half = W.advantages({k: v[: v.shape[0] // 2] for k, v in W.global_inputs().items()})
    assert not torch.allclose(half["batch"], one["batch"][: one["batch"].shape[0] // 2], atol=1e-3)


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 6), G=st.integers(1, 6), seed=st.integers(0, 2**16),
       offset=st.sampled_from([0.0, 1e4]), ids=st.booleans())
def test_batch_scale_std_is_the_std_of_all_finite_rewards(groups, G, seed, offset, ids):
    # scale="batch" pools the batch variance from the groups' statistics: it must equal the
    # unbiased std of every finite reward, also at an offset of 1e4 with a spread of 1e-2
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(groups * G, generator=g, dtype=torch.float64) * 1e-2 + offset).float()
    r[torch.rand(groups * G, generator=g) < 0.2] = float("nan")
    kwargs = {"group_ids": torch.arange(groups).repeat_interleave(G)} if ids else {"group_size": G}
    centered = group_advantages(r, scale="none", **kwargs)
    finite = r[torch.isfinite(r)].double()
    std = finite.std() if finite.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    expected = (centered.double() / (std + 1e-6)).float()
    torch.testing.assert_close(group_advantages(r, scale="batch", **kwargs), expected, rtol=2e-5, atol=1e-6)


def test_empty_batches_and_float64_ties():
    e, m, none = torch.zeros(0), torch.zeros(0, 5, dtype=torch.bool), torch.zeros(0, dtype=torch.long)
    outs = [group_advantages(e, group_size=4), group_advantages(e, group_size=4, scale="batch"),
            group_advantages(e, group_ids=none), rloo_advantages(e, group_size=2),
            group_advantages(torch.zeros(0, 2), group_size=4, reward_weights=[1.0, 1.0]),
            passk_advantages(e, k=2, group_size=4), opo_advantages(e, m, group_size=4)]
    assert all(o.shape == (0,) and o.dtype == torch.float32 for o in outs)
    assert zero_std_groups(e, group_ids=none).shape == (0,)
    # float64 rewards keep their precision for the tie: 0.1 + 0.2 != 0.3, in both functions
    r = torch.tensor([0.1 + 0.2, 0.3, 1.0, 1.0], dtype=torch.float64)
    assert zero_std_groups(r, group_size=2).tolist() == [False, False, True, True]
    torch.testing.assert_close(group_advantages(r, group_size=2, eps=0.0), torch.tensor([0.7071068, -0.7071068, 0.0, 0.0]))


# --- best_minus_second_advantages -----------------------------------------------------------

def test_best_minus_second_hand_derived():
    # group 1: r_max = 1, r_second = 0.5: margin 0.5 at row 0; group 2: the maximum 3 is shared: 0
    r = torch.tensor([1.0, 0.5, 0.0, 0.2, 3.0, 3.0, 1.0, 0.0])
    adv = best_minus_second_advantages(r, group_size=4, scale="none")
    assert adv.tolist() == [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # scale="group": std of [1, 0.5, 0, 0.2] = sqrt(0.5675 / 3); 0.5 / (std + eps)
    std = math.sqrt(((0.575**2) + 0.075**2 + 0.425**2 + 0.225**2) / 3)
    adv = best_minus_second_advantages(r, group_size=4, eps=1e-6)
    torch.testing.assert_close(adv, torch.tensor([0.5 / (std + 1e-6), 0, 0, 0, 0, 0, 0, 0]))
    # NaN is no reward: [NaN, 2, 1] -> 2 - 1 at row 1; one finite reward -> 0; all NaN -> 0
    adv = best_minus_second_advantages(torch.tensor([NAN, 2.0, 1.0, NAN, 4.0, NAN, NAN]),
                                       group_ids=torch.tensor([0, 0, 0, 1, 1, 2, 2]), scale="none")
    assert adv.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 7), min_size=1, max_size=5), seed=st.integers(0, 2**16),
       scale=st.sampled_from(["group", "none"]), nan=st.booleans(), permute=st.booleans())
def test_best_minus_second_matches_reference(sizes, seed, scale, nan, permute):
    g = torch.Generator().manual_seed(seed)
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    r = torch.randint(0, 4, (ids.numel(),), generator=g).float() / 2  # ties are common
    if nan:
        r[torch.rand(ids.numel(), generator=g) < 0.2] = NAN
    if permute:
        perm = torch.randperm(ids.numel(), generator=g)
        r, ids = r[perm], ids[perm]
    adv = best_minus_second_advantages(r, group_ids=ids, scale=scale)
    _close(adv, best_minus_second_advantages_ref(r, ids, scale, 1e-6))
    if len(set(sizes)) == 1 and not permute:  # contiguous groups: the same values
        _close(best_minus_second_advantages(r, group_size=sizes[0], scale=scale), adv.double(), rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(G=st.integers(2, 8), groups=st.integers(1, 4), seed=st.integers(0, 2**16),
       offset=st.sampled_from([0.0, 1e4, -1e4]))
def test_best_minus_second_properties(G, groups, seed, offset):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(groups * G, generator=g, dtype=torch.float64)
    adv = best_minus_second_advantages(r, group_size=G, scale="none").view(groups, G)
    # at most one non-zero per group, at its argmax, equal to the top-2 margin; never negative
    top2 = r.view(groups, G).topk(2, dim=1).values
    assert (adv >= 0).all() and (torch.count_nonzero(adv, dim=1) <= 1).all()
    torch.testing.assert_close(adv.amax(1).double(), top2[:, 0] - top2[:, 1], rtol=1e-6, atol=1e-7)
    assert (adv.argmax(1) == r.view(groups, G).argmax(1)).all()
    # an offset of 1e4 on every reward (float64 in) changes nothing; scale="group" divides by std + eps
    shifted = best_minus_second_advantages(r + offset, group_size=G, scale="none").view(groups, G)
    torch.testing.assert_close(shifted, adv, rtol=1e-6, atol=1e-7)
    scaled = best_minus_second_advantages(r + offset, group_size=G).view(groups, G)
    torch.testing.assert_close(scaled.double(), adv.double() / (r.view(groups, G).std(1, keepdim=True) + 1e-6),
                               rtol=1e-5, atol=1e-6)


def test_best_minus_second_empty_and_bad_inputs():
    assert best_minus_second_advantages(torch.zeros(0), group_size=4).shape == (0,)
    assert best_minus_second_advantages(torch.zeros(0), group_ids=torch.zeros(0, dtype=torch.long)).shape == (0,)
    assert best_minus_second_advantages(torch.tensor([5.0]), group_size=1).tolist() == [0.0]  # G = 1: no runner-up
    # a tie at float64 precision stays a tie: 0.1 + 0.2 > 0.3, so the group [0.1 + 0.2, 0.3] is not tied
    r = torch.tensor([0.1 + 0.2, 0.3, 0.3, 0.3], dtype=torch.float64)
    assert best_minus_second_advantages(r, group_size=2, scale="none")[2:].tolist() == [0.0, 0.0]
    assert best_minus_second_advantages(r, group_size=2, scale="none")[0] > 0
    with pytest.raises(ShapeError, match=r"best_minus_second_advantages: rewards has shape \(2, 1\); expected 1"):
        best_minus_second_advantages(torch.ones(2, 1), group_size=2)
    with pytest.raises(InvalidArgumentError, match="best_minus_second_advantages: scale is 'batch'"):
        best_minus_second_advantages(torch.ones(2), group_size=2, scale="batch")
    with pytest.raises(InvalidArgumentError, match="best_minus_second_advantages: pass exactly one of group_size"):
        best_minus_second_advantages(torch.ones(2))
    with pytest.raises(ShapeError, match="best_minus_second_advantages: rewards has shape \\(3,\\), not a multiple"):
        best_minus_second_advantages(torch.ones(3), group_size=2)
    with pytest.raises(InvalidArgumentError, match="best_minus_second_advantages: eps"):
        best_minus_second_advantages(torch.ones(2), group_size=2, eps=-1.0)


# --- zero-std groups (DAPO dynamic sampling) ------------------------------------------------

def test_zero_std_groups_hand_derived():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, NAN, NAN, 0.5, NAN, 0.5, 0.5])
    # groups of 3: all 1 -> True; (0, 1, 1) -> False; (NaN, NaN, 0.5) -> True (one value);
    # (NaN, 0.5, 0.5) -> True (NaN left out)
    assert zero_std_groups(r, group_size=3).tolist() == [True] * 3 + [False] * 3 + [True] * 3 + [True] * 3
    # Exact equality: 0.1 + 0.2 = 0.30000000000000004 != 0.3 in float64 (kept in float64).
    r2 = torch.tensor([0.1 + 0.2, 0.3, 0.3, 0.3], dtype=torch.float64)
    assert zero_std_groups(r2, group_size=2).tolist() == [False, False, True, True]


@given(G=st.integers(1, 4), groups=st.integers(1, 5), seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_zero_std_groups_matches_reference(G, groups, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 2, (groups * G,), generator=g).float()
    r[torch.rand(groups * G, generator=g) < 0.2] = NAN
    assert torch.equal(zero_std_groups(r, group_size=G), zero_std_groups_ref(r, G))


def test_zero_std_groups_bf16_and_batch_calling():
    assert zero_std_groups(torch.ones(4, dtype=torch.bfloat16), group_size=2).all()
    batch = Batch(rewards=torch.arange(4.0), mask=torch.ones(4, 6, dtype=torch.bool), batch_size=[4])
    assert zero_std_groups(batch, group_size=2).tolist() == [False] * 4


def test_zero_std_groups_bad_inputs():
    with pytest.raises(ShapeError, match=r"zero_std_groups: rewards has shape \(5,\), not a multiple of group_size=2"):
        zero_std_groups(torch.ones(5), group_size=2)
    with pytest.raises(InvalidArgumentError, match="zero_std_groups: group_size must be an int >= 1, got 0"):
        zero_std_groups(torch.ones(4), group_size=0)
    with pytest.raises(DTypeError, match="zero_std_groups: rewards has dtype torch.int64"):
        zero_std_groups(torch.ones(4, dtype=torch.long), group_size=2)


def test_zero_std_groups_compiles_fullgraph_and_matches_eager():
    import torch._dynamo
    torch._dynamo.reset()
    calls = {
        "zero_std": lambda: zero_std_groups(torch.tensor([1.0, 1.0, NAN, 2.0]), group_size=2),
    }
    for name, call in calls.items():
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(), call(), msg=name)
