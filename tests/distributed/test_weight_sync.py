"""torchforge.distributed.weight_sync: copying weights into a generation copy, generation under FSDP."""

from __future__ import annotations

import pytest
import torch

from tests import _dist_worker as W
from torchforge.distributed import (
    shard,
    sync_weights,
    unwrap_model,
)
from torchforge.errors import InvalidArgumentError


def test_sync_weights_single_process():
    src, dst = W.tiny_llama(seed=0), W.tiny_llama(seed=1).to(torch.bfloat16)
    sync_weights(shard(src, activation_checkpointing=True), dst)  # wrapper names are mapped
    for (name, a), b in zip(unwrap_model(src).named_parameters(), dst.parameters()):
        assert b.dtype == torch.bfloat16
        assert torch.equal(a.detach().to(torch.bfloat16), b), name
    with pytest.raises(InvalidArgumentError, match=r"sync_weights: src_model and dst_model have different tensors"):
        sync_weights(src, torch.nn.Linear(2, 2))


def test_generation_with_uneven_lengths_does_not_deadlock(two_process_results):
    """Rank 0 stops after 1 token (its first greedy token is eos), rank 1 runs 8: with
    synced_gpus both return (FSDP forwards are collectives) and agree with one process."""
    result = two_process_results["generate"]
    assert result["lengths"] == [4 + 1, 4 + 8]
    prompt = W.global_batch()["input_ids"][:1, :4]
    with torch.no_grad():
        expected = W.tiny_llama().generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                           eos_token_id=result["eos"], pad_token_id=0)
    assert result["generated"][1] == expected.tolist()
    with torch.no_grad():
        stopped = W.tiny_llama().generate(prompt, max_new_tokens=8, do_sample=False,
                                          eos_token_id=result["eos"], pad_token_id=0)
    assert result["generated"][0] == stopped.tolist()
    assert stopped[0, -1].item() == result["eos"] and stopped.shape[1] == 4 + 1
