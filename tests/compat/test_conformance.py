"""torchforge.testing's property checks applied to the peers' own functions.

Each peer function has an expected outcome: it passes the check, or it fails one named
property, which the test asserts (the check's message names the property). The README's
conformance table ("Coming from verl / TRL") is these outcomes; a failure there is a
peer's choice, stated as such, not a bug report. The checks stop at the first property
that fails, so a function listed as failing one property is not claimed to pass the rest.

verl is called directly (``verl.trainer.ppo.core_algos``); TRL's loss has no function of
its own, so it is called through ``GRPOTrainer._compute_loss`` by the harness of
test_trl.py. torchforge.compat.trl's twin is checked beside it: it reproduces TRL's
normalizers (so it fails where they do) and keeps torchforge's masking (so it passes where
TRL's ``NaN * 0`` leaks).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.compat.test_trl import _loss_config, trl_loss
from torchforge.compat.trl import grpo_loss, loss_kwargs
from torchforge.testing import check_advantage_estimator, check_aggregation_exact, check_kl_estimator, check_policy_loss

pytestmark = pytest.mark.compat

EXAMPLES = 15  # hypothesis examples per check, besides each check's fixed examples

# The first line of each check's message for the property that fails.
ON_POLICY = "the on-policy gradient"
EMPTY = "with an empty mask the loss should be 0"
NAN_LEAK = "NaN at positions where mask is False leaks"
NOT_UNBIASED = "is not unbiased for KL"
NOT_FINITE = "advantages not finite"
TIES = "has all-equal rewards"
EMPTY_BATCH = "fn on the whole batch gives nan"


def _core_algos():
    return pytest.importorskip("verl.trainer.ppo.core_algos",
                               reason="the verl conformance tests need verl (pip install -e '.[compat]')")


def _expect(check, fails: str | None) -> None:
    """Run ``check``; it passes when ``fails`` is None, else fails with that property."""
    if fails is None:
        check()
        return
    with pytest.raises(AssertionError, match=fails):
        check()


# --- verl: KL estimators --------------------------------------------------------------------

@pytest.mark.parametrize("kl_penalty, claims, fails, why", [
    ("kl", dict(), None, "k1: unbiased, not nonnegative by design"),
    ("low_var_kl", dict(nonnegative=True), None, "k3; its clamps at +-20 / +-10 do not bite here"),
    ("k3+", dict(nonnegative=True), None, "k3's value (the gradient is k2's)"),
    ("mse", dict(nonnegative=True, unbiased=False), None, "k2, checked as the biased estimator it is"),
    ("mse", dict(nonnegative=True), NOT_UNBIASED, "k2 is biased: E[k2] != KL (documented, Schulman)"),
    ("abs", dict(nonnegative=True), NOT_UNBIASED, "|log r| is biased (documented)"),
])
def test_verl_kl_penalty(kl_penalty, claims, fails, why):
    ca = _core_algos()
    _expect(lambda: check_kl_estimator(lambda lp, ref: ca.kl_penalty(lp, ref, kl_penalty),
                                       max_examples=EXAMPLES, **claims), fails)


# --- verl: advantage estimators ----------------------------------------------------------------

def _verl_advantages(estimator, **options):
    fn = _core_algos().get_adv_estimator_fn(estimator)

    def advantages(rewards, *, group_size):
        B = rewards.shape[0]
        index = np.repeat(np.arange(B // group_size), group_size)
        adv, _ = fn(token_level_rewards=rewards.unsqueeze(-1).clone(), response_mask=torch.ones(B, 1),
                    index=index, **options)
        return adv[:, 0]
    return advantages


@pytest.mark.parametrize("estimator, options, claims, fails, why", [
    ("grpo", dict(), dict(), NOT_FINITE, "a NaN reward propagates into its group's advantages"),
    ("grpo", dict(), dict(allow_nan=False), TIES,
     "(r - mean) / (std + 1e-6): a tie whose mean rounds gives residue / 1e-6, not 0 (the epsilon is verl's)"),
    ("grpo_vectorized", dict(), dict(allow_nan=False, group_size=(2, 6)), TIES, "as grpo"),
    ("grpo", dict(norm_adv_by_std_in_grpo=False), dict(allow_nan=False, group_size=(2, 6)), None,
     "Dr. GRPO: no std division"),
    ("rloo", dict(), dict(), NOT_FINITE, "a NaN reward propagates"),
    ("rloo", dict(), dict(allow_nan=False, group_size=(2, 6)), None, "RLOO"),
    ("reinforce_plus_plus_baseline", dict(), dict(allow_nan=False, group_size=(2, 6)), None,
     "batch-whitened group baseline"),
])
def test_verl_advantage_estimators(estimator, options, claims, fails, why):
    fn = _verl_advantages(estimator, **options)
    _expect(lambda: check_advantage_estimator(fn, max_examples=EXAMPLES, **claims), fails)


# --- verl: policy losses and agg_loss --------------------------------------------------------------

def _verl_policy_loss(name, mode):
    ca = _core_algos()
    from verl.workers.config import ActorConfig

    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1,
                         use_dynamic_bsz=False)
    fn = ca.get_policy_loss_fn(name)

    def loss(log_probs, old_log_probs, advantages, mask):
        A = advantages.unsqueeze(-1).expand(log_probs.shape) if advantages.dim() == 1 else advantages
        return fn(old_log_prob=old_log_probs, log_prob=log_probs, advantages=A, response_mask=mask.float(),
                  loss_agg_mode=mode, config=config)
    return loss


@pytest.mark.parametrize("name, mode, fails, why", [
    ("vanilla", "token-mean", EMPTY, "agg_loss divides by the token count unclamped: 0 / 0 on an empty mask"),
    ("vanilla", "seq-mean-token-mean", EMPTY, "as above, 0 / 0 sequences"),
    ("gspo", "seq-mean-token-mean", EMPTY, "as above"),
    ("cispo", "token-mean", EMPTY, "as above"),
    ("gpg", "token-mean", EMPTY, "as above"),
    ("sapo", "token-mean", ON_POLICY, "always reduces with seq-mean-token-mean, whatever loss_agg_mode says"),
    ("sapo", "seq-mean-token-mean", EMPTY, "its own mode; then 0 / 0 on an empty mask"),
    ("geo_mean", "token-mean", ON_POLICY, "GMPO: torch.mean over every row, loss_agg_mode unused"),
])
def test_verl_policy_losses(name, mode, fails, why):
    fn = _verl_policy_loss(name, mode)
    _expect(lambda: check_policy_loss(fn, aggregation=mode, max_examples=EXAMPLES), fails)


def test_verl_bypass_mode():
    """bypass_mode (verl's default correction, sequence IS weights): the rollout correction
    raises on a mask with no token; with that case answered 0 by the caller, it passes."""
    fn = _verl_policy_loss("bypass_mode", "token-mean")
    with pytest.raises(ValueError, match="at least one valid token"):
        check_policy_loss(fn, aggregation="token-mean", max_examples=EXAMPLES)

    def guarded(log_probs, old_log_probs, advantages, mask):
        if not mask.any():
            return torch.where(mask, log_probs, 0.0).sum() * 0, {}
        return fn(log_probs, old_log_probs, advantages, mask)
    check_policy_loss(guarded, aggregation="token-mean", max_examples=EXAMPLES)


def _verl_agg_loss(clamp_counts: bool):
    ca = _core_algos()

    def agg(per_token, mask, *, mode, num_tokens, num_sequences, dp_size):
        if clamp_counts:  # what aggregate does with a zero count
            num_tokens, num_sequences = (max(c, 1) if isinstance(c, int) else c.clamp(min=1)
                                         for c in (num_tokens, num_sequences))
        return ca.agg_loss(per_token, mask.float(), mode, dp_size=dp_size, batch_num_tokens=num_tokens,
                           global_batch_size=num_sequences)
    return agg


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_verl_agg_loss(mode):
    """verl's agg_loss: exact across micro-batches and ranks given non-zero counts; an empty
    batch is 0 / 0 (verl does not clamp its counts); seq-mean-token-mean multiplies by the
    mask, so a NaN where nothing is counted leaks."""
    _expect(lambda: check_aggregation_exact(_verl_agg_loss(False), modes=[mode], nan_outside_mask=False,
                                            max_examples=EXAMPLES), EMPTY_BATCH)
    leaks = mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    _expect(lambda: check_aggregation_exact(_verl_agg_loss(True), modes=[mode], max_examples=EXAMPLES),
            EMPTY_BATCH if leaks else None)
    _expect(lambda: check_aggregation_exact(_verl_agg_loss(True), modes=[mode], nan_outside_mask=False,
                                            max_examples=EXAMPLES), None)


# --- TRL: GRPOTrainer._compute_loss per loss_type, and its compat twin --------------------------------

# The mode each loss type's normalizer would be, were it to divide by the non-empty rows.
TRL_MODES = dict(grpo="seq-mean-token-mean", bnpo="token-mean", dr_grpo="seq-mean-token-sum-norm",
                 dapo="token-mean", luspo="seq-mean-token-sum", cispo="token-mean", sapo="seq-mean-token-mean",
                 vespo="token-mean")
ALL_ROWS = "averages over every row of the micro-batch (empty rows included), not the rows with a counted token"
TRL_OUTCOMES = dict(  # loss_type: (TRL's first failing property, compat's, why)
    grpo=(ON_POLICY, ON_POLICY, ALL_ROWS),
    dr_grpo=(ON_POLICY, ON_POLICY, "divides by every row times max_completion_length (Dr. GRPO's constant)"),
    luspo=(ON_POLICY, ON_POLICY, ALL_ROWS),
    sapo=(ON_POLICY, ON_POLICY, ALL_ROWS),
    bnpo=(NAN_LEAK, None, "masks by multiplying with the mask: NaN * 0 is NaN"),
    dapo=(NAN_LEAK, None, "as bnpo"),
    cispo=(NAN_LEAK, None, "as bnpo"),
    vespo=(NAN_LEAK, None, "as bnpo (its sequence weight then turns NaN to 0)"),
)


def _trl_policy_loss(loss_type, level):
    def loss(log_probs, old_log_probs, advantages, mask):
        config = _loss_config(loss_type, level)
        config.max_completion_length = max(log_probs.shape[-1], 1)  # dr_grpo's constant is then T
        m = mask.long()
        inputs = dict(advantages=advantages, completion_mask=m, old_per_token_logps=old_log_probs,
                      num_items_in_batch=torch.tensor(float(m.sum())))
        return trl_loss(config, log_probs, torch.zeros_like(log_probs), inputs)
    return loss


def _compat_policy_loss(loss_type, level):
    def loss(log_probs, old_log_probs, advantages, mask):
        config = _loss_config(loss_type, level)
        config.max_completion_length = max(log_probs.shape[-1], 1)
        return grpo_loss(log_probs, old_log_probs, advantages, mask, **loss_kwargs(config))
    return loss


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", list(TRL_OUTCOMES))
def test_trl_losses(loss_type, level):
    pytest.importorskip("trl", reason="the TRL conformance tests need trl (pip install -e '.[compat]')")
    trl_fails, compat_fails, _ = TRL_OUTCOMES[loss_type]
    advantage_level = "sequence" if level == "sequence" else "any"
    for make, fails in ((_trl_policy_loss, trl_fails), (_compat_policy_loss, compat_fails)):
        _expect(lambda: check_policy_loss(make(loss_type, level), aggregation=TRL_MODES[loss_type],
                                          advantage_level=advantage_level, max_examples=EXAMPLES), fails)
