"""Sharded checkpoints with torch.distributed.checkpoint, and export to a Hugging Face folder.

A checkpoint is a folder::

    path/
      dcp/            model and optimizer, torch.distributed.checkpoint format (sharded:
                      every rank writes its own shards; loadable by any number of ranks)
      rank_0.pt ...   one small torch.save file per rank: ``extra``, the scheduler state
                      and this rank's RNG states (torch CPU / CUDA, ``random``, numpy)

The same functions work in a plain single process (no process group), for DDP models
and for FSDP2-sharded models; a checkpoint written by N processes resumes with M.

Loading never runs code from the checkpoint. Every file is read as data only: the
per-rank files and every tensor with ``torch.load(weights_only=True)``, and DCP's
``.metadata`` index with an unpickler that accepts only DCP's own metadata classes. What
the per-rank file holds is stored in that form: tensors, numbers, strings, lists, tuples
and dicts (the RNG states converted; ``extra`` must be JSON-like). A file that holds
anything else (tampered with, or written by torchforge before this format) is refused
with an error naming it; files you wrote yourself with an older torchforge load with
``load_checkpoint(..., trust_pickled_files=True)``.

Writes are atomic: a checkpoint is written into a hidden sibling folder
(``.<name>.incomplete``) and renamed to ``path`` once every rank has finished, so a run
killed while saving leaves the previous checkpoints intact and never a half-written
folder under the final name; :func:`latest_checkpoint` finds the newest complete one.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
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
from torchforge.errors import InvalidArgumentError, TorchforgeError

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "export_pretrained",
    "rng_state",
    "set_rng_state",
]

_DCP_DIR = "dcp"
_FORMAT = 2  # per-rank files that load with weights_only=True; 1: pickled RNG objects
_INCOMPLETE = ".incomplete"
_STEP_NAME = re.compile(r"step-(\d+)")
_RANK_FILE = re.compile(r"rank_(\d+)\.pt")
# What reading a truncated, corrupted or hostile file raises (never a bare Exception).
_READ_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, TypeError,
                AttributeError, ImportError, KeyError, IndexError, UnicodeDecodeError)


@contextlib.contextmanager
def _single_process_quiet():
    """Silence DCP's "assuming the intent is to save in a single process": it is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank_file(path: Path, r: int) -> Path:
    return path / f"rank_{r}.pt"


# --- RNG states as data --------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """The RNG states of this process: torch CPU, every CUDA device, ``random``, numpy.

    Stored as data that ``torch.load(weights_only=True)`` reads: torch states as uint8
    tensors, Python's Mersenne Twister as a list of ints, numpy's as an int64 tensor and
    numbers.

    Args:
        None.

    Returns:
        dict of tensors, numbers, lists and dicts; pass it to :func:`set_rng_state`.

    Example:
        >>> import torch
        >>> state = rng_state(); a = torch.rand(1); set_rng_state(state)
        >>> bool(torch.rand(1) == a)
        True
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        return state
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state["numpy"] = {
        "kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian),
    }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states saved by :func:`rng_state` (missing entries are left alone).

    Args:
        state: dict from :func:`rng_state` (or the pickled form of torchforge before
            checkpoint format 2).

    Returns:
        None.

    Example:
        >>> set_rng_state(rng_state())
    """
    torch.set_rng_state(state["torch"])
    python = state["python"]
    if isinstance(python, dict):
        random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
    else:  # format 1: random.getstate() itself
        random.setstate(python)
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        saved = state["numpy"]
        if isinstance(saved, dict):
            saved = (saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"],
                     saved["has_gauss"], saved["cached_gaussian"])
        np.random.set_state(saved)


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


# --- what a per-rank file may hold ----------------------------------------------------------

def _check_plain(fn: str, where: str, value: Any, *, tensors: bool) -> None:
    """Raise unless ``value`` is made of dicts with str keys, lists, tuples, str, numbers,
    bool and None (and tensors when ``tensors``): what ``weights_only=True`` loads."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        return
    if tensors and isinstance(value, torch.Tensor):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(fn, f"{where}[{i}]", item, tensors=tensors)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise InvalidArgumentError(
                    f"{fn}: {where} has the key {key!r} of type {type(key).__name__}; expected str keys"
                )
            _check_plain(fn, f"{where}[{key!r}]", item, tensors=tensors)
        return
    allowed = "dict, list, tuple, str, int, float, bool, None" + (", torch.Tensor" if tensors else "")
    raise InvalidArgumentError(
        f"{fn}: {where} is a {type(value).__module__}.{type(value).__name__}; a checkpoint stores only "
        f"data that loads without running code ({allowed}). Hint: store its state as such values"
    )


