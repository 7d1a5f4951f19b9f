"""verl 0.9.1's policy losses (``compute_policy_loss_*``), value and entropy losses and
``agg_loss``, on torchforge's primitives."""

__all__: list[str] = []
