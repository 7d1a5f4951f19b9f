"""The rules of a run folder: one run per ``output_dir``, resume, overwrite, interrupts.

A folder *holds a run* when it has a logged step, a checkpoint or a final model. A new run never writes into such a folder: it continues the run (``--resume``),
replaces it (``--overwrite``, which deletes exactly those files first) or goes elsewhere.
Resuming cuts ``metrics.jsonl`` back to the checkpoint's step (the steps logged after the
last checkpoint are trained again), and TensorBoard purges the same steps, so neither holds
a step twice. Ctrl-C stops after the current step with a checkpoint (:class:`StopOnInterrupt`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from torchforge.distributed.checkpoint import latest_checkpoint
from torchforge.errors import InvalidArgumentError, TorchforgeError

__all__ = [
    "RUN_FILES", "RunInterrupted", "holds_run", "earlier_run", "last_checkpoint_step",
    "prepare_output_dir", "check_writable", "truncate_metrics", "StopOnInterrupt",
]

#: what a run writes into its output_dir (``trackers.json`` and ``wandb``: its tracker runs,
#: which a new run in the folder must not continue or upload with its own)
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "final", "final-merged", "tensorboard", "curves.png",
             "trackers.json", "wandb")
#: what makes a folder hold a run: a logged step, a checkpoint or a final model (a run that
#: failed before its first step leaves only config.yaml, and nothing is lost by replacing it)
_RUN_MARKS = ("metrics.jsonl", "checkpoints", "final")


class RunInterrupted(TorchforgeError):
    """The run stopped on Ctrl-C; ``step`` steps are done, ``checkpoint_step`` is the last saved."""

    def __init__(self, step: int, checkpoint_step: int | None) -> None:
        self.step, self.checkpoint_step = step, checkpoint_step
        saved = f"last checkpoint step {checkpoint_step}" if checkpoint_step is not None else "no checkpoint yet"
        super().__init__(f"stopped at step {step}; {saved}; continue with --resume")


def holds_run(output_dir: str | os.PathLike) -> bool:
    """Whether ``output_dir`` holds (part of) a torchforge run: metrics, checkpoints or a final model.

    Args:
        output_dir: a folder (need not exist).

    Returns:
        bool.

    Example:
        >>> holds_run("/nonexistent/run")
        False
    """
    root = Path(output_dir)
    return root.is_dir() and any((root / name).exists() for name in _RUN_MARKS)


def last_checkpoint_step(output_dir: str | os.PathLike) -> int | None:
    """The step of the newest complete checkpoint in ``output_dir`` (see ``latest_checkpoint``), or None.

    Args:
        output_dir: the run folder.

    Returns:
        int or None.

    Example:
        >>> last_checkpoint_step("/nonexistent/run") is None
        True
    """
    latest = latest_checkpoint(Path(output_dir) / "checkpoints")
    return None if latest is None else int(latest.name.split("-", 1)[1])


def earlier_run(output_dir: str | os.PathLike) -> str | None:
    """The run ``output_dir`` holds, in a few words (``"a run (checkpoint at step 4)"``), or
    None when it holds none (see :func:`holds_run`).

    Args:
        output_dir: a folder (need not exist).

    Returns:
        str or None.

    Example:
        >>> earlier_run("/nonexistent/run") is None
        True
    """
    if not holds_run(output_dir):
        return None
    step = last_checkpoint_step(output_dir)
    return f"a run (checkpoint at step {step})" if step is not None else "a run"


def check_writable(output_dir: str | os.PathLike) -> None:
    """Raise ``InvalidArgumentError`` unless ``output_dir`` is (or can be created as) a writable folder.

    Args:
        output_dir: the run folder.

    Returns:
        None.
    """
    path = Path(output_dir).expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise InvalidArgumentError(f"output_dir={str(output_dir)!r}: {probe} is a file; expected a folder")
    try:  # a real write (os.access says yes to root everywhere, even on read-only mounts)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError:
        raise InvalidArgumentError(
            f"output_dir={str(output_dir)!r} is not writable ({probe} does not allow writing); "
            "expected a folder you can write to"
        ) from None


def prepare_output_dir(output_dir: str | os.PathLike, *, resume: bool, overwrite: bool) -> str | None:
    """Apply the one-run-per-folder rule before a run starts; returns a note to print, or None.

    - a new run into a folder that holds a run: ``InvalidArgumentError`` saying how to resume
      or start over; nothing is touched;
    - ``overwrite``: the earlier run's files (:data:`RUN_FILES`) are deleted, other files kept;
    - ``resume``: nothing to do here (the trainer loads the newest checkpoint).

    Args:
        output_dir: the run folder.
        resume: continue the run in the folder.
        overwrite: replace the run in the folder.

    Returns:
        A one-line note, or None.
    """
    if resume and overwrite:
        raise InvalidArgumentError("--resume and --overwrite together; expected one of them (continue, or start over)")
    check_writable(output_dir)
    root = Path(output_dir)
    held = earlier_run(root)
    if held is None or resume:
        return None
    if overwrite:
        for name in RUN_FILES:
            path = root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        return f"--overwrite: deleted the earlier run in {root}"
    raise InvalidArgumentError(
        f"output_dir {str(root)!r} already holds {held}; continue it with --resume, replace it with "
        "--overwrite, or choose a new output_dir"
    )


def truncate_metrics(output_dir: str | os.PathLike, step: int) -> None:
    """Drop the rows of ``output_dir/metrics.jsonl`` logged after ``step`` (resuming at ``step``).

    Args:
        output_dir: the run folder.
        step: the checkpoint's step; rows with a larger step are removed.

    Returns:
        None.
    """
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class StopOnInterrupt:
    """Turn the first Ctrl-C (SIGINT) into a request to stop after the current step.

    The training loop asks :meth:`requested` between steps, saves a checkpoint and stops;
    a second Ctrl-C raises ``KeyboardInterrupt`` at once (no checkpoint). The handler is
    installed on creation (in the main thread only; elsewhere Ctrl-C keeps its default
    behaviour) and removed by :meth:`close` (or leaving a ``with`` block).

    Returns:
        The guard.

    Example:
        >>> with StopOnInterrupt() as interrupt:
        ...     interrupt.requested()
        False
    """

    def __init__(self) -> None:
        self.flag = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame) -> None:
        self.flag = True
        signal.signal(signal.SIGINT, self._previous)  # the second Ctrl-C stops at once
        print("\nCtrl-C: stopping after this step, with a checkpoint (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    def requested(self) -> bool:
        """Whether any process got Ctrl-C (a collective when several processes run).

        Returns:
            bool.
        """
        from torchforge.distributed import is_distributed, reduce_metric_sums

        if not is_distributed():
            return self.flag
        return float(reduce_metric_sums({"stop": torch.tensor(float(self.flag))})["stop"]) > 0

    def close(self) -> None:
        """Restore the previous SIGINT handler.

        Returns:
            None.
        """
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def __enter__(self) -> "StopOnInterrupt":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
