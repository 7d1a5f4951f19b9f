"""Tests for torchforge.entropy_selection: the entropy threshold and the high-entropy token mask."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._losses_common import _log_prob_pair as _data
from tests.reference import high_entropy_mask_ref
from torchforge.batch import Batch
from torchforge.entropy_selection import entropy_threshold, high_entropy_mask
from torchforge.errors import DTypeError, InvalidArgumentError, ShapeError, TorchforgeError

SETTINGS = settings(max_examples=30, deadline=None)
NAN = float("nan")


# --- high-entropy tokens ----------------------------------------------------------------

def test_high_entropy_mask_hand_derived():
    # 5 counted entropies 0.1, 2.0, 0.3, 1.5, 0.2 (9.0 masked). quantile 0.4 keeps the top
    # 40%: sorted 0.1 0.2 0.3 1.5 2.0, tau = Q_0.6 at position 0.6 * 4 = 2.4:
    # 0.3 + 0.4 * (1.5 - 0.3) = 0.78 -> keeps 2.0 and 1.5.
    entropy = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    torch.testing.assert_close(entropy_threshold(entropy, mask, quantile=0.4), torch.tensor(0.78))
    assert high_entropy_mask(entropy, mask, quantile=0.4).tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert high_entropy_mask(entropy, mask, quantile=1.0).tolist() == mask.float().tolist()  # all counted
    # 1 - 0.2 = 0.8 -> position 3.2: 1.5 + 0.2 * 0.5 = 1.6 -> keeps 2.0 only
    assert high_entropy_mask(entropy, mask, quantile=0.2).tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    # a given threshold wins over this batch's
    assert high_entropy_mask(entropy, mask, quantile=0.2, threshold=0.25).tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    # empty: nothing kept, threshold 0
    none = torch.zeros_like(mask)
    assert high_entropy_mask(entropy, none, quantile=0.2).sum() == 0 and entropy_threshold(entropy, none, quantile=0.2) == 0
    assert high_entropy_mask(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), quantile=0.2).shape == (0, 3)
    # a NaN counted entropy: the order is unknown, so the threshold is NaN and nothing is kept, at any
    # quantile (sorted last, the NaN was read at 0.2 and skipped at 0.5); a NaN where masked changes nothing
    e = torch.tensor([[0.1, 0.2, 0.3, 0.4, float("nan")]])
    for quantile in (0.2, 0.5, 1.0):
        assert entropy_threshold(e, quantile=quantile).isnan()
        assert high_entropy_mask(e, torch.ones_like(e, dtype=torch.bool), quantile=quantile).sum() == 0
    counted = torch.tensor([[True, True, True, True, False]])
    torch.testing.assert_close(entropy_threshold(e, counted, quantile=0.5), torch.tensor(0.25))


@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000),
       quantile=st.sampled_from([0.05, 0.2, 0.5, 0.8, 1.0]))
@SETTINGS
def test_high_entropy_mask_matches_reference_and_torch_quantile(B, T, seed, quantile):
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) < 0.7
    out = high_entropy_mask(entropy.masked_fill(~mask, NAN), mask, quantile=quantile)  # NaN outside never leaks
    assert out.dtype == torch.float32
    assert torch.equal(out.double(), high_entropy_mask_ref(entropy, mask, quantile))
    if mask.any():
        torch.testing.assert_close(entropy_threshold(entropy, mask, quantile=quantile),
                                   torch.quantile(entropy[mask], 1 - quantile), rtol=1e-6, atol=1e-6)
        kept = out.sum().item()
        assert kept >= math.floor(quantile * mask.sum().item())  # at least the top fraction (ties kept)


def test_high_entropy_mask_exact_across_micro_batches():
    # The threshold of the whole step, applied to each micro-batch, selects exactly what
    # one pass over the whole batch selects; each micro-batch's own threshold does not.
    g = torch.Generator().manual_seed(0)
    entropy = torch.cat([torch.rand(4, 8, generator=g), 3 + torch.rand(4, 8, generator=g)])  # second half higher
    mask = torch.rand(8, 8, generator=g) < 0.8
    whole = high_entropy_mask(entropy, mask, quantile=0.2)
    micro = [(entropy[:4], mask[:4]), (entropy[4:], mask[4:])]
    tau = entropy_threshold(torch.cat([e[m] for e, m in micro]), quantile=0.2)
    exact = torch.cat([high_entropy_mask(e, m, quantile=0.2, threshold=tau) for e, m in micro])
    assert torch.equal(exact, whole)
    local = torch.cat([high_entropy_mask(e, m, quantile=0.2) for e, m in micro])
    assert not torch.equal(local, whole)


def test_high_entropy_mask_bad_inputs():
    entropy, mask = torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool)
    for q in (0, 1.5, -0.1, True, "0.2"):
        with pytest.raises(InvalidArgumentError, match=r"high_entropy_mask: quantile must be a number in \(0, 1\]"):
            high_entropy_mask(entropy, mask, quantile=q)
    with pytest.raises(ShapeError, match=r"high_entropy_mask: mask has shape \(2, 2\) but entropy has shape \(2, 3\)"):
        high_entropy_mask(entropy, mask[:, :2], quantile=0.2)
    with pytest.raises(ShapeError, match=r"high_entropy_mask: threshold has shape \(2,\); expected a scalar"):
        high_entropy_mask(entropy, mask, quantile=0.2, threshold=torch.zeros(2))
    with pytest.raises(DTypeError, match="entropy_threshold: entropy has dtype torch.int64"):
        entropy_threshold(entropy.long(), quantile=0.2)
    with pytest.raises(InvalidArgumentError, match=r"entropy_threshold: quantile must be a number in \(0, 1\]"):
        entropy_threshold(entropy, quantile=0.0)


# --- shared -----------------------------------------------------------------------------

def test_bf16_inputs():
    old, rollout, mask = _data(seed=4)
    e = high_entropy_mask(old.abs().bfloat16(), mask, quantile=0.3)
    assert torch.equal(e, high_entropy_mask(old.abs().bfloat16().float(), mask, quantile=0.3))


def test_batch_calling():
    old, rollout, mask = _data(seed=5)
    batch = Batch(old_log_probs=old, rollout_log_probs=rollout, mask=mask, rewards=torch.arange(4.0), batch_size=[4])
    # entropy is no batch key: the entropy filters take tensors
    with pytest.raises(TorchforgeError, match="high_entropy_mask: entropy must be a torch.Tensor, got"):
        high_entropy_mask(batch, mask, quantile=0.2)


def test_high_entropy_mask_compiles_fullgraph_and_matches_eager():
    import torch._dynamo
    torch._dynamo.reset()
    old, rollout, mask = _data(seed=6)
    calls = {
        "high_entropy": lambda: high_entropy_mask(old.abs(), mask, quantile=0.2, threshold=0.5),
    }
    for name, call in calls.items():
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(), call(), msg=name)
