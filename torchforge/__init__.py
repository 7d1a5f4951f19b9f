"""torchforge: PyTorch-native reinforcement-learning primitives for post-training language models."""

from torchforge.batch import Batch, batch_args, is_batch
from torchforge.errors import DTypeError, InvalidArgumentError, MissingKeyError, ShapeError, TorchforgeError
from torchforge.kl import KL_ESTIMATORS, approx_kl
from torchforge.reduce import AGGREGATION_MODES, Aggregation, aggregate, masked_mean, masked_sum, masked_var, masked_whiten

__version__ = "0.1.0"

__all__ = [
    # batch
    "Batch",
    "batch_args",
    "is_batch",
    # errors
    "TorchforgeError",
    "ShapeError",
    "DTypeError",
    "InvalidArgumentError",
    "MissingKeyError",
    # reduce
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "aggregate",
    "Aggregation",
    "AGGREGATION_MODES",
    # kl
    "approx_kl",
    "KL_ESTIMATORS",
]
