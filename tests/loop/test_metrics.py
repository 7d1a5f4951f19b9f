"""StepMetrics: a step's metrics combined over micro-batches and processes as their reductions say."""

import math

import pytest
import torch

from tests._dist_worker import step_metric_parts, step_metrics_of
from tests.distributed.conftest import two_process_results  # noqa: F401  (the one 2-process launch)
from torchforge.errors import InvalidArgumentError
from torchforge.loop.metrics import Metric, StepMetrics, metric_reduction


def test_hand_derived_combination():
    metrics = step_metrics_of(step_metric_parts())
    got = metrics.reduce()
    # clip_frac: token-weighted, (3 * 0.5 + 1 * 0.1 + 0 * 0.9 + 4 * 0.3) / 8 = 2.8 / 8
    assert got["clip_frac"] == pytest.approx(0.35, abs=1e-7)
    # the extremes of the parts that count a token: the third part's 99 / -99 never win
    assert got["ratio_max"] == pytest.approx(1.5) and got["ratio_min"] == pytest.approx(0.7)
    assert got["top_margin"] == pytest.approx(4.0)  # a Metric states "max" for a name that does not
    # pg_loss is a term of the loss: the parts' shares add up, 0.25 - 0.5 + 1 + 0.125
    assert got["pg_loss"] == pytest.approx(0.875)
    assert list(got) == ["clip_frac", "ratio_max", "ratio_min", "pg_loss", "top_margin"]  # the order added


def test_local_keeps_the_values_on_their_device_until_reduce():
    metrics = step_metrics_of(step_metric_parts()[:2])
    local = metrics.local()
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in local.values())
    assert local["clip_frac"].item() == pytest.approx((3 * 0.5 + 0.1) / 4)


def test_extremes_of_nothing_counted():
    metrics = StepMetrics()
    metrics.update({"ratio_max": torch.tensor(5.0), "ratio_min": torch.tensor(-5.0)}, weight=0)
    assert metrics.local()["ratio_max"].item() == -math.inf and metrics.local()["ratio_min"].item() == math.inf
    assert metrics.reduce() == {"ratio_max": 0.0, "ratio_min": 0.0}  # as a loss's metrics of an empty mask


def test_a_mean_of_no_tokens_is_zero_not_nan():
    metrics = StepMetrics()
    metrics.add("entropy", torch.tensor(3.0), weight=0)
    assert metrics.reduce() == {"entropy": 0.0}


@pytest.mark.parametrize("name, reduction", [("ratio_max", "max"), ("kl_min", "min"), ("value_loss", "sum"),
                                             ("clip_frac_low", "mean"), ("entropy", "mean")])
def test_reduction_from_the_name(name, reduction):
    assert metric_reduction(name) == reduction


def test_bad_input():
    with pytest.raises(InvalidArgumentError, match=r"Metric: reduction is 'median'; expected one of 'mean', 'sum', 'max', 'min'"):
        Metric(torch.tensor(1.0), "median")
    metrics = StepMetrics()
    metrics.add("margin", 1.0)
    with pytest.raises(InvalidArgumentError, match=r"StepMetrics.add: margin was added as a 'mean' metric; "
                                                   r"expected the same reduction, got 'max'"):
        metrics.add("margin", Metric(2.0, "max"))
    with pytest.raises(InvalidArgumentError, match=r"StepMetrics.add: reduction is 'avg'; expected one of"):
        metrics.add("other", 1.0, reduction="avg")


def test_two_processes_reduce_to_one(two_process_results):  # noqa: F811
    whole = step_metrics_of(step_metric_parts()).reduce()
    for rank, got in enumerate(two_process_results["statistics"]):
        assert list(got["step_metrics"]) == list(whole), rank
        for name, value in whole.items():
            assert got["step_metrics"][name] == pytest.approx(value, rel=1e-6), (rank, name)
