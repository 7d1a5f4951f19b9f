"""Benchmark: one GRPO step of RLTrainer on the demo task, against a hand-written loop and TRL.

Variants, in one process, interleaved in blocks of steps (torchforge, hand-written, TRL,
torchforge, ...), each on its own copy of the same model:

- ``torchforge``: ``RLTrainer.train_step(step)`` with ``demo_config`` (GRPO, 16 prompts x 8
  samples, lr 3e-3, no KL, float32, no gradient checkpointing). The row
  ``torchforge + logging`` adds, per step, the ``MetricsLogger.log`` call that
  ``RLTrainer.train`` makes (metrics.jsonl and TensorBoard); checkpoints are off.
- ``hand-written``: :func:`handwritten_grpo_step`, the same maths in one function with
  plain torch + transformers: ``model.generate(do_sample=True, top_k=0, top_p=1.0)``,
  completion mask up to the first eos, reward (``CopyDigitsReward`` given the completion ids,
  as RLTrainer and TRL give them), group-normalized advantages, full-logits
  ``log_softmax`` + ``gather`` log-probs, clipped GRPO loss (token-mean), gradient-norm
  clip at 1.0 (as RLTrainer and TRL do), AdamW step.
- ``TRL``: ``trl.GRPOTrainer`` on the same model, prompts, group size, completion length
  and learning rate (``beta=0``, ``loss_type="dapo"``: token-mean over the batch,
  ``scale_rewards="group"``, fp32, no gradient checkpointing, constant learning rate,
  ``report_to="none"``, ``logging_steps=1``). Its step time is the interval between two
  ``on_step_end`` callbacks, so it covers everything ``Trainer.train`` does per step
  (fetching the batch, generation, the update, logging); the other variants' blocks run
  inside that callback, outside TRL's intervals. Runs only when ``import trl`` works.

Settings:

- ``short``: ``max_completion_length=4`` (the demo: 3 digits and eos).
- ``long``: ``max_completion_length=32`` with a model that never stops early: its LM
  head gets a frozen bias of -1e4 on the eos logit, so every completion is 32 tokens and
  all variants generate, and train on, the same number of tokens.

Each variant runs ``--warmup`` steps (not timed) and then ``--steps`` timed steps, in
rounds of ``--block`` steps per variant. Reported per variant: the median wall-clock ms per
step and the median process CPU ms per step (``time.process_time``: on a shared machine,
time the process is descheduled does not count), their ratios to torchforge's
``train_step``, the mean completion length (a check that the variants do the same work),
and the peak extra memory of one step: the largest amount of memory allocated by torch
during one step beyond what was allocated before it (``torch.profiler`` memory events on
the CPU, which see torch's CPU allocator but not Python objects; ``max_memory_allocated``
on CUDA), measured on one extra step after the timed ones. The process's RSS high-water
mark (``resource.getrusage``) is printed too, for all variants together. The targets are
judged on the median wall times; the "paired" ratio (median over rounds of the ratio of
the two variants' times in that round) is printed next to them, as it is less sensitive
to load that changes during the run.

``--profile`` adds a table of where the time of one step goes (process CPU ms per phase,
torchforge's functions against the hand-written loop's), measured by wrapping functions
on separate, interleaved steps.

Running TRL: TRL is not a dependency of torchforge. Create a separate environment:

    python -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0          # the CPU build; pin it
    /tmp/trl-venv/bin/pip install transformers==5.24.0 trl datasets -e .
    /tmp/trl-venv/bin/python benchmarks/bench_loop.py --threads 1

(pin transformers to the version of your torchforge environment so that both runs use
the same model code; TRL 1.16.0 works with transformers 5.24.0). Without TRL the script
prints a skip line and compares torchforge with the hand-written loop.

Usage: python benchmarks/bench_loop.py [--quick] [--profile] [--threads N] [--steps N] [--settings short,long]
Writes benchmarks/results/loop.md (not with --quick).

``--async`` runs only the asynchronous-generation section instead: the same GRPO run
synchronous (2 threads, and 1) against ``async_generation`` at ``max_staleness`` 1 and 2
(generator and trainer on one thread each): ms per step, the share of time each side waits,
staleness, reward; then the reward curves of the ways to correct stale samples, and writes
benchmarks/results/loop_async.md (see :func:`async_comparison`).

``--multi-turn`` runs only the multi-turn section instead: ``rollout_episodes`` (K turns
with an environment) against one ``rollout`` of the same total length, and writes
benchmarks/results/loop_multi_turn.md (see :func:`multi_turn_overhead`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from torch import nn

import torchforge
from torchforge import RLTrainer
from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, demo_config, tiny_llama
from torchforge.trainer.tracking import MetricsLogger
from torchforge.trainer import rollouts

try:
    import trl
except ImportError:  # the TRL variant is skipped
    trl = None

SETTINGS = {
    "short": dict(max_completion_length=4, no_eos=False),
    "long": dict(max_completion_length=32, no_eos=True),
    "medium": dict(max_completion_length=16, no_eos=True),
}
PROMPTS, G, LR, CLIP = 16, 8, 3e-3, 0.2
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# --- the model ----------------------------------------------------------------------------

def build_model(tokenizer: Any, no_eos: bool) -> nn.Module:
    """The demo's tiny Llama (seed 0); with ``no_eos``, an LM head that never samples eos."""
    model = tiny_llama(tokenizer, seed=0)
    if no_eos:
        old = model.lm_head
        head = nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.zero_()
            head.bias[tokenizer.eos_token_id] = -1e4
        head.bias.requires_grad_(False)
        model.lm_head = head
    return model


