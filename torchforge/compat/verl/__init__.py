"""verl 0.9.1's ``verl.trainer.ppo.core_algos`` on torchforge's primitives.

A verl user swaps ``core_algos`` with one import, keeping verl's names, parameter order and
return shapes::

    from torchforge.compat import verl as core_algos

The advantage estimators (with ``compute_rewards`` and ``kl_penalty``) live in
:mod:`.advantages`, the policy, value and entropy losses (with ``agg_loss``) in
:mod:`.losses`, verl's ``rollout_corr_helper`` (IS weights, rejection masks and their
metrics, which ``bypass_mode`` computes) in :mod:`.rollout_correction`; all are re-exported
here. Nothing here imports verl: a verl ``config``
(OmegaConf, verl's ``AlgoConfig`` / ``ActorConfig``) is read by attribute or key.
"""

from .advantages import *  # noqa: F401,F403
from .advantages import __all__ as _advantages_all
from .losses import *  # noqa: F401,F403
from .losses import __all__ as _losses_all
from .rollout_correction import *  # noqa: F401,F403
from .rollout_correction import __all__ as _rollout_correction_all

__all__ = [*_advantages_all, *_losses_all, *_rollout_correction_all]
