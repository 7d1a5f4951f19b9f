"""Benchmark: generation engines side by side, then a whole GRPO step of RLTrainer with each.

Generation (``--part gen``): the same model, prompts and sampling settings (32 prompts x 8
samples, temperature 1, no top-k / top-p, completions that run to the limit: the random
model's stop id is one no one samples), each variant in turn, ``--repeats`` rounds, median:

- ``hf seeded``: :class:`torchforge.loop.HFEngine` (``generate`` with the seeded sampler,
  the default engine: exact per-sample seeds, the sampler's log-probs);
- ``hf generate``: plain ``model.generate(do_sample=True, top_k=0)`` (no per-sample seeds,
  no log-probs): what HF sampling costs without torchforge's sampler;
- ``vllm``: :class:`torchforge.loop.vllm_engine.VLLMEngine` (in this process);
- ``vllm server``: :class:`torchforge.loop.vllm_engine.VLLMServerEngine` (a ``vllm serve``
  process on 127.0.0.1, one HTTP request per sample).

Models: ``tiny`` (the demo's Llama with 2 heads of 32, V=15) and ``100m`` (a Llama of
hidden 768, 8 layers, 12 heads, V=32000: 106M parameters), float32, built from a config.
Reported: generated tokens per second and the ratio to ``hf seeded``; weight-sync time
(``update_weights`` with the model's full weights) per engine.

Whole step (``--part step``): ``RLTrainer.train_step`` on the demo task (16 prompts x 8, 4
tokens; the demo's Llama with 2 heads of 32 for every engine) with ``engine="hf"``,
``"vllm"`` and ``"vllm-server"`` (each its own trainer, the same seed), median step time over ``--steps`` steps after 2 warm-up steps, and the time of
the engine sync inside it.

vLLM's CPU build needs its own environment (it pins transformers < 5.20): see the README's
Engines section. Without vLLM the vLLM rows are skipped. On a GPU machine with vLLM's CUDA
build, ``python benchmarks/bench_rollout.py`` runs the same on CUDA (``gpu_rollout.sh``).

Prefix cache (``--part prefix``, the 106M model): vLLM in process with its prefix cache off and
on, 4 prompts of 256 tokens x 8 copies each (a GRPO step's group), 16 new tokens.

Threads (``--part threads``): ``hf seeded`` and vLLM in process at 1, 2, 4 and 8 torch threads
(those the machine has), 32 x 8 requests of 32 new tokens.

``--profile`` instead times the phases of the step (sampling, the rest of the rollout,
scoring, log-prob recomputation, the update, metrics, weight sync, other) per engine and
writes benchmarks/results/rollout_profile.md (``--profile-model 100m``: the same step on the
106M Llama, 2 prompts x 8, 16 tokens, into rollout_profile_100m.md).

Usage: python benchmarks/bench_rollout.py [--quick] [--part gen,sync,prefix,threads,step] [--models tiny,100m]
       [--new-tokens 64] [--repeats 3] [--steps 5] [--profile [--profile-model 100m] [--engines hf,vllm]]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from torchforge.distributed import full_weights
from torchforge.loop import HFEngine, SamplingSettings
from torchforge.loop.engines import request_seeds

HERE = Path(__file__).resolve().parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def build_model(name: str, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from torchforge.trainer.demo import char_tokenizer, tiny_llama

    tokenizer = char_tokenizer()
    if name == "tiny":
        return tiny_llama(tokenizer, num_heads=2, seed=0).to(device).eval(), tokenizer
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).eval(), tokenizer


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def generation(models, new_tokens, repeats, num_prompts, group, device) -> list[str]:
    from torchforge.loop.vllm_engine import VLLMEngine, VLLMServerEngine

    lines = ["| model | params | new tokens | variant | tokens / s (median) | vs hf seeded | weight sync (s) |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for name in models:
        model, tokenizer = build_model(name, device)
        vocab = model.config.vocab_size
        params = sum(p.numel() for p in model.parameters())
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, vocab, (16,), generator=generator).tolist() for _ in range(num_prompts)]
        requests = [p for p in prompts for _ in range(group)]
        seeds = request_seeds(0, range(num_prompts), group)
        stop = vocab - 1 if name == "100m" else 0  # an id the model (almost) never samples: full-length completions
        for T in new_tokens:
            settings = SamplingSettings(max_new_tokens=T, stop_token_ids=(stop,))
            engines = {"hf seeded": HFEngine(model, pad_token_id=0)}
            if HAS_VLLM:
                kwargs = dict(dtype="float32", max_model_len=16 + T)
                engines["vllm"] = VLLMEngine.from_model(model, tokenizer, **kwargs)
                engines["vllm server"] = VLLMServerEngine.from_model(model, tokenizer, **kwargs)

            def plain():
                ids = torch.tensor(requests, device=device)
                return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                      top_p=1.0, max_new_tokens=T, min_new_tokens=T, pad_token_id=0)

            runs = {key: [] for key in ["hf seeded", "hf generate", *[k for k in engines if k != "hf seeded"]]}
            tokens = {}
            for _ in range(repeats):
                for key in runs:
                    if key == "hf generate":
                        seconds, out = timed(plain, device)
                        tokens[key] = out.shape[0] * (out.shape[1] - 16)
                    else:
                        seconds, out = timed(lambda: engines[key].generate(requests, seeds=seeds, settings=settings), device)
                        tokens[key] = sum(len(c.token_ids) for c in out)
                    runs[key].append(tokens[key] / seconds)
            syncs = {}
            for key, engine in engines.items():
                if key != "hf seeded":
                    syncs[key] = statistics.median(timed(lambda: engine.update_weights(full_weights(model), version=1), device)[0]
                                                   for _ in range(3))
            base = statistics.median(runs["hf seeded"])
            for key, values in runs.items():
                rate = statistics.median(values)
                sync = f"{syncs[key]:.3f}" if key in syncs else "-"
                lines.append(f"| {name} | {params / 1e6:.1f}M | {T} | {key} | {rate:,.0f} | {rate / base:.2f}x | {sync} |")
                print(lines[-1], flush=True)
            for engine in engines.values():
                if hasattr(engine, "close"):
                    engine.close()
            del engines
            gc.collect()
    return lines


def whole_step(steps: int, device: torch.device) -> list[str]:
    from torchforge import RLTrainer
    from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, demo_config, tiny_llama

    lines = ["| engine | step (ms, median) | step time vs hf | engine sync in it (ms) | reward at the last step |",
             "| --- | ---: | ---: | ---: | ---: |"]
    engines = ["hf", *(["vllm", "vllm-server"] if HAS_VLLM else [])]
    results = {}
    for engine in engines:
        with tempfile.TemporaryDirectory() as out:
            config = demo_config(engine=engine, output_dir=out, progress_bar=False, save_steps=None,
                                 engine_args={"dtype": "float32"} if engine != "hf" else None)
            tokenizer = char_tokenizer()  # the same 2-head model for every engine (vLLM's CPU attention: >= 32 dims)
            trainer = RLTrainer(model=tiny_llama(tokenizer, num_heads=2, seed=0), tokenizer=tokenizer, config=config,
                                reward_functions=[CopyDigitsReward()], train_dataset=copy_digits_dataset(4096))
            times, syncs, rewards = [], [], []
            for step in range(steps + 2):
                seconds, metrics = timed(lambda: trainer.train_step(step), device)
                if step >= 2:
                    times.append(seconds)
                    syncs.append(metrics.get("engine/sync_seconds", 0.0))
                    rewards.append(metrics["reward"])
            trainer.close_engine()
        results[engine] = (statistics.median(times), statistics.median(syncs), rewards[-1])
    base = results["hf"][0]
    for engine, (seconds, sync, reward) in results.items():
        lines.append(f"| {engine} | {seconds * 1e3:.0f} | {seconds / base:.2f}x | {sync * 1e3:.1f} | {reward:.3f} |")
        print(lines[-1], flush=True)
    return lines


def weight_sync(models, repeats, device) -> list[str]:
    """``update_weights`` with a model's full weights per engine against the memory floor: one
    batched ``torch._foreach_copy_`` of the same tensors into preallocated ones."""
    from torchforge.loop.process_engine import HFProcessEngine

    lines = ["| model | weights MiB | variant | sync ms (median) | x floor |", "| --- | ---: | --- | ---: | ---: |"]
    for name in models:
        model, tokenizer = build_model(name, device)
        weights = [t for _, t in full_weights(model)]
        size = sum(t.numel() * t.element_size() for t in weights)
        copies = [torch.empty_like(t) for t in weights]
        own = [t for _, t in full_weights(build_model(name, device)[0])]

        def per_tensor_copy():  # the previous HFEngine.update_weights: a name map per call, one copy_ each
            mapping = dict(zip([n for n, _ in full_weights(model)], own))
            for key, tensor in full_weights(model):
                mapping[key].copy_(tensor)

        variants = {"floor (one batched copy)": lambda: torch._foreach_copy_(copies, weights),
                    "per-tensor copy (before)": per_tensor_copy}
        copy_engine = HFEngine(build_model(name, device)[0])
        variants["hf copy (HFEngine.update_weights)"] = lambda: copy_engine.update_weights(full_weights(model), version=1)
        engines = []
        if device.type == "cpu":
            engines.append(HFProcessEngine(model, threads=1))
            variants["hf-process"] = lambda: engines[0].update_weights(full_weights(model), version=1)
        if HAS_VLLM:
            from torchforge.loop.vllm_engine import VLLMEngine

            engines.append(VLLMEngine.from_model(model, tokenizer, dtype="float32", max_model_len=128))
            variants["vllm (in process)"] = lambda: engines[-1].update_weights(full_weights(model), version=1)
        runs = {key: [] for key in variants}
        for _ in range(repeats):
            for key, fn in variants.items():
                runs[key].append(timed(fn, device)[0])
        floor = statistics.median(runs["floor (one batched copy)"])
        for key, values in runs.items():
            ms = statistics.median(values)
            lines.append(f"| {name} | {size / 2**20:.1f} | {key} | {ms * 1e3:.2f} | {ms / floor:.1f}x |")
            print(lines[-1], flush=True)
        for engine in engines:
            engine.close()
        gc.collect()
    return lines


def prefix_caching(models, repeats, device, prompt_tokens: int = 256, num_prompts: int = 4, group: int = 8,
                   new_tokens: int = 16) -> list[str]:
    """vLLM in process with its prefix cache on (vLLM's default, and torchforge's) and off: a GRPO
    step's requests are ``group`` copies of each prompt, so with the cache a prompt's full KV blocks
    are computed once and the other copies reuse them. One engine at a time (vLLM runs one in process)."""
    from torchforge.loop.vllm_engine import VLLMEngine

    lines = ["| model | prompt tokens | requests | new tokens | prefix cache | ms per generate (median) | vs off |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for name in models:
        model, tokenizer = build_model(name, device)
        vocab = model.config.vocab_size
        generator = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, vocab, (prompt_tokens,), generator=generator).tolist() for _ in range(num_prompts)]
        requests = [p for p in prompts for _ in range(group)]
        seeds = request_seeds(0, range(num_prompts), group)
        settings = SamplingSettings(max_new_tokens=new_tokens, stop_token_ids=(vocab - 1 if name == "100m" else 0,))
        times = {}
        for enabled in (False, True):
            engine = VLLMEngine.from_model(model, tokenizer, dtype="float32", max_model_len=prompt_tokens + new_tokens,
                                           enable_prefix_caching=enabled)
            engine.generate(requests[:group], seeds=seeds[:group], settings=settings)  # warm-up
            runs = []
            for _ in range(repeats):
                engine.llm.reset_prefix_cache()  # every step starts cold: new weights, new prompts
                runs.append(timed(lambda: engine.generate(requests, seeds=seeds, settings=settings), device)[0])
            times[enabled] = statistics.median(runs)
            engine.close()
            del engine
            gc.collect()
        for enabled in (False, True):
            lines.append(f"| {name} | {prompt_tokens} | {num_prompts} x {group} | {new_tokens} | "
                         f"{'on' if enabled else 'off'} | {times[enabled] * 1e3:.0f} | {times[enabled] / times[False]:.2f}x |")
            print(lines[-1], flush=True)
    return lines


def thread_counts(models, repeats, device, new_tokens: int = 32) -> list[str]:
    """``hf seeded`` and vLLM in process at 1, 2, 4, 8 torch threads (those the machine has): the
    same 32 x 8 requests. vLLM in process runs on this process's torch threads (torchforge sets
    ``VLLM_CPU_OMP_THREADS_BIND=nobind``), so ``torch.set_num_threads`` sets both."""
    from torchforge.loop.vllm_engine import VLLMEngine

    counts = [n for n in (1, 2, 4, 8) if n <= (os.cpu_count() or 1)]
    lines = ["| model | threads | hf seeded tokens / s | vllm tokens / s | vllm / hf seeded |",
             "| --- | ---: | ---: | ---: | ---: |"]
    before = torch.get_num_threads()
    for name in models:
        model, tokenizer = build_model(name, device)
        vocab = model.config.vocab_size
        generator = torch.Generator().manual_seed(1)
        requests = [p for p in [torch.randint(3, vocab, (16,), generator=generator).tolist() for _ in range(32)]
                    for _ in range(8)]
        seeds = request_seeds(0, range(32), 8)
        settings = SamplingSettings(max_new_tokens=new_tokens, stop_token_ids=(vocab - 1 if name == "100m" else 0,))
        engines = {"hf": HFEngine(model, pad_token_id=0),
                   "vllm": VLLMEngine.from_model(model, tokenizer, dtype="float32", max_model_len=16 + new_tokens)}
        for threads in counts:
            torch.set_num_threads(threads)
            rates = {}
            for key, engine in engines.items():
                engine.generate(requests[:8], seeds=seeds[:8], settings=settings)  # warm-up at this count
                runs = []
                for _ in range(repeats):
                    seconds, out = timed(lambda: engine.generate(requests, seeds=seeds, settings=settings), device)
                    runs.append(sum(len(c.token_ids) for c in out) / seconds)
                rates[key] = statistics.median(runs)
            lines.append(f"| {name} | {threads} | {rates['hf']:,.0f} | {rates['vllm']:,.0f} | {rates['vllm'] / rates['hf']:.2f}x |")
            print(lines[-1], flush=True)
        engines["vllm"].close()
        del engines
        gc.collect()
    torch.set_num_threads(before)
    return lines


PHASES = ["sampling (engine.generate)", "rollout, besides generate", "scoring (reward functions)",
          "log-prob recomputation (ref / old, no grad)", "update (forward, loss, backward, AdamW)", "metrics",
          "weight sync", "other"]


# the profile's models: the demo's (16 prompts x 8, 4 tokens) and the 106M Llama of the generation
# table on the demo's prompts and reward (its 32000 ids past the demo's 15 decode to <unk>, so the
# reward stays near 0: the step's time, not its learning); fewer, longer completions at 106M
PROFILE_TASKS = {"tiny": {"prompts_per_step": 16, "max_completion_length": 4},
                 "100m": {"prompts_per_step": 2, "max_completion_length": 16}}


def step_profile(steps: int, device: torch.device, engines: list[str], model_name: str = "tiny") -> list[str]:
    """Median wall ms per step and phase of ``RLTrainer.train_step`` on the demo, per engine."""
    import torchforge.trainer.rollouts as strategy
    import torchforge.trainer.trainer as trainer_module
    from bench_loop import _Phases
    from torchforge import RLTrainer
    from torchforge.loop import engines as engines_module
    from torchforge.loop.process_engine import HFProcessEngine
    from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, demo_config, tiny_llama

    per: dict[str, dict[str, list[float]]] = {}
    for engine in engines:
        with tempfile.TemporaryDirectory() as out:
            config = demo_config(engine=engine, output_dir=out, progress_bar=False, save_steps=None,
                                 engine_args={"dtype": "float32"} if engine.startswith("vllm") else None,
                                 **PROFILE_TASKS[model_name])
            tokenizer = char_tokenizer()
            model = (tiny_llama(tokenizer, num_heads=2, seed=0) if model_name == "tiny"
                     else build_model(model_name, device)[0].train())
            trainer = RLTrainer(model=model, tokenizer=tokenizer, config=config,
                                reward_functions=[CopyDigitsReward()], train_dataset=copy_digits_dataset(4096))
            for step in range(2):
                trainer.train_step(step)
            rows = per.setdefault(engine, {})
            with _Phases(clock=time.perf_counter) as ph:  # wall time: some engines generate in another process
                generators = [engines_module.HFEngine, HFProcessEngine]
                if HAS_VLLM:
                    from torchforge.loop.vllm_engine import VLLMEngine, VLLMServerEngine
                    generators += [VLLMEngine, VLLMServerEngine]
                for cls in generators:
                    ph.wrap(cls, "generate", PHASES[0])
                ph.wrap(strategy, "rollout", "rollout")
                ph.wrap(strategy, "score_rewards", PHASES[2])
                ph.wrap(trainer_module.RLTrainer, "_reference_log_probs", PHASES[3])
                ph.wrap(trainer_module.RLTrainer, "_update", PHASES[4])
                ph.wrap(trainer_module.RLTrainer, "_metrics", PHASES[5])
                ph.wrap(trainer_module.RLTrainer, "_sync_engine", PHASES[6])
                ph.wrap(trainer_module.RLTrainer, "_publish_weights", PHASES[6])
                for step in range(2, steps + 2):
                    ph.acc.clear()
                    start = time.perf_counter()
                    trainer.train_step(step)
                    total = time.perf_counter() - start
                    acc = dict(ph.acc)
                    acc[PHASES[1]] = acc.pop("rollout", 0.0) - acc.get(PHASES[0], 0.0)
                    acc["other"] = total - sum(acc.get(p, 0.0) for p in PHASES[:-1])
                    acc["total"] = total
                    for label in [*PHASES, "total"]:
                        rows.setdefault(label, []).append(acc.get(label, 0.0))
            trainer.close_engine()
    lines = ["| phase | " + " | ".join(f"`{e}` ms" for e in engines) + " |",
             "| --- |" + " ---: |" * len(engines)]
    for label in [*PHASES, "total"]:
        cells = [f"{1e3 * statistics.median(per[e][label]):.1f}" for e in engines]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: the tiny model, 16 tokens, 1 repeat, 2 steps")
    parser.add_argument("--part", default="gen,step", help="comma-separated: gen, sync, prefix, threads, step")
    parser.add_argument("--models", default="tiny,100m")
    parser.add_argument("--new-tokens", default="64", help="comma-separated completion lengths, e.g. 64,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="only the step's phases (wall ms per step: sampling, rollout, scoring, recomputed "
                             "log-probs, update, metrics, weight sync, other) per engine; writes "
                             "benchmarks/results/rollout_profile.md")
    parser.add_argument("--profile-model", default="tiny", choices=sorted(PROFILE_TASKS),
                        help="with --profile: the demo's model (tiny) or the 106M Llama (100m, its own results file)")
    parser.add_argument("--engines", default=None, help="with --profile: comma-separated engines "
                        "(default hf, hf-process and, with vLLM, vllm, vllm-server)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models, new_tokens = args.models.split(","), [int(t) for t in args.new_tokens.split(",")]
    repeats, steps = args.repeats, args.steps
    if args.quick:
        models, new_tokens, repeats, steps = ["tiny"], [16], 1, 2
    machine = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    sections = [f"# rollout\n\nMachine: {machine}; torch {torch.__version__}; vLLM "
                f"{'present' if HAS_VLLM else 'absent (its rows are skipped)'}. 32 prompts x 8 samples, prompts of 16 "
                "tokens, temperature 1, completions to the limit, float32.\n"]
    if args.profile:
        engines = args.engines.split(",") if args.engines else ["hf", "hf-process", *(["vllm", "vllm-server"] if HAS_VLLM else [])]
        task = PROFILE_TASKS[args.profile_model]
        model_words = "the 2-head demo Llama" if args.profile_model == "tiny" else "the 106M Llama of the generation table"
        suffix = "" if args.profile_model == "tiny" else f"_{args.profile_model}"
        text = (f"# rollout_profile{suffix}\n\nMachine: {machine}; torch {torch.__version__}; threads {torch.get_num_threads()}. "
                f"Where the time of one GRPO step of RLTrainer on the demo goes ({task['prompts_per_step']} prompts x 8, "
                f"{task['max_completion_length']} tokens, {model_words}), per engine: median wall ms over {steps} steps "
                f"after 2 warm-up steps (`python benchmarks/bench_rollout.py --profile --profile-model {args.profile_model}`).\n\n"
                + "\n".join(step_profile(steps, device, engines, args.profile_model))
                + "\n\nPhases are timed by wrapping `engine.generate`, the single-turn `rollout` (less its generate), "
                "`score_rewards`, `RLTrainer._reference_log_probs`, `._update`, `._metrics` and `._sync_engine`; "
                "other: what the step spends outside them (advantages, batch moves, the step's bookkeeping).\n")
        print(text)
        if not args.quick:
            (HERE / "results" / f"rollout_profile{suffix}.md").write_text(text)
        return
    parts = args.part.split(",")
    if "gen" in parts:
        sections.append("## Generation\n\n" + "\n".join(generation(models, new_tokens, repeats, 32, 8, device)) + "\n")
    if "sync" in parts:  # its own page: benchmarks/results/weight_sync.md
        text = (f"# weight_sync\n\nMachine: {machine}; torch {torch.__version__}; threads {torch.get_num_threads()}. "
                "`update_weights` with a model's full weights, each variant in turn, median of "
                f"{max(repeats, 5)} (`python benchmarks/bench_rollout.py --part sync`).\n\n"
                + "\n".join(weight_sync(models, max(repeats, 5), device))
                + "\n\nFloor: one `torch._foreach_copy_` of the model's tensors into preallocated ones (the "
                "bytes a sync must move, once). vLLM's CPU build repacks every linear layer's weight for its "
                "GEMM kernel (oneDNN) after loading, so its sync allocates and reorders each time.\n")
        if not args.quick:
            (HERE / "results" / "weight_sync.md").write_text(text)
        parts = [p for p in parts if p != "sync"]
        if not parts:
            return
    if "prefix" in parts and HAS_VLLM:
        sections.append("## vLLM's prefix cache over a group's copies of one prompt\n\n"
                        + "\n".join(prefix_caching(models, repeats, device)) + "\n")
    if "threads" in parts and HAS_VLLM:
        sections.append("## Threads: HF and vLLM in process at 1, 2, 4, 8 CPU threads (those the machine has)\n\n"
                        + "\n".join(thread_counts(models, repeats, device)) + "\n")
    if "step" in parts:
        sections.append(f"## One GRPO step of RLTrainer on the demo (16 prompts x 8, 4 tokens), median of {steps}\n\n"
                        + "\n".join(whole_step(steps, device)) + "\n")
    if not args.quick:
        path = HERE / "results" / "rollout.md"
        if path.exists():  # keep the recorded sections this run did not measure, in their order
            fresh = {section.split("\n", 1)[0]: section for section in sections[1:]}
            kept = ["## " + old for old in path.read_text().split("\n## ")[1:]]
            merged = [fresh.pop(old.split("\n", 1)[0], old.rstrip() + "\n") for old in kept]
            sections = [sections[0], *merged, *fresh.values()]
        path.write_text("\n".join(sections))


if __name__ == "__main__":
    main()
