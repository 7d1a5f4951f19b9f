"""torchforge.distributed.process_group: single-process defaults, torchrun's environment, launch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torchforge.distributed import (
    generation_kwargs,
    init_distributed,
    is_main_process,
    launch,
    rank,
    teardown_distributed,
    world_size,
)
from torchforge.errors import InvalidArgumentError, TorchforgeError


def test_single_process_defaults(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed() is False
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed() is False
    assert (world_size(), rank(), is_main_process()) == (1, 0, True)
    assert generation_kwargs() == {}
    teardown_distributed()  # no-op without a group


def test_init_distributed_needs_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(TorchforgeError, match=r"init_distributed: WORLD_SIZE=2 but MASTER_ADDR is not set"):
        init_distributed()


def test_launch_errors(monkeypatch):
    with pytest.raises(InvalidArgumentError, match=r"launch: nproc must be an int >= 1, got 0"):
        launch(0, ["train"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TorchforgeError, match=r"launch: already inside a distributed run \(WORLD_SIZE=2\)"):
        launch(2, ["train"])


def test_end_process_exits_with_the_status_after_flushing_and_skips_the_shutdown():
    code = ("import atexit; from torchforge.distributed import end_process; "
            "atexit.register(print, 'shutdown ran'); print('done', end=''); end_process(3)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (3, "done")  # flushed; the atexit handler never ran


def test_the_command_in_a_torchrun_worker_exits_through_end_process(tmp_path):
    # a settings mistake: status 2, the one error line on stderr, and no shutdown (TORCHELASTIC_RUN_ID set)
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "HF_HUB_OFFLINE": "1"}
    code = ("import atexit; atexit.register(print, 'shutdown ran'); import runpy; "
            "runpy.run_module('torchforge', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, "train", "max_stepz=1", f"output_dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "max_stepz" in out.stderr and "shutdown ran" not in out.stdout
    env.pop("TORCHELASTIC_RUN_ID")
    out = subprocess.run([sys.executable, "-c", code, "train", "max_stepz=1", f"output_dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "shutdown ran" in out.stdout  # outside torchrun: a normal exit
