"""One run per output_dir: refusing to mix runs, --overwrite, --resume of a finished run, Ctrl-C.

The behaviour is tested through the ``torchforge`` command in a subprocess, as a user runs it.
"""

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchforge.trainer.cli import main
from torchforge.trainer.run_dir import (
    RUN_FILES,
    StopOnInterrupt,
    earlier_run,
    holds_run,
    last_checkpoint_step,
    prepare_output_dir,
    truncate_metrics,
)
from torchforge.errors import InvalidArgumentError

QUICK = ["prompts_per_step=4", "num_generations=4", "progress_bar=false"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def torchforge(*args, **kwargs):
    """The ``torchforge`` command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "torchforge", *args], capture_output=True, text=True,
                          env=ENV, timeout=600, **kwargs)


def _snapshot(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_a_new_run_into_a_run_folder_is_refused_and_changes_nothing_then_overwrite_replaces_it(tmp_path):
    run = tmp_path / "a"
    assert main(["train", *QUICK, "max_steps=3", "save_steps=1", f"output_dir={run}"]) == 0
    before = _snapshot(run)
    out = torchforge("train", *QUICK, "max_steps=2", "save_steps=1", "learning_rate=0.01", f"output_dir={run}")
    assert out.returncode == 2
    line = _one_error_line(out.stderr)
    assert "already holds a run (checkpoint at step 3)" in line
    assert "--resume" in line and "--overwrite" in line and "new output_dir" in line
    assert _snapshot(run) == before  # not one byte, not one mtime

    (run / "notes.txt").write_text("mine")  # a file that is not the run's is kept
    out = torchforge("train", "--overwrite", *QUICK, "max_steps=1", f"output_dir={run}")
    assert out.returncode == 0, out.stderr
    assert f"--overwrite: deleted the earlier run in {run}" in out.stderr
    assert _steps(run) == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001"]
    assert (run / "notes.txt").read_text() == "mine"


def test_from_python_a_second_run_into_a_run_folder_is_refused_and_changes_nothing(tmp_path):
    from torchforge import RLTrainer
    from torchforge.trainer.demo import demo_config

    config = demo_config(max_steps=2, save_steps=1, prompts_per_step=4, num_generations=4, max_completion_length=4,
                         progress_bar=False, output_dir=str(tmp_path / "run"))
    trainer = RLTrainer(config=config)
    trainer.train()
    before = _snapshot(tmp_path / "run")
    message = (f"RLTrainer: output_dir '{tmp_path / 'run'}' already holds a run (checkpoint at step 2); continue it "
               "with RLConfig(resume=True), or choose a new output_dir")
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        RLTrainer(config=config)  # a notebook cell run twice
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        trainer.train()  # the same trainer, trained again from step 0
    assert _snapshot(tmp_path / "run") == before  # not one byte, not one mtime
    resumed = RLTrainer(config=dataclasses.replace(config, resume=True))
    assert resumed.train()["steps"] == 2 and _steps(tmp_path / "run") == [1, 2]


def test_earlier_run_says_what_the_folder_holds(tmp_path):
    assert earlier_run(tmp_path) is None and earlier_run(tmp_path / "missing") is None
    (tmp_path / "config.yaml").write_text("a: 1\n")  # a run that failed before its first step
    assert earlier_run(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert earlier_run(tmp_path) == "a run"


def test_resume_of_a_finished_run_says_so_and_changes_nothing(tmp_path):
    run = tmp_path / "a"
    assert main(["train", *QUICK, "max_steps=2", f"output_dir={run}"]) == 0
    before = _snapshot(run)
    out = torchforge("train", "--resume", *QUICK, "max_steps=2", f"output_dir={run}")
    assert out.returncode == 0, out.stderr
    assert f"{run} is complete: 2 of 2 steps done; nothing to train" in out.stdout
    assert "trained" not in out.stdout and "nan" not in out.stdout
    assert _snapshot(run) == before
    # raising max_steps continues the run
    assert main(["train", "--resume", *QUICK, "max_steps=3", f"output_dir={run}"]) == 0
    assert _steps(run) == [1, 2, 3]


def test_ctrl_c_stops_with_one_line_and_a_checkpoint_and_resume_logs_every_step_once(tmp_path):
    run = tmp_path / "a"
    process = subprocess.Popen([sys.executable, "-m", "torchforge", "train", *QUICK, "max_steps=200",
                                "save_steps=100", f"output_dir={run}"], env=ENV, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    step = _steps(run)[-1]
    assert stderr.strip().splitlines()[-1] == f"stopped at step {step}; last checkpoint step {step}; continue with --resume"
    assert last_checkpoint_step(run) == step  # written on the interrupt, between steps
    assert not (run / "final").exists()

    # the run goes on to its end; every step is logged once, and the summary covers them all
    out = torchforge("train", "--resume", *QUICK, f"max_steps={step + 2}", f"output_dir={run}")
    assert out.returncode == 0, out.stderr
    assert _steps(run) == list(range(1, step + 3))
    assert f"trained {step + 2} steps (GRPO, 2 of them now, resumed from step {step})" in out.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert f"reward      {rows[0]['reward']:.3f} -> {rows[-1]['reward']:.3f}" in out.stdout  # window of 1 step


def test_resume_drops_the_steps_logged_after_the_checkpoint_from_metrics_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # a run that stopped hard after logging step 3 but before checkpointing it
    run = tmp_path / "a"
    assert main(["train", *QUICK, "max_steps=3", "save_steps=2", f"output_dir={run}"]) == 0
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-000003")
    assert main(["train", "--resume", *QUICK, "max_steps=4", "save_steps=2", f"output_dir={run}"]) == 0
    assert _steps(run) == [1, 2, 3, 4]  # step 3 once: the retrained one
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [1, 2, 3, 4]


def test_truncate_metrics_keeps_the_rows_up_to_the_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": s}) + "\n" for s in (1, 2, 3, 4)))
    truncate_metrics(tmp_path, 2)
    assert _steps(tmp_path) == [1, 2]


def test_prepare_output_dir_rules(tmp_path):
    assert not holds_run(tmp_path) and prepare_output_dir(tmp_path, resume=False, overwrite=False) is None
    (tmp_path / "config.yaml").write_text("a: 1\n")  # a run that failed before its first step: nothing to lose
    assert prepare_output_dir(tmp_path, resume=False, overwrite=False) is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(InvalidArgumentError, match="already holds a run; continue it with --resume"):
        prepare_output_dir(tmp_path, resume=False, overwrite=False)
    assert prepare_output_dir(tmp_path, resume=True, overwrite=False) is None
    with pytest.raises(InvalidArgumentError, match="--resume and --overwrite together"):
        prepare_output_dir(tmp_path, resume=True, overwrite=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgumentError, match="is a file; expected a folder"):
        prepare_output_dir(tmp_path / "file" / "run", resume=False, overwrite=False)


def test_overwrite_deletes_every_file_of_the_earlier_run_and_keeps_the_users(tmp_path):
    # the tracker runs too: a replaced run's wandb files and ids must not reach the new run
    for name in RUN_FILES:
        if "." in name:
            (tmp_path / name).write_text("{}\n")
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "x").write_text("")
    (tmp_path / "notes.txt").write_text("mine")
    assert {"trackers.json", "wandb", "final-merged"} <= set(RUN_FILES)
    assert "deleted the earlier run" in prepare_output_dir(tmp_path, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_stop_on_interrupt_turns_the_first_sigint_into_a_request():
    with StopOnInterrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert interrupt.requested()
        with pytest.raises(KeyboardInterrupt):  # the second one stops at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
