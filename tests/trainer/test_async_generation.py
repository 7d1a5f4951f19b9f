"""Asynchronous generation: the staleness bound, staleness 0 = the synchronous run, resume,
Ctrl-C, multi-turn episodes, two processes, and the generator's own rules."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.trainer.async_generation import AsyncGenerator
from torchforge.trainer.config import RLConfig
from torchforge.trainer.run_dir import RunInterrupted
from torchforge.trainer.trainer import RLTrainer


# --- the generator alone ----------------------------------------------------------------------

class VersionOnly:
    """An engine stand-in that records the versions it was given."""

    def __init__(self):
        self.weights_version = 0
        self.loads = []

    def update_weights(self, weights, *, version):
        self.loads.append(version)
        self.weights_version = version


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_every_step_is_sampled_within_the_bound_and_none_is_dropped(max_staleness):
    engine, steps = VersionOnly(), 12
    sampled = []
    ahead = []

    def sample(step):
        sampled.append((step, engine.weights_version))
        time.sleep(0.002)
        return step

    gen = AsyncGenerator(sample, engine, start=0, end=steps, version=0, max_staleness=max_staleness).start_thread()
    trained = []
    for step in range(steps):
        item, metrics = gen.take(step)
        trained.append((item.step, item.version, item.payload))
        ahead.append(metrics["async/buffer_size"])
        time.sleep(0.01)  # the trainer is the slow side: the generator runs as far ahead as allowed
        gen.publish(step + 1, [("w", torch.zeros(1))])
    gen.close()
    assert [t[0] for t in trained] == list(range(steps)) == [t[2] for t in trained]  # in order, none lost
    assert [s for s, _ in sampled] == list(range(steps))  # each sampled once ("finish")
    assert all(0 <= step - version <= max_staleness for step, version, _ in trained)
    assert max(step - version for step, version, _ in trained) == max_staleness  # the bound is reached
    assert max(ahead) <= max_staleness + 1


def test_restart_samples_a_batch_again_when_new_weights_arrive_during_it():
    engine = VersionOnly()
    started = threading.Event()

    def sample(step):
        if step == 1 and engine.weights_version == 0:
            started.set()
            time.sleep(0.3)  # the trainer publishes version 1 meanwhile
        return engine.weights_version

    gen = AsyncGenerator(sample, engine, start=0, end=2, version=0, max_staleness=1,
                         partial_rollouts="restart").start_thread()
    first, _ = gen.take(0)
    started.wait(5)
    gen.publish(1, [])
    second, metrics = gen.take(1)
    gen.close()
    assert (first.version, second.version, second.payload, metrics["async/restarts"]) == (0, 1, 1, 1.0)


def test_a_failing_sample_is_raised_by_take_and_close_stops_the_thread():
    def sample(step):
        if step == 1:
            raise ValueError("grader exploded")
        return step

    gen = AsyncGenerator(sample, VersionOnly(), start=0, end=5, version=0, max_staleness=2).start_thread()
    assert gen.take(0)[0].payload == 0
    with pytest.raises(TorchforgeError, match=r"sampling failed \(ValueError: grader exploded\)"):
        gen.take(1)
    blocked = AsyncGenerator(lambda step: step, VersionOnly(), start=0, end=5, version=0, max_staleness=0).start_thread()
    blocked.take(0)  # step 1 waits for version 1, which never comes
    blocked.close(timeout=5)
    assert not blocked._thread.is_alive()
    with pytest.raises(TorchforgeError, match="stopped before step 1"):
        blocked.take(1)


def test_generator_settings_are_checked():
    with pytest.raises(InvalidArgumentError, match=r"AsyncGenerator: max_staleness=-1; expected an int >= 0"):
        AsyncGenerator(lambda s: s, VersionOnly(), start=0, end=1, version=0, max_staleness=-1)
    with pytest.raises(InvalidArgumentError, match=r"partial_rollouts='abort'; expected one of \['finish', 'restart'\]"):
        AsyncGenerator(lambda s: s, VersionOnly(), start=0, end=1, version=0, max_staleness=0, partial_rollouts="abort")


@pytest.mark.parametrize("changes, message", [
    (dict(async_generation="yes"), r"async_generation='yes'; expected True or False"),
    (dict(async_generation=True, max_staleness=-1), r"max_staleness=-1; expected an int >= 0"),
    (dict(async_generation=True, partial_rollouts="abort"), r"partial_rollouts='abort'; expected one of"),
    (dict(proximal_log_probs="old"), r"proximal_log_probs='old'; expected one of \['recomputed', 'sampler'\]"),
    (dict(async_generation=True, dynamic_sampling=True), r"async_generation with dynamic_sampling; expected one"),
    (dict(async_generation=True, max_staleness=1, engine_sync_steps=3),
     r"engine_sync_steps=3 and max_staleness=1; expected 1 <= engine_sync_steps <= max_staleness \+ 1"),
    (dict(async_generation=True, engine_sync_steps=0), r"engine_sync_steps=0 and max_staleness=1"),
])
def test_config_errors(changes, message):
    with pytest.raises(InvalidArgumentError, match=message):
        RLConfig(**changes)


# --- the trainer --------------------------------------------------------------------------------

def config(tmp_path, name, **changes):
    values = dict(max_steps=4, prompts_per_step=4, num_generations=4, max_completion_length=6, kl_coef=0.05,
                  learning_rate=1e-2, mixed_precision="fp32", gradient_checkpointing=False, progress_bar=False,
                  output_dir=str(tmp_path / name), save_steps=None)
    values.update(changes)
    return RLConfig(**values)


def trained_versions(trainer):
    """Record (step, policy_version of each trained row) of every update."""
    seen, update = [], trainer._update

    def recording(batch):
        seen.append((trainer.step_being_trained, batch.policy_version.tolist()))
        return update(batch)

    step = trainer.train_step

    def train_step(s):
        trainer.step_being_trained = s
        return step(s)

    trainer._update, trainer.train_step = recording, train_step
    return seen


def test_staleness_zero_equals_the_synchronous_run_bit_for_bit(tmp_path):
    runs = {}
    for name, changes in (("sync", {}), ("async", dict(async_generation=True, max_staleness=0))):
        trainer = RLTrainer(config=config(tmp_path, name, **changes))
        trainer.train()
        runs[name] = trainer
    sync, asynchronous = runs["sync"], runs["async"]
    for a, b in zip(sync.history, asynchronous.history):
        for key in ("loss", "reward", "kl", "grad_norm", "entropy", "completions/mean_length"):
            assert a[key] == b[key], (a["step"], key)
        assert b["async/staleness"] == 0.0
    for (name, p), (_, q) in zip(sync.model.state_dict().items(), asynchronous.model.state_dict().items()):
        assert torch.equal(p, q), name
    assert not any(t.name == "torchforge-generator" for t in threading.enumerate())


def test_with_staleness_k_every_sample_is_trained_within_k_steps_of_its_weights(tmp_path):
    k = 2
    trainer = RLTrainer(config=config(tmp_path, "k2", async_generation=True, max_staleness=k, max_steps=6))
    seen = trained_versions(trainer)
    update = trainer._update

    def slow_update(batch):  # training slower than sampling: the generator runs k steps ahead
        time.sleep(0.4)
        return update(batch)

    trainer._update = slow_update
    trainer.train()
    staleness = [step - v for step, versions in seen for v in versions]
    assert [s for s, _ in seen] == list(range(6))
    assert all(0 <= s <= k for s in staleness) and max(staleness) == k
    logged = [h["async/staleness"] for h in trainer.history]
    assert logged == [step - sum(v) / len(v) for step, v in seen] == [h["rollout/staleness"] for h in trainer.history]
    for h in trainer.history:
        assert 1 <= h["async/buffer_size"] <= k + 1 and h["async/trainer_wait_seconds"] >= 0
        assert h["engine/weights_version"] >= h["step"] - 1 - k
    # the decoupled loss: the clipped ratio is against the step's own weights (1 on the first
    # pass), the behaviour factor pi_prox / mu moves off 1 on stale batches
    assert all(h["ratio_mean"] == pytest.approx(1.0, abs=1e-6) for h in trainer.history)
    stale = [h for h in trainer.history if h["async/staleness"] > 0]
    assert stale and all(abs(h["async/behaviour_ratio_mean"] - 1) > 1e-4 for h in stale)


def test_clipping_against_the_sampler_uses_its_log_probs(tmp_path):
    trainer = RLTrainer(config=config(tmp_path, "sampler", async_generation=True, max_staleness=1, max_steps=3,
                                      proximal_log_probs="sampler"))
    seen = trained_versions(trainer)
    update = trainer._update
    trainer._update = lambda batch: (time.sleep(0.3), update(batch))[1]
    trainer.train()
    stale = [h for h, (_, v) in zip(trainer.history, seen) if h["step"] - 1 - max(v) > 0]
    assert stale and all(abs(h["ratio_mean"] - 1) > 1e-4 for h in stale)  # pi_theta / mu
    assert all(h["async/behaviour_ratio_mean"] == 1.0 for h in trainer.history)  # nothing left between them


def _trained_prompts(trainer, taken=None):
    """Record (step, prompts) of every batch the trainer takes from its generator, into ``taken``."""
    taken = [] if taken is None else taken
    start = trainer._started_generator

    def started(step):
        gen = start(step)
        if not getattr(gen, "_recorded", False):
            take = gen.take

            def recording(s, **kw):
                sampled, metrics = take(s, **kw)
                taken.append((s, [row["prompt"] for row in sampled.payload.rows]))
                return sampled, metrics

            gen.take, gen._recorded = recording, True
        return gen

    trainer._started_generator = started
    return taken


def test_ctrl_c_stops_both_sides_and_resume_loses_no_prompt_and_repeats_none(tmp_path):
    whole = RLTrainer(config=config(tmp_path, "whole", async_generation=True, max_staleness=2, max_steps=5))
    expected = _trained_prompts(whole)
    whole.train()

    first = RLTrainer(config=config(tmp_path, "cut", async_generation=True, max_staleness=2, max_steps=5))
    taken = _trained_prompts(first)
    step = first.train_step

    def interrupted(s):
        if s == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during step 1: the run stops after it
            time.sleep(0.05)
        return step(s)

    first.train_step = interrupted
    with pytest.raises(RunInterrupted, match="stopped at step 2"):
        first.train()
    assert not any(t.name == "torchforge-generator" and t.is_alive() for t in threading.enumerate())
    assert (tmp_path / "cut" / "checkpoints" / "step-000002").is_dir()
    second = RLTrainer(config=config(tmp_path, "cut", async_generation=True, max_staleness=2, max_steps=5,
                                     resume=True))
    _trained_prompts(second, taken)
    second.train()
    assert taken == expected  # every step's prompts trained once, in order, across the cut
    steps = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_multi_turn_episodes_train_asynchronously(tmp_path):
    from torchforge.trainer.demo_episodes import AskThenCopy, multi_turn_demo_config

    cfg = multi_turn_demo_config(max_steps=3, prompts_per_step=2, num_generations=4, progress_bar=False,
                                 output_dir=str(tmp_path / "episodes"), save_steps=None, async_generation=True,
                                 max_staleness=1)
    trainer = RLTrainer(config=cfg, environment_factory=AskThenCopy)
    trainer.train()
    for h in trainer.history:
        assert 1.0 <= h["episodes/turns_mean"] <= 2.0 and h["async/staleness"] <= 1
        assert h["reward"] == pytest.approx(h["rewards/environment/mean"])


def test_two_processes_at_staleness_zero_equal_one_synchronous_process(tmp_path):
    # FSDP2 on 2 gloo processes, each with its own generator, from the command line
    from torchforge.trainer.cli import main

    common = ["max_steps=2", "prompts_per_step=4", "num_generations=4", "kl_coef=0.05", "progress_bar=false",
              "learning_rate=1e-2", "max_completion_length=6", "distributed_strategy=fsdp"]
    runs = {}
    for name, extra in (("one", []), ("two", ["--nproc", "2", "async_generation=true", "max_staleness=0"])):
        assert main(["train", *extra[:2], *common, *extra[2:], f"output_dir={tmp_path / name}"]) == 0
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(runs["one"], runs["two"]):
        for key in ("loss", "reward", "kl", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
        assert b["async/staleness"] == 0.0


def test_lora_publishes_merged_weights_to_the_generation_copy(tmp_path):
    # staleness 0: every batch is sampled by the copy with the adapters merged in, so the
    # sampler's log-probs equal the trainer's (float32 noise) while the adapters move
    pytest.importorskip("peft")
    trainer = RLTrainer(config=config(tmp_path, "lora", async_generation=True, max_staleness=0,
                                      lora={"rank": 4, "alpha": 8.0}))
    trainer.train()
    assert max(h["rollout/log_prob_gap"] for h in trainer.history) < 1e-5
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert max(float(p.abs().max()) for p in lora_b) > 1e-3
