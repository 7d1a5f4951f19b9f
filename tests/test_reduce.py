"""Tests for torchforge.reduce: masked reductions and loss aggregation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tests.reference import aggregate_ref, masked_values_ref, masked_var_ref, masked_whiten_ref
from torchforge.batch import Batch
from torchforge.errors import DTypeError, InvalidArgumentError, ShapeError
from torchforge.reduce import (
    AGGREGATION_MODES,
    Aggregation,
    aggregate,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    masked_var,
    masked_whiten,
    pooled_var,
)

SETTINGS = settings(max_examples=30, deadline=None)
NAN = float("nan")


@st.composite
def values_and_mask(draw, min_b=1, max_b=5, max_t=6, p_empty_row=0.25):
    """A [B, T] float32 tensor and a bool mask with some empty rows (maybe all)."""
    B = draw(st.integers(min_b, max_b))
    T = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    values = 3 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < draw(st.floats(0.0, 1.0))
    empty = torch.rand(B, generator=g) < p_empty_row
    mask[empty] = False
    return values, mask


def _grad(fn, values):
    values = values.clone().requires_grad_()
    (grad,) = torch.autograd.grad(fn(values), values)
    return grad


# ----------------------------------------------------------------------------------------
# hand-derived cases
# ----------------------------------------------------------------------------------------

def test_masked_sum_and_mean_hand_derived():
    values = torch.tensor([[1.0, 3.0, NAN], [5.0, 7.0, 2.0]])
    mask = torch.tensor([[True, True, False], [False, True, False]])
    # counted: 1, 3 | 7  -> sum 11, mean 11/3; per row: sums (4, 7), means (2, 7);
    # per column: sums (1, 10, 0), means (1, 5, 0) (an empty column gives 0).
    assert masked_sum(values, mask).item() == 11.0
    assert masked_sum(values, mask, dim=1).tolist() == [4.0, 7.0]
    assert masked_sum(values, mask, dim=0).tolist() == [1.0, 10.0, 0.0]
    torch.testing.assert_close(masked_mean(values, mask), torch.tensor(11 / 3), rtol=0, atol=1e-7)
    assert masked_mean(values, mask, dim=1).tolist() == [2.0, 7.0]
    assert masked_mean(values, mask, dim=0).tolist() == [1.0, 5.0, 0.0]
    assert masked_mean(values, mask, dim=-1).tolist() == [2.0, 7.0]


def test_masked_var_hand_derived():
    values = torch.tensor([[1.0, 3.0, 100.0], [4.0, NAN, 8.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # row 0: 1, 3 -> mean 2, squared deviations 1 + 1 = 2 -> unbiased 2/1 = 2, biased 1.
    # row 1: 4 alone -> 0 (one sample has no spread; not NaN).
    assert masked_var(values, mask, dim=1).tolist() == [2.0, 0.0]
    assert masked_var(values, mask, dim=1, unbiased=False).tolist() == [1.0, 0.0]
    # all: 1, 3, 4 -> mean 8/3, squared deviations 25/9 + 1/9 + 16/9 = 42/9 -> unbiased 7/3.
    torch.testing.assert_close(masked_var(values, mask), torch.tensor(7 / 3), rtol=0, atol=1e-6)
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), torch.tensor(14 / 9), rtol=0, atol=1e-6)
    # column 0: 1, 4 -> mean 2.5, deviations 2.25 + 2.25 -> 4.5; column 2: empty -> 0.
    assert masked_var(values, mask, dim=0).tolist() == [4.5, 0.0, 0.0]


def test_masked_whiten_hand_derived():
    values = torch.tensor([1.0, 3.0, 9.0, NAN])
    mask = torch.tensor([True, True, False, False])
    # counted 1, 3: mean 2, unbiased var 2 -> (1 - 2)/sqrt(2), (3 - 2)/sqrt(2); 0 elsewhere.
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(masked_whiten(values, mask, eps=0.0), torch.tensor([-r, r, 0.0, 0.0]), rtol=0, atol=1e-7)
    # shift_mean=False adds the mean back on counted positions: 2 -+ 1/sqrt(2).
    torch.testing.assert_close(
        masked_whiten(values, mask, shift_mean=False, eps=0.0), torch.tensor([2 - r, 2 + r, 0.0, 0.0]), rtol=0, atol=1e-7
    )
    # eps enters under the root: var + eps = 2 + 2 = 4 -> (-1/2, 1/2).
    torch.testing.assert_close(masked_whiten(values, mask, eps=2.0), torch.tensor([-0.5, 0.5, 0.0, 0.0]), rtol=0, atol=1e-7)
    # the input is not modified
    assert values[:3].tolist() == [1.0, 3.0, 9.0]


def test_aggregate_hand_derived():
    per_token = torch.tensor([[1.0, 1.0, 0.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    # counted tokens 1, 1 | 4 | (row 2 empty): N = 3 tokens, S = 2 non-empty sequences.
    expected = {
        "token-mean": 6 / 3,  # (1 + 1 + 4) / 3
        "seq-mean-token-mean": (1 + 4) / 2,  # row means 1 and 4
        "seq-mean-token-sum": (2 + 4) / 2,  # row sums 2 and 4
        "seq-mean-token-sum-norm": (2 + 4) / (2 * 3),  # / (S * T)
    }
    for mode, value in expected.items():
        out = aggregate(per_token, mask, mode=mode)
        assert out.dtype == torch.float32 and out.dim() == 0
        assert out.item() == pytest.approx(value, abs=1e-7), mode
    assert aggregate(per_token, mask).item() == 2.0  # default mode: token-mean
    # norm_length replaces T: 6 / (2 * 4)
    assert aggregate(per_token, mask, mode="seq-mean-token-sum-norm", norm_length=4).item() == 0.75
    # explicit counts replace the local ones: token-mean 6 / 12, seq modes / 4
    assert aggregate(per_token, mask, num_tokens=12).item() == 0.5
    assert aggregate(per_token, mask, mode="seq-mean-token-sum", num_sequences=4).item() == 1.5
    assert aggregate(per_token, mask, num_tokens=torch.tensor(12)).item() == 0.5
    # dp_size scales: 2 * 6 / 12
    assert aggregate(per_token, mask, num_tokens=12, dp_size=2).item() == 1.0


# ----------------------------------------------------------------------------------------
# agreement with the reference loops
# ----------------------------------------------------------------------------------------

@SETTINGS
@given(data=values_and_mask(), mode=st.sampled_from(AGGREGATION_MODES), norm_length=st.sampled_from([None, 7]))
def test_aggregate_matches_reference(data, mode, norm_length):
    values, mask = data
    out = aggregate(values, mask, mode=mode, norm_length=norm_length)
    assert torch.isfinite(out)
    assert out.item() == pytest.approx(aggregate_ref(values, mask, mode, norm_length), rel=1e-5, abs=1e-5)


@SETTINGS
@given(data=values_and_mask(), dim=st.sampled_from([None, 0, 1, -1]), unbiased=st.booleans())
def test_masked_reductions_match_reference(data, dim, unbiased):
    values, mask = data
    if dim is None:
        slices = [(values, mask)]
    else:
        kept = 1 - dim % 2  # the dimension that is not reduced
        slices = [(values.select(kept, i), mask.select(kept, i)) for i in range(values.shape[kept])]
    sums = [sum(masked_values_ref(v, m)) for v, m in slices]
    means = [s / max(len(masked_values_ref(v, m)), 1) for s, (v, m) in zip(sums, slices)]
    variances = [masked_var_ref(v, m, unbiased) for v, m in slices]
    shape = () if dim is None else (len(slices),)
    expected = [torch.tensor(x, dtype=torch.float64).reshape(shape) for x in (sums, means, variances)]
    got = [
        masked_sum(values, mask, dim=dim),
        masked_mean(values, mask, dim=dim),
        masked_var(values, mask, dim=dim, unbiased=unbiased),
    ]
    for g, e in zip(got, expected):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(data=values_and_mask(), shift_mean=st.booleans())
def test_masked_whiten_matches_reference(data, shift_mean):
    values, mask = data
    out = masked_whiten(values, mask, shift_mean=shift_mean)
    torch.testing.assert_close(out.double(), masked_whiten_ref(values, mask, shift_mean), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------
# masked == sliced
# ----------------------------------------------------------------------------------------

@SETTINGS
@given(data=values_and_mask())
def test_masked_equals_sliced(data):
    values, mask = data
    kept = values[mask]
    torch.testing.assert_close(masked_sum(values, mask), kept.sum(), rtol=1e-6, atol=1e-5)
    if kept.numel() > 0:
        torch.testing.assert_close(masked_mean(values, mask), kept.mean(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(masked_var(values, mask, unbiased=False), kept.var(unbiased=False), rtol=1e-5, atol=1e-5)
    if kept.numel() > 1:
        torch.testing.assert_close(masked_var(values, mask), kept.var(), rtol=1e-5, atol=1e-5)
        whitened = (kept - kept.mean()) / torch.sqrt(kept.var() + 1e-8)
        torch.testing.assert_close(masked_whiten(values, mask)[mask], whitened, rtol=1e-4, atol=1e-4)
    # token-mean over the mask == token-mean over the kept tokens as one full row
    full = torch.ones(1, kept.numel(), dtype=torch.bool)
    if kept.numel() > 0:
        torch.testing.assert_close(aggregate(values, mask), aggregate(kept[None], full), rtol=1e-6, atol=1e-6)


@SETTINGS
@given(data=values_and_mask(max_t=8), mode=st.sampled_from(AGGREGATION_MODES))
def test_aggregate_masked_equals_sliced_rows_and_columns(data, mode):
    values, mask = data
    # Dropping the empty rows and the all-padding columns at the end changes nothing
    # (seq-mean-token-sum-norm keeps its norm_length fixed).
    rows = mask.any(-1)
    T = values.shape[1]
    last = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1
    full = aggregate(values, mask, mode=mode, norm_length=T)
    sliced = aggregate(values[rows][:, :last], mask[rows][:, :last], mode=mode, norm_length=T)
    torch.testing.assert_close(full, sliced, rtol=1e-6, atol=1e-6)
    # and padding columns hold NaN without effect
    padded = torch.cat([values, torch.full_like(values, NAN)], 1)
    padded_mask = torch.cat([mask, torch.zeros_like(mask)], 1)
    torch.testing.assert_close(aggregate(padded, padded_mask, mode=mode, norm_length=T), full, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------
# empty masks, NaN at masked positions, bf16
# ----------------------------------------------------------------------------------------

REDUCTIONS = {
    "masked_sum": lambda v, m: masked_sum(v, m),
    "masked_sum(dim=1)": lambda v, m: masked_sum(v, m, dim=1).sum(),
    "masked_mean": lambda v, m: masked_mean(v, m),
    "masked_mean(dim=1)": lambda v, m: masked_mean(v, m, dim=1).sum(),
    "masked_var": lambda v, m: masked_var(v, m),
    "masked_var(dim=1)": lambda v, m: masked_var(v, m, dim=1).sum(),
    "masked_var(biased)": lambda v, m: masked_var(v, m, unbiased=False),
    "masked_whiten": lambda v, m: (masked_whiten(v, m) * torch.arange(v.numel()).view(v.shape)).sum(),
    "masked_whiten(eps=0)": lambda v, m: (masked_whiten(v, m, eps=0.0) * torch.arange(v.numel()).view(v.shape)).sum(),
    **{f"aggregate({mode})": (lambda v, m, mode=mode: aggregate(v, m, mode=mode)) for mode in AGGREGATION_MODES},
}


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_of_no_tokens_is_zero_in_every_mode(mode):
    # T = 0 (and B = 0): seq-mean-token-sum-norm's default norm_length, T, is then 0
    for shape in ((3, 0), (0, 4), (0, 0)):
        v = torch.zeros(shape, requires_grad=True)
        out = aggregate(v, torch.zeros(shape, dtype=torch.bool), mode=mode)
        assert out.item() == 0.0
        out.backward()
        assert v.grad.shape == shape


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_empty_mask_gives_finite_zero_and_zero_gradient(name):
    fn = REDUCTIONS[name]
    values = torch.randn(3, 4)
    for mask in (torch.zeros(3, 4, dtype=torch.bool), torch.zeros(0, 4, dtype=torch.bool)):
        v = values[: mask.shape[0]].clone().requires_grad_()
        out = fn(v, mask)
        assert out.item() == 0.0
        out.backward()
        assert v.grad.equal(torch.zeros_like(v))


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_nan_at_masked_positions_does_not_leak(name):
    fn = REDUCTIONS[name]
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) < 0.6
    mask[0] = False  # an empty row
    mask[1, :2] = True
    dirty = torch.where(mask, clean, torch.tensor([NAN, float("inf"), -float("inf")]).repeat(5)[:15].view(3, 5))
    assert fn(dirty, mask).equal(fn(clean, mask))
    grad_dirty, grad_clean = _grad(lambda v: fn(v, mask), dirty), _grad(lambda v: fn(v, mask), clean)
    assert torch.isfinite(grad_dirty).all()
    assert grad_dirty.equal(grad_clean)
    assert (grad_dirty[~mask] == 0).all()


def test_constant_values_whiten_to_zero_with_finite_gradient():
    # var + eps = 0: whitened values are 0 (not 0/0) and the gradient is finite.
    values = torch.tensor([2.0, 2.0, 5.0]).requires_grad_()
    mask = torch.tensor([True, True, False])
    out = masked_whiten(values, mask, eps=0.0)
    assert out.equal(torch.zeros(3))
    (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.isfinite(values.grad).all()


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_bf16_input_gives_float32(name):
    fn = REDUCTIONS[name]
    g = torch.Generator().manual_seed(1)
    values = torch.randn(3, 5, generator=g).bfloat16()
    mask = torch.rand(3, 5, generator=g) < 0.7
    out = fn(values, mask)
    assert out.dtype == torch.float32
    assert out.equal(fn(values.float(), mask))
    whitened = masked_whiten(values, mask)
    assert whitened.dtype == torch.float32


# ----------------------------------------------------------------------------------------
# exactness across micro-batches and data-parallel ranks
# ----------------------------------------------------------------------------------------

def _pieces(B, K, M, g):
    """Split rows 0..B-1 into K ranks of M micro-batches each, of uneven (maybe 0) sizes."""
    cuts = torch.sort(torch.randint(0, B + 1, (K * M - 1,), generator=g)).values.tolist()
    bounds = [0, *cuts, B]
    pieces = [slice(bounds[i], bounds[i + 1]) for i in range(K * M)]
    return [pieces[r * M:(r + 1) * M] for r in range(K)]


@settings(max_examples=40, deadline=None)
@given(
    data=values_and_mask(min_b=2, max_b=9), mode=st.sampled_from(AGGREGATION_MODES),
    K=st.integers(1, 3), M=st.integers(1, 3), seed=st.integers(0, 10_000), trim=st.booleans(),
)
def test_aggregation_is_exact_across_micro_batches_and_ranks(data, mode, K, M, seed, trim):
    # A shared "model": per_token = theta * x + theta^2. Each rank sums its micro-batch
    # losses (gradient accumulation) and the ranks' gradients are averaged (DDP / FSDP).
    # With the global counts and dp_size = K this equals one process on the whole batch.
    x, mask = data
    B, T = x.shape
    g = torch.Generator().manual_seed(seed)
    theta = torch.tensor(0.7, requires_grad=True)
    N = mask.sum()
    S = mask.any(-1).sum()

    def loss_of(rows, **counts):
        xs, ms = x[rows], mask[rows]
        if trim:  # each micro-batch padded to its own length: norm_length keeps T
            length = int(ms.any(0).nonzero().max()) + 1 if ms.any() else 1
            xs, ms = xs[:, :length], ms[:, :length]
        return aggregate(theta * xs + theta**2, ms, mode=mode, norm_length=T, **counts)

    whole = loss_of(slice(0, B))
    (whole_grad,) = torch.autograd.grad(whole, theta)

    rank_losses, rank_grads = [], []
    for micro_batches in _pieces(B, K, M, g):
        loss = sum(loss_of(rows, num_tokens=N, num_sequences=S, dp_size=K) for rows in micro_batches)
        rank_losses.append(loss)
        rank_grads.append(torch.autograd.grad(loss, theta, allow_unused=True)[0])
    rank_grads = [torch.zeros(()) if gr is None else gr for gr in rank_grads]
    torch.testing.assert_close(sum(rank_losses) / K, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(rank_grads) / K, whole_grad, rtol=1e-5, atol=1e-5)


def test_local_counts_are_not_exact_across_micro_batches():
    # Without the global counts, micro-batch means do not add up: the test above can fail.
    per_token = torch.tensor([[1.0, 1.0], [4.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    whole = aggregate(per_token, mask)  # 6 / 3 = 2
    halves = (aggregate(per_token[:1], mask[:1]) + aggregate(per_token[1:], mask[1:])) / 2  # (1 + 4) / 2
    assert whole.item() == 2.0 and halves.item() == 2.5


def test_dp_size_without_counts_raises():
    per_token, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(InvalidArgumentError, match="aggregate: dp_size=2 needs num_tokens"):
        aggregate(per_token, mask, dp_size=2)
    for mode in AGGREGATION_MODES[1:]:
        with pytest.raises(InvalidArgumentError, match=f"aggregate: dp_size=4 with mode='{mode}' needs num_sequences"):
            aggregate(per_token, mask, mode=mode, dp_size=4, num_tokens=6)
    # with the count of the mode, it works
    assert aggregate(per_token, mask, dp_size=2, num_tokens=12).item() == 0.0


# ----------------------------------------------------------------------------------------
# Aggregation, calling convention
# ----------------------------------------------------------------------------------------

@SETTINGS
@given(data=values_and_mask(), mode=st.sampled_from(AGGREGATION_MODES), dp_size=st.integers(1, 3))
def test_aggregation_dataclass_equals_aggregate(data, mode, dp_size):
    values, mask = data
    counts = dict(num_tokens=int(mask.sum()) + 3, num_sequences=int(mask.any(-1).sum()) + 1)
    agg = Aggregation(mode=mode, dp_size=dp_size, norm_length=5, **counts)
    expected = aggregate(values, mask, mode=mode, dp_size=dp_size, norm_length=5, **counts)
    assert agg(values, mask).equal(expected)
    assert Aggregation.of(mode)(values, mask).equal(aggregate(values, mask, mode=mode))
    assert Aggregation.of(agg) is agg


def test_aggregate_and_masked_reductions_refuse_a_batch():
    # "values" is the critic's batch key: masked_mean(batch) used to read it silently.
    values = torch.randn(2, 4)
    mask = torch.tensor([[True, False, True, True], [False, False, False, False]])
    td = TensorDict(values=values, per_token=values, mask=mask, batch_size=[2])
    batch = Batch(values=values, mask=mask, batch_size=[2])
    for fn in (masked_sum, masked_mean, masked_var, masked_whiten, masked_min, masked_max):
        for data in (td, batch):
            with pytest.raises(InvalidArgumentError, match=rf"{fn.__name__}: values is a \w+; expected a tensor.*batch.mask"):
                fn(data, mask)
            with pytest.raises(TypeError):
                fn(data)
    with pytest.raises(InvalidArgumentError, match=r"aggregate: per_token is a TensorDict; expected a tensor"):
        aggregate(td, mask)


# ----------------------------------------------------------------------------------------
# masked_min / masked_max
# ----------------------------------------------------------------------------------------

def test_masked_min_max_hand_derived():
    values = torch.tensor([[1.0, 9.0, NAN], [5.0, -7.0, 2.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[True, False, False], [True, True, False], [False, False, False]])
    # counted: 1 | 5, -7 | nothing -> max 5, min -7; rows: max (1, 5, fill), min (1, -7, fill);
    # columns: max (5, -7, fill), min (1, -7, fill).
    assert masked_max(values, mask).item() == 5.0
    assert masked_min(values, mask).item() == -7.0
    assert masked_max(values, mask, dim=1).tolist() == [1.0, 5.0, 0.0]
    assert masked_min(values, mask, dim=1, fill=-3.0).tolist() == [1.0, -7.0, -3.0]
    assert masked_max(values, mask, dim=0).tolist() == [5.0, -7.0, 0.0]
    assert masked_min(values, mask, dim=-2).tolist() == [1.0, -7.0, 0.0]
    assert masked_max(values, torch.zeros_like(mask)).item() == 0.0
    assert masked_max(values, torch.zeros_like(mask), fill=-math.inf).item() == -math.inf
    assert masked_min(values.bfloat16(), mask).dtype == torch.float32


@pytest.mark.parametrize("shape,dim", [((0, 3), None), ((0, 3), 0), ((0, 3), 1), ((2, 0), 1), ((2, 0), None)])
def test_masked_min_max_empty_tensors(shape, dim):
    values, mask = torch.zeros(shape), torch.zeros(shape, dtype=torch.bool)
    expected_shape = () if dim is None else values.sum(dim).shape
    for fn in (masked_min, masked_max):
        out = fn(values, mask, dim=dim, fill=1.5)
        assert out.shape == expected_shape and bool((out == 1.5).all())


@SETTINGS
@given(data=values_and_mask())
def test_masked_min_max_match_reference_and_gradient_at_the_extremum(data):
    values, mask = data
    xs = masked_values_ref(values, mask)
    assert masked_max(values, mask).item() == (max(xs) if xs else 0.0)
    assert masked_min(values, mask).item() == (min(xs) if xs else 0.0)
    rows = [masked_values_ref(values[b], mask[b]) for b in range(values.shape[0])]
    assert masked_max(values, mask, dim=1).tolist() == [max(r) if r else 0.0 for r in rows]
    # masked == sliced, and NaN where the mask is False never leaks.
    poisoned = values.masked_fill(~mask, NAN)
    assert masked_min(poisoned, mask).item() == masked_min(values[mask], torch.ones(len(xs), dtype=torch.bool)).item()
    grad = _grad(lambda v: masked_max(v, mask), values)
    assert grad.sum().item() == (1.0 if xs else 0.0) and bool((grad[~mask] == 0).all())


def test_masked_min_max_bad_inputs():
    values, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ShapeError, match=r"masked_max: mask has shape \(2, 1\) but values has shape \(2, 3\)"):
        masked_max(values, torch.ones(2, 1, dtype=torch.bool))
    with pytest.raises(DTypeError, match="masked_min: values has dtype torch.int64; expected a floating-point"):
        masked_min(values.long(), mask)
    with pytest.raises(InvalidArgumentError, match="masked_min: fill must be a number \\(not NaN\\), got nan"):
        masked_min(values, mask, fill=NAN)
    with pytest.raises(InvalidArgumentError, match=r"masked_max: dim=2 for values of 2 dimensions; expected None or an int in \[-2, 2\)"):
        masked_max(values, mask, dim=2)


# ----------------------------------------------------------------------------------------
# statistics over ranks: sum_over_ranks
# ----------------------------------------------------------------------------------------

def _two_identical_ranks(x):
    """sum_over_ranks of two ranks that hold the same shard: the batch doubled."""
    return 2 * x


@SETTINGS
@given(data=values_and_mask())
def test_sum_over_ranks_gives_the_statistics_of_the_whole_batch(data):
    # Two ranks holding the same shard == one process on the shard concatenated with itself.
    values, mask = data
    both_v, both_m = torch.cat([values, values]), torch.cat([mask, mask])
    kw = dict(sum_over_ranks=_two_identical_ranks)
    torch.testing.assert_close(masked_mean(values, mask, **kw), masked_mean(both_v, both_m), rtol=1e-6, atol=1e-6)
    for unbiased in (True, False):
        torch.testing.assert_close(masked_var(values, mask, unbiased=unbiased, **kw),
                                   masked_var(both_v, both_m, unbiased=unbiased), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(masked_whiten(values, mask, **kw), masked_whiten(both_v, both_m)[: len(values)],
                               rtol=1e-5, atol=1e-6)
    # The identity is one process.
    torch.testing.assert_close(masked_whiten(values, mask, sum_over_ranks=lambda x: x), masked_whiten(values, mask),
                               rtol=0, atol=0)


def test_sum_over_ranks_hand_derived():
    # Ranks hold [1, 3] and (simulated) [5, 7]: n = 4, mean 4, M2 = 9 + 1 + 1 + 9 = 20, var = 20 / 3.
    # Pass 1 adds (count 2, sum 12) from the other rank; pass 2 adds its squared deviations
    # (5-4)^2 + (7-4)^2 = 10 and deviations 1 + 3 = 4 (this rank's: -3 - 1 = -4, so the
    # correction (sum d)^2 / n is 0 here).
    others = iter([torch.tensor([2.0, 12.0], dtype=torch.float64), torch.tensor([10.0, 4.0], dtype=torch.float64)])
    values, mask = torch.tensor([1.0, 3.0]), torch.ones(2, dtype=torch.bool)
    var = masked_var(values, mask, sum_over_ranks=lambda x: x + next(others))
    torch.testing.assert_close(var, torch.tensor(20 / 3), rtol=0, atol=1e-6)


def test_variance_of_rewards_offset_by_1e4_is_exact():
    # Float32 inputs near 1e4 (exactly representable): the two float64 passes match the
    # exact variance of those inputs; float32 sums would be off in the 4th digit.
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(-8, 9, (64, 32), generator=g).float() / 8  # multiples of 1/8
    mask = torch.rand(64, 32, generator=g) < 0.7
    for offset in (0.0, 1e4, -1e4):
        rewards = noise + offset
        assert bool((rewards - offset == noise).all())  # the inputs are exact
        torch.testing.assert_close(masked_var(rewards, mask), torch.tensor(masked_var_ref(noise, mask)).float(),
                                   rtol=1e-6, atol=0)
        torch.testing.assert_close(masked_whiten(rewards, mask), masked_whiten_ref(noise, mask).float(),
                                   rtol=0, atol=1e-6)
    # Small spread on a large offset: 1e4 + N(0, 0.05^2). Against float64 on the same float32
    # inputs, the whitened values are within 2e-5 (float32 sums and a float32 mean: 8e-4).
    rewards = 1e4 + 0.05 * torch.randn(256, 512, generator=g)
    mask = torch.rand(256, 512, generator=g) < 0.8
    exact = rewards.double()[mask]
    expected = (rewards.double() - exact.mean()) / exact.var().sqrt()
    torch.testing.assert_close(masked_var(rewards, mask).double(), exact.var(), rtol=2e-7, atol=0)
    assert (masked_whiten(rewards, mask).double() - expected)[mask].abs().max() < 2e-5


def test_sum_over_ranks_bad_inputs():
    values, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(InvalidArgumentError, match="masked_mean: sum_over_ranks with dim=1; .* pass dim=None"):
        masked_mean(values, mask, dim=1, sum_over_ranks=lambda x: x)
    with pytest.raises(InvalidArgumentError, match="masked_var: sum_over_ranks is a int; expected a function"):
        masked_var(values, mask, sum_over_ranks=1)
    with pytest.raises(ShapeError, match=r"masked_whiten: sum_over_ranks returned \(\) for a tensor of shape \(2,\)"):
        masked_whiten(values, mask, sum_over_ranks=lambda x: x.sum())


# ----------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------

def test_bad_inputs():
    values = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(DTypeError, match=r"aggregate: mask has dtype torch.float32; expected torch.bool .*mask.bool\(\)"):
        aggregate(values, mask.float())
    with pytest.raises(DTypeError, match="masked_mean: mask has dtype torch.int64; expected torch.bool"):
        masked_mean(values, mask.long())
    with pytest.raises(ShapeError, match=r"masked_sum: mask has shape \(2, 1\) but values has shape \(2, 3\); expected \(2, 3\)"):
        masked_sum(values, torch.ones(2, 1, dtype=torch.bool))  # would broadcast: rejected
    with pytest.raises(ShapeError, match=r"aggregate: mask has shape \(3, 2\) but per_token has shape \(2, 3\)"):
        aggregate(values, torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ShapeError, match=r"aggregate: per_token has shape \(3,\); expected 2 dimensions"):
        aggregate(torch.zeros(3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(DTypeError, match="masked_var: values has dtype torch.int64; expected a floating-point tensor"):
        masked_var(values.long(), mask)
    with pytest.raises(InvalidArgumentError, match="aggregate: mode is 'seq-mean'; expected one of 'token-mean', 'seq-mean-token-mean'"):
        aggregate(values, mask, mode="seq-mean")
    with pytest.raises(InvalidArgumentError, match="aggregate: dp_size must be an int >= 1, got 0"):
        aggregate(values, mask, dp_size=0)
    with pytest.raises(InvalidArgumentError, match="aggregate: dp_size must be an int >= 1, got 1.5"):
        aggregate(values, mask, dp_size=1.5, num_tokens=6)
    with pytest.raises(InvalidArgumentError, match="aggregate: norm_length must be > 0, got 0"):
        aggregate(values, mask, mode="seq-mean-token-sum-norm", norm_length=0)
    with pytest.raises(InvalidArgumentError, match="aggregate: num_tokens must be >= 0, got -1"):
        aggregate(values, mask, num_tokens=-1)
    with pytest.raises(InvalidArgumentError, match="aggregate: num_sequences must be >= 0, got -2"):
        aggregate(values, mask, mode="seq-mean-token-sum", num_sequences=-2)
    # dim: one named error (was torch's IndexError or a TypeError from deep inside)
    for fn in (masked_sum, masked_mean, masked_var, masked_min, masked_max):
        with pytest.raises(InvalidArgumentError, match=rf"{fn.__name__}: dim=5 for values of 2 dimensions; "
                                                       r"expected None or an int in \[-2, 2\)"):
            fn(values, mask, dim=5)
    for fn in (masked_var, masked_min):
        with pytest.raises(InvalidArgumentError, match=rf"{fn.__name__}: dim=\(0, 1\) for values of 2 dimensions"):
            fn(values, mask, dim=(0, 1))
    assert masked_sum(values, mask, dim=(0, 1)) == masked_sum(values, mask)
    # a count is a scalar: a [2] or [B, T] count would broadcast the loss into a tensor
    for count in (torch.tensor([6.0, 3.0]), torch.ones(2, 3)):
        with pytest.raises(ShapeError, match=r"aggregate: num_tokens has shape \((2|2, 3),?\); expected a scalar"):
            aggregate(values, mask, num_tokens=count)
    assert aggregate(values, mask, num_tokens=torch.tensor([6.0])).shape == ()
    with pytest.raises(InvalidArgumentError, match="aggregate: num_tokens must be finite and >= 0, got inf"):
        aggregate(values, mask, num_tokens=float("inf"))
    with pytest.raises(InvalidArgumentError, match="aggregate: num_sequences must be a number >= 0, got True"):
        aggregate(values, mask, mode="seq-mean-token-mean", num_sequences=True)
    with pytest.raises(InvalidArgumentError, match="masked_whiten: eps must be >= 0, got -1"):
        masked_whiten(values, mask, eps=-1.0)
    with pytest.raises(DTypeError, match="aggregate: per_token has dtype torch.int64; expected a floating-point"):
        aggregate(values.long(), mask)


# --- pooled_var: the variance of the union from each part's statistics -----------------------

def test_pooled_var_hand_derived():
    # parts [1, 3] (n 2, mean 2, M2 2) and [5] (n 1, mean 5, M2 0): values 1, 3, 5 -> mean 3,
    # squared deviations 4 + 0 + 4 = 8 -> unbiased 4, biased 8/3; M2 = 2 + 0 + 2 * 1 + 1 * 4.
    n, mean, m2 = torch.tensor([2.0, 1.0]), torch.tensor([2.0, 5.0]), torch.tensor([2.0, 0.0])
    assert pooled_var(n, mean, m2).item() == 4.0
    torch.testing.assert_close(pooled_var(n, mean, m2, unbiased=False), torch.tensor(8 / 3), rtol=0, atol=1e-7)
    # an empty part adds nothing, whatever its (finite) mean; one value in all has no spread
    assert pooled_var(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([2.0, 123.0, 5.0]), torch.tensor([2.0, 0.0, 0.0])).item() == 4.0
    assert pooled_var(torch.tensor([1.0, 0.0]), torch.tensor([7.0, 0.0]), torch.zeros(2)).item() == 0.0
    assert pooled_var(torch.zeros(0), torch.zeros(0), torch.zeros(0)).item() == 0.0


@settings(max_examples=40, deadline=None)
@given(parts=st.integers(1, 6), seed=st.integers(0, 2**16), offset=st.sampled_from([0.0, 1e4]))
def test_pooled_var_equals_masked_var_of_the_union(parts, seed, offset):
    g = torch.Generator().manual_seed(seed)
    chunks = [torch.randn(int(torch.randint(0, 5, (1,), generator=g)), generator=g, dtype=torch.float64) * 1e-2 + offset
              for _ in range(parts)]
    n = torch.tensor([float(c.numel()) for c in chunks])
    mean = torch.stack([c.mean() if c.numel() else c.new_zeros(()) for c in chunks])
    m2 = torch.stack([((c - c.mean()) ** 2).sum() if c.numel() else c.new_zeros(()) for c in chunks])
    union = torch.cat(chunks)
    expected = union.var() if union.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    torch.testing.assert_close(pooled_var(n, mean, m2).double(), expected, rtol=1e-6, atol=1e-12)
    # m2 as its total over the parts: the same variance
    torch.testing.assert_close(pooled_var(n, mean, m2.sum()).double(), expected, rtol=1e-6, atol=1e-12)


def test_pooled_var_over_ranks_equals_one_process():
    # two "ranks" holding two parts each: sum_over_ranks adds the other rank's share
    n, mean, m2 = torch.tensor([3.0, 2.0, 4.0, 1.0]), torch.tensor([1.0, 2.0, 10.0, -3.0]), torch.tensor([0.5, 1.0, 2.0, 0.0])
    one = pooled_var(n, mean, m2)
    shares = {}

    def rank(r):
        part = slice(2 * r, 2 * r + 2)

        def sum_over_ranks(t):
            shares.setdefault(r, []).append(t)
            return t + pooled_share(1 - r, len(shares[r]) - 1)

        return pooled_var(n[part], mean[part], m2[part], sum_over_ranks=sum_over_ranks)

    def pooled_share(r, call):  # what rank r sends in its call number `call` (the same sums)
        part = slice(2 * r, 2 * r + 2)
        n_i, mean_i = n[part].double(), mean[part].double()
        if call == 0:
            return torch.stack([n_i.sum(), (n_i * mean_i).sum()])
        total = n.double().sum()
        global_mean = (n.double() * mean.double()).sum() / total
        return (m2[part].double().sum() + (n_i * (mean_i - global_mean) ** 2).sum()).reshape(1)

    for r in range(2):
        torch.testing.assert_close(rank(r), one, rtol=1e-6, atol=0)


def test_pooled_var_bad_input():
    with pytest.raises(ShapeError, match=r"pooled_var: counts, means and m2 have shapes \(2,\), \(3,\)"):
        pooled_var(torch.ones(2), torch.ones(3), torch.ones(2))
    with pytest.raises(ShapeError, match=r"pooled_var: .* and \(3,\); expected one shape .*m2 possibly a scalar"):
        pooled_var(torch.ones(2), torch.ones(2), torch.ones(3))
    with pytest.raises(InvalidArgumentError, match="pooled_var: sum_over_ranks is a int"):
        pooled_var(torch.ones(2), torch.ones(2), torch.ones(2), sum_over_ranks=3)
