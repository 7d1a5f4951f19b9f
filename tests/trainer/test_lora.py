"""LoRA: settings, only adapters train, the reference is the base model with one copy of its
weights, exact resume, the final folder loads with peft, merged export, and 2 processes
(DDP and FSDP2, gloo) matching 1.

This file is also the 2-process worker: ``python tests/trainer/test_lora.py OUT STRATEGY``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.trainer.lora import adapters_disabled, check_lora_settings, require_peft


def _config(out, **changes):
    from torchforge import RLConfig

    values = {"max_steps": 3, "num_generations": 4, "prompts_per_step": 4, "max_completion_length": 4, "kl_coef": 0.1,
                  "learning_rate": 5e-2, "progress_bar": False, "output_dir": str(out), "gradient_checkpointing": False,
                  "mixed_precision": None, "lora": {"rank": 4, "alpha": 8.0}, "loss_aggregation": "seq-mean-token-mean"}
    values.update(changes)
    return RLConfig(**values)


def _history(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# --- settings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, message", [
    ({"rank": 0}, r"RLConfig: lora.rank=0; expected an int >= 1"),
    ({"alpha": 0}, r"RLConfig: lora.alpha=0; expected a number > 0"),
    ({"dropout": 1.0}, r"RLConfig: lora.dropout=1.0; expected a number in \[0, 1\)"),
    ({"target_modules": []}, r"RLConfig: lora.target_modules=\[\]; expected 'all-linear', a module name"),
    ({"merge": "yes"}, r"RLConfig: lora.merge='yes'; expected true or false"),
    ({"r": 8}, r"RLConfig: unknown lora setting\(s\) \['r'\]; expected keys among \['alpha', 'dropout', 'merge', 'rank', 'target_modules'\]"),
    ([8], r"RLConfig: lora=\[8\]; expected None or a mapping"),
])
def test_bad_lora_settings_are_rejected_by_the_config(settings, message):
    from torchforge import RLConfig

    with pytest.raises(InvalidArgumentError, match=message):
        RLConfig(lora=settings)


def test_lora_defaults():
    assert check_lora_settings(None) is None
    assert check_lora_settings({"target_modules": ["q_proj"]}) == {
        "rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj"], "merge": False}


def test_missing_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(ImportError, match=r"LoRA needs peft.*pip install 'torchforge\[lora\]'"):
        require_peft()


# --- one process --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-step GRPO + KL run with LoRA on the demo, and the model it started from."""
    from torchforge import RLTrainer
    from torchforge.trainer import demo

    out = tmp_path_factory.mktemp("lora")
    config = _config(out / "run", lora={"rank": 4, "alpha": 8.0, "merge": True}, save_steps=1)
    trainer = RLTrainer(config=config)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    base = demo.tiny_llama(demo.char_tokenizer(), seed=config.seed)  # what the demo trainer starts from
    return trainer, initial, base, out


def test_only_adapters_train_and_the_reference_is_the_policy(trained):
    trainer, initial, _, _ = trained
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    in_optimizer = [names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]]
    assert in_optimizer and all(".lora_A." in n or ".lora_B." in n for n in in_optimizer)
    for name, param in trainer.model.named_parameters():
        changed = not torch.equal(param, initial[name])
        assert changed == ("lora_B" in name or "lora_A" in name), name  # base weights never move
    # no second copy of the base weights: the reference is the policy itself
    assert trainer.ref_model is trainer.model
    assert all(not torch.equal(initial[n], p) for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_reference_log_probs_are_the_base_model(trained):
    from torchforge.loop import policy_log_probs, rollout

    trainer, _, base, _ = trained
    batch = rollout(trainer.model, trainer.tokenizer, ["123=", "45="], num_generations=2, max_new_tokens=4, seed=1)
    with torch.no_grad():
        with adapters_disabled(trainer.model):
            ref, _ = policy_log_probs(trainer.model, batch)
        policy, _ = policy_log_probs(trainer.model, batch)
        plain, _ = policy_log_probs(base, batch)
    torch.testing.assert_close(ref, plain, rtol=0, atol=1e-6)
    assert (policy - plain).abs().max() > 1e-3  # the trained adapters do change the policy
    # and the logged KL is that of the policy against the base: 0 at step 1 (B = 0), > 0 after
    history = _history(trainer.output_dir)
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-7) and history[-1]["kl"] > 1e-6


