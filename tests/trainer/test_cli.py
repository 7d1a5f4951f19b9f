"""The ``torchforge`` command: the embedded demo, real runs from a config, resume, plot, errors."""

import json
import re
import subprocess
import sys

import pytest
import yaml

from torchforge.trainer.cli import import_object, load_run_config, main
from torchforge.trainer.demo import char_tokenizer, copy_digits_dataset, tiny_llama
from torchforge.errors import InvalidArgumentError

QUICK = ["max_steps=2", "prompts_per_step=4", "num_generations=4", "progress_bar=false"]


def length_reward(prompts, completions, **kwargs):
    """A TRL-style reward function, imported by dotted path in the tests below."""
    return [float(len(c)) for c in completions]


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_with_no_config_runs_the_demo_and_says_where_everything_went(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *QUICK, f"output_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "trained 2 steps (GRPO)" in out and "reward " in out
    for path in (run / "metrics.jsonl", run / "checkpoints" / "step-000002", run / "final", run / "curves.png"):
        assert str(path) in out and path.exists()
    assert (run / "tensorboard").is_dir() and any((run / "tensorboard").iterdir())
    assert yaml.safe_load((run / "config.yaml").read_text())["max_steps"] == 2
    assert _steps(run) == [1, 2]


def test_resume_continues_the_run(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *QUICK, f"output_dir={run}"]) == 0
    assert main(["train", "--resume", *QUICK, "max_steps=3", f"output_dir={run}"]) == 0
    assert _steps(run) == [1, 2, 3]


def test_a_real_run_from_a_config_file(tmp_path, capsys):
    tokenizer = char_tokenizer()
    tiny_llama(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in copy_digits_dataset(8)))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tmp_path / "model"), "dataset": str(data),
        "reward_functions": ["torchforge.trainer.demo.CopyDigitsReward", "tests.trainer.test_cli:length_reward"],
        "algorithm": "grpo", "learning_rate": 1e-3, "max_completion_length": 5, "kl_coef": 0.0,
        "mixed_precision": "fp32", "gradient_checkpointing": False, "output_dir": str(tmp_path / "out"),
        "max_steps": 5,
    }))
    assert main(["train", "--config", str(config), *QUICK]) == 0  # key=value overrides the file
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and {"rewards/copy_digits/mean", "rewards/length_reward/mean"} <= set(rows[0])


def test_a_datasets_folder_is_accepted(tmp_path):
    from datasets import Dataset

    from torchforge.trainer.cli import _dataset

    Dataset.from_list(copy_digits_dataset(4)).save_to_disk(tmp_path / "ds")
    data = _dataset(str(tmp_path / "ds"))
    assert len(data) == 4 and data[0]["prompt"].endswith("=")


def test_plot_command(tmp_path, capsys):
    run = tmp_path / "run"
    main(["train", *QUICK, "max_steps=1", f"output_dir={run}"])
    (run / "curves.png").unlink()
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["train", "max_steps"], r"'max_steps' is not key=value; expected e.g. max_steps=100"),
    (["train", "lr=0.1"], r"RLConfig: unknown field\(s\) \['lr'\]"),
    (["train", "dataset=x.jsonl"], r"dataset / reward_functions given without a model"),
    (["train", "model=/nowhere"], r"model given but not \['dataset', 'reward_functions'\]"),
])
def test_bad_settings_exit_2_with_the_reason(argv, message, capsys):
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_settings_parse_as_yaml_values(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("learning_rate: 1e-3\nmax_steps: 5\noutput_dir: 1e3run\n")
    values = load_run_config(str(config), ["max_steps=7", "clip_high=0.28", "stop_token_ids=[5, 6]",
                                           "max_grad_norm=null", "warmup_steps=1e1", "reward_weights=[1e-1, 2]"])
    # 1e-3 is a string to YAML 1.1: read as the float it means (but not a name like "1e3run")
    assert values == {"learning_rate": 1e-3, "max_steps": 7, "clip_high": 0.28, "stop_token_ids": [5, 6],
                      "max_grad_norm": None, "warmup_steps": 10.0, "reward_weights": [0.1, 2],
                      "output_dir": "1e3run"}


def test_import_object():
    assert import_object("tests.trainer.test_cli.length_reward") is length_reward
    assert import_object("tests.trainer.test_cli:length_reward") is length_reward
    with pytest.raises(InvalidArgumentError, match=r"import_object: cannot import 'tests.trainer.test_cli.nothing'"):
        import_object("tests.trainer.test_cli.nothing")


def test_python_dash_m_runs_the_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torchforge", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--nproc" in out.stdout and "--resume" in out.stdout
