"""Sharded checkpoints with torch.distributed.checkpoint, and export to a Hugging Face folder.

A checkpoint is a folder::

    path/
      dcp/            model and optimizer, torch.distributed.checkpoint format (sharded:
                      every rank writes its own shards; loadable by any number of ranks)
      rank_0.pt ...   one small torch.save file per rank: ``extra``, the scheduler state
                      and this rank's RNG states (torch CPU / CUDA, ``random``, numpy)

The same functions work in a plain single process (no process group), for DDP models
and for FSDP2-sharded models; a checkpoint written by N processes resumes with M.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from torchforge.distributed.parallelize import unwrap_model
from torchforge.distributed.process_group import (
    barrier,
    is_distributed,
    is_main_process,
    rank,
    world_size,
)
from torchforge.errors import TorchforgeError

__all__ = ["save_checkpoint", "load_checkpoint", "export_pretrained", "rng_state", "set_rng_state"]

_DCP_DIR = "dcp"


@contextlib.contextmanager
def _single_process_quiet():
    """Silence DCP's "assuming the intent is to save in a single process": it is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank_file(path: Path, r: int) -> Path:
    return path / f"rank_{r}.pt"


def rng_state() -> dict[str, Any]:
    """The RNG states of this process: torch CPU, every CUDA device, ``random``, numpy.

    Args:
        None.

    Returns:
        dict, picklable; pass it to :func:`set_rng_state`.

    Example:
        >>> import torch
        >>> state = rng_state(); a = torch.rand(1); set_rng_state(state)
        >>> bool(torch.rand(1) == a)
        True
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states saved by :func:`rng_state` (missing entries are left alone).

    Args:
        state: dict from :func:`rng_state`.

    Returns:
        None.

    Example:
        >>> set_rng_state(rng_state())
    """
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(state["numpy"])
        except ImportError:
            pass