def test_final_folder_loads_with_peft_and_merged_weights_match(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from torchforge.trainer import demo

    trainer, _, _, _ = trained
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(demo.tiny_llama(demo.char_tokenizer(), seed=0), trainer.output_dir / "final")
        merged = AutoModelForCausalLM.from_pretrained(trainer.output_dir / "final-merged")
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-4)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert (trainer.output_dir / "final" / "adapter_config.json").is_file()


def test_resume_is_exact(trained, tmp_path):
    from torchforge import RLTrainer

    trainer, _, _, _ = trained
    run = tmp_path / "resumed"
    RLTrainer(config=_config(run, max_steps=2, save_steps=1)).train()
    resumed = RLTrainer(config=_config(run, max_steps=3, resume=True))
    resumed.train()
    one, two = _history(trainer.output_dir), _history(run)
    assert [r["step"] for r in two] == [1, 2, 3]
    for key in ("loss", "reward", "kl", "grad_norm"):
        assert two[2][key] == pytest.approx(one[2][key], rel=1e-6, abs=1e-9), key
    for (name, a), b in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7, msg=name)


def _saved_keys(checkpoint):
    from torchforge.distributed.checkpoint import _read_metadata

    return set(_read_metadata(Path(checkpoint) / "dcp" / ".metadata").state_dict_metadata)


def _dcp_bytes(checkpoint):
    return sum(f.stat().st_size for f in (Path(checkpoint) / "dcp").iterdir())


def test_checkpoints_hold_only_the_adapters(trained):
    from torchforge.distributed.checkpoint import load_checkpoint

    trainer, _, _, _ = trained
    checkpoint = trainer.output_dir / "checkpoints" / "step-000003"
    model_keys = {k for k in _saved_keys(checkpoint) if k.startswith("model.")}
    trainable = {"model.policy." + n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert model_keys == trainable  # no base weight; buffers: the demo Llama has no persistent one
    optimizer_keys = {k.split(".", 2)[2] for k in _saved_keys(checkpoint) if k.startswith("optimizer.state.")}
    assert {k.rsplit(".", 1)[0] for k in optimizer_keys} == {k.removeprefix("model.") for k in trainable}
    with pytest.raises(TorchforgeError, match="holds only the trainable parameters"):
        load_checkpoint(checkpoint, model=trainer.modules, restore_rng=False)


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """3 PPO + LoRA steps (checkpoint each), and the parameters they started from."""
    from torchforge import RLTrainer

    out = tmp_path_factory.mktemp("ppo_lora")
    trainer = RLTrainer(config=_config(out / "run", algorithm="ppo", save_steps=1))
    initial = {n: p.detach().clone() for n, p in trainer.modules.named_parameters()}
    trainer.train()
    return trainer, initial


def test_ppo_with_lora_trains_the_adapters_and_the_value_head_only(ppo_run):
    trainer, initial = ppo_run
    critic = trainer.algorithm.critic
    assert critic is trainer.modules["critic"] and critic.decoder is not trainer.model.get_base_model().model
    names = {id(p): n for n, p in trainer.modules.named_parameters()}
    in_optimizer = {names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]}
    expected = {n for n in names.values() if "lora_A." in n or "lora_B." in n} | {"critic.head.weight", "critic.head.bias"}
    assert in_optimizer == expected
    assert any(n.startswith("critic.decoder.") for n in expected) and any(n.startswith("policy.") for n in expected)
    for name, param in trainer.modules.named_parameters():
        changed = not torch.equal(param, initial[name])
        if "lora_A." in name:  # A moves once B has (B starts at 0: A's first gradient is 0)
            continue
        assert changed == (name in expected), name
    # the critic's base is the model's base: frozen, and equal to the policy's
    policy_base = dict(trainer.model.get_base_model().model.named_parameters())
    for name, param in critic.decoder.named_parameters():
        if "lora_" not in name:
            torch.testing.assert_close(param, policy_base[name], rtol=0, atol=0, msg=name)
    checkpoint = trainer.output_dir / "checkpoints" / "step-000003"
    assert {k for k in _saved_keys(checkpoint) if k.startswith("model.")} == {"model." + n for n in expected}


