"""Tests for torchforge.testing: the strategies draw what they promise, the library's own
estimators and losses pass the checks, and deliberately wrong ones fail them."""

import importlib
import sys

import pytest
import torch
from hypothesis import given, settings

import torchforge.testing as tft
from torchforge.advantages import group_advantages
from torchforge.errors import InvalidArgumentError
from torchforge.kl import approx_kl
from torchforge.losses import ppo_loss
from torchforge.testing import (
    batches,
    check_advantage_estimator,
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
        strategies = importlib.reload(tft.strategies)
        checks = importlib.reload(tft.checks)
        assert strategies.hypothesis is None
        with pytest.raises(ImportError, match=r"masks needs hypothesis.*torchforge\[dev\]"):
            strategies.masks()
        with pytest.raises(ImportError, match="check_policy_loss needs hypothesis"):
            checks.check_policy_loss(ppo_loss)
    finally:
        monkeypatch.undo()
        importlib.reload(tft.strategies)
        importlib.reload(tft.checks)
        importlib.reload(tft)
    assert tft.strategies.hypothesis is not None
