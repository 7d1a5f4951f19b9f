"""The ``torchforge`` command.

``torchforge train``                      the embedded demo (tiny Llama, copy-digits task, GRPO)
``torchforge train key=value ...``        the demo with some settings changed
``torchforge train --config run.yaml``    a real run: RLConfig fields plus ``model`` (a local
                                          Hugging Face folder), ``dataset`` (a JSONL file or a
                                          ``datasets`` folder), ``reward_functions`` (dotted
                                          import paths) and ``distributed`` (DistributedConfig
                                          fields); ``key=value`` overrides the file
``torchforge train --nproc N ...``        the same on N processes (torch.distributed.run)
``torchforge plot RUN_DIR``               the reward / KL / entropy / length curves as a PNG

``torchrun --nproc_per_node N -m torchforge train ...`` works as well.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from torchforge.errors import InvalidArgumentError

__all__ = ["main", "load_run_config", "import_object"]

_RUN_KEYS = ("model", "dataset", "reward_functions", "distributed", "environment")


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
        out[key.strip()] = yaml.safe_load(value)  # "0.5" -> float, "null" -> None, "[1, 2]" -> list
    return out


def load_run_config(path: str | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The merged settings of a run: the YAML file (if any), then ``key=value`` overrides.

    Args:
        path: a YAML file, or None.
        overrides: ``key=value`` strings; values are parsed as YAML.

    Returns:
        dict of settings (RLConfig fields and the run keys ``model``, ``dataset``,
        ``reward_functions``, ``distributed``).
    """
    values: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise InvalidArgumentError(f"torchforge train: {path} holds a {type(loaded).__name__}; expected a mapping")
        values.update(loaded)
    values.update(_parse_overrides(overrides))
    return _numbers(values)


def import_object(path: str) -> Any:
    """The object named by ``"package.module.name"`` or ``"package.module:name"``.

    Args:
        path: a dotted path.

    Returns:
        The object.
    """
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise InvalidArgumentError(f"import_object: {path!r} is not a dotted path; expected 'package.module.name'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise InvalidArgumentError(f"import_object: cannot import {path!r}: {error}") from error


def _reward_functions(paths: Sequence[str]) -> list[Any]:
    from torchforge.loop.rewards import RewardFunction

    out = []
    for path in paths:
        obj = import_object(path)
        out.append(obj() if inspect.isclass(obj) and issubclass(obj, RewardFunction) else obj)
    return out


def _dataset(path: str) -> Any:
    p = Path(path)
    if p.is_file():
        with p.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if p.is_dir():
        from datasets import DatasetDict, load_from_disk

        data = load_from_disk(str(p))
        return data["train"] if isinstance(data, DatasetDict) else data
    raise InvalidArgumentError(f"torchforge train: dataset {path!r} does not exist; expected a JSONL file or a datasets folder")


def build_trainer(values: dict[str, Any]):
    """An RLTrainer from merged run settings (see :func:`load_run_config`).

    Args:
        values: settings.

    Returns:
        RLTrainer.
    """
    from torchforge.distributed import DistributedConfig
    from torchforge.trainer.config import RLConfig
    from torchforge.trainer.demo import demo_config
    from torchforge.trainer.trainer import RLTrainer

    run = {k: values.pop(k) for k in _RUN_KEYS if k in values}
    dist = DistributedConfig(**run["distributed"]) if run.get("distributed") else None
    environment = import_object(run["environment"]) if run.get("environment") else None  # multi-turn episodes
    if "model" not in run:  # the embedded demo, with any settings changed
        if "dataset" in run or "reward_functions" in run:
            raise InvalidArgumentError(
                "torchforge train: dataset / reward_functions given without a model; expected 'model' "
                "(a local Hugging Face folder) too"
            )
        return RLTrainer(config=demo_config(**values), distributed_config=dist, environment_factory=environment)
    missing = [k for k in ("dataset", "reward_functions") if k not in run and not (k == "reward_functions" and environment)]
    if missing:
        raise InvalidArgumentError(f"torchforge train: model given but not {missing}; expected all three")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run["model"])
    tokenizer = AutoTokenizer.from_pretrained(run["model"])
    rewards = run.get("reward_functions", [])
    return RLTrainer(
        model=model, tokenizer=tokenizer, config=RLConfig.from_dict(values),
        reward_functions=_reward_functions([rewards] if isinstance(rewards, str) else rewards),
        train_dataset=_dataset(run["dataset"]), distributed_config=dist, environment_factory=environment,
    )


def _train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from torchforge.distributed import is_main_process, launch, teardown_distributed

    if args.nproc is not None and args.nproc > 1:
        forwarded = [a for a in argv if not a.startswith("--nproc")]
        if "--nproc" in argv:  # "--nproc N": drop N too
            i = list(argv).index("--nproc")
            forwarded = list(argv[:i]) + list(argv[i + 2:])
        return launch(args.nproc, ["train", *forwarded])
    values = load_run_config(args.config, args.overrides)
    if args.resume:
        values["resume"] = True
    trainer = build_trainer(values)
    main_process = is_main_process()
    try:
        summary = trainer.train()
    finally:
        teardown_distributed()
    if main_process:
        print(
            f"\ntrained {summary['steps']} steps ({trainer.algorithm.name})\n"
            f"  reward      {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} "
            "(mean of the first and last 10% of steps)\n"
            f"  metrics     {summary['metrics']}  (TensorBoard: {trainer.output_dir / 'tensorboard'})\n"
            f"  checkpoint  {summary['checkpoint']}  (continue with --resume)\n"
            f"  final model {summary['final_model']}\n"
            f"  plot        {summary['plot']}"
        )
    return 0 if not math.isnan(summary["reward_last"]) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchforge`` command.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="torchforge", description="RL post-training of language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train (no arguments: the embedded demo)")
    train.add_argument("--config", help="a YAML file of settings")
    train.add_argument("--nproc", type=int, help="number of processes to launch (torch.distributed.run)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="settings that override the file")
    plot = commands.add_parser("plot", help="draw a run's curves to RUN_DIR/curves.png")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="PNG path")
    args = parser.parse_args(argv)
    if args.command == "plot":
        from torchforge.trainer.plot import plot_run

        print(plot_run(args.run_dir, args.out))
        return 0
    try:
        return _train(args, argv[1:])
    except InvalidArgumentError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
