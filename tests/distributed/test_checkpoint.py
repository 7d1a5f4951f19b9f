"""Tests of torchforge.distributed.checkpoint: single-process round trips, and checkpoints written by 2
FSDP2 processes (gloo) resumed with 2 (FSDP2 and DDP) and with 1, plus the Hugging Face export."""

from __future__ import annotations

import random

import pytest
import torch

from tests import _dist_worker as W
from torchforge.distributed.checkpoint import export_pretrained, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from torchforge.errors import TorchforgeError



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
    save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, scheduler=scheduler,
                    extra={"step": 1, "data_position": 16})
    expected_rand, expected_py = torch.rand(4), random.random()
    params, exp_avg = W.params_of(model), {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}

    model_b = W.tiny_llama(seed=5)  # another init: everything must come from the file
    optimizer_b = torch.optim.AdamW(model_b.parameters(), lr=1.0)
    scheduler_b = torch.optim.lr_scheduler.StepLR(optimizer_b, step_size=1, gamma=0.5)
    torch.manual_seed(0)
    extra = load_checkpoint(tmp_path / "ck", model=model_b, optimizer=optimizer_b, scheduler=scheduler_b)
    assert extra == {"step": 1, "data_position": 16}
    assert _max_diff(W.params_of(model_b), params) == 0.0
    assert all(torch.equal(optimizer_b.state[p]["exp_avg"], exp_avg[n]) for n, p in model_b.named_parameters())
    assert optimizer_b.param_groups[0]["lr"] == pytest.approx(5e-3)  # scheduler stepped once
    assert scheduler_b.last_epoch == 1
    assert torch.equal(torch.rand(4), expected_rand) and random.random() == expected_py

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


def test_rng_state_round_trip():
    state = rng_state()
    a, b = torch.rand(2), random.random()
    set_rng_state(state)
    assert torch.equal(torch.rand(2), a) and random.random() == b


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
    _, results, _ = spawned
    c = results["checkpoint"]
    assert _max_diff(c["resumed_params1"], c["params1"]) == 0.0  # fresh objects, loaded from disk
    assert c["resumed_loss2"].item() == c["loss2"].item()
    assert _max_diff(c["resumed_params2"], c["params2"]) == 0.0
    assert c["resumed_lr"] == c["lr1"] == pytest.approx(5e-3)
    (save0, load0, extra0), (save1, load1, extra1) = c["rands"]
    assert torch.equal(save0, load0) and torch.equal(save1, load1)  # per-rank RNG restored
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
