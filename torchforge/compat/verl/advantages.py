"""verl 0.9.1's advantage estimators (``compute_*_outcome_advantage``, GAE, ...), ``compute_rewards``
and ``kl_penalty``, on torchforge's primitives."""

__all__: list[str] = []
