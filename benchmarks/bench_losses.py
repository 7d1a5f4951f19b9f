"""Benchmark: forward + backward of the policy losses on [B, T] = [256, 4096] float32.

Side by side in one process, interleaved (A B C ... A B C ...), medians:

PPO (``ppo_loss``, token-mean, all its metrics) and GRPO (``grpo_loss``, k3 KL with
coefficient 0.04, all its metrics) against:

- ``minimal``: the textbook formula, loss only, float-mask multiplication (GRPO: plus the
  plain k3 term);
- ``trl-style``: the per-token computation and reductions of TRL's GRPO loss (exp of the
  log-ratio, two coefficients, -min, masked sum / count; low / high / region clip
  fractions with float-mask means, read back with ``.item()``; GRPO: its k3 and mean KL);
- ``verl-style``: verl's ``compute_policy_loss`` (log-ratio clamped at +-20, k1
  ``ppo_kl``, dual-clip always on (c = 3) as in its default, [B, T] advantages, masked
  means with ``+ 1e-8``; GRPO: plus ``low_var_kl`` clamped at +-10);
- ``torchrl-style`` (PPO only): TorchRL's ``ClipPPOLoss`` objective (clamp in log space,
  gains stacked and min-reduced, clip fraction, kl_approx, effective sample size via
  logsumexp, masked selection before the mean);
- ``minimal, bool mask``: the same, given the bool mask the losses take (converted to
  float inside the timed region) instead of a float mask made beforehand;
- ``NAME`` (with ``--before NAME=DIR``, repeatable): the same function imported from an
  older copy of ``torchforge/losses.py`` saved as ``DIR/old_losses.py`` (importing the
  modules it needs from older copies beside it as ``old_kl``, ``old_ratios``: see
  ``load_before``), to record a change before and after in one run.

The new losses against their naive form (a direct re-implementation of the published
per-token computation, as verl writes it: ``nonzero`` / ``randperm`` / ``topk`` with a
``.item()`` count): ``sapo_loss``, ``gmpo_loss``, ``clip_cov_loss``, ``kl_cov_loss``.

``masked sum``: the mask alone, ``sum(where(mask, log_probs, 0))`` as the losses select
(``torchforge``) against a multiply by a float mask made beforehand (``minimal``) and by
``mask.float()`` (``minimal, bool mask``), eager and compiled: what reading a bool mask
costs by itself.

The mask is a padding mask (each row counts a prefix); ``--mask scattered`` counts each
token with p = 0.6 instead, as a token-selecting correction (``high_entropy_mask``,
``ratio_mask``) leaves it. On a CPU both ATen's ``torch.where`` (eager) and inductor's bool
load (compiled) handle the mask element by element, at a cost that depends on its pattern.

The peer formulations are re-implementations written for this benchmark, following those
libraries' published per-token computations; they are not their code.

PPO and GRPO also run under ``torch.compile(fullgraph=True)`` (torchforge, the befores,
the minimal formulas; ``--no-compile`` skips it). On a CPU, ``--kernels`` adds where a
compiled step spends its time: each C++ kernel inductor generates for torchforge and the two
minimal formulas, forward and backward, timed by the profiler (inductor's
``cpp.enable_kernel_profile``), in a second table. Reported: median ms, ratio to the minimal formula
and to torchforge (same mode), and the bytes autograd saves for the backward (a
device-independent proxy for peak memory; CUDA also reports the peak allocated).

On a CPU, freed buffers stay in the process (benchmarks/_allocator.py), as the CUDA caching
allocator keeps GPU memory: otherwise eager timings include the OS zeroing fresh pages,
which moves them by up to 30% with the order of the variants. ``--fresh-pages`` keeps
glibc's default.

Usage: python benchmarks/bench_losses.py [--quick] [--no-compile] [--kernels] [--mask scattered] [--before NAME=DIR ...] [--device cuda] [--threads N] [--fresh-pages]
Writes benchmarks/results/losses.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from _allocator import keep_freed_buffers
from _old_names import old_private_names

from torchforge.covariance_losses import clip_cov_loss, kl_cov_loss
from torchforge.losses import grpo_loss, ppo_loss
from torchforge.trust_region_losses import gmpo_loss, sapo_loss

CLIP = 0.2
BETA = 0.04
MASKS = {"padding": "a padding mask (each row counts a prefix of length uniform in [T/4, T]), ~60% of tokens counted",
         "scattered": "a scattered mask (each token counted with p = 0.6)"}


# --- PPO --------------------------------------------------------------------------------

def ppo_torchforge(lp, d):
    return ppo_loss(lp, d["old"], d["adv"], d["mask"], clip_low=CLIP)


def ppo_minimal(lp, d, maskf=None):
    maskf = d["maskf"] if maskf is None else maskf
    ratio = torch.exp(lp - d["old"])
    a = d["adv"][:, None]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP))
    return (pg * maskf).sum() / maskf.sum(), {}


def ppo_minimal_bool(lp, d):
    return ppo_minimal(lp, d, d["mask"].float())


def _trl_terms(lp, d):
    coef_1 = torch.exp(lp - d["old"])
    coef_2 = torch.clamp(coef_1, 1 - CLIP, 1 + CLIP)
    a = d["adv"].unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    with torch.no_grad():
        is_low = (coef_1 < 1 - CLIP) & (a < 0)
        is_high = (coef_1 > 1 + CLIP) & (a > 0)
        region = is_low | is_high
        maskf = d["maskf"]
        metrics = {k: ((v.float() * maskf).sum() / maskf.sum()).item()
                   for k, v in (("low_clip", is_low), ("high_clip", is_high), ("clip_ratio", region))}
    return per_token_loss, metrics


def ppo_trl(lp, d):
    per_token_loss, metrics = _trl_terms(lp, d)
    maskf = d["maskf"]
    return (per_token_loss * maskf).sum() / maskf.sum().clamp(min=1.0), metrics


def _verl_terms(lp, d):
    maskf, adv_tok = d["maskf"], d["adv_tok"]

    def masked_mean(x):
        return (x * maskf).sum() / (maskf.sum() + 1e-8)
    negative_approx_kl = torch.clamp(lp - d["old"], min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl)
    pg_losses1 = -adv_tok * ratio
    pg_losses2 = -adv_tok * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float())
    pg_losses3 = -adv_tok * 3.0
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (adv_tok < 0).float())
    pg_losses = torch.where(adv_tok < 0, clip_pg_losses2, clip_pg_losses1)
    metrics = {"ppo_kl": ppo_kl.detach(), "clipfrac": pg_clipfrac.detach(), "clipfrac_lower": pg_clipfrac_lower.detach()}
    return pg_losses, metrics, masked_mean


def ppo_verl(lp, d):
    pg_losses, metrics, masked_mean = _verl_terms(lp, d)
    return masked_mean(pg_losses), metrics


def ppo_torchrl(lp, d):
    log_weight = (lp - d["old"]).unsqueeze(-1)
    advantage = d["adv_tok"].unsqueeze(-1)
    gain1 = log_weight.exp() * advantage
    log_weight_clip = log_weight.clamp(torch.log(torch.tensor(1 - CLIP)).item(), torch.log(torch.tensor(1 + CLIP)).item())
    clip_fraction = (log_weight_clip != log_weight).to(log_weight.dtype).mean()
    gain2 = log_weight_clip.exp() * advantage
    gain = torch.stack([gain1, gain2], -1).min(dim=-1).values
    with torch.no_grad():
        lw = log_weight.squeeze(-1)
        ess = (2 * lw.logsumexp(0) - (2 * lw).logsumexp(0)).exp().mean() / lw.shape[0]
        kl_approx = (d["old"] - lp).detach().mean()
    loss = (-gain).squeeze(-1)[d["mask"]].mean()
    return loss, {"clip_fraction": clip_fraction.detach(), "kl_approx": kl_approx, "ESS": ess}


# --- GRPO -------------------------------------------------------------------------------

def grpo_torchforge(lp, d):
    return grpo_loss(lp, d["old"], d["adv"], d["mask"], d["ref"], kl_coef=BETA, clip_low=CLIP)


def grpo_minimal(lp, d, maskf=None):
    maskf = d["maskf"] if maskf is None else maskf
    ratio = torch.exp(lp - d["old"])
    a = d["adv"][:, None]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP))
    x = d["ref"] - lp
    kl = torch.exp(x) - x - 1
    return ((pg + BETA * kl) * maskf).sum() / maskf.sum(), {}


def grpo_minimal_bool(lp, d):
    return grpo_minimal(lp, d, d["mask"].float())


def grpo_trl(lp, d):
    per_token_loss, metrics = _trl_terms(lp, d)
    maskf = d["maskf"]
    per_token_kl = torch.exp(d["ref"] - lp) - (d["ref"] - lp) - 1
    per_token_loss = per_token_loss + BETA * per_token_kl
    metrics["kl"] = ((per_token_kl.detach() * maskf).sum() / maskf.sum().clamp(min=1.0)).item()
    return (per_token_loss * maskf).sum() / maskf.sum().clamp(min=1.0), metrics


def grpo_verl(lp, d):
    pg_losses, metrics, masked_mean = _verl_terms(lp, d)
    kl = torch.clamp(d["ref"] - lp, min=-20, max=20)
    kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    metrics["kl_loss"] = masked_mean(kld).detach()
    return masked_mean(pg_losses) + BETA * masked_mean(kld), metrics


# --- the mask alone ----------------------------------------------------------------------
# What reading the [B, T] mask costs, without a loss around it: the losses select with
# their bool mask (a NaN at a padded position must not reach the loss or the gradient),
# the minimal formulas multiply by a float mask made before the timed region.

def masked_sum_where(lp, d):
    return torch.where(d["mask"], lp, 0.0).sum(), {}


def masked_sum_float_mask(lp, d):
    return (lp * d["maskf"]).sum(), {}


def masked_sum_bool_to_float(lp, d):
    return (lp * d["mask"].float()).sum(), {}


# --- the new losses and their naive forms ------------------------------------------------

def sapo_torchforge(lp, d):
    return sapo_loss(lp, d["old"], d["adv"], d["mask"])


def sapo_naive(lp, d):
    ratio = torch.exp(lp - d["old"])
    a = d["adv_tok"]
    tau = torch.where(a > 0, 1.0, 1.05)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return (-gate * a * d["maskf"]).sum() / d["maskf"].sum(), {}


def gmpo_torchforge(lp, d):
    return gmpo_loss(lp, d["old"], d["adv"], d["mask"])


def gmpo_naive(lp, d):
    maskf, a = d["maskf"], d["adv_tok"]
    x = lp - d["old"]
    sgn = torch.sign(a)
    x_min = sgn * torch.min(sgn * x, sgn * torch.clamp(x, -0.4, 0.4))
    n = maskf.sum(-1)
    ratio = torch.exp((x_min * maskf).sum(-1) / (n + 1e-8))
    adv = (a * maskf).sum(-1) / (n + 1e-8)
    return torch.mean(-adv * ratio), {}


def clip_cov_torchforge(lp, d):
    return clip_cov_loss(lp, d["old"], d["adv"], d["mask"], generator=d["gen"])


def clip_cov_naive(lp, d):
    maskf, a, mask = d["maskf"], d["adv_tok"], d["mask"]

    def mm(x):
        return (x * maskf).sum() / maskf.sum()
    ratio = torch.exp(lp - d["old"])
    pg1 = -a * ratio
    pg2 = -a * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
    clip_by_origin = (pg2 > pg1) & mask
    cov = (a - mm(a)) * (lp - mm(lp.detach()))
    cov[~mask] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(2e-4 * maskf.sum().item()), 1)
    idx = torch.nonzero((cov < 5.0) & (cov > 1.0) & mask)
    corr = torch.ones_like(a)
    if len(idx) > 0:
        idx = idx[torch.randperm(len(idx), generator=d["gen"])[:clip_num]]
        corr[idx[:, 0], idx[:, 1]] = 0
    return mm(torch.maximum(pg1, pg2) * corr), {}


def kl_cov_torchforge(lp, d):
    return kl_cov_loss(lp, d["old"], d["adv"], d["mask"])


def kl_cov_naive(lp, d):
    maskf, a, mask = d["maskf"], d["adv_tok"], d["mask"]
    x = lp - d["old"]
    pg = -a * torch.exp(x)
    pg_kl = pg + 1.0 * x.abs()
    valid = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
    va, vl = a[mask].detach(), lp[mask].detach()
    cov = (va - va.mean()) * (vl - vl.mean())
    k = max(1, int(len(cov) * 2e-4))
    top = valid[torch.topk(cov, k).indices]
    pg = pg.reshape(-1).clone()
    pg[top] = pg_kl.reshape(-1)[top]
    return (pg.view_as(maskf) * maskf).sum() / maskf.sum(), {}


# --- measurement ------------------------------------------------------------------------

def saved_bytes(fn, lp0, d):
    """Bytes autograd keeps for the backward (tensors seen by save_for_backward)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    lp = lp0.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = fn(lp, d)
    loss.backward()
    return total


