"""Scaling out with PyTorch's own distributed stack: process group, exact global counts, sharding.

Everything here works in a plain single process (no process group: every collective is
the identity, ``world_size() == 1``) and under ``torchrun`` (``torch.distributed`` with
nccl on GPUs, gloo on CPU). Launch N processes with::

    torchrun --nproc_per_node N -m torchforge train ...

Exactness across ranks: a loss averaged by DDP / FSDP over ``dp_size`` ranks equals the
loss of the whole batch in one process when every rank aggregates with the counts of the
whole optimizer step (all micro-batches, all ranks): see :func:`global_counts` and
:class:`torchforge.reduce.Aggregation`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torchforge.errors import InvalidArgumentError, TorchforgeError, check_choice, check_mask, check_tensor

__all__ = [
    "DistributedConfig",
    "init_distributed",
    "teardown_distributed",
    "world_size",
    "rank",
    "is_main_process",
    "barrier",
    "global_counts",
    "reduce_metric_sums",
    "whiten_over_ranks",
    "shard",
    "unwrap_model",
    "generation_kwargs",
    "launch",
    "sync_weights",
    "STRATEGIES",
    "SHARDING_STRATEGIES",
]

STRATEGIES = ("fsdp", "ddp", "none")
SHARDING_STRATEGIES = ("full", "grad_op", "hybrid")
MIXED_PRECISIONS = (None, "no", "fp32", "bf16")


# --- process group -----------------------------------------------------------------------

def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is active."""
    return dist.is_available() and dist.is_initialized()


