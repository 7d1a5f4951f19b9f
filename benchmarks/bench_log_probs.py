"""Benchmark: token log-probs from logits, and fused from hidden states + LM head.

Compares, side by side in one process,

- ``ours``: :func:`torchforge.token_log_probs` (chunked, own backward);
- (a) ``log_softmax+gather``: ``log_softmax(logits, dtype=float32).gather(tokens)``;
- (b) ``-cross_entropy``: ``-F.cross_entropy(logits, tokens, reduction="none")``
  (on ``logits.float()`` for bf16, since the result must be float32);
- (c) ``row-loop logsumexp``: the formulation of TRL's ``selective_log_softmax`` and
  verl's ``logprobs_from_logits``: ``logits.gather(tokens) - logsumexp`` with a Python
  loop over the B sequences (per-sequence ``log_softmax`` + gather for bf16 logits, as
  both libraries do);

and ``fused``: :func:`torchforge.fused_token_log_probs` against the LM-head matmul
``hidden @ weight.T`` followed by the fastest of (a), (b), (c) at the same setting;
``fused+softcap`` is the fused kernel with Gemma's head transform on (``softcap=30``).

Modes: ``fwd`` (no grad, as for old / reference log-probs) and ``fwd+bwd`` (backward of
``(log_probs * g).sum()`` for a random ``g``). Times are medians over interleaved
repeats (A B C A B C ...). Peak extra memory is measured with ``torch.profiler``
(``profile_memory=True``): the largest "Total Allocated" seen during one call, counted
from the start of the call, so inputs do not count and everything the call allocates
(outputs, saved tensors, gradients, temporaries) does. For the fused rows the gradients
of ``hidden`` and ``weight`` (which every method must return) are subtracted and shown
as a fraction of one [N, V] float32 logits tensor. On CUDA, ``torch.cuda.max_memory_allocated``.

One run measures the device's plan (``PLANS``): on CUDA, V = 32000 and 128256 at N = 8192;
on a CPU, V = 32000 at N = 8192 and V = 128256 at N = 2048 (the baselines at 8192 x 128256
need ~17 GB), then the fused kernel's memory alone at N = 8192, V = 128256. ``--tokens`` /
``--vocabs`` measure one setting instead.

Usage: ``python benchmarks/bench_log_probs.py [--quick] [--repeats R] [--hidden H] [--tokens N] [--vocabs V,...]``.
Writes ``benchmarks/results/log_probs.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchforge.log_probs import fused_token_log_probs, token_log_probs  # noqa: E402

MiB = 1 << 20


# ----------------------------------------------------------------------------------------
# The formulations
# ----------------------------------------------------------------------------------------

def ours(logits, tokens):
    return token_log_probs(logits, tokens)


def log_softmax_gather(logits, tokens):
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def neg_cross_entropy(logits, tokens):
    B, T, V = logits.shape
    x = logits if logits.dtype == torch.float32 else logits.float()
    return -F.cross_entropy(x.reshape(B * T, V), tokens.reshape(B * T), reduction="none").view(B, T)


def row_loop_logsumexp(logits, tokens):
    idx = tokens.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, idx).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    rows = [torch.log_softmax(row, dim=-1).gather(-1, i).squeeze(-1) for row, i in zip(logits, idx)]
    return torch.stack(rows).float()


BASELINES = {
    "(a) log_softmax+gather": log_softmax_gather,
    "(b) -cross_entropy": neg_cross_entropy,
    "(c) row-loop logsumexp": row_loop_logsumexp,
}


def make_logits_call(fn, logits, tokens, mode):
    g = torch.randn(tokens.shape, device=tokens.device)

    def call():
        if mode == "fwd":
            with torch.no_grad():
                fn(logits, tokens)
        else:
            logits.grad = None
            out = fn(logits, tokens)
            out.backward(g)
            logits.grad = None

    return call


# Gemma 2 / 3's head transform, for the "fused+softcap" rows: z' = 30 tanh(z / 30)
SOFTCAP = 30.0


def make_fused_call(kind, hidden, weight, tokens, mode, head_fn=None):
    g = torch.randn(tokens.shape, device=tokens.device)

    def forward():
        if kind == "fused":
            return fused_token_log_probs(hidden, weight, tokens)
        if kind == "fused+softcap":
            return fused_token_log_probs(hidden, weight, tokens, softcap=SOFTCAP)
        return head_fn(hidden @ weight.t(), tokens)

    def call():
        if mode == "fwd":
            with torch.no_grad():
                forward()
        else:
            hidden.grad = weight.grad = None
            forward().backward(g)
            hidden.grad = weight.grad = None

    return call


# ----------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_extra_bytes(call, device):
    """Largest memory allocated during ``call()`` beyond what was allocated before it."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        sync(device)
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max([0, *totals])


