"""Tests for torchforge.testing: the strategies draw what they promise, the library's own
estimators and losses pass the checks, and deliberately wrong ones fail them."""

import functools
import importlib
import sys

import pytest
import torch
from hypothesis import given, settings

import torchforge.testing as tft
from torchforge.advantages import group_advantages, rloo_advantages
from torchforge.errors import InvalidArgumentError
from torchforge.kl import KL_ESTIMATORS, approx_kl
from torchforge.losses import cispo_loss, grpo_loss, ppo_loss, reinforce_loss
from torchforge.reduce import AGGREGATION_MODES, Aggregation, aggregate
from torchforge.testing import (
    batches,
    check_advantage_estimator,
    check_aggregation_exact,
    check_kl_estimator,
    check_policy_loss,
    group_rewards,
    masks,
    policy_pairs,
)

# Strategy tests collect what 60 deterministic draws produced, then assert on the set.
DRAWS = settings(max_examples=60, deadline=None, derandomize=True, database=None)


def _collect(strategy, features):
    """Run ``features(x)`` (a set of strings) over draws of ``strategy``; their union."""
    seen = set()

    @DRAWS
    @given(x=strategy)
    def run(x):
        seen.update(features(x))

    run()
    return seen


def _gaps(mask):
    """Rows with a masked position before a counted one (tool / observation tokens)."""
    later = mask.flip(-1).cummax(-1).values.flip(-1)  # a counted token at or after t
    return (~mask & later).any(-1)


# ----------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------

def test_masks_shapes_and_realistic_rows():
    def features(mask):
        B, T = mask.shape
        assert mask.dtype == torch.bool and 1 <= B <= 4 and 3 <= T <= 9
        lengths = mask.sum(-1)
        out = set()
        if not mask.any():
            out.add("empty batch")
        if (lengths == 0).any() and mask.any():
            out.add("empty row")
        if _gaps(mask).any():
            out.add("gap")
        if ((lengths > 0) & (lengths < T) & ~_gaps(mask)).any():
            out.add("right-padded")
        if (lengths == T).any():
            out.add("full")
        return out

    seen = _collect(masks(batch_size=(1, 4), length=(3, 9)), features)
    assert seen == {"empty batch", "empty row", "gap", "right-padded", "full"}


def test_masks_options_turn_off_empties_and_gaps():
    def features(mask):
        assert mask.shape == (3, 6)
        assert mask.any(-1).all()  # allow_empty=False: every row counts a token
        assert not _gaps(mask).any()  # gaps=False: right padding only
        return {"padded"} if (~mask).any() else set()

    assert _collect(masks(batch_size=3, length=6, allow_empty=False, gaps=False), features) == {"padded"}


def test_group_rewards_has_ties_constant_groups_and_nan():
    def features(case):
        rewards, G = case
        assert 2 <= G <= 4 and rewards.dtype == torch.float32 and rewards.dim() == 1
        assert rewards.shape[0] % G == 0 and 1 <= rewards.shape[0] // G <= 3
        finite = rewards[torch.isfinite(rewards)]
        assert finite.abs().max() <= 10 if finite.numel() else True
        out = set()
        for group in rewards.view(-1, G):
            valid = group[torch.isfinite(group)]
            if valid.numel() == 0:
                out.add("all NaN")
            elif valid.numel() < G:
                out.add("some NaN")
            if valid.numel() == G and (valid == valid[0]).all():
                out.add("all equal")
            if valid.unique().numel() < valid.numel() and valid.unique().numel() > 1:
                out.add("ties")
            if valid.unique().numel() == valid.numel() > 1:
                out.add("distinct")
        return out

    seen = _collect(group_rewards(group_size=(2, 4), num_groups=(1, 3)), features)
    assert seen == {"all NaN", "some NaN", "all equal", "ties", "distinct"}


def test_group_rewards_without_nan():
    def features(case):
        rewards, G = case
        assert G == 3 and torch.isfinite(rewards).all()
        return set()

    _collect(group_rewards(group_size=3, allow_nan=False), features)


def test_policy_pairs_log_probs_match_logits_and_tokens():
    def features(pair):
        B = pair.batch_size[0]
        logits, ref_logits, tokens = pair["logits"], pair["ref_logits"], pair["tokens"]
        assert logits.shape[0] == B and logits.shape == ref_logits.shape and 2 <= logits.shape[-1] <= 5
        assert tokens.dtype == torch.int64 and ((0 <= tokens) & (tokens < logits.shape[-1])).all()
        for key, x in (("log_probs", logits), ("ref_log_probs", ref_logits)):
            expected = (x.float() - x.float().logsumexp(-1, keepdim=True)).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            assert pair[key].dtype == torch.float32
            torch.testing.assert_close(pair[key], expected, rtol=1e-5, atol=1e-5)
        return {"equal"} if torch.equal(logits, ref_logits) else {"different"}

    assert _collect(policy_pairs(vocab_size=(2, 5)), features) == {"equal", "different"}