def step(fn, lp0, d, sync):
    lp = lp0.clone().requires_grad_()
    sync()
    start = time.perf_counter()
    loss, _ = fn(lp, d)
    loss.backward()
    sync()
    return (time.perf_counter() - start) * 1e3


def compiled_kernels(variants, lp0, d, sync, steps: int):
    """``[(group, name, phase, kernel, median ms per step)]``: the CPU kernels of each
    compiled variant, forward and backward, from the profiler with inductor's kernel
    profiling on, one profiled step at a time."""
    import torch._inductor.config as inductor_config
    from torch.profiler import profile

    rows = []
    torch._dynamo.reset()  # compile again, with the kernels' profiling compiled in
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        for (group, name), fn in variants.items():
            compiled = torch.compile(fn, fullgraph=True)
            for _ in range(2):
                step(compiled, lp0, d, sync)
            per_step = {}
            for _ in range(steps):
                with profile() as prof:
                    step(compiled, lp0, d, sync)
                total = {}
                for event in prof.events():
                    if not event.name.startswith("graph_"):
                        continue
                    parent, phase = event.cpu_parent, "forward"
                    while parent is not None:
                        if parent.name == "CompiledFunctionBackward":
                            phase = "backward"
                        parent = parent.cpu_parent
                    kernel = event.name.split("_cpp_fused_", 1)[-1]
                    total[(phase, kernel)] = total.get((phase, kernel), 0.0) + event.cpu_time_total / 1e3
                for key, ms in total.items():
                    per_step.setdefault(key, []).append(ms)
            rows += [(group, name, phase, kernel, statistics.median(ms))
                     for (phase, kernel), ms in per_step.items()]
    return rows


