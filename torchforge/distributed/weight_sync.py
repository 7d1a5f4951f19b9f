"""Generation under sharding, and copying trained weights into a generation copy.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from torchforge.distributed.parallelize import is_sharded, unwrap_model
from torchforge.distributed.process_group import world_size
from torchforge.errors import InvalidArgumentError

# --- generation and weight sync ----------------------------------------------------------

def generation_kwargs(model: nn.Module | None = None) -> dict:
    """Extra keyword arguments for Hugging Face ``generate`` so that no rank deadlocks.

    Under FSDP every forward is a collective (parameters are all-gathered), so every rank
    must run the same number of forwards. ``synced_gpus=True`` makes ``generate`` keep
    stepping a rank whose sequences have all stopped until every rank has stopped.

    Args:
        model: the model that generates; when given, ranks sync only if its parameters are
            sharded (a generation copy with whole weights samples on its own, no collective).

    Returns:
        ``{"synced_gpus": True}`` when ``world_size() > 1`` (and ``model``, if given, is
        sharded), else ``{}``.

    Example:
        >>> generation_kwargs()  # a single process
        {}

    Note:
        Every rank must also pass the same ``max_new_tokens``. Harmless with DDP (a
        forward there is not a collective; ranks just wait for the slowest one).
    """
    if world_size() == 1:
        return {}
    if model is not None and not is_sharded(model):
        return {}
    return {"synced_gpus": True}


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


def full_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters of a trained model (plain, DDP or FSDP2) as full tensors, one at a time.

    Yields ``(name, tensor)`` by Hugging Face parameter name (wrapper prefixes such as
    ``_fsdp_wrapped_module`` or ``_orig_mod`` removed); a sharded ``DTensor`` is gathered
    with ``full_tensor()`` as it is reached, so the extra memory is one full tensor. Every
    rank must consume the whole iterator, in the same order (each gather is a collective).
    This is what a generation engine's ``update_weights`` takes.

    Args:
        model: the model being trained.

    Returns:
        An iterator of ``(name, tensor)`` pairs, detached (no grad).

    Example:
        >>> import torch
        >>> [name for name, _ in full_weights(torch.nn.Linear(2, 2))]
        ['weight', 'bias']
    """
    from torch.distributed.tensor import DTensor

    for name, tensor in unwrap_model(model).named_parameters():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield _clean_name(name), full.detach()
