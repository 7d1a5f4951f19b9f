"""Tests of torchforge.distributed: single-process behaviour, and 2-process DDP / FSDP2 runs on
CPU with gloo (the multi-process results come from one spawn of tests/_dist_worker.py)."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import _dist_worker as W
from tests.reference import global_counts_ref
from torchforge.distributed import (
    DistributedConfig,
    generation_kwargs,
    global_counts,
    init_distributed,
    is_main_process,
    launch,
    rank,
    reduce_metric_sums,
    shard,
    sync_weights,
    teardown_distributed,
    unwrap_model,
    world_size,
)
from torchforge.errors import DTypeError, InvalidArgumentError, ShapeError, TorchforgeError
from torchforge.reduce import Aggregation



# --- single process ----------------------------------------------------------------------

def test_single_process_defaults(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed() is False
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed() is False
    assert (world_size(), rank(), is_main_process()) == (1, 0, True)
    assert generation_kwargs() == {}
    teardown_distributed()  # no-op without a group


def test_init_distributed_needs_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(TorchforgeError, match=r"init_distributed: WORLD_SIZE=2 but MASTER_ADDR is not set"):
        init_distributed()


def test_launch_errors(monkeypatch):
    with pytest.raises(InvalidArgumentError, match=r"launch: nproc must be an int >= 1, got 0"):
        launch(0, ["train"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TorchforgeError, match=r"launch: already inside a distributed run \(WORLD_SIZE=2\)"):
        launch(2, ["train"])


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


def test_sync_weights_single_process():
    src, dst = W.tiny_llama(seed=0), W.tiny_llama(seed=1).to(torch.bfloat16)
    sync_weights(shard(src, activation_checkpointing=True), dst)  # wrapper names are mapped
    for (name, a), b in zip(unwrap_model(src).named_parameters(), dst.parameters()):
        assert b.dtype == torch.bfloat16
        assert torch.equal(a.detach().to(torch.bfloat16), b), name
    with pytest.raises(InvalidArgumentError, match=r"sync_weights: src_model and dst_model have different tensors"):
        sync_weights(src, torch.nn.Linear(2, 2))


# --- two processes (gloo) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One torchrun launch (torchforge.distributed.launch) of 2 workers running all scenarios."""
    out = tmp_path_factory.mktemp("dist")
    rc = launch(2, [str(W.WORKER), str(out), "counts", "statistics", "grads", "generate"], module=None)
    assert rc == 0, "distributed workers failed (their output is above)"
    results = {name: torch.load(out / f"{name}.pt", weights_only=False) for name in ("grads", "generate")}
    results["counts"] = [torch.load(out / f"counts_rank{r}.pt", weights_only=False) for r in range(2)]
    results["statistics"] = [torch.load(out / f"statistics_rank{r}.pt", weights_only=True) for r in range(2)]
    return results


def test_counts_and_metric_sums_over_ranks(spawned):
    # rank 0 holds lengths [6, 6, 5, 6], rank 1 [1, 0, 2, 1]: 27 tokens, 7 non-empty rows
    for r, got in enumerate(spawned["counts"]):
        assert got["env_world"] == "2"
        assert [c.item() for c in got["counts"]] == [27, 7]
        assert got["sums"]["tokens"].item() == 27.0 and got["sums"]["rank"].item() == 1.0


def test_statistics_over_ranks_equal_one_process_on_the_whole_batch(spawned):
    # Each rank holds half of the rows (uneven token counts: 23 and 4) of values near 1e4;
    # masked_* with sum_over_ranks on each rank == one process on the concatenated batch.
    from torchforge.reduce import masked_mean, masked_var, masked_whiten

    values, mask = W.global_values(), W.global_batch()["mask"]
    whitened = masked_whiten(values, mask)
    weights = torch.arange(24.0).view(4, 6)
    for r, got in enumerate(spawned["statistics"]):
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
def test_two_processes_match_one(spawned, variant, mode):
    """Uneven tokens per rank (23 vs 4, one empty row), 2 micro-batches per rank: the
    gradients, the SGD-updated parameters and the loss equal the 1-process ones."""
    got, ref = spawned["grads"][(variant, mode)], _reference(mode)
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


def test_two_processes_bf16_mixed_precision(spawned):
    got, ref = spawned["grads"][("fsdp-bf16", "token-mean")], _reference("token-mean")
    assert got["param_dtype"] == "torch.float32"  # sharded master weights stay float32
    diff = _max_diff(got["grads"], ref["grads"])
    assert 0 < diff <= 1e-2  # bf16 compute: close, but not bit-equal to float32


def test_generation_with_uneven_lengths_does_not_deadlock(spawned):
    """Rank 0 stops after 1 token (its first greedy token is eos), rank 1 runs 8: with
    synced_gpus both return (FSDP forwards are collectives) and agree with one process."""
    result = spawned["generate"]
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


# --- RLTrainer on 2 processes (launched by the torchforge command) -------------------------

def _trainer_history(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy, algorithm", [("fsdp", "grpo"), ("ddp", "grpo"), ("fsdp", "ppo")])
def test_trainer_on_two_processes_matches_one(tmp_path, strategy, algorithm):
    # Sampling is seeded per sample, so 2 processes draw the same completions as 1; with
    # exact aggregation the losses, KL and gradient norms are then those of one process.
    from torchforge.trainer.cli import main

    settings = ["max_steps=3", "prompts_per_step=4", "num_generations=4", "kl_coef=0.05", "progress_bar=false",
                f"distributed_strategy={strategy}", "loss_aggregation=seq-mean-token-mean", f"algorithm={algorithm}"]
    assert main(["train", *settings, f"output_dir={tmp_path / 'one'}"]) == 0
    assert main(["train", "--nproc", "2", *settings, f"output_dir={tmp_path / 'two'}"]) == 0
    one, two = _trainer_history(tmp_path / "one"), _trainer_history(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for key in ("loss", "reward", "kl", "entropy", "grad_norm", "completions/mean_length"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    if algorithm == "grpo" and strategy == "fsdp":
        # the 2-process checkpoint resumes on 1 process
        with pytest.warns(UserWarning, match="checkpoint saved by 2 processes, resumed with 1"):
            assert main(["train", "--resume", *settings, "max_steps=4", f"output_dir={tmp_path / 'two'}"]) == 0
        assert [r["step"] for r in _trainer_history(tmp_path / "two")] == [1, 2, 3, 4]


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
    from torchforge.distributed import gather_over_ranks, reduce_metric_extrema, sum_over_ranks

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
