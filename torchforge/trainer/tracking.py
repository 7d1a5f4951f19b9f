"""Where a run's metrics go: a JSONL file, a progress bar, and the trackers of ``report_to``
(TensorBoard, Weights & Biases, Trackio)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Sequence

from tqdm.auto import tqdm

from torchforge.errors import InvalidArgumentError

__all__ = ["MetricsLogger", "read_metrics", "PROGRESS_KEYS", "TRACKERS", "check_report_to",
           "check_tracker_packages"]

#: the numbers shown on the progress bar
PROGRESS_KEYS = ("reward", "kl", "entropy", "loss", "completions/mean_length", "eval/pass@1")
#: the trackers of ``RLConfig.report_to`` (TRL's names)
TRACKERS = ("tensorboard", "wandb", "trackio")
#: where a run keeps its trackers' run ids, so that a resumed run continues the same tracker run
TRACKER_RUNS = "trackers.json"
#: the x-axis of the wandb charts: the training step (wandb's own step restarts in a resumed offline run)
WANDB_STEP = "train/global_step"


def check_report_to(report_to: Any) -> list[str]:
    """``RLConfig.report_to`` as a list of tracker names (no package is imported).

    Args:
        report_to: a list of names among :data:`TRACKERS`, one name, or ``"none"`` / ``[]``.

    Returns:
        The names, each once, in order.

    Example:
        >>> check_report_to("wandb"), check_report_to("none"), check_report_to(["tensorboard", "trackio"])
        (['wandb'], [], ['tensorboard', 'trackio'])
    """
    given = [report_to] if isinstance(report_to, str) else report_to
    if given == ["none"]:
        return []
    if not isinstance(given, (list, tuple)) or not all(isinstance(n, str) and n in TRACKERS for n in given):
        raise InvalidArgumentError(
            f"RLConfig: report_to={report_to!r}; expected a list of names among {list(TRACKERS)}, one name, or 'none'"
        )
    return list(dict.fromkeys(given))


def check_tracker_packages(report_to: Sequence[str]) -> None:
    """Raise, naming the extra to install, when a tracker of ``report_to`` is not installed.

    Args:
        report_to: tracker names (:func:`check_report_to`'s output).

    Returns:
        None.

    Example:
        >>> check_tracker_packages(["tensorboard"])
    """
    for name in report_to:
        if name in ("wandb", "trackio") and importlib.util.find_spec(name) is None:
            raise InvalidArgumentError(
                f"report_to: {name!r} needs the {name} package, which is not installed; "
                f'pip install "torchforge[{name}]"'
            )


def _tracker_runs(output_dir: Path) -> dict[str, Any]:
    path = output_dir / TRACKER_RUNS
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


class MetricsLogger:
    """Writes one JSON line per logged step to ``output_dir/metrics.jsonl``, the same scalars
    to TensorBoard (``output_dir/tensorboard``), and the key numbers to a progress bar.

    Only the process that owns the logger writes; on other ranks pass ``enabled=False``.

    The trackers of ``report_to`` get every logged metric at its step, and wandb and
    Trackio also the run's config. Their run ids are kept in ``output_dir/trackers.json``:
    a resumed run (``initial_step > 0``) continues the same wandb run (``id``,
    ``resume="allow"``; charts against ``train/global_step``) and the same Trackio run
    (its name, ``resume="allow"``). wandb writes under ``output_dir/wandb`` in the mode of
    ``WANDB_MODE`` (``offline`` without a network; ``wandb sync`` uploads later); the
    projects are ``WANDB_PROJECT`` / ``TRACKIO_PROJECT``, default ``"torchforge"``.

    Args:
        output_dir: the run folder.
        total_steps: the length of the progress bar.
        initial_step: where the bar starts (a resumed run). A resumed run's
            ``metrics.jsonl`` is cut back to this step and TensorBoard purges the later
            steps, so the steps trained again after a resume are never logged twice
            (wandb and Trackio cannot delete points: the steps trained again appear twice there).
        enabled: write anything at all.
        progress_bar: show the bar.
        tensorboard: write TensorBoard events (when ``report_to`` is None).
        report_to: tracker names among :data:`TRACKERS`; None: ``["tensorboard"]`` if
            ``tensorboard`` else none.
        run_config: the run's settings, for wandb's and Trackio's run config.
        run_name: the tracker run's name; None: the ``output_dir`` folder's name.

    Returns:
        The logger; call :meth:`log` every logged step and :meth:`close` at the end.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     logger = MetricsLogger(d, total_steps=1, progress_bar=False, tensorboard=False)
        ...     logger.log(1, {"reward": 0.5})
        ...     logger.close()
        ...     read_metrics(d)
        [{'step': 1, 'reward': 0.5}]
    """

    def __init__(self, output_dir: str | os.PathLike, *, total_steps: int, initial_step: int = 0,
                 enabled: bool = True, progress_bar: bool = True, tensorboard: bool = True,
                 report_to: Sequence[str] | str | None = None, run_config: dict[str, Any] | None = None,
                 run_name: str | None = None) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._bar = self._writer = self._wandb = self._trackio = None
        trackers = check_report_to(report_to) if report_to is not None else (["tensorboard"] if tensorboard else [])
        tensorboard = "tensorboard" in trackers
        if not enabled:
            return
        check_tracker_packages(trackers)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if initial_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run replaces the old log; a resumed one appends
        elif initial_step > 0:
            from torchforge.trainer.run_dir import truncate_metrics

            truncate_metrics(output_dir, initial_step)  # steps after the checkpoint are trained again
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops the earlier events at steps >= it (the resumed ones)
            self._writer = SummaryWriter(str(Path(output_dir) / "tensorboard"),
                                         purge_step=initial_step + 1 if initial_step > 0 else None)
        if "wandb" in trackers or "trackio" in trackers:
            self._start_trackers(Path(output_dir), trackers, initial_step, run_config, run_name)
        if progress_bar:
            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True)

    def _start_trackers(self, output_dir: Path, trackers: list[str], initial_step: int,
                        run_config: dict[str, Any] | None, run_name: str | None) -> None:
        """wandb and Trackio runs: new ones, or those of ``trackers.json`` when resuming."""
        earlier = _tracker_runs(output_dir) if initial_step > 0 else {}
        runs: dict[str, Any] = {}
        name = run_name or output_dir.resolve().name
        config = dict(run_config or {})
        if "wandb" in trackers:
            import wandb

            stored = earlier.get("wandb", {})
            run_id = stored.get("id") or uuid.uuid4().hex[:12]
            project = stored.get("project") or os.environ.get("WANDB_PROJECT", "torchforge")
            self._wandb = wandb.init(project=project, name=name, id=run_id, resume="allow", config=config,
                                     dir=str(output_dir))
            self._wandb.define_metric(WANDB_STEP)
            self._wandb.define_metric("*", step_metric=WANDB_STEP)
            runs["wandb"] = {"id": run_id, "project": project}
        if "trackio" in trackers:
            import trackio

            stored = earlier.get("trackio", {})
            project = stored.get("project") or os.environ.get("TRACKIO_PROJECT", "torchforge")
            # a new run gets a unique name (Trackio names runs), a resumed one its stored name
            trackio_name = stored.get("name") or f"{name}-{uuid.uuid4().hex[:6]}"
            self._trackio = trackio.init(project=project, name=trackio_name, config=config,
                                         resume="allow" if stored else "never", embed=False)
            runs["trackio"] = {"project": project, "name": trackio_name}
        (output_dir / TRACKER_RUNS).write_text(json.dumps({**_tracker_runs(output_dir), **runs}, indent=1) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` at ``step``.

        Args:
            step: the step (1-based).
            metrics: name -> float.

        Returns:
            None.
        """
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            # NaN is not JSON: write null
            f.write(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}) + "\n")
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({**{k: v for k, v in row.items() if k != "step"}, WANDB_STEP: step})
        if self._trackio is not None:
            self._trackio.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._bar is not None:
            self._bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3g}" for k in PROGRESS_KEYS if k in metrics},
                                  refresh=False)

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar.

        Args:
            steps: how many steps were done.

        Returns:
            None.
        """
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        """Flush and close the outputs.

        Args:
            None.

        Returns:
            None.
        """
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._trackio is not None:
            self._trackio.finish()
            self._trackio = None
        if self._bar is not None:
            self._bar.close()


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl``.

    Args:
        run_dir: a run folder.

    Returns:
        A list of dicts, one per logged step (null values as NaN).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"read_metrics: {path} does not exist; expected the metrics of a torchforge run")
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append({k: (math.nan if v is None else v) for k, v in json.loads(line).items()})
    return rows
