"""The ``torchforge`` command: the embedded demo, real runs from a config, resume, plot, errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from torchforge.trainer.cli import main
from torchforge.trainer.demo import char_tokenizer, copy_digits_dataset, tiny_llama

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
    assert "trained 2 steps (GRPO)" in out and "reward " in out and "clipped " in out
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


def test_plot_command(tmp_path, capsys):
    run = tmp_path / "run"
    main(["train", *QUICK, "max_steps=1", f"output_dir={run}"])
    (run / "curves.png").unlink()
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["train", "max_steps"], r"'max_steps' is not key=value; expected e.g. max_steps=100"),
    (["train", "lr=0.1"], r"unknown setting 'lr'"),
    (["train", "dataset=x.jsonl"], r"dataset / reward_functions given without a model"),
    (["train", "model=/nowhere"], r"model given but not \['dataset', 'reward_functions'\]"),
])
def test_bad_settings_exit_2_with_the_reason(argv, message, capsys):
    assert main(argv) == 2
    assert re.search(message, capsys.readouterr().err)


def test_python_dash_m_runs_the_command_and_help_lists_every_setting_with_its_default(tmp_path):
    from torchforge.trainer.config import RLConfig

    out = torchforge("train", "--help")
    assert out.returncode == 0
    for flag in ("--nproc", "--resume", "--overwrite", "--debug", "--nnodes", "--node-rank", "--master-addr",
                 "--master-port"):
        assert flag in out.stdout
    for key in ("model", "dataset", "reward_functions", "distributed"):
        assert re.search(rf"^  {key} +\S", out.stdout, flags=re.MULTILINE), key
    for key, default in RLConfig().to_dict().items():
        assert re.search(rf"^  {key} +{re.escape(repr(default))}", out.stdout, flags=re.MULTILINE), key
    assert re.search(r"^  max_steps +None +\[demo: 300\]", out.stdout, flags=re.MULTILINE)


# --- mistakes: one line, exit 2, before any model loads ------------------------------------

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def torchforge(*args, script=False, **kwargs):
    """The ``torchforge`` command, as a user runs it (``python -m torchforge`` or the installed script)."""
    command = [str(Path(sys.executable).parent / "torchforge")] if script else [sys.executable, "-m", "torchforge"]
    return subprocess.run([*command, *args], capture_output=True, text=True, env={**ENV, **kwargs.pop("env", {})},
                          timeout=600, **kwargs)


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.fixture
def unloadable_model(tmp_path):
    """A model folder that fails with a long traceback if anything tries to load it."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{ this is not JSON")
    return folder


@pytest.fixture
def real_run(tmp_path, unloadable_model):
    """Settings of a real run (model, dataset, rewards) whose model would fail to load."""
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in copy_digits_dataset(8)))
    return {"model": str(unloadable_model), "dataset": str(data),
            "reward_functions": ["torchforge.trainer.demo.CopyDigitsReward"], "output_dir": str(tmp_path / "out")}


def test_a_typo_is_one_line_with_the_nearest_key_before_the_model_loads(tmp_path, real_run):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**real_run, "lerning_rate": 1e-3}))
    out = torchforge("train", "--config", str(config))
    assert out.returncode == 2
    assert _one_error_line(out.stderr) == ("error: unknown setting 'lerning_rate'; did you mean 'learning_rate'? "
                                           "(`torchforge train --help` lists them all)")
    assert not (tmp_path / "out").exists()


