"""Peer-shaped entry points over torchforge's primitives: swap verl's or TRL's calls with one import.

A layer above the primitives (like ``loop/`` and ``trainer/``), one module per peer, each
keeping that peer's names, parameter order and return shapes::

    from torchforge.compat import verl as core_algos   # verl 0.9.1's verl.trainer.ppo.core_algos
    from torchforge.compat import trl                  # TRL 1.16's GRPO loss, every loss_type

Nothing here imports verl or trl: the submodules import torch and torchforge only, and read
the peers' config objects by attribute. They are imported on first access (``compat.verl``
and ``compat.trl`` would otherwise load both peers' twins for a user who wants one); their
names are not re-exported at the top of ``torchforge`` because they are the peers' names
(``compat.trl.grpo_loss`` is TRL's loss, not :func:`torchforge.grpo_loss`).

tests/compat/ checks each twin against the peer's own function on the same inputs (the
``compat`` extra installs the pinned peers; ``.ci/run`` runs ``pytest -m compat tests/compat``
in their own environment).
"""

import importlib

SUBMODULES = ("verl", "trl")

__all__ = list(SUBMODULES)


def __getattr__(name):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
