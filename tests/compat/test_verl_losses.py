"""torchforge.compat.verl's losses against verl 0.9.1's own ``core_algos``, on the same float64 inputs.

Each test calls verl's function and its twin on clones of the same leaf tensors and
compares the loss, every metric and the gradients (w.r.t. ``log_prob``; ``vpreds`` for the
value loss, ``logits`` for the entropy), with verl's own ``ActorConfig`` (and
``PolicyLossConfig``) as ``config``.

Tolerance: torchforge computes in float32 (its numerical contract), verl in the inputs'
float64, so the two agree to float32 rounding; ``_close`` allows 1e-6 of the largest
magnitude compared (at least 1), far below any difference of semantics (a normaliser, a
clip, a dropped token change results by more than 1e-3).

Where verl's loss is NaN (an empty mask with this call's counts: 0 / 0) the twin's is 0
with zero gradient, torchforge's contract; the test asserts both.
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings

import pytest
import torch

from tests.compat.conftest import require_peer
from torchforge.compat import verl as tf_verl
from torchforge.errors import InvalidArgumentError

pytestmark = pytest.mark.compat

REL = 1e-6
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
                 "cispo")   # bypass_mode, which needs verl's rollout correction config: test_verl_rollout_correction
CASES = ("ordinary", "extreme", "offset", "empty")
B, T = 6, 9


def _core():
    return require_peer("verl.trainer.ppo.core_algos")


def _config(global_batch_info=None, **overrides):
    """verl's real ActorConfig, with a PolicyLossConfig whose selections pick several tokens."""
    require_peer("verl.workers.config")
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy_loss = PolicyLossConfig(clip_cov_ratio=0.2, kl_cov_ratio=0.2, dro_beta=0.5, clip_cov_lb=0.2,
                                   clip_cov_ub=3.0)
    fields = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss,
                  clip_ratio_high=0.28, global_batch_info=dict(global_batch_info or {}))
    fields.update(overrides)
    return ActorConfig(**fields)


