"""Regenerate benchmarks/RESULTS.md from benchmarks/results/*.md.

RESULTS.md = a generated header (what each benchmark measures, how to run them all, the
machine each section ran on), the hand-written summary (kept from the current RESULTS.md:
the text between the ``<!-- summary -->`` and ``<!-- /summary -->`` markers), then every
``benchmarks/results/*.md`` verbatim, in the order below (unknown files last, by name).

Run after any benchmark run:

    python benchmarks/collect_results.py

The summary's numbers are not parsed from the results: update them by hand in
RESULTS.md when a result changes (this script keeps whatever is between the markers).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name of the results file (without .md) -> (the script and the arguments that write it, as
# run_all.py runs it; what it measures; how the recorded figures were run)
BENCHMARKS = {
    "log_probs": ("bench_log_probs.py",
                  "token log-probs from logits (`token_log_probs`) and fused from hidden states + LM head "
                  "(`fused_token_log_probs`) against log_softmax+gather, -cross_entropy and a per-row "
                  "logsumexp loop: time and peak memory, fp32 / bf16, forward and forward+backward",
                  "python benchmarks/bench_log_probs.py"),
    "kl": ("bench_kl.py",
           "`exact_kl` (chunked, recomputing backward) against the unchunked formula and `F.kl_div`: "
           "time and peak memory; before / after",
           "git show <commit before the change>:torchforge/kl.py > /tmp/kl_before.py; "
           "python benchmarks/bench_kl.py --before /tmp/kl_before.py"),
    "kl_approx": ("bench_kl.py --approx",
                  "the per-token sample estimator `approx_kl` (k3, bounded and exact) against verl's "
                  "`low_var_kl` and TRL's k3: forward + backward time",
                  "python benchmarks/bench_kl.py --approx --threads 1"),
    "advantages": ("bench_advantages.py",
                   "`gae` and `group_advantages` against verl's, TorchRL's and TRL's formulations; "
                   "`passk_advantages`, `opo_advantages`, `remax_advantages`, GDPO against their loop "
                   "or peer forms; `group_ids` against contiguous `group_size`; before / after",
                   "git show <commit before the change>:torchforge/advantages.py > /tmp/advantages_before.py; "
                   "python benchmarks/bench_advantages.py --threads 1 --before /tmp/advantages_before.py"),
    "losses": ("bench_losses.py --kernels",
               "`ppo_loss` / `grpo_loss` forward + backward against a minimal formula and TRL / verl / "
               "TorchRL-style losses, eager and compiled, before / after; the newer losses against their "
               "naive form; bytes saved for backward",
               "python benchmarks/bench_losses.py --threads 1 --kernels --before NAME=DIR  "
               "# DIR holds old_losses.py and the old_<module>.py it imports (old_kl, old_ratios), from git show <commit>"),
    "distributed": ("bench_distributed.py",
                    "one training step on 1 process vs 2 processes (FSDP2, DDP): step time and memory per rank",
                    "python benchmarks/bench_distributed.py"),
    "loop": ("bench_loop.py",
             "one GRPO step of `RLTrainer` against a hand-written torch + transformers loop and TRL's "
             "`GRPOTrainer`: step time, peak memory, where the time goes",
             "python benchmarks/bench_loop.py --profile  "
             "# with the python of an environment that has TRL for the TRL rows (see its docstring)"),
    "loop_multi_turn": ("bench_loop.py --multi-turn",
                        "`rollout_episodes` (K turns per episode) against a single-turn rollout of the same "
                        "samples: the loop step's overhead",
                        "python benchmarks/bench_loop.py --multi-turn"),
    "loop_async": ("bench_loop.py --async",
                   "the same GRPO run synchronous against `async_generation` at `max_staleness` 1 and 2 (a "
                   "generator thread, or the `hf-process` engine), generator and trainer on one thread each: "
                   "ms per step, who waits; the demo's reward at staleness 1 for each way to correct stale samples",
                   "python benchmarks/bench_loop.py --async --async-setting medium --async-steps 24 "
                   "--async-repeats 3 --curve-steps 200 --curve-seeds 3"),
    "lora": ("bench_lora.py",
             "a GRPO step with a KL penalty, full fine-tuning (reference = a deep copy) against LoRA "
             "(reference = the policy with its adapters disabled): weights, gradients, AdamW state, peak memory",
             "python benchmarks/bench_lora.py"),
    "packing": ("bench_packing.py",
                "a GRPO step (log-probs forward + backward, the loss) on a ~100M-parameter Llama, padded "
                "against padding-free (packed sequences): time, tokens / s, peak memory, over length spreads",
                "python benchmarks/bench_packing.py"),
    "rollout": ("bench_rollout.py",
                "generation engines side by side (HF `generate` with the seeded sampler, plain `generate`, vLLM "
                "in process, vLLM as a server): tokens per second and weight-sync time at ~0.1M and 106M "
                "parameters; one GRPO step of `RLTrainer` with each engine",
                "python benchmarks/bench_rollout.py  # in the vLLM environment (README, Generation engines); "
                "on a GPU: bash benchmarks/gpu_rollout.sh"),
}

START, END = "<!-- summary -->", "<!-- /summary -->"
PLACEHOLDER = f"{START}\n## Summary\n\n(write the headline ratios against their targets here)\n{END}"

_NAME_PATTERNS = (
    re.compile(r"Machine:\s*([^,\n]+)"),
    re.compile(r"CPU:\s*([^,\n]+)"),
    re.compile(r"device \w+ \((.+?)\),"),
)


def machine_of(text: str) -> str:
    """The machine a results file names: its processor (first 'Machine:', 'CPU:' or
    'device x (...)'), its core count, and the device when it is not the CPU."""
    name = next((m.group(1).strip() for p in _NAME_PATTERNS if (m := p.search(text))), None)
    if name is None:
        return "see its section"
    cores = re.search(r"(\d+) cores", text)
    device = "cuda" if re.search(r"device cuda|\| cuda \|", text) else None
    return ", ".join(x for x in (name, f"{cores.group(1)} cores" if cores else None, device) if x)


def ordered_results(results_dir: Path) -> list[Path]:
    files = {p.stem: p for p in results_dir.glob("*.md")}
    known = [files.pop(name) for name in BENCHMARKS if name in files]
    return known + [files[name] for name in sorted(files)]


def summary_of(path: Path) -> str:
    if path.exists():
        text = path.read_text()
        start, end = text.find(START), text.find(END)
        if start != -1 and end > start:
            return text[start:end + len(END)]
    return PLACEHOLDER


def build(results_dir: Path, out: Path) -> str:
    files = ordered_results(results_dir)
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/collect_results.py` from `benchmarks/results/*.md` (each written "
        "by its benchmark script); the summary is written by hand. Every benchmark compares torchforge "
        "with the naive formulation and the ones other libraries use, side by side in one process, and "
        "reports medians, ratios and peak memory; on CUDA when present.",
        "",
        "| results | script | what it measures | machine it ran on |",
        "| --- | --- | --- | --- |",
    ]
    for path in files:
        script, what, _ = BENCHMARKS.get(path.stem, ("-", "-", None))
        lines.append(f"| [{path.stem}](#{path.stem}) | `{script}` | {what} | {machine_of(path.read_text())} |")
    lines += ["", "Run them all (each writes its `benchmarks/results/*.md`), then regenerate this page:", "", "```"]
    for path in files:
        run = BENCHMARKS.get(path.stem, (None, None, None))[2]
        if run:
            lines += [command.strip() for command in run.split("; ")]
    lines += ["python benchmarks/collect_results.py", "```", "",
              "`python benchmarks/run_all.py` runs the `script` column's invocations, each once with its "
              "defaults, on the best device present, then regenerates this page (`--only NAME ...` for some).", "",
              "`--quick` on any script is a smoke run (small shapes, few repeats); some scripts write their "
              "results file even then, so run the full commands before regenerating this page.", "",
              summary_of(out), ""]
    for path in files:
        lines += ["---", "", f'<a id="{path.stem}"></a>', "", path.read_text().rstrip(), ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    out = Path(args.out)
    text = build(Path(args.results), out)
    out.write_text(text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
