"""Property-testing kit: hypothesis strategies and one-call property checks.

For anyone writing a new KL estimator, advantage estimator, policy loss or loss
aggregation: the strategies draw realistic inputs in the torchforge key vocabulary, and
each ``check_*`` runs a hypothesis search over them and raises ``AssertionError`` with a
counterexample (the offending tensors are in the message) when a property fails.

Strategies:

- :func:`masks`: [B, T] bool masks with right padding, empty rows, mid-sequence gaps
  (tool / observation tokens) and, sometimes, a whole batch with nothing counted.
- :func:`batches`: ``TensorDict`` batches with the DESIGN.md keys (tokens, mask,
  log_probs, old_log_probs, ref_log_probs, rollout_log_probs, rewards, advantages, values,
  old_values, returns), the log-probs coming from related policies.
- :func:`group_rewards`: [B] rewards in contiguous groups of G, with ties, all-equal
  groups and NaN ("not applicable") entries.
- :func:`policy_pairs`: logits of two related policies, tokens sampled from the first,
  and both policies' log-probs of those tokens.

Checks:

- :func:`check_kl_estimator`: zero for equal policies, finite, optionally non-negative,
  unbiased for KL(pi || ref) (Monte Carlo on a small categorical distribution).
- :func:`check_advantage_estimator`: shape, finite on degenerate groups, zero for
  all-equal groups, zero mean per group, invariance to shifting rewards.
- :func:`check_policy_loss`: on-policy gradient ``-A grad log pi`` aggregated as
  claimed, masked == sliced, zero loss and gradient on an empty mask, no NaN leak.
- :func:`check_aggregation_exact`: micro-batches summed and ranks averaged with global
  counts equal the one-process loss and gradient.
- :func:`check_engine`: a generation engine's conformance (token ids round-trip, log-probs
  of the processed distribution, per-request seeds, stop ids, weights pushed are used).

Every check is deterministic (hypothesis ``derandomize=True``, no example database), so a
failure reproduces on every run; ``max_examples`` trades time for thoroughness. Call the
checks from a plain test function, not from inside another ``@given`` test.

Note:
    hypothesis is a development dependency (``pip install torchforge[dev]``), needed only
    to *call* the functions here; importing this module does not need it, so that
    ``torchforge`` itself never does.

Example:
    >>> import math
    >>> from torchforge.kl import approx_kl
    >>> # Schulman's k3 (unbounded) is unbiased; the default k3 bounds its gradient and is not.
    >>> check_kl_estimator(lambda lp, ref: approx_kl(lp, ref, estimator="k3", max_ratio=math.inf),
    ...                    nonnegative=True, max_examples=5)
"""

from torchforge.testing.checks import (
    check_advantage_estimator,
    check_aggregation_exact,
    check_kl_estimator,
    check_policy_loss,
)
from torchforge.testing.engines import check_engine, reference_log_probs
from torchforge.testing.strategies import batches, group_rewards, masks, policy_pairs

__all__ = [
    "masks",
    "batches",
    "group_rewards",
    "policy_pairs",
    "check_kl_estimator",
    "check_advantage_estimator",
    "check_policy_loss",
    "check_aggregation_exact",
    "check_engine",
    "reference_log_probs",
]