def machine() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in
                    subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines()
                    if line.startswith("Model name"))
    except (StopIteration, FileNotFoundError):
        return platform.processor() or "unknown CPU"


def _load(module_name: str, path: Path):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # torch.compile looks functions' modules up by name
    spec.loader.exec_module(module)
    return module


def load_before(name: str, directory: str):
    """``old_losses`` from ``directory`` (an older copy of torchforge/losses.py), under
    module names unique to ``name``. Modules it imports from the same folder as
    ``old_<module>`` (an older kl.py as ``old_kl``, ratios.py as ``old_ratios``) are
    loaded first, from ``DIR/old_<module>.py``."""
    helpers = sorted(p for p in Path(directory).glob("old_*.py") if p.name != "old_losses.py")
    with old_private_names():
        for path in helpers:
            sys.modules[path.stem] = _load(f"{path.stem}_{name}", path)
        try:
            return _load(f"old_losses_{name}", Path(directory) / "old_losses.py")
        finally:
            for path in helpers:
                sys.modules.pop(path.stem, None)




def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shape, few repeats")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--kernels", action="store_true",
                        help="CPU: also time each kernel of the compiled torchforge and minimal variants")
    parser.add_argument("--before", action="append", default=[], metavar="NAME=DIR",
                        help="a variant NAME from DIR/old_losses.py (and DIR/old_<module>.py); repeatable")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's; 1 is steadier on a shared machine)")
    parser.add_argument("--fresh-pages", action="store_true",
                        help="leave glibc's allocator as it is (freed buffers may go back to the OS)")
    parser.add_argument("--mask", choices=MASKS, default="padding",
                        help="; ".join(f"{name}: {what}" for name, what in MASKS.items()).replace("%", "%%"))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "losses.md"))
    args = parser.parse_args()

    device = torch.device(args.device)
    steady = device.type == "cpu" and not args.fresh_pages and keep_freed_buffers()
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T = (32, 1024) if args.quick else (256, 4096)
    repeats = args.repeats or (5 if args.quick else 21)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=g) * 3
    lp0 = (old + 0.1 * torch.randn(B, T, generator=g)).to(device)
    ref = (old + 0.1 * torch.randn(B, T, generator=g)).to(device)
    adv = torch.randn(B, generator=g).to(device)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    if args.mask == "padding":
        mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)
    else:
        mask = (torch.rand(B, T, generator=g) < 0.6).to(device)
    d = {"old": old.to(device), "ref": ref, "adv": adv, "mask": mask, "maskf": mask.float(),
         "adv_tok": adv[:, None].expand(B, T).contiguous(),  # verl / TorchRL carry per-token advantages
         "gen": torch.Generator(device=device).manual_seed(0)}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    groups = {
        "ppo_loss": {"torchforge": ppo_torchforge, "minimal": ppo_minimal, "minimal, bool mask": ppo_minimal_bool,
                     "trl-style": ppo_trl, "verl-style": ppo_verl, "torchrl-style": ppo_torchrl},
        "grpo_loss": {"torchforge": grpo_torchforge, "minimal": grpo_minimal, "minimal, bool mask": grpo_minimal_bool,
                      "trl-style": grpo_trl, "verl-style": grpo_verl},
        "sapo_loss": {"torchforge": sapo_torchforge, "naive": sapo_naive},
        "gmpo_loss": {"torchforge": gmpo_torchforge, "naive": gmpo_naive},
        "clip_cov_loss": {"torchforge": clip_cov_torchforge, "naive": clip_cov_naive},
        "kl_cov_loss": {"torchforge": kl_cov_torchforge, "naive": kl_cov_naive},
        "masked sum": {"torchforge": masked_sum_where, "minimal": masked_sum_float_mask,
                       "minimal, bool mask": masked_sum_bool_to_float},
    }
    befores = []
    for spec in args.before:
        name, _, directory = spec.rpartition("=")
        name = name or "before"
        befores.append(name)
        module = load_before(name.replace(" ", "_"), directory)
        groups["ppo_loss"][name] = lambda lp, d, m=module: m.ppo_loss(lp, d["old"], d["adv"], d["mask"], clip_low=CLIP)
        groups["grpo_loss"][name] = lambda lp, d, m=module: m.grpo_loss(
            lp, d["old"], d["adv"], d["mask"], d["ref"], kl_coef=BETA, clip_low=CLIP)

    # Same loss value from every formulation (their metrics differ by design); the
    # verl-style PPO has dual-clip on, which changes nothing at these ratios.
    for group, variants in groups.items():
        reference = variants["torchforge"](lp0, d)[0].detach()
        for name, fn in variants.items():
            if group == "clip_cov_loss":  # a random draw of 2e-4 of the tokens: close, not equal
                continue
            value = fn(lp0.clone().requires_grad_(), d)[0].detach()
            assert torch.allclose(value, reference, rtol=1e-4, atol=1e-6), (group, name, value, reference)

    runs = {(group, name, "eager"): fn for group, variants in groups.items() for name, fn in variants.items()}
    if not args.no_compile:
        for group in ("ppo_loss", "grpo_loss", "masked sum"):
            for name in ("torchforge", "minimal", "minimal, bool mask", *befores):
                if name in groups[group]:
                    runs[(group, name, "compiled")] = torch.compile(groups[group][name], fullgraph=True)
    times = {key: [] for key in runs}
    for key, fn in runs.items():  # warm-up (and compilation)
        for _ in range(2):
            step(fn, lp0, d, sync)
    for _ in range(repeats):  # interleaved
        for key, fn in runs.items():
            times[key].append(step(fn, lp0, d, sync))
    peak = {}
    if device.type == "cuda":
        for key, fn in runs.items():
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(fn, lp0, d, sync)
            peak[key] = (torch.cuda.max_memory_allocated() - base) / 2**20
    medians = {key: statistics.median(v) for key, v in times.items()}
    saved = {(group, name): saved_bytes(fn, lp0, d) / 2**20
             for group, variants in groups.items() for name, fn in variants.items()}

    kernels = []
    if args.kernels and device.type == "cpu" and not args.no_compile:
        kernels = compiled_kernels(
            {(group, name): groups[group][name] for group in ("ppo_loss", "grpo_loss")
             for name in ("torchforge", "minimal", "minimal, bool mask")},
            lp0, d, sync, steps=repeats)

    where = torch.cuda.get_device_name() if device.type == "cuda" else machine()
    lines = [
        "## Losses: forward + backward (benchmarks/bench_losses.py)",
        "",
        (f"Machine: {where}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}, "
         f"device {device}. Shape [B, T] = [{B}, {T}], float32, token-mean, {MASKS[args.mask]}; "
         f"median of {repeats} interleaved runs"
         + ("; freed buffers kept in the process (benchmarks/_allocator.py)." if steady else ".")),
        "",
        "| loss | variant | mode | median ms | x minimal / naive | x torchforge | saved for backward, eager (MiB) |"
        + (" peak CUDA MiB |" if peak else ""),
        "| --- | --- | --- | ---: | ---: | ---: | ---: |" + (" ---: |" if peak else ""),
    ]
    for (group, name, mode), ms in medians.items():
        base_name = "minimal" if (group, "minimal", mode) in medians else "naive"
        base = medians.get((group, base_name, mode))
        ratio_base = f"{ms / base:.2f}" if base else "-"
        row = (f"| {group} | {name} | {mode} | {ms:.2f} | {ratio_base} | "
               f"{ms / medians[(group, 'torchforge', mode)]:.2f} | {saved[(group, name)]:.1f} |")
        if peak:
            row += f" {peak[(group, name, mode)]:.1f} |"
        lines.append(row)
    lines += [
        "",
        ("torchforge computes all its metrics inside the timed region (PPO: clip fractions low / "
         "high, k3 approx KL, ratio mean / min / max; GRPO: those and the mean KL); `minimal` "
         "computes the loss only; the peers compute their own metrics as their libraries do. "
         "A `--before NAME=DIR` variant is an older losses.py, "
         "`DIR/old_losses.py`, timed in the same process."),
        "",
    ]
    if kernels:
        lines += [
            "### Where a compiled step spends its time (`--kernels`)",
            "",
            f"Each inductor kernel's time in a step (median of {repeats} steps, each profiled on its "
            "own); a kernel's name lists the ops fused into it. torchforge and "
            "`minimal, bool mask` read the bool mask in their kernels, `minimal` a float mask made "
            "before the step: the same kernels apart from the mask's dtype.",
            "",
            "| loss | variant | phase | kernel (fused ops) | ms per step |",
            "| --- | --- | --- | --- | ---: |",
            *(f"| {group} | {name} | {phase} | `{kernel}` | {ms:.2f} |" for group, name, phase, kernel, ms in kernels),
            "",
        ]
    lines += [
        (f"Run: `python benchmarks/bench_losses.py{' --threads ' + str(args.threads) if args.threads else ''}"
         f"{' --kernels' if kernels else ''}{' --mask ' + args.mask if args.mask != 'padding' else ''}"
         f"{''.join(f' --before {spec}' for spec in args.before)}{' --fresh-pages' if args.fresh_pages else ''}`."),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
