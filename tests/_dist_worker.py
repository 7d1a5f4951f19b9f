"""Helpers shared by tests/distributed/test_parallelize.py and tests/distributed/test_checkpoint.py, and the worker
that those tests launch N times with torchrun's environment (RANK, WORLD_SIZE, ...).

Run as ``python tests/_dist_worker.py OUT_DIR SCENARIO [SCENARIO ...]``; rank 0 writes the
results of each scenario to ``OUT_DIR/<scenario>.pt``.
"""

from __future__ import annotations

import math
import os
import random
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import torch

WORKER = Path(__file__).resolve()
GLOBAL_B, SEQ_LEN, MICRO = 8, 7, 2
# Response lengths per sequence: the first half (rank 0 of 2) holds 23 counted tokens, the
# second half (rank 1) 4, one row of which is empty — deliberately uneven across ranks.
LENGTHS = [6, 6, 5, 6, 1, 0, 2, 1]
MODES = ("token-mean", "seq-mean-token-mean")


def tiny_llama(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def global_batch() -> dict[str, torch.Tensor]:
    """A fixed global batch: input ids [B, L], response mask [B, L-1], advantages [B]."""
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(1, 64, (GLOBAL_B, SEQ_LEN), generator=g)
    positions = torch.arange(SEQ_LEN - 1)
    mask = positions[None, :] < torch.tensor(LENGTHS)[:, None]
    advantages = torch.randn(GLOBAL_B, generator=g)
    return {"input_ids": input_ids, "mask": mask, "advantages": advantages}


def _log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def pg_loss(model, batch: dict[str, torch.Tensor], agg) -> torch.Tensor:
    """``-(A * log_probs)`` aggregated by ``agg`` over the response mask."""
    input_ids = batch["input_ids"]
    logits = model(input_ids=input_ids).logits[:, :-1]
    log_probs = _log_probs(logits, input_ids[:, 1:])
    per_token = -(batch["advantages"][:, None] * log_probs)
    return agg(per_token, batch["mask"])


def local_shard(batch: dict, rank: int, world: int) -> dict:
    per = GLOBAL_B // world
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


def micro_batches(batch: dict, size: int) -> list[dict]:
    n = batch["input_ids"].shape[0]
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, n, size)]


def train_step(model, optimizer, batch: dict, mode: str, *, micro: int | None = MICRO) -> torch.Tensor:
    """One optimizer step with gradient accumulation and exact global counts; returns the loss."""
    from torchforge.distributed import global_counts, reduce_metric_sums, world_size
    from torchforge.reduce import Aggregation

    mbs = micro_batches(batch, micro) if micro else [batch]
    num_tokens, num_sequences = global_counts([mb["mask"] for mb in mbs])
    agg = Aggregation(mode, num_tokens=num_tokens, num_sequences=num_sequences, dp_size=world_size())
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for mb in mbs:
        loss = pg_loss(model, mb, agg)
        loss.backward()
        total += loss.detach()
    optimizer.step()
    # per-rank losses are dp_size * (partial sum / global count): their mean is the batch loss
    return (reduce_metric_sums({"loss": total})["loss"] / world_size()).float()


def full_tensors(named) -> dict[str, torch.Tensor]:
    """Name -> full (gathered) detached CPU tensor; a collective for sharded DTensors."""
    from torch.distributed.tensor import DTensor

    from torchforge.distributed.weight_sync import _clean_name

    out = {}
    for name, t in named:
        if t is None:
            continue
        t = t.full_tensor() if isinstance(t, DTensor) else t
        out[_clean_name(name)] = t.detach().cpu().clone()
    return out


def grads_of(model) -> dict[str, torch.Tensor]:
    from torchforge.distributed import unwrap_model

    return full_tensors((n, p.grad) for n, p in unwrap_model(model).named_parameters())


