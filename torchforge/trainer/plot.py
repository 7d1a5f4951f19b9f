"""``torchforge plot RUN_DIR``: the reward, KL, entropy and length curves of a run, as a PNG."""

from __future__ import annotations

import math
import os
from pathlib import Path

from torchforge.trainer.tracking import read_metrics

__all__ = ["plot_run"]

PANELS = (
    ("reward", "reward (mean)"),
    ("kl", "KL(pi || ref)"),
    ("entropy", "entropy (nats / token)"),
    ("completions/mean_length", "completion length (tokens)"),
    ("rollout/log_prob_gap", "sampler vs trainer: mean |log p gap|"),
    ("eval/reward", "eval reward (mean)"),
    ("eval/pass@1", "eval pass@1"),
)


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Draw a run's curves (2 rows of panels) from its ``metrics.jsonl``.

    Args:
        run_dir: the run folder (the trainer's ``output_dir``).
        out: the PNG path; default ``run_dir/curves.png``.

    Returns:
        The path of the PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = Path(out) if out is not None else Path(run_dir) / "curves.png"
    ncols = -(-len(PANELS) // 2)
    fig, axes = plt.subplots(2, ncols, figsize=(3.5 * ncols, 7), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, PANELS):
        points = [(r["step"], r[key]) for r in rows if key in r and not math.isnan(r[key])]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, lw=1.2)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(PANELS):]:  # an odd number of panels leaves one cell of the grid empty
        ax.remove()
    fig.suptitle(str(Path(run_dir).resolve().name))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
