"""Tests for torchforge.reward_shaping: DAPO's overlong penalty."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from tests.reference import overlong_penalty_ref
from torchforge.errors import InvalidArgumentError, ShapeError, TorchforgeError
from torchforge.reward_shaping import overlong_penalty

SETTINGS = settings(max_examples=30, deadline=None)


# --- overlong penalty -------------------------------------------------------------------

def test_overlong_penalty_hand_derived():
    # L_max = 20, L_cache = 4: free up to 16; at 18, -(18 - 16) / 4 = -0.5; at 20, -1; above, -1.
    out = overlong_penalty(torch.tensor([10, 16, 17, 18, 20, 25]), max_length=20, buffer_length=4, penalty=2.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0, -2.0, -2.0]))
    hard = overlong_penalty(torch.tensor([20, 21]), max_length=20, buffer_length=0)
    torch.testing.assert_close(hard, torch.tensor([0.0, -1.0]))


@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=8), max_length=st.integers(1, 30),
       buffer=st.integers(0, 30), penalty=st.sampled_from([0.5, 1.0]))
@SETTINGS
def test_overlong_penalty_matches_reference(lengths, max_length, buffer, penalty):
    buffer = min(buffer, max_length)
    x = torch.tensor(lengths)
    out = overlong_penalty(x, max_length=max_length, buffer_length=buffer, penalty=penalty)
    if buffer == 0:
        expected = torch.tensor([-penalty if n > max_length else 0.0 for n in lengths])
    else:
        expected = overlong_penalty_ref(x, max_length, buffer, penalty)
    torch.testing.assert_close(out, expected.float())
    sorted_out = overlong_penalty(x.sort().values, max_length=max_length, buffer_length=buffer, penalty=penalty)
    assert torch.all(sorted_out[1:] <= sorted_out[:-1])


def test_tensordict_calling():
    # "lengths" is no batch key: overlong_penalty takes the tensor (e.g. batch.mask.sum(-1))
    td2 = TensorDict(lengths=torch.tensor([1, 30]), batch_size=[2])
    with pytest.raises(TorchforgeError, match="overlong_penalty: lengths must be a torch.Tensor, got TensorDict"):
        overlong_penalty(td2, max_length=20, buffer_length=5)
    torch.testing.assert_close(overlong_penalty(td2["lengths"], max_length=20, buffer_length=5), torch.tensor([0.0, -1.0]))


def test_bad_inputs():
    with pytest.raises(InvalidArgumentError, match="overlong_penalty: penalty must be finite and >= 0, got inf"):
        overlong_penalty(torch.tensor([5, 12]), max_length=10, buffer_length=2, penalty=float("inf"))
    with pytest.raises(InvalidArgumentError, match=r"overlong_penalty: buffer_length must be an int in \[0, max_length=10\], got 11"):
        overlong_penalty(torch.tensor([1]), max_length=10, buffer_length=11)
    with pytest.raises(ShapeError, match=r"overlong_penalty: lengths has shape \(2, 1\); expected 1 dimensions"):
        overlong_penalty(torch.ones(2, 1), max_length=10, buffer_length=2)


def test_overlong_penalty_compiles_fullgraph_and_matches_eager():
    import torch._dynamo
    torch._dynamo.reset()
    calls = {
        "overlong": lambda: overlong_penalty(torch.tensor([3, 9, 12]), max_length=10, buffer_length=4),
    }
    for name, call in calls.items():
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(), call(), msg=name)
