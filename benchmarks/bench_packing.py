"""Benchmark: a GRPO training step, padded against padding-free (packed), side by side.

One process, one model (a ~100M-parameter Llama built from a config: H=768, 12 layers, 12
heads, MLP 2048, a tied 32000-token vocabulary; float32, no gradient checkpointing), one
batch per setting, the two variants interleaved step by step:

- ``padded``: ``policy_log_probs(model, batch)``: left-padded prompts, right-padded
  completions, every row at the width of the longest (what ``RLConfig()`` runs);
- ``packed``: ``policy_log_probs(model, batch, packed=True)``: each row's real tokens packed
  end to end with per-sequence position ids (``RLConfig(padding_free=True)``).

A step is the log-probs forward, ``grpo_loss`` (token-mean, on-policy) and its backward,
what ``RLTrainer`` runs per micro-batch (here: the whole batch as one). Batches: 16
completions (4 prompts x 4 samples), prompts of 16-48 real tokens, completion limit
``--limit`` tokens. Completion lengths are drawn as in a GRPO run, mostly short with a tail
to the limit: ``min(limit, ceil(Exponential(mean)))``, one completion of each batch at the
limit (a truncated sample, which sets the padded width). The curve over spreads varies
``mean / limit``: ``uniform`` (every completion at the limit: packing has nothing to
remove and should cost nothing), 1/2, 1/4 (the headline: a realistic spread), 1/8.

Reported per setting and variant: the median ms per step over ``--repeats`` timed steps
(after one warm-up step each), tokens per second (real prompt + completion tokens), the
peak extra memory of one step (``max_memory_allocated`` on CUDA; torch.profiler memory
events on the CPU, torch's allocator), and the packed/padded ratios; plus the largest
difference between the two variants' log-probs on the counted tokens (they must agree).

Usage: python benchmarks/bench_packing.py [--quick] [--repeats N] [--limit T] [--threads N]
Writes benchmarks/results/packing.md (not with --quick).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loop import DEVICE, PeakMemory, machine, sync

import transformers

import torchforge
from torchforge import Batch, grpo_loss, policy_log_probs

HERE = Path(__file__).resolve().parent
PROMPTS, G = 4, 4
SPREADS = (("uniform", None), ("1/2", 0.5), ("1/4", 0.25), ("1/8", 0.125))
HEADLINE = "1/4"


def build_model(quick: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=1024) if quick else \
        dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, vocab_size=32000)
    config = LlamaConfig(**size, max_position_embeddings=2048, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(DEVICE).float()


def make_batch(spread: float | None, limit: int, vocab: int, seed: int = 0) -> Batch:
    """4 prompts x 4 completions; completion lengths ~ min(limit, ceil(Exp(spread * limit))),
    the first at the limit; prompts of 16-48 real tokens, left-padded."""
    g = torch.Generator().manual_seed(seed)
    B = PROMPTS * G
    if spread is None:
        lengths = torch.full((B,), limit)
    else:
        draws = torch.empty(B).exponential_(1.0 / (spread * limit), generator=g).ceil().long()
        lengths = draws.clamp(1, limit)
        lengths[0] = limit
    prompt_lengths = torch.randint(16, 49, (PROMPTS,), generator=g).repeat_interleave(G)
    P = int(prompt_lengths.max())
    prompt_mask = torch.arange(P)[None, :] >= P - prompt_lengths[:, None]
    prompt = torch.randint(3, vocab, (B, P), generator=g).masked_fill(~prompt_mask, 0)
    mask = torch.arange(limit)[None, :] < lengths[:, None]
    tokens = torch.randint(3, vocab, (B, limit), generator=g).masked_fill(~mask, 0)
    batch = Batch(prompt_tokens=prompt, prompt_mask=prompt_mask, tokens=tokens, mask=mask, batch_size=[B])
    batch.advantages = torch.randn(B, generator=g)
    return batch.to(DEVICE)


def step(model, batch: Batch, packed: bool) -> torch.Tensor:
    """The log-probs forward, the GRPO loss, the backward; returns the log-probs (detached)."""
    log_probs, _ = policy_log_probs(model, batch, packed=packed)
    loss, _ = grpo_loss(log_probs, log_probs.detach(), batch.advantages, batch.mask, aggregation="token-mean")
    loss.backward()
    model.zero_grad(set_to_none=True)
    return log_probs.detach()


def measure(model, batch: Batch, repeats: int) -> dict[str, dict[str, float]]:
    rows = {"padded": {"times": []}, "packed": {"times": []}}
    log_probs = {}
    for name in rows:  # warm-up, and the log-probs to compare
        log_probs[name] = step(model, batch, name == "packed")
    for _ in range(repeats):  # interleaved: load that drifts hits both variants alike
        for name, row in rows.items():
            sync()
            start = time.perf_counter()
            step(model, batch, name == "packed")
            sync()
            row["times"].append(time.perf_counter() - start)
    tokens = int(batch.prompt_mask.sum() + batch.mask.sum())
    for name, row in rows.items():
        meter = PeakMemory()
        meter.start()
        step(model, batch, name == "packed")
        row["peak_mib"] = meter.stop()
        row["ms"] = 1000 * statistics.median(row["times"])
        row["tokens_per_s"] = tokens / (row["ms"] / 1000)
    diff = (log_probs["packed"] - log_probs["padded"])[batch.mask].abs().max()
    padded_width = batch.prompt_tokens.shape[1] + batch.tokens.shape[1] - 1
    return {**rows, "info": {"tokens": tokens, "padded_tokens": batch.batch_size[0] * padded_width,
                             "mean_length": float(batch.mask.sum(-1).float().mean()),
                             "max_diff": float(diff)}}


def report(results, args, params: float) -> str:
    versions = (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                f"torchforge {torchforge.__version__}")
    lines = [
        "## Padding-free training: a GRPO step, padded vs packed (`benchmarks/bench_packing.py`)",
        "",
        f"Machine: {machine()}, device {DEVICE.type}, {os.cpu_count()} cores, "
        f"torch.get_num_threads()={torch.get_num_threads()}; {versions}.",
        "",
        f"Llama built from a config, {params / 1e6:.0f} M parameters (H=768, 12 layers, tied 32000-token "
        f"vocabulary), fp32, sdpa attention, no gradient checkpointing. One step = `policy_log_probs` forward, "
        f"`grpo_loss` (token-mean), backward, on {PROMPTS} prompts x {G} completions (prompts of 16-48 "
        f"tokens, completion limit {args.limit}); completion lengths `min(limit, ceil(Exp(spread x limit)))`, "
        "one at the limit. Median of "
        f"{args.repeats} interleaved steps after one warm-up; tokens/s counts real prompt + completion tokens. "
        "Peak: extra memory allocated by torch during one step ("
        + ("`max_memory_allocated`" if DEVICE.type == "cuda" else "torch.profiler memory events") + ").",
        "",
        "| spread (mean / limit) | real tokens | padded tokens | variant | ms / step | tokens / s | x padded "
        "| peak MiB | x padded | max abs log-prob diff |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for spread, r in results.items():
        info, pad = r["info"], r["padded"]
        for name in ("padded", "packed"):
            row = r[name]
            lines.append(
                f"| {spread} | {info['tokens']} | {info['padded_tokens']} | {name} | {row['ms']:.0f} | "
                f"{row['tokens_per_s']:.0f} | {row['tokens_per_s'] / pad['tokens_per_s']:.2f} | "
                f"{row['peak_mib']:.0f} | {row['peak_mib'] / pad['peak_mib']:.2f} | "
                + (f"{info['max_diff']:.1e} |" if name == "packed" else "— |"))
    head = results[HEADLINE]
    speed = head["packed"]["tokens_per_s"] / head["padded"]["tokens_per_s"]
    peak = head["packed"]["peak_mib"] / head["padded"]["peak_mib"]
    uniform = results["uniform"]["packed"]["ms"] / results["uniform"]["padded"]["ms"]
    lines += [
        "",
        f"- spread {HEADLINE}: packed throughput {speed:.2f}x the padded step's (target >= 1.5x): "
        + ("met" if speed >= 1.5 else "MISSED"),
        f"- spread {HEADLINE}: packed peak {peak:.2f}x the padded step's (target <= 0.7x): "
        + ("met" if peak <= 0.7 else "MISSED"),
        f"- uniform lengths: packed step time {uniform:.2f}x the padded one (nothing to remove; target ~1.0)",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 1 repeat; writes nothing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--spreads", default=",".join(name for name, _ in SPREADS))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.repeats, args.limit = 1, 32
    model = build_model(args.quick)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    results = {}
    for name, spread in SPREADS:
        if name not in args.spreads.split(","):
            continue
        results[name] = measure(model, make_batch(spread, args.limit, vocab), args.repeats)
        r = results[name]
        print(f"spread {name}: padded {r['padded']['ms']:.0f} ms, {r['padded']['peak_mib']:.0f} MiB; packed "
              f"{r['packed']['ms']:.0f} ms, {r['packed']['peak_mib']:.0f} MiB; tokens {r['info']['tokens']} of "
              f"{r['info']['padded_tokens']}; max diff {r['info']['max_diff']:.1e}", flush=True)
    if args.quick or HEADLINE not in results or "uniform" not in results:
        return
    text = report(results, args, params)
    print(text)
    (HERE / "results" / "packing.md").write_text(text)


if __name__ == "__main__":
    main()