def test_under_nproc_a_mistake_is_printed_once_before_any_process_starts(tmp_path):
    out = torchforge("train", "--nproc", "2", "max_stepz=3", f"output_dir={tmp_path / 'out'}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "did you mean 'max_steps'?" in _one_error_line(out.stderr)


@pytest.mark.parametrize("settings, message", [
    ({"learning_rate": "fast"}, r"^learning_rate='fast' is a str; expected float$"),
    ({"max_steps": 2.5}, r"^max_steps=2.5 is a float; expected int or None$"),
    ({"progress_bar": "no way"}, r"^progress_bar='no way' is a str; expected bool$"),
    ({"algorithm": "grpoo"}, r"^RLConfig: algorithm='grpoo'; expected one of \['grpo', 'ppo', 'reinforce'\]$"),
    ({"num_generations": 0}, r"^RLConfig: num_generations=0; expected an int >= 1$"),
    ({"dataset": "missing.jsonl"}, r"^dataset 'missing.jsonl' does not exist; expected a JSONL file"),
    ({"reward_functions": ["nowhere_module.fn"]}, r"^import_object: cannot import 'nowhere_module.fn': No module"),
    ({"reward_functions": ["torchforge.trainer.demo.NoSuchReward"]}, r"^import_object: cannot import"),
    ({"distributed": {"strategi": "ddp"}}, r"^unknown setting distributed.strategi; did you mean 'strategy'\?"),
    ({"distributed": {"strategy": "zero"}}, r"^DistributedConfig: strategy"),
    ({"output_dir": "/proc/torchforge-run"}, r"^output_dir='/proc/torchforge-run' is not writable"),
    ({"prompts_per_step": 6, "num_generations": 4}, None),  # fine on 1 process
])
def test_every_settings_mistake_is_one_error_line_and_exit_2_before_the_model_loads(
        tmp_path, real_run, settings, message, capsys, monkeypatch):
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**real_run, **settings}))
    if message is None:
        with pytest.raises(AssertionError, match="the model was loaded"):
            main(["train", "--config", str(config)])
        return
    assert main(["train", "--config", str(config)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert re.search(message, line.removeprefix("error: ")), line


def test_a_missing_or_malformed_config_file_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nothing.yaml")]) == 2
    assert _one_error_line(capsys.readouterr().err) == f"error: --config {tmp_path / 'nothing.yaml'}: no such file; expected a YAML file of settings"
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 3\nlearning_rate: [1e-3\noutput_dir: x\n")
    assert main(["train", "--config", str(config)]) == 2
    assert re.match(rf"error: {re.escape(str(config))}:3: malformed YAML: ", _one_error_line(capsys.readouterr().err))
    assert main(["train", "max_steps=[3"]) == 2
    assert "'max_steps=[3': the value is not valid YAML" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("count", ["0", "-2", "two", "1.5"])
def test_nonsense_process_counts_are_rejected(count, capsys):
    assert main(["train", "--nproc", count]) == 2
    assert _one_error_line(capsys.readouterr().err) == f"error: --nproc {count}; expected a whole number >= 1"


def test_nproc_0_through_the_command():
    out = torchforge("train", "--nproc", "0")
    assert out.returncode == 2 and _one_error_line(out.stderr) == "error: --nproc 0; expected a whole number >= 1"


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "0"], "--nnodes 0; expected a whole number >= 1"),
    (["--nnodes", "2"], "--nnodes 2 without --master-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank 2 with --nnodes 2"),
    (["--node-rank", "1"], "without --nnodes N"),
    (["--nnodes", "2", "--master-addr", "h", "--master-port", "70000"], "--master-port 70000; expected a port"),
    (["--nnodes", "2", "--master-addr", "h", "prompts_per_step=3"], "prompts_per_step=3 does not split over 2"),
    (["--nproc", "2", "distributed_strategy=none"], "distributed_strategy='none' with 2 processes would train one"),
])
def test_bad_multi_node_flags(argv, message, capsys):
    assert main(["train", *argv]) == 2
    assert message in _one_error_line(capsys.readouterr().err)


# --- the model path -------------------------------------------------------------------------

def test_a_model_path_that_does_not_exist_fails_at_once_naming_it(tmp_path, real_run):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**real_run, "model": "./models/nowhere"}))
    out = torchforge("train", "--config", str(config), env={"HF_HUB_OFFLINE": "0"})  # would try a hub if it could
    assert out.returncode == 2
    assert _one_error_line(out.stderr) == ("error: model './models/nowhere' does not exist; "
                                           "expected a Hugging Face model folder")


@pytest.mark.parametrize("model, message", [
    ("~/no/such/model", "model '~/no/such/model' does not exist"),
    ("/no/such/model", "model '/no/such/model' does not exist"),
    ("runs/a/final/", "model 'runs/a/final/' does not exist"),
    ("some-org/no-such-model", "neither a local folder nor in the Hugging Face cache (HF_HUB_OFFLINE is set)"),
])
def test_model_paths_that_look_local_are_never_sent_to_a_hub(model, message, tmp_path, real_run, capsys,
                                                              monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**real_run, "model": model}))
    assert main(["train", "--config", str(config)]) == 2
    assert message in _one_error_line(capsys.readouterr().err)


def test_a_model_folder_without_config_json_is_one_line(tmp_path, real_run, capsys):
    (tmp_path / "empty").mkdir()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**real_run, "model": str(tmp_path / "empty")}))
    assert main(["train", "--config", str(config)]) == 2
    assert "is a folder without config.json" in _one_error_line(capsys.readouterr().err)


# --- reward functions next to the config ----------------------------------------------------

MYREWARDS = """
def length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def picky(prompts, completions, **kwargs):
    return [1.0 / (len(c) - len(c)) if p.startswith("7") else 0.0 for p, c in zip(prompts, completions)]
"""