# --- the hand-written loop ----------------------------------------------------------------

def handwritten_grpo_step(model, tokenizer, optimizer, prompts, reward_fn, *, num_generations,
                          max_new_tokens, clip=CLIP):
    """One GRPO step, written out with plain torch + transformers."""
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    prompt_ids = enc["input_ids"].repeat_interleave(num_generations, 0).to(device)
    prompt_mask = enc["attention_mask"].repeat_interleave(num_generations, 0).to(device)
    eos, P = tokenizer.eos_token_id, prompt_ids.shape[1]

    # sample
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, top_k=0,
                             top_p=1.0, temperature=1.0, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.train()
    completions = out[:, P:]
    T = completions.shape[1]

    # mask: up to and including the first eos
    is_eos = completions == eos
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), T)
    mask = torch.arange(T, device=device)[None, :] <= first_eos[:, None]

    # reward (judged from the ids up to the first eos, as RLTrainer and TRL pass them) and
    # group-normalized advantages
    ids = [c[m].tolist() for c, m in zip(completions, mask)]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    rewards = torch.tensor(reward_fn(texts, [p for p in prompts for _ in range(num_generations)], ids),
                           dtype=torch.float32, device=device)
    grouped = rewards.view(-1, num_generations)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)

    # log-probs of the completion tokens
    attention = torch.cat([prompt_mask, torch.ones_like(completions)], dim=1)
    logits = model(input_ids=out, attention_mask=attention).logits[:, P - 1:-1]
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, completions[..., None]).squeeze(-1)

    # clipped GRPO loss, token-mean; on-policy, so old log-probs = detached log-probs
    ratio = torch.exp(log_probs - log_probs.detach())
    adv = advantages[:, None]
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    maskf = mask.float()
    loss = (per_token * maskf).sum() / maskf.sum()

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": loss.item(), "reward": rewards.mean().item(), "mean_length": maskf.sum(1).mean().item()}


# --- the variants -------------------------------------------------------------------------

class Torchforge:
    name = "torchforge"

    def __init__(self, tokenizer, dataset, setting, workdir):
        # the learning rate of the other variants, not the demo's: the same training in all three
        cfg = demo_config(max_completion_length=setting["max_completion_length"], learning_rate=LR,
                          max_steps=100_000, save_steps=None, progress_bar=False,
                          output_dir=str(workdir / "torchforge"))
        self.trainer = RLTrainer(model=build_model(tokenizer, setting["no_eos"]), tokenizer=tokenizer,
                                 config=cfg, reward_functions=[CopyDigitsReward()], train_dataset=dataset)
        self.logger = MetricsLogger(cfg.output_dir, total_steps=cfg.max_steps, progress_bar=False)
        self.index = 0
        self.times, self.cpu, self.log_times, self.log_cpu, self.lengths = [], [], [], [], []

    def step(self, timed=True):
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        metrics = self.trainer.train_step(self.index)
        sync()
        middle, cpu_middle = time.perf_counter(), time.process_time()
        self.logger.log(self.index + 1, metrics)
        end, cpu_end = time.perf_counter(), time.process_time()
        self.index += 1
        if timed:
            self.times.append(middle - start)
            self.cpu.append(cpu_middle - cpu_start)
            self.log_times.append(end - middle)
            self.log_cpu.append(cpu_end - cpu_middle)
            self.lengths.append(metrics["completions/mean_length"])

    def close(self):
        self.logger.close()


class Handwritten:
    name = "hand-written"

    def __init__(self, tokenizer, dataset, setting, workdir):
        self.tokenizer, self.dataset = tokenizer, dataset
        self.max_new_tokens = setting["max_completion_length"]
        self.model = build_model(tokenizer, setting["no_eos"]).to(DEVICE)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=LR,
                                           weight_decay=0.0)
        self.reward = CopyDigitsReward()
        self.index = 0
        self.times, self.cpu, self.lengths = [], [], []

    def step(self, timed=True):
        first = (self.index * PROMPTS) % len(self.dataset)
        prompts = [row["prompt"] for row in self.dataset[first:first + PROMPTS]]
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        out = handwritten_grpo_step(self.model, self.tokenizer, self.optimizer, prompts,
                                    self.reward.compute, num_generations=G,
                                    max_new_tokens=self.max_new_tokens)
        sync()
        self.index += 1
        if timed:
            self.times.append(time.perf_counter() - start)
            self.cpu.append(time.process_time() - cpu_start)
            self.lengths.append(out["mean_length"])

    def close(self):
        pass