def time_interleaved(calls, repeats, device):
    """Median seconds of each call, the calls run interleaved (A B C A B C ...).

    Each call has already run once (the memory measurement), which is the warm-up.
    """
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            sync(device)
            start = time.perf_counter()
            call()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def machine_description(device):
    lines = []
    try:
        model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((l.split(":", 1)[1].strip() for l in model.splitlines() if l.startswith("Model name")), platform.processor())
    except OSError:
        model = platform.processor()
    lines.append(f"- CPU: {model}, {os.cpu_count()} cores, torch threads: {torch.get_num_threads()}")
    lines.append(f"- torch {torch.__version__}, Python {platform.python_version()}")
    if device.type == "cuda":
        lines.append(f"- GPU: {torch.cuda.get_device_name()}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------

# What one run measures on each device when neither --tokens nor --vocabs is given:
# (N, vocabs) settings, each against every baseline, and the vocabs whose fused kernel's
# memory is measured alone at N = 8192. On a CPU the baselines at N = 8192 x V = 128256 need
# ~17 GB (the [N, V] fp32 logits are 4.2 GB, and (a) / (b) make three more), more than a
# 24 GiB machine shared with other jobs gives: V = 128256 runs against them at N = 2048, and
# the fused kernel alone at N = 8192.
PLANS = {
    "cuda": ([(8192, (32000, 128256))], ()),
    "cpu": ([(8192, (32000,)), (2048, (128256,))], (128256,)),
}
MEMORY_TOKENS = 8192


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=1024, V=32000 only")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=64, help="H of the fused LM head (small: CPU matmuls are slow)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "log_probs.md"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None,
                        help="N of one setting (default: the device's plan, PLANS; 1024 with --quick)")
    parser.add_argument("--vocabs", default=None,
                        help="comma-separated V of one setting (default: the device's plan, PLANS)")
    parser.add_argument("--fused-memory-only", action="store_true",
                        help="only the fused kernel's peak memory (no baselines, which need 4x [N, V])")
    args = parser.parse_args()
    device = torch.device(args.device)
    vocabs = tuple(int(v) for v in args.vocabs.split(",")) if args.vocabs else None
    if args.quick:
        settings, memory_vocabs = [(args.tokens or 1024, vocabs or (32000,))], ()
    elif args.tokens or vocabs:
        settings, memory_vocabs = [(args.tokens or 8192, vocabs or (32000, 128256))], ()
    else:
        settings, memory_vocabs = PLANS[device.type]
    if args.fused_memory_only:
        settings, memory_vocabs = [], vocabs or (128256,)
    repeats = args.repeats or 3
    H = args.hidden
    command = " ".join(["python benchmarks/bench_log_probs.py", *sys.argv[1:]])
    header = ["## Token log-probs (`bench_log_probs.py`)", "", machine_description(device), "", f"Run: `{command}`.", ""]
    done = list(header)  # the sections measured so far
    for N, setting_vocabs in settings:
        # written after every (V, dtype, mode), so that a long run leaves its results so far
        for lines in measure_setting(device, N, setting_vocabs, H, repeats, args.quick):
            write_markdown(args.out, done + lines)
        done += lines
    if memory_vocabs:
        done += fused_memory_only(device, args.tokens or MEMORY_TOKENS, memory_vocabs, H)
        write_markdown(args.out, done)


