"""Scaling out with PyTorch's own distributed stack: process group, sharding, exact counts,
checkpoints and weight sync.

Everything here works in a plain single process (no process group: every collective is
the identity, ``world_size() == 1``) and under ``torchrun`` (``torch.distributed`` with
nccl on GPUs, gloo on CPU). Launch N processes with::

    torchrun --nproc_per_node N -m torchforge train ...

Exactness across ranks: a loss averaged by DDP / FSDP over ``dp_size`` ranks equals the
loss of the whole batch in one process when every rank aggregates with the counts of the
whole optimizer step (all micro-batches, all ranks): see :func:`global_counts` and
:class:`torchforge.reduce.Aggregation`.
"""

from torchforge.distributed.checkpoint import (
    export_pretrained,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from torchforge.distributed.collectives import (
    gather_over_ranks,
    global_counts,
    reduce_metric_extrema,
    reduce_metric_sums,
    sum_over_ranks,
    whiten_over_ranks,
)
from torchforge.distributed.parallelize import (
    SHARDING_STRATEGIES,
    STRATEGIES,
    DistributedConfig,
    is_sharded,
    shard,
    unwrap_model,
)
from torchforge.distributed.process_group import (
    barrier,
    end_process,
    init_distributed,
    is_distributed,
    is_main_process,
    launch,
    rank,
    teardown_distributed,
    world_size,
)
from torchforge.distributed.weight_sync import full_weights, generation_kwargs, sync_weights

__all__ = [
    "DistributedConfig",
    "init_distributed",
    "teardown_distributed",
    "end_process",
    "is_distributed",
    "world_size",
    "rank",
    "is_main_process",
    "barrier",
    "launch",
    "global_counts",
    "reduce_metric_sums",
    "reduce_metric_extrema",
    "sum_over_ranks",
    "gather_over_ranks",
    "whiten_over_ranks",
    "shard",
    "unwrap_model",
    "is_sharded",
    "generation_kwargs",
    "sync_weights",
    "full_weights",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "export_pretrained",
    "rng_state",
    "set_rng_state",
    "STRATEGIES",
    "SHARDING_STRATEGIES",
]