def _close(actual, expected, what, atol=0.0):
    """|actual - expected| <= max(REL * max(|expected|, 1), atol), elementwise, in float64."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=max(REL * max(scale, 1.0), atol),
                               msg=lambda m: f"{what}: {m}")


def _inputs(case: str, seed: int = 0):
    """Float64 (old_log_prob, log_prob, advantages, response_mask, rollout_is_weights).

    ordinary: log-ratios ~ N(0, 0.3); extreme: log-ratios of +-50 on log-probs <= 0; offset:
    advantages + 1e4; empty: no token counted. The mask is 0/1 int64 with one empty row."""
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.01
    if case == "extreme":
        up = torch.rand(B, T, generator=g) < 0.5
        old = torch.where(up, lp - 50, lp)
        lp = torch.where(up, lp, lp - 50)
    else:
        old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
        old = old.clamp(max=-1e-3)
    A = torch.randn(B, T, generator=g, dtype=torch.float64)
    if case == "offset":
        A = A + 1e4
    mask = (torch.rand(B, T, generator=g) < 0.75).long()
    mask[1] = 0
    mask[:, 0] = torch.where(torch.arange(B) == 1, 0, 1)
    if case == "empty":
        mask.zero_()
    weights = 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)
    return old, lp, A, mask, weights


def _compare_loss(what, ours, theirs, lp_ours, lp_theirs, loss_atol=0.0):
    (loss_o, metrics_o), (loss_t, metrics_t) = ours, theirs
    assert set(metrics_o) == set(metrics_t), f"{what}: metric names {sorted(metrics_o)} != {sorted(metrics_t)}"
    for key in metrics_t:
        assert type(metrics_o[key]) is type(metrics_t[key]), f"{what}: {key} is {type(metrics_o[key])}"
        _close(metrics_o[key], metrics_t[key], f"{what} {key}")
    if torch.isnan(loss_t):  # verl's 0 / 0 on an empty mask: the twin keeps torchforge's 0
        assert loss_o.item() == 0.0, f"{what}: verl's loss is NaN (0 / 0), expected 0, got {loss_o.item()}"
        loss_o.backward()
        assert lp_ours.grad is None or not lp_ours.grad.any(), f"{what}: gradient on an empty mask"
        return
    _close(loss_o, loss_t, f"{what} loss", loss_atol)
    loss_o.backward()
    loss_t.backward()
    grad_o = torch.zeros_like(lp_ours) if lp_ours.grad is None else lp_ours.grad
    _close(grad_o, lp_theirs.grad, f"{what} grad")


def _run(name, case, loss_agg_mode, with_weights, global_batch_info=None, seed=0):
    core = _core()
    config = _config(global_batch_info)
    old, lp, A, mask, weights = _inputs(case, seed)
    lp_t, lp_o = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    w = weights if with_weights else None
    args = dict(loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=w)
    torch.manual_seed(seed)   # clip_cov's draw: the same seed draws the same tokens
    theirs = core.get_policy_loss_fn(name)(old, lp_t, A, mask, **args)
    torch.manual_seed(seed)
    ours = tf_verl.get_policy_loss_fn(name)(old, lp_o, A, mask, **args)
    _compare_loss(f"{name} {case} {loss_agg_mode} weights={with_weights} {global_batch_info}", ours, theirs,
                  lp_o, lp_t)


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("case", CASES)
def test_policy_losses_equal_verls(name, case):
    for loss_agg_mode, with_weights in itertools.product(MODES, (False, True)):
        _run(name, case, loss_agg_mode, with_weights)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_policy_losses_equal_verls_with_global_batch_info(name):
    """verl's actor passes the global counts: dp_size 2, and counts not this call's."""
    info = dict(dp_size=2, batch_num_tokens=61, global_batch_size=11, loss_scale_factor=13)
    for case, loss_agg_mode in itertools.product(("ordinary", "empty"), MODES):
        _run(name, case, loss_agg_mode, with_weights=True, global_batch_info=info)


@pytest.mark.parametrize("seed", range(4))
def test_policy_losses_equal_verls_across_seeds(seed):
    """Other draws of the inputs (and of clip_cov's tokens)."""
    for name in POLICY_LOSSES:
        _run(name, "ordinary", "token-mean", with_weights=False, seed=seed)


def test_clip_cov_and_kl_cov_select_tokens():
    """The covariance losses' selections are not empty here, so the equality tests see them:
    a loss with the selection differs from the plain surrogate."""
    old, lp, A, mask, _ = _inputs("ordinary")
    config = _config()
    torch.manual_seed(0)
    _, metrics = tf_verl.compute_policy_loss_clip_cov(old, lp, A, mask, config=config)
    assert metrics["actor/pg_clipfrac"] > 0
    loss, _ = tf_verl.compute_policy_loss_kl_cov(old, lp, A, mask, config=config)
    unpenalized = -(A * torch.exp(lp - old) * mask).sum() / mask.sum()
    assert abs(loss.item() - unpenalized.item()) > 1e-3


def test_deprecated_compute_policy_loss_equals_verls():
    core = _core()
    for case, loss_agg_mode in itertools.product(CASES, MODES):
        old, lp, A, mask, _ = _inputs(case)
        lp_t, lp_o = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            theirs = core.compute_policy_loss(old, lp_t, A, mask, 0.2, None, 0.28, 3.0, loss_agg_mode)
        with pytest.warns(FutureWarning, match="deprecated"):
            ours = tf_verl.compute_policy_loss(old, lp_o, A, mask, 0.2, None, 0.28, 3.0, loss_agg_mode)
        for i, label in enumerate(("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"), start=1):
            _close(ours[i], theirs[i], f"compute_policy_loss {case} {loss_agg_mode} {label}")
        _compare_loss(f"compute_policy_loss {case} {loss_agg_mode}", (ours[0], {}), (theirs[0], {}), lp_o, lp_t)


@pytest.mark.parametrize("case", CASES)
def test_reinforce_equals_verls(case):
    core = _core()
    for loss_agg_mode, with_weights in itertools.product(MODES, (False, True)):
        old, lp, A, mask, weights = _inputs(case)
        lp_t, lp_o = lp.clone().requires_grad_(), lp.clone().requires_grad_()
        w = weights if with_weights else None
        theirs = core.compute_policy_loss_reinforce(old, lp_t, A, mask, loss_agg_mode, _config(), w)
        ours = tf_verl.compute_policy_loss_reinforce(old, lp_o, A, mask, loss_agg_mode, _config(), w)
        _compare_loss(f"reinforce {case} {loss_agg_mode} {with_weights}", ours, theirs, lp_o, lp_t)


@pytest.mark.parametrize("case", ("ordinary", "offset", "empty"))
def test_value_loss_equals_verls(case):
    core = _core()
    counts = ({}, dict(dp_size=2, batch_num_tokens=61, global_batch_size=11, loss_scale_factor=13))
    for loss_agg_mode, kwargs in itertools.product(MODES, counts):
        old, lp, A, mask, _ = _inputs(case)
        returns = A                                   # offset: returns near 1e4
        values = returns + torch.randn(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        vpreds = values + 0.5 * (lp - old)            # some moves beyond the clip of 0.2
        v_t, v_o = vpreds.clone().requires_grad_(), vpreds.clone().requires_grad_()
        loss_t, frac_t = core.compute_value_loss(v_t, returns, values, mask, 0.2, loss_agg_mode, **kwargs)
        loss_o, frac_o = tf_verl.compute_value_loss(v_o, returns, values, mask, 0.2, loss_agg_mode, **kwargs)
        what = f"value loss {case} {loss_agg_mode} {kwargs}"
        _close(frac_o, frac_t, f"{what} vf_clipfrac")
        _compare_loss(what, (loss_o, {}), (loss_t, {}), v_o, v_t)


@pytest.mark.parametrize("case", ("ordinary", "extreme", "empty"))
def test_entropy_loss_equals_verls(case):
    core = _core()
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, T, 11, generator=g, dtype=torch.float64) * (50.0 if case == "extreme" else 1.0)
    _, _, _, mask, _ = _inputs(case)
    for loss_agg_mode in MODES:
        x_t, x_o = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        theirs = core.compute_entropy_loss(x_t, mask, loss_agg_mode)
        ours = tf_verl.compute_entropy_loss(x_o, mask, loss_agg_mode)
        _compare_loss(f"entropy {case} {loss_agg_mode}", (ours, {}), (theirs, {}), x_o, x_t)


def test_agg_loss_equals_verls():
    core = _core()
    g = torch.Generator().manual_seed(3)
    loss_mat = torch.randn(B, T, generator=g, dtype=torch.float64) + 1e4
    _, _, _, mask, _ = _inputs("ordinary")
    counts = ({}, dict(dp_size=4, batch_num_tokens=200, global_batch_size=24),
              dict(batch_num_tokens=torch.tensor(50), global_batch_size=torch.tensor(9), loss_scale_factor=5))
    for loss_agg_mode, kwargs in itertools.product(MODES, counts):
        _close(tf_verl.agg_loss(loss_mat, mask, loss_agg_mode, **kwargs),
               core.agg_loss(loss_mat, mask, loss_agg_mode, **kwargs), f"agg_loss {loss_agg_mode} {kwargs}")
    for loss_agg_mode in ("token-mean", "seq-mean-token-mean"):   # dp_size > 1 needs the global count
        with pytest.raises(ValueError):
            core.agg_loss(loss_mat, mask, loss_agg_mode, dp_size=2)
        with pytest.raises(ValueError, match="dp_size=2"):
            tf_verl.agg_loss(loss_mat, mask, loss_agg_mode, dp_size=2)


def _parameters(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", ["agg_loss", "compute_policy_loss", "compute_policy_loss_reinforce",
                                  "compute_entropy_loss", "compute_value_loss", "get_policy_loss_fn",
                                  *(f"compute_policy_loss_{n}" for n in POLICY_LOSSES)])
