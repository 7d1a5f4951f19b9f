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


# --- eval_dataset from the command line ------------------------------------------------------

QUICK = ["max_steps=2", "prompts_per_step=2", "num_generations=2", "max_completion_length=4", "progress_bar=false",
         "num_eval_generations=2", "eval_correct_threshold=0.5"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_eval_dataset_from_the_command_line_is_scored_every_eval_steps_and_resume_keeps_the_schedule(tmp_path):
    from transformers import AutoModelForCausalLM

    from torchforge.trainer.cli import check_run, load_run_config, main
    from torchforge.trainer.evaluation import evaluate_dataset

    rows = demo.copy_digits_dataset(3, seed=5)
    held_out = _jsonl(tmp_path / "held_out.jsonl", rows)
    run = tmp_path / "run"
    settings = [*QUICK, f"eval_dataset={held_out}", "eval_steps=2", f"output_dir={run}"]
    assert main(["train", *settings]) == 0  # the demo, scored on the user's rows
    logged = _metrics(run)
    assert [r["step"] for r in logged] == [1, 2]
    assert not any(k.startswith("eval/") for k in logged[0])
    assert logged[1]["eval/num_prompts"] == 3.0 and {"eval/reward", "eval/pass@1", "eval/pass@2"} <= set(logged[1])
    # the figures are those of the model after step 2, scored with the run's settings
    config = check_run(load_run_config(None, settings)).config
    final = AutoModelForCausalLM.from_pretrained(run / "final")
    direct = evaluate_dataset(final, demo.char_tokenizer(), rows, [demo.CopyDigitsReward()], config)
    for key in ("eval/reward", "eval/pass@1", "eval/pass@2", "eval/greedy_reward"):
        assert logged[1][key] == pytest.approx(direct[key], abs=1e-7), key

    # resumed to step 5: evaluated at 4 (the schedule counts the run's steps, not the resumed ones)
    assert main(["train", "--resume", *settings, "max_steps=5"]) == 0
    logged = _metrics(run)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in logged if "eval/reward" in r] == [2, 4]


def test_eval_dataset_takes_what_dataset_takes_a_datasets_folder_and_its_split(tmp_path):
    datasets = pytest.importorskip("datasets", reason="needs datasets (pip install -e '.[data]')")
    from torchforge.trainer.cli import check_run

    folder = tmp_path / "copy"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(demo.copy_digits_dataset(8, seed=1)),
                          "test": datasets.Dataset.from_list(demo.copy_digits_dataset(3, seed=2)),
                          "validation": datasets.Dataset.from_list(demo.copy_digits_dataset(2, seed=3))}
                         ).save_to_disk(str(folder))
    model = tmp_path / "model"
    (model).mkdir()
    (model / "config.json").write_text("{}")  # never loaded: check_run only
    base = {"model": str(model), "dataset": str(folder), "reward_functions": ["torchforge.trainer.demo.CopyDigitsReward"],
            "output_dir": str(tmp_path / "out"), "eval_steps": 1}
    run = check_run({**base, "eval_dataset": str(folder)})  # a DatasetDict: train for training, test for evaluation
    assert run.dataset == (str(folder), "train")
    assert [r["prompt"] for r in run.eval_rows] == [r["prompt"] for r in demo.copy_digits_dataset(3, seed=2)]
    run = check_run({**base, "eval_dataset": {"path": str(folder), "split": "validation"}})
    assert [r["prompt"] for r in run.eval_rows] == [r["prompt"] for r in demo.copy_digits_dataset(2, seed=3)]
    # the demo's task: fresh rows, another draw than the training rows'
    run = check_run({"eval_dataset": "demo", "eval_steps": 5, "output_dir": str(tmp_path / "demo")})
    assert run.eval_rows == demo.copy_digits_dataset(64, seed=run.config.seed + 1)


@pytest.mark.parametrize("settings, message", [
    ({"eval_steps": 10}, "eval_steps is set without eval_dataset: nothing would be evaluated; expected "
                         "eval_dataset=FILE (a JSONL file or datasets folder of prompts) too, or neither"),
    ({"eval_dataset": "{data}"}, "eval_dataset is set without eval_steps: nothing would be evaluated; expected "
                                 "eval_steps=N (every N steps) too, or neither"),
    ({"eval_dataset": "held_out.jsonl", "eval_steps": 10},
     "eval_dataset 'held_out.jsonl' does not exist; expected a JSONL file or a datasets folder"),
    ({"eval_dataset": "{no_prompt}", "eval_steps": 10},
     "eval_dataset: the eval dataset has 1 rows with fields ['question']; expected rows with a 'prompt' field"),
    ({"eval_dataset": {"path": "{data}", "split": "test"}, "eval_steps": 10},
     "eval_dataset: split 'test' of '{data}', which has no splits; expected a DatasetDict folder"),
    ({"eval_dataset": {"path": "{data}", "splt": "test"}, "eval_steps": 10},
     "eval_dataset={'path': '{data}', 'splt': 'test'}; expected a JSONL file, a datasets folder or {path: DIR, "
     "split: NAME}"),
    ({"eval_dataset": "demo", "eval_steps": 10}, "eval_dataset=demo with a model; expected a JSONL file"),
    ({"eval_dataset": "{bad_json}", "eval_steps": 10}, "eval_dataset {bad_json}:2: not a JSON line"),
])
def test_eval_dataset_mistakes_are_one_line_before_the_model_loads(tmp_path, settings, message, capsys, monkeypatch):
    import transformers
    import yaml

    from torchforge.trainer.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    paths = {"data": str(_jsonl(tmp_path / "data.jsonl", demo.copy_digits_dataset(4))),
             "no_prompt": str(_jsonl(tmp_path / "q.jsonl", [{"question": "1+1"}])),
             "bad_json": str(tmp_path / "bad.jsonl")}
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1"}\n{"prompt": \n')
    def fill(value):  # the {data} / {no_prompt} / {bad_json} placeholders of the cases
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        for name, path in paths.items():
            value = value.replace("{" + name + "}", path) if isinstance(value, str) else value
        return value

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": str(model), "dataset": paths["data"], "output_dir": str(tmp_path / "out"),
                                      "reward_functions": ["torchforge.trainer.demo.CopyDigitsReward"],
                                      **fill(settings)}))
    assert main(["train", "--config", str(config)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: " + fill(message)), lines
    assert not (tmp_path / "out").exists()


def test_the_issue_command_eval_steps_alone_on_the_demo_is_one_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "torchforge", "train", "eval_steps=10", f"output_dir={tmp_path / 'o'}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: eval_steps is set without eval_dataset: nothing would be evaluated; expected eval_dataset=FILE "
        "(a JSONL file or datasets folder of prompts) too, or neither"]


def test_the_trainer_refuses_eval_steps_without_an_eval_dataset_and_rows_without_a_prompt(tmp_path):
    from torchforge import RLTrainer

    with pytest.raises(InvalidArgumentError, match=r"^RLTrainer: eval_steps=1 without an eval_dataset: nothing would "
                                                   r"be evaluated; expected eval_dataset=rows"):
        RLTrainer(config=_config(tmp_path))
    with pytest.raises(InvalidArgumentError, match=r"^RLTrainer: the eval dataset has 0 rows; expected rows with a "
                                                   r"'prompt' field$"):
        RLTrainer(config=_config(tmp_path), eval_dataset=[])