def test_policy_pairs_dtype():
    def features(pair):
        assert pair["logits"].dtype == torch.bfloat16 and pair["log_probs"].dtype == torch.float32
        return set()

    _collect(policy_pairs(dtype=torch.bfloat16), features)


FLOAT_KEYS = ("log_probs", "old_log_probs", "ref_log_probs", "rollout_log_probs", "values", "old_values", "returns")


def test_batches_keys_shapes_and_related_policies():
    def features(batch):
        B = batch.batch_size[0]
        mask = batch["mask"]
        T = mask.shape[1]
        assert B % 2 == 0 and 2 <= B <= 6 and 1 <= T <= 5
        assert mask.dtype == torch.bool and batch["tokens"].shape == (B, T)
        assert batch["tokens"].dtype == torch.int64 and ((0 <= batch["tokens"]) & (batch["tokens"] < 8)).all()
        for key in FLOAT_KEYS:
            assert batch[key].shape == (B, T) and batch[key].dtype == torch.float32, key
            assert torch.isfinite(batch[key]).all(), key
        for key in ("log_probs", "old_log_probs", "ref_log_probs", "rollout_log_probs"):
            assert (batch[key] <= 0).all(), key
        assert batch["rewards"].shape == (B,) and torch.isfinite(batch["rewards"]).all()
        # the rollout engine reports the sampler's log-probs up to a small mismatch
        assert (batch["rollout_log_probs"] - batch["old_log_probs"]).abs().max() < 0.02
        out = {"sequence" if batch["advantages"].shape == (B,) else "token"}
        assert batch["advantages"].shape in ((B,), (B, T))
        if torch.equal(batch["log_probs"], batch["old_log_probs"]):
            out.add("on-policy")
        return out

    seen = _collect(batches(batch_size=(2, 6), length=(1, 5), group_size=2), features)
    assert seen == {"sequence", "token", "on-policy"}


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_batches_nan_outside_mask(level):
    def features(batch):
        mask = batch["mask"]
        for key in FLOAT_KEYS:
            assert torch.equal(torch.isnan(batch[key]), ~mask), key
        A = batch["advantages"]
        assert torch.equal(torch.isnan(A), ~(mask.any(-1) if level == "sequence" else mask))
        return set()

    _collect(batches(advantage_level=level, nan_outside_mask=True), features)


def test_strategies_reject_bad_arguments():
    with pytest.raises(InvalidArgumentError, match=r"masks: batch_size is \(3, 1\); expected 1 <= low <= high"):
        masks(batch_size=(3, 1))
    with pytest.raises(InvalidArgumentError, match="masks: length must be an int or a"):
        masks(length=2.5)
    with pytest.raises(InvalidArgumentError, match="group_rewards: group_size is 0"):
        group_rewards(group_size=0)
    with pytest.raises(InvalidArgumentError, match="batches: advantage_level is 'tokens'"):
        batches(advantage_level="tokens")
    with pytest.raises(InvalidArgumentError, match="policy_pairs: max_drift must be a number >= 0"):
        policy_pairs(max_drift=-1.0)
    with pytest.raises(InvalidArgumentError, match="check_advantage_estimator: shift_invariant is 'rows'"):
        check_advantage_estimator(group_advantages, shift_invariant="rows")
    with pytest.raises(InvalidArgumentError, match="check_policy_loss: aggregation mode is 'mean'"):
        check_policy_loss(ppo_loss, aggregation="mean")
    with pytest.raises(InvalidArgumentError, match="check_kl_estimator: max_examples must be an int >= 1"):
        check_kl_estimator(approx_kl, max_examples=0)


def test_module_imports_without_hypothesis(monkeypatch):
    # hypothesis is a dev dependency: importing torchforge.testing must not need it, and
    # calling a strategy or check without it says what to install.
    try:
        monkeypatch.setitem(sys.modules, "hypothesis", None)
        monkeypatch.setitem(sys.modules, "hypothesis.strategies", None)
        module = importlib.reload(tft)
        assert module.hypothesis is None
        with pytest.raises(ImportError, match=r"masks needs hypothesis.*torchforge\[dev\]"):
            module.masks()
        with pytest.raises(ImportError, match="check_policy_loss needs hypothesis"):
            module.check_policy_loss(ppo_loss)
    finally:
        monkeypatch.undo()
        importlib.reload(tft)
    assert tft.hypothesis is not None


