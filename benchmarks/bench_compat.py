"""Benchmark: ``torchforge.compat`` against the peers' own functions, same inputs, same process.

The compat layer should cost nothing over the function it replaces. Each row times the
forward + backward (where the peer's function has a gradient) of one twin and of the peer's
own function, interleaved (peer, compat, peer, compat, ...), and reports medians and their ratio;
each pair is checked equal before it is timed.

- TRL 1.16: ``compat.trl.grpo_loss`` against ``GRPOTrainer._compute_loss`` per ``loss_type``
  (``_compat_trl.py``, B=64, T=1024).
- verl 0.9.1: ``compat.verl``'s ``compute_policy_loss_vanilla`` / ``_gspo`` / ``_cispo``
  (B=64, T=1024, float32, gradient w.r.t. ``log_prob``), ``kl_penalty("low_var_kl")``, and
  the advantage estimators ``compute_gae_advantage_return`` (B=512, T=1024) and
  ``compute_grpo_outcome_advantage`` (4096 responses, groups of 8) where compat has them.

Usage: python benchmarks/bench_compat.py [--quick] [--threads N]   (an environment with verl
and trl: ``pip install -e '.[compat]'``). Writes benchmarks/results/compat.md (not with --quick).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _compat_trl import table as trl_table  # noqa: E402
from _compat_trl import trl_rows  # noqa: E402
from bench_advantages import interleaved  # noqa: E402


def _timed(peer, compat, reps: int) -> tuple[float, float]:
    medians = interleaved({"peer": peer, "compat": compat}, {"peer": reps, "compat": reps}, warmup=0)
    return 1e3 * medians["peer"], 1e3 * medians["compat"]


def _check(label: str, got, want) -> None:
    for g, w in zip(got, want):
        w = torch.as_tensor(w, dtype=torch.float64)
        g = torch.as_tensor(g, dtype=torch.float64)
        tol = 1e-5 * max(w.abs().max().item() if w.numel() else 0.0, 1.0)
        finite = torch.isfinite(w)
        if not torch.equal(finite, torch.isfinite(g)) or (g[finite] - w[finite]).abs().max().item() > tol:
            raise AssertionError(f"{label}: compat and verl differ")


def verl_rows(quick: bool = False) -> list[dict]:
    """One row per verl function: ``config``, ``shape``, ``peer_ms``, ``compat_ms``, ``ratio``."""
    import verl.trainer.ppo.core_algos as ca
    from verl.workers.config import ActorConfig

    from torchforge.compat import verl as tv

    reps = 5 if quick else 41
    B, T = (16, 256) if quick else (64, 1024)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=g) * 3
    lp0 = old + 0.1 * torch.randn(B, T, generator=g)
    A = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = (torch.arange(T) < torch.randint(T // 4, T + 1, (B, 1), generator=g)).float()
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_high=0.28)
    rows = []

    def loss_pair(name):
        peer_fn, compat_fn = ca.get_policy_loss_fn(name), tv.get_policy_loss_fn(name)

        def run(fn):
            def go():
                lp = lp0.clone().requires_grad_()
                loss = fn(old_log_prob=old, log_prob=lp, advantages=A, response_mask=mask,
                          loss_agg_mode="token-mean", config=config)[0]
                loss.backward()
                return loss.detach(), lp.grad
            return go
        return run(peer_fn), run(compat_fn)

    for name in ("vanilla", "gspo", "cispo"):
        peer, compat = loss_pair(name)
        _check(f"compute_policy_loss_{name}", compat(), peer())
        rows.append((f"`compute_policy_loss_{name}`, fwd+bwd", f"B={B}, T={T}", *_timed(peer, compat, reps)))

    ref = lp0 - 0.1

    def kl_run(fn):
        def go():
            lp = lp0.clone().requires_grad_()
            kl = fn(lp, ref, "low_var_kl")
            kl.sum().backward()
            return kl.detach(), lp.grad
        return go
    if hasattr(tv, "kl_penalty"):
        _check("kl_penalty", kl_run(tv.kl_penalty)(), kl_run(ca.kl_penalty)())
        rows.append(("`kl_penalty(\"low_var_kl\")`, fwd+bwd", f"B={B}, T={T}",
                     *_timed(kl_run(ca.kl_penalty), kl_run(tv.kl_penalty), reps)))

    if hasattr(tv, "compute_gae_advantage_return"):
        Bg, Tg = (64, 256) if quick else (512, 1024)
        rewards, values = torch.randn(Bg, Tg, generator=g), torch.randn(Bg, Tg, generator=g)
        gmask = (torch.arange(Tg) < torch.randint(Tg // 4, Tg + 1, (Bg, 1), generator=g)).float()

        def gae(fn):
            return lambda: fn(rewards, values, gmask, 1.0, 0.95)
        _check("compute_gae_advantage_return", gae(tv.compute_gae_advantage_return)(),
               gae(ca.compute_gae_advantage_return)())
        rows.append(("`compute_gae_advantage_return`", f"B={Bg}, T={Tg}",
                     *_timed(gae(ca.compute_gae_advantage_return), gae(tv.compute_gae_advantage_return),
                             max(3, reps // 4))))
    if hasattr(tv, "compute_grpo_outcome_advantage"):
        N, G, Tr = (512, 8, 64) if quick else (4096, 8, 256)
        scores = torch.zeros(N, Tr)
        scores[:, -1] = (torch.rand(N, generator=g) < 0.5).float()
        rmask = torch.ones(N, Tr)
        index = np.repeat(np.array([f"uid-{i}" for i in range(N // G)], dtype=object), G)

        def grpo(fn):
            return lambda: fn(scores, rmask, index)
        _check("compute_grpo_outcome_advantage", grpo(tv.compute_grpo_outcome_advantage)(),
               grpo(ca.compute_grpo_outcome_advantage)())
        rows.append(("`compute_grpo_outcome_advantage`", f"{N} responses, G={G}, T={Tr}",
                     *_timed(grpo(ca.compute_grpo_outcome_advantage), grpo(tv.compute_grpo_outcome_advantage),
                             reps)))
    return [dict(config=c, shape=s, peer_ms=p, compat_ms=m, ratio=m / p) for c, s, p, m in rows]


def verl_table(rows: list[dict]) -> str:
    lines = ["| verl function | shape | verl ms | `torchforge.compat.verl` ms | compat / verl |",
             "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['config']} | {r['shape']} | {r['peer_ms']:.2f} | {r['compat_ms']:.2f} | {r['ratio']:.2f}x |"
              for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(HERE / "results" / "compat.md"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    verl, trl = verl_rows(args.quick), trl_rows(quick=args.quick)
    ratios = [r["ratio"] for r in verl + trl]
    slowest = max(verl + trl, key=lambda r: r["ratio"])
    slowest_name = ("verl " if slowest in verl else "TRL ") + slowest["config"].split(",")[0].strip("`")
    text = "\n".join([
        "# torchforge.compat against the peers' own functions",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, load {load:.2f}; torch {torch.__version__}. "
        "Medians of interleaved runs, each pair checked equal first.",
        f"Command: `python benchmarks/bench_compat.py{' --threads ' + str(args.threads) if args.threads else ''}`",
        "",
        "## verl 0.9.1",
        "",
        verl_table(verl),
        "",
        "## TRL 1.16",
        "",
        trl_table(trl),
        "",
        "## Summary",
        "",
        "| figure | value |",
        "| --- | ---: |",
        f"| worst compat / peer ratio | {max(ratios):.2f}x |",
        f"| slowest twin against its peer | {slowest_name} |",
        f"| median compat / peer ratio | {statistics.median(ratios):.2f}x |",
        "",
    ])
    print(text)
    if not args.quick:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