def test_signatures_equal_verls(name):
    core = _core()
    assert _parameters(getattr(tf_verl, name)) == _parameters(getattr(core, name))


def test_registry_names_equal_verls():
    core = _core()
    assert set(tf_verl.POLICY_LOSS_REGISTRY) == set(core.POLICY_LOSS_REGISTRY)
    for name in tf_verl.POLICY_LOSS_REGISTRY:
        assert tf_verl.get_policy_loss_fn(name).__name__ == core.get_policy_loss_fn(name).__name__


# --- without verl: torchforge's contract, bad input -----------------------------------------------

def test_nan_where_masked_reaches_nothing():
    old, lp, A, mask, _ = _inputs("ordinary")
    config = {"policy_loss": {"dro_beta": 0.5, "clip_cov_ratio": 0.2, "kl_cov_ratio": 0.2}}
    nan_lp = torch.where(mask.bool(), lp, math.nan)
    for name, loss_agg_mode in itertools.product(POLICY_LOSSES, MODES):
        x, y = lp.clone().requires_grad_(), nan_lp.clone().requires_grad_()
        torch.manual_seed(0)
        loss_x, _ = tf_verl.get_policy_loss_fn(name)(old, x, A, mask, loss_agg_mode, config)
        torch.manual_seed(0)
        loss_y, _ = tf_verl.get_policy_loss_fn(name)(old, y, A, mask, loss_agg_mode, config)
        _close(loss_y, loss_x, f"{name} {loss_agg_mode}")
        loss_x.backward(), loss_y.backward()
        _close(y.grad, x.grad, f"{name} {loss_agg_mode} grad")


@pytest.mark.parametrize("loss_agg_mode", MODES)
def test_cispo_equals_the_native_cispo_loss(loss_agg_mode):
    """The twin forms CISPO on reinforce_loss; the native cispo_loss gives the same loss and gradient."""
    from torchforge.compat.verl.losses import _aggregation
    from torchforge.trust_region_losses import cispo_loss

    old, lp, A, mask, weights = _inputs("ordinary")
    x, y = lp.float().clone().requires_grad_(), lp.float().clone().requires_grad_()
    config = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    twin, _ = tf_verl.compute_policy_loss_cispo(old.float(), x, A.float(), mask, loss_agg_mode, config, weights.float())
    native, _ = cispo_loss(y, old.float(), A.float(), mask.bool(), weights.float(), clip_low=0.2, clip_high=0.28,
                           aggregation=_aggregation("test", loss_agg_mode), with_metrics=False)
    twin.backward(), native.backward()
    torch.testing.assert_close(twin, native, rtol=1e-6, atol=0)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=0)


