"""Tests of torchforge.distributed.checkpoint: single-process round trips, and checkpoints written by 2
FSDP2 processes (gloo) resumed with 2 (FSDP2 and DDP) and with 1, plus the Hugging Face export."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import _dist_worker as W
from torchforge.distributed.checkpoint import (
    export_pretrained,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from torchforge.errors import InvalidArgumentError, TorchforgeError

REPO = Path(__file__).resolve().parents[2]


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _trained(seed: int = 0):
    model = W.tiny_llama(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    W.train_step(model, optimizer, W.global_batch(), "token-mean", micro=None)
    scheduler.step()
    return model, optimizer, scheduler


# --- single process ----------------------------------------------------------------------

def test_round_trip_single_process(tmp_path):
    model, optimizer, scheduler = _trained()
    torch.manual_seed(42)
    random.seed(42)
    np.random.seed(42)
    random.gauss(0, 1), np.random.standard_normal()  # a cached Gaussian in each state
    extra = {"step": 1, "data_position": 16, "nested": {"names": ["a", "b"], "pair": (1, 2.5), "none": None}}
    save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, scheduler=scheduler, extra=extra)
    expected_rand, expected_py = torch.rand(4), (random.random(), random.gauss(0, 1))
    expected_np = (np.random.rand(3), np.random.standard_normal())
    params, exp_avg = W.params_of(model), {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}

    model_b = W.tiny_llama(seed=5)  # another init: everything must come from the file
    optimizer_b = torch.optim.AdamW(model_b.parameters(), lr=1.0)
    scheduler_b = torch.optim.lr_scheduler.StepLR(optimizer_b, step_size=1, gamma=0.5)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    assert load_checkpoint(tmp_path / "ck", model=model_b, optimizer=optimizer_b, scheduler=scheduler_b) == extra
    assert _max_diff(W.params_of(model_b), params) == 0.0
    assert all(torch.equal(optimizer_b.state[p]["exp_avg"], exp_avg[n]) for n, p in model_b.named_parameters())
    assert optimizer_b.param_groups[0]["lr"] == pytest.approx(5e-3)  # scheduler stepped once
    assert scheduler_b.last_epoch == 1
    assert torch.equal(torch.rand(4), expected_rand) and (random.random(), random.gauss(0, 1)) == expected_py
    got_np = (np.random.rand(3), np.random.standard_normal())
    assert np.array_equal(got_np[0], expected_np[0]) and got_np[1] == expected_np[1]

    # the resumed run continues exactly like the uninterrupted one
    loss_a = W.train_step(model, optimizer, W.global_batch(), "token-mean", micro=None)
    loss_b = W.train_step(model_b, optimizer_b, W.global_batch(), "token-mean", micro=None)
    assert loss_a.item() == loss_b.item()
    assert _max_diff(W.params_of(model), W.params_of(model_b)) == 0.0


def test_model_only_and_no_rng(tmp_path):
    model = W.tiny_llama()
    save_checkpoint(tmp_path / "ck", model=model)
    other = W.tiny_llama(seed=3)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    assert load_checkpoint(tmp_path / "ck", model=other, restore_rng=False) == {}
    assert torch.equal(torch.get_rng_state(), before)
    assert _max_diff(W.params_of(other), W.params_of(model)) == 0.0


def _half_frozen(seed: int = 0):
    """A tiny Llama whose embeddings and MLPs are frozen, one AdamW step taken on the rest."""
    model = W.tiny_llama(seed)
    for name, param in model.named_parameters():
        param.requires_grad_(not ("embed" in name or "mlp" in name))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    W.train_step(model, optimizer, W.global_batch(), "token-mean", micro=None)
    return model, optimizer


def test_trainable_only_holds_and_restores_only_the_trainable_parameters(tmp_path):
    from torchforge.distributed.checkpoint import _read_metadata

    model, optimizer = _half_frozen()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and frozen
    save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, extra={"step": 1}, trainable_only=True)
    saved = {k.removeprefix("model.") for k in _read_metadata(tmp_path / "ck" / "dcp" / ".metadata").state_dict_metadata
             if k.startswith("model.")}
    assert saved == trainable  # the frozen weights are not in the checkpoint
    full = tmp_path / "full"
    save_checkpoint(full, model=model, optimizer=optimizer)
    size = {p: sum(f.stat().st_size for f in (p / "dcp").iterdir()) for p in (tmp_path / "ck", full)}
    assert size[tmp_path / "ck"] < size[full]

    # a model with the same frozen weights and other trainable ones gets back exactly the saved state
    other, other_optimizer = _half_frozen(seed=0)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if param.requires_grad:
                param.add_(1.0)
    frozen_before = {n: p.detach().clone() for n, p in other.named_parameters() if n in frozen}
    extra = load_checkpoint(tmp_path / "ck", model=other, optimizer=other_optimizer, restore_rng=False,
                            trainable_only=True)
    assert extra == {"step": 1}
    assert _max_diff(W.params_of(other), W.params_of(model)) == 0.0
    for name, param in other.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen_before[name]), name
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        if p.requires_grad:
            assert torch.equal(optimizer.state[p]["exp_avg_sq"], other_optimizer.state[q]["exp_avg_sq"]), name
    # a full checkpoint's trainable entries load the same way; the adapters-only one needs the keyword
    load_checkpoint(full, model=other, optimizer=other_optimizer, restore_rng=False, trainable_only=True)
    with pytest.raises(TorchforgeError, match=r"holds only the trainable parameters .*trainable_only=True"):
        load_checkpoint(tmp_path / "ck", model=other, optimizer=other_optimizer, restore_rng=False)


def test_rng_state_round_trip():
    state = rng_state()
    a, b, c = torch.rand(2), random.random(), np.random.rand()
    set_rng_state(state)
    assert torch.equal(torch.rand(2), a) and random.random() == b and np.random.rand() == c


def test_rank_file_is_plain_data(tmp_path):
    model, optimizer, scheduler = _trained()
    save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, scheduler=scheduler, extra={"step": 1})
    saved = torch.load(tmp_path / "ck" / "rank_0.pt", weights_only=True)  # no pickled objects
    assert saved["format"] == 2 and saved["world_size"] == 1 and saved["extra"] == {"step": 1}
    assert set(saved["rng"]) == {"torch", "python", "numpy"}
    assert saved["scheduler"] == scheduler.state_dict()


# --- loading never runs code -------------------------------------------------------------

class _WritesAFile:
    """A pickle payload: unpickling it writes ``marker`` (what a tampered file would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code from the checkpoint ran"))


@pytest.mark.parametrize("form", ["torch.save", "raw pickle"])
def test_tampered_rank_file_is_refused_and_runs_nothing(tmp_path, form):
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "ck", model=model)
    marker, rank_file = tmp_path / "marker.txt", tmp_path / "ck" / "rank_0.pt"
    if form == "torch.save":
        torch.save({"extra": {}, "payload": _WritesAFile(marker)}, rank_file)
    else:
        rank_file.write_bytes(pickle.dumps(_WritesAFile(marker)))
    with pytest.raises(TorchforgeError, match=rf"load_checkpoint: {rank_file} is not a checkpoint file that loads "
                                              r"as plain data \(UnpicklingError: .*\); refused, nothing in it was run"
                                              r".*trust_pickled_files=True"):
        load_checkpoint(tmp_path / "ck", model=model)
    assert not marker.exists()
    # the test can fail: unpickling the same file does run the payload
    torch.load(rank_file, weights_only=False) if form == "torch.save" else pickle.loads(rank_file.read_bytes())
    assert marker.exists()


