"""Reading a run's settings, shared by ``torchforge train`` and ``torchforge eval``.

A run is described by a YAML file of settings and ``key=value`` overrides
(:func:`load_run_config`); its ``dataset`` and ``eval_dataset`` are JSONL files or
``datasets`` folders, with a split (:func:`dataset_source`, :func:`read_dataset`), its
``reward_functions`` dotted import paths or reward-model / judge settings
(:func:`reward_functions_from_settings`), and every dotted path is resolved with
:func:`import_object` from the working directory and the config file's folder
(:func:`add_import_folders`). Nothing here loads a model: a mistake is one
``InvalidArgumentError`` line before anything heavy.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.loop.rewards import RewardFunction, reward_name

__all__ = [
    "load_run_config",
    "import_object",
    "add_import_folders",
    "read_dataset",
    "dataset_source",
    "reward_functions_from_settings",
    "RewardRaised",
    "did_you_mean",
]

_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


def _numbers(value: Any) -> Any:
    """YAML 1.1 reads ``1e-3`` as a string (it wants ``1.0e-3``); read it as the float it is."""
    if isinstance(value, str) and _FLOAT.match(value):
        return float(value)
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    return value


def _parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidArgumentError(f"torchforge train: {pair!r} is not key=value; expected e.g. max_steps=100")
        try:
            out[key.strip()] = yaml.safe_load(value)  # "0.5" -> float, "null" -> None, "[1, 2]" -> list
        except yaml.YAMLError as error:
            raise InvalidArgumentError(
                f"torchforge train: {pair!r}: the value is not valid YAML ({getattr(error, 'problem', error)})"
            ) from None
    return out


def load_run_config(path: str | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The merged settings of a run: the YAML file (if any), then ``key=value`` overrides.

    Args:
        path: a YAML file, or None.
        overrides: ``key=value`` strings; values are parsed as YAML.

    Returns:
        dict of settings (RLConfig fields and the run keys ``model``, ``dataset``,
        ``reward_functions``, ``environment``, ``distributed``).

    Example:
        >>> load_run_config(None, ["max_steps=7", "learning_rate=1e-3", "stop_token_ids=[5, 6]"])
        {'max_steps': 7, 'learning_rate': 0.001, 'stop_token_ids': [5, 6]}
    """
    values: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise InvalidArgumentError(f"--config {path}: no such file; expected a YAML file of settings")
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise InvalidArgumentError(f"{where}: malformed YAML: {problem}") from None
        if not isinstance(loaded, dict):
            raise InvalidArgumentError(f"torchforge train: {path} holds a {type(loaded).__name__}; expected a mapping")
        values.update(loaded)
    values.update(_parse_overrides(overrides))
    return _numbers(values)


