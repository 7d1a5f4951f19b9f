"""MetricsLogger and read_metrics: one JSON line per logged step, the same scalars in TensorBoard."""

import json
import math

import pytest
import torch

from torchforge.trainer.tracking import MetricsLogger, read_metrics


def _events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events


def test_each_step_is_one_json_line_and_nan_is_null(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=2, progress_bar=False, tensorboard=False)
    logger.log(1, {"reward": 0.25, "kl": torch.tensor(0.5), "count": 3})
    logger.log(2, {"reward": math.nan})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "reward": 0.25, "kl": 0.5, "count": 3.0},
        {"step": 2, "reward": None},  # strict JSON: NaN is not a JSON number
    ]
    rows = read_metrics(tmp_path)
    assert rows[0] == {"step": 1, "reward": 0.25, "kl": 0.5, "count": 3.0}
    assert rows[1]["step"] == 2 and math.isnan(rows[1]["reward"])


def test_tensorboard_gets_the_same_scalars_and_a_resume_purges_the_steps_trained_again(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=3, progress_bar=False)
    for step in (1, 2, 3):
        logger.log(step, {"reward": float(step)})
    logger.close()
    assert [(e.step, e.value) for e in _events(tmp_path).Scalars("reward")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    # resumed from a checkpoint at step 1: steps 2 and 3 are trained again, with new values
    logger = MetricsLogger(tmp_path, total_steps=3, initial_step=1, progress_bar=False)
    assert [row["step"] for row in read_metrics(tmp_path)] == [1]
    for step in (2, 3):
        logger.log(step, {"reward": 10.0 * step})
    logger.close()
    assert [(row["step"], row["reward"]) for row in read_metrics(tmp_path)] == [(1, 1.0), (2, 20.0), (3, 30.0)]
    assert [(e.step, e.value) for e in _events(tmp_path).Scalars("reward")] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_a_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", total_steps=1, enabled=False)
    logger.log(1, {"reward": 1.0})
    logger.advance()
    logger.close()
    assert not (tmp_path / "run").exists()


def test_read_metrics_of_a_folder_without_a_run_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"read_metrics: .*metrics.jsonl does not exist"):
        read_metrics(tmp_path)


# --- report_to: wandb (offline) and trackio (local) ---------------------------------------

import struct

from torchforge.errors import InvalidArgumentError
from torchforge.trainer.cli import main
from torchforge.trainer.tracking import check_report_to, check_tracker_packages


@pytest.fixture
def trackers_env(tmp_path, monkeypatch):
    """wandb offline with its files under tmp_path, trackio's database under tmp_path."""
    pytest.importorskip("wandb")
    trackio = pytest.importorskip("trackio")
    import trackio.sqlite_storage

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")  # read at import
    return tmp_path