def test_tampered_dcp_metadata_is_refused_and_runs_nothing(tmp_path):
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "ck", model=model)
    marker, metadata = tmp_path / "marker.txt", tmp_path / "ck" / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(_WritesAFile(marker)))
    with pytest.raises(TorchforgeError, match=rf"load_checkpoint: {metadata} could not be read as checkpoint metadata "
                                              r"\(UnpicklingError: refers to pathlib.Path.write_text.*\); refused"):
        load_checkpoint(tmp_path / "ck", model=model)
    assert not marker.exists()


def test_tampered_optimizer_item_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    # DCP stores non-tensor optimizer entries (param group hyperparameters) as pickled bytes
    # and its own planner reads them with weights_only=False.
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    marker = tmp_path / "marker.txt"
    optimizer.param_groups[0]["note"] = _WritesAFile(marker)  # saved as a bytes item
    save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer)
    assert not marker.exists()
    with pytest.raises(TorchforgeError, match=r"load_checkpoint: the item 'optimizer.param_groups.*note' .* is not "
                                              r"plain data \(UnpicklingError\); refused, nothing in it was run"):
        fresh = torch.optim.SGD(model.parameters(), lr=0.1)
        fresh.param_groups[0]["note"] = None  # the item is read only when the loader asks for it
        load_checkpoint(tmp_path / "ck", model=model, optimizer=fresh)
    assert not marker.exists()


