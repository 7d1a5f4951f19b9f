"""The scalar metrics of a training step, each with how it combines, kept on the device.

A loss returns its metrics as a dict of scalar tensors of one micro-batch; how each one
combines over the micro-batches and processes of a step is its *reduction*:

- ``"mean"``: a mean over counted tokens (or another weight): the weighted mean of the parts;
- ``"sum"``: the parts add up (a count, or a term of the loss computed with the step's
  global counts, whose micro-batch and process shares add up to the whole). A term named
  ``*_loss`` is, like the loss, each process's share (``accumulate_gradients`` divides it
  by the number of processes); a ``Metric(value, "sum")`` is a count, added as it is;
- ``"max"`` / ``"min"``: an extreme (``ratio_max``): the extreme of the parts; a part with
  nothing counted never wins.

A plain tensor's reduction follows its name (:func:`metric_reduction`: ``*_max``,
``*_min``, ``*_loss``, else a mean); a :class:`Metric` states it. :class:`StepMetrics`
accumulates them where they were computed (no device sync per micro-batch) and
:meth:`StepMetrics.reduce` brings them to the CPU once, over every process in two
collectives (sums, extrema).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from torchforge.distributed import reduce_metric_extrema, reduce_metric_sums
from torchforge.errors import InvalidArgumentError, check_choice

__all__ = ["METRIC_REDUCTIONS", "Metric", "StepMetrics", "metric_reduction"]

METRIC_REDUCTIONS = ("mean", "sum", "max", "min")


def metric_reduction(name: str) -> str:
    """How a loss metric combines over micro-batches and ranks: "max", "min", "sum" or "mean".

    A metric named ``*_max`` (``ratio_max``) is a maximum and ``*_min`` a minimum: a mean
    of per-micro-batch maxima is not the maximum of the batch. A metric named ``*_loss``
    (PPO's ``pg_loss``, ``value_loss``) is a term of the loss, computed with the step's
    global counts as the loss is: each micro-batch's value is its share, so the shares add
    up (a token-weighted mean of them would depend on the micro-batch size). Every other
    metric is a mean over counted tokens, combined as a token-weighted mean.

    Args:
        name: the metric's name.

    Returns:
        "max", "min", "sum" or "mean".

    Example:
        >>> [metric_reduction(k) for k in ("ratio_max", "ratio_min", "value_loss", "clip_frac_low")]
        ['max', 'min', 'sum', 'mean']
    """
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    if name.endswith("_loss"):
        return "sum"
    return "mean"


@dataclass(frozen=True)
class Metric:
    """A scalar metric with its reduction, for a name that does not say it.

    Args:
        value: a scalar tensor (or number).
        reduction: one of ``METRIC_REDUCTIONS``.

    Returns:
        The metric; return it among a loss's metrics (``{"top_margin": Metric(m, "max")}``).

    Example:
        >>> import torch
        >>> Metric(torch.tensor(3.0), "max").reduction
        'max'
    """

    value: torch.Tensor | float
    reduction: str = "mean"

    def __post_init__(self) -> None:
        check_choice("Metric", "reduction", self.reduction, METRIC_REDUCTIONS)


class StepMetrics:
    """The scalar metrics of one step, accumulated on their device with their reductions.

    Args:
        None.

    Returns:
        An empty accumulator: :meth:`add` / :meth:`update` per micro-batch, then
        :meth:`local` (this process) or :meth:`reduce` (every process, as floats).

    Example:
        >>> import torch
        >>> metrics = StepMetrics()
        >>> metrics.update({"ratio_max": torch.tensor(1.5), "clip_frac": torch.tensor(0.5)}, weight=3)
        >>> metrics.update({"ratio_max": torch.tensor(1.2), "clip_frac": torch.tensor(0.1)}, weight=1)
        >>> {k: round(v, 4) for k, v in metrics.reduce().items()}   # (3 * 0.5 + 0.1) / 4
        {'ratio_max': 1.5, 'clip_frac': 0.4}
    """

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}   # mean: the weighted sum; sum: the sum; max / min: the extreme
        self._weights: dict[str, torch.Tensor] = {}  # mean: the sum of the weights
        self._reductions: dict[str, str] = {}

    def add(self, name: str, value: torch.Tensor | float | Metric, *, reduction: str | None = None,
            weight: torch.Tensor | float = 1.0) -> None:
        """Add one part's value of ``name``.

        Args:
            name: the metric.
            value: a scalar (tensor or number), or a :class:`Metric` carrying its reduction.
            reduction: one of ``METRIC_REDUCTIONS``; default: the Metric's, else
                :func:`metric_reduction` of the name.
            weight: the part's weight in a mean (its counted tokens); for an extreme, a part
                of weight 0 is left out.

        Returns:
            None.
        """
        if isinstance(value, Metric):
            reduction, value = reduction or value.reduction, value.value
        reduction = reduction or metric_reduction(name)
        check_choice("StepMetrics.add", "reduction", reduction, METRIC_REDUCTIONS)
        if self._reductions.setdefault(name, reduction) != reduction:
            raise InvalidArgumentError(f"StepMetrics.add: {name} was added as a {self._reductions[name]!r} metric; "
                                       f"expected the same reduction, got {reduction!r}")
        value = torch.as_tensor(value).detach().float().reshape(())
        weight = torch.as_tensor(weight, device=value.device).detach().float().reshape(())
        previous = self._values.get(name)
        if reduction == "mean":
            self._values[name] = weight * value if previous is None else previous + weight * value
            self._weights[name] = weight if name not in self._weights else self._weights[name] + weight
        elif reduction == "sum":
            self._values[name] = value if previous is None else previous + value
        else:  # a part with nothing counted has a fill value, not a token's: it never wins
            fill = -math.inf if reduction == "max" else math.inf
            value = torch.where(weight > 0, value, fill)
            self._values[name] = value if previous is None else (
                torch.maximum if reduction == "max" else torch.minimum)(previous, value)

    def update(self, metrics: Mapping[str, torch.Tensor | float | Metric], *, weight: torch.Tensor | float = 1.0) -> None:
        """:meth:`add` every metric of one part, each with the part's ``weight``.

        Args:
            metrics: name -> scalar or Metric (a loss's metrics).
            weight: the part's counted tokens.

        Returns:
            None.
        """
        for name, value in metrics.items():
            self.add(name, value, weight=weight)

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def __iter__(self):
        return iter(self._values)

    def local(self) -> dict[str, torch.Tensor]:
        """This process's values, on their device: means divided by their weight (0 when it
        is 0), sums, and extremes (``-inf`` / ``+inf`` when no part counted a token).

        Args:
            None.

        Returns:
            name -> scalar tensor.
        """
        return {name: value / self._weights[name].clamp(min=1) if self._reductions[name] == "mean" else value
                for name, value in self._values.items()}

    def reduce(self) -> dict[str, float]:
        """Every process's metrics combined (every process calls this with the same names in
        the same order): means and sums in one all-reduce, extremes in another; an extreme
        no process counted is 0, as the losses' metrics of an empty mask.

        Args:
            None.

        Returns:
            name -> float, in the order added.
        """
        sums, maxima, minima = {}, {}, {}
        for name, value in self._values.items():
            kind = self._reductions[name]
            if kind in ("mean", "sum"):
                sums[name] = value
                if kind == "mean":
                    sums[f"{name}\0weight"] = self._weights[name]  # no metric name holds a NUL
            else:
                (maxima if kind == "max" else minima)[name] = value
        total = reduce_metric_sums(_on_cpu(sums)) if sums else {}
        extrema = reduce_metric_extrema(*map(_on_cpu, (maxima, minima))) if maxima or minima else {}
        out = {}
        for name in self._values:
            kind = self._reductions[name]
            if kind == "mean":
                out[name] = float(total[name]) / max(float(total[f"{name}\0weight"]), 1.0)
            elif kind == "sum":
                out[name] = float(total[name])
            else:
                value = float(extrema[name])
                out[name] = value if math.isfinite(value) else 0.0
        return out


def _on_cpu(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The scalars of one device in one copy to the CPU (one sync, not one per metric)."""
    if not values:
        return {}
    device = next(iter(values.values())).device
    stacked = torch.stack([v.to(device, torch.float64) for v in values.values()]).cpu()
    return dict(zip(values, stacked.unbind(0)))
