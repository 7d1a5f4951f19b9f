"""Benchmark: memory of a GRPO step with a KL penalty, full fine-tuning against LoRA, same model.

Both variants train the same Llama (the demo's architecture, scaled up: ``--hidden``,
``--layers``) with ``RLTrainer`` on the demo task, GRPO with ``kl_coef=0.1`` (so a
reference policy is needed), fp32, AdamW:

- ``full``: every weight trains; the reference is a frozen deep copy of the model.
- ``LoRA``: ``RLConfig(lora={rank, alpha: 2 * rank, target_modules: all-linear})``; only the
  adapters train, and the reference is the same model with its adapters disabled.

Reported per variant: the weights held (policy + reference, unique storages), the
trainable parameters, the gradient bytes (one per trainable parameter) and the AdamW-state
bytes after a step, their sum (the training state), the peak extra memory allocated by torch during one step
(``torch.profiler`` memory events on the CPU, ``max_memory_allocated`` on CUDA; the same
meter as ``bench_loop.py``), the median step time, and the size on disk of the checkpoint
the trainer writes (``RLTrainer.save``); for LoRA also that of a whole-model checkpoint of
the same run (``save_checkpoint(..., trainable_only=False)``, what LoRA runs wrote before).

Usage: python benchmarks/bench_lora.py [--quick] [--hidden H] [--layers L] [--rank R] [--steps N]
Writes benchmarks/results/lora.md (not with --quick).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loop import DEVICE, PeakMemory, machine, sync

import torchforge
from torchforge import RLConfig, RLTrainer
from torchforge.distributed.checkpoint import save_checkpoint
from torchforge.trainer.demo import (
    CopyDigitsReward,
    char_tokenizer,
    copy_digits_dataset,
    tiny_llama,
)

HERE = Path(__file__).resolve().parent


def _mib(tensors) -> float:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total / 2**20


def _folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


def measure(variant: str, args, workdir: str) -> dict[str, float]:
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = tiny_llama(tokenizer, hidden_size=args.hidden, num_layers=args.layers, num_heads=8, seed=0)
    lora = {"rank": args.rank, "alpha": 2.0 * args.rank, "target_modules": "all-linear"} if variant == "LoRA" else None
    config = RLConfig(max_steps=args.warmup + args.steps + 1, num_generations=4, prompts_per_step=8,
                      max_completion_length=args.length, kl_coef=0.1, learning_rate=1e-4, mixed_precision=None,
                      gradient_checkpointing=False, progress_bar=False, output_dir=os.path.join(workdir, variant),
                      lora=lora, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RLTrainer(model=model, tokenizer=tokenizer, config=config, reward_functions=[CopyDigitsReward()],
                            train_dataset=copy_digits_dataset(256, seed=0))
        times = []
        for step in range(args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            trainer.train_step(step)
            sync()
            times.append(time.perf_counter() - start)
        meter = PeakMemory()
        meter.start()
        trainer.train_step(args.warmup + args.steps)
        peak = meter.stop()
        checkpoint = trainer.save(trainer.step)
        whole = Path(workdir) / f"{variant}-whole-model"
        save_checkpoint(whole, model=trainer.modules, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                        extra={"step": trainer.step})
    params = list(trainer.model.parameters())
    ref = list(trainer.ref_model.parameters()) if trainer.ref_model is not None else []
    states = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {
        "weights": _mib(params + ref),
        "trainable": sum(p.numel() for p in trainer.trainable_parameters) / 1e6,
        "total_params": sum(p.numel() for p in params) / 1e6,
        # the optimizer step frees the gradients (set_to_none): count what the backward allocates
        "grads": sum(p.numel() * p.element_size() for p in trainer.trainable_parameters) / 2**20,
        "adam": _mib(states),
        "peak": peak,
        "ms": 1e3 * statistics.median(times[args.warmup:]),
        "reference": "the policy, adapters disabled" if trainer.ref_model is trainer.model else "a deep copy",
    }
    out["checkpoint"], out["checkpoint_whole"] = _folder_mib(checkpoint), _folder_mib(whole)
    out["state"] = out["weights"] + out["grads"] + out["adam"]
    out["total"] = out["weights"] + out["adam"] + out["peak"]  # held before the step + what the step adds
    return out


def report(results: dict[str, dict], args) -> str:
    full = results["full"]
    lines = [
        "## LoRA: memory of a GRPO step with KL, full fine-tuning vs LoRA (`benchmarks/bench_lora.py`)",
        "",
        f"Machine: {machine()}, device {DEVICE.type}, {os.cpu_count()} cores, "
        f"torch.get_num_threads()={torch.get_num_threads()}; torch {torch.__version__}, "
        f"torchforge {torchforge.__version__}.",
        "",
        f"Llama with H={args.hidden}, {args.layers} layers ({full['total_params']:.1f} M parameters), the demo task, "
        f"GRPO with kl_coef=0.1, 8 prompts x 4 samples, completions of up to {args.length} tokens, fp32, AdamW; "
        f"LoRA rank {args.rank} (alpha {2 * args.rank}) on every linear layer but the head. State: weights held "
        "(policy and reference, unique storages) + gradients (one per trainable parameter) + AdamW states. Peak: extra memory "
        "allocated by torch during one step (" + ("`max_memory_allocated`" if DEVICE.type == "cuda" else
                                                   "torch.profiler memory events: torch's CPU allocator") + "): "
        "gradients and activations; LoRA's are a little larger (each adapted layer keeps its adapter's "
        "inputs for backward). Peak total: weights + AdamW states + peak step. "
        f"Median of {args.steps} steps after {args.warmup} warm-up steps.",
        "",
        "| variant | reference policy | trainable M params | weights MiB | grads MiB | AdamW MiB | state MiB "
        "| x full | peak step MiB | peak total MiB | x full | ms / step |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['reference']} | {r['trainable']:.3f} | {r['weights']:.1f} | {r['grads']:.1f} "
                     f"| {r['adam']:.1f} | {r['state']:.1f} | {r['state'] / full['state']:.2f} | {r['peak']:.1f} "
                     f"| {r['total']:.1f} | {r['total'] / full['total']:.2f} | {r['ms']:.0f} |")
    lora = results["LoRA"]
    lines += [
        "",
        "### Checkpoint size on disk (one `RLTrainer.save`: DCP model + optimizer, per-rank step / scheduler / RNG file)",
        "",
        ("A LoRA run's checkpoint holds only what trains (the adapters) and their AdamW state; the frozen base "
         "weights come from the model the run starts with (`save_checkpoint(..., trainable_only=True)`). "
         "Before: the whole model with the adapters' AdamW state."),
        "",
        "| variant | checkpoint holds | MiB | x full |",
        "| --- | --- | ---: | ---: |",
        f"| full | every weight + AdamW | {full['checkpoint']:.1f} | 1.00 |",
        (f"| LoRA, before | base + adapters, adapters' AdamW | {lora['checkpoint_whole']:.1f} "
         f"| {lora['checkpoint_whole'] / full['checkpoint']:.3f} |"),
        (f"| LoRA, now | adapters + their AdamW | {lora['checkpoint']:.2f} "
         f"| {lora['checkpoint'] / full['checkpoint']:.3f} |"),
    ]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, few steps, nothing written")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(HERE / "results" / "lora.md"))
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.steps, args.length = 128, 2, 2, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        results = {variant: measure(variant, args, workdir) for variant in ("full", "LoRA")}
    text = report(results, args)
    print(text)
    if not args.quick:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
