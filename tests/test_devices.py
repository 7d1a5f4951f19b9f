"""Every primitive family on every device present, against the slow references on the CPU.

The other test files check each primitive in depth on the CPU; this one runs a
representative call of each family on ``device`` (CPU, and CUDA when present, see
tests/conftest.py), values and gradients, so that a kernel that is only right on one
device fails here.
"""

import pytest
import torch

import torchforge as tf
from tests.reference import (
    aggregate_ref,
    approx_kl_ref,
    exact_kl_ref,
    gae_ref,
    group_advantages_ref,
    head_transform_ref,
    lm_head_logits_ref,
    masked_whiten_ref,
    ppo_per_token_ref,
    token_entropy_ref,
    token_log_probs_ref,
    truncated_importance_weights_ref,
    value_per_token_ref,
)


def _inputs(seed: int = 0, B: int = 3, T: int = 5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[-1] = False  # an empty row
    return g, lp, old, mask


def _close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.detach().cpu().double(), expected, rtol=1e-5, atol=atol)


def test_log_probs_entropy_and_exact_kl(device):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 11, generator=g) * 8
    ref_logits = torch.randn(2, 3, 11, generator=g) * 8
    tokens = torch.randint(0, 11, (2, 3), generator=g)
    _close(tf.token_log_probs(logits.to(device), tokens.to(device), temperature=0.7),
           token_log_probs_ref(logits, tokens, temperature=0.7))
    _close(tf.token_entropy(logits.to(device)), token_entropy_ref(logits))
    _close(tf.exact_kl(logits.to(device), ref_logits.to(device)), exact_kl_ref(logits, ref_logits))


def test_fused_log_probs_with_a_soft_cap_values_and_gradient(device):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(13, 8, generator=g, dtype=torch.float64) * 4  # |z| ~ 10-30
    tokens = torch.randint(0, 13, (2, 3), generator=g)
    logits = head_transform_ref(lm_head_logits_ref(hidden, weight), softcap=30.0)
    expected = token_log_probs_ref(logits, tokens)
    w = weight.float().to(device).requires_grad_()
    out = tf.fused_token_log_probs(hidden.float().to(device), w, tokens.to(device), softcap=30.0)
    _close(out, expected, atol=1e-4)
    out.sum().backward()
    w_cpu = weight.float().requires_grad_()
    tf.fused_token_log_probs(hidden.float(), w_cpu, tokens, softcap=30.0).sum().backward()
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_approx_kl(device, estimator):
    _, lp, old, _ = _inputs(3)
    # Schulman's k3 (unbounded) is the reference's; the default bounds it beyond ref/pi > 2.
    out = tf.approx_kl(lp.to(device), old.to(device), estimator=estimator, max_ratio=float("inf"))
    _close(out, approx_kl_ref(lp, old, estimator))


def test_group_advantages_and_gae(device):
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]) + 1e4
    _close(tf.group_advantages(rewards.to(device), group_size=4),
           group_advantages_ref(rewards, 4, "group", 1e-6), atol=1e-4)
    g, _, _, mask = _inputs(4)
    token_rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv, ret = tf.gae(token_rewards.to(device), values.to(device), mask.to(device), gamma=0.9, lam=0.8)
    adv_ref, ret_ref = gae_ref(token_rewards, values, mask, 0.9, 0.8)
    _close(adv, adv_ref)
    _close(ret, ret_ref)


def test_ppo_and_value_losses_and_the_reducer(device):
    g, lp, old, mask = _inputs(5)
    adv = torch.randn(3, generator=g)
    lp_d = lp.clone().to(device).requires_grad_()
    loss, metrics = tf.ppo_loss(lp_d, old.to(device), adv.to(device), mask.to(device), clip_high=0.28, dual_clip=3.0)
    per_token = ppo_per_token_ref(lp, old, adv, mask, clip_high=0.28, dual_clip=3.0)
    _close(loss, aggregate_ref(torch.tensor(per_token), mask, "token-mean"))
    assert all(v.device.type == device.type for v in metrics.values())
    loss.backward()
    lp_c = lp.clone().requires_grad_()
    tf.ppo_loss(lp_c, old, adv, mask, clip_high=0.28, dual_clip=3.0)[0].backward()
    torch.testing.assert_close(lp_d.grad.cpu(), lp_c.grad, rtol=1e-5, atol=1e-7)

    values, returns = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    v_loss, _ = tf.value_loss(values.to(device), old.to(device), returns.to(device), mask.to(device), clip=0.2)
    _close(v_loss, aggregate_ref(torch.tensor(value_per_token_ref(values, old, returns, mask, 0.2)), mask, "token-mean"))
    whitened = tf.masked_whiten(values.to(device) + 1e4, mask.to(device))
    expected = masked_whiten_ref(values.double() + 1e4, mask)
    _close(torch.where(mask.to(device), whitened, 0.0), torch.where(mask, torch.as_tensor(expected), 0.0), atol=1e-3)


def test_corrections(device):
    _, lp, old, mask = _inputs(6)
    out = tf.truncated_importance_weights(old.to(device), lp.to(device), mask.to(device), level="token", cap=2.0)
    _close(out, truncated_importance_weights_ref(old, lp, mask, "token", 2.0))
