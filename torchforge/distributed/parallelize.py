"""Sharding a model over processes: FSDP2 ``fully_shard`` per block then the root, or DDP.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from torchforge.errors import InvalidArgumentError, check_choice

STRATEGIES = ("fsdp", "ddp", "none")
SHARDING_STRATEGIES = ("full", "grad_op", "hybrid")
MIXED_PRECISIONS = (None, "no", "fp32", "bf16")
from torchforge.distributed.process_group import is_distributed, world_size

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


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds FSDP2-sharded parameters (DTensors): its forward is then a
    collective, and its full weights must be gathered.

    Args:
        module: any module.

    Returns:
        bool.

    Example:
        >>> import torch
        >>> is_sharded(torch.nn.Linear(1, 1))
        False
    """
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


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
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

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
    reduce-scattered after its backward), then a vision-language model's vision tower and
    projector each become one, then the root takes the remaining parameters (embeddings,
    final norm, LM head). Activation checkpointing wraps the blocks before sharding.

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
    vision = _vision_modules(model)
    for module in vision:
        fully_shard(module, mesh=device_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=device_mesh, mp_policy=policy, reshard_after_forward=reshard)
    if vision:  # the vision tower runs first in generate: the root must already be the root
        model._get_fsdp_state()._lazy_init()
    return model


def _vision_modules(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision tower and projector (the outermost modules named
    ``visual``, ``vision_tower``, ``multi_modal_projector``, ...): Hugging Face's ``generate``
    runs them through ``get_image_features`` before the first forward, outside the root's
    hooks, so each is its own FSDP unit that gathers its parameters itself. [] for a text model."""
    from torchforge.loop.vision import is_vision_tower_name

    found: list[str] = []
    modules = []
    for name, module in model.named_modules():  # parents before their children
        if name and is_vision_tower_name(name.rsplit(".", 1)[-1]) and not any(name.startswith(f"{f}.") for f in found):
            found.append(name)
            modules.append(module)
    return modules
