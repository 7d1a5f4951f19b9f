"""Benchmark: forward + backward of the PPO clipped loss on [B, T] = [256, 4096].

Variants, side by side in one process, interleaved (A B C ... A B C ...), medians:

- ``torchforge``: ``torchforge.losses.ppo_loss`` (token-mean, all its metrics);
- ``minimal``: the hand-written formula, loss only, float-mask multiplication;
- ``trl-style``: the per-token computation and reductions of TRL's GRPO loss
  (exp of the log-ratio, two coefficients, -min, masked sum / count; low / high / region
  clip fractions with float-mask means, read back with ``.item()``);
- ``verl-style``: verl's ``compute_policy_loss`` (log-ratio clamped at +-20, k1 ``ppo_kl``,
  dual-clip always on (c = 3) as in its default, [B, T] advantages, masked means with
  ``+ 1e-8``);
- ``torchrl-style``: TorchRL's ``ClipPPOLoss`` objective (clamp in log space, gains
  stacked and min-reduced, clip fraction, kl_approx, effective sample size via
  logsumexp, masked selection before the mean).

The three peer formulations are re-implementations written for this benchmark, following
those libraries' published per-token computations; they are not their code.

Every variant runs eagerly and under ``torch.compile`` (``--no-compile`` skips it).
Reported: median ms, ratio to torchforge, and the bytes autograd saves for the backward
(a device-independent proxy for peak memory; CUDA also reports the peak allocated).

Usage: python benchmarks/bench_losses.py [--quick] [--no-compile] [--device cuda] [--threads N]
Writes benchmarks/results/losses.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from torchforge.losses import ppo_loss

CLIP = 0.2


# --- the formulations -------------------------------------------------------------------

def torchforge_style(lp, old, adv, mask, maskf, adv_tok):
    loss, metrics = ppo_loss(lp, old, adv, mask, clip_low=CLIP)
    return loss, metrics


def minimal(lp, old, adv, mask, maskf, adv_tok):
    ratio = torch.exp(lp - old)
    a = adv[:, None]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP))
    return (pg * maskf).sum() / maskf.sum(), {}


def trl_style(lp, old, adv, mask, maskf, adv_tok):
    log_ratio = lp - old
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - CLIP, 1 + CLIP)
    a = adv.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    loss = (per_token_loss * maskf).sum() / maskf.sum().clamp(min=1.0)
    with torch.no_grad():
        is_low = (coef_1 < 1 - CLIP) & (a < 0)
        is_high = (coef_1 > 1 + CLIP) & (a > 0)
        region = is_low | is_high

        def masked_batch_mean(x):
            return (x * maskf).sum() / maskf.sum()
        metrics = {k: masked_batch_mean(v.float()).item()
                   for k, v in (("low_clip", is_low), ("high_clip", is_high), ("clip_ratio", region))}
    return loss, metrics


def verl_style(lp, old, adv, mask, maskf, adv_tok):
    def masked_mean(x, m):
        return (x * m).sum() / (m.sum() + 1e-8)
    negative_approx_kl = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, maskf)
    pg_losses1 = -adv_tok * ratio
    pg_losses2 = -adv_tok * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), maskf)
    pg_losses3 = -adv_tok * 3.0
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (adv_tok < 0).float(), maskf)
    pg_losses = torch.where(adv_tok < 0, clip_pg_losses2, clip_pg_losses1)
    loss = masked_mean(pg_losses, maskf)
    return loss, {"ppo_kl": ppo_kl.detach(), "clipfrac": pg_clipfrac.detach(), "clipfrac_lower": pg_clipfrac_lower.detach()}


def torchrl_style(lp, old, adv, mask, maskf, adv_tok):
    log_weight = (lp - old).unsqueeze(-1)
    advantage = adv_tok.unsqueeze(-1)
    gain1 = log_weight.exp() * advantage
    log_weight_clip = log_weight.clamp(torch.log(torch.tensor(1 - CLIP)).item(), torch.log(torch.tensor(1 + CLIP)).item())
    clip_fraction = (log_weight_clip != log_weight).to(log_weight.dtype).mean()
    ratio = log_weight_clip.exp()
    gain2 = ratio * advantage
    gain = torch.stack([gain1, gain2], -1).min(dim=-1).values
    with torch.no_grad():
        lw = log_weight.squeeze(-1)
        ess = (2 * lw.logsumexp(0) - (2 * lw).logsumexp(0)).exp().mean() / lw.shape[0]
        kl_approx = (old - lp).detach().mean()
    loss = (-gain).squeeze(-1)[mask].mean()
    return loss, {"clip_fraction": clip_fraction.detach(), "kl_approx": kl_approx, "ESS": ess}


VARIANTS = {
    "torchforge": torchforge_style,
    "minimal": minimal,
    "trl-style": trl_style,
    "verl-style": verl_style,
    "torchrl-style": torchrl_style,
}


# --- measurement ------------------------------------------------------------------------

def saved_bytes(fn, inputs, lp0):
    """Bytes autograd keeps for the backward (tensors seen by save_for_backward)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    lp = lp0.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = fn(lp, *inputs)
    loss.backward()
    return total