def _wandb_records(run_dir):
    """Every record of the offline wandb runs under run_dir/wandb: [(run id, kind, payload)], in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, block, chunk = path.read_bytes(), 7, 32768, b""  # 7 bytes of file header
        while pos + 7 <= len(data):  # LevelDB-style log: 32 KiB blocks of (crc, length, type) records
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if length == 0 and kind == 0:
                pos += left
                continue
            chunk += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last piece of one
                record = pb.Record()
                record.ParseFromString(chunk)
                chunk = b""
                which = record.WhichOneof("record_type")
                if which == "run":
                    out.append((record.run.run_id, "config",
                                {i.key: json.loads(i.value_json) for i in record.run.config.update}))
                elif which == "history":
                    out.append((None, "history", {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                                  for i in record.history.item}))  # "a/b" is a nested key
    return out


def _wandb_history(run_dir):
    return [(h["train/global_step"], h.get("reward")) for _, kind, h in _wandb_records(run_dir) if kind == "history"]


def _trackio_logs(run_dir):
    from trackio.sqlite_storage import SQLiteStorage

    stored = json.loads((run_dir / "trackers.json").read_text())["trackio"]
    logs = SQLiteStorage.get_logs(stored["project"], stored["name"])
    return stored, [(row["step"], row.get("reward")) for row in logs]


def test_wandb_and_trackio_get_the_config_and_every_metric_and_a_resume_continues_their_runs(trackers_env):
    run_dir = trackers_env / "run"
    config = {"learning_rate": 1e-3, "algorithm": "grpo"}
    logger = MetricsLogger(run_dir, total_steps=3, progress_bar=False, report_to=["wandb", "trackio"],
                           run_config=config, run_name="my-run")
    for step in (1, 2):
        logger.log(step, {"reward": 0.5 * step, "kl": torch.tensor(0.25)})
    logger.close()
    assert not (run_dir / "tensorboard").exists()  # not asked for
    stored = json.loads((run_dir / "trackers.json").read_text())
    records = _wandb_records(run_dir)
    run_ids = {r for r, kind, _ in records if kind == "config"}
    assert run_ids == {stored["wandb"]["id"]}
    assert {"learning_rate": 1e-3, "algorithm": "grpo"}.items() <= records[0][2].items()
    assert _wandb_history(run_dir) == [(1, 0.5), (2, 1.0)]
    assert [h["kl"] for _, kind, h in records if kind == "history"] == [0.25, 0.25]
    trackio_run, logs = _trackio_logs(run_dir)
    assert trackio_run["name"].startswith("my-run-") and logs == [(1, 0.5), (2, 1.0)]
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_run_config(trackio_run["project"], trackio_run["name"])["learning_rate"] == 1e-3

    # resumed from a checkpoint at step 1: the same wandb run id and the same trackio run
    logger = MetricsLogger(run_dir, total_steps=3, initial_step=1, progress_bar=False,
                           report_to=["wandb", "trackio"], run_config=config, run_name="my-run")
    for step in (2, 3):
        logger.log(step, {"reward": 10.0 * step})
    logger.close()
    assert json.loads((run_dir / "trackers.json").read_text()) == stored
    assert {r for r, kind, _ in _wandb_records(run_dir) if kind == "config"} == {stored["wandb"]["id"]}
    assert _wandb_history(run_dir) == [(1, 0.5), (2, 1.0), (2, 20.0), (3, 30.0)]  # wandb keeps the old points
    assert _trackio_logs(run_dir) == (trackio_run, [(1, 0.5), (2, 1.0), (2, 20.0), (3, 30.0)])
    # a fresh run in a new folder is a new tracker run
    MetricsLogger(trackers_env / "other", total_steps=1, progress_bar=False, report_to="wandb").close()
    assert json.loads((trackers_env / "other" / "trackers.json").read_text())["wandb"]["id"] != stored["wandb"]["id"]


def test_torchforge_train_reports_to_every_tracker_and_resume_continues_them(trackers_env, capsys):
    run_dir = trackers_env / "run"
    quick = ["prompts_per_step=2", "num_generations=2", "progress_bar=false", f"output_dir={run_dir}",
             "report_to=[tensorboard, wandb, trackio]"]
    assert main(["train", "max_steps=2", *quick]) == 0
    assert (run_dir / "tensorboard").is_dir()
    stored = json.loads((run_dir / "trackers.json").read_text())
    records = _wandb_records(run_dir)
    config = next(payload for _, kind, payload in records if kind == "config")
    assert config["max_steps"] == 2 and config["report_to"] == ["tensorboard", "wandb", "trackio"]
    history = [h for _, kind, h in records if kind == "history"]
    rows = read_metrics(run_dir)
    assert [h["train/global_step"] for h in history] == [1, 2]
    assert set(rows[0]) - {"step"} <= set(history[0])  # every logged metric
    assert history[1]["reward"] == pytest.approx(rows[1]["reward"])
    assert main(["train", "--resume", "max_steps=3", *quick]) == 0
    assert json.loads((run_dir / "trackers.json").read_text()) == stored
    assert [s for s, _ in _wandb_history(run_dir)] == [1, 2, 3]
    assert {r for r, kind, _ in _wandb_records(run_dir) if kind == "config"} == {stored["wandb"]["id"]}
    assert [s for s, _ in _trackio_logs(run_dir)[1]] == [1, 2, 3]


def test_a_missing_tracker_package_is_one_line_naming_the_extra_before_anything_loads(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(InvalidArgumentError, match=r"""report_to: 'wandb' needs the wandb package, which is not """
                                                   r"""installed; pip install "torchforge\[wandb\]\""""):
        check_tracker_packages(["tensorboard", "wandb"])
    assert main(["train", "report_to=wandb", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err == 'error: report_to: \'wandb\' needs the wandb package, which is not installed; pip install "torchforge[wandb]"\n'
    assert not (tmp_path / "run").exists()
    from torchforge import RLConfig, RLTrainer

    with pytest.raises(InvalidArgumentError, match=r"report_to: 'wandb' needs the wandb package"):
        RLTrainer(config=RLConfig(report_to=["wandb"], output_dir=str(tmp_path / "run2")))


def test_report_to_names_are_checked():
    from torchforge import RLConfig

    assert RLConfig().report_to == ["tensorboard"]
    assert RLConfig(report_to="none").report_to == [] and check_report_to(["wandb", "wandb"]) == ["wandb"]
    with pytest.raises(InvalidArgumentError, match=r"RLConfig: report_to=\['tensorbord'\]; expected a list of names "
                                                   r"among \['tensorboard', 'wandb', 'trackio'\]"):
        RLConfig(report_to=["tensorbord"])
