"""Regenerate benchmarks/RESULTS.md from benchmarks/results/*.md.

RESULTS.md is generated whole; do not edit it by hand (a test compares it with this
script's output). It holds:

- a header: what the page is, how to regenerate it, the machines the results ran on;
- a one-paragraph summary: ``SUMMARY`` below (hand-written, no figures in it) and a
  generated sentence on the targets met and missed;
- one table of headline figures, one row per figure: ``FIGURES`` below says, per
  benchmark, which figures are headline ones and where each is read from its results file
  (a cell of a markdown table its script writes, or a line the script writes), the
  comparison it is against and its target, if any. A figure that is not found is an error
  naming the file and the figure, so a benchmark whose output changes fails loudly here;
- an index of the benchmarks (script, what it measures, machine, its full results and its
  notes) and the commands that run them all.

Every ``bench_*.py`` rewrites its results file whole, so history and explanations of a
result (earlier runs, before / after a change, why a target is missed) live in
``benchmarks/notes/<name>.md``, which the index links.

Run after any benchmark run:

    python benchmarks/collect_results.py
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name of the results file (without .md) -> (the script and the arguments that write it, as
# run_all.py runs it; what it measures; how the recorded figures were run)
BENCHMARKS = {
    "log_probs": ("bench_log_probs.py",
                  "`token_log_probs` from logits and `fused_token_log_probs` from hidden states + LM head "
                  "against log_softmax+gather, -cross_entropy and a per-row loop: time, peak memory",
                  "python benchmarks/bench_log_probs.py"),
    "kl": ("bench_kl.py",
           "`exact_kl` (chunked, recomputing backward) against the unchunked formula and `F.kl_div`: "
           "time and peak memory",
           "git show <commit before the change>:torchforge/kl.py > /tmp/kl_before.py; "
           "python benchmarks/bench_kl.py --before /tmp/kl_before.py"),
    "kl_approx": ("bench_kl.py --approx",
                  "the per-token estimator `approx_kl` (k3, bounded and exact) against verl's `low_var_kl` "
                  "and TRL's k3: forward + backward time",
                  "python benchmarks/bench_kl.py --approx --threads 1"),
    "advantages": ("bench_advantages.py",
                   "`gae`, `group_advantages` and the newer estimators against verl's, TorchRL's and TRL's "
                   "formulations or their loop form; `group_ids` against contiguous groups",
                   "git show <commit before the change>:torchforge/advantages.py > /tmp/advantages_before.py; "
                   "python benchmarks/bench_advantages.py --threads 1 --before /tmp/advantages_before.py"),
    "losses": ("bench_losses.py --kernels",
               "`ppo_loss`, `grpo_loss` and the newer losses, forward + backward, eager and compiled, against "
               "a minimal formula and TRL / verl / TorchRL-style losses; bytes saved for backward",
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
                        "length: the loop's overhead",
                        "python benchmarks/bench_loop.py --multi-turn"),
    "loop_async": ("bench_loop.py --async",
                   "the same GRPO run synchronous and with `async_generation` (a generator thread or the "
                   "`hf-process` engine): ms per step, who waits; the demo's reward per staleness correction",
                   "python benchmarks/bench_loop.py --async --async-setting medium --async-steps 24 "
                   "--async-repeats 3 --curve-steps 200 --curve-seeds 3"),
    "lora": ("bench_lora.py",
             "a GRPO step with a KL penalty, full fine-tuning against LoRA (reference = the policy with its "
             "adapters disabled): state held, peak memory, checkpoint size",
             "python benchmarks/bench_lora.py"),
    "packing": ("bench_packing.py",
                "a GRPO step on a ~100M-parameter Llama, padded against padding-free (packed sequences): "
                "time, tokens / s, peak memory, over length spreads",
                "python benchmarks/bench_packing.py"),
    "rollout_profile": ("bench_rollout.py --profile",
                        "where the time of one `RLTrainer` GRPO step on the demo goes, per engine: sampling, "
                        "scoring, recomputed log-probs, the update, metrics, weight sync, other",
                        "python benchmarks/bench_rollout.py --profile --threads 1 --steps 8  "
                        "# in the vLLM environment for the vLLM columns"),
    "rollout_profile_100m": ("bench_rollout.py --profile --profile-model 100m",
                             "the same step profile on the 106M Llama (2 prompts x 8, 16 tokens), `hf` and vLLM "
                             "in process",
                             "python benchmarks/bench_rollout.py --profile --profile-model 100m --engines hf,vllm "
                             "--steps 3 --threads 2  # in the vLLM environment"),
    "compat": ("bench_compat.py",
               "`torchforge.compat`'s twins against verl 0.9.1's and TRL 1.16's own functions, same inputs: "
               "forward + backward time",
               "python benchmarks/bench_compat.py --threads 1  # in an environment with verl and trl (the compat extra)"),
    "weight_sync": ("bench_rollout.py --part sync",
                    "`update_weights` with a model's full weights per engine against the memory floor "
                    "(one batched copy of the same bytes)",
                    "python benchmarks/bench_rollout.py --part sync --threads 1 --repeats 7  "
                    "# in the vLLM environment for the vLLM rows"),
    "rollout": ("bench_rollout.py",
                "generation engines side by side (HF `generate`, seeded or plain, vLLM in process or as a "
                "server): tokens / s and weight-sync time; one GRPO step of `RLTrainer` with each",
                "python benchmarks/bench_rollout.py  # in the vLLM environment (README, Generation engines), "
                "or on a GPU: bash benchmarks/gpu_rollout.sh"),
}

# The summary's hand-written part: one plain paragraph, no figures (they are in the table,
# read from the results files) and no history (that is in benchmarks/notes/).
SUMMARY = (
    "Each benchmark runs torchforge side by side with the naive formula and with the formulations "
    "verl, TRL and TorchRL use, in one process, and reports medians, ratios and peak memory. On the "
    "CPU the log-prob kernels, the exact KL, the advantage estimators and the eager losses match or "
    "beat those formulations, with a fraction of their peak memory where they materialize [N, V] "
    "tensors; an `RLTrainer` step costs a few percent over a hand-written loop and less than TRL's "
    "`GRPOTrainer`; padding-free training raises throughput and lowers peak memory when completion "
    "lengths vary; LoRA shrinks the state a step holds and the checkpoint; the `torchforge.compat` "
    "twins take no longer than verl's and TRL's own functions. The bounded k3 of "
    "`approx_kl` costs more than TRL's unbounded one, the compiled losses stay well above a compiled "
    "minimal formula (inductor's CPU code loads a bool mask one byte at a time), and vLLM and "
    "asynchronous generation do not reach their speed-up targets on a CPU."
)

MAX_CELL = 200  # characters in a table cell of RESULTS.md
MAX_LINE = 400  # characters in a line of RESULTS.md


class FigureNotFound(LookupError):
    """A headline figure is missing from its results file (its format changed, or a row is gone)."""


# --- reading a results file ---------------------------------------------------------------------

@dataclass
class Heading:
    level: int
    text: str
    line: int
    anchor: str


@dataclass
class Table:
    line: int
    header: list[str]
    rows: list[dict[str, str]]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def github_anchor(text: str, seen: dict[str, int]) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens, and a
    ``-1``, ``-2`` ... suffix for a repeated one."""
    slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return f"{slug}-{count}" if count else slug


