"""The policy losses ``RLConfig.policy_loss`` names, in one registry.

An entry says which torchforge loss a name calls, which ``RLConfig`` fields become which
of its keyword arguments, and what is fixed ("gspo" is ``ppo_loss`` with
``ratio_level="sequence"``). Everything that needs to know the policy losses asks it:

- ``Algorithm.policy_gradient_loss`` calls the configured entry;
- ``RLConfig`` checks a run's loss settings by asking each entry's loss (:meth:`PolicyLoss.check`):
  the bounds live once, in the loss functions;
- ``RLConfig`` refuses per-token weights (``rollout_correction``, ``top_entropy_quantile``)
  for a loss without ``weights=`` (:attr:`PolicyLoss.takes_weights`);
- the ``torchforge train`` help and the README's table of policy losses
  (:func:`policy_loss_table`, checked by the tests) are written from it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchforge.covariance_losses import clip_cov_loss, kl_cov_loss
from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.losses import ppo_loss, reinforce_loss
from torchforge.reduce import Aggregation
from torchforge.trust_region_losses import cispo_loss, gmpo_loss, sapo_loss

__all__ = ["POLICY_LOSS_REGISTRY", "PolicyLoss", "policy_loss_table"]


@dataclass(frozen=True)
class PolicyLoss:
    """One policy loss of the trainer: the function, and where its hyperparameters come from.

    Args:
        name: the ``RLConfig.policy_loss`` value.
        loss: a torchforge loss ``(log_probs, [old_log_probs,] advantages, mask, [weights,] *,
            ..., aggregation) -> (loss, metrics)``.
        settings: the loss's keyword argument -> the ``RLConfig`` field that sets it.
        fixed: keyword arguments this name always passes.
        summary: one line for the docs.

    Returns:
        The entry; call it as ``entry(config, log_probs, old_log_probs, advantages, mask,
        weights=..., aggregation=...)``.

    Example:
        >>> from torchforge.trainer.config import RLConfig
        >>> entry = POLICY_LOSS_REGISTRY["gspo"]
        >>> entry.loss.__name__, entry.kwargs(RLConfig(clip_low=0.1))["ratio_level"]
        ('ppo_loss', 'sequence')
    """

    name: str
    loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    settings: Mapping[str, str] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    summary: str = ""

    @property
    def takes_old_log_probs(self) -> bool:
        """Whether the loss weighs by a ratio to the sampling policy (every one but REINFORCE's)."""
        return "old_log_probs" in inspect.signature(self.loss).parameters

    @property
    def takes_weights(self) -> bool:
        """Whether the loss takes per-token ``weights=`` (rollout corrections, the entropy mask)."""
        return "weights" in inspect.signature(self.loss).parameters

    def kwargs(self, config: Any) -> dict[str, Any]:
        """The loss's keyword arguments from ``config``'s fields, with the fixed ones.

        Args:
            config: an ``RLConfig``.

        Returns:
            keyword -> value.
        """
        return {**{kw: getattr(config, name) for kw, name in self.settings.items()}, **self.fixed}

    def __call__(self, config: Any, log_probs: torch.Tensor, old_log_probs: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor, *, weights: torch.Tensor | None = None,
                 aggregation: str | Aggregation = "token-mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        args = (log_probs, old_log_probs, advantages, mask) if self.takes_old_log_probs else (log_probs, advantages, mask)
        if weights is not None and not self.takes_weights:
            raise TorchforgeError(f"policy loss {self.name!r} ({self.loss.__name__}) takes no per-token weights; "
                                  f"expected weights=None, or one of {[n for n, e in POLICY_LOSS_REGISTRY.items() if e.takes_weights]}")
        extra = {"weights": weights} if self.takes_weights else {}
        return self.loss(*args, **extra, **self.kwargs(config), aggregation=aggregation)

    def call(self) -> str:
        """The loss call this name makes, with its fixed arguments (``ppo_loss(ratio_level="sequence")``).

        Args:
            None.

        Returns:
            str.
        """
        fixed = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in self.fixed.items())
        return f"{self.loss.__name__}({fixed})"

    def check(self, config: Any) -> None:
        """Raise unless the loss accepts ``config``'s settings: the loss is asked, on an empty
        batch (no token, no random draw), so its own bounds are the only ones.

        Args:
            config: an ``RLConfig``.

        Returns:
            None; an ``InvalidArgumentError`` naming the ``RLConfig`` field otherwise.
        """
        empty, none = torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.bool)
        try:
            self(config, empty, empty, torch.zeros(0), none)
        except (InvalidArgumentError, TypeError) as error:
            # a loss's message starts "<fn>: <argument> ...": name the field that set the argument
            words = re.match(r"\w+: (\w+)", str(error))
            kw = words.group(1) if words else None
            if kw not in self.settings:
                names = ", ".join(f"{n}={getattr(config, n)!r}" for n in self.settings.values())
                raise InvalidArgumentError(f"RLConfig: {names} are refused by {self.loss.__name__}: {error}") from None
            name = self.settings[kw]
            raise InvalidArgumentError(
                f"RLConfig: {name}={getattr(config, name)!r} (the {kw} of policy_loss={self.name!r}); {error}"
            ) from None