@pytest.fixture
def project(tmp_path):
    """A user's project: a model, a dataset, myrewards.py and run.yaml in one folder."""
    folder = tmp_path / "project"
    folder.mkdir()
    tokenizer = char_tokenizer()
    tiny_llama(tokenizer).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    rows = [{"prompt": p} for p in ("123=", "456=", "789=", "012=")]
    (folder / "data.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    (folder / "myrewards.py").write_text(MYREWARDS)
    settings = {"model": str(folder / "model"), "dataset": str(folder / "data.jsonl"), "max_steps": 1,
                "prompts_per_step": 4, "num_generations": 2, "max_completion_length": 3, "kl_coef": 0.0,
                "mixed_precision": "fp32", "gradient_checkpointing": False, "progress_bar": False,
                "output_dir": str(folder / "out")}
    return folder, settings


def test_a_reward_module_next_to_the_config_imports_under_the_installed_script(project, tmp_path):
    folder, settings = project
    (folder / "run.yaml").write_text(yaml.safe_dump({**settings, "reward_functions": ["myrewards.length"]}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = torchforge("train", "--config", str(folder / "run.yaml"), script=True, cwd=elsewhere)
    assert out.returncode == 0, out.stderr
    row = json.loads((folder / "out" / "metrics.jsonl").read_text())
    assert "rewards/length/mean" in row


def test_a_raising_reward_function_is_one_line_naming_it_the_sample_and_the_exception(project, capsys):
    folder, settings = project
    (folder / "run.yaml").write_text(yaml.safe_dump({**settings, "reward_functions": ["myrewards:picky"]}))
    out = torchforge("train", "--config", "run.yaml", cwd=folder)
    assert out.returncode == 1
    line = _one_error_line(out.stderr.replace("Writing model shards", "").strip())
    assert re.fullmatch(r"error: reward function 'myrewards:picky' raised ZeroDivisionError: float division by zero "
                        r"on sample \d \(prompt '789=', completion '.*'\) \(--debug prints the traceback\)", line), line
    # --debug: the whole traceback, down to the user's line
    assert main(["train", "--debug", "--overwrite", "--config", str(folder / "run.yaml")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "1.0 / (len(c) - len(c))" in err


# --- past one machine -------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_one_process_equal_one_process_and_their_checkpoint_resumes_on_one(tmp_path):
    # Two launchers, as on two machines: each starts one process; node 0 hosts the rendezvous.
    settings = ["max_steps=2", "prompts_per_step=4", "num_generations=4", "kl_coef=0.05", "progress_bar=false",
                "loss_aggregation=seq-mean-token-mean"]
    port = str(_free_port())
    nodes = [subprocess.Popen([sys.executable, "-m", "torchforge", "train", "--nnodes", "2", "--node-rank", str(r),
                               "--master-addr", "127.0.0.1", "--master-port", port, *settings,
                               f"output_dir={tmp_path / 'two'}"], env=ENV, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "trained 2 steps (GRPO)" in outputs[0][0]  # rank 0 prints the summary
    assert main(["train", *settings, f"output_dir={tmp_path / 'one'}"]) == 0
    one, two = (_rows(tmp_path / name) for name in ("one", "two"))
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ("loss", "reward", "kl", "entropy", "grad_norm", "completions/mean_length"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    # the checkpoint of the 2 processes on 2 nodes continues on 1 process
    with pytest.warns(UserWarning, match="checkpoint saved by 2 processes, resumed with 1"):
        assert main(["train", "--resume", *settings, "max_steps=3", f"output_dir={tmp_path / 'two'}"]) == 0
    assert [r["step"] for r in _rows(tmp_path / "two")] == [1, 2, 3]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- the demo ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_demo_learns_to_copy_and_stop(tmp_path):
    # `torchforge train` as it comes: the clipped ratio falls, and the exported model stops on its own
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = torchforge("train", "progress_bar=false", f"output_dir={tmp_path / 'demo'}")
    assert out.returncode == 0, out.stderr
    reward = re.search(r"reward +(-?[\d.]+) -> (-?[\d.]+)", out.stdout).groups()
    clipped = re.search(r"clipped +([\d.]+) -> ([\d.]+)", out.stdout).groups()
    assert float(reward[1]) - float(reward[0]) >= 0.5, out.stdout
    assert float(clipped[0]) > 0.5 and float(clipped[1]) < 0.1, out.stdout
    final = tmp_path / "demo" / "final"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    prompts = [row["prompt"] for row in copy_digits_dataset(64, seed=123)]
    inputs = tokenizer(prompts, return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)[:, inputs["input_ids"].shape[1]:]
    stopped = [tokenizer.eos_token_id in row.tolist()[:4] for row in generated]
    assert sum(stopped) / len(stopped) >= 0.9, tokenizer.batch_decode(generated)


@pytest.mark.parametrize("engine", ["hf", "hf-process"])
def test_a_users_model_trains_asynchronously_from_the_command_line(project, monkeypatch, engine):
    folder, settings = project
    monkeypatch.syspath_prepend(str(folder))  # myrewards.py, as the installed script finds it next to run.yaml
    (folder / "run.yaml").write_text(yaml.safe_dump({**settings, "max_steps": 3, "reward_functions": ["myrewards.length"]}))
    assert main(["train", "--config", str(folder / "run.yaml"), "async_generation=true", "max_staleness=1",
                 f"engine={engine}"]) == 0
    rows = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["async/staleness"] <= 1 and "rewards/length/mean" in r for r in rows)