def init_distributed() -> bool:
    """Initialize the default process group from ``torchrun``'s environment.

    Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and ``MASTER_ADDR`` /
    ``MASTER_PORT``, set by ``torchrun``). Picks the nccl backend when CUDA is available
    (and binds this process to GPU ``LOCAL_RANK``), gloo otherwise. A no-op when
    ``WORLD_SIZE`` is absent or 1, and when a process group already exists.

    Args:
        None.

    Returns:
        True when a process group is active after the call (distributed run), False in a
        single process.

    Example:
        >>> init_distributed()  # plain python: no torchrun environment
        False
    """
    if is_distributed():
        return True
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return False
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise TorchforgeError(
                f"init_distributed: WORLD_SIZE={size} but {name} is not set; launch with "
                "torchrun (torchrun --nproc_per_node N ...), which sets RANK, LOCAL_RANK, "
                "WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            )
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group(backend="gloo")
    return True


def launch(nproc: int, args: Sequence[str], *, module: str | None = "torchforge") -> int:
    """Run ``nproc`` processes on this machine through torch's own launcher (torchrun).

    Runs ``python -m torch.distributed.run --standalone --nproc_per_node nproc -m module
    *args`` (or the script ``args[0]`` when ``module`` is None) and waits for it. This is
    what ``torchforge train --nproc N ...`` does; ``torchrun --nproc_per_node N -m
    torchforge train ...`` is equivalent, and the way to go multi-node (``--nnodes``,
    ``--rdzv-endpoint``).

    Args:
        nproc: number of processes (>= 1), typically the number of GPUs.
        args: command-line arguments of the module (or a script path and its arguments).
        module: module to run with ``-m``; None to run a script.

    Returns:
        The launcher's exit status (0 when every process succeeded).

    Example:
        >>> launch(2, ["train", "--config", "cfg.yaml"])  # doctest: +SKIP
        0
    """
    fn = "launch"
    if not (isinstance(nproc, int) and nproc >= 1):
        raise InvalidArgumentError(f"{fn}: nproc must be an int >= 1, got {nproc!r}")
    if "TORCHELASTIC_RUN_ID" in os.environ or is_distributed():
        raise TorchforgeError(
            f"{fn}: already inside a distributed run (WORLD_SIZE={os.environ.get('WORLD_SIZE')}); "
            "drop --nproc when launching with torchrun"
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += (["-m", module] if module else []) + list(args)
    return subprocess.call(cmd)


def teardown_distributed() -> None:
    """Destroy the default process group if one is active; a no-op otherwise.

    Args:
        None.

    Returns:
        None.

    Example:
        >>> teardown_distributed()  # no process group: nothing to do
    """
    if is_distributed():
        # Every rank reaches the barrier before any destroys its group: a gloo peer torn
        # down while the other still talks to it aborts the process at exit.
        dist.barrier()
        dist.destroy_process_group()


def world_size() -> int:
    """Number of processes in the default group (1 without a process group).

    Args:
        None.

    Returns:
        int >= 1.

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """Global rank of this process (0 without a process group).

    Args:
        None.

    Returns:
        int in [0, world_size()).

    Example:
        >>> rank()
        0
    """
    return dist.get_rank() if is_distributed() else 0


def is_main_process() -> bool:
    """Whether this process is rank 0 (always True in a single process).

    Args:
        None.

    Returns:
        bool.

    Example:
        >>> is_main_process()
        True
    """
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (a no-op without a process group).

    Args:
        None.

    Returns:
        None.

    Example:
        >>> barrier()
    """
    if is_distributed():
        dist.barrier()


def _collective_device(fallback: torch.device) -> torch.device:
    """The device a collective tensor must live on for the active backend."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback if fallback.type != "meta" else torch.device("cpu")


# --- exact counts and metrics ------------------------------------------------------------

def global_counts(masks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and sequence counts of one whole optimizer step, over micro-batches and ranks.

    ``num_tokens = sum_ranks sum_micro sum_bt mask_bt`` and
    ``num_sequences = sum_ranks sum_micro sum_b [sum_t mask_bt > 0]``, with one
    ``all_reduce`` (SUM) of a 2-element tensor. Pass them to
    ``Aggregation(mode, num_tokens=..., num_sequences=..., dp_size=world_size())`` for
    every micro-batch of the step: summing the micro-batch losses (gradient accumulation)
    and averaging over ranks (DDP / FSDP) then gives exactly the single-process loss.

    Args:
        masks: the [B, T] bool masks of every micro-batch of this optimizer step on this
            rank (B and T may differ between micro-batches). Every rank must call this the
            same number of times (it is a collective).

    Returns:
        ``(num_tokens, num_sequences)``: two int64 scalars, identical on every rank, on
        the device of the masks (the CUDA device under nccl).

    Example:
        >>> import torch
        >>> m1 = torch.tensor([[True, True, False], [False, False, False]])
        >>> m2 = torch.tensor([[True, False, False]])
        >>> global_counts([m1, m2])  # 3 tokens, 2 non-empty sequences
        (tensor(3), tensor(2))

    Note:
        A sequence with no counted token is not counted, as in ``aggregate``'s
        ``seq-*`` modes (a row dropped whole by a filter does not dilute the loss).
    """
    fn = "global_counts"
    if isinstance(masks, torch.Tensor):
        masks = [masks]
    if len(masks) == 0:
        raise InvalidArgumentError(
            f"{fn}: masks is empty; expected the [B, T] masks of the micro-batches of one step"
        )
    device = None
    counts = None
    for i, mask in enumerate(masks):
        check_tensor(fn, f"masks[{i}]", mask, ndim=2)
        check_mask(fn, mask, f"masks[{i}]", mask)
        if device is None:
            device = _collective_device(mask.device)
            counts = torch.zeros(2, dtype=torch.int64, device=device)
        counts[0] += mask.sum().to(device)
        counts[1] += mask.any(-1).sum().to(device)
    if is_distributed():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts[0], counts[1]


def reduce_metric_sums(sums: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
    """Sum scalar metrics over ranks in one collective (the identity in a single process).

    ``out[k] = sum_ranks sums[k]``. Reduce sums and counts, then divide: the mean of a
    metric over all ranks is ``out["reward_sum"] / out["reward_count"]``, not a mean of
    per-rank means (which is wrong when ranks hold different numbers of tokens).

    Args:
        sums: name -> scalar tensor (or Python number). Every rank must pass the same keys
            in the same order (the values are stacked into one tensor).

    Returns:
        dict with the same keys; float64 scalars on the CPU, detached, identical on every
        rank.

    Example:
        >>> import torch
        >>> reduce_metric_sums({"reward_sum": torch.tensor(3.0), "count": torch.tensor(2)})
        {'reward_sum': tensor(3., dtype=torch.float64), 'count': tensor(2., dtype=torch.float64)}
    """
    fn = "reduce_metric_sums"
    if not isinstance(sums, dict):
        raise InvalidArgumentError(f"{fn}: sums must be a dict of scalars, got {type(sums).__name__}")
    if not sums:
        return {}
    values = []
    for key, value in sums.items():
        value = torch.as_tensor(value).detach()
        if value.numel() != 1:
            raise InvalidArgumentError(
                f"{fn}: sums[{key!r}] has shape {tuple(value.shape)}; expected a scalar"
            )
        values.append(value.reshape(()).to("cpu", torch.float64))
    stacked = torch.stack(values)
    if is_distributed():
        device = _collective_device(torch.device("cpu"))
        on_device = stacked.to(device)
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
        stacked = on_device.cpu()
    return dict(zip(sums.keys(), stacked.unbind(0)))



def whiten_over_ranks(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """``masked_whiten`` with the mean and variance of the whole batch over all ranks.

    ``(values - mean) / sqrt(var + eps)`` at counted positions (0 elsewhere), where ``mean``
    and the unbiased ``var`` are those of every counted value on every rank, computed in
    two passes (sum, then squared deviations) with one all-reduce each in float64. Whitening
    each rank's shard on its own would give each rank different statistics, and the
    update would depend on the number of processes.

    Args:
        values: [B, T] float values of this rank (e.g. GAE advantages).
        mask: [B, T] bool, True = the value counts.
        eps: added to the variance before the square root, >= 0.

    Returns:
        float32 [B, T]; in a single process, ``masked_whiten(values, mask, eps=eps)``.

    Example:
        >>> import torch
        >>> whiten_over_ranks(torch.tensor([[1., 3., 9.]]), torch.tensor([[True, True, False]]), eps=0.0)
        tensor([[-0.7071,  0.7071,  0.0000]])
    """
    fn = "whiten_over_ranks"
    check_tensor(fn, "values", values)
    check_mask(fn, mask, "values", values)
    if not eps >= 0:
        raise InvalidArgumentError(f"{fn}: eps must be >= 0, got {eps!r}")
    x = torch.where(mask, values.double(), 0.0)
    first = reduce_metric_sums({"n": mask.sum(), "sum": x.sum()})
    n = first["n"]
    mean = first["sum"] / n.clamp(min=1)
    deviation = torch.where(mask, x - mean.to(x.device), 0.0)
    var = reduce_metric_sums({"sq": (deviation ** 2).sum()})["sq"] / (n - 1).clamp(min=1)
    var = var if n > 1 else torch.zeros((), dtype=torch.float64)
    scale = torch.rsqrt(var + eps) if var + eps > 0 else torch.zeros((), dtype=torch.float64)
    return (deviation * scale.to(x.device)).float()

# --- configuration -----------------------------------------------------------------------

@dataclass
class DistributedConfig:
    """How to spread training over processes (``torchrun`` launches them).

    Args:
        strategy: "fsdp" (FSDP2 ``fully_shard``; recommended for large models), "ddp"
            (``DistributedDataParallel``; every rank holds the full model) or "none".
        num_gpus: number of processes to launch (``torch.distributed.run --nproc_per_node``);
            None means "whatever the launcher started" (``WORLD_SIZE``, 1 without one).
        sharding_strategy: FSDP only: "full" (reshard parameters after forward, ZeRO-3),
            "grad_op" (keep them gathered between forward and backward, ZeRO-2) or
            "hybrid" (2-D mesh: replicate across nodes, shard within a node).
        mixed_precision: None / "fp32" (full precision) or "bf16" (bf16 parameters in
            compute, gradients reduced in float32).
        activation_checkpointing: recompute each block's activations in backward.

    Returns:
        A validated config; pass its fields to :func:`shard` with ``shard(model, **cfg.shard_kwargs())``.

    Example:
        >>> DistributedConfig(strategy="fsdp", num_gpus=8, sharding_strategy="full", mixed_precision="bf16").strategy
        'fsdp'
        >>> DistributedConfig(strategy="ddp", num_gpus=4).shard_kwargs()["strategy"]
        'ddp'
    """

    strategy: str = "fsdp"
    num_gpus: int | None = None
    sharding_strategy: str = "full"
    mixed_precision: str | None = None
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        fn = "DistributedConfig"
        check_choice(fn, "strategy", self.strategy, STRATEGIES)
        check_choice(fn, "sharding_strategy", self.sharding_strategy, SHARDING_STRATEGIES)
        check_choice(fn, "mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        if self.num_gpus is not None and not (isinstance(self.num_gpus, int) and self.num_gpus >= 1):
            raise InvalidArgumentError(f"{fn}: num_gpus must be None or an int >= 1, got {self.num_gpus!r}")

    def shard_kwargs(self) -> dict:
        """Keyword arguments of :func:`shard` for this config.

        Args:
            None.

        Returns:
            dict with strategy, sharding_strategy, mixed_precision, activation_checkpointing.

        Example:
            >>> sorted(DistributedConfig().shard_kwargs())
            ['activation_checkpointing', 'mixed_precision', 'sharding_strategy', 'strategy']
        """
        return {
            "strategy": self.strategy,
            "sharding_strategy": self.sharding_strategy,
            "mixed_precision": self.mixed_precision,
            "activation_checkpointing": self.activation_checkpointing,
        }


# --- sharding ----------------------------------------------------------------------------

def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 does not wrap, so it is returned as is).

    Args:
        model: a module, possibly ``DistributedDataParallel``-wrapped.

    Returns:
        The inner module.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(1, 1)
        >>> unwrap_model(m) is m
        True
    """
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def _block_classes(fn: str, model: nn.Module, block_types) -> tuple[type, ...]:
    present = {type(m) for m in model.modules()}
    if block_types is None:
        names = list(getattr(model, "_no_split_modules", None) or [])
        classes = tuple(sorted((c for c in present if c.__name__ in names), key=lambda c: c.__name__))
        source = f"model._no_split_modules={names!r}"
    else:
        items = [block_types] if isinstance(block_types, (str, type)) else list(block_types)
        names = [b if isinstance(b, str) else b.__name__ for b in items]
        classes = tuple(
            c for c in present if c.__name__ in names or any(c is b for b in items if isinstance(b, type))
        )
        source = f"block_types={names!r}"
    if not classes:
        raise InvalidArgumentError(
            f"{fn}: no module of {type(model).__name__} matched {source}; expected the "
            "transformer block class(es) (e.g. block_types=[LlamaDecoderLayer] or their names)"
        )
    return classes


def _blocks(model: nn.Module, classes: tuple[type, ...]) -> list[tuple[str, nn.Module]]:
    """Outermost modules of the block classes, in module order, with their names."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, classes) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


def _apply_activation_checkpointing(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    wrapped = []
    for name, block in blocks:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapper = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        setattr(parent, child, wrapper)
        wrapped.append(wrapper)
    return wrapped


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _fsdp_mesh(fn: str, mesh, sharding_strategy: str):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    size = world_size()
    want_dims = 2 if sharding_strategy == "hybrid" else 1
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != want_dims or mesh.size() != size:
            raise InvalidArgumentError(
                f"{fn}: mesh has shape {tuple(mesh.shape)} for world size {size} with "
                f"sharding_strategy={sharding_strategy!r}; expected {want_dims} dimension(s) "
                f"whose product is {size}"
            )
        return mesh
    if mesh is None:
        if want_dims == 1:
            shape = (size,)
        else:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
            per_node = per_node if per_node >= 1 and size % per_node == 0 else size
            shape = (size // per_node, per_node)
    else:
        shape = tuple(int(s) for s in mesh)
    product = 1
    for s in shape:
        product *= s
    if len(shape) != want_dims or product != size or min(shape) < 1:
        raise InvalidArgumentError(
            f"{fn}: mesh {shape} does not fit world size {size} with sharding_strategy="
            f"{sharding_strategy!r}; expected {want_dims} positive dimension(s) "
            + ("(replicate, shard) " if want_dims == 2 else "")
            + f"whose product is {size}"
        )
    names = ("replicate", "shard") if want_dims == 2 else ("shard",)
    if not is_distributed():
        return None
    return init_device_mesh(_device_type(), shape, mesh_dim_names=names)


def shard(
    model: nn.Module,
    *,
    strategy: str = "fsdp",
    mesh=None,
    mixed_precision: str | None = None,
    sharding_strategy: str = "full",
    activation_checkpointing: bool = False,
    block_types=None,
) -> nn.Module:
    """Wrap a model for data-parallel training: FSDP2 per block then the root, or DDP.

    FSDP2 (``torch.distributed.fsdp.fully_shard``): each transformer block becomes one
    communication group (its parameters are all-gathered just before its forward and
    reduce-scattered after its backward), then the root takes the remaining parameters
    (embeddings, final norm, LM head). Activation checkpointing wraps the blocks before
    sharding.

    Args:
        model: the model (a Hugging Face causal LM or any module with block classes), on
            its training device. Modified in place (FSDP2 converts its parameters to
            sharded DTensors; activation checkpointing replaces its blocks by wrappers).
        strategy: "fsdp", "ddp" or "none" (no data parallelism).
        mesh: FSDP only: a ``DeviceMesh`` or a shape tuple; default ``(world_size,)``,
            for "hybrid" ``(nodes, LOCAL_WORLD_SIZE)``. Its product must be the world size.
        mixed_precision: None / "fp32", or "bf16": ``MixedPrecisionPolicy(param_dtype=
            bfloat16, reduce_dtype=float32)`` (FSDP only; with DDP, use ``torch.autocast``).
        sharding_strategy: "full" (``reshard_after_forward=True``, ZeRO-3), "grad_op"
            (False, ZeRO-2), "hybrid" (2-D mesh: replicate over dim 0, shard over dim 1).
        activation_checkpointing: recompute each block's activations in backward
            (non-reentrant ``checkpoint_wrapper``; state-dict keys are unchanged).
        block_types: block classes or class names; default: the names in
            ``model._no_split_modules`` (Hugging Face), looked up in ``model.modules()``.

    Returns:
        The wrapped model: the same object for "fsdp" / "none", a
        ``DistributedDataParallel`` for "ddp". Without a process group (a plain single
        process) FSDP / DDP are skipped and the model is returned unsharded, with
        activation checkpointing applied when asked; arguments are validated either way.

    Example:
        >>> import torch
        >>> class Block(torch.nn.Linear): pass
        >>> model = torch.nn.Sequential(Block(4, 4), Block(4, 4))
        >>> shard(model, block_types=[Block]) is model   # one process: nothing to shard
        True

    References:
        ZeRO, https://arxiv.org/abs/1910.02054; PyTorch FSDP, https://arxiv.org/abs/2304.11277
    """
    fn = "shard"
    check_choice(fn, "strategy", strategy, STRATEGIES)
    check_choice(fn, "sharding_strategy", sharding_strategy, SHARDING_STRATEGIES)
    check_choice(fn, "mixed_precision", mixed_precision, MIXED_PRECISIONS)
    if strategy != "fsdp" and mesh is not None:
        raise InvalidArgumentError(f"{fn}: mesh is only used with strategy='fsdp', got strategy={strategy!r}")
    needs_blocks = strategy == "fsdp" or activation_checkpointing
    blocks = _blocks(model, _block_classes(fn, model, block_types)) if needs_blocks else []
    device_mesh = _fsdp_mesh(fn, mesh, sharding_strategy) if strategy == "fsdp" else None
    if strategy == "ddp" and mixed_precision == "bf16":
        warnings.warn(
            "shard: mixed_precision='bf16' is not applied by DDP; run the forward under "
            "torch.autocast(device_type, torch.bfloat16)",
            stacklevel=2,
        )

    shard_targets = [block for _, block in blocks]
    if activation_checkpointing:
        shard_targets = _apply_activation_checkpointing(model, blocks)
    if strategy == "none" or not is_distributed():
        return model

    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
        return DistributedDataParallel(model, device_ids=device_ids)

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    reshard = sharding_strategy != "grad_op"
    for block in shard_targets:
        fully_shard(block, mesh=device_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=device_mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model


# --- generation and weight sync ----------------------------------------------------------

def generation_kwargs() -> dict:
    """Extra keyword arguments for Hugging Face ``generate`` so that no rank deadlocks.

    Under FSDP every forward is a collective (parameters are all-gathered), so every rank
    must run the same number of forwards. ``synced_gpus=True`` makes ``generate`` keep
    stepping a rank whose sequences have all stopped until every rank has stopped.

    Args:
        None.

    Returns:
        ``{"synced_gpus": True}`` when ``world_size() > 1``, else ``{}``.

    Example:
        >>> generation_kwargs()  # a single process
        {}

    Note:
        Every rank must also pass the same ``max_new_tokens``. Harmless with DDP (a
        forward there is not a collective; ranks just wait for the slowest one).
    """
    return {"synced_gpus": True} if world_size() > 1 else {}


_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def _clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    model = unwrap_model(model)
    named = {_clean_name(n): p for n, p in model.named_parameters()}
    named.update({_clean_name(n): b for n, b in model.named_buffers() if b is not None})
    return named


@torch.no_grad()
def sync_weights(src_model: nn.Module, dst_model: nn.Module) -> None:
    """Copy the weights of a trained model (plain, DDP or FSDP2-sharded) into a full copy.

    For each parameter and buffer, by name: a sharded ``DTensor`` is gathered with
    ``full_tensor()`` (a collective: every rank must call this) and copied into the
    same-named tensor of ``dst_model`` (cast to its dtype and device), one tensor at a
    time, so the extra memory is one full tensor.

    Args:
        src_model: the model being trained.
        dst_model: a separate, unsharded model of the same architecture on this rank
            (e.g. a generation copy, possibly in another dtype or on another device).

    Returns:
        None; ``dst_model`` is updated in place.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> sync_weights(a, b)
        >>> torch.equal(a.weight, b.weight)
        True
    """
    from torch.distributed.tensor import DTensor

    fn = "sync_weights"
    src = _named_tensors(src_model)
    dst = _named_tensors(dst_model)
    missing, unexpected = sorted(set(src) - set(dst)), sorted(set(dst) - set(src))
    if missing or unexpected:
        raise InvalidArgumentError(
            f"{fn}: src_model and dst_model have different tensors: only in src_model "
            f"{missing[:5]}, only in dst_model {unexpected[:5]}; expected the same architecture"
        )
    for name, tensor in src.items():  # same order on every rank: full_tensor is a collective
        target = dst[name]
        if isinstance(target, DTensor):
            raise InvalidArgumentError(
                f"{fn}: dst_model tensor {name!r} is sharded (a DTensor); expected an unsharded copy"
            )
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if full.shape != target.shape:
            raise InvalidArgumentError(
                f"{fn}: {name!r} has shape {tuple(full.shape)} in src_model but "
                f"{tuple(target.shape)} in dst_model; expected equal shapes"
            )
        target.copy_(full)
