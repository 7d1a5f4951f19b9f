"""torchforge.distributed.parallelize: DistributedConfig, shard(), and 2-process DDP / FSDP2 runs
on CPU with gloo equal to one process (the trainer's through the torchforge command)."""

from __future__ import annotations

import pytest
import torch

from tests import _dist_worker as W
from torchforge.distributed import (
    DistributedConfig,
    shard,
)
from torchforge.errors import InvalidArgumentError
from torchforge.reduce import Aggregation


def test_distributed_config_card_examples():
    cfg = DistributedConfig(strategy="fsdp", num_gpus=8, sharding_strategy="full", mixed_precision="bf16")
    assert cfg.shard_kwargs() == {"strategy": "fsdp", "sharding_strategy": "full",
                                  "mixed_precision": "bf16", "activation_checkpointing": False}
    assert DistributedConfig(strategy="ddp", num_gpus=4).num_gpus == 4
    with pytest.raises(InvalidArgumentError, match=r"DistributedConfig: strategy is 'zero'; expected one of 'fsdp', 'ddp', 'none'"):
        DistributedConfig(strategy="zero")
    with pytest.raises(InvalidArgumentError, match=r"DistributedConfig: sharding_strategy is 'half'"):
        DistributedConfig(sharding_strategy="half")
    with pytest.raises(InvalidArgumentError, match=r"DistributedConfig: mixed_precision is 'fp16'"):
        DistributedConfig(mixed_precision="fp16")
    with pytest.raises(InvalidArgumentError, match=r"DistributedConfig: num_gpus must be None or an int >= 1, got 0"):
        DistributedConfig(num_gpus=0)


def test_shard_errors():
    model = W.tiny_llama()
    with pytest.raises(InvalidArgumentError, match=r"shard: strategy is 'zero3'; expected one of 'fsdp', 'ddp', 'none'"):
        shard(model, strategy="zero3")
    with pytest.raises(InvalidArgumentError, match=r"shard: sharding_strategy is 'shard_all'"):
        shard(model, sharding_strategy="shard_all")
    with pytest.raises(InvalidArgumentError, match=r"shard: mixed_precision is 'fp8'"):
        shard(model, mixed_precision="fp8")
    with pytest.raises(InvalidArgumentError,
                       match=r"shard: no module of LlamaForCausalLM matched block_types=\['GPT2Block'\]"):
        shard(model, block_types=["GPT2Block"])
    with pytest.raises(InvalidArgumentError,
                       match=r"shard: no module of Sequential matched model._no_split_modules=\[\]"):
        shard(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(InvalidArgumentError, match=r"shard: mesh \(2,\) does not fit world size 1 .* whose product is 1"):
        shard(model, mesh=(2,))
    with pytest.raises(InvalidArgumentError, match=r"shard: mesh \(1,\) does not fit world size 1 with "
                       r"sharding_strategy='hybrid'; expected 2 positive dimension\(s\) \(replicate, shard\)"):
        shard(model, mesh=(1,), sharding_strategy="hybrid")
    with pytest.raises(InvalidArgumentError, match=r"shard: mesh is only used with strategy='fsdp', got strategy='ddp'"):
        shard(model, strategy="ddp", mesh=(1,))


def test_shard_single_process_is_identity_and_checkpointing_keeps_keys():
    plain = W.tiny_llama()
    keys = list(plain.state_dict())
    assert shard(plain) is plain and shard(plain, strategy="ddp") is plain
    checkpointed = shard(W.tiny_llama(), activation_checkpointing=True)
    assert type(checkpointed.model.layers[0]).__name__ == "CheckpointWrapper"
    assert list(checkpointed.state_dict()) == keys
    for model in (plain, checkpointed):
        W.train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), W.global_batch(), "token-mean")
    g_plain, g_ckpt = W.grads_of(plain), W.grads_of(checkpointed)
    assert set(g_plain) == set(g_ckpt)
    assert max((g_plain[k] - g_ckpt[k]).abs().max().item() for k in g_plain) <= 1e-6


_reference_cache: dict = {}