def test_truncated_files_are_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "ck", model=model)
    rank_file = tmp_path / "ck" / "rank_0.pt"
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(TorchforgeError, match=rf"load_checkpoint: {rank_file} is not a checkpoint file .* truncated"):
        load_checkpoint(tmp_path / "ck", model=model)
    rank_file.write_bytes(b"")
    with pytest.raises(TorchforgeError, match=rf"load_checkpoint: {rank_file} is not a checkpoint file"):
        load_checkpoint(tmp_path / "ck", model=model)
    save_checkpoint(tmp_path / "ck2", model=model)
    metadata = tmp_path / "ck2" / "dcp" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:40])
    with pytest.raises(TorchforgeError, match=rf"load_checkpoint: {metadata} could not be read as checkpoint metadata"):
        load_checkpoint(tmp_path / "ck2", model=model)
    save_checkpoint(tmp_path / "ck3", model=model)
    (shard,) = (tmp_path / "ck3" / "dcp").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(TorchforgeError, match=r"load_checkpoint: .*ck3/dcp could not be read .*truncated or corrupted"):
        load_checkpoint(tmp_path / "ck3", model=model)


def test_previous_format_needs_explicit_trust(tmp_path):
    # Format 1 stored random.getstate() and np.random.get_state() (a numpy array) as pickled objects.
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "ck", model=model)
    random.seed(3)
    np.random.seed(3)
    old_rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    expected = (random.random(), np.random.rand())
    torch.save({"extra": {"step": 4}, "scheduler": None, "rng": old_rng, "world_size": 1, "has_optimizer": False},
               tmp_path / "ck" / "rank_0.pt")
    with pytest.raises(TorchforgeError, match=r"written by torchforge before checkpoint format 2.*trust_pickled_files=True"):
        load_checkpoint(tmp_path / "ck", model=model)
    random.seed(0)
    np.random.seed(0)
    assert load_checkpoint(tmp_path / "ck", model=model, trust_pickled_files=True) == {"step": 4}
    assert (random.random(), np.random.rand()) == expected


def test_extra_and_scheduler_state_must_be_plain_data(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match=r"save_checkpoint: extra\['data'\]\['sampler'\]\[1\] is a "
                                                   r"torch._C.Generator; a checkpoint stores only data"):
        save_checkpoint(tmp_path / "ck", model=model, extra={"step": 1, "data": {"sampler": [0, torch.Generator()]}})
    with pytest.raises(InvalidArgumentError, match=r"save_checkpoint: extra\['t'\] is a torch.Tensor"):
        save_checkpoint(tmp_path / "ck", model=model, extra={"t": torch.zeros(1)})
    with pytest.raises(InvalidArgumentError, match=r"save_checkpoint: extra has the key \(1, 2\) of type tuple"):
        save_checkpoint(tmp_path / "ck", model=model, extra={(1, 2): 0})
    with pytest.raises(InvalidArgumentError, match=r"save_checkpoint: extra must be a dict, got list"):
        save_checkpoint(tmp_path / "ck", model=model, extra=[1])

    class Scheduler:
        def state_dict(self):
            return {"last_epoch": 3, "fn": len}

    with pytest.raises(InvalidArgumentError, match=r"save_checkpoint: the scheduler state\['fn'\] is a "
                                                   r"builtins.builtin_function_or_method"):
        save_checkpoint(tmp_path / "ck", model=model, scheduler=Scheduler())
    assert not (tmp_path / "ck").exists() and not list(tmp_path.iterdir())  # nothing written


# --- atomic writes -----------------------------------------------------------------------

