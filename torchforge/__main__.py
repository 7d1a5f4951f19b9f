"""``python -m torchforge ...`` and ``torchrun -m torchforge ...``: the ``torchforge`` command."""

import sys

from torchforge.trainer.cli import main

sys.exit(main())