def make_trl_trainer(tokenizer, dataset, setting, workdir, callback):
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    reward = CopyDigitsReward()

    def copy_digits(prompts, completions, completion_ids, **kwargs):
        return reward.compute(completions, prompts, completion_ids=completion_ids)

    config = trl.GRPOConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=PROMPTS * G, num_generations=G,
        max_completion_length=setting["max_completion_length"], learning_rate=LR, beta=0.0,
        loss_type="dapo", scale_rewards="group", epsilon=CLIP, temperature=1.0, top_p=1.0, top_k=0,
        num_iterations=1, gradient_accumulation_steps=1, max_grad_norm=1.0, weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, bf16=False, fp16=False, gradient_checkpointing=False,
        max_steps=callback.total_steps, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, use_cpu=DEVICE.type == "cpu",
    )
    trainer = trl.GRPOTrainer(model=build_model(tokenizer, setting["no_eos"]), processing_class=tokenizer,
                              reward_funcs=[copy_digits], args=config, train_dataset=Dataset.from_list(dataset),
                              callbacks=[callback])
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    return trainer


def trl_mean_length(trainer) -> float:
    values = trainer._metrics["train"].get("completions/mean_length", [])
    return values[-1] if values else float("nan")


# --- memory -------------------------------------------------------------------------------

class PeakMemory:
    """Peak extra torch-allocated bytes between ``start()`` and ``stop()``."""

    def start(self):
        sync()
        if DEVICE.type == "cuda":
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()

    def stop(self) -> float:
        sync()
        if DEVICE.type == "cuda":
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        self.prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            self.prof.export_chrome_trace(path)
            with open(path) as f:
                events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
        if not events:
            return 0.0
        events.sort(key=lambda e: e["ts"])
        # the profiler's running total may start above 0 (tensors allocated under an earlier
        # profiler and freed outside it): measure from the total before the first event
        base = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
        return max(0, max(e["args"]["Total Allocated"] for e in events) - base) / 2**20


def peak_of(call: Callable[[], None]) -> float:
    meter = PeakMemory()
    meter.start()
    call()
    return meter.stop()


# --- one setting --------------------------------------------------------------------------

def run_setting(name, setting, args, tokenizer, dataset, workdir):
    torch.manual_seed(0)
    runners = [Torchforge(tokenizer, dataset, setting, workdir), Handwritten(tokenizer, dataset, setting, workdir)]
    for runner in runners:
        for _ in range(args.warmup):
            runner.step(timed=False)

    def block():
        for runner in runners:
            for _ in range(args.block):
                runner.step()

    rounds = -(-args.steps // args.block)
    peaks: dict[str, float] = {}
    trl_times: list[float] = []
    trl_cpu: list[float] = []
    trl_lengths: list[float] = []
    if trl is not None:
        from transformers import TrainerCallback

        class Interleave(TrainerCallback):
            """Times TRL's steps; runs the other variants' blocks between them, outside TRL's intervals."""

            total_steps = args.warmup + rounds * args.block + 1  # + 1: the memory step

            def __init__(self):
                self.last = self.last_cpu = None
                self.meter = None

            def on_train_begin(self, *a, **k):
                self.last, self.last_cpu = time.perf_counter(), time.process_time()

            def on_step_end(self, targs, state, control, **kwargs):
                sync()
                now, now_cpu = time.perf_counter(), time.process_time()
                done = state.global_step - args.warmup
                if self.meter is not None:  # the last step: memory only
                    peaks["TRL GRPOTrainer"] = self.meter.stop()
                    self.meter = None
                elif 0 < done <= rounds * args.block:
                    trl_times.append(now - self.last)
                    trl_cpu.append(now_cpu - self.last_cpu)
                    trl_lengths.append(trl_mean_length(trainer))
                    if done % args.block == 0:
                        block()
                if state.global_step == self.total_steps - 1:
                    self.meter = PeakMemory()
                    self.meter.start()
                sync()
                self.last, self.last_cpu = time.perf_counter(), time.process_time()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = make_trl_trainer(tokenizer, dataset, setting, workdir, Interleave())
            trainer.train()
    else:
        for _ in range(rounds):
            block()
    for runner in runners:
        peaks[runner.name] = peak_of(lambda: runner.step(timed=False))
        runner.close()

    tf, hw = runners
    peaks["torchforge + logging"] = peaks["torchforge"]
    rows = {
        "torchforge": (tf.times, tf.cpu, tf.lengths),
        "torchforge + logging": ([a + b for a, b in zip(tf.times, tf.log_times)],
                                 [a + b for a, b in zip(tf.cpu, tf.log_cpu)], tf.lengths),
        "hand-written": (hw.times, hw.cpu, hw.lengths),
    }
    if trl is not None:
        rows["TRL GRPOTrainer"] = (trl_times, trl_cpu, trl_lengths)
    return {key: dict(ms=1e3 * statistics.median(t), cpu_ms=1e3 * statistics.median(c), n=len(t),
                      mean_length=statistics.fmean(lengths), peak_mib=peaks[key], times=t)
            for key, (t, c, lengths) in rows.items()}


def paired_ratio(times: list[float], base: list[float], block: int) -> float:
    """Median over interleaved rounds of (this variant's block mean / the base's block mean)."""
    rounds = min(len(times), len(base)) // block
    return statistics.median(statistics.fmean(times[r * block:(r + 1) * block])
                             / statistics.fmean(base[r * block:(r + 1) * block]) for r in range(rounds))


# --- where the time goes (--profile) -------------------------------------------------------

class _Phases:
    """Accumulates process CPU time per phase by wrapping functions (restored on exit); ``clock``
    another timer (``time.perf_counter``: wall time, for work in other processes)."""

    def __init__(self, clock: Callable[[], float] = time.process_time):
        self.clock = clock
        self.acc: dict[str, float] = {}
        self.active: set[str] = set()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner, attr, label):
        original = getattr(owner, attr)
        acc, active, clock = self.acc, self.active, self.clock

        def timed(*a, **k):
            if label in active:  # nested in a call of the same phase (counted there)
                return original(*a, **k)
            active.add(label)
            start = clock()
            try:
                return original(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + clock() - start
                active.discard(label)

        self._undo.append((owner, attr, owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING))
        setattr(owner, attr, timed)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for owner, attr, value in reversed(self._undo):
            if value is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)