def measure_setting(device, N, vocabs, H, repeats, quick):
    """Time and memory of ``token_log_probs`` and ``fused_token_log_probs`` against the
    baselines at N tokens for each V in ``vocabs``; yields the setting's markdown section
    after every (V, dtype, mode), the last one complete."""
    B = 8
    T = N // B
    dtypes = [torch.float32, torch.bfloat16]
    modes = ["fwd", "fwd+bwd"]

    rows = []  # (V, dtype, mode, name, ms, peak bytes)
    fused_rows = []
    for V in vocabs:
        logits_bytes_f32 = N * V * 4
        for dtype in dtypes:
            gen = torch.Generator(device="cpu").manual_seed(0)
            tokens = torch.randint(0, V, (B, T), generator=gen).to(device)
            logits = (3 * torch.randn(B, T, V, generator=gen)).to(device=device, dtype=dtype)
            for mode in modes:
                x = logits.requires_grad_(mode == "fwd+bwd")
                calls = {"ours": make_logits_call(ours, x, tokens, mode)}
                calls.update({name: make_logits_call(fn, x, tokens, mode) for name, fn in BASELINES.items()})
                peaks = {name: peak_extra_bytes(call, device) for name, call in calls.items()}
                med = time_interleaved(calls, repeats, device)
                for name, call in calls.items():
                    peak = peaks[name]
                    rows.append((V, dtype, mode, name, med[name] * 1e3, peak, logits.numel() * logits.element_size()))
                    print(f"V={V} {str(dtype)[6:]} {mode:8s} {name:24s} {med[name]*1e3:9.1f} ms  peak {peak/MiB:8.1f} MiB", flush=True)
                fastest = min(BASELINES, key=lambda n: med[n])

                # fused vs LM-head matmul + the fastest baseline at this setting
                hidden = (torch.randn(N, H, generator=gen) / H**0.5).to(device=device, dtype=dtype)
                weight = torch.randn(V, H, generator=gen).to(device=device, dtype=dtype)
                hidden = hidden.view(B, T, H).requires_grad_(mode == "fwd+bwd")
                weight.requires_grad_(mode == "fwd+bwd")
                fcalls = {
                    "fused": make_fused_call("fused", hidden, weight, tokens, mode),
                    "fused+softcap": make_fused_call("fused+softcap", hidden, weight, tokens, mode),
                    f"matmul + {fastest}": make_fused_call("head", hidden, weight, tokens, mode, BASELINES[fastest]),
                }
                fpeaks = {name: peak_extra_bytes(call, device) for name, call in fcalls.items()}
                fmed = time_interleaved(fcalls, repeats, device)
                grads = (hidden.numel() + weight.numel()) * hidden.element_size() if mode == "fwd+bwd" else 0
                for name, call in fcalls.items():
                    peak = fpeaks[name]
                    fused_rows.append((V, dtype, mode, name, fmed[name] * 1e3, peak - grads, logits_bytes_f32))
                    print(f"V={V} {str(dtype)[6:]} {mode:8s} {name:34s} {fmed[name]*1e3:9.1f} ms  "
                          f"peak-grads {(peak-grads)/MiB:8.1f} MiB", flush=True)
                del hidden, weight
                yield setting_section(rows, fused_rows, N, vocabs, H, repeats, quick)
            del logits