def test_config_as_dict_equals_defaults():
    """A plain dict, and None, read as ActorConfig's defaults (clip 0.2, dual clip 3)."""
    old, lp, A, mask, _ = _inputs("ordinary")
    by_none = tf_verl.compute_policy_loss_vanilla(old, lp, A, mask)
    by_dict = tf_verl.compute_policy_loss_vanilla(old, lp, A, mask, config={"clip_ratio": 0.2, "clip_ratio_c": 3.0})
    assert by_none[1] == by_dict[1]
    assert by_none[0].item() == by_dict[0].item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_response_mask_other_than_0_and_1_raises(dtype):
    """Every value of a non-bool mask other than 0 and 1 is refused, whatever its dtype;
    0/1 (and -0.0) masks give verl's loss."""
    old, lp, A, mask, _ = _inputs("ordinary")
    loss = tf_verl.compute_policy_loss_vanilla(old, lp, A, mask.bool())[0]
    ok = mask.to(dtype)
    if dtype.is_floating_point:
        ok = torch.where(ok == 0, -0.0, ok).to(dtype)
    assert tf_verl.compute_policy_loss_vanilla(old, lp, A, ok)[0].item() == loss.item()
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        bad = [0.5, 2.0, -1.0, 1 + info.eps, 1 - info.eps / 2, info.smallest_normal * info.eps, math.nan,
               math.inf, -math.inf]
    else:
        bad = [2, 255] if dtype == torch.uint8 else [2, -1]
    for value in bad:
        m = mask.to(dtype).clone()
        m[0, 0] = value
        with pytest.raises(InvalidArgumentError, match="response_mask has values other than 0 and 1"):
            tf_verl.compute_policy_loss_vanilla(old, lp, A, m)


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n != "gpg"])   # gpg reads no old_log_prob
def test_old_log_prob_of_another_shape_or_dtype_raises(name):
    """No twin broadcasts a [B] old_log_prob over the tokens, or reads integers as log-probs."""
    old, lp, A, mask, _ = _inputs("ordinary")
    config = {"policy_loss": {"dro_beta": 0.5, "clip_cov_ratio": 0.2, "kl_cov_ratio": 0.2}}
    loss_fn = tf_verl.get_policy_loss_fn(name)
    with pytest.raises(ValueError, match=rf"old_log_probs? has shape \({B},\) but log_probs? has shape"):
        loss_fn(old[:, 0], lp, A, mask, "token-mean", config)
    with pytest.raises(TypeError, match="old_log_probs? has dtype torch.int64; expected a floating-point"):
        loss_fn(old.long(), lp, A, mask, "token-mean", config)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "cispo"])
def test_rollout_is_weights_of_another_shape_or_dtype_raises(name):
    """The twins that multiply rollout_is_weights in themselves check it as the native losses do."""
    old, lp, A, mask, weights = _inputs("ordinary")
    loss_fn = tf_verl.get_policy_loss_fn(name)
    with pytest.raises(ValueError, match=rf"rollout_is_weights has shape \({T},\) but log_probs? has shape"):
        loss_fn(old, lp, A, mask, "token-mean", None, weights[0])
    with pytest.raises(TypeError, match="rollout_is_weights has dtype torch.int64"):
        loss_fn(old, lp, A, mask, "token-mean", None, weights.long())


def test_bad_input():
    old, lp, A, mask, _ = _inputs("ordinary")
    with pytest.raises(InvalidArgumentError, match="response_mask has values other than 0 and 1"):
        tf_verl.compute_policy_loss_vanilla(old, lp, A, mask * 2)
    with pytest.raises(InvalidArgumentError, match="loss_agg_mode is 'mean'"):
        tf_verl.compute_policy_loss_vanilla(old, lp, A, mask, "mean")
    with pytest.raises(InvalidArgumentError, match="dro_beta must be a positive value"):
        tf_verl.compute_policy_loss_dro(old, lp, A, mask)
    with pytest.raises(InvalidArgumentError, match="clip_ratio_c must be > 1.0"):
        tf_verl.compute_policy_loss_vanilla(old, lp, A, mask, config={"clip_ratio_c": 1.0})
    with pytest.raises(InvalidArgumentError, match="unsupported loss mode 'nope'"):
        tf_verl.get_policy_loss_fn("nope")
    with pytest.raises(ValueError, match=r"advantages has shape \(6, 8\)"):
        tf_verl.compute_policy_loss_vanilla(old, lp, A[:, :-1], mask)