_KILLED_SAVE = textwrap.dedent("""
    import sys, time, torch
    import torchforge.distributed.checkpoint as C
    root = sys.argv[1]
    torch.manual_seed(0)
    first = torch.nn.Linear(64, 64)
    C.save_checkpoint(f"{root}/step-000001", model=first, extra={"step": 1})
    torch.save(first.state_dict(), f"{root}/first.pt")
    original = C.rng_state
    def slow_rng_state():  # called between the model shards and the rank file
        print("SAVING", flush=True)
        time.sleep(120)
        return original()
    C.rng_state = slow_rng_state
    second = torch.nn.Linear(64, 64)
    C.save_checkpoint(f"{root}/{sys.argv[2]}", model=second, extra={"step": 2})
""")


@pytest.mark.parametrize("target", ["step-000002", "step-000001"])  # a new checkpoint; overwriting one
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, target):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(tmp_path), target],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "SAVING", proc.stderr.read()
        assert (tmp_path / f".{target}.incomplete" / "dcp" / ".metadata").exists()  # killed mid-save
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    # The half-written folder is hidden; the previous checkpoint is complete and loads.
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000001"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    model = torch.nn.Linear(64, 64)
    assert load_checkpoint(latest_checkpoint(tmp_path), model=model, restore_rng=False) == {"step": 1}
    first = torch.load(tmp_path / "first.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], first[k]) for k in first)
    # the next save of that name clears the leftover and completes
    save_checkpoint(tmp_path / target, model=model, extra={"step": 3})
    assert not (tmp_path / f".{target}.incomplete").exists()
    assert load_checkpoint(tmp_path / target, model=model, restore_rng=False) == {"step": 3}


def test_overwrite_replaces_the_checkpoint(tmp_path):
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "ck", model=a, extra={"v": "a"})
    save_checkpoint(tmp_path / "ck", model=b, extra={"v": "b"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    model = torch.nn.Linear(2, 2)
    assert load_checkpoint(tmp_path / "ck", model=model) == {"v": "b"}
    assert torch.equal(model.weight, b.weight)
    # a folder that holds anything but a checkpoint is refused, never replaced
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}")
    with pytest.raises(InvalidArgumentError, match=r"save_checkpoint: path=.*run' exists and holds \['metrics.jsonl'\], "
                                                   r"which a checkpoint does not"):
        save_checkpoint(tmp_path / "run", model=a)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["metrics.jsonl"]
    assert not (tmp_path / ".run.incomplete").exists()
    (tmp_path / "empty").mkdir()
    save_checkpoint(tmp_path / "empty", model=a)  # an empty folder is fine
    assert load_checkpoint(tmp_path / "empty", model=model, restore_rng=False) == {}


def test_latest_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    model = torch.nn.Linear(2, 2)
    for step in (9, 10, 2):  # ordered by number, not by name
        save_checkpoint(tmp_path / f"step-{step}", model=model)
    save_checkpoint(tmp_path / "final", model=model)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10"
    (tmp_path / "step-11" / "dcp").mkdir(parents=True)  # incomplete (an old non-atomic write)
    save_checkpoint(tmp_path / "step-12", model=model)
    (tmp_path / "step-12" / "rank_0.pt").unlink()
    (tmp_path / ".step-13.incomplete" / "dcp").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-10"


def test_load_errors(tmp_path):
    with pytest.raises(TorchforgeError, match=r"load_checkpoint: path=.*nothing.* holds no checkpoint"):
        load_checkpoint(tmp_path / "nothing", model=torch.nn.Linear(2, 2))
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "ck", model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(TorchforgeError, match=r"load_checkpoint: path=.* was saved without a scheduler"):
        load_checkpoint(tmp_path / "ck", model=model, scheduler=scheduler)
    with pytest.raises(TorchforgeError, match=r"load_checkpoint: path=.* was saved without an optimizer"):
        load_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer)


class _Tokenizer:
    def save_pretrained(self, path):
        (__import__("pathlib").Path(path) / "tokenizer_marker.txt").write_text("ok")


