"""The peers of the equality tests, or a skip that names the extra that installs them."""

import pytest

EXTRA = "pip install -e '.[compat]'"


def require_peer(module: str):
    """``module`` imported (e.g. ``"verl.trainer.ppo.core_algos"``), or the test skips with a
    reason naming the ``compat`` extra. verl and trl are installed with ``--no-deps`` in CI
    (their GPU-only dependencies do not install on a CPU), so a peer that is present but fails
    to import for a missing dependency skips with that error too."""
    return pytest.importorskip(module, reason=f"needs {module.split('.')[0]} ({EXTRA}; .ci/run installs it)",
                               exc_type=ImportError)