_MISSING = object()


def phase_breakdown(setting, steps, tokenizer, dataset, workdir) -> list[tuple[str, float, float]]:
    """Median CPU ms per step and phase, torchforge vs the hand-written loop (steps interleaved)."""
    import torchforge.loop.sampling
    import torchforge.trainer.rollouts
    import torchforge.trainer.trainer

    torch.manual_seed(0)
    tf, hw = Torchforge(tokenizer, dataset, setting, workdir), Handwritten(tokenizer, dataset, setting, workdir)
    for runner in (tf, hw):
        for _ in range(3):
            runner.step(timed=False)
    per: dict[tuple[str, str], list[float]] = {}
    with _Phases() as ph:
        module, strategy = torchforge.trainer.trainer, torchforge.trainer.rollouts  # the single-turn strategy
        ph.wrap(strategy, "rollout", "sampling")
        ph.wrap(torchforge.loop.sampling.SeededSampler, "__call__", "  seeded sampler (part of sampling)")
        ph.wrap(strategy, "decode_completions", "decode")
        ph.wrap(strategy, "score_rewards", "rewards")
        ph.wrap(module.RLTrainer, "_loss", "log-probs forward + loss")
        ph.wrap(module, "optimizer_step", "grad clip + AdamW (+ scheduler)")
        ph.wrap(module.RLTrainer, "_metrics", "metrics")
        ph.wrap(torch.Tensor, "backward", "backward")
        ph.wrap(hw.model, "generate", "sampling")
        ph.wrap(hw.tokenizer, "batch_decode", "decode")
        ph.wrap(hw.reward, "compute", "rewards")
        ph.wrap(hw.optimizer, "step", "grad clip + AdamW (+ scheduler)")
        ph.wrap(torch.nn.utils, "clip_grad_norm_", "grad clip + AdamW (+ scheduler)")
        for _ in range(steps):
            for key, call in (("torchforge", lambda: tf.trainer.train_step(tf.index)), ("hand-written", hw.step)):
                ph.acc.clear()
                start = time.process_time()
                call()
                total = time.process_time() - start
                if key == "torchforge":
                    tf.index += 1
                ph.acc["total"] = total
                for label, value in ph.acc.items():
                    per.setdefault((key, label), []).append(value)
    tf.close()
    labels = ["sampling", "  seeded sampler (part of sampling)", "decode", "rewards", "log-probs forward + loss",
              "backward", "grad clip + AdamW (+ scheduler)", "metrics", "total"]
    rows = []
    for label in labels:
        ms = [1e3 * statistics.median(per[(key, label)]) if (key, label) in per else float("nan")
              for key in ("torchforge", "hand-written")]
        rows.append((label, *ms))
    # the hand-written loop's forward + loss is what its other phases leave
    listed = [r for r in rows if r[0] in ("sampling", "decode", "rewards", "backward",
                                          "grad clip + AdamW (+ scheduler)")]
    rest = rows[-1][2] - sum(r[2] for r in listed)
    return [(label, a, rest if label == "log-probs forward + loss" else b) for label, a, b in rows]


# --- report -------------------------------------------------------------------------------

def machine() -> str:
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name()
    try:
        return next(line.split(":", 1)[1].strip() for line in
                    subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                    if line.startswith("Model name"))
    except (StopIteration, FileNotFoundError):
        return platform.processor() or "unknown CPU"