# ----------------------------------------------------------------------------------------
# check_kl_estimator
# ----------------------------------------------------------------------------------------

# (estimator, nonnegative, unbiased): k1 and k3 are unbiased for KL(pi || ref); k2 and abs
# are not; k2, k3 and abs are >= 0.
KL_CLAIMS = {"k1": (False, True), "k2": (True, False), "k3": (True, True), "abs": (True, False)}


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_library_kl_estimators_pass(estimator):
    nonnegative, unbiased = KL_CLAIMS[estimator]
    check_kl_estimator(functools.partial(approx_kl, estimator=estimator), nonnegative=nonnegative,
                       unbiased=unbiased)


@pytest.mark.parametrize("estimator", ["k2", "abs"])
def test_biased_library_estimators_fail_when_claimed_unbiased(estimator):
    with pytest.raises(AssertionError, match="is not unbiased for KL") as info:
        check_kl_estimator(functools.partial(approx_kl, estimator=estimator), max_examples=10)
    assert "standard errors away" in str(info.value) and "pi = tensor(" in str(info.value)


def test_scaled_k1_is_biased():
    # E[1.1 k1] = 1.1 KL: a 10 % bias, many standard errors at 20k samples when KL ~ 1.
    with pytest.raises(AssertionError, match="is not unbiased for KL"):
        check_kl_estimator(lambda lp, ref: 1.1 * approx_kl(lp, ref, estimator="k1"), max_examples=10)


def test_k1_is_not_nonnegative():
    with pytest.raises(AssertionError, match="claims nonnegative=True but returned -"):
        check_kl_estimator(functools.partial(approx_kl, estimator="k1"), nonnegative=True, max_examples=10)


def test_kl_estimator_must_vanish_for_equal_policies():
    # Unbiased in expectation only if the offset were removed; and not 0 when pi = ref.
    with pytest.raises(AssertionError, match=r"fn\(log_probs, log_probs\) should be 0"):
        check_kl_estimator(lambda lp, ref: approx_kl(lp, ref) + 1e-3, unbiased=False, max_examples=10)


def test_kl_estimator_must_be_finite():
    # k3 written with a division: exp(ref) / exp(lp) is 0 / 0 once both underflow.
    def k3_by_division(lp, ref):
        return torch.exp(ref.double()).float() / torch.exp(lp) - 1 + (lp - ref)

    with pytest.raises(AssertionError, match="non-finite estimates on extreme log-probs"):
        check_kl_estimator(k3_by_division, max_examples=10, log_prob_floor=-120.0)


def test_kl_estimator_must_keep_the_shape():
    with pytest.raises(AssertionError, match=r"fn returned shape .*; expected a float tensor of the input shape"):
        check_kl_estimator(lambda lp, ref: (lp - ref).sum(-1), max_examples=5)


def test_kl_failure_is_deterministic():
    messages = []
    for _ in range(2):
        with pytest.raises(AssertionError) as info:
            check_kl_estimator(functools.partial(approx_kl, estimator="k2"), max_examples=10)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


# ----------------------------------------------------------------------------------------
# check_advantage_estimator
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale,shift", [("group", "group"), ("none", "group"), ("batch", "batch")])
def test_group_advantages_pass(scale, shift):
    check_advantage_estimator(functools.partial(group_advantages, scale=scale), shift_invariant=shift)


def test_rloo_advantages_pass():
    check_advantage_estimator(rloo_advantages, group_size=(2, 6))


def test_batch_scale_is_not_invariant_to_per_group_shifts():
    # The batch std sees the spread between groups: shifting one group changes it.
    with pytest.raises(AssertionError, match="not invariant to a shift of the rewards per group"):
        check_advantage_estimator(functools.partial(group_advantages, scale="batch"), max_examples=10)


def _naive_std(rewards, *, group_size):
    r = rewards.view(-1, group_size)
    return ((r - r.mean(-1, keepdim=True)) / r.std(-1, keepdim=True)).view(-1)


def test_std_without_guard_fails_on_equal_groups():
    with pytest.raises(AssertionError, match="advantages not finite") as info:
        check_advantage_estimator(_naive_std, group_size=(2, 6), allow_nan=False, max_examples=10)
    assert "rewards = tensor(" in str(info.value)