_CLIP = {"clip_low": "clip_low", "clip_high": "clip_high"}

#: ``RLConfig.policy_loss`` -> its entry, in the order the docs list them
POLICY_LOSS_REGISTRY: dict[str, PolicyLoss] = {entry.name: entry for entry in (
    PolicyLoss("ppo", ppo_loss, {**_CLIP, "dual_clip": "dual_clip"}, {"ratio_level": "token"},
               "the clipped surrogate (PPO, GRPO, DAPO's clip-higher)"),
    PolicyLoss("gspo", ppo_loss, {**_CLIP, "dual_clip": "dual_clip"}, {"ratio_level": "sequence"},
               "the clipped surrogate of sequence ratios (GSPO)"),
    PolicyLoss("cispo", cispo_loss, _CLIP, summary="REINFORCE weighted by the clipped, detached ratio (CISPO)"),
    PolicyLoss("sapo", sapo_loss, {"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"},
               summary="a smooth sigmoid gate of the ratio in place of the clip (SAPO)"),
    PolicyLoss("gmpo", gmpo_loss, _CLIP, summary="the geometric mean of the token ratios, clipped in log space (GMPO)"),
    PolicyLoss("clip_cov", clip_cov_loss, {**_CLIP, "select_frac": "cov_select_frac", "cov_low": "cov_low",
                                           "cov_high": "cov_high"},
               summary="the clipped surrogate, a few high-covariance tokens detached (Clip-Cov)"),
    PolicyLoss("kl_cov", kl_cov_loss, {"select_frac": "cov_select_frac", "kl_coef": "kl_cov_coef"},
               summary="the unclipped surrogate, a KL penalty on the highest-covariance tokens (KL-Cov)"),
    PolicyLoss("reinforce", reinforce_loss, summary="-A log pi, no ratio (REINFORCE)"),
)}


def policy_loss_table() -> str:
    """The README's table of policy losses, written from :data:`POLICY_LOSS_REGISTRY`.

    Args:
        None.

    Returns:
        A Markdown table: name, the loss call, the ``RLConfig`` fields it takes, whether it
        takes per-token weights, what it is.

    Example:
        >>> policy_loss_table().splitlines()[2].startswith("| `ppo` | `ppo_loss(ratio_level=\\"token\\")`")
        True
    """
    lines = ["| `policy_loss` | calls | `RLConfig` settings | per-token weights | what it is |",
             "| --- | --- | --- | --- | --- |"]
    for entry in POLICY_LOSS_REGISTRY.values():
        settings = ", ".join(f"`{name}`" for name in dict.fromkeys(entry.settings.values())) or "—"
        lines.append(f"| `{entry.name}` | `{entry.call()}` | {settings} | "
                     f"{'yes' if entry.takes_weights else 'no'} | {entry.summary} |")
    return "\n".join(lines)