def _reseed_for_rank(r: int) -> None:
    """Derive distinct streams for a rank that had no saved state (more ranks than saved)."""
    seed = int(torch.randint(0, 2**62, (1,)).item()) + r
    torch.manual_seed(seed)  # also seeds every CUDA device
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def _state_dicts(model: nn.Module, optimizer, options: StateDictOptions | None = None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optimizer": optim_sd}


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save model, optimizer, scheduler, ``extra`` and RNG states to the folder ``path``.

    Model and optimizer go through ``torch.distributed.checkpoint`` (``get_state_dict``
    then ``dcp.save``): each rank writes its own shards of an FSDP2 model, so no rank
    ever holds the full state. ``extra``, the scheduler state and this rank's RNG states
    go to ``path/rank_<r>.pt``. Every rank must call this (it is a collective).

    Args:
        path: checkpoint folder (created; an existing checkpoint there is overwritten).
        model: the model being trained: plain, DDP-wrapped or FSDP2-sharded.
        optimizer: its optimizer, or None.
        scheduler: an object with ``state_dict()`` / ``load_state_dict()`` (an LR
            scheduler), or None.
        extra: small picklable dict (step, data position, ...), may differ per rank.

    Returns:
        None.

    Example:
        >>> import tempfile, torch
        >>> model = torch.nn.Linear(2, 2)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_checkpoint(d, model=model, extra={"step": 3})
        ...     load_checkpoint(d, model=model)
        {'step': 3}
    """
    path = Path(path)
    if is_main_process():
        path.mkdir(parents=True, exist_ok=True)
    barrier()
    state = _state_dicts(model, optimizer)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(path / _DCP_DIR), no_dist=not is_distributed())
    torch.save(
        {
            "extra": extra if extra is not None else {},
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
            "world_size": world_size(),
            "has_optimizer": optimizer is not None,
        },
        _rank_file(path, rank()),
    )
    barrier()


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and the rest), in place.

    Model and optimizer are read with ``dcp.load`` into this process's own layout, then
    applied with ``set_state_dict``: a checkpoint saved by N ranks (sharded or not) loads
    into M ranks, plain, DDP or FSDP2.

    Args:
        path: checkpoint folder.
        model: model with the architecture that was saved (plain, DDP or FSDP2).
        optimizer: optimizer over ``model``'s parameters, or None (then the saved
            optimizer state is ignored).
        scheduler: scheduler to restore, or None.
        restore_rng: restore this rank's RNG states.

    Returns:
        ``extra`` as saved by this rank (by rank 0 if this rank did not exist when saving).

    Note:
        Resuming with a different number of processes: rank r restores the RNG states
        and ``extra`` saved by rank r when that file exists (so resuming with fewer ranks
        continues their streams); a rank that did not exist at save time takes rank 0's
        ``extra`` and re-seeds its generators from rank 0's states plus its rank, so that
        ranks do not draw identical samples. Bitwise equality with an uninterrupted run
        is only possible with the same number of processes (the data split differs).

    Example:
        >>> import tempfile, torch
        >>> model = torch.nn.Linear(2, 2)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_checkpoint(d, model=model, optimizer=optimizer, extra={"step": 10})
        ...     load_checkpoint(d, model=torch.nn.Linear(2, 2), restore_rng=False)["step"]
        10

    References:
        torch.distributed.checkpoint, https://pytorch.org/docs/stable/distributed.checkpoint.html
    """
    path = Path(path)
    if not (path / _DCP_DIR / ".metadata").exists():
        raise TorchforgeError(
            f"load_checkpoint: path={str(path)!r} holds no checkpoint ({path / _DCP_DIR / '.metadata'} "
            "not found); expected a folder written by save_checkpoint"
        )
    own = _rank_file(path, rank())
    saved = torch.load(own if own.exists() else _rank_file(path, 0), weights_only=False)
    if optimizer is not None and not saved.get("has_optimizer", True):
        raise TorchforgeError(
            f"load_checkpoint: path={str(path)!r} was saved without an optimizer; pass optimizer=None"
        )
    state = _state_dicts(model, optimizer)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path / _DCP_DIR), no_dist=not is_distributed())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    if scheduler is not None:
        if saved["scheduler"] is None:
            raise TorchforgeError(f"load_checkpoint: path={str(path)!r} was saved without a scheduler")
        scheduler.load_state_dict(saved["scheduler"])
    if saved["world_size"] != world_size() and is_main_process():
        warnings.warn(
            f"load_checkpoint: checkpoint saved by {saved['world_size']} processes, resumed with "
            f"{world_size()}; model and optimizer are resharded exactly, RNG streams are not "
            "those of an uninterrupted run",
            stacklevel=2,
        )
    if restore_rng:
        set_rng_state(saved["rng"])
        if not own.exists():
            _reseed_for_rank(rank())
    barrier()
    return saved["extra"]


def export_pretrained(model: nn.Module, tokenizer: Any, path: str | os.PathLike) -> None:
    """Write the full (unsharded) model as a Hugging Face folder (safetensors) from rank 0.

    The full state dict is gathered with ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)`` (a collective: every rank must call this; only rank 0 ends up
    holding it, on the CPU), then rank 0 calls ``save_pretrained`` with it, and the
    tokenizer's ``save_pretrained`` when ``tokenizer`` is not None. All ranks wait at a
    barrier at the end, so the folder is complete when any rank returns.

    Args:
        model: a Hugging Face ``PreTrainedModel``: plain, DDP-wrapped or FSDP2-sharded.
        tokenizer: a tokenizer with ``save_pretrained``, or None.
        path: output folder.

    Returns:
        None.

    Note:
        transformers 5 always writes safetensors (its ``safe_serialization`` argument is
        gone), so none is passed.

    Example:
        >>> export_pretrained(model, tokenizer, "out/final")  # doctest: +SKIP
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if is_main_process():
        inner = unwrap_model(model)
        if not hasattr(inner, "save_pretrained"):
            raise TorchforgeError(
                f"export_pretrained: model is a {type(inner).__name__}; expected a Hugging Face "
                "PreTrainedModel (with save_pretrained)"
            )
        Path(path).mkdir(parents=True, exist_ok=True)
        inner.save_pretrained(str(path), state_dict=full)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
    barrier()