def report(results, args, profiles=None) -> str:
    versions = (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                f"torchforge {torchforge.__version__}, TRL {trl.__version__ if trl else 'not installed'}, "
                f"Python {platform.python_version()}")
    lines = [
        "## The loop: one GRPO step, RLTrainer vs a hand-written loop vs TRL (`benchmarks/bench_loop.py`)",
        "",
        f"Machine: {machine()}, device {DEVICE.type}, {os.cpu_count()} cores, "
        f"torch.get_num_threads()={torch.get_num_threads()}; {versions}.",
        "",
        f"Demo task and model (tiny Llama, H=64, 2 layers, vocabulary 15), GRPO, {PROMPTS} prompts x {G} "
        f"samples = {PROMPTS * G} completions per step, lr {LR}, no KL, fp32, temperature 1, top-k off. "
        f"{args.steps} timed steps per variant after {args.warmup} warm-up steps, interleaved in blocks "
        f"of {args.block}; medians of the wall-clock time and of the process CPU time per step "
        "(`time.process_time`, which other jobs on a shared machine disturb less). Peak: extra memory "
        "allocated by torch during one step ("
        + ("`max_memory_allocated`" if DEVICE.type == "cuda"
           else "torch.profiler memory events: torch's CPU allocator, not Python objects") + ").",
        "",
    ]
    targets = []
    for name, rows in results.items():
        setting = SETTINGS[name]
        lines += [f"### `{name}`: max_completion_length={setting['max_completion_length']}"
                  + (" (eos never sampled: every completion is full length)" if setting["no_eos"] else ""), "",
                  "| variant | median ms / step | x torchforge | median CPU ms / step | x torchforge (CPU) "
                  "| mean completion tokens | peak MiB |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        base = rows["torchforge"]
        for key, row in rows.items():
            lines.append(f"| {key} | {row['ms']:.1f} | {row['ms'] / base['ms']:.2f} | {row['cpu_ms']:.1f} | "
                         f"{row['cpu_ms'] / base['cpu_ms']:.2f} | {row['mean_length']:.1f} | {row['peak_mib']:.1f} |")
        lines.append("")
        hw = rows["hand-written"]
        over, over_cpu = base["ms"] / hw["ms"] - 1, base["cpu_ms"] / hw["cpu_ms"] - 1
        paired = 1 / paired_ratio(hw["times"], base["times"], args.block) - 1
        targets.append(f"- `{name}`: torchforge's overhead over the hand-written loop {100 * over:+.1f}% "
                       f"(median wall times; CPU times {100 * over_cpu:+.1f}%; paired per round "
                       f"{100 * paired:+.1f}%) (target <= +10%): " + ("met" if over <= 0.10 else "MISSED"))
        if "TRL GRPOTrainer" in rows:
            t = rows["TRL GRPOTrainer"]
            ratio, ratio_cpu = t["ms"] / base["ms"], t["cpu_ms"] / base["cpu_ms"]
            paired = paired_ratio(t["times"], base["times"], args.block)
            targets.append(f"- `{name}`: TRL's step time / torchforge's {ratio:.2f} (median wall times; CPU "
                           f"times {ratio_cpu:.2f}; paired per round {paired:.2f}) (target >= 1.0): "
                           + ("met" if ratio >= 1.0 else "MISSED"))
        else:
            targets.append(f"- `{name}`: TRL not installed: not measured")
    for name, rows in (profiles or {}).items():
        lines += [f"### Where the time goes, `{name}` (`--profile`: median process CPU ms per step and phase, "
                  f"{args.profile_steps} interleaved steps each)", "",
                  "| phase | torchforge | hand-written | difference |", "| --- | ---: | ---: | ---: |"]
        for label, a, b in rows:
            cell = lambda x: "-" if x != x else f"{x:.2f}"  # noqa: E731 (NaN: no such phase)
            diff = "-" if (a != a or b != b) else f"{a - b:+.2f}"
            lines.append(f"| {label.strip()} | {cell(a)} | {cell(b)} | {diff} |")
        lines += ["", "Phases are timed by wrapping functions: torchforge's `rollout`, `decode_completions`, "
                  "`score_rewards`, `RLTrainer._loss` (fused log-probs forward, entropy, GRPO loss and its "
                  "metrics), `Tensor.backward`, `optimizer_step`, `RLTrainer._metrics`; the hand-written "
                  "loop's `generate`, `batch_decode` (its per-row masking of the tokens before it is not "
                  "included), reward, `backward`, `clip_grad_norm_` + `AdamW.step`, and its log-probs "
                  "forward + loss row is what the others leave of its total.", ""]
    lines += ["### Targets", "", *targets, "",
              f"Process RSS high-water mark, all variants together: "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB.", "",
              "`torchforge` times `RLTrainer.train_step` (sampling, rewards, advantages, the update and its "
              "metrics); `torchforge + logging` adds the metrics.jsonl + TensorBoard write that `train()` "
              "makes per step. `hand-written` computes the loss only (no entropy, no metrics). TRL's step "
              "is the whole `Trainer` step interval (batch fetch, generation, update, its metrics and "
              "logging to `log_history`). The model is tiny (H=64, 2 layers), so fixed per-token and "
              "per-step costs (the sampler's ops, Python) weigh far more here than they would next to "
              "the forward of a real model.",
              ""]
    if trl is not None:
        lines += ["TRL's peak memory is set by the tile buffer of its chunked log-prob kernel "
                  "(`trl.kernels.ChunkedLogProbFunction`): [min(tokens, 4096), 32768] float32 (112 MiB for the "
                  "896 positions of `short`, 512 MiB for `long`), whatever the vocabulary size (15 here).", ""]
    command = " ".join(["python", "benchmarks/bench_loop.py", *sys.argv[1:]])
    lines.append(f"Run: `{command}` with the python of an environment that has TRL (see the script's "
                 "docstring); without TRL the TRL rows are skipped.")
    return "\n".join(lines) + "\n"


# --- multi-turn episodes: the loop step's overhead over a single-turn rollout --------------

class _FixedObservation:
    """A free environment: every step answers ``"0123="`` (5 tokens) until ``turns`` model turns."""

    def __init__(self, turns: int):
        self.turns = turns

    def reset(self, row):
        self.turn = 0
        return row["prompt"]

    def step(self, action):
        self.turn += 1
        return ("0123=", 0.0, self.turn == self.turns)


def multi_turn_overhead(args) -> str:
    """``rollout_episodes`` (K turns of n tokens, observations of 5) vs one ``rollout`` of the same length.

    The model never samples eos, so both produce sequences of exactly ``T = K n + 5 (K - 1)``
    tokens for the same 128 rows; the training forward then costs the same for both (same
    [B, T] batch), so the difference is the sampling side: K ``generate`` calls that each
    re-read their context, the observations' tokenization and the environments' threads.
    """
    from torchforge.loop import environments
    from torchforge.loop.environments import rollout_episodes
    from torchforge.loop.rollout import rollout

    tokenizer = char_tokenizer()
    model = build_model(tokenizer, no_eos=True).to(DEVICE)
    rows = copy_digits_dataset(PROMPTS, seed=0)
    prompts = [row["prompt"] for row in rows]
    n, obs = 8, 5
    lines = ["## Multi-turn episodes: `rollout_episodes` vs a single-turn `rollout` of the same length "
             "(`benchmarks/bench_loop.py --multi-turn`)", "",
             f"Machine: {machine()}, device {DEVICE.type}, torch.get_num_threads()={torch.get_num_threads()}; "
             f"torch {torch.__version__}, transformers {transformers.__version__}.", "",
             f"Tiny Llama (H=64, 2 layers) that never samples eos, {PROMPTS} rows x {G} samples = {PROMPTS * G} "
             f"sequences; K model turns of {n} tokens, an environment that answers {obs} tokens at once "
             f"(no work of its own); the single-turn rollout samples the same total length T. Medians of "
             f"{args.steps} timed calls each after {args.warmup} warm-up calls, interleaved.", "",
             "| K turns | T tokens | single-turn ms | multi-turn ms | overhead | of which generate ms | "
             "of which the rest (envs, tokenizing, padding) ms |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for K in (2, 4):
        T = K * n + obs * (K - 1)
        single, multi, generate_ms = [], [], []
        inner_times: list[float] = []

        def timed_rollout(*a, **kw):
            sync()
            t0 = time.perf_counter()
            out = rollout(*a, **kw)
            sync()
            inner_times.append(time.perf_counter() - t0)
            return out

        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            batch = rollout(model, tokenizer, prompts, num_generations=G, max_new_tokens=T, seed=i)
            sync()
            t1 = time.perf_counter()
            environments.rollout, inner_times[:] = timed_rollout, []
            try:
                episodes_batch, _ = rollout_episodes(
                    model, tokenizer, [_FixedObservation(K) for _ in range(PROMPTS * G)], rows=rows,
                    num_generations=G, max_turns=K, max_new_tokens_per_turn=n, max_total_tokens=T, seed=i)
            finally:
                environments.rollout = rollout
            sync()
            t2 = time.perf_counter()
            assert batch.tokens.shape[1] == episodes_batch.tokens.shape[1] == T
            if i >= args.warmup:
                single.append(1e3 * (t1 - t0))
                multi.append(1e3 * (t2 - t1))
                generate_ms.append(1e3 * sum(inner_times))
        a, b, g = statistics.median(single), statistics.median(multi), statistics.median(generate_ms)
        lines.append(f"| {K} | {T} | {a:.1f} | {b:.1f} | {100 * (b / a - 1):+.0f}% | {g:.1f} | {b - g:.1f} |")
    lines += ["", "The multi-turn loop samples fewer tokens (K n, not T) but starts K `generate` calls, each "
              "prefilling its whole context (no KV cache is kept across turns, as in `generate`); the "
              "remaining column is the loop's own Python: decoding the actions, the environments' threads, "
              "tokenizing the observations and building the batch.", "",
              f"Run: `python benchmarks/bench_loop.py --multi-turn --steps {args.steps}`.", ""]
    return "\n".join(lines)


# --- asynchronous generation ------------------------------------------------------------------

#: the throughput variants of ``--async``: (label, RLConfig changes, torch threads of the trainer)
ASYNC_VARIANTS = (
    ("sync, 2 threads", {}, 2),
    ("sync, 1 thread", {}, 1),
    ("async, max_staleness=1", dict(async_generation=True, max_staleness=1, generator_threads=1), 1),
    ("async, max_staleness=2", dict(async_generation=True, max_staleness=2, generator_threads=1), 1),
    ("async, max_staleness=1, hf-process", dict(async_generation=True, max_staleness=1, engine="hf-process",
                                                engine_args={"threads": 1}), 1),
    ("async, max_staleness=2, hf-process", dict(async_generation=True, max_staleness=2, engine="hf-process",
                                                engine_args={"threads": 1}), 1),
)
#: the reward-curve variants of ``--async``: how a stale sample's ratio is corrected
CORRECTION_VARIANTS = (
    ("sync (on-policy)", {}),
    ("async k=1: clip vs recomputed pi_prox, TIS on pi_prox/mu (decoupled PPO)",
     dict(async_generation=True, max_staleness=1, rollout_correction="tis")),
    ("async k=1: clip vs recomputed pi_prox, no behaviour weight (Meta's forge)",
     dict(async_generation=True, max_staleness=1)),
    ("async k=1: clip vs the sampler's mu (TRL's async trainer)",
     dict(async_generation=True, max_staleness=1, proximal_log_probs="sampler")),
)


def _timed_run(tokenizer, dataset, setting, workdir, changes, steps, threads):
    """One RLTrainer run of ``steps`` steps; per-step wall intervals, the sync run's sampling
    time, and the history."""
    torch.set_num_threads(threads)
    values = dict(max_completion_length=setting["max_completion_length"], learning_rate=LR, max_steps=steps,
                  save_steps=None, progress_bar=False, output_dir=str(workdir), report_to="none")
    cfg = demo_config(**{**values, **changes})
    trainer = RLTrainer(model=build_model(tokenizer, setting["no_eos"]), tokenizer=tokenizer, config=cfg,
                        reward_functions=[CopyDigitsReward()], train_dataset=dataset)
    ends, sampling = [], []
    train_step, rollout = trainer.train_step, rollouts.rollout

    def timed_step(step):
        metrics = train_step(step)
        ends.append(time.perf_counter())
        return metrics

    def timed_rollout(*a, **k):  # the synchronous run's sampling time (the generator's is logged)
        start = time.perf_counter()
        out = rollout(*a, **k)
        sampling.append(time.perf_counter() - start)
        return out

    trainer.train_step, rollouts.rollout = timed_step, timed_rollout  # the single-turn strategy's sampler
    begin = time.perf_counter()
    try:
        trainer.train()
    finally:
        rollouts.rollout = rollout
        trainer.close_engine()
    intervals = [b - a for a, b in zip([begin] + ends[:-1], ends)]
    return intervals, sampling, trainer.history


def async_comparison(args) -> str:
    """``--async``: the same GRPO run synchronous and asynchronous, side by side."""
    tokenizer = char_tokenizer()
    dataset = copy_digits_dataset(4096, seed=0)
    setting = SETTINGS[args.async_setting]
    skip = max(2, args.warmup)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        results = {label: [] for label, _, _ in ASYNC_VARIANTS}
        for rep in range(args.async_repeats):  # interleaved repeats: load changes hit every variant
            for label, changes, threads in ASYNC_VARIANTS:
                out = _timed_run(tokenizer, dataset, setting, Path(d) / f"throughput-{len(rows)}", changes,
                                 args.async_steps, threads)
                results[label].append(out)
                rows.append(label)
                print(f"[{label}: {statistics.median(out[0][skip:]) * 1e3:.0f} ms/step]", flush=True)
        curves = {label: [] for label, _ in CORRECTION_VARIANTS}
        for seed in range(args.curve_seeds):  # one seed is noise: the data order and samples change with it
            curve = dict(seed=seed, learning_rate=demo_config().learning_rate)  # the demo's own run
            for index, (label, changes) in enumerate(CORRECTION_VARIANTS):
                _, _, history = _timed_run(tokenizer, dataset, SETTINGS["short"], Path(d) / f"curve-{seed}-{index}",
                                           dict(changes, generator_threads=1, **curve) if changes else curve,
                                           args.curve_steps, 1 if changes else 2)
                curves[label].append([h["reward"] for h in history])
                print(f"[seed {seed}, {label}: reward {curves[label][-1][-1]:.3f}]", flush=True)
    torch.set_num_threads(args.threads)

    base = statistics.median(x for out in results["sync, 2 threads"] for x in out[0][skip:])
    lines = [
        "## Asynchronous generation: the same GRPO run synchronous and asynchronous (`bench_loop.py --async`)",
        "",
        f"Machine: {machine()}. The demo task (16 prompts x 8 samples, GRPO, lr {LR}, fp32) on the "
        f"{args.async_setting!r} setting (max_completion_length={setting['max_completion_length']}"
        f"{', an LM head that never samples eos' if setting['no_eos'] else ''}); {args.async_steps} steps per run, "
        f"{args.async_repeats} interleaved runs per variant, the first {skip} steps of each run not counted. "
        "Asynchronous runs: the generator thread and the trainer on one torch thread each (`generator_threads=1`, "
        "`torch.set_num_threads(1)`); synchronous runs with 2 threads (both cores for each phase) and with 1.",
        "",
        "| variant | ms / step (median) | steps / s vs sync, 2 threads | sampling ms / step | trainer waits | "
        "generator waits | staleness (mean) | reward, last 10 steps |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, _, _ in ASYNC_VARIANTS:
        runs = results[label]
        step = statistics.median(x for out in runs for x in out[0][skip:])
        histories = [h for out in runs for h in out[2][skip:]]
        total = sum(x for out in runs for x in out[0][skip:])
        if "async" in label:
            sampling = statistics.median(h["async/generation_seconds"] for h in histories)
            trainer_wait = sum(h["async/trainer_wait_seconds"] for h in histories) / total
            generator_wait = sum(h["async/generator_wait_seconds"] for h in histories) / total
            waits = f"{trainer_wait:.0%} | {generator_wait:.0%}"
            staleness = f"{statistics.mean(h['async/staleness'] for h in histories):.2f}"
        else:
            sampling = statistics.median(x for out in runs for x in out[1][skip:])
            share = sum(x for out in runs for x in out[1][skip:]) / total
            waits = f"{share:.0%} (sampling) | {1 - share:.0%} (training)"
            staleness = "0"
        reward = statistics.mean(h["reward"] for out in runs for h in out[2][-10:])
        lines.append(f"| {label} | {step * 1e3:.0f} | {base / step:.2f}x | {sampling * 1e3:.0f} | {waits} | "
                     f"{staleness} | {reward:.3f} |")
    lines += [
        "",
        "In the synchronous rows the two wait columns are the shares of the step spent sampling (the trainer "
        "idle) and training (the sampler idle).",
        "",
        f"### Reward curves at staleness 1: {args.curve_steps} steps of the demo (its settings: 'short', "
        f"lr {demo_config().learning_rate}), seeds 0-{args.curve_seeds - 1}",
        "",
        "Mean reward over 10 steps, averaged over the seeds (the range over seeds in brackets).",
        "",
        "| variant | first 10 steps | 10 steps mid-run | last 10 steps |",
        "| --- | ---: | ---: | ---: |",
    ]

    def window(runs, start, stop):
        means = [statistics.mean(r[start:stop]) for r in runs]
        return f"{statistics.mean(means):.3f} [{min(means):.3f}, {max(means):.3f}]"

    for label, runs in curves.items():
        middle = args.curve_steps // 2
        lines.append(f"| {label} | {window(runs, 0, 10)} | {window(runs, middle - 5, middle + 5)} | "
                     f"{window(runs, args.curve_steps - 10, args.curve_steps)} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short setting, 1 warm-up + 4 timed steps")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: steadier on a shared machine)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--block", type=int, default=1, help="steps per variant per interleaved round")
    parser.add_argument("--settings", default="short,long", help="of short, long (and medium)")
    parser.add_argument("--profile", action="store_true",
                        help="also time the phases of torchforge's step and of the hand-written loop")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "loop.md"))
    parser.add_argument("--multi-turn", action="store_true",
                        help="only the multi-turn section: rollout_episodes vs a single-turn rollout "
                             "(writes results/loop_multi_turn.md)")
    parser.add_argument("--async", dest="async_run", action="store_true",
                        help="only the asynchronous-generation section: sync against async at max_staleness 1 "
                             "and 2, and the reward curves of the stale-sample corrections "
                             "(writes results/loop_async.md)")
    parser.add_argument("--async-setting", default="long", choices=sorted(SETTINGS))
    parser.add_argument("--async-steps", type=int, default=20, help="steps per throughput run")
    parser.add_argument("--async-repeats", type=int, default=2, help="interleaved runs per throughput variant")
    parser.add_argument("--curve-steps", type=int, default=150, help="steps per reward-curve run")
    parser.add_argument("--curve-seeds", type=int, default=3, help="seeds per reward-curve variant")
    args = parser.parse_args()
    if args.async_run:
        if args.quick:
            args.async_steps, args.async_repeats, args.curve_steps, args.curve_seeds = 6, 1, 12, 1
        text = async_comparison(args)
        print(text)
        if not args.quick:
            (Path(__file__).parent / "results" / "loop_async.md").write_text(text)
        return
    if args.multi_turn:
        torch.set_num_threads(args.threads)
        text = multi_turn_overhead(args)
        print(text)
        if not args.quick:
            (Path(__file__).parent / "results" / "loop_multi_turn.md").write_text(text)
        return
    if args.quick:
        args.steps, args.warmup, args.block, args.settings = 4, 1, 1, "short"
    torch.set_num_threads(args.threads)
    if trl is None:
        print("TRL: skipped (`import trl` failed); see the docstring to install it in a separate environment")

    tokenizer = char_tokenizer()
    dataset = copy_digits_dataset(4096, seed=0)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name in args.settings.split(","):
            start = time.perf_counter()
            results[name] = run_setting(name, SETTINGS[name], args, tokenizer, dataset, Path(d) / name)
            print(f"[{name}: {time.perf_counter() - start:.0f} s]", flush=True)
        profiles = {}
        if args.profile:
            for name in args.settings.split(","):
                profiles[name] = phase_breakdown(SETTINGS[name], args.profile_steps, tokenizer, dataset,
                                                 Path(d) / f"{name}-profile")
    text = report(results, args, profiles)
    print(text)
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