class ResultsFile:
    """The headings and markdown tables of one ``benchmarks/results/*.md``."""

    def __init__(self, path: Path):
        self.path = path
        self.name = path.stem
        self.lines = path.read_text().splitlines()
        self.headings: list[Heading] = []
        self.tables: list[Table] = []
        seen: dict[str, int] = {}
        fence = False
        i = 0
        while i < len(self.lines):
            line = self.lines[i]
            if line.startswith("```"):
                fence = not fence
            elif not fence and (m := re.match(r"(#{1,6}) (.+)", line)):
                text = m.group(2).strip()
                self.headings.append(Heading(len(m.group(1)), text, i, github_anchor(text, seen)))
            elif (not fence and line.startswith("|") and i + 1 < len(self.lines)
                  and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", self.lines[i + 1].strip())):
                header = _cells(line)
                # a repeated column name gets '#2', '#3' ... ('x padded' for time, then for memory)
                names = []
                for h in header:
                    names.append(h if h not in names else f"{h}#{sum(n.split('#')[0] == h for n in names) + 1}")
                rows, j = [], i + 2
                while j < len(self.lines) and self.lines[j].startswith("|"):
                    rows.append(dict(zip(names, _cells(self.lines[j]))))
                    j += 1
                self.tables.append(Table(i, names, rows))
                i = j
                continue
            i += 1

    def section(self, *titles: str) -> Section:
        """The part of the file under the headings that start with ``titles`` (each searched
        after the previous one; none: the whole file)."""
        start, end, heading = 0, len(self.lines), None
        for title in titles:
            found = next((h for h in self.headings if start <= h.line < end and h.text.startswith(title)), None)
            if found is None:
                raise FigureNotFound(f"no heading starting with {title!r}")
            heading = found
            start = found.line
            end = next((h.line for h in self.headings if h.line > found.line and h.level <= found.level),
                       len(self.lines))
        return Section(self, start, end, heading)


def _number(text: str) -> float:
    m = re.search(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", text)
    if m is None:
        raise FigureNotFound(f"no number in {text!r}")
    return float(m.group(0).replace(",", ""))


def _matches(cell: str | None, want: str) -> bool:
    if cell is None:
        return False
    cell = cell.replace("`", "")
    return cell.startswith(want[:-1]) if want.endswith("*") else cell == want


@dataclass
class Section:
    file: ResultsFile
    start: int
    end: int
    heading: Heading | None
    columns: tuple[str, ...] = ()

    def having(self, *columns: str) -> Section:
        """The same section, its tables narrowed to those with every one of ``columns``."""
        return Section(self.file, self.start, self.end, self.heading, self.columns + columns)

    def rows(self, where: dict[str, str], column: str) -> list[dict[str, str]]:
        """The rows of the section's tables that have ``column`` and every cell of ``where``
        (a value ending in '*' matches a prefix; backticks are ignored)."""
        return [row for t in self.file.tables
                if self.start <= t.line < self.end and all(c in t.header for c in (column, *self.columns))
                for row in t.rows if all(_matches(row.get(k), v) for k, v in where.items())]

    def cell(self, column: str, **where: str) -> str:
        rows = self.rows(where, column)
        if len(rows) != 1:
            described = ", ".join(f"{k}={v}" for k, v in where.items())
            raise FigureNotFound(f"{len(rows)} rows with {described} and a column {column!r} (expected 1)")
        return rows[0][column]

    def num(self, column: str, **where: str) -> float:
        """The number in the one cell of ``column`` in the row ``where``."""
        return _number(self.cell(column, **where))

    def match(self, pattern: str) -> str:
        """Group 1 of the first line of the section that matches ``pattern``."""
        for line in self.file.lines[self.start:self.end]:
            if m := re.search(pattern, line):
                return m.group(1)
        raise FigureNotFound(f"no line matching {pattern!r}")


# --- the headline figures -----------------------------------------------------------------------

@dataclass(frozen=True)
class Figure:
    """One row of RESULTS.md's table: ``value`` reads the number from the section ``section``
    of ``results/<bench>.md``; ``fmt`` writes it; ``against`` is the comparison (text, or read
    from the same section); ``target`` is (operator, bound, as written) when there is one."""

    bench: str
    figure: str
    section: tuple[str, ...]
    value: Callable[[Section], float]
    fmt: str
    against: str | Callable[[Section], str]
    target: tuple[str, float, str] | None = None


_OPS = {">=": float.__ge__, "<=": float.__le__, "<": float.__lt__, ">": float.__gt__}


def _fastest(s: Section, column: str, names: list[str], **where: str) -> tuple[float, str]:
    """The smallest of ``column`` over the rows named ``names`` (in the column 'method'), and its name."""
    return min((s.num(column, method=n, **where), n) for n in names)


_SHORT = {"float32": "fp32", "bfloat16": "bf16"}
_LP_BASELINES = ["(a) log_softmax+gather", "(b) -cross_entropy", "(c) row-loop logsumexp"]


def _lp_fwd_bwd(dtype: str) -> Figure:
    where = {"V": "128256", "dtype": dtype, "mode": "fwd+bwd"}
    return Figure(
        "log_probs", f"`token_log_probs` {_SHORT[dtype]} forward+backward, N=2048, V=128256, time",
        ("N = 2048, V = 128256", "From logits"),
        lambda s: s.num("median ms", method="ours", **where) / _fastest(s, "median ms", _LP_BASELINES, **where)[0],
        "{:.2f}x the time",
        lambda s: "the fastest baseline, " + _fastest(s, "median ms", _LP_BASELINES, **where)[1],
        ("<=", 1.0, "<= 1.0x"))


def _lp_fwd(dtype: str, V: str, N: str) -> Figure:
    return Figure(
        "log_probs", f"`token_log_probs` {_SHORT[dtype]} forward, N={N}, V={V}", (f"N = {N}, V = {V}", "From logits"),
        lambda s: s.num("vs ours", V=V, dtype=dtype, mode="fwd", method="(a) log_softmax+gather"),
        "{:.2f}x faster", "log_softmax + gather", (">=", 1.5, ">= 1.5x"))


_LOSS = {"loss": "ppo_loss"}
_KL = {"device": "cpu", "V": "128256", "dtype": "float32", "pass": "fwd+bwd"}
FIGURES: list[Figure] = [
    _lp_fwd("float32", "32000", "8192"),
    _lp_fwd("bfloat16", "32000", "8192"),
    _lp_fwd("float32", "128256", "2048"),
    _lp_fwd("bfloat16", "128256", "2048"),
    _lp_fwd_bwd("float32"),
    _lp_fwd_bwd("bfloat16"),
    Figure("log_probs", "`token_log_probs` bf16 forward+backward, N=2048, V=128256, peak extra memory",
           ("N = 2048, V = 128256", "From logits"),
           lambda s: s.num("peak / logits size", V="128256", dtype="bfloat16", mode="fwd+bwd", method="ours"),
           "{:.2f}x the logits' size",
           lambda s: "log_softmax + gather: {:.2f}x".format(s.num(
               "peak / logits size", V="128256", dtype="bfloat16", mode="fwd+bwd", method="(a) log_softmax+gather")),
           ("<=", 1.1, "<= 1.1x")),
    Figure("log_probs", "`fused_token_log_probs` bf16 forward+backward, N=2048, V=128256, time",
           ("N = 2048, V = 128256", "Fused from hidden states"),
           lambda s: (s.num("median ms", V="128256", dtype="bfloat16", mode="fwd+bwd", method="fused")
                      / s.num("median ms", V="128256", dtype="bfloat16", mode="fwd+bwd", method="matmul + *")),
           "{:.2f}x the time",
           lambda s: s.cell("method", V="128256", dtype="bfloat16", mode="fwd+bwd", method="matmul + *"),
           ("<=", 1.2, "<= 1.2x")),
    Figure("log_probs", "`fused_token_log_probs` bf16 forward+backward with soft cap, N=8192, V=128256, "
           "peak extra memory", ("Fused alone at N = 8192",),
           lambda s: s.num("/ [N,V] fp32 logits", V="128256", dtype="bfloat16", mode="fwd+bwd",
                           kernel="fused+softcap"),
           "{:.1%} of the [N, V] fp32 logits", "one [N, V] fp32 logits tensor", ("<", 0.1, "< 10%")),

    Figure("kl", "`exact_kl` fp32 forward+backward, N=2048, V=128256", (),
           lambda s: s.num("naive / exact_kl", **_KL),
           "{:.2f}x faster", "the unchunked formula"),
    Figure("kl", "`exact_kl` fp32 forward+backward, N=2048, V=128256", (),
           lambda s: s.num("kl_div / exact_kl", **_KL),
           "{:.2f}x faster", "`F.kl_div`"),
    Figure("kl", "`exact_kl` fp32 forward+backward, N=2048, V=128256, peak extra memory", (),
           lambda s: s.having("naive mem").num("exact_kl mem", **_KL),
           "{:.2f}x one [N, V] fp32 tensor",
           lambda s: "the unchunked formula: {:.2f}x".format(
               s.num("naive mem", **_KL))),

    Figure("kl_approx", "`approx_kl` k3 (bounded, the default) forward+backward, [256, 4096], time", (),
           lambda s: s.num("median ms", estimator="approx_kl k3") / s.num("median ms", estimator="TRL k3"),
           "{:.2f}x the time", "TRL's k3 (unbounded)"),
    Figure("kl_approx", "`approx_kl` k3, `max_ratio=inf`, forward+backward, [256, 4096], time", (),
           lambda s: (s.num("median ms", estimator="approx_kl k3, max_ratio=inf")
                      / s.num("median ms", estimator="TRL k3")),
           "{:.2f}x the time", "TRL's k3"),

    *(Figure("advantages", "`gae` B=512, T=1024", ("gae",),
             lambda s, c=column: s.num(c, B="512", T="1024"), "{:.1f}x faster", peer)
      for column, peer in (("loop / ours", "verl's loop"), ("TorchRL loop / ours", "TorchRL's loop"),
                           ("TorchRL vec / ours", "TorchRL's vectorized form"))),
    Figure("advantages", "`gae` B=512, T=4096, with tool tokens", ("gae at B=512",),
           lambda s: s.num("peer / ours", mask="right padding + ~10% tool tokens"), "{:.1f}x faster",
           lambda s: "verl (ours / memory floor: {:.1f}x; right-padded: {:.1f}x verl, {:.1f}x the floor)".format(
               s.num("ours / floor", mask="right padding + ~10% tool tokens"),
               s.num("peer / ours", mask="right padding"), s.num("ours / floor", mask="right padding")),
           (">=", 10.0, ">= 10x")),
    Figure("advantages", "`group_advantages` B=65536, G=8", ("group_advantages",),
           lambda s: s.num("TRL / ours", G="8"), "{:.1f}x faster", "TRL's"),
    Figure("advantages", "GDPO: `group_advantages` on [B, 3] rewards, B=4096, G=8, time", ("New estimators",),
           lambda s: (s.num("torchforge ms", estimator="group_advantages [B, K=3] (GDPO)")
                      / s.num("peer ms", estimator="group_advantages [B, K=3] (GDPO)")),
           "{:.2f}x the time", "TRL's `normalize_then_sum`"),
    Figure("advantages", "`group_ids` (rows shuffled), B=65536, G=8: the slowest of 5 estimators, time",
           ("group_ids against",),
           lambda s: max(_number(r["ratio"]) for r in s.rows({}, "group_ids in [0, B) ms")),
           "{:.2f}x the time",
           lambda s: "contiguous `group_size` (slowest: {})".format(max(
               (_number(r["ratio"]), r["estimator"]) for r in s.rows({}, "group_ids in [0, B) ms"))[1]),
           ("<=", 2.0, "<= 2x")),

    Figure("losses", "`ppo_loss` fwd+bwd, eager, all metrics, [256, 4096], time", (),
           lambda s: s.num("x minimal / naive", variant="torchforge", mode="eager", **_LOSS), "{:.2f}x the time",
           "minimal formula (loss only, float mask)", ("<=", 1.3, "<= 1.3x")),
    *(Figure("losses", "`ppo_loss` fwd+bwd, eager, all metrics, [256, 4096]", (),
             lambda s, v=variant: s.num("x torchforge", variant=v, mode="eager", **_LOSS), "{:.2f}x faster",
             f"{peer} loss", target)
      for variant, peer, target in (("trl-style", "TRL-style", (">=", 1.0, ">= 1.0x")),
                                    ("verl-style", "verl-style", (">", 1.0, "> 1x")),
                                    ("torchrl-style", "TorchRL-style", (">", 1.0, "> 1x")))),
    Figure("losses", "`grpo_loss` fwd+bwd, eager, all metrics, [256, 4096], time", (),
           lambda s: s.num("x minimal / naive", loss="grpo_loss", variant="torchforge", mode="eager"),
           "{:.2f}x the time", "minimal formula (loss only, float mask)", ("<=", 1.3, "<= 1.3x")),
    Figure("losses", "`grpo_loss` fwd+bwd, eager, all metrics, [256, 4096]", (),
           lambda s: s.num("x torchforge", loss="grpo_loss", variant="trl-style", mode="eager"), "{:.2f}x faster",
           "TRL-style loss", (">=", 1.0, ">= 1.0x")),
    *(Figure("losses", f"`{loss}` fwd+bwd, compiled, [256, 4096], time", (),
             lambda s, l=loss: s.num("x minimal / naive", loss=l, variant="torchforge", mode="compiled"),
             "{:.2f}x the time", "minimal formula, compiled (float mask)", ("<=", 1.1, "<= 1.1x"))
      for loss in ("ppo_loss", "grpo_loss")),
    Figure("losses", "`ppo_loss` fwd+bwd, compiled, [256, 4096], time", (),
           lambda s: (s.num("median ms", variant="torchforge", mode="compiled", **_LOSS)
                      / s.num("median ms", variant="minimal, bool mask", mode="compiled", **_LOSS)),
           "{:.2f}x the time", "minimal formula, compiled, given the same bool mask"),

    Figure("distributed", "FSDP2, 2 processes, `small` model: parameters per rank", ("`small` model",),
           lambda s: s.num("params vs full", variant="FSDP2, 2 processes"), "{:.2f}x the full model",
           lambda s: "1 process (DDP, 2 processes: {:.2f}x)".format(
               s.num("params vs full", variant="DDP, 2 processes"))),
    *(Figure("distributed", f"{variant}, `small` model: step time (CPU, gloo)", ("`small` model",),
             lambda s, v=variant: s.num("vs 1 process", variant=v), "{:.2f}x the time", "1 process")
      for variant in ("FSDP2, 2 processes", "DDP, 2 processes")),

    *(Figure("loop", f"`RLTrainer` GRPO step, `{setting}`: overhead", ("Targets",),
             lambda s, st=setting: _number(s.match(rf"`{st}`: torchforge's overhead over the hand-written loop "
                                                   r"([+-][\d.]+%)")),
             "{:+.1f}%", "a hand-written torch + transformers loop", ("<=", 10.0, "<= +10%"))
      for setting in ("short", "long")),
    *(Figure("loop", f"`RLTrainer` GRPO step, `{setting}`", (f"`{setting}`",),
             lambda s: s.num("x torchforge", variant="TRL GRPOTrainer"), "{:.2f}x faster",
             "TRL's `GRPOTrainer`", (">=", 1.0, ">= 1.0x"))
      for setting in ("short", "long")),
    Figure("loop", "`RLTrainer` GRPO step, `short`: peak memory", ("`short`",),
           lambda s: s.num("peak MiB", variant="torchforge"), "{:.1f} MiB",
           lambda s: "hand-written {:.1f} MiB; TRL {:.1f} MiB".format(
               s.num("peak MiB", variant="hand-written"), s.num("peak MiB", variant="TRL GRPOTrainer"))),

    Figure("loop_multi_turn", "`rollout_episodes`, 4 turns per episode: time", (),
           lambda s: s.num("overhead", **{"K turns": "4"}), "{:+.0f}%", "a single-turn rollout of the same length"),

    *(Figure("loop_async", f"`async_generation`, max_staleness=1, {how}: steps / s", (),
             lambda s, v=variant: s.num("steps / s vs sync, 2 threads", variant=v), "{:.2f}x",
             "synchronous, 2 threads", target)
      for variant, how, target in (("async, max_staleness=1, hf-process", "`hf-process` engine",
                                    (">=", 1.5, ">= 1.5x")),
                                   ("async, max_staleness=1", "a generator thread", None))),
    *(Figure("loop_async", f"demo reward, last 10 of 200 steps, staleness 1, {how}", ("Reward curves",),
             lambda s, v=variant: s.num("last 10 steps", variant=v), "{:.3f}",
             lambda s: "synchronous: {:.3f}".format(s.num("last 10 steps", variant="sync (on-policy)")))
      for variant, how in (("async k=1: clip vs the sampler's mu*", "clip vs the sampler's mu"),
                           ("async k=1: clip vs recomputed pi_prox, TIS*", "decoupled PPO + TIS"))),

    Figure("lora", "LoRA r=16, 8M-parameter Llama: weights + grads + AdamW", (),
           lambda s: s.num("state MiB", variant="LoRA") / s.num("state MiB", variant="full"),
           "{:.2f}x", "full fine-tuning (reference: a deep copy)"),
    Figure("lora", "LoRA r=16, 8M-parameter Llama: peak total memory of a step", (),
           lambda s: s.num("peak total MiB", variant="LoRA") / s.num("peak total MiB", variant="full"),
           "{:.2f}x", "full fine-tuning (reference: a deep copy)"),
    Figure("lora", "LoRA r=16: checkpoint size", ("Checkpoint size",),
           lambda s: s.num("x full", variant="LoRA, now"), "{:.3f}x", "full fine-tuning"),

    Figure("packing", "packed GRPO step, 110M Llama, spread 1/4: tokens / s", (),
           lambda s: s.num("x padded", variant="packed", **{"spread (mean / limit)": "1/4"}), "{:.2f}x",
           "padded", (">=", 1.5, ">= 1.5x")),
    Figure("packing", "packed GRPO step, 110M Llama, spread 1/4: peak memory", (),
           lambda s: s.num("x padded#2", variant="packed", **{"spread (mean / limit)": "1/4"}), "{:.2f}x",
           "padded", ("<=", 0.7, "<= 0.7x")),
    Figure("packing", "packed GRPO step, 110M Llama, uniform lengths: tokens / s", (),
           lambda s: s.num("x padded", variant="packed", **{"spread (mean / limit)": "uniform"}), "{:.2f}x",
           "padded (nothing to remove)"),

    Figure("rollout", "vLLM in process, 106M Llama, 32 x 8 x 64 tokens: tokens / s", ("Generation",),
           lambda s: s.num("tokens / s (median)", model="100m", variant="vllm")
           / s.num("tokens / s (median)", model="100m", variant="hf generate"),
           "{:.2f}x", "HF `generate`", (">=", 3.0, ">= 3x")),
    Figure("rollout", "vLLM in process, 106M Llama: weight sync", ("Generation",),
           lambda s: s.num("weight sync (s)", model="100m", variant="vllm"), "{:.3f} s",
           lambda s: "vLLM server: {:.3f} s".format(s.num("weight sync (s)", model="100m", variant="vllm server"))),
    Figure("rollout_profile", "demo GRPO step, vLLM in process: sampling time", (),
           lambda s: s.num("`vllm` ms", phase="sampling (engine.generate)")
           / s.num("`hf` ms", phase="sampling (engine.generate)"), "{:.1f}x",
           lambda s: "the `hf` engine's (weight sync {:.1f} ms of a {:.0f} ms step)".format(
               s.num("`vllm` ms", phase="weight sync"), s.num("`vllm` ms", phase="total"))),
    Figure("rollout_profile_100m", "106M GRPO step, vLLM in process: time", (),
           lambda s: s.num("`vllm` ms", phase="total") / s.num("`hf` ms", phase="total"), "{:.2f}x the time",
           lambda s: "the `hf` engine (sampling {:.2f}x hf's; weight sync {:.0f} ms of {:.0f})".format(
               s.num("`vllm` ms", phase="sampling (engine.generate)") / s.num("`hf` ms", phase="sampling (engine.generate)"),
               s.num("`vllm` ms", phase="weight sync"), s.num("`vllm` ms", phase="total")),
           ("<", 1.0, "< 1.0x")),
    Figure("rollout", "vLLM prefix cache, 106M Llama, 4 prompts of 256 tokens x 8 copies: time", ("vLLM's prefix cache",),
           lambda s: s.num("vs off", model="100m", **{"prefix cache": "on"}), "{:.2f}x the time", "the cache off"),
    Figure("weight_sync", "`hf-process` weight sync, 106M Llama (404 MiB)", (),
           lambda s: s.num("x floor", model="100m", variant="hf-process"), "{:.2f}x the time",
           "one batched memory copy of the weights"),
    Figure("weight_sync", "vLLM in process (CPU build) weight sync, 106M Llama", (),
           lambda s: s.num("x floor", model="100m", variant="vllm (in process)"), "{:.1f}x the time",
           "one batched memory copy of the weights"),
    Figure("compat", "`torchforge.compat` twins, the slowest against its peer (B=64, T=1024)", ("Summary",),
           lambda s: s.num("value", figure="worst compat / peer ratio"), "{:.2f}x the time",
           lambda s: "the peer's own function (slowest: {}; median over the twins: {:.2f}x)".format(
               s.cell("value", figure="slowest twin against its peer"),
               s.num("value", figure="median compat / peer ratio")),
           ("<=", 1.05, "<= 1.05x")),
    Figure("compat", "`compat.verl.compute_gae_advantage_return`, B=512, T=1024", ("verl 0.9.1",),
           lambda s: 1 / s.num("compat / verl", **{"verl function": "compute_gae_advantage_return"}),
           "{:.1f}x faster", "verl's own function"),
    Figure("rollout", "`RLTrainer` GRPO step on the demo with vLLM in process: time", ("One GRPO step",),
           lambda s: s.num("step time vs hf", engine="vllm"), "{:.2f}x the time", "the `hf` engine",
           ("<", 1.0, "< 1.0x")),
]


def label(figure: Figure) -> str:
    """The figure's name in errors: what it measures, and what against when that is fixed text."""
    return figure.figure + (f" against {figure.against}" if isinstance(figure.against, str) else "")


def read_figure(figure: Figure, results: ResultsFile) -> dict[str, str]:
    """The cells of a figure's row, or FigureNotFound naming the file and the figure."""
    try:
        section = results.section(*figure.section)
        value = figure.value(section)
        against = figure.against(section) if callable(figure.against) else figure.against
    except (FigureNotFound, KeyError, ValueError, ZeroDivisionError) as e:
        raise FigureNotFound(f"{results.path}: headline figure {label(figure)!r} not found: {e}") from e
    target = "-"
    if figure.target:
        op, bound, written = figure.target
        target = f"{written}: " + ("met" if _OPS[op](float(value), bound) else "**missed**")
    anchor = f"#{section.heading.anchor}" if section.heading and section.heading.level > 2 else ""
    return {"benchmark": figure.bench, "figure": figure.figure, "value": figure.fmt.format(value),
            "against": against, "target": target, "machine": machine_of("\n".join(results.lines)),
            "details": f"[{results.name}.md](results/{results.name}.md{anchor})"}


# --- the page ---------------------------------------------------------------------------------

_NAME_PATTERNS = (
    re.compile(r"Machine:\s*([^,.;\n]+)"),
    re.compile(r"CPU:\s*([^,\n]+)"),
    re.compile(r"device \w+ \((.+?)\),"),
)


def machine_of(text: str) -> str:
    """The machine a results file names: its processor (first 'Machine:', 'CPU:' or
    'device x (...)'), its core count, and the device when it is not the CPU."""
    name = next((m.group(1).strip() for p in _NAME_PATTERNS if (m := p.search(text))), None)
    cuda = bool(re.search(r"device cuda|\| cuda \||GPU: ", text))
    if name is None:
        return "cuda (model not recorded)" if cuda else "cpu (model not recorded)"
    cores = re.search(r"(\d+) cores", text)
    return ", ".join(x for x in (name, f"{cores.group(1)} cores" if cores else None, "cuda" if cuda else None) if x)


def ordered_results(results_dir: Path) -> list[Path]:
    files = {p.stem: p for p in results_dir.glob("*.md")}
    known = [files.pop(name) for name in BENCHMARKS if name in files]
    return known + [files[name] for name in sorted(files)]


def _paragraph(text: str) -> str:
    return textwrap.fill(text, 100, break_long_words=False, break_on_hyphens=False)


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def build(results_dir: Path, notes_dir: Path | None = None) -> str:
    """The text of RESULTS.md from the results files in ``results_dir``; links to the notes
    in ``notes_dir`` (default: ``notes`` beside it) that exist."""
    notes_dir = notes_dir or results_dir.parent / "notes"
    files = {p.stem: ResultsFile(p) for p in ordered_results(results_dir)}
    missing = sorted({f.bench for f in FIGURES} - set(files))
    if missing:
        raise FigureNotFound(f"{results_dir}: no results file for {', '.join(m + '.md' for m in missing)}")
    rows = [read_figure(f, files[f.bench]) for f in FIGURES]
    machines: dict[str, list[str]] = {}
    for name, results in files.items():
        machines.setdefault(machine_of("\n".join(results.lines)), []).append(name)
    targets = [r for r in rows if r["target"] != "-"]
    missed = [f"{r['figure']} ({r['value']})" for r in targets if "missed" in r["target"]]
    summary = (f"{SUMMARY} Of the {len(targets)} figures below with a target, {len(targets) - len(missed)} meet it"
               + (f"; missed: {'; '.join(missed)}." if missed else "."))
    gpu = any("cuda" in m for m in machines)
    lines = [
        "# Benchmark results",
        "",
        _paragraph("Headline figures of torchforge's benchmarks, each read from the results file its script "
                   "writes. This page is generated: `python benchmarks/collect_results.py` rewrites it from "
                   "`benchmarks/results/*.md` (do not edit it by hand), and `python benchmarks/run_all.py` runs "
                   "every benchmark and then that. Each benchmark's notes hold the history of its results."),
        "",
        "Machines (shared with other jobs)" + ("" if gpu else "; no figure here was measured on a GPU") + ":",
        "",
        *(f"- {machine}: {', '.join(names)}" for machine, names in machines.items()),
        "",
        "## Summary",
        "",
        _paragraph(summary),
        "",
        "## Figures",
        "",
        _paragraph("\"x faster\": the other's time over torchforge's; \"x the time\": torchforge's over the "
                   "other's; a bare ratio: torchforge's figure over the other's. The details link opens the "
                   "table a figure is read from."),
        "",
        _row(["benchmark", "figure", "value", "against", "target", "machine", "details"]),
        _row(["---"] * 7),
        *(_row(r.values()) for r in rows),
        "",
        "## Benchmarks",
        "",
        _row(["results", "script", "what it measures", "machine", "notes"]),
        _row(["---"] * 5),
    ]
    for name, results in files.items():
        script, what, _ = BENCHMARKS.get(name, ("-", "-", None))
        notes = notes_dir / f"{name}.md"
        lines.append(_row([f"[{name}.md](results/{name}.md)", f"`{script}`", what,
                           machine_of("\n".join(results.lines)),
                           f"[notes/{name}.md](notes/{name}.md)" if notes.exists() else "-"]))
    lines += ["", "Run them all (each writes its `benchmarks/results/*.md`), then regenerate this page:", "", "```"]
    for name in files:
        run = BENCHMARKS.get(name, (None, None, None))[2]
        if run:
            lines += [command.strip() for command in run.split("; ")]
    lines += ["python benchmarks/collect_results.py", "```", "",
              _paragraph("`python benchmarks/run_all.py` runs the `script` column's invocations, each once with "
                         "its defaults, on the best device present, then regenerates this page (`--only NAME ...` "
                         "for some). `--quick` on any script is a smoke run (small shapes, few repeats); some "
                         "scripts write their results file even then, so run the full commands before "
                         "regenerating this page."), ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(HERE / "results"))
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    out = Path(args.out)
    try:
        text = build(Path(args.results))
    except FigureNotFound as e:
        raise SystemExit(f"error: {e}") from None
    out.write_text(text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
