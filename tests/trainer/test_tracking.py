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
