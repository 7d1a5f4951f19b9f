"""Step time and memory per rank: 1 process vs 2 processes (FSDP2 and DDP), a tiny Llama.

One optimizer step = a fixed global batch, 2 micro-batches per rank, policy-gradient loss
aggregated with global counts (torchforge.distributed.global_counts + Aggregation), AdamW.
With N processes each rank holds 1/N of the global batch. Variants run in rounds
(1p, fsdp-2p, ddp-2p, 1p, ...) and the table reports medians over all measured steps.

Memory per rank: parameter, gradient and AdamW-state bytes held by the rank (local shards
under FSDP2: about 1/N of the full model), and on CPU the peak resident set growth of the
process (ru_maxrss after the steps minus RSS before building the model); on CUDA
torch.cuda.max_memory_allocated.

    python benchmarks/bench_distributed.py            # full
    python benchmarks/bench_distributed.py --quick    # a smoke run (seconds)

Writes benchmarks/results/distributed.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
SIZES = {
    # the tests' tiny Llama
    "tiny": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # large enough that parameters dominate the fixed costs
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4),
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def worker(args) -> None:
    """One rank: build, shard, run steps, write a JSON line of timings and memory."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from torchforge.distributed import (global_counts, init_distributed, rank, shard,
                                        teardown_distributed, world_size)
    from torchforge.reduce import Aggregation

    torch.set_num_threads(args.threads)
    init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rss_before = _rss_mib()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES[args.size], max_position_embeddings=512)).to(device)
    full_param_bytes = _local_bytes(model.parameters())
    strategy = args.strategy if world_size() > 1 else "none"
    model = shard(model, strategy=strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    g = torch.Generator().manual_seed(0)
    vocab = SIZES[args.size]["vocab_size"]
    ids = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=g)
    lengths = torch.randint(1, args.seq_len + 1, (args.batch,), generator=g)
    mask = torch.arange(args.seq_len)[None, :] < lengths[:, None]
    adv = torch.randn(args.batch, generator=g)
    per = args.batch // world_size()
    sl = slice(rank() * per, (rank() + 1) * per)
    ids, mask, adv = ids[sl].to(device), mask[sl].to(device), adv[sl].to(device)
    half = per // 2

    def step():
        mbs = [(ids[:half], mask[:half], adv[:half]), (ids[half:], mask[half:], adv[half:])]
        n_tok, n_seq = global_counts([m for _, m, _ in mbs])
        agg = Aggregation("token-mean", num_tokens=n_tok, num_sequences=n_seq, dp_size=world_size())
        optimizer.zero_grad(set_to_none=True)
        for x, m, a in mbs:
            logits = model(input_ids=x).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
            agg(-(a[:, None] * lp), m).backward()
        optimizer.step()

    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        if world_size() > 1:
            torch.distributed.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    optim_state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss_before)
    result = {
        "rank": rank(), "world": world_size(), "times": times,
        "param_mib": _local_bytes(model.parameters()) / 2**20, "full_param_mib": full_param_bytes / 2**20,
        "grad_mib": _local_bytes(p.grad for p in model.parameters()) / 2**20,
        "optim_mib": _local_bytes(optim_state) / 2**20, "peak_mib": peak,
    }
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    teardown_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, strategy: str, size: str, args) -> list[dict]:
    out = Path(tempfile.mkstemp(suffix=".jsonl")[1])
    port = _free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(args.threads))
        cmd = [sys.executable, str(HERE), "--worker", "--out", str(out), "--strategy", strategy, "--size", size,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--seq-len", str(args.seq_len), "--threads", str(args.threads)]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"worker failed: {strategy} x{nproc} {size}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    out.unlink()
    return rows


def machine() -> str:
    try:
        name = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except (StopIteration, FileNotFoundError):
        name = platform.processor()
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return f"{name}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--results", default=str(HERE.parent / "results" / "distributed.md"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.steps, args.warmup, args.rounds = 3, 1, 1
    variants = [("1 process", 1, "none"), ("FSDP2, 2 processes", 2, "fsdp"), ("DDP, 2 processes", 2, "ddp")]
    sizes = ["tiny"] if args.quick else ["tiny", "small"]
    lines = [
        "## Distributed: 1 vs 2 processes (`benchmarks/bench_distributed.py`)", "",
        f"Machine: {machine()}. gloo backend, {args.threads} torch thread(s) per process. "
        f"One step = global batch {args.batch} x {args.seq_len} tokens, 2 micro-batches per rank, "
        f"token-mean PG loss with global counts, AdamW. {args.rounds} round(s) of "
        f"{args.steps} steps (after {args.warmup} warm-up), variants interleaved per round; medians.",
        "Memory columns are per rank: parameters / gradients / AdamW state held by the rank, "
        "and the peak RSS growth of the process (CPU) or max allocated (CUDA).", "",
    ]
    for size in sizes:
        times: dict[str, list[float]] = {v[0]: [] for v in variants}
        last: dict[str, list[dict]] = {}
        for _ in range(args.rounds):
            for name, nproc, strategy in variants:
                rows = launch(nproc, strategy, size, args)
                # a step lasts as long as its slowest rank
                times[name] += [max(ts) for ts in zip(*(r["times"] for r in rows))]
                last[name] = rows
        base = statistics.median(times["1 process"])
        full = last["1 process"][0]["full_param_mib"]
        lines += [f"### `{size}` model ({full:.3f} MiB of float32 parameters)", "",
                  "| variant | step time (ms, median) | vs 1 process | params / rank (MiB) | params vs full |"
                  " grads / rank (MiB) | AdamW state / rank (MiB) | peak mem / rank (MiB) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, _, _ in variants:
            med = statistics.median(times[name])
            rows = last[name]
            p = max(r["param_mib"] for r in rows)
            lines.append(
                f"| {name} | {med * 1e3:.1f} | {med / base:.2f}x | {p:.3f} | {p / full:.2f} | "
                f"{max(r['grad_mib'] for r in rows):.3f} | {max(r['optim_mib'] for r in rows):.3f} | "
                f"{max(r['peak_mib'] for r in rows):.1f} |")
        lines.append("")
    lines += [
        "Reading: under FSDP2 each rank holds ~1/2 of the parameters, gradients and optimizer "
        "state; DDP holds everything on every rank. On a shared 2-core CPU the step time of 2 "
        "processes mostly shows the communication and launch overheads of gloo, not a speed-up: "
        "the point of the CPU run is exactness (tests) and the memory split.", ""]
    text = "\n".join(lines)
    print(text)
    if not args.quick or not Path(args.results).exists():
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(text)


if __name__ == "__main__":
    main()