def test_std_plus_eps_blows_up_rounding_residue_of_ties():
    # (r - mean) / (std + 1e-6): finite, but the float32 mean of [0.11] * 3 rounds away
    # from 0.11, and the residue r - mean (~1e-8) over std + eps gives advantages of ~1e-2
    # instead of 0.
    def eps_std(rewards, *, group_size):
        r = rewards.view(-1, group_size)
        return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)).view(-1)

    assert eps_std(torch.full((3,), 0.11), group_size=3).abs().max() > 1e-3  # the premise
    with pytest.raises(AssertionError, match="has all-equal rewards"):
        check_advantage_estimator(eps_std, group_size=(3, 3), allow_nan=False, max_examples=10)


def test_added_constant_breaks_ties_and_zero_mean():
    def plus_one(rewards, *, group_size):
        return group_advantages(rewards, group_size=group_size) + 1.0

    with pytest.raises(AssertionError, match="has all-equal rewards"):
        check_advantage_estimator(plus_one, max_examples=10)
    with pytest.raises(AssertionError, match=r"sum to .*; expected zero mean per group"):
        check_advantage_estimator(plus_one, ties_zero=False, max_examples=10)


def test_uncentered_estimator_is_not_shift_invariant():
    # r / std: zero mean not claimed, ties fine (std guard), but shifting r shifts A.
    def scaled(rewards, *, group_size):
        centered = group_advantages(rewards, group_size=group_size, scale="none")
        return torch.where(centered != 0, rewards / 4, 0.0).nan_to_num()

    with pytest.raises(AssertionError, match="not invariant to a shift"):
        check_advantage_estimator(scaled, zero_mean=False, max_examples=10)


def test_in_place_estimator_fails():
    def in_place(rewards, *, group_size):
        r = rewards.view(-1, group_size)
        return r.sub_(r.nanmean(-1, keepdim=True)).nan_to_num().view(-1)

    with pytest.raises(AssertionError, match="fn modified its input rewards"):
        check_advantage_estimator(in_place, max_examples=5)


# ----------------------------------------------------------------------------------------
# check_policy_loss
# ----------------------------------------------------------------------------------------

def _reinforce(lp, old, A, mask, **kwargs):
    return reinforce_loss(lp, A, mask, **kwargs)


def _cispo(lp, old, A, mask, **kwargs):
    return cispo_loss(lp, old, A, mask, clip_low=0.2, clip_high=0.28, **kwargs)


LOSSES = {"ppo": ppo_loss, "grpo": grpo_loss, "cispo": _cispo, "reinforce": _reinforce}


@pytest.mark.parametrize("loss", LOSSES)
def test_library_losses_pass(loss):
    check_policy_loss(LOSSES[loss])


@pytest.mark.parametrize("mode", AGGREGATION_MODES[1:])
@pytest.mark.parametrize("loss", ["ppo", "reinforce"])
def test_library_losses_pass_every_aggregation(loss, mode):
    check_policy_loss(functools.partial(LOSSES[loss], aggregation=mode), aggregation=mode, max_examples=10)


def test_grpo_with_kl_term_at_equal_policies_passes():
    # k3 has zero value and zero gradient where log_probs == ref_log_probs.
    def grpo_kl(lp, old, A, mask):
        return grpo_loss(lp, old, A, mask, ref_log_probs=lp.detach(), kl_coef=0.1)

    check_policy_loss(grpo_kl, max_examples=10)


def test_wrong_aggregation_claim_fails():
    with pytest.raises(AssertionError, match="on-policy gradient") as info:
        check_policy_loss(ppo_loss, aggregation="seq-mean-token-mean", max_examples=10)
    assert "mask = tensor(" in str(info.value) and "expected = tensor(" in str(info.value)


def test_wrong_sign_fails():
    def gradient_ascent(lp, old, A, mask):
        loss, metrics = reinforce_loss(lp, A, mask)
        return -loss, metrics

    with pytest.raises(AssertionError, match="on-policy gradient"):
        check_policy_loss(gradient_ascent, max_examples=10)


def test_normalizing_by_all_positions_fails():
    # Divides by B * T (padding included) instead of the counted tokens.
    def per_position_mean(lp, old, A, mask):
        A = A.unsqueeze(-1) if A.dim() == 1 else A
        return torch.where(mask, -A * lp, 0.0).sum() / mask.numel()

    with pytest.raises(AssertionError, match="on-policy gradient"):
        check_policy_loss(per_position_mean, max_examples=10)