def add_import_folders(config_path: str | None) -> None:
    """Put the working directory and the config file's folder first on ``sys.path``.

    So that a run's dotted paths (``reward_functions: [myrewards.correct]``) name modules
    beside the config, or where the command runs, as they would in ``python -c``.

    Args:
        config_path: the ``--config`` file, or None.

    Returns:
        None.
    """
    folders = [os.getcwd()]
    if config_path is not None:
        folders.append(str(Path(config_path).resolve().parent))
    for folder in reversed(folders):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def import_object(path: str) -> Any:
    """The object named by ``"package.module.name"`` or ``"package.module:name"``.

    Args:
        path: a dotted path.

    Returns:
        The object.

    Example:
        >>> import_object("torchforge.trainer.demo:CopyDigitsReward").name
        'copy_digits'
    """
    if not isinstance(path, str):
        raise InvalidArgumentError(f"import_object: {path!r} is not a dotted path; expected 'package.module.name'")
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise InvalidArgumentError(f"import_object: {path!r} is not a dotted path; expected 'package.module.name'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise InvalidArgumentError(f"import_object: cannot import {path!r}: {error}") from error
    except Exception as error:  # the module itself raised while importing
        raise InvalidArgumentError(
            f"import_object: importing {path!r} raised {type(error).__name__}: {error}"
        ) from error


def did_you_mean(key: str, names: Sequence[str]) -> str:
    """The end of an unknown-setting message: ``"; did you mean 'name'?"``, or ``""`` if none is close.

    Args:
        key: the unknown name.
        names: the valid names.

    Returns:
        str, to append to the message.

    Example:
        >>> "unknown setting 'max_step'" + did_you_mean("max_step", ["max_steps", "seed"])
        "unknown setting 'max_step'; did you mean 'max_steps'?"
    """
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def dataset_source(key: str, value: Any, *, split: str = "train") -> tuple[str, str | None]:
    """A run's ``dataset`` / ``eval_dataset`` setting checked without reading it: its path and split.

    The setting is a JSONL file, a ``datasets`` folder (``save_to_disk``'s output: one
    ``Dataset``, or a ``DatasetDict`` of splits, of which ``split`` is taken), or the mapping
    ``{path: DIR, split: NAME}`` that names another split. A ``DatasetDict``'s splits are read
    from its ``dataset_dict.json``, so that a missing split is an error before anything loads.

    Args:
        key: the setting's name, for the messages (``"dataset"``, ``"eval_dataset"``).
        value: the setting.
        split: the split of a ``DatasetDict`` folder when ``value`` names none.

    Returns:
        ``(path, split)``: ``split`` is None for a JSONL file or a folder of one ``Dataset``.

    Example:
        >>> dataset_source("eval_dataset", {"path": "/nowhere", "split": "test"})
        Traceback (most recent call last):
        ...
        torchforge.errors.InvalidArgumentError: eval_dataset '/nowhere' does not exist; expected a JSONL file or a datasets folder
    """
    form = "a JSONL file, a datasets folder or {path: DIR, split: NAME}"
    named = None
    if isinstance(value, dict):
        if set(value) - {"path", "split"} or not isinstance(value.get("path"), str) or not isinstance(
                value.get("split", ""), str):
            raise InvalidArgumentError(f"{key}={value!r}; expected {form}")
        value, named = value["path"], value.get("split")
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{key}={value!r}; expected {form}")
    p = Path(value).expanduser()
    if not p.exists():
        raise InvalidArgumentError(f"{key} {value!r} does not exist; expected a JSONL file or a datasets folder")
    splits_file = p / "dataset_dict.json"
    if not splits_file.is_file():  # a JSONL file, or a folder of one Dataset
        if named is not None:
            raise InvalidArgumentError(f"{key}: split {named!r} of {value!r}, which has no splits; expected a "
                                       "DatasetDict folder (save_to_disk of a DatasetDict), or no split")
        return str(p), None
    splits = list(json.loads(splits_file.read_text()).get("splits", []))
    chosen = named if named is not None else split
    if chosen not in splits:
        raise InvalidArgumentError(f"{key} {value!r} has the splits {splits}, not {chosen!r}; expected "
                                   f"{key}={{path: {value}, split: NAME}} with NAME one of them")
    return str(p), chosen


def read_dataset(path: str, *, split: str | None = "train", key: str = "dataset") -> Any:
    """A run's ``dataset`` / ``eval_dataset``: the rows of a JSONL file, or one split of a ``datasets`` folder.

    Args:
        path: a JSONL file (one JSON object a line; blank lines skipped) or a folder that
            ``datasets.load_from_disk`` reads (see :func:`dataset_source`).
        split: the split taken from a ``DatasetDict`` folder (default ``"train"``).
        key: the setting's name, for the messages.

    Returns:
        A list of dicts (JSONL), or a ``datasets.Dataset``.
    """
    p = Path(path).expanduser()
    if p.is_file():
        rows = []
        with p.open() as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise InvalidArgumentError(f"{key} {path}:{i}: not a JSON line ({error.msg})") from None
        return rows
    if p.is_dir():
        from datasets import DatasetDict, load_from_disk  # an optional extra, and slow to import

        data = load_from_disk(str(p))
        if not isinstance(data, DatasetDict):
            return data
        if split not in data:
            raise InvalidArgumentError(f"{key} {path!r} has the splits {list(data)}, not {split!r}; "
                                       f"expected {key}={{path: {path}, split: NAME}} with NAME one of them")
        return data[split]
    raise InvalidArgumentError(f"{key} {path!r} does not exist; expected a JSONL file or a datasets folder")


# --- reward functions: name the sample a raising function failed on ----------------------

class RewardRaised(TorchforgeError):
    """A reward function of the run raised: names it, the sample and the exception."""


class _LocatedReward:
    """A reward function that, when it raises, finds the first sample it raises on alone."""

    def __init__(self, fn: Any, path: str) -> None:
        self.fn, self.path = fn, path
        self.name = reward_name(fn)
        self.weight = float(getattr(fn, "weight", 1.0))
        self.in_process = bool(getattr(fn, "in_process", False))  # reward models stay out of worker processes

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str], **columns: Any):
        try:
            return self.fn(prompts=prompts, completions=completions, **columns)
        except Exception as error:
            B = len(completions)
            where = ""
            for b in range(B):
                one = {k: (v[b:b + 1] if isinstance(v, (list, tuple)) and len(v) == B else v) for k, v in columns.items()}
                try:
                    self.fn(prompts=list(prompts[b:b + 1]), completions=list(completions[b:b + 1]), **one)
                except Exception:
                    where = f" on sample {b} (prompt {prompts[b]!r}, completion {completions[b]!r})"
                    break
            raise RewardRaised(
                f"reward function {self.path!r} raised {type(error).__name__}: {error}{where}"
            ) from error


def reward_functions_from_settings(settings: Sequence[Any]) -> list[Any]:
    """A run's ``reward_functions``: each dotted path imported, each mapping a reward model or judge.

    A ``RewardFunction`` class is instantiated with no arguments; a function or object is
    used as is. Each imported one is wrapped so that, when it raises, the error
    (:class:`RewardRaised`) names its path and the first sample it raises on alone.

    Args:
        settings: dotted import paths (``"myrewards.correct"``, ``"myrewards:Format"``)
            and / or ``{reward_model: DIR, ...}`` / ``{judge: DIR, ...}`` mappings
            (:func:`torchforge.rewards.reward_model.reward_from_settings`; no model is
            loaded here).

    Returns:
        A list of reward functions, in the order given.

    Example:
        >>> [fn.name for fn in reward_functions_from_settings(["torchforge.trainer.demo.CopyDigitsReward"])]
        ['copy_digits']
    """
    out = []
    for path in settings:
        if isinstance(path, dict):  # {reward_model: DIR, ...} / {judge: DIR, ...}: built without loading a model
            from torchforge.rewards.reward_model import reward_from_settings

            out.append(reward_from_settings(path))
            continue
        obj = import_object(path)
        if inspect.isclass(obj) and issubclass(obj, RewardFunction):
            obj = obj()
        if not callable(obj):
            raise InvalidArgumentError(
                f"reward_functions: {path!r} is a {type(obj).__name__}; expected a function or a RewardFunction"
            )
        out.append(_LocatedReward(obj, path))
    return out
