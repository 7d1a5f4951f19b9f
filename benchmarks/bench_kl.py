"""Benchmark exact_kl (chunked, recomputing backward) against the unchunked formulations.

Variants, side by side in one process (timings interleaved A B C A B C ...):

- ``exact_kl``: torchforge's chunked forward and backward.
- ``naive``: ``log_softmax`` of both, ``(p * (log_p - log_q)).sum(-1)``, autograd.
- ``kl_div``: ``F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)``.

For N positions x V vocabulary, float32 and bfloat16, forward only (no grad) and
forward+backward (gradient w.r.t. the policy logits). Reports median time, the ratio to
``exact_kl`` and the peak extra memory (RSS above the inputs, in a fresh subprocess per
variant on CPU, with glibc's mmap threshold fixed so that freed buffers leave the RSS;
``max_memory_allocated`` on CUDA) as a multiple of one [N, V] float32
tensor. Writes benchmarks/results/kl.md.

    python benchmarks/bench_kl.py            # N=2048, V in {32000, 128256}
    python benchmarks/bench_kl.py --quick    # N=1024, V=32000
    python benchmarks/bench_kl.py --before /tmp/kl_before.py   # also an earlier kl.py's exact_kl

``--before FILE`` times the ``exact_kl`` of an earlier commit's ``kl.py`` (``git show
<commit>:torchforge/kl.py > FILE``) in the same rotation, and adds a before / after table.

``--approx`` times the per-token sample estimator instead (time only, [B, T] = [256, 4096]
float32 log-probs, forward + backward of the masked mean, interleaved medians): torchforge's
``approx_kl`` k3 (default: continued along its tangent beyond ref / pi = 2; and exact,
``max_ratio=inf``), verl's ``low_var_kl`` (log-ratio clamped at +-20, value at +-10) and
TRL's k3, each a re-implementation of the published per-token formula. On a CPU, freed
buffers stay in the process for it (benchmarks/_allocator.py, as in bench_losses.py).
Writes benchmarks/results/kl_approx.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from _allocator import keep_freed_buffers
from _old_names import old_private_names

from torchforge.kl import approx_kl, exact_kl


def naive(logits, ref_logits):
    log_p = torch.log_softmax(logits.float(), -1)
    log_q = torch.log_softmax(ref_logits.float(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def kl_div(logits, ref_logits):
    log_p = torch.log_softmax(logits.float(), -1)
    log_q = torch.log_softmax(ref_logits.float(), -1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)


VARIANTS = {"exact_kl": exact_kl, "naive": naive, "kl_div": kl_div}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_before(path: str):
    """The ``exact_kl`` of an earlier commit, imported from a copy of its kl.py."""
    spec = importlib.util.spec_from_file_location("kl_before", path)
    module = importlib.util.module_from_spec(spec)
    with old_private_names():
        spec.loader.exec_module(module)
    return module.exact_kl




def _inputs(n, v, dtype, device, grad):
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(1, n, v, generator=g, device=device).to(dtype).requires_grad_(grad)
    ref_logits = torch.randn(1, n, v, generator=g, device=device).to(dtype)
    return logits, ref_logits


def _run(fn, logits, ref_logits, backward):
    if backward:
        out = fn(logits, ref_logits)
        out.sum().backward()
        logits.grad = None
    else:
        with torch.no_grad():
            fn(logits, ref_logits)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_variants(n, v, dtype, device, backward, repeats):
    logits, ref_logits = _inputs(n, v, dtype, device, backward)
    times = {name: [] for name in VARIANTS}
    for name, fn in VARIANTS.items():  # warm-up
        _run(fn, logits, ref_logits, backward)
    for _ in range(repeats):
        for name, fn in VARIANTS.items():  # interleaved: A B C A B C ...
            _sync(device)
            start = time.perf_counter()
            _run(fn, logits, ref_logits, backward)
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _peak_rss_bytes(reset=False):
    """Peak RSS of this process (VmHWM; ru_maxrss would include the parent's peak)."""
    if reset:
        try:  # Linux >= 4.0: reset the high-water mark to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def measure_memory_here(name, n, v, dtype, backward):
    """Peak RSS growth of one call, in this (fresh) process; printed for the parent."""
    logits, ref_logits = _inputs(n, v, DTYPES[dtype], "cpu", backward)
    _run(VARIANTS[name], logits[:, :8], ref_logits[:, :8], backward)  # load kernels
    base = _peak_rss_bytes(reset=True)
    _run(VARIANTS[name], logits, ref_logits, backward)
    print(_peak_rss_bytes() - base)


def peak_memory(name, n, v, dtype, backward, device, before=None):
    if device == "cuda":
        logits, ref_logits = _inputs(n, v, DTYPES[dtype], device, backward)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _run(VARIANTS[name], logits, ref_logits, backward)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    cmd = [sys.executable, __file__, "--memory-child", name, str(n), str(v), dtype, str(int(backward))]
    if before:
        cmd += ["--before", before]
    # A fixed mmap threshold makes glibc return every freed large buffer to the OS, so
    # the RSS high-water mark follows the live tensors instead of the allocator's cache.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return int(out.stdout.strip().splitlines()[-1])


def _verl_low_var_kl(lp, ref):
    kl = torch.clamp(ref - lp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def _trl_k3(lp, ref):
    return torch.exp(ref - lp) - (ref - lp) - 1


APPROX = {
    "approx_kl k3": lambda lp, ref: approx_kl(lp, ref),
    "approx_kl k3, max_ratio=inf": lambda lp, ref: approx_kl(lp, ref, max_ratio=math.inf),
    "verl low_var_kl": _verl_low_var_kl,
    "TRL k3": _trl_k3,
}


def approx_section(repeats: int, device: str, steady: bool) -> list[str]:
    """Time the per-token KL estimators, forward + backward of the masked mean."""
    B, T = 256, 4096
    g = torch.Generator().manual_seed(0)
    ref = (-torch.rand(B, T, generator=g) * 3).to(device)
    lp0 = (ref + 0.3 * torch.randn(B, T, generator=g).to(device))
    maskf = (torch.rand(B, T, generator=g) < 0.6).float().to(device)
    times = {name: [] for name in APPROX}

    def once(fn):
        lp = lp0.clone().requires_grad_()
        _sync(device)
        start = time.perf_counter()
        ((fn(lp, ref) * maskf).sum() / maskf.sum()).backward()
        _sync(device)
        return time.perf_counter() - start
    for fn in APPROX.values():  # warm-up
        once(fn)
    for _ in range(repeats):
        for name, fn in APPROX.items():  # interleaved
            times[name].append(once(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    lines = [
        "## approx_kl: per-token KL estimators (benchmarks/bench_kl.py --approx)",
        "",
        (f"Device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}. [B, T] = [{B}, {T}] "
         f"float32, forward + backward of the masked mean; median of {repeats} interleaved runs; "
         "time only (the variants differ in value where ref / pi > 2, by design)"
         + ("; freed buffers kept in the process (benchmarks/_allocator.py)." if steady else ".")),
        "",
        "| estimator | median ms | x approx_kl k3 |",
        "| --- | ---: | ---: |",
    ]
    for name, t in med.items():
        lines.append(f"| {name} | {1e3 * t:.2f} | {t / med['approx_kl k3']:.2f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--approx", action="store_true",
                        help="time approx_kl against verl's and TRL's per-token k3 instead")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="N=1024, V=32000, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--before", default=None, metavar="FILE",
                        help="an earlier commit's kl.py: time its exact_kl beside this one's")
    parser.add_argument("--memory-child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.before:
        VARIANTS["before"] = load_before(args.before)
    if args.memory_child:
        name, n, v, dtype, backward = args.memory_child
        measure_memory_here(name, int(n), int(v), dtype, bool(int(backward)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.approx:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        steady = device == "cpu" and keep_freed_buffers()
        lines = approx_section(args.repeats or 21, device, steady)
        print("\n".join(lines))
        path = os.path.join(os.path.dirname(__file__), "results", "kl_approx.md")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {path}")
        return

    n = 1024 if args.quick else 2048
    vocabs = [32000] if args.quick else [32000, 128256]
    repeats = args.repeats or (3 if args.quick else 5)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    cpu = platform.processor() or "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [
        "## exact_kl (benchmarks/bench_kl.py)",
        "",
        f"Machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
        + (f", CUDA: {torch.cuda.get_device_name()}" if "cuda" in devices else "")
        + f". N = {n} positions, median of {repeats} interleaved runs. Memory: peak extra"
        " bytes of one call (RSS growth in a fresh process on CPU), as a multiple of one"
        " [N, V] float32 tensor (the gradient buffer included for fwd+bwd).",
        "",
        "| device | V | dtype | pass | exact_kl ms | naive ms | kl_div ms | naive / exact_kl | kl_div / exact_kl | exact_kl mem | naive mem | kl_div mem |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    before_rows = []
    for device in devices:
        for v in vocabs:
            for dtype in DTYPES:
                for backward in (False, True):
                    t = time_variants(n, v, DTYPES[dtype], device, backward, repeats)
                    unit = n * v * 4
                    mem = {name: peak_memory(name, n, v, dtype, backward, device, args.before) / unit
                           for name in VARIANTS}
                    row = (
                        f"| {device} | {v} | {dtype} | {'fwd+bwd' if backward else 'fwd'} | "
                        f"{1e3 * t['exact_kl']:.1f} | {1e3 * t['naive']:.1f} | {1e3 * t['kl_div']:.1f} | "
                        f"{t['naive'] / t['exact_kl']:.2f} | {t['kl_div'] / t['exact_kl']:.2f} | "
                        f"{mem['exact_kl']:.2f} | {mem['naive']:.2f} | {mem['kl_div']:.2f} |"
                    )
                    print(row, flush=True)
                    lines.append(row)
                    if args.before:
                        before_rows.append(
                            f"| {device} | {v} | {dtype} | {'fwd+bwd' if backward else 'fwd'} | "
                            f"{1e3 * t['before']:.1f} | {1e3 * t['exact_kl']:.1f} | "
                            f"{t['exact_kl'] / t['before']:.2f} | {mem['before']:.2f} | {mem['exact_kl']:.2f} |"
                        )
    if args.before:
        lines += [
            "",
            f"### Before / after (the same rotation; before = `{os.path.basename(args.before)}`)",
            "",
            "| device | V | dtype | pass | before ms | exact_kl ms | after / before | before mem | exact_kl mem |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *before_rows,
        ]
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results", "kl.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