def test_search_finds_a_bug_the_fixed_example_misses():
    # The fixed example has [B] advantages; only drawn batches have [B, T] ones, which this
    # loss wrongly averages over each row (padding included) before use.
    def row_mean_advantages(lp, old, A, mask):
        if A.dim() == 2:
            A = A.mean(-1)
        return ppo_loss(lp, old, A, mask)

    check_policy_loss(row_mean_advantages, advantage_level="sequence", max_examples=10)
    with pytest.raises(AssertionError, match="on-policy gradient") as info:
        check_policy_loss(row_mean_advantages, max_examples=25)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert notes and "explicit" not in notes  # found on a drawn batch, not the fixed one


def test_multiplying_by_the_mask_leaks_nan():
    # The classic (x * mask).sum(): NaN * 0 is NaN.
    def times_mask(lp, old, A, mask):
        A = A.unsqueeze(-1) if A.dim() == 1 else A
        return (-A * lp * mask).sum() / mask.sum().clamp(min=1)

    with pytest.raises(AssertionError, match="NaN at positions where mask is False leaks"):
        check_policy_loss(times_mask, max_examples=10)


def test_dividing_by_an_empty_count_fails():
    def unclamped(lp, old, A, mask):
        A = A.unsqueeze(-1) if A.dim() == 1 else A
        return torch.where(mask, -A * lp, 0.0).sum() / mask.sum()

    with pytest.raises(AssertionError, match="(not finite|with an empty mask)"):
        check_policy_loss(unclamped, max_examples=10)


def test_loss_depending_on_padding_rows_fails_masked_equals_sliced():
    # Right gradient, but a value that changes with the number of (empty) rows.
    def row_dependent(lp, old, A, mask):
        loss, metrics = ppo_loss(lp, old, A, mask)
        return loss + 1e-2 * (~mask.any(-1)).sum(), metrics

    with pytest.raises(AssertionError, match="dropping the rows with no counted token changes the loss"):
        check_policy_loss(row_dependent, max_examples=10)


def test_loss_must_be_a_scalar():
    with pytest.raises(AssertionError, match="expected a float scalar tensor"):
        check_policy_loss(lambda lp, old, A, mask: torch.where(mask, lp, 0.0), max_examples=5)


# ----------------------------------------------------------------------------------------
# check_aggregation_exact
# ----------------------------------------------------------------------------------------

def test_aggregate_is_exact():
    check_aggregation_exact(aggregate)


def test_aggregation_object_is_exact():
    def via_object(per_token, mask, *, mode, num_tokens, num_sequences, dp_size):
        return Aggregation(mode, num_tokens=num_tokens, num_sequences=num_sequences, dp_size=dp_size)(per_token, mask)

    check_aggregation_exact(via_object, max_examples=10)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_averaging_per_rank_means_is_not_exact(mode):
    def per_rank(per_token, mask, *, mode, num_tokens, num_sequences, dp_size):
        return aggregate(per_token, mask, mode=mode)  # local counts: biased across ranks

    with pytest.raises(AssertionError, match=f"mode='{mode}', dp_size=2.*one process gives") as info:
        check_aggregation_exact(per_rank, modes=[mode], max_examples=5)
    assert "rows per micro-batch [1, 3]" in str(info.value)  # the fixed uneven split


def test_ignoring_dp_size_is_not_exact():
    def no_dp(per_token, mask, *, mode, num_tokens, num_sequences, dp_size):
        return aggregate(per_token, mask, mode=mode, num_tokens=num_tokens, num_sequences=num_sequences)

    with pytest.raises(AssertionError, match="one process gives"):
        check_aggregation_exact(no_dp, max_examples=5)


def test_aggregation_leaking_nan_fails_against_reference():
    def times_mask(per_token, mask, *, mode, num_tokens, num_sequences, dp_size):
        return dp_size * (per_token * mask).sum() / max(int(num_tokens), 1)

    with pytest.raises(AssertionError, match="the reference gives"):
        check_aggregation_exact(times_mask, modes=["token-mean"], max_examples=5)
    # without NaN outside the mask it is an exact token-mean
    check_aggregation_exact(times_mask, modes=["token-mean"], nan_outside_mask=False, max_examples=10)


def test_own_mode_without_reference():
    # A mode of one's own (token-sum over the global sequence count): exact, no reference.
    def token_sum_per_sequence(per_token, mask, *, mode, num_tokens, num_sequences, dp_size):
        assert mode == "token-sum-per-seq"
        return dp_size * torch.where(mask, per_token, 0.0).sum() / max(int(num_sequences), 1)

    check_aggregation_exact(token_sum_per_sequence, modes=["token-sum-per-seq"], reference=None, max_examples=10)
    with pytest.raises(InvalidArgumentError, match="modes must be a non-empty sequence"):
        check_aggregation_exact(aggregate, modes=[])

