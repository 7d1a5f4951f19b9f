"""torchforge.distributed.collectives: global counts, summed metrics and statistics over ranks
(2-process results from one spawn of tests/_dist_worker.py, see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import _dist_worker as W
from tests.reference import global_counts_ref
from torchforge.distributed import (
    global_counts,
    reduce_metric_sums,
)
from torchforge.errors import DTypeError, InvalidArgumentError, ShapeError


def test_global_counts_hand_case():
    # tokens: 2 + 0 + 3 = 5; sequences with a token: rows 0 and 2 -> 2 (row 1 is empty)
    m1 = torch.tensor([[True, True, False], [False, False, False]])
    m2 = torch.tensor([[True, True, True, False]])
    n_tok, n_seq = global_counts([m1, m2])
    assert (n_tok.item(), n_seq.item()) == (5, 2)
    assert n_tok.dtype == torch.int64


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(0, 2**31)), min_size=1, max_size=4))
def test_global_counts_matches_reference(shapes):
    masks = [torch.rand(b, t, generator=torch.Generator().manual_seed(s)) < 0.4 for b, t, s in shapes]
    n_tok, n_seq = global_counts(masks)
    assert (n_tok.item(), n_seq.item()) == global_counts_ref([masks])


def test_global_counts_errors():
    with pytest.raises(InvalidArgumentError, match=r"global_counts: masks is empty"):
        global_counts([])
    with pytest.raises(DTypeError, match=r"global_counts: mask has dtype torch.float32; expected torch.bool"):
        global_counts([torch.ones(2, 3)])
    with pytest.raises(ShapeError, match=r"global_counts: masks\[1\] has shape \(3,\); expected 2 dimensions"):
        global_counts([torch.ones(2, 3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)])


def test_accumulation_with_global_counts_equals_whole_batch():
    """One process: micro-batches aggregated with the step's counts == the whole batch."""
    for mode in W.MODES:
        grads = []
        for micro in (None, 3):
            model = W.tiny_llama()
            W.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), W.global_batch(), mode, micro=micro)
            grads.append(W.grads_of(model))
        assert max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0]) <= 1e-6


def test_reduce_metric_sums_single_process():
    out = reduce_metric_sums({"reward_sum": torch.tensor(3.5), "count": 4, "kl": torch.tensor([0.25])})
    assert list(out) == ["reward_sum", "count", "kl"]
    assert [v.item() for v in out.values()] == [3.5, 4.0, 0.25]
    assert reduce_metric_sums({}) == {}
    with pytest.raises(InvalidArgumentError, match=r"reduce_metric_sums: sums\['x'\] has shape \(2,\); expected a scalar"):
        reduce_metric_sums({"x": torch.ones(2)})


def test_counts_and_metric_sums_over_ranks(two_process_results):
    # rank 0 holds lengths [6, 6, 5, 6], rank 1 [1, 0, 2, 1]: 27 tokens, 7 non-empty rows
    for r, got in enumerate(two_process_results["counts"]):
        assert got["env_world"] == "2"
        assert [c.item() for c in got["counts"]] == [27, 7]
        assert got["sums"]["tokens"].item() == 27.0 and got["sums"]["rank"].item() == 1.0


def test_statistics_over_ranks_equal_one_process_on_the_whole_batch(two_process_results):
    # Each rank holds half of the rows (uneven token counts: 23 and 4) of values near 1e4;
    # masked_* with sum_over_ranks on each rank == one process on the concatenated batch.
    from torchforge.reduce import masked_mean, masked_var, masked_whiten

    values, mask = W.global_values(), W.global_batch()["mask"]
    whitened = masked_whiten(values, mask)
    weights = torch.arange(24.0).view(4, 6)
    for r, got in enumerate(two_process_results["statistics"]):
        rows = slice(4 * r, 4 * r + 4)
        torch.testing.assert_close(got["mean"], masked_mean(values, mask), rtol=0, atol=0)
        torch.testing.assert_close(got["var"], masked_var(values, mask), rtol=1e-6, atol=0)
        torch.testing.assert_close(got["var_biased"], masked_var(values, mask, unbiased=False), rtol=1e-6, atol=0)
        torch.testing.assert_close(got["whiten"], whitened[rows], rtol=0, atol=1e-6)
        assert torch.equal(got["whiten_over_ranks"], got["whiten"])
        # The gradient of this rank's loss with respect to its values is that of one process
        # on the whole batch (sum_over_ranks passes the gradient of this rank's share).
        full = values.clone().requires_grad_()
        (expected,) = torch.autograd.grad((masked_whiten(full, mask)[rows] * weights).sum(), full)
        torch.testing.assert_close(got["grad"], expected[rows], rtol=1e-5, atol=1e-5)
        assert got["extrema"] == {"rank_max": 1.0, "empty_max": -float("inf"), "rank_min": 0.0, "only_1": 7.0}
        assert got["gathered"].tolist() == [0.0, 1.0, 2.0, 10.0]


_reference_cache: dict = {}


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 6), seed=st.integers(0, 2**31), eps=st.sampled_from([0.0, 1e-8]))
def test_whiten_over_ranks_is_masked_whiten_in_one_process(B, T, seed, eps):
    from torchforge.distributed import whiten_over_ranks
    from torchforge.reduce import masked_whiten

    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g) * 3 + 1
    mask = torch.rand(B, T, generator=g) < 0.6
    values = values.masked_fill(~mask, float("nan"))  # never leaks
    torch.testing.assert_close(whiten_over_ranks(values, mask, eps=eps), masked_whiten(values, mask, eps=eps),
                               rtol=1e-5, atol=1e-6)


def test_whiten_over_ranks_errors():
    from torchforge.distributed import whiten_over_ranks

    with pytest.raises(InvalidArgumentError, match=r"masked_whiten: eps must be >= 0, got -1"):
        whiten_over_ranks(torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), eps=-1)
    with pytest.raises(ShapeError, match=r"masked_whiten: mask has shape \(2, 3\) but values has shape \(2, 2\)"):
        whiten_over_ranks(torch.zeros(2, 2), torch.ones(2, 3, dtype=torch.bool))


def test_single_process_collectives_are_the_identity():
    from torchforge.distributed import (
        gather_over_ranks,
        reduce_metric_extrema,
        sum_over_ranks,
    )

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    assert sum_over_ranks(x) is x
    assert gather_over_ranks(x.detach()).tolist() == [1.0, 2.0]
    assert reduce_metric_extrema({}, {}) == {}
    got = reduce_metric_extrema({"a": 2, "b": torch.tensor([-1.0])}, {"c": 0.5})
    assert got == {"a": 2.0, "b": -1.0, "c": 0.5} and all(v.dtype == torch.float64 for v in got.values())
    with pytest.raises(InvalidArgumentError, match=r"reduce_metric_extrema: \['a'\] are in both maxima and minima"):
        reduce_metric_extrema({"a": 1.0}, {"a": 0.0})
    with pytest.raises(InvalidArgumentError, match=r"reduce_metric_extrema: minima\['c'\] has shape \(2,\); expected a scalar"):
        reduce_metric_extrema({}, {"c": torch.zeros(2)})
    with pytest.raises(InvalidArgumentError, match=r"reduce_metric_extrema: maxima must be a dict of scalars, got list"):
        reduce_metric_extrema([], {})
    with pytest.raises(ShapeError, match=r"gather_over_ranks: values has shape \(2, 2\); expected 1 dimension"):
        gather_over_ranks(torch.zeros(2, 2))
