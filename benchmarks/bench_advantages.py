"""Benchmark: torchforge's gae and group_advantages against the formulations other libraries use.

GAE peers (re-implemented here from their published semantics):
  - loop:         the per-timestep reverse Python loop with mask carry-over (verl style);
  - trl_loop:     TorchRL's ``generalized_advantage_estimate`` (reverse loop over time,
                  [B, T, 1] layout, done flags);
  - trl_vec:      TorchRL's ``vec_generalized_advantage_estimate`` for scalar gamma / lambda
                  (split the rows into trajectories at done flags, pad, and convolve with the
                  geometric series gamma * lam ** k truncated below 1e-7).
TorchRL has no notion of skipped (masked) tokens inside a row; its inputs are prepared for it
*outside the timed region* by moving each row's counted tokens to the left, so that its
results equal ours, gaps in the mask included (this favours the TorchRL variants).

group_advantages peers, B = 65536:
  - trl:     nanmean / nanstd over [B / G, G] + repeat_interleave (TRL's GRPOTrainer);
  - verl:    a Python loop collecting each group's scores (verl's compute_grpo_outcome_advantage);
  - minimal: view / mean / std, no NaN or tie handling (the lower bound).

Variants are interleaved (A B C A B C ...) and medians reported; the machine may be shared.
Usage: python benchmarks/bench_advantages.py [--quick] [--threads N] [--no-compile] [--before FILE [FILE ...]]
       [--verl-site /work/venv-peers/lib/python3.11/site-packages]

The ``floor`` section times gae at B=512, T=4096 against a plain copy of its arrays (the
memory floor) and verl's own function (``--verl-site``; else the loop above).

--before times the current functions against an earlier version, copied from git: the single
advantages.py of before the split (``git show <commit>:torchforge/advantages.py``), or, for a
commit after it, its advantages.py and returns.py together.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch

from torchforge.advantages import (
    group_advantages,
    opo_advantages,
    passk_advantages,
    rloo_advantages,
    zero_std_groups,
)
from torchforge.returns import gae, reinforce_pp_advantages, remax_advantages

RESULTS = os.path.join(os.path.dirname(__file__), "results", "advantages.md")


# --- peers: GAE ---------------------------------------------------------------------------

def loop_gae(rewards, values, mask, gamma, lam):
    """Per-timestep reverse loop; masked tokens carry value and advantage (verl)."""
    B, T = rewards.shape
    m = mask.float()
    next_values = torch.zeros(B)
    last = torch.zeros(B)
    out = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        new = delta + gamma * lam * last
        next_values = values[:, t] * m[:, t] + (1 - m[:, t]) * next_values
        last = new * m[:, t] + (1 - m[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def trl_loop_gae(gamma, lmbda, state_value, next_state_value, reward, done):
    """TorchRL generalized_advantage_estimate: tensors [B, T, 1], time at dim -2."""
    terminated = done.clone()
    not_done = (~done).int()
    not_terminated = (~terminated).int()
    advantage = torch.empty_like(state_value)
    prev = 0
    delta = reward + gamma * not_terminated * next_state_value - state_value
    discount = lmbda * gamma * not_done
    for t in reversed(range(state_value.shape[-2])):
        prev = advantage[..., t, :] = delta[..., t, :] + prev * discount[..., t, :]
    return advantage, advantage + state_value


def trl_vec_gae(gamma, lmbda, state_value, next_state_value, reward, done, thr=1e-7):
    """TorchRL vec_generalized_advantage_estimate, scalar gamma / lambda path."""
    done = done.transpose(-2, -1)  # [B, 1, T]
    terminated = done.clone()
    reward, value, next_value = (x.transpose(-2, -1) for x in (reward, state_value, next_state_value))
    td0 = reward + (~terminated).int() * gamma * next_value - value
    # trajectory lengths: split at every done flag (and at the end of each row)
    ends = done.clone()
    ends[..., -1] = True
    num_per_traj = torch.where(ends.reshape(-1))[0] + 1
    num_per_traj[1:] = num_per_traj[1:] - num_per_traj[:-1]
    # pad the trajectories to [N, Tmax]
    t_max = int(num_per_traj.max())
    arange = torch.arange(t_max, dtype=torch.int16).unsqueeze(0)
    pad_mask = arange < num_per_traj.unsqueeze(1)
    padded = torch.masked_scatter(torch.zeros(len(num_per_traj), t_max), pad_mask, td0.reshape(-1))
    # geometric filter, truncated where gamma * lambda ** k < thr
    gl = gamma * lmbda
    length = t_max if gl >= 1.0 else max(1, min(t_max, int(math.log(thr) / math.log(gl)))) if gl > 0 else 1
    series = torch.full((length,), gl)
    series[0] = 1.0
    series = series.cumprod(0)
    adv = torch.conv1d(torch.nn.functional.pad(padded.unsqueeze(1), [0, length - 1]), series.view(1, 1, -1))
    adv = adv.squeeze(1)[pad_mask].view_as(reward)
    value_target = adv + value
    return adv.transpose(-1, -2), value_target.transpose(-1, -2)


def torchrl_inputs(rewards, values, mask):
    """Counted tokens moved to the left of each row; done on the last counted token."""
    B, T = mask.shape
    order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)
    n = mask.sum(-1)
    valid = torch.arange(T).unsqueeze(0) < n.unsqueeze(1)
    r = torch.where(valid, rewards.gather(1, order), 0.0)
    v = torch.where(valid, values.gather(1, order), 0.0)
    next_v = torch.cat([v[:, 1:], torch.zeros(B, 1)], dim=1)
    done = torch.arange(T).unsqueeze(0) == (n - 1).clamp(min=0).unsqueeze(1)
    return dict(state_value=v.unsqueeze(-1), next_state_value=next_v.unsqueeze(-1),
                reward=r.unsqueeze(-1), done=done.unsqueeze(-1)), order, valid


def torchrl_outputs(adv, order, valid, mask):
    out = torch.zeros(mask.shape)
    out.scatter_(1, order, torch.where(valid, adv.squeeze(-1), 0.0))
    return torch.where(mask, out, 0.0)


# --- peers: group advantages --------------------------------------------------------------

def trl_group(rewards, G, eps=1e-6):
    grouped = rewards.view(-1, G)
    mean = torch.nanmean(grouped, dim=1)
    var = torch.nanmean((grouped - mean.unsqueeze(1)) ** 2, dim=1)
    count = (~torch.isnan(grouped)).sum(1)
    std = torch.sqrt(var * count / (count - 1))
    mean, std = mean.repeat_interleave(G), std.repeat_interleave(G)
    return (rewards - mean) / (std + eps)


def verl_group(rewards, G, eps=1e-6):
    index = [i // G for i in range(rewards.shape[0])]
    scores = rewards.clone()
    id2score = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    id2mean, id2std = {}, {}
    for idx, group in id2score.items():
        stacked = torch.stack(group)
        id2mean[idx], id2std[idx] = stacked.mean(), stacked.std()
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + eps)
    return scores


def minimal_group(rewards, G, eps=1e-6):
    grouped = rewards.view(-1, G)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + eps)).view(-1)


# --- timing -------------------------------------------------------------------------------

def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved(fns: dict, repeats: dict, warmup: int = 1, stat=statistics.median) -> dict:
    """Median (or ``stat``) seconds of each callable, run A B C A B C ...; ``repeats[name]``
    caps a slow one."""
    times = {k: [] for k in fns}
    for k, f in fns.items():
        for _ in range(warmup):
            f()
    rounds = max(repeats.values())
    for i in range(rounds):
        for k, f in fns.items():
            if i < repeats[k]:
                sync()
                t0 = time.perf_counter()
                f()
                sync()
                times[k].append(time.perf_counter() - t0)
    return {k: stat(v) for k, v in times.items()}


def memory_bytes(fn) -> int:
    """Peak bytes allocated by ``fn`` on CUDA; on CPU, the total bytes its ops allocate.

    (The CPU profiler attributes allocations to ops but frees to no op, so a CPU peak is not
    recoverable from it; the total allocated is an upper bound of the peak.)
    """
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def machine() -> str:
    try:
        model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in model.splitlines() if "Model name" in line)
    except Exception:  # noqa: BLE001 - lscpu is informational only
        model = platform.processor() or "unknown CPU"
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{model}, {os.cpu_count()} cores visible, torch.get_num_threads()={torch.get_num_threads()}{gpu}, "
            f"torch {torch.__version__}")


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s < 10 else f"{s * 1e3:.0f}"


# --- main ---------------------------------------------------------------------------------

def bench_gae(args, lines):
    gamma, lam = 1.0, 0.95
    sizes = [(B, T) for B in (64, 512) for T in (256, 1024, 4096)]
    compiled = None if args.no_compile else torch.compile(gae, fullgraph=True)
    lines += [
        f"### gae (gamma={gamma}, lam={lam}; mask: right padding plus ~10% masked tool tokens inside rows)",
        "",
        "| B | T | torchforge eager ms | compiled ms | loop (verl) ms | TorchRL loop ms | TorchRL vec ms "
        "| loop / ours | TorchRL loop / ours | TorchRL vec / ours | MB ours / loop / vec | max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for B, T in sizes:
        g = torch.Generator().manual_seed(B + T)
        rewards = torch.randn(B, T, generator=g)
        values = torch.randn(B, T, generator=g)
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)) & (torch.rand(B, T, generator=g) > 0.1)
        trl_in, order, valid = torchrl_inputs(rewards, values, mask)

        ours = lambda: gae(rewards, values, mask, gamma=gamma, lam=lam)  # noqa: E731
        fns = {
            "ours": ours,
            "loop": lambda: loop_gae(rewards, values, mask, gamma, lam),
            "trl_loop": lambda: trl_loop_gae(gamma, lam, **trl_in),
            "trl_vec": lambda: trl_vec_gae(gamma, lam, **trl_in),
        }
        if compiled is not None:
            fns["compiled"] = lambda: compiled(rewards, values, mask, gamma=gamma, lam=lam)
        slow = 3 if args.quick else (5 if B * T >= 512 * 1024 else 9)
        fast = 5 if args.quick else 15
        reps = {k: (fast if k in ("ours", "compiled") else slow) for k in fns}
        med = interleaved(fns, reps)

        # same results, gaps included
        adv, ret = ours()
        ref_adv = torch.where(mask, loop_gae(rewards, values, mask, gamma, lam)[0], 0.0)
        scale = ret.abs().max().item()
        errs = [(adv - ref_adv).abs().max().item() / scale]
        for fn in (trl_loop_gae, trl_vec_gae):
            a = torchrl_outputs(fn(gamma, lam, **trl_in)[0], order, valid, mask)
            errs.append((adv - a).abs().max().item() / scale)
        if compiled is not None:
            errs.append((compiled(rewards, values, mask, gamma=gamma, lam=lam)[0] - adv).abs().max().item() / scale)
        mem = [memory_bytes(f) / 2**20 for f in (fns["ours"], fns["loop"], fns["trl_vec"])]
        comp = fmt_ms(med["compiled"]) if compiled is not None else "-"
        lines.append(
            f"| {B} | {T} | {fmt_ms(med['ours'])} | {comp} | {fmt_ms(med['loop'])} | {fmt_ms(med['trl_loop'])} "
            f"| {fmt_ms(med['trl_vec'])} | {med['loop'] / med['ours']:.1f}x | {med['trl_loop'] / med['ours']:.1f}x "
            f"| {med['trl_vec'] / med['ours']:.1f}x | {mem[0]:.0f} / {mem[1]:.0f} / {mem[2]:.0f} | {max(errs):.1e} |"
        )
        print(lines[-1], flush=True)
    lines.append("")


def verl_gae():
    """verl's own ``compute_gae_advantage_return`` (with its masked whitening), when verl imports
    (``--verl-site`` adds a site-packages folder, e.g. /work/venv-peers/lib/python3.11/site-packages,
    at the end of sys.path); else None."""
    try:
        from verl.trainer.ppo.core_algos import compute_gae_advantage_return
    except Exception:  # verl absent, or its dependencies
        return None
    return compute_gae_advantage_return


def bench_floor(args, lines):
    """gae at B=512, T=4096 against the memory floor (a plain copy of its arrays) and verl."""
    gamma, lam, B, T = 1.0, 0.95, 512, 4096
    verl = verl_gae()
    peer = "verl `compute_gae_advantage_return`" if verl is not None else "loop (verl's, re-implemented)"
    lines += [
        f"### gae at B={B}, T={T} against the memory floor and {peer}",
        "",
        "| mask | torchforge ms | copy floor ms | ours / floor | peer ms | peer / ours | max rel err |",
        "|---|---|---|---|---|---|---|",
    ]
    g = torch.Generator().manual_seed(7)
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    right = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    masks = {"right padding": right, "right padding + ~10% tool tokens": right & (torch.rand(B, T, generator=g) > 0.1)}
    for name, mask in masks.items():
        m = mask.float()
        fns = {
            "ours": lambda: gae(rewards, values, mask, gamma=gamma, lam=lam),
            # the floor: read rewards, values and mask once and write as many bytes (two float32 outputs)
            "floor": lambda: (rewards.clone(), values.clone(), mask.clone()),
            "peer": (lambda: verl(rewards, values, m, gamma, lam)) if verl is not None
            else (lambda: loop_gae(rewards, values, mask, gamma, lam)),
        }
        slow = 3 if args.quick else 7
        med = interleaved(fns, {"ours": 5 if args.quick else 21, "floor": 5 if args.quick else 21, "peer": slow})
        adv, ret = fns["ours"]()
        ref_adv = torch.where(mask, loop_gae(rewards, values, mask, gamma, lam)[0], 0.0)
        err = (adv - ref_adv).abs().max().item() / ret.abs().max().item()
        lines.append(f"| {name} | {fmt_ms(med['ours'])} | {fmt_ms(med['floor'])} | {med['ours'] / med['floor']:.1f}x "
                     f"| {fmt_ms(med['peer'])} | {med['peer'] / med['ours']:.1f}x | {err:.1e} |")
        print(lines[-1], flush=True)
    lines += ["", "Copy floor: `clone()` of rewards, values (float32) and mask (bool), the bytes gae must read and "
              "about those it writes, once. verl's function also whitens the advantages (its own API).", ""]


def bench_group(args, lines):
    B = 65536
    compiled = None if args.no_compile else torch.compile(group_advantages, fullgraph=True)
    lines += [
        f"### group_advantages (B={B}, scale='group')",
        "",
        "| G | torchforge eager ms | compiled ms | TRL ms | verl loop ms | minimal ms | TRL / ours | verl / ours "
        "| minimal / ours |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for G in (8, 16):
        rewards = torch.randn(B, generator=torch.Generator().manual_seed(G))
        fns = {
            "ours": lambda: group_advantages(rewards, group_size=G),
            "trl": lambda: trl_group(rewards, G),
            "minimal": lambda: minimal_group(rewards, G),
            "verl": lambda: verl_group(rewards, G),
        }
        if compiled is not None:
            fns["compiled"] = lambda: compiled(rewards, group_size=G)
        fast = 11 if args.quick else 51
        reps = {k: (1 if k == "verl" and args.quick else 3 if k == "verl" else fast) for k in fns}
        med = interleaved(fns, reps, warmup=1 if not args.quick else 0)
        torch.testing.assert_close(group_advantages(rewards, group_size=G), trl_group(rewards, G), rtol=1e-4, atol=1e-5)
        comp = fmt_ms(med["compiled"]) if compiled is not None else "-"
        lines.append(
            f"| {G} | {fmt_ms(med['ours'])} | {comp} | {fmt_ms(med['trl'])} | {fmt_ms(med['verl'])} "
            f"| {fmt_ms(med['minimal'])} | {med['trl'] / med['ours']:.1f}x | {med['verl'] / med['ours']:.0f}x "
            f"| {med['minimal'] / med['ours']:.2f}x |"
        )
        print(lines[-1], flush=True)
    lines.append("")


# --- peers: the new estimators as naive loops ------------------------------------------------

def loop_passk(rewards, G, k, eps=1e-6):
    """The authors' calc_adv, one group at a time (math.comb), as in their verl patch."""
    out = torch.zeros_like(rewards)
    for g in range(0, rewards.shape[0], G):
        val = rewards[g:g + G].tolist()
        n, c = len(val), sum(1 for v in val if v == 1)
        rho = 1 - math.comb(n - c, k) / math.comb(n, k)
        sigma = math.sqrt(rho * (1 - rho))
        a_pos = (1 - rho) / (sigma + eps)
        a_neg = (1 - rho - (math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1) if n > c else 0.0)) / (sigma + eps)
        out[g:g + G] = torch.tensor([a_pos if v == 1 else a_neg for v in val])
    return out