# --- reading without running code ------------------------------------------------------------

def _dcp_class(module: str, name: str) -> bool:
    """The globals DCP's ``.metadata`` pickle legitimately refers to."""
    if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
        import importlib

        return isinstance(getattr(importlib.import_module(module), name, None), type)
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))
    return (module, name) in {
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    }


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _dcp_class(module, name):
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which DCP metadata never holds")
        return super().find_class(module, name)


def _read_metadata(path: Path):
    """DCP's ``.metadata`` index, unpickled through an allow-list of DCP's own classes."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _READ_ERRORS as error:
        raise TorchforgeError(
            f"load_checkpoint: {path} could not be read as checkpoint metadata "
            f"({type(error).__name__}: {error}); refused, nothing in it was run. The file is "
            "truncated, corrupted, tampered with or not written by save_checkpoint"
        ) from None
    if not isinstance(metadata, dcp.metadata.Metadata):
        raise TorchforgeError(
            f"load_checkpoint: {path} holds a {type(metadata).__name__}, not DCP metadata; refused"
        )
    return metadata


class _SafeReader(dcp.FileSystemReader):
    """DCP's reader, with ``.metadata`` read by :func:`_read_metadata` (DCP uses plain pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank_ = kwargs.get("rank")
        name = ".metadata" if rank_ is None else f"__{rank_}.metadata"  # DCP's names (filesystem.py)
        metadata = _read_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(dcp.DefaultLoadPlanner):
    """DCP's planner, reading non-tensor items (optimizer hyperparameters) as data only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except _READ_ERRORS as error:
            raise TorchforgeError(
                f"load_checkpoint: the item {read_item.dest_index.fqn!r} of the checkpoint's dcp/ folder "
                f"is not plain data ({type(error).__name__}); refused, nothing in it was run"
            ) from None
        super().load_bytes(read_item, io.BytesIO(_saved_bytes(loaded)))


def _saved_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _dcp_load(state: dict[str, Any], folder: Path) -> None:
    """``dcp.load`` through the safe reader and planner; one clear error on a bad file."""
    _read_metadata(folder / ".metadata")  # before DCP, which would log and wrap the error
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=_SafeReader(str(folder)), planner=_SafePlanner(),
                     no_dist=not is_distributed())
    except CheckpointException as error:
        failures = [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
        ours = [f for f in failures if isinstance(f, TorchforgeError)]
        if ours:
            raise ours[0] from None
        first = failures[0] if failures else error
        raise TorchforgeError(
            f"load_checkpoint: {folder} could not be read ({type(first).__name__}: {first}); the "
            "checkpoint is truncated or corrupted"
        ) from None


def _read_rank_file(file: Path, trust_pickled_files: bool) -> dict[str, Any]:
    fn = "load_checkpoint"
    if trust_pickled_files:
        saved = torch.load(file, map_location="cpu", weights_only=False)
    else:
        try:
            with warnings.catch_warnings():  # torch warns about the protocol of hostile pickles
                warnings.simplefilter("ignore")
                saved = torch.load(file, map_location="cpu", weights_only=True)
        except _READ_ERRORS as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
            reason = next((line for line in lines if "Unsupported" in line), lines[0])
            raise TorchforgeError(
                f"{fn}: {file} is not a checkpoint file that loads as plain data ({type(error).__name__}: "
                f"{reason}); refused, nothing in it was run. It is truncated, corrupted or tampered "
                "with, or was written by torchforge before checkpoint format 2. Only if you wrote it "
                "yourself, load it with load_checkpoint(..., trust_pickled_files=True), which unpickles "
                "it (that can run code)"
            ) from None
    expected = {"extra", "scheduler", "rng", "world_size", "has_optimizer"}
    if not isinstance(saved, dict) or not expected <= set(saved):
        seen = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise TorchforgeError(
            f"{fn}: {file} holds {seen}; expected a dict with the keys {sorted(expected)} written by save_checkpoint"
        )
    return saved


# --- save / load -----------------------------------------------------------------------------

def _state_dicts(model: nn.Module, optimizer, options: StateDictOptions | None = None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=options)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optimizer": optim_sd}


def _options(trainable_only: bool) -> StateDictOptions | None:
    """Only the parameters that require grad (and buffers), loaded without the frozen ones."""
    return StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None


def _staging(path: Path) -> Path:
    return path.parent / f".{path.name}{_INCOMPLETE}"


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    trainable_only: bool = False,
) -> None:
    """Save model, optimizer, scheduler, ``extra`` and RNG states to the folder ``path``, atomically.

    Model and optimizer go through ``torch.distributed.checkpoint`` (``get_state_dict``
    then ``dcp.save``): each rank writes its own shards of an FSDP2 model, so no rank
    ever holds the full state. ``extra``, the scheduler state and this rank's RNG states
    go to ``rank_<r>.pt``. Everything is written into the hidden sibling folder
    ``.<name>.incomplete``; once every rank is done, rank 0 renames it to ``path``. Every
    rank must call this (it is a collective).

    Args:
        path: checkpoint folder: new, empty, or an existing checkpoint (replaced, only
            once the new one is complete). A folder holding anything else is refused,
            never deleted.
        model: the model being trained: plain, DDP-wrapped or FSDP2-sharded.
        optimizer: its optimizer, or None.
        scheduler: an object with ``state_dict()`` / ``load_state_dict()`` (an LR
            scheduler), or None; its state must be plain data (tensors, numbers,
            strings, lists, dicts), as every torch LR scheduler's is.
        extra: small JSON-like dict (step, data position, ...): str keys; values dicts,
            lists, tuples, str, int, float, bool, None. May differ per rank.
        trainable_only: save only the parameters that require grad (and the buffers),
            with their optimizer state: a LoRA run's adapters, not its frozen base weights
            (``StateDictOptions(ignore_frozen_params=True)``). Load it with
            ``load_checkpoint(..., trainable_only=True)`` into a model whose frozen
            weights are already those of the run.

    Returns:
        None.

    Raises:
        InvalidArgumentError: ``extra`` or the scheduler state holds another type (the
            message names the key), or ``path`` holds other files; nothing is written then.

    Example:
        >>> import tempfile, torch
        >>> model = torch.nn.Linear(2, 2)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_checkpoint(d, model=model, extra={"step": 3})
        ...     load_checkpoint(d, model=model)
        {'step': 3}

    Note:
        A rename is atomic on one file system: a process killed while saving leaves
        ``.<name>.incomplete`` (removed by the next save of the same name) and the
        previous checkpoints as they were. Replacing an existing ``path`` moves it aside
        first, so between the two renames ``path`` is briefly absent, never partial.
    """
    fn = "save_checkpoint"
    path = Path(path)
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise InvalidArgumentError(f"{fn}: extra must be a dict, got {type(extra).__name__}")
    _check_plain(fn, "extra", extra, tensors=False)
    scheduler_state = scheduler.state_dict() if scheduler is not None else None
    _check_plain(fn, "the scheduler state", scheduler_state, tensors=True)
    if path.exists():
        others = sorted(c.name for c in path.iterdir() if not _RANK_FILE.fullmatch(c.name) and c.name != _DCP_DIR) \
            if path.is_dir() else [path.name]
        if others:
            raise InvalidArgumentError(
                f"{fn}: path={str(path)!r} exists and holds {others[:5]}, which a checkpoint does not; "
                "expected a new folder or an existing checkpoint (which is replaced): pick another path"
            )
    staging = _staging(path)
    if is_main_process():
        if staging.exists():  # left by a run killed while saving
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    barrier()
    state = _state_dicts(model, optimizer, _options(trainable_only))
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(staging / _DCP_DIR), no_dist=not is_distributed())
    torch.save(
        {
            "format": _FORMAT,
            "extra": extra,
            "scheduler": scheduler_state,
            "rng": rng_state(),
            "world_size": world_size(),
            "has_optimizer": optimizer is not None,
            "trainable_only": trainable_only,
        },
        _rank_file(staging, rank()),
    )
    barrier()
    if is_main_process():
        previous = path.parent / f".{path.name}.previous"
        if previous.exists():
            shutil.rmtree(previous)
        if path.exists():
            path.rename(previous)
        staging.rename(path)
        if previous.exists():
            shutil.rmtree(previous)
    barrier()


def _is_complete(path: Path) -> bool:
    """A checkpoint folder whose metadata and every rank's file are there."""
    if not (path / _DCP_DIR / ".metadata").is_file():
        return False
    files = sorted(path.glob("rank_*.pt"))
    if not files:
        return False
    try:  # rank files are named rank_0 .. rank_{N-1}, N = the world size at save time
        ranks = sorted(int(f.stem.split("_")[1]) for f in files)
    except ValueError:
        return False
    return ranks == list(range(len(ranks)))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder ``step-<n>`` in ``directory``, or None.

    Folders are ordered by ``n``; a folder is complete when its DCP metadata and its rank
    files are there. Folders being written (``.step-<n>.incomplete``, left by a run
    killed while saving) are hidden and never returned.

    Args:
        directory: the folder holding the ``step-<n>`` checkpoints (the trainer's
            ``output_dir/checkpoints``).

    Returns:
        Path of the checkpoint, or None when there is none (or ``directory`` does not exist).

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> with tempfile.TemporaryDirectory() as d:
        ...     for step in (5, 10):
        ...         save_checkpoint(Path(d) / f"step-{step:06d}", model=torch.nn.Linear(2, 2))
        ...     latest_checkpoint(d).name
        'step-000010'
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = []
    for child in directory.iterdir():
        match = _STEP_NAME.fullmatch(child.name)
        if match and child.is_dir() and _is_complete(child):
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
    trust_pickled_files: bool = False,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and the rest), in place.

    Model and optimizer are read with ``dcp.load`` into this process's own layout, then
    applied with ``set_state_dict``: a checkpoint saved by N ranks (sharded or not) loads
    into M ranks, plain, DDP or FSDP2. Nothing in the checkpoint is run: see the module's
    docstring for how each file is read.

    Args:
        path: checkpoint folder.
        model: model with the architecture that was saved (plain, DDP or FSDP2).
        optimizer: optimizer over ``model``'s parameters, or None (then the saved
            optimizer state is ignored).
        scheduler: scheduler to restore, or None.
        restore_rng: restore this rank's RNG states.
        trust_pickled_files: read the per-rank files with ``torch.load(weights_only=False)``,
            which can run code from them. Only for checkpoints you wrote yourself with
            torchforge before checkpoint format 2 (whose RNG states were pickled objects);
            the model and optimizer are read as data either way.
        trainable_only: load only the parameters of ``model`` that require grad (and the
            buffers) with their optimizer state, leaving its frozen weights as they are:
            for checkpoints saved with ``save_checkpoint(..., trainable_only=True)``
            (also reads the same entries of a full checkpoint).

    Returns:
        ``extra`` as saved by this rank (by rank 0 if this rank did not exist when saving).

    Raises:
        TorchforgeError: ``path`` holds no checkpoint; a file is truncated, corrupted or
            holds anything but plain data (the message names the file); the checkpoint
            lacks the optimizer or scheduler asked for.

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
        torch.distributed.checkpoint, https://pytorch.org/docs/stable/distributed.checkpoint.html;
        ``torch.load(weights_only=True)``, https://pytorch.org/docs/stable/notes/serialization.html
    """
    path = Path(path)
    if not (path / _DCP_DIR / ".metadata").exists():
        raise TorchforgeError(
            f"load_checkpoint: path={str(path)!r} holds no checkpoint ({path / _DCP_DIR / '.metadata'} "
            "not found); expected a folder written by save_checkpoint"
        )
    own = _rank_file(path, rank())
    saved = _read_rank_file(own if own.exists() else _rank_file(path, 0), trust_pickled_files)
    if optimizer is not None and not saved.get("has_optimizer", True):
        raise TorchforgeError(
            f"load_checkpoint: path={str(path)!r} was saved without an optimizer; pass optimizer=None"
        )
    if saved.get("trainable_only", False) and not trainable_only:
        raise TorchforgeError(
            f"load_checkpoint: path={str(path)!r} holds only the trainable parameters (saved with "
            "trainable_only=True, e.g. a LoRA run's adapters); load it with trainable_only=True into a "
            "model whose frozen weights are those of the run"
        )
    options = _options(trainable_only)
    state = _state_dicts(model, optimizer, options)
    _dcp_load(state, path / _DCP_DIR)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)

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
