"""Tests for torchforge.testing: the strategies draw what they promise, the library's own
estimators and losses pass the checks, and deliberately wrong ones fail them."""

import functools
import math

import pytest
import torch
from hypothesis import settings

from torchforge.advantages import group_advantages, rloo_advantages
from torchforge.errors import InvalidArgumentError
from torchforge.kl import KL_ESTIMATORS, approx_kl
from torchforge.losses import grpo_loss, ppo_loss, reinforce_loss
from torchforge.trust_region_losses import cispo_loss
from torchforge.reduce import AGGREGATION_MODES, Aggregation, aggregate
from torchforge.testing import (
    check_advantage_estimator,
    check_aggregation_exact,
    check_kl_estimator,
    check_policy_loss,
)

# Strategy tests collect what 60 deterministic draws produced, then assert on the set.
DRAWS = settings(max_examples=60, deadline=None, derandomize=True, database=None)

# (estimator, nonnegative, unbiased): k1 and k3 are unbiased for KL(pi || ref); k2 and abs
# are not; k2, k3 and abs are >= 0. k3 is unbiased only as Schulman wrote it
# (max_ratio=inf): approx_kl's default continues it along its tangent beyond
# ref / pi = max_ratio = 2 (bounded gradient), which biases it there (tested below).
KL_CLAIMS = {"k1": (False, True), "k2": (True, False), "k3": (True, True), "abs": (True, False)}


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_library_kl_estimators_pass(estimator):
    nonnegative, unbiased = KL_CLAIMS[estimator]
    max_ratio = math.inf if estimator == "k3" else 2.0  # exact k3; max_ratio changes only k3
    check_kl_estimator(functools.partial(approx_kl, estimator=estimator, max_ratio=max_ratio),
                       nonnegative=nonnegative, unbiased=unbiased)


def test_default_bounded_k3_is_nonnegative_and_biased():
    # The default k3 (tangent beyond ref / pi = 2) keeps k3 >= 0 and 0 at pi = ref ...
    check_kl_estimator(functools.partial(approx_kl, estimator="k3"), nonnegative=True, unbiased=False)
    # ... but is biased where ref / pi > 2 has mass: the check must see it.
    with pytest.raises(AssertionError, match="is not unbiased for KL"):
        check_kl_estimator(functools.partial(approx_kl, estimator="k3"))


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
        return torch.where(mask, -A * lp, 0.0).sum() / mask.numel(), {}

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
        return (-A * lp * mask).sum() / mask.sum().clamp(min=1), {}

    with pytest.raises(AssertionError, match="NaN at positions where mask is False leaks"):
        check_policy_loss(times_mask, max_examples=10)


def test_dividing_by_an_empty_count_fails():
    def unclamped(lp, old, A, mask):
        A = A.unsqueeze(-1) if A.dim() == 1 else A
        return torch.where(mask, -A * lp, 0.0).sum() / mask.sum(), {}

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
        check_policy_loss(lambda lp, old, A, mask: (torch.where(mask, lp, 0.0), {}), max_examples=5)


def test_a_loss_must_return_loss_and_metrics():
    # One contract: every loss returns (loss, metrics); a bare loss is an error, not papered over.
    def bare(lp, old, A, mask):
        return reinforce_loss(lp, A, mask)[0]

    with pytest.raises(AssertionError, match=r"fn returned Tensor .*expected \(loss, metrics\)"):
        check_policy_loss(bare, max_examples=5)



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