def test_ppo_with_lora_resumes_exactly(ppo_run, tmp_path):
    from torchforge import RLTrainer

    trainer, _ = ppo_run
    run = tmp_path / "resumed"
    RLTrainer(config=_config(run, algorithm="ppo", max_steps=2, save_steps=1)).train()
    resumed = RLTrainer(config=_config(run, algorithm="ppo", max_steps=3, resume=True))
    resumed.train()
    one, two = _history(trainer.output_dir), _history(run)
    assert [r["step"] for r in two] == [1, 2, 3]
    for key in ("loss", "reward", "kl", "grad_norm", "value_loss"):
        assert two[2][key] == pytest.approx(one[2][key], rel=1e-6, abs=1e-9), key
    for (name, a), b in zip(trainer.modules.named_parameters(), resumed.modules.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7, msg=name)


def test_peft_config_object_and_errors(tmp_path):
    from peft import LoraConfig

    from torchforge import RLTrainer

    trainer = RLTrainer(config=_config(tmp_path, lora=None, max_steps=1),
                        peft_config=LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    trained_names = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained_names and all(("q_proj" in n or "v_proj" in n) and "lora_" in n for n in trained_names)
    with pytest.raises(InvalidArgumentError, match="RLTrainer: peft_config is a str; expected a peft.LoraConfig"):
        RLTrainer(config=_config(tmp_path, lora=None), peft_config="lora")


# --- 2 processes ---------------------------------------------------------------------------------

def _run(out, strategy, *, interrupted=False):
    """2 steps; ``interrupted``: 1 step, then a second run resumes its (adapters-only) checkpoint."""
    from torchforge import RLTrainer

    if interrupted:
        RLTrainer(config=_config(out, distributed_strategy=strategy, max_steps=1)).train()
    return RLTrainer(config=_config(out, distributed_strategy=strategy, max_steps=2, resume=interrupted)).train()


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_lora_on_two_processes_resumed_matches_one(tmp_path, strategy):
    from peft import PeftModel

    from torchforge.distributed import launch
    from torchforge.trainer import demo

    _run(tmp_path / "one", strategy)
    # the 2-process run is interrupted after step 1 and resumed from its adapters-only checkpoint
    assert launch(2, [__file__, str(tmp_path / "two"), strategy], module=None) == 0
    assert {k.split(".")[1] for k in _saved_keys(tmp_path / "two" / "checkpoints" / "step-000001")
            if k.startswith("model.")} == {"policy"}
    assert all("lora_" in k for k in _saved_keys(tmp_path / "two" / "checkpoints" / "step-000001")
               if k.startswith("model."))
    one, two = _history(tmp_path / "one"), _history(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ("loss", "reward", "kl", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    # the 2-process final folder holds the same adapters
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        logits = [PeftModel.from_pretrained(demo.tiny_llama(demo.char_tokenizer(), seed=0), p / "final")(input_ids=ids).logits
                  for p in (tmp_path / "one", tmp_path / "two")]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from torchforge.distributed import end_process, init_distributed, teardown_distributed

    torch.set_num_threads(1)
    assert init_distributed()
    try:
        _run(Path(sys.argv[1]), sys.argv[2], interrupted=True)
    finally:
        teardown_distributed()
    end_process(0)  # every result is written: skip the shutdown where gloo can abort


def test_the_lora_block_from_the_command_line(tmp_path, capsys):
    from torchforge.trainer.cli import main

    settings = ["max_steps=1", "num_generations=2", "prompts_per_step=2", "progress_bar=false"]
    assert main(["train", "lora={rank: 0}", *settings, f"output_dir={tmp_path / 'bad'}"]) == 2
    assert "lora.rank=0; expected an int >= 1" in capsys.readouterr().err
    assert main(["train", "lora={rank: 2, merge: true}", *settings, f"output_dir={tmp_path / 'run'}"]) == 0
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()
    assert (tmp_path / "run" / "final-merged" / "config.json").is_file()
