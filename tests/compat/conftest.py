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


# Cases where a compat twin is known to differ from verl, recorded (strict: the test fails
# once the twin is fixed, so the entry must go) until the twin matches.
KNOWN_DIFFERENCES = {
    "test_outcome_estimators_equal_verl[compute_grpo_vectorized_outcome_advantage-{}-str-ties]":
        "verl's vectorized GRPO divides a tie's float32 rounding residue by epsilon (up to 1.5e-3); the twin gives 0",
    "test_outcome_estimators_equal_verl[compute_grpo_vectorized_outcome_advantage-{}-int-ties]":
        "as the str-ties case",
    "test_gae_equals_verl[0.5-0.0-offset]":
        "whitening advantages offset by 1e4 in float32 loses 2.6e-5 relative against verl's float64",
    "test_outcome_estimators_on_an_all_zero_mask[compute_opo_outcome_advantage-{}]":
        "the OPO twin gives NaN on an all-zero response mask where verl gives 0",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = KNOWN_DIFFERENCES.get(item.name)
        if reason is not None and item.path.name == "test_verl_advantages.py":
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
