"""torchforge.distributed.process_group: single-process defaults, torchrun's environment, launch."""

from __future__ import annotations

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
