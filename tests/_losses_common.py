"""Inputs, a gradient call and a compile check shared by the primitives' test modules (the
losses, the ratios, the corrections, the advantages and returns)."""

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


def _log_prob_pair(B=4, T=6, seed=0, spread=0.5, p_mask=0.7):
    """``(old, rollout, mask)``: the trainer's and the sampler's log-probs of the same tokens."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 3
    old = rollout + spread * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < p_mask
    return old, rollout, mask


def _check_compiled(cases, backend):
    """Each ``(fn, args, kwargs)`` of ``cases`` under ``torch.compile(fullgraph=True)`` (a graph
    break raises) equals the eager call."""
    torch._dynamo.reset()
    compiled = {}
    # Every @batch_args wrapper shares one code object, so compiling eight functions counts
    # as recompiles of it: lift dynamo's per-code-object limit (8) for this test.
    with torch._dynamo.config.patch(recompile_limit=64):
        for fn, args, kwargs in cases:
            key = (fn, tuple(sorted(kwargs)))
            compiled.setdefault(key, torch.compile(fn, fullgraph=True, backend=backend))
            out, expected = compiled[key](*args, **kwargs), fn(*args, **kwargs)
            out = out if isinstance(out, tuple) else (out,)
            expected = expected if isinstance(expected, tuple) else (expected,)
            for o, e in zip(out, expected):
                torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5, equal_nan=True)


def _close(actual, expected, rel=1e-5):
    """|actual - expected| <= rel * (size of the expected values), in float64."""
    expected = expected.double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=rel * max(scale, 1.0))


def _random_tokens(B, T, seed, p_keep=0.7):
    """``(rewards, values, mask)`` of shape [B, T], the mask keeping about ``p_keep``."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < p_keep
    return rewards, values, mask
