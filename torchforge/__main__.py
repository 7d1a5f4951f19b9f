"""``python -m torchforge ...`` and ``torchrun -m torchforge ...``: the ``torchforge`` command."""

from torchforge.trainer.cli import run

run()
