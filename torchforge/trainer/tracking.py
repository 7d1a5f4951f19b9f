"""Where a run's metrics go: a JSONL file, TensorBoard, and a progress bar."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

__all__ = ["MetricsLogger", "read_metrics", "PROGRESS_KEYS"]

#: the numbers shown on the progress bar
PROGRESS_KEYS = ("reward", "kl", "entropy", "loss", "completions/mean_length", "eval/pass@1")


class MetricsLogger:
    """Writes one JSON line per logged step to ``output_dir/metrics.jsonl``, the same scalars
    to TensorBoard (``output_dir/tensorboard``), and the key numbers to a progress bar.

    Only the process that owns the logger writes; on other ranks pass ``enabled=False``.

    Args:
        output_dir: the run folder.
        total_steps: the length of the progress bar.
        initial_step: where the bar starts (a resumed run). A resumed run's
            ``metrics.jsonl`` is cut back to this step and TensorBoard purges the later
            steps, so the steps trained again after a resume are never logged twice.
        enabled: write anything at all.
        progress_bar: show the bar.
        tensorboard: write TensorBoard events.

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
                 enabled: bool = True, progress_bar: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._bar = self._writer = None
        if not enabled:
            return
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
        if progress_bar:
            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True)

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