def _reference(mode: str) -> dict:
    """One process, the whole global batch in one forward, SGD step."""
    if mode not in _reference_cache:
        model = W.tiny_llama()
        loss = W.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), W.global_batch(), mode, micro=None)
        _reference_cache[mode] = {"grads": W.grads_of(model), "params": W.params_of(model), "loss": loss}
    return _reference_cache[mode]


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


VARIANTS = [
    ("ddp", "token-mean"), ("ddp", "seq-mean-token-mean"),
    ("fsdp", "token-mean"), ("fsdp", "seq-mean-token-mean"),
    ("fsdp-grad_op", "token-mean"), ("fsdp-hybrid-1x2", "seq-mean-token-mean"),
    ("fsdp-hybrid-2x1", "token-mean"), ("fsdp-ac", "token-mean"), ("ddp-ac", "seq-mean-token-mean"),
]


@pytest.mark.parametrize("variant,mode", VARIANTS)
def test_two_processes_match_one(two_process_results, variant, mode):
    """Uneven tokens per rank (23 vs 4, one empty row), 2 micro-batches per rank: the
    gradients, the SGD-updated parameters and the loss equal the 1-process ones."""
    got, ref = two_process_results["grads"][(variant, mode)], _reference(mode)
    assert _max_diff(got["grads"], ref["grads"]) <= 1e-6
    assert _max_diff(got["params"], ref["params"]) <= 1e-6
    assert abs(got["loss"].item() - ref["loss"].item()) <= 1e-6


def test_two_processes_without_global_counts_would_differ():
    """Control: per-rank token means (no global counts) give a different gradient, so the
    equality above is not trivially satisfied by this batch."""
    model = W.tiny_llama()
    batch = W.global_batch()
    for r in range(2):  # the average of two per-rank token-mean losses
        (W.pg_loss(model, W.local_shard(batch, r, 2), Aggregation("token-mean")) / 2).backward()
    assert _max_diff(W.grads_of(model), _reference("token-mean")["grads"]) > 1e-3


def test_two_processes_bf16_mixed_precision(two_process_results):
    got, ref = two_process_results["grads"][("fsdp-bf16", "token-mean")], _reference("token-mean")
    assert got["param_dtype"] == "torch.float32"  # sharded master weights stay float32
    diff = _max_diff(got["grads"], ref["grads"])
    assert 0 < diff <= 1e-2  # bf16 compute: close, but not bit-equal to float32


def _trainer_history(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy, algorithm, extra", [
    ("fsdp", "grpo", []),
    ("ddp", "grpo", ["mask_truncated_completions=true"]),  # the processes count different tokens
    ("fsdp", "ppo", []),
])
def test_trainer_on_two_processes_matches_one(tmp_path, strategy, algorithm, extra):
    # Sampling is seeded per sample, so 2 processes draw the same completions as 1; with
    # exact aggregation the losses, KL and gradient norms are then those of one process.
    from torchforge.trainer.cli import main

    settings = ["max_steps=3", "prompts_per_step=4", "num_generations=4", "kl_coef=0.05", "progress_bar=false",
                f"distributed_strategy={strategy}", "loss_aggregation=seq-mean-token-mean", f"algorithm={algorithm}",
                *extra]
    assert main(["train", *settings, f"output_dir={tmp_path / 'one'}"]) == 0
    assert main(["train", "--nproc", "2", *settings, f"output_dir={tmp_path / 'two'}"]) == 0
    one, two = _trainer_history(tmp_path / "one"), _trainer_history(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for key in ("loss", "reward", "reward_std", "rewards/copy_digits/std", "kl", "entropy", "grad_norm",
                    "completions/mean_length", "frac_reward_zero_std", "clip_frac_low", "ratio_max"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    if algorithm == "grpo" and strategy == "fsdp":
        # the 2-process checkpoint resumes on 1 process
        with pytest.warns(UserWarning, match="checkpoint saved by 2 processes, resumed with 1"):
            assert main(["train", "--resume", *settings, "max_steps=4", f"output_dir={tmp_path / 'two'}"]) == 0
        assert [r["step"] for r in _trainer_history(tmp_path / "two")] == [1, 2, 3, 4]
