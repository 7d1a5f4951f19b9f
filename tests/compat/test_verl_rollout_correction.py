"""torchforge.compat.verl's rollout correction and ``bypass_mode`` loss against verl 0.9.1's own
``rollout_corr_helper`` and ``core_algos``, on the same float64 inputs.

The inputs and tolerance are those of test_verl_losses: log-ratios ~ N(0, 0.3) (ordinary),
of +-50 (extreme), advantages + 1e4 (offset); torchforge computes in float32, verl in the
inputs' float64, so values agree to 1e-6 of the largest magnitude compared (at least 1).
Every metric verl returns is compared, by name and value; masks exactly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.compat.conftest import require_peer
from tests.compat.test_verl_losses import MODES, _close, _compare_loss, _config, _inputs
from torchforge.compat import verl as tf_verl
from torchforge.errors import InvalidArgumentError

pytestmark = pytest.mark.compat

CASES = ("ordinary", "extreme", "offset")
IS_THRESHOLDS = (2.0, 5, "0.5_2.0", "0.9_1.1")
RS_OPTIONS = (  # (rollout_rs, rollout_rs_threshold): every option, shared and per-option thresholds
    ("token_k1", 2.0), ("token_k2", 0.1), ("token_k3", "0.2"), ("seq_sum_k1", "0.5_3"), ("seq_sum_k2", 1.0),
    ("seq_sum_k3", 2.0), ("seq_mean_k1", 2.0), ("seq_mean_k2", 0.05), ("seq_mean_k3", 0.05),
    ("seq_max_k2", 0.5), ("seq_max_k3", 0.5), ("token_k1,seq_mean_k3", "1.5,0.05"), ("token_k2,seq_max_k3", 0.3),
)


def _helper():
    return require_peer("verl.trainer.ppo.rollout_corr_helper")


def _log_ratio(case, seed=0, bool_mask=False):
    old, lp, _, mask, _ = _inputs(case, seed)
    return lp - old, (mask.bool() if bool_mask else mask)


def _same_metrics(what, ours, theirs):
    assert set(ours) == set(theirs), f"{what}: metric names differ: {sorted(set(ours) ^ set(theirs))}"
    for key in theirs:
        assert type(ours[key]) is float, f"{what}: {key} is {type(ours[key])}"
        _close(ours[key], theirs[key], f"{what} {key}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rollout_is", ("token", "sequence"))
def test_is_weights_equal_verls(case, rollout_is):
    helper = _helper()
    zero_division = 0
    for seed, threshold, normalize in itertools.product(range(3), IS_THRESHOLDS, (False, True)):
        log_ratio, mask = _log_ratio(case, seed)
        what = f"weights {case} {rollout_is} {threshold} normalize={normalize} seed={seed}"
        ours, ours_metrics = tf_verl.compute_rollout_correction_weights(log_ratio, mask, rollout_is, threshold,
                                                                        normalize)
        try:
            theirs, theirs_metrics = helper.compute_rollout_correction_weights(log_ratio, mask, rollout_is, threshold,
                                                                               normalize)
        except ZeroDivisionError:  # IcePop rejected every weight: verl's ESS divides by 0
            zero_division += 1
            assert not ours.any(), what
            assert ours_metrics["rollout_is_eff_sample_size"] == 0.0, what
            continue
        _close(ours, theirs, what)
        assert not ours.requires_grad
        _same_metrics(what, ours_metrics, theirs_metrics)
    assert zero_division < 24, "verl raised on every draw: nothing was compared"


@pytest.mark.parametrize("case", CASES)
def test_rejection_masks_equal_verls(case):
    helper = _helper()
    rejected = 0
    for seed, (rs, threshold), bool_mask in itertools.product(range(3), RS_OPTIONS, (False, True)):
        log_ratio, mask = _log_ratio(case, seed, bool_mask)
        what = f"rejection {case} {rs} {threshold} seed={seed} bool={bool_mask}"
        ours, ours_metrics = tf_verl.compute_rollout_rejection_mask(log_ratio, mask, rs, threshold)
        theirs, theirs_metrics = helper.compute_rollout_rejection_mask(log_ratio, mask, rs, threshold)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), f"{what}: {ours} != {theirs}"
        rejected += int((theirs != mask).sum())
        _same_metrics(what, ours_metrics, theirs_metrics)
    assert rejected > 0, "no option rejected a token: the masks were not tested"


@pytest.mark.parametrize("case", CASES)
def test_offpolicy_metrics_equal_verls(case):
    helper = _helper()
    for seed in range(3):
        old, lp, _, mask, _ = _inputs(case, seed)
        _same_metrics(f"offpolicy {case}", tf_verl.compute_offpolicy_metrics(lp, old, mask),
                      helper.compute_offpolicy_metrics(lp, old, mask))
        _same_metrics(f"offpolicy {case} no rollout", tf_verl.compute_offpolicy_metrics(lp, None, mask),
                      helper.compute_offpolicy_metrics(lp, None, mask))
        _same_metrics(f"from_logprobs {case}", tf_verl.compute_rollout_corr_metrics_from_logprobs(lp, old, mask),
                      helper.compute_rollout_corr_metrics_from_logprobs(lp, old, mask))


def test_is_and_rs_metrics_equal_verls_called_directly():
    helper = _helper()
    log_ratio, mask = _log_ratio("ordinary")
    raw = torch.exp(log_ratio) * mask
    weights = raw.clamp(max=2.0)
    for rollout_is in ("token", "sequence"):
        level = log_ratio if rollout_is == "token" else (log_ratio * mask).sum(-1, keepdim=True)
        args = (weights, raw, level, mask, rollout_is, 2.0)
        _same_metrics(f"is_metrics {rollout_is}", tf_verl.compute_is_metrics(*args), helper.compute_is_metrics(*args))
    stat = 0.5 * log_ratio.square()
    rows = mask.sum(-1) > 0
    for level, per_row in (("token", None), ("sequence", (stat * mask).sum(-1))):
        kwargs = dict(level=level, per_sequence_values=per_row, rollout_rs_threshold=0.1,
                      rollout_rs_threshold_lower=math.log(0.5), apply_lower_threshold=level == "token")
        _same_metrics(f"rs_metrics {level}", tf_verl.compute_rs_metrics("x", stat, mask, rows, **kwargs),
                      helper.compute_rs_metrics("x", stat, mask, rows, **kwargs))


@pytest.mark.parametrize("case", CASES)
def test_correction_and_rejection_mask_equal_verls(case):
    helper = _helper()
    settings = [dict(), dict(rollout_is="token"), dict(rollout_is="sequence", rollout_is_threshold="0.5_3"),
                dict(rollout_is="token", rollout_is_threshold=None),
                dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05),
                dict(rollout_is="sequence", rollout_is_batch_normalize=True, rollout_rs="token_k1,seq_max_k2",
                     rollout_rs_threshold="1.5,0.5")]
    for seed, kwargs in itertools.product(range(3), settings):
        old, lp, _, mask, _ = _inputs(case, seed)
        what = f"pipeline {case} {kwargs} seed={seed}"
        ours = tf_verl.compute_rollout_correction_and_rejection_mask(lp, old, mask, **kwargs)
        try:
            theirs = helper.compute_rollout_correction_and_rejection_mask(lp, old, mask, **kwargs)
        except ZeroDivisionError:
            continue  # IcePop rejected every weight (see test_is_weights_equal_verls)
        assert (ours[0] is None) == (theirs[0] is None), what
        if theirs[0] is not None:
            _close(ours[0].batch["rollout_is_weights"], theirs[0].batch["rollout_is_weights"], what)
        assert torch.equal(ours[1], theirs[1]), what
        _same_metrics(what, ours[2], theirs[2])


def _bypass_config(global_batch_info=None, **correction):
    require_peer("verl.trainer.config.algorithm")
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import PolicyLossConfig

    policy_loss = PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=RolloutCorrectionConfig(**correction))
    return _config(global_batch_info, policy_loss=policy_loss)


BYPASS_SETTINGS = (
    dict(loss_type="ppo_clip"),                                      # verl's default: rollout_is="sequence"
    dict(loss_type="ppo_clip", rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold=2.0),
    dict(loss_type="reinforce", rollout_is="token"),
    dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold="0.2_5", rollout_is_batch_normalize=True,
         rollout_rs="seq_mean_k3", rollout_rs_threshold=0.1),
    dict(loss_type="reinforce", rollout_is=None),
)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("setting", range(len(BYPASS_SETTINGS)))
def test_bypass_mode_equals_verls(case, setting):
    core = require_peer("verl.trainer.ppo.core_algos")
    counts = (None, dict(dp_size=2, batch_num_tokens=61, global_batch_size=11, loss_scale_factor=13))
    for seed, loss_agg_mode, info in itertools.product(range(2), MODES, counts):
        config = _bypass_config(info, **BYPASS_SETTINGS[setting])
        old, lp, A, mask, weights = _inputs(case, seed)
        lp_t, lp_o = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        what = f"bypass {case} {BYPASS_SETTINGS[setting]} {loss_agg_mode} {info} seed={seed}"
        try:
            theirs = core.compute_policy_loss_bypass_mode(old, lp_t, A, mask, loss_agg_mode, config, weights)
        except ZeroDivisionError:
            continue
        ours = tf_verl.get_policy_loss_fn("bypass_mode")(old, lp_o, A, mask, loss_agg_mode, config, weights)
        _compare_loss(what, ours, theirs, lp_o, lp_t, _float32_rounding(core, old, lp, A, mask, loss_agg_mode, config))


def _float32_rounding(core, old, lp, A, mask, loss_agg_mode, config):
    """Four times the distance of verl's own loss on the float32 inputs from its float64 one.

    token-sum adds some 40 float32 terms near 1 (doubled by dp_size=2): their rounding,
    about 1e-6 of the loss, is float32's, not a difference of semantics; verl in float32
    makes it too, and this allows the twin that much."""
    with torch.no_grad():
        f32 = core.compute_policy_loss_bypass_mode(old.float(), lp.float(), A.float(), mask, loss_agg_mode, config)[0]
        f64 = core.compute_policy_loss_bypass_mode(old, lp, A, mask, loss_agg_mode, config)[0]
    return 4 * abs(f32.double() - f64).item()


def test_bypass_mode_reads_a_plain_dict_as_verls_config():
    core = require_peer("verl.trainer.ppo.core_algos")
    correction = dict(loss_type="reinforce", rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=0.1)
    old, lp, A, mask, _ = _inputs("ordinary")
    lp_t, lp_o = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    theirs = core.compute_policy_loss_bypass_mode(old, lp_t, A, mask, "token-mean", _bypass_config(**correction))
    as_dict = {"clip_ratio_high": 0.28, "policy_loss": {"rollout_correction": correction}}
    ours = tf_verl.compute_policy_loss_bypass_mode(old, lp_o, A, mask, "token-mean", as_dict)
    _compare_loss("bypass from a dict", ours, theirs, lp_o, lp_t)


def test_signatures_equal_verls():
    helper, core = _helper(), require_peer("verl.trainer.ppo.core_algos")
    from tests.compat.test_verl_losses import _parameters

    assert _parameters(tf_verl.compute_policy_loss_bypass_mode) == _parameters(core.compute_policy_loss_bypass_mode)
    for name in ("compute_rollout_correction_weights", "compute_is_metrics", "compute_rollout_rejection_mask",
                 "compute_rs_metrics", "compute_rollout_correction_and_rejection_mask", "compute_offpolicy_metrics",
                 "compute_rollout_corr_metrics_from_logprobs"):
        assert _parameters(getattr(tf_verl, name)) == _parameters(getattr(helper, name)), name
    assert tf_verl.SUPPORTED_ROLLOUT_RS_OPTIONS == helper.SUPPORTED_ROLLOUT_RS_OPTIONS
    assert tf_verl.SAFETY_BOUND == helper.SAFETY_BOUND


def test_empty_mask_raises_as_verls():
    helper = _helper()
    old, lp, _, mask, _ = _inputs("empty")
    with pytest.raises(ValueError, match="at least one valid token"):
        helper.compute_rollout_correction_and_rejection_mask(lp, old, mask, rollout_is="token")
    with pytest.raises(InvalidArgumentError, match="response_mask counts no token"):
        tf_verl.compute_rollout_correction_and_rejection_mask(lp, old, mask, rollout_is="token")


# --- without verl: the contract and bad input -----------------------------------------------------

def test_bypass_ppo_clip_is_vanilla_on_the_rejected_mask():
    """ppo_clip ignores the IS weights (the clipped ratio is the correction) and drops the
    rejected tokens from the mask, denominator included."""
    old, lp, A, mask, _ = _inputs("ordinary")
    correction = dict(loss_type="ppo_clip", rollout_is="token", rollout_rs="token_k2", rollout_rs_threshold=0.02)
    loss, metrics = tf_verl.compute_policy_loss_bypass_mode(old, lp, A, mask, "token-mean",
                                                            {"policy_loss": {"rollout_correction": correction}})
    kept = mask.bool() & (0.5 * (lp - old).square() <= 0.02)
    assert 0 < kept.sum() < mask.sum()
    expected, _ = tf_verl.compute_policy_loss_vanilla(old, lp, A, kept.long(), "token-mean")
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 - kept.sum().item() / mask.sum().item())


def test_bypass_reinforce_weights_by_the_truncated_ratio():
    old, lp, A, mask, _ = _inputs("ordinary")
    correction = dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.5)
    lp = lp.clone().requires_grad_()
    loss, _ = tf_verl.compute_policy_loss_bypass_mode(old, lp, A, mask, "token-sum",
                                                      {"policy_loss": {"rollout_correction": correction}})
    weights = torch.exp(lp.detach() - old).clamp(max=1.5)
    expected = -(weights * A * lp.detach() * mask).sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, (-weights * A * mask).to(lp.grad.dtype), rtol=1e-6, atol=1e-6)


def test_bad_input():
    log_ratio, mask = _log_ratio("ordinary")
    fn = tf_verl.compute_rollout_correction_weights
    with pytest.raises(InvalidArgumentError, match="compute_rollout_correction_weights: rollout_is is 'geo'"):
        fn(log_ratio, mask, "geo")
    with pytest.raises(InvalidArgumentError, match="rollout_is_threshold is '3_2'"):
        fn(log_ratio, mask, "token", "3_2")
    with pytest.raises(InvalidArgumentError, match="rollout_is_threshold is True"):
        fn(log_ratio, mask, "token", True)
    with pytest.raises(InvalidArgumentError, match="response_mask has values other than 0 and 1"):
        fn(log_ratio, mask * 2)
    rs = tf_verl.compute_rollout_rejection_mask
    with pytest.raises(InvalidArgumentError, match=r"rollout_rs has \['seq_max_k1'\]"):
        rs(log_ratio, mask, "seq_max_k1", 1.0)
    with pytest.raises(InvalidArgumentError, match="needs rollout_rs_threshold"):
        rs(log_ratio, mask, "token_k2")
    with pytest.raises(InvalidArgumentError, match="2 entries for 3 rollout_rs options"):
        rs(log_ratio, mask, "token_k1,token_k2,token_k3", "2,3")
    with pytest.raises(InvalidArgumentError, match="for token_k2 is '0.1_2'; expected one upper bound"):
        rs(log_ratio, mask, "token_k2", "0.1_2")
    bypass = tf_verl.compute_policy_loss_bypass_mode
    old, lp, A, mask, _ = _inputs("ordinary")
    with pytest.raises(InvalidArgumentError, match="needs config.policy_loss.rollout_correction"):
        bypass(old, lp, A, mask)
    with pytest.raises(InvalidArgumentError, match="loss_type is 'ppo'"):
        bypass(old, lp, A, mask, config={"policy_loss": {"rollout_correction": {"loss_type": "ppo"}}})
