"""Reading a run's settings (``torchforge train`` and ``torchforge eval``): the YAML file and
overrides, dotted paths, the dataset, the reward functions, the did-you-mean hint."""

import sys

import pytest

from torchforge.errors import InvalidArgumentError
from torchforge.trainer.demo import copy_digits_dataset
from torchforge.trainer.run_config import (
    RewardRaised,
    add_import_folders,
    did_you_mean,
    import_object,
    load_run_config,
    read_dataset,
    reward_functions_from_settings,
)


def length_reward(prompts, completions, **kwargs):
    """A TRL-style reward function, imported by dotted path in the tests below."""
    return [float(len(c)) for c in completions]


def raises_on_sevens(prompts, completions, **kwargs):
    """Raises when any completion holds a 7, so one sample alone is found to raise."""
    if any("7" in c for c in completions):
        raise ValueError("a seven")
    return [0.0] * len(completions)


def test_settings_parse_as_yaml_values(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("learning_rate: 1e-3\nmax_steps: 5\noutput_dir: 1e3run\n")
    values = load_run_config(str(config), ["max_steps=7", "clip_high=0.28", "stop_token_ids=[5, 6]",
                                           "max_grad_norm=null", "warmup_steps=1e1", "reward_weights=[1e-1, 2]"])
    # 1e-3 is a string to YAML 1.1: read as the float it means (but not a name like "1e3run")
    assert values == {"learning_rate": 1e-3, "max_steps": 7, "clip_high": 0.28, "stop_token_ids": [5, 6],
                      "max_grad_norm": None, "warmup_steps": 10.0, "reward_weights": [0.1, 2],
                      "output_dir": "1e3run"}


@pytest.mark.parametrize("text, message", [
    (None, r"^--config .*nothing.yaml: no such file; expected a YAML file of settings$"),
    ("max_steps: [1\n", r"c.yaml:2: malformed YAML: "),
    ("- 1\n- 2\n", r"c.yaml holds a list; expected a mapping$"),
])
def test_a_bad_config_file_is_one_line(tmp_path, text, message):
    path = tmp_path / ("nothing.yaml" if text is None else "c.yaml")
    if text is not None:
        path.write_text(text)
    with pytest.raises(InvalidArgumentError, match=message):
        load_run_config(str(path))
    with pytest.raises(InvalidArgumentError, match=r"'max_steps' is not key=value; expected e.g. max_steps=100"):
        load_run_config(None, ["max_steps"])


def test_import_object():
    assert import_object("tests.trainer.test_run_config.length_reward") is length_reward
    assert import_object("tests.trainer.test_run_config:length_reward") is length_reward
    with pytest.raises(InvalidArgumentError, match=r"import_object: cannot import 'tests.trainer.test_run_config.x'"):
        import_object("tests.trainer.test_run_config.x")
    with pytest.raises(InvalidArgumentError, match=r"import_object: 'length_reward' is not a dotted path"):
        import_object("length_reward")


def test_the_command_keeps_its_old_names():
    # tests and users' scripts import these from the command's module
    from torchforge.trainer import cli, run_config

    assert cli.load_run_config is run_config.load_run_config and cli.import_object is run_config.import_object


def test_add_import_folders_puts_the_working_directory_and_the_config_folder_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "rewards_beside_the_config.py").write_text("def fn(prompts, completions): return [1.0]\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in (str(tmp_path), "")])
    add_import_folders(str(tmp_path / "conf" / "run.yaml"))
    assert sys.path[:2] == [str(tmp_path), str(tmp_path / "conf")]
    assert callable(import_object("rewards_beside_the_config.fn"))
    del sys.modules["rewards_beside_the_config"]
    add_import_folders(None)  # already there: not added twice
    assert sys.path.count(str(tmp_path)) == 1


def test_did_you_mean():
    assert did_you_mean("lerning_rate", ["learning_rate", "seed"]) == "; did you mean 'learning_rate'?"
    assert did_you_mean("zzz", ["learning_rate", "seed"]) == ""


def test_a_jsonl_file_and_a_datasets_folder_are_read(tmp_path):
    from datasets import Dataset

    (tmp_path / "d.jsonl").write_text('{"prompt": "1="}\n\n{"prompt": "2="}\n')
    assert read_dataset(str(tmp_path / "d.jsonl")) == [{"prompt": "1="}, {"prompt": "2="}]
    Dataset.from_list(copy_digits_dataset(4)).save_to_disk(tmp_path / "ds")
    data = read_dataset(str(tmp_path / "ds"))
    assert len(data) == 4 and data[0]["prompt"].endswith("=")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1="}\nnot json\n')
    with pytest.raises(InvalidArgumentError, match=r"bad.jsonl:2: not a JSON line"):
        read_dataset(str(tmp_path / "bad.jsonl"))
    with pytest.raises(InvalidArgumentError, match=r"does not exist; expected a JSONL file or a datasets folder"):
        read_dataset(str(tmp_path / "none.jsonl"))


def test_reward_functions_are_imported_and_a_raising_one_names_the_sample():
    copy, length, sevens = reward_functions_from_settings([
        "torchforge.trainer.demo.CopyDigitsReward", "tests.trainer.test_run_config:length_reward",
        "tests.trainer.test_run_config.raises_on_sevens"])
    assert (copy.name, length.name) == ("copy_digits", "length_reward")
    assert copy(prompts=["407="], completions=["407"]) == [1.0]  # a RewardFunction class is instantiated
    assert length(prompts=["1=", "2="], completions=["ab", ""]) == [2.0, 0.0]
    with pytest.raises(RewardRaised, match=r"^reward function 'tests.trainer.test_run_config.raises_on_sevens' raised "
                                           r"ValueError: a seven on sample 1 \(prompt '2=', completion '17'\)$"):
        sevens(prompts=["1=", "2="], completions=["1", "17"])
    with pytest.raises(InvalidArgumentError, match=r"reward_functions: 'sys.maxsize' is a int; expected a function"):
        reward_functions_from_settings(["sys.maxsize"])
