"""Tests for torchforge.log_probs: token_log_probs, token_entropy, fused_token_log_probs."""

import json
import math
import os
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import torchforge.log_probs as log_probs_module
from tests.reference import (
    head_transform_ref,
    lm_head_logits_ref,
    token_entropy_ref,
    token_log_probs_ref,
)
from torchforge.errors import DTypeError, InvalidArgumentError, MissingKeyError, ShapeError
from torchforge.log_probs import fused_token_log_probs, token_entropy, token_log_probs

SETTINGS = settings(max_examples=25, deadline=None)
LN3 = math.log(3.0)


def _logits(seed, B, T, V, dtype=torch.float64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    return logits.to(dtype), tokens


def _head(seed, B, T, H, V, dtype=torch.float64, with_bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64) if with_bias else None
    tokens = torch.randint(0, V, (B, T), generator=g)
    cast = lambda x: None if x is None else x.to(dtype).requires_grad_()  # noqa: E731
    return cast(hidden), cast(weight), cast(bias), tokens


def _unfused(hidden, weight, tokens, bias=None, temperature=1.0):
    """Plain autograd: logits = hidden @ weight.T + bias, then log_softmax / entropy."""
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    lp = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return lp, -(log_p.exp() * log_p).sum(-1)


# ----------------------------------------------------------------------------------------
# Hand-derived cases
# ----------------------------------------------------------------------------------------

def test_token_log_probs_hand_derived():
    # logits (0, log 3): softmax = (1/4, 3/4), so log-probs log(1/4), log(3/4).
    # temperature 2: z = (0, log(3)/2) = (0, log sqrt 3): p = (1, sqrt 3) / (1 + sqrt 3).
    # gradient of log p[1] wrt logits = (onehot(1) - p) / temperature.
    logits = torch.tensor([[[0.0, LN3], [0.0, LN3]]], requires_grad=True)
    tokens = torch.tensor([[0, 1]])
    out = token_log_probs(logits, tokens)
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    torch.testing.assert_close(out, torch.tensor([[math.log(0.25), math.log(0.75)]]), rtol=0, atol=1e-6)

    s3 = math.sqrt(3.0)
    out_t = token_log_probs(logits, tokens, temperature=2.0)
    expected = [[math.log(1 / (1 + s3)), math.log(s3 / (1 + s3))]]
    torch.testing.assert_close(out_t, torch.tensor(expected), rtol=0, atol=1e-6)

    (grad,) = torch.autograd.grad(out_t[0, 1], logits)
    p = torch.tensor([1 / (1 + s3), s3 / (1 + s3)])
    expected_grad = torch.stack([torch.zeros(2), (torch.tensor([0.0, 1.0]) - p) / 2.0]).unsqueeze(0)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)


def test_token_entropy_hand_derived():
    # Uniform over 4: log 4. p = (1/4, 3/4): -(1/4 log 1/4 + 3/4 log 3/4) = 0.562335.
    # One finite logit among -inf: p = (1, 0, 0), entropy 0 and gradient 0 (0 log 0 = 0).
    # Gradient at uniform: -p_v (log p_v + H) = -(1/4)(-log 4 + log 4) = 0 for every v.
    inf = math.inf
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, LN3, -inf, -inf], [0.0, -inf, -inf, -inf]]],
                          requires_grad=True)
    out = token_entropy(logits)
    expected = [[math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), 0.0]]
    torch.testing.assert_close(out, torch.tensor(expected), rtol=0, atol=1e-6)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad[0, 0], torch.zeros(4), rtol=0, atol=1e-7)
    torch.testing.assert_close(grad[0, 2], torch.zeros(4), rtol=0, atol=0)
    # Row 1, v = 0: -p0 (log p0 + H) = -(1/4)(log(1/4) + 0.562335) = 0.206014.
    torch.testing.assert_close(grad[0, 1, 0], torch.tensor(-0.25 * (math.log(0.25) + expected[0][1])),
                               rtol=0, atol=1e-6)
    # temperature -> large: uniform over the finite logits, log 2.
    torch.testing.assert_close(token_entropy(logits, temperature=1e6)[0, 1], torch.tensor(math.log(2)),
                               rtol=0, atol=1e-5)


