"""The loop's functions on the tiny local Llama: masks, rollout, log-probs, exact accumulation."""

import pytest
import torch

from torchforge.batch import Batch
from torchforge.errors import InvalidArgumentError
from torchforge.loop import (
    accumulate_gradients,
    micro_batches,
    optimizer_step,
)
from torchforge.reduce import aggregate

EOS = 2


def _toy_parts(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(6, 5, generator=g) < 0.6
    mask[2] = False  # an empty row
    x = torch.randn(6, 5, generator=g)
    return Batch(tokens=torch.zeros(6, 5, dtype=torch.long), mask=mask, advantages=x, batch_size=[6])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_accumulated_micro_batches_give_the_whole_batch_gradient(mode):
    weight = torch.nn.Parameter(torch.tensor(1.5))
    batch = _toy_parts()

    def loss_fn(part, aggregation):
        per_token = (weight * part.advantages) ** 2
        return aggregation(per_token, part.mask), {"m": per_token.detach().mean()}

    loss, _ = accumulate_gradients(list(micro_batches(batch, 2)), loss_fn, mode=mode, norm_length=5)
    accumulated = weight.grad.clone()
    weight.grad = None
    whole = aggregate((weight * batch.advantages) ** 2, batch.mask, mode=mode, norm_length=5)
    whole.backward()
    torch.testing.assert_close(accumulated, weight.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, whole.detach(), rtol=1e-6, atol=0)


def test_optimizer_step_clips_and_reports_the_norm():
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    norm = optimizer_step([weight], optimizer, max_grad_norm=1.0)
    assert norm == pytest.approx(5.0)
    torch.testing.assert_close(weight.detach(), torch.tensor([-0.6, -0.8, 0.0, 0.0]))
    assert weight.grad is None


def test_micro_batches_errors():
    with pytest.raises(InvalidArgumentError, match="micro_batches: size must be an int >= 1, got 0"):
        list(micro_batches(_toy_parts(), 0))


def test_accumulated_extremes_are_max_and_min_and_an_empty_micro_batch_never_wins():
    # micro-batches of 3, 0 and 1 tokens: x_max / x_min combine as max / min (the empty one's
    # 0 is left out), x_mean as the token-weighted mean (3 * 1 + 1 * 5) / 4 = 2
    mask = torch.tensor([[True, True, True], [False, False, False], [True, False, False]])
    batch = Batch(mask=mask, advantages=torch.tensor([[1.0], [0.0], [5.0]]).expand(3, 3), batch_size=[3])
    weight = torch.nn.Parameter(torch.tensor(1.0))

    def loss_fn(part, aggregation):
        x = part.advantages[:, 0]
        return aggregation(weight * part.mask.float(), part.mask), {"x_max": x.max(), "x_min": x.min(), "x_mean": x.mean()}

    _, metrics = accumulate_gradients(list(micro_batches(batch, 1)), loss_fn)
    assert metrics == {"x_max": 5.0, "x_min": 1.0, "x_mean": 2.0}
    _, metrics = accumulate_gradients(list(micro_batches(batch, 1))[1:2], loss_fn)  # nothing counted
    assert metrics["x_max"] == -float("inf") and metrics["x_min"] == float("inf")
