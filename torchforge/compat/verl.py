"""verl 0.9.1's ``verl.trainer.ppo.core_algos`` on torchforge's primitives."""
