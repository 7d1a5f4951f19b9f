"""Tests for torchforge.batch: the Batch tensorclass and the @batch_args calling convention."""

import inspect

import pytest
import torch
from tensordict import TensorDict

from torchforge.batch import Batch, batch_args, is_batch
from torchforge.errors import InvalidArgumentError, MissingKeyError, TorchforgeError


def _batch(B=3, T=4):
    g = torch.Generator().manual_seed(0)
    return Batch(
        tokens=torch.randint(0, 10, (B, T), generator=g),
        mask=torch.rand(B, T, generator=g) < 0.7,
        log_probs=-torch.rand(B, T, generator=g),
        rewards=torch.randn(B, generator=g),
        batch_size=[B],
    )


# ----------------------------------------------------------------------------------------
# Batch
# ----------------------------------------------------------------------------------------

def test_attribute_and_key_access_agree():
    batch = _batch()
    assert batch["log_probs"] is batch.log_probs
    assert batch.get("mask") is batch.mask
    assert batch.old_log_probs is None and batch["ref_log_probs"] is None  # unset fields
    assert batch.batch_size == torch.Size([3])


def test_key_and_attribute_set():
    batch = _batch()
    ref = torch.zeros(3, 4)
    batch["ref_log_probs"] = ref
    assert batch.ref_log_probs.equal(ref)
    values = torch.ones(3, 4)
    batch.values = values  # "values" is a key and a TensorDict method name
    assert batch["values"].equal(values) and batch.values.equal(values)
    with pytest.raises(RuntimeError, match="batch dimension mismatch"):
        batch["old_log_probs"] = torch.zeros(2, 4)  # B must match
    with pytest.raises(AttributeError, match="no such field"):
        batch.logits = torch.zeros(3, 4, 5)  # not in the key vocabulary


def test_slicing_indexes_the_batch_dimension():
    batch = _batch()
    head = batch[1:]
    assert isinstance(head, Batch) and head.batch_size == torch.Size([2])
    assert head.log_probs.equal(batch.log_probs[1:]) and head.rewards.equal(batch.rewards[1:])
    picked = batch[torch.tensor([True, False, True])]
    assert picked.batch_size == torch.Size([2]) and picked.tokens.equal(batch.tokens[[0, 2]])
    one = batch[1]
    assert one.log_probs.equal(batch.log_probs[1]) and one.batch_size == torch.Size([])
    assert batch[torch.tensor([2, 0])].mask.equal(batch.mask[[2, 0]])


def test_to_and_from_tensordict():
    batch = _batch()
    td = batch.to_tensordict()
    assert isinstance(td, TensorDict) and not isinstance(td, Batch)
    assert set(td.keys()) == {"tokens", "mask", "log_probs", "rewards"}  # unset fields absent
    assert td["log_probs"].equal(batch.log_probs)
    back = Batch.from_tensordict(td)
    assert isinstance(back, Batch) and back.batch_size == batch.batch_size
    for key in ("tokens", "mask", "log_probs", "rewards"):
        assert back[key].equal(batch[key])
    assert back.advantages is None


def test_is_batch():
    assert is_batch(_batch())
    assert is_batch(TensorDict(a=torch.zeros(2), batch_size=[2]))
    assert not is_batch(torch.zeros(2))
    assert not is_batch({"log_probs": torch.zeros(2)})


# ----------------------------------------------------------------------------------------
# batch_args
# ----------------------------------------------------------------------------------------

@batch_args
def _weighted_sum(log_probs, mask, advantages=None, *, scale=1.0):
    """Test primitive: scale * sum of log_probs (times advantages) where mask."""
    out = torch.where(mask, log_probs, 0.0)
    if advantages is not None:
        out = out * advantages.unsqueeze(-1)
    return scale * out.sum()


def test_batch_args_plain_tensors_unchanged():
    batch = _batch()
    expected = 2.0 * torch.where(batch.mask, batch.log_probs, 0.0).sum()
    assert _weighted_sum(batch.log_probs, batch.mask, scale=2.0).equal(expected)
    assert _weighted_sum(log_probs=batch.log_probs, mask=batch.mask, scale=2.0).equal(expected)


def test_batch_args_reads_keys_from_batch_and_tensordict():
    batch = _batch()
    expected = _weighted_sum(batch.log_probs, batch.mask, scale=3.0)
    assert _weighted_sum(batch, scale=3.0).equal(expected)
    assert _weighted_sum(batch.to_tensordict(), scale=3.0).equal(expected)
    # an optional key present in the batch is read too
    batch.advantages = torch.tensor([1.0, -1.0, 2.0])
    assert _weighted_sum(batch).equal(_weighted_sum(batch.log_probs, batch.mask, batch.advantages))
    # extra keys are ignored
    td = batch.to_tensordict()
    td["logits"] = torch.zeros(3, 4, 5)
    assert _weighted_sum(td).equal(_weighted_sum(batch))


def test_batch_args_explicit_keywords_override_keys():
    batch = _batch()
    ones = torch.ones(3, 4, dtype=torch.bool)
    assert _weighted_sum(batch, mask=ones).equal(batch.log_probs.sum())
    advantages = torch.full((3,), 2.0)
    assert _weighted_sum(batch, advantages=advantages).equal(2 * _weighted_sum(batch))
    # the batch itself is not modified
    assert batch.advantages is None


def test_batch_args_missing_required_key():
    td = TensorDict(log_probs=torch.zeros(2, 3), batch_size=[2])
    with pytest.raises(MissingKeyError, match=r"_weighted_sum: the batch has no key 'mask' \(keys: \['log_probs'\]\)"):
        _weighted_sum(td)
    # an unset Batch field counts as missing
    with pytest.raises(MissingKeyError, match="_weighted_sum: the batch has no key 'log_probs'"):
        _weighted_sum(Batch(mask=torch.ones(2, 3, dtype=torch.bool), batch_size=[2]))
    # MissingKeyError is a KeyError whose message is printed unquoted, and a TorchforgeError
    with pytest.raises(KeyError) as info:
        _weighted_sum(td)
    assert str(info.value).startswith("_weighted_sum: the batch")
    assert isinstance(info.value, TorchforgeError)
    # passing the missing key by keyword fixes it
    assert _weighted_sum(td, mask=torch.ones(2, 3, dtype=torch.bool)).item() == 0.0


def test_batch_args_rejects_extra_positional_arguments():
    batch = _batch()
    with pytest.raises(InvalidArgumentError, match="_weighted_sum: got a batch as first argument and 1 more positional"):
        _weighted_sum(batch, batch.mask)
    with pytest.raises(InvalidArgumentError, match="and 2 more positional"):
        _weighted_sum(batch.to_tensordict(), batch.mask, None)


def test_batch_args_keeps_name_docstring_and_signature():
    assert _weighted_sum.__name__ == "_weighted_sum"
    assert _weighted_sum.__doc__.startswith("Test primitive")
    params = inspect.signature(_weighted_sum).parameters
    assert list(params) == ["log_probs", "mask", "advantages", "scale"]
    assert params["scale"].kind is inspect.Parameter.KEYWORD_ONLY