def test_export_pretrained_single_process(tmp_path):
    from transformers import AutoModelForCausalLM

    model, _, _ = _trained()
    export_pretrained(model, _Tokenizer(), tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert (tmp_path / "hf" / "tokenizer_marker.txt").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = W.global_batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(TorchforgeError, match=r"export_pretrained: model is a Linear; expected a Hugging Face"):
        export_pretrained(torch.nn.Linear(2, 2), None, tmp_path / "bad")


# --- two processes (gloo) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    # a 1-process checkpoint for the 2-process workers to load (scenario "load_single")
    model, optimizer, _ = _trained()
    save_checkpoint(out / "ckpt1", model=model, optimizer=optimizer, extra={"step": 5})
    single = {"params": W.params_of(model),
              "exp_avg": {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}}
    W.launch(2, out, ["checkpoint", "resume", "load_single"])
    results = {n: torch.load(out / f"{n}.pt", weights_only=False) for n in ("checkpoint", "resume", "load_single")}
    return out, results, single


def test_fsdp_checkpoint_resumes_with_two_processes(spawned):
    out, results, _ = spawned
    c = results["checkpoint"]
    for r in range(2):  # each rank's file is plain data; the staging folder is gone
        saved = torch.load(out / "ckpt" / f"rank_{r}.pt", weights_only=True)
        assert saved["format"] == 2 and saved["world_size"] == 2 and saved["extra"] == {"step": 1, "rank": r}
    assert not (out / ".ckpt.incomplete").exists() and latest_checkpoint(out) is None  # "ckpt" is no step-<n>
    assert _max_diff(c["resumed_params1"], c["params1"]) == 0.0  # fresh objects, loaded from disk
    assert c["resumed_loss2"].item() == c["loss2"].item()
    assert _max_diff(c["resumed_params2"], c["params2"]) == 0.0
    assert c["resumed_lr"] == c["lr1"] == pytest.approx(5e-3)
    (save0, load0, extra0), (save1, load1, extra1) = c["rands"]
    assert torch.equal(save0, load0) and torch.equal(save1, load1)  # per-rank RNGs (torch, random, numpy) restored
    assert not torch.equal(save0, save1)  # ... and the ranks' streams differ
    assert extra0 == {"step": 1, "rank": 0} and extra1 == {"step": 1, "rank": 1}


def test_fsdp_checkpoint_resumes_with_ddp(spawned):
    _, results, _ = spawned
    c, r = results["checkpoint"], results["resume"]
    assert abs(r["loss2"].item() - c["loss2"].item()) <= 1e-6
    assert _max_diff(r["params2"], c["params2"]) <= 1e-6


def test_fsdp_checkpoint_resumes_with_one_process(spawned):
    out, results, _ = spawned
    c = results["checkpoint"]
    model = W.tiny_llama(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with pytest.warns(UserWarning, match=r"checkpoint saved by 2 processes, resumed with 1"):
        extra = load_checkpoint(out / "ckpt", model=model, optimizer=optimizer, scheduler=scheduler)
    assert extra == {"step": 1, "rank": 0}
    assert _max_diff(W.params_of(model), c["params1"]) == 0.0
    assert all(torch.equal(optimizer.state[p]["exp_avg"], c["exp_avg1"][n]) for n, p in model.named_parameters())
    loss2 = W.train_step(model, optimizer, W.global_batch(), "token-mean", micro=None)
    assert abs(loss2.item() - c["loss2"].item()) <= 1e-6
    assert _max_diff(W.params_of(model), c["params2"]) <= 1e-6


def test_single_process_checkpoint_loads_into_two(spawned):
    _, results, single = spawned
    s = results["load_single"]
    assert _max_diff(s["params"], single["params"]) == 0.0
    assert _max_diff(s["exp_avg"], single["exp_avg"]) == 0.0
    (extra0, rand0, warn0), (extra1, rand1, _) = s["per_rank"]
    assert extra0 == extra1 == {"step": 5}  # rank 1 had no file: rank 0's extra
    assert not torch.equal(rand0, rand1)  # rank 1 re-seeded: no duplicated samples
    assert any("saved by 1 processes, resumed with 2" in w for w in warn0)


def test_export_from_fsdp_loads_with_from_pretrained(spawned):
    from transformers import AutoModelForCausalLM

    out, results, _ = spawned
    c = results["checkpoint"]
    loaded = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert _max_diff(W.params_of(loaded), c["params2"]) == 0.0
    with torch.no_grad():
        assert (loaded(input_ids=c["probe"]).logits - c["logits"]).abs().max().item() <= 1e-6


def test_sync_weights_from_fsdp(spawned):
    _, results, _ = spawned
    c = results["checkpoint"]
    assert _max_diff(c["synced"], c["params2"]) == 0.0