def test_fused_hand_derived():
    # weight rows (0,), (1,) and bias (0, 0): logits = (0, hidden) = (0, log 3) ->
    # p = (1/4, 3/4). With bias (log 3, 0): logits (log 3, log 3), p = (1/2, 1/2).
    # d log p[1] / d hidden = weight[1] - sum_v p_v weight[v] = 1 - 3/4 = 1/4;
    # d / d weight[v] = (onehot_v - p_v) * hidden = (-1/4, 1/4) * log 3.
    hidden = torch.tensor([[[LN3]]], requires_grad=True)
    weight = torch.tensor([[0.0], [1.0]], requires_grad=True)
    tokens = torch.tensor([[1]])
    lp, ent = fused_token_log_probs(hidden, weight, tokens, return_entropy=True)
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75)]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, torch.tensor([[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]]),
                               rtol=0, atol=1e-6)
    g_hidden, g_weight = torch.autograd.grad(lp.sum(), (hidden, weight))
    torch.testing.assert_close(g_hidden, torch.tensor([[[0.25]]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(g_weight, torch.tensor([[-0.25 * LN3], [0.25 * LN3]]), rtol=0, atol=1e-6)
    bias = torch.tensor([LN3, 0.0])
    torch.testing.assert_close(fused_token_log_probs(hidden, weight, tokens, bias),
                               torch.tensor([[math.log(0.5)]]), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------
# Agreement with the reference loops
# ----------------------------------------------------------------------------------------

@SETTINGS
@given(B=st.integers(1, 3), T=st.integers(1, 5), V=st.integers(1, 40), seed=st.integers(0, 10_000),
       temperature=st.sampled_from([1.0, 0.6, 1.7]), chunk_size=st.sampled_from([None, 1, 2, 7]))
def test_token_log_probs_and_entropy_match_reference(B, T, V, seed, temperature, chunk_size):
    logits, tokens = _logits(seed, B, T, V, dtype=torch.float32)
    out = token_log_probs(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    ref = token_log_probs_ref(logits, tokens, temperature)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    ent = token_entropy(logits, temperature=temperature, chunk_size=chunk_size)
    torch.testing.assert_close(ent.double(), token_entropy_ref(logits, temperature), rtol=1e-5, atol=1e-5)


@SETTINGS
@given(B=st.integers(1, 3), T=st.integers(1, 4), H=st.integers(1, 6), V=st.integers(1, 20),
       seed=st.integers(0, 10_000), temperature=st.sampled_from([1.0, 0.8]),
       chunk_size=st.sampled_from([None, 1, 3]))
def test_fused_matches_reference(B, T, H, V, seed, temperature, chunk_size):
    hidden, weight, bias, tokens = _head(seed, B, T, H, V)
    lp, ent = fused_token_log_probs(hidden, weight, tokens, bias, temperature=temperature,
                                    chunk_size=chunk_size, return_entropy=True)
    logits = lm_head_logits_ref(hidden.detach(), weight.detach(), bias.detach())
    torch.testing.assert_close(lp, token_log_probs_ref(logits, tokens, temperature), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, token_entropy_ref(logits, temperature), rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------
# Properties: chunk-size invariance, fused == unfused, sliced == whole, strided input
# ----------------------------------------------------------------------------------------

@SETTINGS
@given(B=st.integers(1, 3), T=st.integers(1, 6), V=st.integers(2, 64), seed=st.integers(0, 10_000),
       c1=st.integers(1, 20), c2=st.integers(1, 20), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_chunk_size_invariance(B, T, V, seed, c1, c2, dtype):
    logits, tokens = _logits(seed, B, T, V, dtype=dtype)
    g = torch.randn(B, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    results = []
    for c in (c1, c2):
        x = logits.clone().requires_grad_()
        lp = token_log_probs(x, tokens, chunk_size=c)
        ent = token_entropy(x, chunk_size=c)
        (grad,) = torch.autograd.grad((lp * g).sum() + (ent * g).sum(), x)
        results.append((lp, ent, grad.float()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(B=st.integers(1, 3), T=st.integers(1, 5), H=st.integers(1, 8), V=st.integers(2, 40),
       seed=st.integers(0, 10_000), chunk_size=st.integers(1, 12), backward_rows=st.sampled_from([2, 5, 4096]),
       with_bias=st.booleans(), temperature=st.sampled_from([1.0, 0.7]),
       which=st.sampled_from(["log_probs", "entropy", "both"]))
def test_fused_equals_unfused_values_and_gradients(B, T, H, V, seed, chunk_size, backward_rows, with_bias,
                                                   temperature, which):
    hidden, weight, bias, tokens = _head(seed, B, T, H, V, with_bias=with_bias)
    gen = torch.Generator().manual_seed(seed + 1)
    g_lp = torch.randn(B, T, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(B, T, generator=gen, dtype=torch.float64)
    inputs = [x for x in (hidden, weight, bias) if x is not None]
    old_rows = log_probs_module._FUSED_BACKWARD_ROWS
    log_probs_module._FUSED_BACKWARD_ROWS = backward_rows  # several row blocks and vocab tiles
    try:
        lp, ent = fused_token_log_probs(hidden, weight, tokens, bias, temperature=temperature,
                                        chunk_size=chunk_size, return_entropy=True)
        ref_lp, ref_ent = _unfused(hidden, weight, tokens, bias, temperature)

        def loss(a, b):
            return {"log_probs": (a * g_lp).sum(), "entropy": (b * g_ent).sum(),
                    "both": (a * g_lp).sum() + (b * g_ent).sum()}[which]

        grads = torch.autograd.grad(loss(lp, ent), inputs)
        ref_grads = torch.autograd.grad(loss(ref_lp, ref_ent), inputs)
    finally:
        log_probs_module._FUSED_BACKWARD_ROWS = old_rows
    torch.testing.assert_close(lp, ref_lp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    # and equal to the unfused primitives on materialized logits
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    torch.testing.assert_close(lp, token_log_probs(logits, tokens, temperature=temperature), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, token_entropy(logits, temperature=temperature), rtol=1e-10, atol=1e-10)


@SETTINGS
@given(B=st.integers(2, 3), T=st.integers(2, 6), V=st.integers(2, 30), seed=st.integers(0, 10_000),
       data=st.data())
def test_sliced_equals_whole_and_strided_input(B, T, V, seed, data):
    # Every position is independent: log-probs of logits[:, :t] are the first t columns of
    # the whole, and a strided view (logits[:, :-1] of [B, T + 1, V]) reads like a copy.
    t = data.draw(st.integers(1, T - 1))
    logits, tokens = _logits(seed, B, T, V)
    whole = token_log_probs(logits, tokens, chunk_size=3)
    torch.testing.assert_close(token_log_probs(logits[:, :t], tokens[:, :t]), whole[:, :t], rtol=0, atol=1e-12)
    torch.testing.assert_close(token_entropy(logits[:, :t]), token_entropy(logits)[:, :t], rtol=0, atol=1e-12)

    x = logits.clone().requires_grad_()
    strided = x[:, :-1]
    assert not strided.is_contiguous()
    lp = token_log_probs(strided, tokens[:, :-1], chunk_size=2)
    ent = token_entropy(strided, chunk_size=2)
    torch.testing.assert_close(lp, whole[:, :-1], rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), x)
    y = logits[:, :-1].clone().requires_grad_()
    (ref,) = torch.autograd.grad(
        torch.log_softmax(y, -1).gather(-1, tokens[:, :-1, None]).sum()
        - (torch.softmax(y, -1) * torch.log_softmax(y, -1)).sum(), y)
    torch.testing.assert_close(grad[:, :-1], ref, rtol=1e-10, atol=1e-10)
    assert (grad[:, -1] == 0).all()  # the last position was not used


# ----------------------------------------------------------------------------------------
# gradcheck (float64) of every custom backward
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck_token_log_probs_and_entropy(temperature):
    logits, tokens = _logits(0, 2, 3, 5, scale=1.0)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: token_log_probs(x, tokens, temperature=temperature, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(
        lambda x: token_entropy(x, temperature=temperature, chunk_size=4), (logits,))


@pytest.mark.parametrize("with_bias", [True, False])
def test_gradcheck_fused(with_bias, monkeypatch):
    monkeypatch.setattr(log_probs_module, "_FUSED_BACKWARD_ROWS", 4)  # 2 row blocks x 3 vocab tiles
    hidden, weight, bias, tokens = _head(1, 2, 3, 4, 6, with_bias=with_bias)
    inputs = tuple(x for x in (hidden, weight, bias) if x is not None)

    def fn(*xs):
        b = xs[2] if with_bias else None
        return fused_token_log_probs(xs[0], xs[1], tokens, b, temperature=0.9, chunk_size=2, return_entropy=True)

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradcheck(lambda *xs: fn(*xs)[0], inputs)  # log-probs alone


# ----------------------------------------------------------------------------------------
# bf16 inputs
# ----------------------------------------------------------------------------------------

def test_bf16_logits():
    logits, tokens = _logits(3, 2, 7, 50, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_()
    lp = token_log_probs(x, tokens, temperature=0.8, chunk_size=3)
    ent = token_entropy(x, chunk_size=3)
    assert lp.dtype == ent.dtype == torch.float32
    # float32 maths on the exact bf16 values: as accurate as float32.
    exact = logits.double()
    torch.testing.assert_close(lp.double(), token_log_probs_ref(exact, tokens, 0.8), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), token_entropy_ref(exact), rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(lp.sum(), x)
    assert grad.dtype == torch.bfloat16
    y = exact.clone().requires_grad_()
    (ref,) = torch.autograd.grad(token_log_probs(y, tokens, temperature=0.8).sum(), y)
    torch.testing.assert_close(grad.double(), ref, rtol=1e-2, atol=1e-2)  # bf16 rounding of the gradient


@SETTINGS
@given(B=st.integers(1, 3), T=st.integers(1, 5), V=st.integers(2, 40), seed=st.integers(0, 10_000),
       temperature=st.sampled_from([1.0, 0.7]), chunk_size=st.sampled_from([None, 1, 3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_values_and_gradients_match_float64_autograd(B, T, V, seed, temperature, chunk_size, dtype):
    # Every code path of the chunk loops (logits read in place, converted into the chunk
    # buffer, divided by the temperature there; softmax in the gradient's rows or in the
    # buffer) against plain float64 autograd on the same (exactly representable) values.
    logits, tokens = _logits(seed, B, T, V, dtype=dtype)
    g = torch.randn(2, B, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = logits.clone().requires_grad_()
    lp = token_log_probs(x, tokens, temperature=temperature, chunk_size=chunk_size)
    ent = token_entropy(x, temperature=temperature, chunk_size=chunk_size)
    (grad_lp,) = torch.autograd.grad((lp * g[0].float()).sum(), x)
    (grad_ent,) = torch.autograd.grad((ent * g[1].float()).sum(), x)

    y = logits.double().requires_grad_()
    log_p = torch.log_softmax(y / temperature, dim=-1)
    ref_lp = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    (ref_grad_lp,) = torch.autograd.grad((ref_lp * g[0]).sum(), y, retain_graph=True)
    (ref_grad_ent,) = torch.autograd.grad((ref_ent * g[1]).sum(), y)
    # float32 maths on the exact values: float32 accuracy; bf16 gradients are rounded to bf16
    torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert grad_lp.dtype == grad_ent.dtype == dtype
    torch.testing.assert_close(grad_lp.double(), ref_grad_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(grad_ent.double(), ref_grad_ent, rtol=tol, atol=tol)


def test_target_logit_minus_inf():
    # A target whose logit is -inf (masked out): log-prob -inf; the gradient is still
    # (onehot - p) * grad, finite: p = softmax over the finite logits, here (1/4, 3/4, 0).
    logits = torch.tensor([[[0.0, LN3, -math.inf]]], requires_grad=True)
    tokens = torch.tensor([[2]])
    out = token_log_probs(logits, tokens)
    assert out.item() == -math.inf
    (grad,) = torch.autograd.grad(out.sum(), logits)
    torch.testing.assert_close(grad, torch.tensor([[[-0.25, -0.75, 1.0]]]), rtol=0, atol=1e-6)


def test_bf16_fused(monkeypatch):
    monkeypatch.setattr(log_probs_module, "_FUSED_BACKWARD_ROWS", 8)  # float32 accumulation across blocks
    hidden, weight, bias, tokens = _head(4, 2, 10, 16, 64, dtype=torch.bfloat16)
    lp, ent = fused_token_log_probs(hidden, weight, tokens, bias, chunk_size=3, return_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32
    grads = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight, bias))
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (hidden, weight, bias))
    ref_lp, ref_ent = _unfused(h64, w64, tokens, b64)
    ref_grads = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), (h64, w64, b64))
    # the logits are rounded to bf16 by the bf16 matmul (|logits| ~ 4, ulp 2^-6)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=5e-2)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=5e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=5e-2, atol=5e-2)


# ----------------------------------------------------------------------------------------
# Batch / TensorDict calling
# ----------------------------------------------------------------------------------------

def test_tensordict_first_argument():
    logits, tokens = _logits(5, 2, 3, 7)
    td = TensorDict({"logits": logits, "tokens": tokens}, batch_size=[2])
    assert token_log_probs(td).equal(token_log_probs(logits, tokens))
    assert token_entropy(td, temperature=0.5).equal(token_entropy(logits, temperature=0.5))
    hidden, weight, _, tokens = _head(5, 2, 3, 4, 7)
    td = TensorDict({"hidden": hidden, "tokens": tokens}, batch_size=[2])
    assert fused_token_log_probs(td, weight=weight).equal(fused_token_log_probs(hidden, weight, tokens))
    with pytest.raises(MissingKeyError, match="token_log_probs: the batch has no key 'logits'"):
        token_log_probs(TensorDict({"tokens": tokens}, batch_size=[2]))


# ----------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------

def test_bad_inputs_token_log_probs_and_entropy():
    logits, tokens = _logits(0, 2, 3, 5, dtype=torch.float32)
    with pytest.raises(ShapeError, match=r"token_log_probs: logits has shape \(6, 5\); expected 3 dimensions"):
        token_log_probs(logits.view(6, 5), tokens.view(6))
    with pytest.raises(DTypeError, match="token_log_probs: logits has dtype torch.int64; expected a floating"):
        token_log_probs(logits.long(), tokens)
    with pytest.raises(DTypeError, match="token_log_probs: tokens has dtype torch.float32; expected an integer"):
        token_log_probs(logits, tokens.float())
    with pytest.raises(ShapeError, match=r"token_log_probs: tokens has shape \(2, 2\) but logits has shape "
                                         r"\(2, 3, 5\); expected \(2, 3\)"):
        token_log_probs(logits, tokens[:, :2])
    with pytest.raises(ShapeError, match=r"tokens has shape \(3, 2\)"):  # no silent transpose / broadcast
        token_log_probs(logits, tokens.t())
    bad = tokens.clone()
    bad[0, 0] = 5
    with pytest.raises(InvalidArgumentError, match=r"token_log_probs: tokens has values in \[\d, 5\]; "
                                                   r"expected token ids in \[0, 5\)"):
        token_log_probs(logits, bad)
    bad[0, 0] = -1
    with pytest.raises(InvalidArgumentError, match=r"tokens has values in \[-1, \d\]"):
        token_log_probs(logits, bad)
    for temperature in (0.0, -1.0):
        with pytest.raises(InvalidArgumentError, match=f"token_log_probs: temperature must be > 0, got {temperature}"):
            token_log_probs(logits, tokens, temperature=temperature)
        with pytest.raises(InvalidArgumentError, match=f"token_entropy: temperature must be > 0, got {temperature}"):
            token_entropy(logits, temperature=temperature)
    with pytest.raises(InvalidArgumentError, match="token_entropy: temperature must be finite"):
        token_entropy(logits, temperature=math.inf)
    with pytest.raises(InvalidArgumentError, match="token_log_probs: chunk_size must be an int >= 1 or None, got 0"):
        token_log_probs(logits, tokens, chunk_size=0)
    with pytest.raises(DTypeError, match="token_entropy: logits has dtype torch.int64"):
        token_entropy(logits.long())
    with pytest.raises(ShapeError, match=r"token_entropy: logits has shape \(2, 3, 0\); expected a vocabulary"):
        token_entropy(logits[..., :0])


def test_bad_inputs_fused():
    hidden, weight, bias, tokens = _head(0, 2, 3, 4, 6, dtype=torch.float32)
    fn = fused_token_log_probs
    with pytest.raises(ShapeError, match=r"fused_token_log_probs: weight has shape \(6, 3\) but hidden has "
                                         r"shape \(2, 3, 4\); expected \(V, 4\)"):
        fn(hidden, weight[:, :3], tokens)
    with pytest.raises(ShapeError, match=r"fused_token_log_probs: hidden has shape \(6, 4\); expected 3 dimensions"):
        fn(hidden.reshape(6, 4), weight, tokens.reshape(6))
    with pytest.raises(ShapeError, match=r"fused_token_log_probs: bias has shape \(5,\) but weight has shape "
                                         r"\(6, 4\); expected \(6,\)"):
        fn(hidden, weight, tokens, bias[:5])
    with pytest.raises(DTypeError, match="fused_token_log_probs: weight has dtype torch.float64 but hidden has "
                                         "dtype torch.float32; expected the same dtype"):
        fn(hidden, weight.double(), tokens)
    with pytest.raises(ShapeError, match=r"fused_token_log_probs: tokens has shape \(2, 2\) but hidden has shape "
                                         r"\(2, 3, 4\); expected \(2, 3\)"):
        fn(hidden, weight, tokens[:, :2])
    with pytest.raises(InvalidArgumentError, match=r"fused_token_log_probs: tokens has values in \[\d, 6\]; "
                                                   r"expected token ids in \[0, 6\) for a vocabulary of V=6"):
        fn(hidden, weight, torch.full_like(tokens, 6))
    with pytest.raises(DTypeError, match="fused_token_log_probs: tokens has dtype torch.float32"):
        fn(hidden, weight, tokens.float())
    with pytest.raises(InvalidArgumentError, match="fused_token_log_probs: temperature must be > 0, got 0"):
        fn(hidden, weight, tokens, temperature=0)
    with pytest.raises(InvalidArgumentError, match="fused_token_log_probs: return_entropy must be a bool"):
        fn(hidden, weight, tokens, return_entropy=1)


# ----------------------------------------------------------------------------------------
# The head's logit transform: z' = softcap * tanh(logit_scale * z / softcap)
# ----------------------------------------------------------------------------------------

def _transformed_unfused(hidden, weight, tokens, bias=None, temperature=1.0, logit_scale=None, softcap=None):
    """Plain autograd through the transform, as a model's forward applies it."""
    z = hidden.double() @ weight.double().t() + (bias.double() if bias is not None else 0)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature, dim=-1)
    return log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def test_fused_head_transform_hand_derived():
    weight = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    # soft cap 30 at head logits (0, 60): z' = (0, 30 tanh 2); log p(0) = -log(1 + e^{30 tanh 2})
    hidden = torch.tensor([[[60.0]]], dtype=torch.float64)
    capped = 30 * math.tanh(2.0)
    got = fused_token_log_probs(hidden, weight, torch.tensor([[0]]), softcap=30.0)
    assert float(got) == pytest.approx(-math.log1p(math.exp(capped)), abs=1e-12)
    # Granite's z / 4 (logit_scale 0.25) then temperature 0.5: z'' = (0, 60 / 4 / 0.5) = (0, 30)
    got = fused_token_log_probs(hidden, weight, torch.tensor([[0]]), logit_scale=0.25, temperature=0.5)
    assert float(got) == pytest.approx(-math.log1p(math.exp(30.0)), abs=1e-12)
    # scale then cap (output_multiplier before the cap): 30 tanh(0.5 * 60 / 30) = 30 tanh 1
    got, ent = fused_token_log_probs(hidden, weight, torch.tensor([[1]]), logit_scale=0.5, softcap=30.0,
                                     return_entropy=True)
    z1 = 30 * math.tanh(1.0)
    assert float(got) == pytest.approx(z1 - math.log1p(math.exp(z1)), abs=1e-12)
    p1 = 1 / (1 + math.exp(-z1))
    assert float(ent) == pytest.approx(-(p1 * math.log(p1) + (1 - p1) * math.log1p(-p1)), rel=1e-9)


@SETTINGS
@given(B=st.integers(1, 2), T=st.integers(1, 3), H=st.integers(1, 4), V=st.integers(2, 12),
       seed=st.integers(0, 10_000), temperature=st.sampled_from([1.0, 0.7]),
       logit_scale=st.sampled_from([None, 0.25, 3.0]), softcap=st.sampled_from([None, 1.5, 30.0]),
       chunk_size=st.integers(1, 5))
def test_fused_head_transform_matches_reference(B, T, H, V, seed, temperature, logit_scale, softcap, chunk_size):
    hidden, weight, bias, tokens = _head(seed, B, T, H, V)
    z = head_transform_ref(lm_head_logits_ref(hidden.detach(), weight.detach(), bias.detach()), logit_scale, softcap)
    lp, ent = fused_token_log_probs(hidden, weight, tokens, bias, temperature=temperature, logit_scale=logit_scale,
                                    softcap=softcap, chunk_size=chunk_size, return_entropy=True)
    torch.testing.assert_close(lp, token_log_probs_ref(z, tokens, temperature), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, token_entropy_ref(z, temperature), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("logit_scale, softcap", [(None, 2.0), (1.7, None), (0.6, 1.5)])
def test_gradcheck_fused_head_transform(logit_scale, softcap, monkeypatch):
    monkeypatch.setattr(log_probs_module, "_FUSED_BACKWARD_ROWS", 4)  # 2 row blocks x 3 vocab tiles
    hidden, weight, bias, tokens = _head(2, 2, 3, 4, 6)

    def fn(h, w, b):
        return fused_token_log_probs(h, w, tokens, b, temperature=0.9, logit_scale=logit_scale, softcap=softcap,
                                     chunk_size=2, return_entropy=True)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda *xs: fn(*xs)[0], (hidden, weight, bias))  # log-probs alone
    assert torch.autograd.gradcheck(lambda *xs: fn(*xs)[1], (hidden, weight, bias))  # entropy alone


@pytest.mark.parametrize("logit_scale, softcap", [(None, 30.0), (0.25, None), (0.25, 30.0)])
def test_fused_head_transform_at_realistic_magnitudes(logit_scale, softcap, monkeypatch):
    # float32, logits the model returns reaching |z'| of 20-40 (where a skipped transform
    # costs nats): values and gradients equal float64 autograd through the transform
    monkeypatch.setattr(log_probs_module, "_FUSED_BACKWARD_ROWS", 8)  # several row blocks
    B, T, H, V = 2, 9, 16, 300
    hidden, weight, bias, tokens = _head(7, B, T, H, V, dtype=torch.float32)
    with torch.no_grad():  # the returned logits reach 36 (the head's own 45 under a cap)
        z = hidden @ weight.t() + bias
        reach = 1.25 * 36.0 if softcap is not None else 36.0 / (logit_scale or 1.0)
        factor = reach / float(z.abs().max())
        weight.mul_(factor)
        bias.mul_(factor)
    g_lp, g_ent = torch.randn(2, B, T, generator=torch.Generator().manual_seed(3))
    lp, ent = fused_token_log_probs(hidden, weight, tokens, bias, logit_scale=logit_scale, softcap=softcap,
                                    chunk_size=5, return_entropy=True)
    grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight, bias))
    ref_lp, ref_ent = _transformed_unfused(hidden, weight, tokens, bias, logit_scale=logit_scale, softcap=softcap)
    ref_grads = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), (hidden, weight, bias))
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-4, atol=1e-4)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), ref.double(), rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    # the same logits without the transform: nats away
    skipped = fused_token_log_probs(hidden, weight, tokens, bias)
    assert float((skipped.double() - ref_lp).detach().abs().max()) > 1.0


def test_fused_head_transform_bf16(monkeypatch):
    monkeypatch.setattr(log_probs_module, "_FUSED_BACKWARD_ROWS", 4)
    hidden, weight, bias, tokens = _head(5, 2, 5, 8, 40)
    with torch.no_grad():
        weight.mul_(4.0)
    lp, ent = fused_token_log_probs(hidden.bfloat16(), weight.bfloat16(), tokens, bias.bfloat16(), softcap=10.0,
                                    logit_scale=0.5, chunk_size=3, return_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    # against float64 on the bf16-rounded inputs: only the matmul runs in bf16
    ref_lp, ref_ent = _transformed_unfused(hidden.bfloat16(), weight.bfloat16(), tokens, bias.bfloat16(),
                                           logit_scale=0.5, softcap=10.0)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=0.15)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=0.15)


def test_bad_inputs_head_transform():
    hidden, weight, _, tokens = _head(0, 2, 3, 4, 6, dtype=torch.float32)
    fn = fused_token_log_probs
    for name in ("logit_scale", "softcap"):
        for bad in (0, -1.0, math.inf, math.nan):
            with pytest.raises(InvalidArgumentError, match=rf"fused_token_log_probs: {name} must be a finite number "
                                                           rf"> 0 or None, got {bad!r}"):
                fn(hidden, weight, tokens, **{name: bad})
        for bad in ("1", True):
            with pytest.raises(InvalidArgumentError, match=rf"fused_token_log_probs: {name} must be a number or "
                                                           rf"None, got {type(bad).__name__}"):
                fn(hidden, weight, tokens, **{name: bad})


# ----------------------------------------------------------------------------------------
# Memory: what autograd keeps, and the peak allocated (not a timing test)
# ----------------------------------------------------------------------------------------

def _saved_tensors(fn):
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    return out, saved


def _peak_allocated_bytes(fn):
    """Largest total memory allocated during ``fn()`` (torch.profiler memory events, CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return max([0] + [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"])


def test_memory_token_log_probs_and_entropy():
    B, T, V = 4, 128, 4096  # logits: 8 MiB in float32
    logits, tokens = _logits(0, B, T, V, dtype=torch.float32)
    logits.requires_grad_()
    for fn in (lambda: token_log_probs(logits, tokens, chunk_size=16), lambda: token_entropy(logits, chunk_size=16)):
        out, saved = _saved_tensors(fn)
        # the only saved [.., V] tensor is the input itself (no copy, no log-softmax)
        big = [s for s in saved if s.numel() >= V]
        assert big and all(s.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr() for s in big)
        assert sum(s.numel() for s in saved if s.numel() < V) <= 2 * B * T

        def forward_backward():
            torch.autograd.grad(fn().sum(), logits)

        peak = _peak_allocated_bytes(forward_backward)
        logits_bytes = logits.numel() * logits.element_size()
        # the gradient of the logits (1x) plus a few chunk temporaries (16 x 4096 floats)
        assert logits_bytes <= peak <= 1.1 * logits_bytes, peak / logits_bytes
    # bf16: the gradient is bf16 (2 bytes per logit) and no float32 copy of the logits
    # appears (it would add 4 bytes per logit); float32 temporaries are a few chunks.
    x = logits.detach().bfloat16().requires_grad_()
    peak = _peak_allocated_bytes(lambda: torch.autograd.grad(token_log_probs(x, tokens, chunk_size=16).sum(), x))
    chunk_bytes = 16 * V * 4
    assert x.numel() * 2 <= peak <= x.numel() * 2 + 4 * chunk_bytes, peak / (x.numel() * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_memory_forward_one_chunk_buffer(dtype, temperature):
    # Without grad (old / reference log-probs) the forward allocates one [chunk_size, V]
    # float32 buffer, reused by every chunk: a bf16 chunk is converted into it and its
    # log-softmax (softmax) computed there in place, not in a second buffer.
    B, T, V, chunk = 4, 128, 4096, 16
    logits, tokens = _logits(0, B, T, V, dtype=dtype)
    chunk_bytes = chunk * V * 4
    small = 64 * 1024  # the [B, T] outputs and per-chunk index temporaries
    with torch.no_grad():
        for fn in (lambda: token_log_probs(logits, tokens, temperature=temperature, chunk_size=chunk),
                   lambda: token_entropy(logits, temperature=temperature, chunk_size=chunk)):
            peak = _peak_allocated_bytes(fn)
            assert peak <= chunk_bytes + small, peak / chunk_bytes


def test_memory_fused_never_builds_logits():
    B, T, H, V = 8, 128, 16, 4096  # [N, V] float32 logits would be 16 MiB
    hidden, weight, bias, tokens = _head(0, B, T, H, V, dtype=torch.float32)
    N = B * T

    def fn():
        return fused_token_log_probs(hidden, weight, tokens, bias, chunk_size=8, return_entropy=True)

    (lp, ent), saved = _saved_tensors(fn)
    for s in saved:  # inputs (no copies) and per-position vectors; nothing with N and V
        is_input = any(s.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in (hidden, weight, bias))
        assert is_input or s.numel() <= N, tuple(s.shape)

    def forward_backward():
        lp, ent = fn()
        torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight, bias))

    peak = _peak_allocated_bytes(forward_backward)
    grads_bytes = 4 * (N * H + V * H + V)  # returned by any method
    logits_bytes = 4 * N * V
    assert peak - grads_bytes < 0.1 * logits_bytes, (peak - grads_bytes) / logits_bytes
