"""Tests for torchforge.kl: approx_kl (sampled estimators) and exact_kl (full vocabulary)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tests.reference import (
    adaptive_kl_coef_ref,
    approx_kl_ref,
    exact_kl_ref,
    verl_low_var_kl_ref,
)
from torchforge.batch import Batch
from torchforge.errors import (
    DTypeError,
    InvalidArgumentError,
    MissingKeyError,
    ShapeError,
)
from torchforge.kl import (
    KL_ESTIMATORS,
    KL_GRADIENTS,
    adaptive_kl_coef,
    approx_kl,
    exact_kl,
)

LN2 = math.log(2.0)
SETTINGS = settings(max_examples=30, deadline=None)


def _categorical(seed, V, spread=1.0):
    """Two random categorical distributions pi, ref over V outcomes, as log-probs (float64)."""
    g = torch.Generator().manual_seed(seed)
    log_pi = torch.log_softmax(spread * torch.randn(V, generator=g, dtype=torch.float64), -1)
    log_ref = torch.log_softmax(spread * torch.randn(V, generator=g, dtype=torch.float64), -1)
    return log_pi, log_ref


def _kl(log_p, log_q):
    return float((log_p.exp() * (log_p - log_q)).sum())


# ----------------------------------------------------------------------------------------
# approx_kl: values
# ----------------------------------------------------------------------------------------

def test_approx_kl_hand_derived():
    # Token with pi(y) = 1/2, ref(y) = 1/4: log_ratio = log 2.
    #   k1 = log 2 = 0.693147, k2 = (log 2)^2 / 2 = 0.240227,
    #   k3 = ref/pi - 1 + log 2 = 1/2 - 1 + log 2 = 0.193147, abs = log 2.
    # Token with pi(y) = 1/4, ref(y) = 1/2: log_ratio = -log 2.
    #   k1 = -log 2, k2 = 0.240227, k3 = 2 - 1 - log 2 = 0.306853, abs = log 2.
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    expected = {
        "k1": [LN2, -LN2],
        "k2": [LN2**2 / 2, LN2**2 / 2],
        "k3": [-0.5 + LN2, 1 - LN2],
        "abs": [LN2, LN2],
    }
    for estimator, values in expected.items():
        out = approx_kl(lp, ref, estimator=estimator)
        assert out.dtype == torch.float32 and out.shape == (1, 2)
        torch.testing.assert_close(out, torch.tensor([values]), rtol=0, atol=1e-6)
    assert approx_kl(lp, ref).equal(approx_kl(lp, ref, estimator="k3"))  # default is k3


@SETTINGS
@given(
    B=st.integers(1, 4), T=st.integers(1, 6), seed=st.integers(0, 10_000),
    estimator=st.sampled_from(KL_ESTIMATORS),
)
def test_approx_kl_matches_reference(B, T, seed, estimator):
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(B, T, generator=g)
    ref = -3 * torch.rand(B, T, generator=g)
    # max_ratio=inf: Schulman's k3 as written (the default bounds it where ref / pi > 2)
    out = approx_kl(lp, ref, estimator=estimator, max_ratio=math.inf)
    torch.testing.assert_close(out.double(), approx_kl_ref(lp, ref, estimator), rtol=1e-5, atol=1e-6)


@SETTINGS
@given(
    log_ratio=st.lists(st.floats(-30, 30, allow_nan=False), min_size=1, max_size=20),
    estimator=st.sampled_from(["k2", "k3", "abs"]),
)
def test_approx_kl_nonnegative_estimators(log_ratio, estimator):
    lr = torch.tensor(log_ratio)
    assert (approx_kl(lr, torch.zeros_like(lr), estimator=estimator) >= 0).all()


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("gradient", KL_GRADIENTS)
def test_approx_kl_zero_when_policies_equal(estimator, gradient):
    lp = torch.log(torch.rand(3, 5) + 0.01).requires_grad_()
    out = approx_kl(lp, lp.detach(), old_log_probs=lp.detach(), estimator=estimator, gradient=gradient)
    assert out.equal(torch.zeros(3, 5))
    out.sum().backward()
    # k2, k3, abs and every straight-through estimate have their minimum there: zero
    # gradient. k1 = log_ratio is linear: its per-token gradient is 1 (bias-corrected:
    # 1 * rho + k1 * rho = 1 at k1 = 0, rho = 1).
    expected_grad = 1.0 if estimator == "k1" and gradient != "straight-through" else 0.0
    assert lp.grad.equal(torch.full((3, 5), expected_grad))


def test_approx_kl_bf16_input_gives_float32():
    lp = torch.log(torch.rand(2, 7) + 0.1).bfloat16()
    ref = torch.log(torch.rand(2, 7) + 0.1).bfloat16()
    out = approx_kl(lp, ref)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, approx_kl(lp.float(), ref.float()), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------
# approx_kl: bias (exact expectations over a categorical, and Monte Carlo)
# ----------------------------------------------------------------------------------------

def _expectation(log_pi, log_ref, estimator, sample_log=None):
    """E_{y ~ exp(sample_log)}[k(y)], exactly: sum over the V outcomes."""
    sample_log = log_pi if sample_log is None else sample_log
    k = approx_kl(log_pi, log_ref, estimator=estimator, max_ratio=math.inf).double()
    return float((sample_log.exp() * k).sum())


@SETTINGS
@given(seed=st.integers(0, 10_000), V=st.integers(2, 12), spread=st.floats(0.1, 3.0))
def test_k1_k3_unbiased_k2_biased_exact_expectation(seed, V, spread):
    log_pi, log_ref = _categorical(seed, V, spread)
    kl = _kl(log_pi, log_ref)
    # k1 and k3 are unbiased: their expectation under pi is KL(pi || ref) exactly.
    assert _expectation(log_pi, log_ref, "k1") == pytest.approx(kl, rel=1e-5, abs=1e-6)
    assert _expectation(log_pi, log_ref, "k3") == pytest.approx(kl, rel=1e-5, abs=1e-6)
    # k2 and abs are not: E[k2] - KL is of order E[log_ratio^3] (here never below 1e-6
    # relative, for distributions this far apart).
    if kl > 1e-2:
        assert abs(_expectation(log_pi, log_ref, "k2") - kl) > 1e-4 * kl


def test_monte_carlo_k1_k3_unbiased_k2_biased():
    # Draw n tokens from pi and average the per-token estimates: k1 and k3 land within 4
    # standard errors of the exact KL(pi || ref); k2 misses it by many standard errors.
    log_pi, log_ref = _categorical(seed=3, V=8, spread=1.5)
    kl = _kl(log_pi, log_ref)
    n = 400_000
    g = torch.Generator().manual_seed(0)
    y = torch.multinomial(log_pi.exp(), n, replacement=True, generator=g)
    lp, ref = log_pi[y].float(), log_ref[y].float()
    for estimator in ("k1", "k3"):
        k = approx_kl(lp, ref, estimator=estimator, max_ratio=math.inf).double()
        stderr = float(k.std()) / math.sqrt(n)
        assert abs(float(k.mean()) - kl) < 4 * stderr, estimator
    k2 = approx_kl(lp, ref, estimator="k2").double()
    assert abs(float(k2.mean()) - kl) > 20 * float(k2.std()) / math.sqrt(n)
    # and k3 has a lower variance than k1 here (the point of k3)
    assert approx_kl(lp, ref, estimator="k3", max_ratio=math.inf).var() < approx_kl(lp, ref, estimator="k1").var()


def test_importance_weights_correct_off_policy_samples():
    # Tokens drawn from pi_old, weighted by pi / pi_old: E_pi_old[w k] = E_pi[k] = KL.
    log_pi, log_ref = _categorical(seed=5, V=10)
    log_old, _ = _categorical(seed=6, V=10)
    weights = (log_pi - log_old).exp()
    kl = _kl(log_pi, log_ref)
    for estimator in ("k1", "k3"):
        k = approx_kl(log_pi, log_ref, weights, estimator=estimator, max_ratio=math.inf).double()
        assert float((log_old.exp() * k).sum()) == pytest.approx(kl, rel=1e-5)
        unweighted = _expectation(log_pi, log_ref, estimator, sample_log=log_old)
        assert abs(unweighted - kl) > 1e-2  # without the weights it is wrong


def test_importance_weights_multiply_and_are_detached():
    lp = torch.log(torch.rand(2, 4) + 0.1).requires_grad_()
    ref = torch.log(torch.rand(2, 4) + 0.1)
    weights = (torch.rand(2, 4) + 0.5).requires_grad_()
    out = approx_kl(lp, ref, weights, max_ratio=math.inf)  # k3 as written
    torch.testing.assert_close(out, weights.detach() * approx_kl(lp, ref, max_ratio=math.inf), rtol=0, atol=0)
    out.sum().backward()
    assert weights.grad is None
    # d(w k3)/d lp = w (1 - exp(-log_ratio))
    torch.testing.assert_close(lp.grad, weights.detach() * (1 - torch.exp(ref - lp.detach())))


# ----------------------------------------------------------------------------------------
# approx_kl: gradients and straight-through
# ----------------------------------------------------------------------------------------

def _expected_gradient(estimator, straight_through, seed=11, V=7):
    """grad_theta E_{y ~ pi}[k(y)] with pi = softmax(theta), the sampling weights detached.

    This is the expectation of the gradient a loss ``mean(k)`` over on-policy samples
    gives, computed exactly by summing over the V outcomes.
    """
    log_pi, log_ref = _categorical(seed, V)
    theta = log_pi.clone().requires_grad_()
    log_probs = torch.log_softmax(theta, -1)
    k = approx_kl(log_probs, log_ref, estimator=estimator, max_ratio=math.inf,
                  gradient="straight-through" if straight_through else "estimator")
    (log_probs.exp().detach() * k.double()).sum().backward()
    return theta.grad, log_pi, log_ref


def _kl_gradient(log_pi, log_ref, reverse):
    """grad_theta KL(pi || ref) (reverse=False) or KL(ref || pi) (reverse=True)."""
    theta = log_pi.clone().requires_grad_()
    log_p = torch.log_softmax(theta, -1)
    if reverse:
        kl = (log_ref.exp() * (log_ref - log_p)).sum()
    else:
        kl = (log_p.exp() * (log_p - log_ref)).sum()
    (grad,) = torch.autograd.grad(kl, theta)
    return grad


def test_gradient_in_expectation_per_estimator():
    # E[grad k1] = 0; E[grad k2] = grad KL(pi||ref); E[grad k3] = grad KL(ref||pi).
    g1, log_pi, log_ref = _expected_gradient("k1", False)
    torch.testing.assert_close(g1, torch.zeros_like(g1), atol=1e-6, rtol=0)
    g2, *_ = _expected_gradient("k2", False)
    torch.testing.assert_close(g2, _kl_gradient(log_pi, log_ref, reverse=False), atol=1e-6, rtol=1e-5)
    g3, *_ = _expected_gradient("k3", False)
    torch.testing.assert_close(g3, _kl_gradient(log_pi, log_ref, reverse=True), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(g3, g2, atol=1e-3)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_straight_through_value_of_estimator_gradient_of_k2(estimator):
    lp = torch.log(torch.rand(3, 6) + 0.05).requires_grad_()
    ref = torch.log(torch.rand(3, 6) + 0.05)
    plain = approx_kl(lp, ref, estimator=estimator)
    st_out = approx_kl(lp, ref, estimator=estimator, gradient="straight-through")
    assert st_out.detach().equal(plain.detach())  # exactly the estimator's value
    (grad_st,) = torch.autograd.grad(st_out.sum(), lp)
    (grad_k2,) = torch.autograd.grad(approx_kl(lp, ref, estimator="k2").sum(), lp)
    torch.testing.assert_close(grad_st, grad_k2, rtol=0, atol=0)
    # d k2 / d lp = log_ratio
    torch.testing.assert_close(grad_k2, (lp - ref).detach(), rtol=1e-6, atol=1e-6)
    # and the expected gradient is the unbiased one, grad KL(pi || ref)
    g, log_pi, log_ref = _expected_gradient(estimator, True)
    torch.testing.assert_close(g, _kl_gradient(log_pi, log_ref, reverse=False), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# approx_kl: clamping
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("gradient", ["estimator", "straight-through"])
def test_extremes_keep_values_and_gradients_finite_and_nonzero(estimator, gradient):
    # Regression: with x = lp - ref = [-19, -5, 25], k3 gave values [1.8e8, 142, 19] and
    # gradients [-1.8e8, -147, 0]; k1, k2, abs lost their gradient past +-20.
    lp = torch.tensor([-19.0, -5.0, 25.0, -1e4, 1e4]).requires_grad_()
    out = approx_kl(lp, torch.zeros(5), estimator=estimator, gradient=gradient)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(lp.grad).all()
    assert (lp.grad != 0).all()  # no cliff: every token keeps a gradient
    x = lp.detach()
    if gradient == "straight-through" or estimator == "k2":
        torch.testing.assert_close(lp.grad, x)  # the gradient of k2, exact at any x
    elif estimator == "k1":
        assert lp.grad.equal(torch.ones(5))
    elif estimator == "abs":
        assert lp.grad.equal(torch.sign(x))
    else:  # bounded k3: |gradient| <= 1 (max_ratio = 2)
        assert (lp.grad.abs() <= 1).all()
    if estimator in ("k1", "k2", "abs"):  # exact values, no clamp
        want = {"k1": x, "k2": x**2 / 2, "abs": x.abs()}[estimator]
        torch.testing.assert_close(out.detach(), want)


def test_bounded_k3_hand_derived():
    # r = ref / pi = e^u with u = -x. Beyond r = max_ratio = 2 (u > log 2) r continues
    # along its tangent: r = 2 (1 + u - log 2), k3 = r - 1 - u, d k3 / d x = 1 - 2 = -1.
    #   x = -19: k3 = 2 (1 + 19 - log 2) - 1 - 19 = 20 - 2 log 2 = 18.6137
    #   x = -5:  k3 = 2 (1 + 5 - log 2) - 1 - 5 = 6 - 2 log 2 = 4.6137
    #   x = 25:  r = e^-25: k3 = e^-25 - 1 + 25 = 24, d k3 / d x = 1 - e^-25 = 1
    x = torch.tensor([-19.0, -5.0, 25.0, -math.log(2), 0.3], requires_grad=True)
    k3 = approx_kl(x, torch.zeros(5))
    k3.sum().backward()
    want = [20 - 2 * LN2, 6 - 2 * LN2, 24.0, 1 - LN2, math.exp(-0.3) - 1 + 0.3]
    torch.testing.assert_close(k3.detach().double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, torch.tensor([-1.0, -1.0, 1.0, -1.0, 1 - math.exp(-0.3)]))
    # continuous at the knee, value and gradient; other bounds move the knee
    eps = 1e-3
    y = torch.tensor([-LN2 - eps, -LN2 + eps], dtype=torch.float64, requires_grad=True)
    v = approx_kl(y, torch.zeros(2, dtype=torch.float64)); v.sum().backward()
    assert abs(float(v[0].detach() - v[1].detach())) < 3e-3 and abs(float(y.grad[0] - y.grad[1])) < 3e-3
    torch.testing.assert_close(approx_kl(torch.tensor([-2.0]), torch.zeros(1), max_ratio=10.0),
                               torch.tensor([math.exp(2) - 3]))  # r = e^2 < 10: exact


@pytest.mark.parametrize("max_ratio", [2.0, math.inf])
def test_k3_near_equal_policies_errs_at_the_rounding_of_log_r(max_ratio):
    # k3 = (log r)^2 / 2 + O((log r)^3) near r = 1: written with exp(log r) - 1 its float32
    # error would be that of rounding 1 (6e-8), larger than k3 itself at |log r| < 3e-4.
    x = torch.cat([torch.logspace(-5, -1, 20), -torch.logspace(-5, -1, 20)])
    k3 = approx_kl(x, torch.zeros_like(x), max_ratio=max_ratio)
    want = torch.expm1(-x.double()) + x.double()
    assert ((k3.double() - want).abs() <= 4 * torch.finfo(torch.float32).eps * x.double().abs()).all()


def test_bounded_k3_equals_verl_low_var_kl_where_neither_clamps():
    # verl clamps exp(ref - lp) - (ref - lp) - 1 at 10; the bound here starts at ref / pi > 2.
    x = torch.linspace(-math.log(2), 5.0, 50, dtype=torch.float32)
    torch.testing.assert_close(approx_kl(x, torch.zeros(50)), verl_low_var_kl_ref(x, torch.zeros(50)),
                               rtol=1e-6, atol=1e-6)


def test_bias_corrected_gradient_is_that_of_kl_pi_ref_in_expectation():
    # On-policy (old = pi), E_pi[grad (k rho)] = grad E_pi[k] = grad KL(pi || ref) for k1, k3.
    for estimator in ("k1", "k3"):
        theta = torch.randn(7, generator=torch.Generator().manual_seed(11), dtype=torch.float64).requires_grad_()
        log_pi = torch.log_softmax(theta, -1)
        log_ref = torch.log_softmax(torch.randn(7, generator=torch.Generator().manual_seed(12), dtype=torch.float64), -1)
        k = approx_kl(log_pi, log_ref, old_log_probs=log_pi.detach(), estimator=estimator,
                      gradient="bias-corrected", max_ratio=math.inf)
        # E over y ~ pi, with the sampling weights held fixed (a score-function estimate)
        (g,) = torch.autograd.grad((log_pi.detach().exp() * k).sum(), theta)
        torch.testing.assert_close(g, _kl_gradient(log_pi.detach(), log_ref, reverse=False), atol=1e-6, rtol=1e-5)


def test_adaptive_kl_coef_hand_derived_and_reference():
    # observed 2x the target: error clipped to 0.2; 1000 / 10000 of the horizon: x 1.02
    assert adaptive_kl_coef(0.1, 0.2, target=0.1, horizon=10_000, num_steps=1000) == pytest.approx(0.102)
    assert adaptive_kl_coef(0.1, 0.09, target=0.1, horizon=100, num_steps=10) == pytest.approx(0.1 * (1 - 0.01))
    for kl in (0.0, 0.05, 0.11, 3.0):
        want = adaptive_kl_coef_ref(0.2, kl, 0.1, 50, 7)
        assert adaptive_kl_coef(0.2, kl, target=0.1, horizon=50, num_steps=7) == pytest.approx(want)
        got = adaptive_kl_coef(torch.tensor(0.2), torch.tensor(kl), target=0.1, horizon=50, num_steps=7)
        assert isinstance(got, torch.Tensor) and got.item() == pytest.approx(want, rel=1e-6)
    assert adaptive_kl_coef(0.3, 5.0, target=1.0, horizon=10, num_steps=0) == 0.3


@SETTINGS
@given(coef=st.floats(0, 10), kl=st.floats(0, 100), target=st.floats(1e-3, 10), steps=st.integers(0, 100))
def test_adaptive_kl_coef_moves_towards_the_target_by_at_most_20_percent(coef, kl, target, steps):
    new = adaptive_kl_coef(coef, kl, target=target, horizon=100, num_steps=steps)
    assert abs(new - coef) <= 0.2 * coef * steps / 100 + 1e-12
    if kl > target:
        assert new >= coef
    elif kl < target:
        assert new <= coef


def test_adaptive_kl_coef_bad_inputs():
    with pytest.raises(InvalidArgumentError, match="adaptive_kl_coef: target must be > 0, got 0"):
        adaptive_kl_coef(0.1, 0.1, target=0, horizon=10, num_steps=1)
    with pytest.raises(InvalidArgumentError, match="adaptive_kl_coef: horizon must be > 0, got -1"):
        adaptive_kl_coef(0.1, 0.1, target=0.1, horizon=-1, num_steps=1)
    with pytest.raises(InvalidArgumentError, match="adaptive_kl_coef: num_steps must be an int >= 0, got -2"):
        adaptive_kl_coef(0.1, 0.1, target=0.1, horizon=10, num_steps=-2)
    # a -20% error with num_steps = 10 horizons: 1 - 0.2 * 10 < 0 would flip the coefficient's sign
    with pytest.raises(InvalidArgumentError, match="adaptive_kl_coef: num_steps=1000 is more than 5 x horizon=100"):
        adaptive_kl_coef(0.1, 0.0, target=0.1, horizon=100, num_steps=1000)
    assert adaptive_kl_coef(0.1, 0.0, target=0.1, horizon=100, num_steps=500) == 0.0  # the bound itself: 0
    with pytest.raises(InvalidArgumentError, match="adaptive_kl_coef: kl_coef must be >= 0, got -0.1"):
        adaptive_kl_coef(-0.1, 0.1, target=0.1, horizon=10, num_steps=1)
    with pytest.raises(InvalidArgumentError, match="adaptive_kl_coef: observed_kl must be finite, got nan"):
        adaptive_kl_coef(0.1, float("nan"), target=0.1, horizon=10, num_steps=1)
    with pytest.raises(ShapeError, match=r"adaptive_kl_coef: observed_kl must be a float scalar tensor, got shape \(2,\)"):
        adaptive_kl_coef(0.1, torch.zeros(2), target=0.1, horizon=10, num_steps=1)


def test_approx_kl_empty_inputs():
    for shape in [(0, 4), (3, 0)]:
        lp = torch.zeros(shape, requires_grad=True)
        for gradient in KL_GRADIENTS:
            out = approx_kl(lp, torch.zeros(shape), old_log_probs=torch.zeros(shape), gradient=gradient)
            assert out.shape == shape
            out.sum().backward()
            assert lp.grad.shape == shape



@pytest.mark.parametrize("gradient", KL_GRADIENTS)
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_approx_kl_mask_is_the_estimate_of_the_counted_tokens(estimator, gradient):
    # mask=: the unmasked estimate where True (value and gradient), exactly 0 where False,
    # even with NaN in every input there.
    g = torch.Generator().manual_seed(1)
    lp, ref, old = -torch.rand(3, 4, 6, generator=g)
    w = torch.rand(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.6
    nan = lambda x: torch.where(mask, x, float("nan"))
    kw = dict(estimator=estimator, gradient=gradient)
    x1, x2 = lp.clone().requires_grad_(), nan(lp).requires_grad_()
    plain = approx_kl(x1, ref, w, old, **kw)
    masked = approx_kl(x2, nan(ref), nan(w), nan(old), mask=mask, **kw)
    torch.testing.assert_close(masked, torch.where(mask, plain, 0.0))
    (plain * mask).sum().backward(); masked.sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad)
    with pytest.raises(DTypeError, match="approx_kl: mask has dtype torch.float32; expected torch.bool"):
        approx_kl(lp, ref, mask=mask.float())
    with pytest.raises(ShapeError, match=r"approx_kl: mask has shape \(6,\) but log_probs has shape \(4, 6\)"):
        approx_kl(lp, ref, mask=mask[0])


# ----------------------------------------------------------------------------------------
# approx_kl: calling convention and bad input
# ----------------------------------------------------------------------------------------

def test_approx_kl_from_batch_and_tensordict():
    lp = torch.log(torch.rand(2, 5) + 0.1)
    ref = torch.log(torch.rand(2, 5) + 0.1)
    w = torch.rand(2, 5)
    expected = approx_kl(lp, ref, estimator="k1")
    batch = Batch(log_probs=lp, ref_log_probs=ref, batch_size=[2])
    assert approx_kl(batch, estimator="k1").equal(expected)
    td = TensorDict(log_probs=lp, ref_log_probs=ref, batch_size=[2])
    assert approx_kl(td, estimator="k1").equal(expected)
    assert approx_kl(td, weights=w, estimator="k1").equal(w * expected)
    assert approx_kl(td, ref_log_probs=lp).equal(torch.zeros(2, 5))  # keyword overrides key
    masked = TensorDict(log_probs=lp, ref_log_probs=ref, mask=torch.zeros(2, 5, dtype=torch.bool), batch_size=[2])
    assert approx_kl(masked, estimator="k1").equal(expected)  # the mask is keyword-only: never read from a batch
    with pytest.raises(MissingKeyError, match="approx_kl: the batch has no key 'ref_log_probs'"):
        approx_kl(Batch(log_probs=lp, batch_size=[2]))


def test_approx_kl_bad_inputs():
    lp = torch.zeros(2, 3)
    with pytest.raises(ShapeError, match=r"approx_kl: ref_log_probs has shape \(2, 4\) but log_probs has shape \(2, 3\)"):
        approx_kl(lp, torch.zeros(2, 4))
    with pytest.raises(ShapeError, match=r"approx_kl: ref_log_probs has shape \(3,\) but log_probs has shape \(2, 3\)"):
        approx_kl(lp, torch.zeros(3))  # would broadcast: rejected
    with pytest.raises(ShapeError, match=r"approx_kl: weights has shape \(2, 1\) but log_probs"):
        approx_kl(lp, lp, torch.ones(2, 1))
    with pytest.raises(DTypeError, match="approx_kl: log_probs has dtype torch.int64; expected a floating-point"):
        approx_kl(torch.zeros(2, 3, dtype=torch.long), lp)
    with pytest.raises(DTypeError, match="approx_kl: ref_log_probs has dtype torch.int64"):
        approx_kl(lp, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(DTypeError, match="approx_kl: weights has dtype torch.bool"):
        approx_kl(lp, lp, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(InvalidArgumentError, match="approx_kl: estimator is 'k4'; expected one of 'k1', 'k2', 'k3', 'abs'"):
        approx_kl(lp, lp, estimator="k4")
    with pytest.raises(InvalidArgumentError, match="approx_kl: max_log_ratio must be > 0, got 0"):
        approx_kl(lp, lp, max_log_ratio=0.0)
    with pytest.raises(InvalidArgumentError, match="approx_kl: max_log_ratio must be > 0, got nan"):
        approx_kl(lp, lp, max_log_ratio=float("nan"))
    with pytest.raises(InvalidArgumentError, match="approx_kl: max_ratio must be > 1 \\(a bound on ref / pi\\), got 1.0"):
        approx_kl(lp, lp, max_ratio=1.0)
    with pytest.raises(InvalidArgumentError, match="approx_kl: gradient is 'k2'; expected one of 'estimator', 'straight-through', 'bias-corrected'"):
        approx_kl(lp, lp, gradient="k2")
    with pytest.raises(InvalidArgumentError, match="approx_kl: gradient='bias-corrected' needs old_log_probs"):
        approx_kl(lp, lp, gradient="bias-corrected")
    with pytest.raises(ShapeError, match=r"approx_kl: old_log_probs has shape \(2, 2\) but log_probs"):
        approx_kl(lp, lp, old_log_probs=lp[:, :2], gradient="bias-corrected")
    with pytest.raises(Exception, match="approx_kl: log_probs must be a torch.Tensor, got list"):
        approx_kl([0.0], lp)


# ----------------------------------------------------------------------------------------
# exact_kl
# ----------------------------------------------------------------------------------------

def test_exact_kl_hand_derived():
    # p = (1/2, 1/2), q = (1/4, 3/4):
    #   KL = 1/2 log(2) + 1/2 log(2/3) = 0.5 * (0.693147 - 0.405465) = 0.143841.
    logits = torch.zeros(1, 1, 2)
    ref_logits = torch.log(torch.tensor([[[0.25, 0.75]]]))
    torch.testing.assert_close(exact_kl(logits, ref_logits), torch.tensor([[0.5 * math.log(4 / 3)]]), rtol=0, atol=1e-7)
    # Temperature 2: logits (0, 2 log 2) / 2 = (0, log 2) -> p = (1/3, 2/3); ref zeros ->
    # q = (1/2, 1/2): KL = 1/3 log(2/3) + 2/3 log(4/3) = log 2 + 2/3 log 2 - log 3.
    logits = torch.tensor([[[0.0, 2 * LN2]]])
    expected = (5 / 3) * LN2 - math.log(3)
    torch.testing.assert_close(exact_kl(logits, torch.zeros(1, 1, 2), temperature=2.0), torch.tensor([[expected]]), rtol=0, atol=1e-7)


@SETTINGS
@given(
    B=st.integers(1, 3), T=st.integers(1, 4), V=st.integers(1, 9), seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.3, 1.0, 1.7]), chunk_size=st.one_of(st.none(), st.integers(1, 5)),
)
def test_exact_kl_matches_reference_and_nonnegative(B, T, V, seed, temperature, chunk_size):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, T, V, generator=g)
    ref_logits = 3 * torch.randn(B, T, V, generator=g)
    out = exact_kl(logits, ref_logits, temperature=temperature, chunk_size=chunk_size)
    assert out.shape == (B, T) and out.dtype == torch.float32
    expected = exact_kl_ref(logits, ref_logits, temperature)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert (out >= 0).all()


@SETTINGS
@given(seed=st.integers(0, 10_000), shift=st.floats(-50, 50))
def test_exact_kl_zero_for_equal_distributions(seed, shift):
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(seed))
    assert exact_kl(logits, logits).equal(torch.zeros(2, 3))
    # softmax is shift-invariant: the same distribution, up to float32 rounding
    torch.testing.assert_close(exact_kl(logits + shift, logits), torch.zeros(2, 3), rtol=0, atol=1e-5)


@SETTINGS
@given(seed=st.integers(0, 10_000), chunk_size=st.integers(1, 13))
def test_exact_kl_chunk_size_invariance(seed, chunk_size):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, 17, generator=g).requires_grad_()
    ref_logits = torch.randn(3, 4, 17, generator=g).requires_grad_()
    grad_out = torch.randn(3, 4, generator=g)
    results = []
    for cs in (None, chunk_size):
        out = exact_kl(logits, ref_logits, chunk_size=cs)
        results.append((out, *torch.autograd.grad(out, (logits, ref_logits), grad_out)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_exact_kl_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, generator=g).requires_grad_()
    ref_logits = torch.randn(2, 3, 5, dtype=torch.float64, generator=g).requires_grad_()
    for temperature in (1.0, 0.6):
        assert torch.autograd.gradcheck(
            lambda x, y: exact_kl(x, y, temperature=temperature, chunk_size=4), (logits, ref_logits)
        )
    assert exact_kl(logits, ref_logits).dtype == torch.float64


def test_exact_kl_gradient_matches_autograd_of_naive_formula():
    g = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(4, 3, 10, generator=g)).requires_grad_()
    ref_logits = (2 * torch.randn(4, 3, 10, generator=g)).requires_grad_()
    grad_out = torch.randn(4, 3, generator=g)
    out = exact_kl(logits, ref_logits, temperature=0.8, chunk_size=5)
    grads = torch.autograd.grad(out, (logits, ref_logits), grad_out)
    log_p = torch.log_softmax(logits / 0.8, -1)
    log_q = torch.log_softmax(ref_logits / 0.8, -1)
    naive = (log_p.exp() * (log_p - log_q)).sum(-1)
    naive_grads = torch.autograd.grad(naive, (logits, ref_logits), grad_out)
    torch.testing.assert_close(out, naive, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, naive_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_exact_kl_gradient_only_where_required():
    logits = torch.randn(2, 2, 6).requires_grad_()
    ref_logits = torch.randn(2, 2, 6)
    exact_kl(logits, ref_logits).sum().backward()
    assert logits.grad is not None and ref_logits.grad is None
    # sum_v d KL / d logits_v = sum_v p_v (d_v - KL) = 0: softmax is shift-invariant
    torch.testing.assert_close(logits.grad.sum(-1), torch.zeros(2, 2), rtol=0, atol=1e-6)
    ref_only = torch.randn(2, 2, 6).requires_grad_()
    exact_kl(torch.randn(2, 2, 6), ref_only).sum().backward()
    assert ref_only.grad is not None


def test_exact_kl_bf16_input():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 33, generator=g).bfloat16().requires_grad_()
    ref_logits = torch.randn(3, 4, 33, generator=g).bfloat16()
    out = exact_kl(logits, ref_logits, chunk_size=5)
    assert out.dtype == torch.float32
    # float32 maths on the bf16 values: the same as the float32 upcast
    upcast = logits.detach().float().requires_grad_()
    expected = exact_kl(upcast, ref_logits.float())
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    out.sum().backward()
    expected.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), upcast.grad.bfloat16().float(), rtol=0, atol=0)
    # mixed: bf16 policy, float32 reference
    assert exact_kl(logits, ref_logits.float()).dtype == torch.float32


def test_exact_kl_saves_only_its_inputs():
    # The backward recomputes: nothing but the inputs themselves (no float32 copy of the
    # bf16 logits, no softmax) is saved for it.
    logits = torch.randn(4, 8, 64).bfloat16().requires_grad_()
    ref_logits = torch.randn(4, 8, 64).bfloat16()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        exact_kl(logits, ref_logits, chunk_size=3)
    large = [t for t in saved if t.numel() > 4 * 8]
    assert {t.data_ptr() for t in large} == {logits.data_ptr(), ref_logits.data_ptr()}
    assert all(t.dtype == torch.bfloat16 for t in large)
    assert sum(t.numel() for t in saved if t.numel() <= 4 * 8) <= 4 * 8  # the [B, T] result


def test_exact_kl_masked_vocabulary():
    # Tokens pi cannot emit (logit -inf) contribute 0 log 0 = 0 instead of NaN.
    logits = torch.tensor([[[0.0, 0.0, -float("inf")]]]).requires_grad_()
    ref_logits = torch.zeros(1, 1, 3)
    # p = (1/2, 1/2, 0), q = (1/3, 1/3, 1/3): KL = 2 * 1/2 log((1/2) / (1/3)) = log(3/2)
    out = exact_kl(logits, ref_logits)
    torch.testing.assert_close(out, torch.tensor([[math.log(1.5)]]), rtol=0, atol=1e-7)
    out.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 2] == 0
    # The other way round, pi gives mass where ref gives none: KL(pi || ref) = inf.
    assert torch.isinf(exact_kl(ref_logits, logits.detach())).all()


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_exact_kl_rows_with_masked_vocabulary_among_others(chunk_size):
    # Some rows have -inf logits (in pi, in both, in neither); values and gradients
    # match 0 log 0 = 0 computed with an explicit where, in float64.
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 6, dtype=torch.float64, generator=g)
    ref_logits = torch.randn(2, 5, 6, dtype=torch.float64, generator=g)
    logits[0, 1, :2] = -float("inf")
    logits[1, 3, 4] = -float("inf")
    ref_logits[1, 3, 4] = -float("inf")
    logits.requires_grad_()
    ref_logits.requires_grad_()
    out = exact_kl(logits, ref_logits, chunk_size=chunk_size)
    log_p, log_q = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    expected = torch.where(log_p.exp() > 0, log_p.exp() * (log_p - log_q), 0.0).sum(-1)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn(2, 5, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad(out, (logits, ref_logits), grad_out)
    assert all(torch.isfinite(gr).all() for gr in grads)
    # analytic gradients: p (log p - log q - KL) and q - p, with 0 where p = 0
    p, q = log_p.exp().detach(), log_q.exp().detach()
    d = torch.where(p > 0, (log_p - log_q).detach(), 0.0)
    expected_logits = p * (d - expected.detach().unsqueeze(-1)) * grad_out.unsqueeze(-1)
    torch.testing.assert_close(grads[0], expected_logits, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], (q - p) * grad_out.unsqueeze(-1), rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a: exact_kl(a, ref_logits.detach(), chunk_size=chunk_size), (logits,))


def test_exact_kl_empty_batch():
    out = exact_kl(torch.zeros(0, 3, 5), torch.zeros(0, 3, 5))
    assert out.shape == (0, 3)


def test_exact_kl_from_tensordict():
    logits, ref_logits = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    td = TensorDict(logits=logits, ref_logits=ref_logits, batch_size=[2])
    expected = exact_kl(logits, ref_logits, temperature=0.5)
    assert exact_kl(td, temperature=0.5).equal(expected)
    assert exact_kl(td, ref_logits=logits).equal(torch.zeros(2, 3))  # keyword overrides key
    with pytest.raises(MissingKeyError, match=r"exact_kl: the batch has no key 'ref_logits' \(keys: \['logits'\]\)"):
        exact_kl(TensorDict(logits=logits, batch_size=[2]))
    with pytest.raises(InvalidArgumentError, match="exact_kl: got a batch as first argument and 1 more positional"):
        exact_kl(td, ref_logits)


def test_exact_kl_bad_inputs():
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ShapeError, match=r"exact_kl: logits has shape \(2, 4\); expected 3 dimensions"):
        exact_kl(torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ShapeError, match=r"exact_kl: ref_logits has shape \(2, 3, 5\) but logits has shape \(2, 3, 4\)"):
        exact_kl(x, torch.zeros(2, 3, 5))
    with pytest.raises(ShapeError, match=r"exact_kl: ref_logits has shape \(1, 3, 4\) but logits has shape \(2, 3, 4\)"):
        exact_kl(x, torch.zeros(1, 3, 4))  # would broadcast: rejected
    with pytest.raises(ShapeError, match=r"exact_kl: logits has shape \(2, 3, 0\); expected a vocabulary V >= 1"):
        exact_kl(torch.zeros(2, 3, 0), torch.zeros(2, 3, 0))
    with pytest.raises(DTypeError, match="exact_kl: logits has dtype torch.int64; expected a floating-point"):
        exact_kl(x.long(), x)
    with pytest.raises(DTypeError, match="exact_kl: ref_logits has dtype torch.int32"):
        exact_kl(x, x.int())
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(InvalidArgumentError, match=f"exact_kl: temperature must be > 0, got {bad}"):
            exact_kl(x, x, temperature=bad)
    with pytest.raises(InvalidArgumentError, match="exact_kl: temperature must be finite, got inf"):
        exact_kl(x, x, temperature=float("inf"))
    with pytest.raises(InvalidArgumentError, match="exact_kl: temperature must be a number, got Tensor"):
        exact_kl(x, x, temperature=torch.tensor(1.0))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidArgumentError, match=f"exact_kl: chunk_size must be an int >= 1 or None, got {bad}"):
            exact_kl(x, x, chunk_size=bad)


def test_exact_kl_near_zero_is_not_a_negative_rounding_residue():
    # found by hypothesis: the sum over V of p (log p - log q) came out at -3.96e-18
    g = torch.Generator().manual_seed(49)
    logits, ref_logits = 3 * torch.randn(1, 2, 2, generator=g), 3 * torch.randn(1, 2, 2, generator=g)
    out = exact_kl(logits, ref_logits, temperature=0.3)
    assert (out >= 0).all() and out[0, 0] < 1e-12