def step(fn, lp0, inputs, sync):
    lp = lp0.clone().requires_grad_()
    sync()
    start = time.perf_counter()
    loss, _ = fn(lp, *inputs)
    loss.backward()
    sync()
    return (time.perf_counter() - start) * 1e3


def machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                   if line.startswith("Model name"))
    except (StopIteration, FileNotFoundError):
        cpu = platform.processor() or "unknown CPU"
    return cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shape, few repeats")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's; 1 is steadier on a shared machine)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "losses.md"))
    args = parser.parse_args()

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T = (32, 1024) if args.quick else (256, 4096)
    repeats = args.repeats or (5 if args.quick else 21)
    g = torch.Generator().manual_seed(0)
    old = (-torch.rand(B, T, generator=g) * 3).to(device)
    lp0 = (old.cpu() + 0.1 * torch.randn(B, T, generator=g)).to(device)
    adv = torch.randn(B, generator=g).to(device)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)
    maskf = mask.float()
    adv_tok = adv[:, None].expand(B, T).contiguous()  # verl / TorchRL carry per-token advantages
    inputs = (old, adv, mask, maskf, adv_tok)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    # Same value from every formulation (the loss; their metrics differ by design).
    reference = ppo_loss(lp0, old, adv, mask)[0]
    for name, fn in VARIANTS.items():
        value = fn(lp0.clone().requires_grad_(), *inputs)[0]
        assert torch.allclose(value.detach(), reference, rtol=1e-4, atol=1e-6), (name, value, reference)

    runs = {(name, "eager"): fn for name, fn in VARIANTS.items()}
    if not args.no_compile:
        for name, fn in VARIANTS.items():
            if name == "trl-style":  # .item() in the metrics is a graph break by construction
                runs[(name, "compiled")] = torch.compile(fn)
            else:
                runs[(name, "compiled")] = torch.compile(fn, fullgraph=True)
    times = {key: [] for key in runs}
    for key, fn in runs.items():  # warm-up (and compilation)
        for _ in range(2):
            step(fn, lp0, inputs, sync)
    for _ in range(repeats):  # interleaved
        for key, fn in runs.items():
            times[key].append(step(fn, lp0, inputs, sync))
    peak = {}
    if device.type == "cuda":
        for key, fn in runs.items():
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(fn, lp0, inputs, sync)
            peak[key] = (torch.cuda.max_memory_allocated() - base) / 2**20

    medians = {key: statistics.median(v) for key, v in times.items()}
    lines = [
        "## Losses: ppo_loss forward + backward",
        "",
        f"Shape [B, T] = [{B}, {T}], float32, token-mean, ~60% of tokens counted; "
        f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else machine()}), "
        f"{os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}; median of {repeats} interleaved runs.",
        "",
        "| variant | mode | median ms | x torchforge (same mode) | saved for backward, eager (MiB) |"
        + (" peak CUDA MiB |" if peak else ""),
        "| --- | --- | ---: | ---: | ---: |" + (" ---: |" if peak else ""),
    ]
    saved = {name: saved_bytes(fn, inputs, lp0) / 2**20 for name, fn in VARIANTS.items()}
    for key, ms in medians.items():
        name, mode = key
        ratio = ms / medians[("torchforge", mode)]
        row = f"| {name} | {mode} | {ms:.2f} | {ratio:.2f} | {saved[name]:.1f} |"
        if peak:
            row += f" {peak[key]:.1f} |"
        lines.append(row)
    lines += [
        "",
        "torchforge computes all its metrics (clip fractions low / high, k3 approx KL, ratio "
        "mean / min / max) inside the timed region; `minimal` computes the loss only. "
        "The peers compute their own metrics as their libraries do. Under torch.compile "
        "ppo_loss uses plain autograd ops (the compiler fuses them); eagerly it uses a "
        "custom backward that saves one [B, T] tensor.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
