"""Inputs and a gradient call shared by the loss test modules (test_losses, test_ratios,
test_trust_region_losses, test_covariance_losses)."""

import torch


def _data(B=4, T=6, seed=0, spread=0.3, p_mask=0.7, token_adv=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    lp = old + spread * torch.randn(B, T, generator=g)
    adv = torch.randn((B, T) if token_adv else (B,), generator=g)
    mask = torch.rand(B, T, generator=g) < p_mask
    return lp.to(dtype), old.to(dtype), adv, mask


def _grad(fn, lp, *args, **kwargs):
    lp = lp.clone().requires_grad_()
    loss, metrics = fn(lp, *args, **kwargs)
    loss.backward()
    return loss.detach(), lp.grad, metrics