def loop_opo(rewards, mask, G):
    """verl's compute_opo_outcome_advantage: a dict of groups, a length-weighted baseline each."""
    lengths = mask.sum(-1)
    groups = defaultdict(list)
    for i in range(rewards.shape[0]):
        groups[i // G].append(i)
    out = torch.zeros_like(rewards)
    for rows in groups.values():
        r, n = rewards[rows], lengths[rows].float()
        out[rows] = r - (n * r).sum() / n.sum()
    return out


def loop_remax(rewards, baselines, mask):
    """Per-row loop: reward-to-go over the counted tokens minus the greedy reward."""
    out = torch.zeros(mask.shape)
    for b in range(mask.shape[0]):
        counted = mask[b].nonzero().flatten()
        if counted.numel():
            out[b, counted] = rewards[b] - baselines[b]
    return out


def verl_remax(token_rewards, baselines, mask):
    """verl's compute_remax_outcome_advantage (vectorized; no skipped tokens inside rows)."""
    returns = (token_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - baselines.unsqueeze(-1) * mask


def trl_gdpo(rewards_per_func, G, weights, eps=1e-4):
    """TRL's multi_objective_aggregation="normalize_then_sum" (vectorized)."""
    K = rewards_per_func.shape[1]
    grouped = rewards_per_func.view(-1, G, K)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = grouped.std(dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + eps)).view(-1, K)
    s = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    return (s - s.mean()) / (s.std() + eps)


def verl_rloo_ids(rewards, index):
    """verl's compute_rloo_vectorized_outcome_advantage (np.unique + bincount)."""
    import numpy as np

    inv = torch.from_numpy(np.unique(index, return_inverse=True)[1])
    c = torch.bincount(inv)[inv].to(rewards.dtype)
    return ((c * rewards - torch.bincount(inv, weights=rewards)[inv]) / (c - 1).clamp_min(1)) * (c > 1)


def bench_new(args, lines):
    B, G, T, K = 4096, 8, 64, 3
    g = torch.Generator().manual_seed(5)
    binary = (torch.rand(B, generator=g) < 0.3).float()
    rewards = torch.randn(B, generator=g)
    multi = torch.randint(0, 3, (B, K), generator=g).float()
    weights = torch.tensor([1.0, 0.5, 2.0])
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    baselines = torch.randn(B, generator=g)
    token_rewards = torch.where(mask & (torch.arange(T)[None, :] == lengths[:, None] - 1), rewards[:, None], 0.0)
    index = torch.arange(B // G).repeat_interleave(G).numpy()
    cases = [
        ("passk_advantages (k=4)", lambda: passk_advantages(binary, k=4, group_size=G),
         {"loop (authors' calc_adv per group)": lambda: loop_passk(binary, G, 4)}),
        ("opo_advantages", lambda: opo_advantages(rewards, mask, group_size=G),
         {"loop (verl's dict of groups)": lambda: loop_opo(rewards, mask, G)}),
        ("remax_advantages", lambda: remax_advantages(rewards, baselines, mask),
         {"loop (per row)": lambda: loop_remax(rewards, baselines, mask),
          "verl (flip-cumsum)": lambda: verl_remax(token_rewards, baselines, mask)}),
        ("group_advantages [B, K=3] (GDPO)", lambda: group_advantages(multi, group_size=G, reward_weights=weights, eps=1e-4),
         {"TRL normalize_then_sum": lambda: trl_gdpo(multi, G, weights)}),
        ("rloo_advantages (group_ids)", lambda: rloo_advantages(rewards, group_ids=torch.from_numpy(index)),
         {"verl rloo_vectorized (np.unique + bincount)": lambda: verl_rloo_ids(rewards, index)}),
    ]
    torch.testing.assert_close(passk_advantages(binary, k=4, group_size=G), loop_passk(binary, G, 4), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(opo_advantages(rewards, mask, group_size=G), loop_opo(rewards, mask, G), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(remax_advantages(rewards, baselines, mask), verl_remax(token_rewards, baselines, mask))
    torch.testing.assert_close(group_advantages(multi, group_size=G, reward_weights=weights, eps=1e-4),
                               trl_gdpo(multi, G, weights), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rloo_advantages(rewards, group_ids=torch.from_numpy(index)), verl_rloo_ids(rewards, index))
    lines += [
        f"### New estimators against their loop (or peer) form (B={B}, G={G}, T={T})",
        "",
        "| estimator | torchforge ms | peer | peer ms | peer / ours |",
        "|---|---|---|---|---|",
    ]
    for name, ours, peers in cases:
        fns = {"ours": ours, **peers}
        slow = 3 if args.quick else 7
        reps = {k: (11 if args.quick else 31) if k == "ours" or "vectorized" in k or "TRL" in k or "verl (" in k
                else slow for k in fns}
        med = interleaved(fns, reps)
        for peer in peers:
            lines.append(f"| `{name}` | {fmt_ms(med['ours'])} | {peer} | {fmt_ms(med[peer])} "
                         f"| {med[peer] / med['ours']:.1f}x |")
            print(lines[-1], flush=True)
    lines.append("")


def bench_group_ids(args, lines):
    B, G = 65536, 8
    g = torch.Generator().manual_seed(6)
    rewards = torch.randint(0, 4, (B,), generator=g).float() / 3
    binary = (rewards > 0.5).float()
    mask = torch.rand(B, 16, generator=g) < 0.8
    perm = torch.randperm(B, generator=g)
    ids = torch.arange(B // G).repeat_interleave(G)
    near, far = ids[perm], (ids * 7919 + 10**9)[perm]  # ids in [0, B) index a table; others are made dense
    r_p, b_p, m_p = rewards[perm], binary[perm], mask[perm]
    cases = {
        "group_advantages": (lambda: group_advantages(rewards, group_size=G),
                             lambda ids: group_advantages(r_p, group_ids=ids)),
        "rloo_advantages": (lambda: rloo_advantages(rewards, group_size=G),
                            lambda ids: rloo_advantages(r_p, group_ids=ids)),
        "passk_advantages (k=4)": (lambda: passk_advantages(binary, k=4, group_size=G),
                                   lambda ids: passk_advantages(b_p, k=4, group_ids=ids)),
        "opo_advantages": (lambda: opo_advantages(rewards, mask, group_size=G),
                           lambda ids: opo_advantages(r_p, m_p, group_ids=ids)),
        "zero_std_groups": (lambda: zero_std_groups(rewards, group_size=G),
                            lambda ids: zero_std_groups(r_p, group_ids=ids)),
    }
    lines += [
        f"### group_ids against contiguous group_size (B={B}, G={G}, rows shuffled for group_ids)",
        "",
        "| estimator | group_size ms | group_ids in [0, B) ms | ratio | ratio of the fastest runs "
        "| other ids (torch.unique) ms | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (contiguous, by_ids) in cases.items():
        torch.testing.assert_close(by_ids(near).float(), contiguous()[perm].float(), rtol=0, atol=1e-5)
        fns = {"size": contiguous, "near": lambda: by_ids(near), "far": lambda: by_ids(far)}
        n = 11 if args.quick else 51
        times = interleaved(fns, {k: n for k in fns}, stat=lambda v: (statistics.median(v), min(v)))
        med = {k: v[0] for k, v in times.items()}
        best = {k: v[1] for k, v in times.items()}
        lines.append(f"| `{name}` | {fmt_ms(med['size'])} | {fmt_ms(med['near'])} | {med['near'] / med['size']:.2f}x "
                     f"| {best['near'] / best['size']:.2f}x | {fmt_ms(med['far'])} | {med['far'] / med['size']:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", "Ratio of the fastest runs: the minimum over the interleaved runs of each, less sensitive to "
              "other jobs on a shared machine than the median.", ""]


def load_before(paths: list[str]):
    """The advantage functions of an earlier commit, imported from copied files.

    One file (the single advantages.py of before the split into advantages.py and returns.py)
    or several (e.g. a later commit's advantages.py and returns.py): each is imported as its own
    module, and a function is taken from the first file that defines it.
    """
    import importlib.util
    import types

    before = types.SimpleNamespace()
    for i, path in enumerate(paths):
        spec = importlib.util.spec_from_file_location(f"advantages_before_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")]):
            if not hasattr(before, name):
                setattr(before, name, getattr(module, name))
    return before


def bench_before_after(args, lines):
    before = load_before(args.before)
    files = ", ".join(f"`{os.path.basename(p)}`" for p in args.before)
    lines += [
        f"### Before / after (the same process; before = {files}, the previous "
        "advantages.py)",
        "",
        "| function | shape | before ms | after ms | after / before | fastest runs: after / before |",
        "|---|---|---|---|---|---|",
    ]
    g = torch.Generator().manual_seed(8)
    rows = []
    for B, T in ((64, 1024), (512, 1024), (512, 4096)):
        r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
        lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
        m = (torch.arange(T)[None, :] < lengths[:, None]) & (torch.rand(B, T, generator=g) > 0.1)
        rows.append(("gae", f"B={B}, T={T}", lambda r=r, v=v, m=m: before.gae(r, v, m, gamma=1.0, lam=0.95),
                     lambda r=r, v=v, m=m: gae(r, v, m, gamma=1.0, lam=0.95)))
    seq = torch.randn(512, generator=g)
    m = torch.rand(512, 1024, generator=g) < 0.8
    rows.append(("gae ([B] rewards)", "B=512, T=1024", lambda: before.gae(seq, v[:, :1024], m, gamma=1.0, lam=0.95),
                 lambda: gae(seq, v[:, :1024], m, gamma=1.0, lam=0.95)))
    rows.append(("reinforce_pp_advantages", "B=512, T=1024",
                 lambda: before.reinforce_pp_advantages(seq, m, gamma=0.99, group_size=8),
                 lambda: reinforce_pp_advantages(seq, m, gamma=0.99, group_size=8)))
    for G in (8, 16):
        rew = torch.randn(65536, generator=torch.Generator().manual_seed(G))
        for scale in ("group", "batch"):
            rows.append((f"group_advantages (scale={scale!r})", f"B=65536, G={G}",
                         lambda rew=rew, G=G, s=scale: before.group_advantages(rew, group_size=G, scale=s),
                         lambda rew=rew, G=G, s=scale: group_advantages(rew, group_size=G, scale=s)))
        rows.append(("rloo_advantages", f"B=65536, G={G}", lambda rew=rew, G=G: before.rloo_advantages(rew, group_size=G),
                     lambda rew=rew, G=G: rloo_advantages(rew, group_size=G)))
    missing = sorted({name.split(" ")[0] for name, *_ in rows} - set(vars(before)))
    if missing:
        raise SystemExit(f"--before: {' '.join(args.before)} do not define {missing}; for a commit after the "
                         "split of advantages.py, pass its advantages.py and returns.py")
    for name, shape, old, new in rows:
        n = 7 if args.quick else (101 if "B=65536" in shape else 31)  # sub-ms rows: more repeats
        times = interleaved({"before": old, "after": new}, {"before": n, "after": n},
                            stat=lambda v: (statistics.median(v), min(v)))
        med = {k: v[0] for k, v in times.items()}
        best = {k: v[1] for k, v in times.items()}
        lines.append(f"| `{name}` | {shape} | {fmt_ms(med['before'])} | {fmt_ms(med['after'])} "
                     f"| {med['after'] / med['before']:.2f}x | {best['after'] / best['before']:.2f}x |")
        print(lines[-1], flush=True)
    lines.append("")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--out", default=RESULTS, help="markdown file to write")
    parser.add_argument("--before", default=None, nargs="+", metavar="FILE",
                        help="an earlier advantages.py (e.g. copied from git) to time against; after the "
                             "split, that commit's advantages.py and returns.py")
    parser.add_argument("--only", default=None, help="comma-separated sections: gae,floor,group,new,ids,before")
    parser.add_argument("--verl-site", default=None, help="a site-packages folder with verl, appended to sys.path")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # all @batch_args wrappers share one code object: allow more than dynamo's 8 entries
    torch._dynamo.config.recompile_limit = 64
    torch.manual_seed(0)
    lines = ["## Advantages (`benchmarks/bench_advantages.py`)", "", f"Machine: {machine()}.", ""]
    if args.quick:
        lines += ["(--quick run: few repeats)", ""]
    if args.verl_site:
        sys.path.append(args.verl_site)
    sections = {"gae": bench_gae, "floor": bench_floor, "group": bench_group, "new": bench_new, "ids": bench_group_ids}
    if args.before:
        sections["before"] = bench_before_after
    for name, bench in sections.items():
        if args.only is None or name in args.only.split(","):
            bench(args, lines)
    lines += [
        "Medians of interleaved runs. Ratios > 1 mean torchforge is faster. TorchRL's inputs are prepared "
        "(counted tokens moved left, done flags) outside its timed region. MB: bytes allocated during one "
        "call (CPU: total allocated by its ops, an upper bound of the peak; CUDA: peak). max rel err: largest |difference| of the "
        "advantages of any peer (and of the compiled function) from ours, relative to max |returns|.",
        "",
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