def params_of(model) -> dict[str, torch.Tensor]:
    from torchforge.distributed import unwrap_model

    return full_tensors(unwrap_model(model).named_parameters())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Path, args: list[str], nproc: int, timeout: float = 240) -> None:
    """Start ``nproc`` processes of ``worker`` with torchrun's environment (gloo on this
    machine); raise with their output when one fails or time runs out."""
    port = free_port()
    procs = []
    for r in range(nproc):
        env = dict(
            os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(subprocess.Popen(
            [sys.executable, str(worker), *args], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs, failed = [], False
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
            failed |= p.returncode != 0
    except subprocess.TimeoutExpired:
        failed = True
        outputs.append("timed out")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed:
        raise RuntimeError(f"{Path(worker).name} workers failed:\n" + "\n----\n".join(o[-4000:] for o in outputs))


def launch(nproc: int, out_dir: Path, scenarios: list[str], timeout: float = 240) -> None:
    """Start ``nproc`` workers of this file running ``scenarios``."""
    spawn(WORKER, [str(out_dir), *scenarios], nproc, timeout)


# --- scenarios (run under the process group) ----------------------------------------------

def _sharded(strategy: str, **kwargs):
    from torchforge.distributed import shard

    model = tiny_llama()
    return shard(model, strategy=strategy, **kwargs)


def scenario_grads(out: Path) -> None:
    """DDP / FSDP2 gradients and SGD-updated parameters on the global batch, per mode."""
    from torchforge.distributed import rank, world_size

    batch = local_shard(global_batch(), rank(), world_size())
    results = {}
    variants = [("ddp", {}, m) for m in MODES] + [("fsdp", {}, m) for m in MODES] + [
        ("fsdp-grad_op", {"sharding_strategy": "grad_op"}, "token-mean"),
        ("fsdp-hybrid-1x2", {"sharding_strategy": "hybrid", "mesh": (1, 2)}, "seq-mean-token-mean"),
        ("fsdp-hybrid-2x1", {"sharding_strategy": "hybrid", "mesh": (2, 1)}, "token-mean"),
        ("fsdp-ac", {"activation_checkpointing": True}, "token-mean"),
        ("ddp-ac", {"activation_checkpointing": True}, "seq-mean-token-mean"),
    ]
    for name, kwargs, mode in variants:
        strategy = name.split("-")[0]
        model = _sharded(strategy, **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = train_step(model, optimizer, batch, mode)
        # grads are still there after step(); gather them, then the updated parameters
        results[(name, mode)] = {"grads": grads_of(model), "params": params_of(model), "loss": loss}
    # bf16 mixed precision: runs, finite, close to fp32
    model = _sharded("fsdp", mixed_precision="bf16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = train_step(model, optimizer, batch, "token-mean")
    results[("fsdp-bf16", "token-mean")] = {
        "grads": grads_of(model), "loss": loss,
        "param_dtype": str(next(iter(model.parameters())).dtype),
    }
    if rank() == 0:
        torch.save(results, out / "grads.pt")


def scenario_generate(out: Path) -> None:
    """Greedy generation under FSDP2 with uneven lengths: rank 0 stops after 1 token."""
    from torchforge.distributed import generation_kwargs, rank, shard, world_size

    model = shard(tiny_llama())
    prompt = global_batch()["input_ids"][:2, :4]
    with torch.no_grad():
        first = model(input_ids=prompt).logits[0, -1].argmax().item()  # collective forward
        eos = int(first)
        if rank() == 0:  # stops at once: its first greedy token is eos
            gen = model.generate(prompt[:1], max_new_tokens=8, do_sample=False, eos_token_id=eos,
                                 pad_token_id=0, **generation_kwargs())
        else:  # must produce all 8 tokens
            gen = model.generate(prompt[:1], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 eos_token_id=eos, pad_token_id=0, **generation_kwargs())
    lengths = [torch.zeros(1, dtype=torch.long) for _ in range(world_size())]
    torch.distributed.all_gather(lengths, torch.tensor([gen.shape[1]]))
    gathered = [None] * world_size()
    torch.distributed.all_gather_object(gathered, gen.tolist())
    if rank() == 0:
        torch.save({"lengths": [int(x) for x in lengths], "eos": eos, "generated": gathered},
                   out / "generate.pt")


def _draws() -> torch.Tensor:
    """Three draws of torch, one of ``random`` and one of numpy: every RNG a checkpoint restores."""
    import numpy as np

    return torch.cat([torch.rand(3).double(), torch.tensor([random.random(), np.random.rand()], dtype=torch.float64)])


def scenario_checkpoint(out: Path) -> None:
    """FSDP2 + AdamW: step 1, save, step 2; then fresh objects load and redo step 2; export."""
    import numpy as np

    from torchforge.distributed import rank, shard, sync_weights, world_size
    from torchforge.distributed.checkpoint import export_pretrained, load_checkpoint, save_checkpoint

    batch = local_shard(global_batch(), rank(), world_size())

    def fresh(seed):
        model = shard(tiny_llama(seed=seed))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return model, optimizer, scheduler

    model, optimizer, scheduler = fresh(0)  # seed 0: the 1-process reference's weights
    torch.manual_seed(100 + rank())  # distinct RNG streams per rank
    random.seed(100 + rank())
    np.random.seed(100 + rank())
    loss1 = train_step(model, optimizer, batch, "token-mean")
    scheduler.step()
    ckpt = out / "ckpt"
    save_checkpoint(ckpt, model=model, optimizer=optimizer, scheduler=scheduler,
                    extra={"step": 1, "rank": rank()})
    rand_after_save = _draws()
    params1 = params_of(model)
    exp_avg1 = full_tensors((n, optimizer.state[p]["exp_avg"]) for n, p in model.named_parameters())
    loss2 = train_step(model, optimizer, batch, "token-mean")
    params2 = params_of(model)

    # export + weight sync of the trained (sharded) model
    export_pretrained(model, None, out / "hf")
    probe = global_batch()["input_ids"][:2]
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    copy = tiny_llama(seed=3)
    sync_weights(model, copy)
    synced = {n: p.detach().clone() for n, p in copy.named_parameters()}

    # resume with the same number of processes, into fresh objects
    model_b, optimizer_b, scheduler_b = fresh(7)  # loading must overwrite this init
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    extra = load_checkpoint(ckpt, model=model_b, optimizer=optimizer_b, scheduler=scheduler_b)
    rand_after_load = _draws()
    resumed_params1 = params_of(model_b)
    resumed_lr = optimizer_b.param_groups[0]["lr"]
    resumed_loss2 = train_step(model_b, optimizer_b, batch, "token-mean")
    resumed_params2 = params_of(model_b)

    rands = [None] * world_size()
    torch.distributed.all_gather_object(rands, (rand_after_save, rand_after_load, extra))
    if rank() == 0:
        torch.save({
            "loss1": loss1, "loss2": loss2, "params1": params1, "params2": params2,
            "exp_avg1": exp_avg1, "logits": logits, "probe": probe, "synced": synced,
            "resumed_params1": resumed_params1, "resumed_params2": resumed_params2,
            "resumed_loss2": resumed_loss2, "resumed_lr": resumed_lr, "lr1": scheduler.get_last_lr()[0],
            "rands": rands,
        }, out / "checkpoint.pt")


def scenario_resume(out: Path) -> None:
    """Load the 2-process checkpoint with this world size (DDP here), step 2, save params."""
    from torchforge.distributed.checkpoint import load_checkpoint
    from torchforge.distributed import rank, shard, world_size

    batch = local_shard(global_batch(), rank(), world_size())
    model = shard(tiny_llama(seed=7), strategy="ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    load_checkpoint(out / "ckpt", model=model, optimizer=optimizer, scheduler=scheduler)
    loss2 = train_step(model, optimizer, batch, "token-mean")
    params2 = params_of(model)
    if rank() == 0:
        torch.save({"loss2": loss2, "params2": params2}, out / "resume.pt")


def scenario_load_single(out: Path) -> None:
    """Load a checkpoint written by ONE process (``out/ckpt1``) into 2-process FSDP2."""
    from torchforge.distributed.checkpoint import load_checkpoint
    from torchforge.distributed import rank, shard, world_size

    model = shard(tiny_llama(seed=7))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = load_checkpoint(out / "ckpt1", model=model, optimizer=optimizer)
    params = params_of(model)
    exp_avg = full_tensors((n, optimizer.state[p]["exp_avg"]) for n, p in model.named_parameters())
    gathered = [None] * world_size()
    torch.distributed.all_gather_object(
        gathered, (extra, torch.rand(3), [str(w.message) for w in caught]))
    if rank() == 0:
        torch.save({"params": params, "exp_avg": exp_avg, "per_rank": gathered}, out / "load_single.pt")


def scenario_counts(out: Path) -> None:
    """global_counts and reduce_metric_sums over ranks (each rank writes its own file)."""
    from torchforge.distributed import global_counts, rank, reduce_metric_sums, world_size

    mask = local_shard(global_batch(), rank(), world_size())["mask"]
    counts = global_counts([mask[:1], mask[1:]])
    sums = reduce_metric_sums({"tokens": mask.sum(), "rank": torch.tensor(float(rank()))})
    torch.save({"counts": counts, "sums": sums, "env_world": os.environ["WORLD_SIZE"]},
               out / f"counts_rank{rank()}.pt")


def global_values() -> torch.Tensor:
    """[B, T-1] float32 values offset by 1e4 (rewards-like), exactly representable."""
    g = torch.Generator().manual_seed(99)
    return 1e4 + torch.randint(-16, 17, (GLOBAL_B, SEQ_LEN - 1), generator=g).float() / 4


def step_metric_parts() -> list[tuple[dict, float]]:
    """Micro-batch metrics and their counted tokens, as a loss returns them: rank r takes parts r, r + n, ...
    (the third part counts no token: its extremes never win)."""
    from torchforge.loop.metrics import Metric

    values = [(0.5, 1.5, 0.9, 0.25, 3.0), (0.1, 1.2, 0.7, -0.5, 4.0), (0.9, 99.0, -99.0, 1.0, 99.0),
              (0.3, 1.1, 0.8, 0.125, 1.0)]
    tokens = [3.0, 1.0, 0.0, 4.0]
    return [({"clip_frac": torch.tensor(c), "ratio_max": torch.tensor(hi), "ratio_min": torch.tensor(lo),
              "pg_loss": torch.tensor(pg), "top_margin": Metric(torch.tensor(m), "max")}, t)
            for (c, hi, lo, pg, m), t in zip(values, tokens)]


def step_metrics_of(parts: list[tuple[dict, float]]):
    """A StepMetrics holding ``parts``, each weighted by its tokens."""
    from torchforge.loop.metrics import StepMetrics

    metrics = StepMetrics()
    for values, tokens in parts:
        metrics.update(values, weight=tokens)
    return metrics


def scenario_statistics(out: Path) -> None:
    """Masked statistics with sum_over_ranks, extrema and gathers over ranks (one file per rank)."""
    from torchforge.distributed import (
        gather_over_ranks,
        rank,
        reduce_metric_extrema,
        sum_over_ranks,
        whiten_over_ranks,
        world_size,
    )
    from torchforge.reduce import masked_mean, masked_var, masked_whiten

    r, n = rank(), world_size()
    mask = local_shard(global_batch(), r, n)["mask"]
    values = local_shard({"v": global_values()}, r, n)["v"].requires_grad_()
    whitened = masked_whiten(values, mask, sum_over_ranks=sum_over_ranks)
    (grad,) = torch.autograd.grad((whitened * torch.arange(whitened.numel()).view_as(whitened)).sum(), values)
    results = {
        "mean": masked_mean(values, mask, sum_over_ranks=sum_over_ranks).detach(),
        "var": masked_var(values, mask, sum_over_ranks=sum_over_ranks).detach(),
        "var_biased": masked_var(values, mask, unbiased=False, sum_over_ranks=sum_over_ranks).detach(),
        "whiten": whitened.detach(),
        "whiten_over_ranks": whiten_over_ranks(values.detach(), mask),
        "grad": grad,
        "extrema": reduce_metric_extrema({"rank_max": float(r), "empty_max": -math.inf},
                                         {"rank_min": torch.tensor(float(r)), "only_1": math.inf if r == 0 else 7.0}),
        "gathered": gather_over_ranks(torch.arange(3.0 - 2 * r) + 10 * r),
        "step_metrics": step_metrics_of(step_metric_parts()[r::n]).reduce(),
    }
    torch.save(results, out / f"statistics_rank{r}.pt")


SCENARIOS = {
    "counts": scenario_counts,
    "statistics": scenario_statistics,
    "load_single": scenario_load_single,
    "grads": scenario_grads,
    "generate": scenario_generate,
    "checkpoint": scenario_checkpoint,
    "resume": scenario_resume,
}


def main() -> None:
    from torchforge.distributed import init_distributed, teardown_distributed

    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    assert init_distributed()
    try:
        for name in sys.argv[2:]:
            SCENARIOS[name](out)
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
    from torchforge.distributed import end_process

    end_process(0)  # every result is written: skip the shutdown where gloo can abort
