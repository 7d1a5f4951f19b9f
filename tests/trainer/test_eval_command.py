"""Evaluation from the trainer (eval_dataset, eval_steps) and from ``torchforge eval``."""

from __future__ import annotations

import json

import pytest

from torchforge.errors import InvalidArgumentError
from torchforge.trainer import demo


def _config(out, **changes):
    from torchforge import RLConfig

    values = {"max_steps": 2, "num_generations": 2, "prompts_per_step": 2, "max_completion_length": 4, "kl_coef": 0.0,
                  "progress_bar": False, "output_dir": str(out), "gradient_checkpointing": False, "mixed_precision": None,
                  "eval_steps": 1, "num_eval_generations": 3, "eval_correct_threshold": 0.5, "learning_rate": 1e-2}
    values.update(changes)
    return RLConfig(**values)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from torchforge import RLTrainer

    out = tmp_path_factory.mktemp("eval") / "run"
    trainer = RLTrainer(config=_config(out), eval_dataset=demo.copy_digits_dataset(5, seed=9))
    trainer.train()
    return trainer


def test_eval_metrics_are_logged_every_eval_steps(run):
    rows = [json.loads(line) for line in (run.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert {"eval/reward", "eval/pass@1", "eval/pass@3", "eval/greedy_accuracy"} <= set(row)
        assert row["eval/num_prompts"] == 5.0 and 0.0 <= row["eval/pass@1"] <= row["eval/pass@3"] <= 1.0
    # the last logged figures are those of the final model, evaluated again the same way
    again = run.evaluate()
    for key in ("eval/reward", "eval/pass@1", "eval/pass@3", "eval/greedy_reward"):
        assert again[key] == pytest.approx(rows[-1][key], abs=1e-7), key
    # TensorBoard got them too
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.output_dir / "tensorboard"))
    events.Reload()
    assert "eval/pass@1" in events.Tags()["scalars"]


def test_the_plot_has_the_eval_panels(run):
    from torchforge.trainer.plot import PANELS, plot_run

    assert ("eval/reward", "eval reward (mean)") in PANELS
    assert plot_run(run.output_dir).exists()


def test_no_eval_without_eval_steps(tmp_path):
    from torchforge import RLTrainer

    trainer = RLTrainer(config=_config(tmp_path, eval_steps=None, max_steps=1),
                        eval_dataset=demo.copy_digits_dataset(2, seed=9))
    trainer.train()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert not any(k.startswith("eval/") for k in row)


@pytest.mark.parametrize("changes, message", [
    ({"eval_steps": 0}, "RLConfig: eval_steps=0; expected an int >= 1 or None"),
    ({"num_eval_generations": 0}, "RLConfig: num_eval_generations=0; expected an int >= 1"),
    ({"eval_correct_threshold": "high"}, "RLConfig: eval_correct_threshold='high'; expected a number"),
])
def test_bad_eval_settings(tmp_path, changes, message):
    with pytest.raises(InvalidArgumentError, match=message):
        _config(tmp_path, **changes)


def test_torchforge_eval_on_a_saved_model_and_a_lora_folder(run, tmp_path, capsys):
    from torchforge.loop import evaluate
    from torchforge.trainer.cli import main
    from torchforge.trainer.lora import load_adapter_model

    data = tmp_path / "eval.jsonl"
    rows = demo.copy_digits_dataset(4, seed=2)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = ["num_eval_generations=2", "max_completion_length=4", "eval_correct_threshold=0.5", "seed=3"]
    reward = "torchforge.trainer.demo:CopyDigitsReward"
    out = tmp_path / "metrics.json"
    assert main(["eval", "--model", str(run.output_dir / "final"), "--dataset", str(data),
                 "--reward-function", reward, "--out", str(out), *settings]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    tokenizer = demo.char_tokenizer()
    model = type(run.model).from_pretrained(run.output_dir / "final")
    direct = evaluate(model, tokenizer, [r["prompt"] for r in rows], [demo.CopyDigitsReward()], num_generations=2,
                      max_new_tokens=4, correct_threshold=0.5, seed=3, columns={"target": [r["target"] for r in rows]})
    assert printed == pytest.approx(direct, rel=1e-6)

    # a LoRA folder: the adapters on their base model (here saved next to them)
    from torchforge.trainer.lora import apply_lora

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    base = demo.tiny_llama(tokenizer, seed=0)
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    from transformers import AutoModelForCausalLM

    policy = apply_lora(AutoModelForCausalLM.from_pretrained(base_dir), {"rank": 2}, seed=1)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)  # adapters that change the model
    policy.save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    assert main(["eval", "--model", str(adapter_dir), "--dataset", str(data), "--reward-function", reward,
                 *settings]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    direct = evaluate(load_adapter_model(adapter_dir), tokenizer, [r["prompt"] for r in rows], [demo.CopyDigitsReward()],
                      num_generations=2, max_new_tokens=4, correct_threshold=0.5, seed=3)
    assert printed == pytest.approx(direct, rel=1e-6)


def test_torchforge_eval_applies_the_reward_timeout(run, tmp_path, monkeypatch, capsys):
    # a grader that hangs on every call: with reward_timeout the eval ends, its samples scored
    # reward_on_failure; the printed metrics say so
    from torchforge.trainer.cli import main

    (tmp_path / "hanging_grader.py").write_text("import time\n\ndef hangs(prompts, completions, **kw):\n"
                                                "    time.sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in demo.copy_digits_dataset(2, seed=2)))
    assert main(["eval", "--model", str(run.output_dir / "final"), "--dataset", str(data),
                 "--reward-function", "hanging_grader:hangs", "num_eval_generations=2", "max_completion_length=3",
                 "reward_timeout=0.5", "reward_on_failure=-1.0"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["eval/reward"] == -1.0 and printed["eval/greedy_reward"] == -1.0


def test_eval_stops_at_eos_as_well_as_the_configured_stop_ids(run):
    # stop_token_ids adds stop ids to eos, in evaluation as in training
    from torchforge.loop import evaluate
    from torchforge.loop.rollout import completion_stop_ids
    from torchforge.trainer.evaluation import evaluate_dataset

    tokenizer = demo.char_tokenizer()
    rows = demo.copy_digits_dataset(8, seed=2)
    stop = [tokenizer.convert_tokens_to_ids("9")]
    config = _config(run.output_dir, stop_token_ids=stop, max_completion_length=8, num_eval_generations=4)
    got = evaluate_dataset(run.model, tokenizer, rows, [demo.CopyDigitsReward()], config)

    def direct(stop_token_ids):
        return evaluate(run.model, tokenizer, [r["prompt"] for r in rows], [demo.CopyDigitsReward()],
                        num_generations=4, max_new_tokens=8, correct_threshold=0.5, seed=config.seed,
                        stop_token_ids=stop_token_ids, columns={"target": [r["target"] for r in rows]})

    expected = direct(completion_stop_ids(tokenizer, run.model, stop))
    assert expected["eval/mean_length"] != direct(stop)["eval/mean_length"]  # eos ends some completions
    assert got == pytest.approx(expected, rel=1e-6)


def test_torchforge_eval_errors(tmp_path, capsys):
    from torchforge.trainer.cli import main

    assert main(["eval", "--model", str(tmp_path / "none"), "--dataset", str(tmp_path / "d.jsonl"),
                 "--reward-function", "torchforge.trainer.demo:CopyDigitsReward"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path), "--dataset", str(tmp_path)]) == 2
    assert "torchforge eval: no reward functions" in capsys.readouterr().err