def fused_memory_only(device, N, vocabs, H):
    """Peak extra memory of fused_token_log_probs alone, where the baselines do not fit;
    returns its markdown section."""
    out = [f"### Fused alone at N = {N} (H = {H}): peak extra memory", "",
           "`fused+softcap`: with Gemma's head transform on (`softcap=30`). Target: under 0.1 of one [N, V] "
           "fp32 logits tensor.", "",
           "| V | dtype | mode | kernel | peak MiB (minus grads) | / [N,V] fp32 logits | [N,V] fp32 logits MiB |",
           "| --- | --- | --- | --- | ---: | ---: | ---: |"]
    for V in vocabs:
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator(device="cpu").manual_seed(0)
            tokens = torch.randint(0, V, (8, N // 8), generator=gen).to(device)
            for mode in ("fwd", "fwd+bwd"):
                for kind in ("fused", "fused+softcap"):
                    hidden = (torch.randn(8, N // 8, H, generator=gen) / H**0.5).to(device=device, dtype=dtype)
                    weight = torch.randn(V, H, generator=gen).to(device=device, dtype=dtype)
                    hidden.requires_grad_(mode == "fwd+bwd")
                    weight.requires_grad_(mode == "fwd+bwd")
                    peak = peak_extra_bytes(make_fused_call(kind, hidden, weight, tokens, mode), device)
                    grads = (hidden.numel() + weight.numel()) * hidden.element_size() if mode == "fwd+bwd" else 0
                    ref = N * V * 4
                    target = "met" if peak - grads < 0.1 * ref else "MISSED"
                    out.append(f"| {V} | {str(dtype)[6:]} | {mode} | {kind} | {(peak - grads) / MiB:.1f} | "
                               f"{(peak - grads) / ref:.3f} ({target}) | {ref / MiB:.0f} |")
                    print(out[-1], flush=True)
    return out + [""]


def setting_section(rows, fused_rows, N, vocabs, H, repeats, quick):
    """The markdown section of one (N, vocabs) setting."""
    out = [f"### N = {N}, V = {', '.join(map(str, vocabs))}", ""]
    out.append(
        f"N = {N} tokens (B=8 x T={N // 8}), logits ~ 3 * randn; median of {repeats} interleaved repeats"
        f"{' (--quick)' if quick else ''}. Peak = peak extra memory allocated during one call "
        "(torch.profiler memory events on CPU, `max_memory_allocated` on CUDA), inputs not counted."
    )
    out += ["", "#### From logits: `token_log_probs` vs (a), (b), (c)", ""]
    out.append("| V | dtype | mode | method | median ms | vs ours | peak MiB | peak / logits size |")
    out.append("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    ours_ms = {(V, d, m): ms for V, d, m, n, ms, _, _ in rows if n == "ours"}
    for V, dtype, mode, name, ms, peak, logits_bytes in rows:
        ratio = ms / ours_ms[(V, dtype, mode)]
        out.append(
            f"| {V} | {str(dtype)[6:]} | {mode} | {name} | {ms:.1f} | {ratio:.2f}x | {peak / MiB:.1f} | "
            f"{peak / logits_bytes:.2f} |"
        )
    out += ["", f"#### Fused from hidden states (H = {H}): `fused_token_log_probs` vs matmul + fastest of (a)-(c)", ""]
    out.append("Peak excludes the gradients of hidden and weight that every method returns; "
               "the last column divides it by one [N, V] float32 logits tensor.")
    out.append("")
    out.append("| V | dtype | mode | method | median ms | time / fused | peak MiB | peak / [N,V] fp32 |")
    out.append("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    fused_ms = {(V, d, m): ms for V, d, m, n, ms, _, _ in fused_rows if n == "fused"}
    for V, dtype, mode, name, ms, peak, ref_bytes in fused_rows:
        out.append(
            f"| {V} | {str(dtype)[6:]} | {mode} | {name} | {ms:.1f} | {ms / fused_ms[(V, dtype, mode)]:.2f}x | "
            f"{peak / MiB:.1f} | {peak / ref_bytes:.3f} |"
        )
    return out + ["", *targets_section(rows, fused_rows), ""]


def write_markdown(path, lines):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {path}", flush=True)


def targets_section(rows, fused_rows):
    """The issue's targets, checked against the measured numbers."""
    out = ["#### Targets", ""]
    ms = {(V, str(d)[6:], m, n): t for V, d, m, n, t, _, _ in rows}
    peak = {(V, str(d)[6:], m, n): (p, b) for V, d, m, n, _, p, b in rows}
    settings = sorted({(V, str(d)[6:]) for V, d, *_ in rows})
    for V, d in settings:
        if (V, d, "fwd", "ours") in ms:
            speedup = ms[(V, d, "fwd", "(a) log_softmax+gather")] / ms[(V, d, "fwd", "ours")]
            out.append(f"- V={V} {d}, forward (no grad) vs (a): {speedup:.2f}x faster (target >= 1.5x): "
                       f"{'met' if speedup >= 1.5 else 'MISSED'}")
        if (V, d, "fwd+bwd", "ours") in ms:
            fastest = min(BASELINES, key=lambda n: ms[(V, d, "fwd+bwd", n)])
            ratio = ms[(V, d, "fwd+bwd", "ours")] / ms[(V, d, "fwd+bwd", fastest)]
            p, b = peak[(V, d, "fwd+bwd", "ours")]
            out.append(f"- V={V} {d}, forward+backward: {ratio:.2f}x the time of the fastest baseline ({fastest}) "
                       f"(target <= 1.0): {'met' if ratio <= 1.0 else 'MISSED'}; peak {p / b:.2f}x the logits' "
                       f"size (target <= 1.1): {'met' if p <= 1.1 * b else 'MISSED'}")
    fms = {(V, str(d)[6:], m, n.split(" ")[0]): (t, p, b) for V, d, m, n, t, p, b in fused_rows}
    for (V, d, m, n), (t, p, b) in sorted(fms.items()):
        if n != "fused" or (V, d, m, "matmul") not in fms:
            continue
        ratio = t / fms[(V, d, m, "matmul")][0]
        line = f"- fused, V={V} {d} {m}: {ratio:.2f}x the time of matmul + fastest (target <= 1.2): " \
               f"{'met' if ratio <= 1.2 else 'MISSED'}; peak extra {p / b:.3f} of one [N, V] fp32 logits"
        if V == 128256:
            line += f" (target < 0.1): {'met' if p < 0.1 * b else 'MISSED'}"
        out.append(line)
    return out


if __name__ == "__main__":
    main()
