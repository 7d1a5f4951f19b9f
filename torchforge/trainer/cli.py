"""The ``torchforge`` command.

``torchforge train``                      the embedded demo (tiny Llama, copy-digits task, GRPO)
``torchforge train key=value ...``        the demo with some settings changed
``torchforge train --config run.yaml``    a real run: RLConfig fields plus ``model`` (a local
                                          Hugging Face folder), ``dataset`` (a JSONL file or a
                                          ``datasets`` folder), ``eval_dataset`` (the same, scored
                                          every ``eval_steps``), ``reward_functions`` (dotted
                                          import paths) and ``distributed`` (DistributedConfig
                                          fields); ``key=value`` overrides the file
``torchforge train --nproc N ...``        the same on N processes (torch.distributed.run)
``torchforge train --nnodes N --node-rank R --master-addr HOST --master-port P ...``
                                          the same on N machines (run it on each one)
``torchforge plot RUN_DIR``               the reward / KL / entropy / length curves as a PNG

``torchrun --nproc_per_node N -m torchforge train ...`` works as well.

Every mistake in the settings is answered with one ``error:`` line and exit status 2,
before any model is loaded (and, with ``--nproc``, before any process is started).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn, Sequence

from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.trainer.environment_settings import environment_from_settings
from torchforge.trainer.eval_command import add_eval_parser, eval_main
from torchforge.trainer.policy_losses import POLICY_LOSS_REGISTRY
from torchforge.trainer.run_config import (
    RewardRaised,
    add_import_folders,
    dataset_source,
    did_you_mean,
    import_object,
    load_run_config,
    read_dataset,
    reward_functions_from_settings,
)
from torchforge.trainer.run_dir import RunInterrupted, last_checkpoint_step, prepare_output_dir

# load_run_config and import_object live in run_config (shared with `torchforge eval`);
# they stay importable from here, where the README and tests have always found them
__all__ = ["main", "run", "load_run_config", "import_object", "check_run", "build_trainer"]

_RUN_KEYS = {
    "model": "a local Hugging Face folder (none: the embedded demo)",
    "dataset": "a JSONL file or a `datasets` folder of rows with a 'prompt' field, or {path: DIR, split: NAME}",
    "eval_dataset": "what `dataset` takes (a DatasetDict folder's 'test' split unless named), scored every "
                    "`eval_steps` steps; `demo`: fresh rows of the demo's task",
    "reward_functions": "dotted import paths, e.g. [myrewards.correct, myrewards:Format], or {reward_model: DIR, ...} / {judge: DIR, ...}",
    "environment": "a dotted import path of a multi-turn environment class, one per episode (RLTrainer's environment_factory), "
                   "or {openenv: URL, ...} / {verifiers: ID, ...}",
    "distributed": "DistributedConfig fields, e.g. {strategy: fsdp, sharding_strategy: full}",
}

_INTERRUPTED = 130  # the shell's status for a process stopped by SIGINT


# --- checking every setting before anything heavy ------------------------------------------

def _looks_local(name: str) -> bool:
    """A model name that can only be a path: never sent to a model hub."""
    return (name.startswith((".", "/", "~", "\\")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)
            or name.endswith("/"))


def _check_model(name: Any) -> str:
    """The model folder (or hub id, cached or reachable); one-line errors otherwise."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"model={name!r}; expected the path of a Hugging Face model folder")
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidArgumentError(
                f"model {name!r} is a folder without config.json; expected a Hugging Face model folder "
                "(save_pretrained's output)"
            )
        return str(path)
    if path.exists():
        raise InvalidArgumentError(f"model {name!r} is a file; expected a Hugging Face model folder")
    if _looks_local(name):
        raise InvalidArgumentError(f"model {name!r} does not exist; expected a Hugging Face model folder")
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
        except Exception:  # not a valid repo id
            cached = False
        if not cached:
            raise InvalidArgumentError(
                f"model {name!r} is neither a local folder nor in the Hugging Face cache (HF_HUB_OFFLINE is set); "
                "expected a Hugging Face model folder"
            )
    return name


def _type_matches(value: Any, annotation: str) -> bool:
    for part in (p.strip() for p in annotation.split("|")):
        if part == "None" and value is None:
            return True
        if part == "bool" and isinstance(value, bool):
            return True
        if part == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if part == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if part == "str" and isinstance(value, str):
            return True
        if part.startswith("dict[") and isinstance(value, dict):  # the lora: block
            return True
        if part.startswith("list[") and isinstance(value, list):
            inner = part[5:-1]
            if all(_type_matches(v, inner) for v in value):
                return True
        if part.startswith("dict") and isinstance(value, dict):
            return True
        if part not in ("None", "bool", "int", "float", "str") and not part.startswith(("list[", "dict")):
            return True  # a type this check does not know: the config's own validation decides
    return False


def _check_types(values: dict[str, Any], cls: type, prefix: str = "") -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        field = fields[key]
        annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        if not _type_matches(value, annotation):
            raise InvalidArgumentError(
                f"{prefix}{key}={value!r} is a {type(value).__name__}; expected {annotation.replace(' | ', ' or ')}"
            )


@dataclasses.dataclass
class _Run:
    config: Any  # RLConfig
    model: str | None = None
    dataset: tuple[str, str | None] | None = None  # (path, split): dataset_source
    train_rows: Any = None  # a JSONL dataset's rows, read once here (image paths resolved); else read when built
    eval_rows: Any = None  # the eval_dataset's rows, read and checked before any model loads
    reward_functions: list[Any] = dataclasses.field(default_factory=list)
    distributed: Any = None  # DistributedConfig or None
    environment: Any = None  # a multi-turn environment class or None
    vision: bool = False  # the model is a vision-language model (loaded with its processor)


def check_run(values: dict[str, Any], *, num_processes: int = 1) -> _Run:
    """Check every setting of a run without loading anything heavy; one-line errors.

    Unknown keys (with the nearest valid key), wrong types, bad values, a missing model
    folder, dataset file or ``distributed`` field, reward functions that do not import, an
    ``output_dir`` that cannot be written, a ``prompts_per_step`` that does not split
    over ``num_processes`` and the strategy ``"none"`` on several processes all raise
    ``InvalidArgumentError``.

    Args:
        values: merged settings (see :func:`load_run_config`).
        num_processes: processes the run will have (``--nproc`` times ``--nnodes``).

    Returns:
        The checked run: ``config`` (RLConfig), ``model``, ``dataset``, ``eval_rows``,
        ``reward_functions``, ``distributed``.
    """
    from torchforge.distributed import DistributedConfig
    from torchforge.trainer.config import RLConfig
    from torchforge.trainer.demo import demo_config
    from torchforge.trainer.run_dir import check_writable

    values = dict(values)
    names = [f.name for f in dataclasses.fields(RLConfig)]
    for key in values:
        if key not in names and key not in _RUN_KEYS:
            raise InvalidArgumentError(
                f"unknown setting {key!r}{did_you_mean(key, [*names, *_RUN_KEYS])} "
                "(`torchforge train --help` lists them all)"
            )
    run_values = {k: values.pop(k) for k in list(_RUN_KEYS) if k in values}
    _check_types(values, RLConfig)
    environment = environment_from_settings(run_values["environment"]) if run_values.get("environment") else None
    brings_rows = getattr(environment, "train_dataset", None) is not None  # a verifiers environment's dataset

    dist = None
    if run_values.get("distributed") is not None:
        given = run_values["distributed"]
        if not isinstance(given, dict):
            raise InvalidArgumentError(f"distributed={given!r}; expected a mapping of DistributedConfig fields")
        dist_names = [f.name for f in dataclasses.fields(DistributedConfig)]
        for key in given:
            if key not in dist_names:
                raise InvalidArgumentError(f"unknown setting distributed.{key}{did_you_mean(key, dist_names)}; "
                                           f"expected one of {dist_names}")
        _check_types(given, DistributedConfig, prefix="distributed.")
        dist = DistributedConfig(**given)

    if "model" not in run_values:  # the embedded demo, with any settings changed
        if "dataset" in run_values or "reward_functions" in run_values:
            raise InvalidArgumentError(
                "torchforge train: dataset / reward_functions given without a model; expected 'model' "
                "(a local Hugging Face folder) too"
            )
        run = _Run(config=demo_config(**values), distributed=dist, environment=environment)
        run.eval_rows = _eval_rows(run_values.get("eval_dataset"), run.config, demo=True)
    else:
        missing = [k for k in ("dataset", "reward_functions") if k not in run_values
                   and not (k == "reward_functions" and environment) and not (k == "dataset" and brings_rows)]
        if missing:
            raise InvalidArgumentError(f"torchforge train: model given but not {missing}; expected all three")
        config = RLConfig.from_dict(values)
        rewards = run_values.get("reward_functions", [])
        rewards = [rewards] if isinstance(rewards, str) else rewards
        if not isinstance(rewards, list) or not (rewards or environment):
            raise InvalidArgumentError(f"reward_functions={rewards!r}; expected a list of dotted import paths")
        dataset = run_values.get("dataset")
        dataset = None if dataset is None and brings_rows else dataset_source("dataset", dataset)
        model = _check_model(run_values["model"])
        from torchforge.trainer.vision_task import check_vision_run

        train_rows = _jsonl_rows(dataset, "dataset")
        eval_rows = _eval_rows(run_values.get("eval_dataset"), config, demo=False)
        # images: every image file exists, the model takes images and has its processor (before it loads)
        named = [(f"dataset {dataset[0]}", train_rows)] if dataset else []
        vision = check_vision_run(model, config, [*named, ("eval_dataset", eval_rows)])
        run = _Run(config=config, model=model, dataset=dataset, train_rows=train_rows, eval_rows=eval_rows,
                   reward_functions=reward_functions_from_settings(rewards), distributed=dist, environment=environment,
                   vision=vision)
    if run.config.prompts_per_step % num_processes:
        raise InvalidArgumentError(
            f"prompts_per_step={run.config.prompts_per_step} does not split over {num_processes} processes; "
            "expected a multiple of the number of processes"
        )
    strategy = run.distributed.strategy if run.distributed is not None else run.config.distributed_strategy
    if strategy == "none" and num_processes > 1:
        raise InvalidArgumentError(
            f"distributed_strategy='none' with {num_processes} processes would train one unsynchronized copy of "
            "the model per process; expected 'fsdp' or 'ddp'"
        )
    from torchforge.trainer.tracking import check_tracker_packages

    check_tracker_packages(run.config.report_to)  # report_to: wandb without wandb installed, before any model
    check_writable(run.config.output_dir)
    return run


def _jsonl_rows(dataset: tuple[str, str | None] | None, key: str) -> Any:
    """A JSONL dataset's rows, read once, their relative image paths resolved from the file's
    folder; None for a ``datasets`` folder (read when the trainer is built) or no dataset."""
    if dataset is None or not Path(dataset[0]).expanduser().is_file():
        return None
    from torchforge.trainer.vision_task import resolve_image_paths

    return resolve_image_paths(read_dataset(dataset[0], key=key), Path(dataset[0]).expanduser().parent)


def _eval_rows(setting: Any, config: Any, *, demo: bool) -> Any:
    """The ``eval_dataset``'s rows, read and checked (paired with ``eval_steps``), or None."""
    if (setting is None) != (config.eval_steps is None):
        given, missing = ("eval_steps", "eval_dataset") if setting is None else ("eval_dataset", "eval_steps")
        what = "FILE (a JSONL file or datasets folder of prompts)" if missing == "eval_dataset" else "N (every N steps)"
        raise InvalidArgumentError(f"{given} is set without {missing}: nothing would be evaluated; expected "
                                   f"{missing}={what} too, or neither")
    if setting is None:
        return None
    if setting == "demo":
        if not demo:
            raise InvalidArgumentError("eval_dataset=demo with a model; expected a JSONL file or datasets folder "
                                       "(`demo` is the embedded demo's task)")
        from torchforge.trainer.demo import copy_digits_dataset

        return copy_digits_dataset(64, seed=config.seed + 1)  # another draw than the training rows'
    from torchforge.trainer.evaluation import check_eval_rows

    path, split = dataset_source("eval_dataset", setting, split="test")
    rows = _jsonl_rows((path, split), "eval_dataset")
    return check_eval_rows(rows if rows is not None else read_dataset(path, split=split, key="eval_dataset"),
                           "eval_dataset")


def build_trainer(values: dict[str, Any] | _Run):
    """An RLTrainer from merged run settings (see :func:`load_run_config`) or a checked run.

    Args:
        values: settings, or the result of :func:`check_run`.

    Returns:
        RLTrainer.
    """
    from torchforge.trainer.trainer import RLTrainer

    run = values if isinstance(values, _Run) else check_run(values)
    if run.model is None:
        return RLTrainer(config=run.config, distributed_config=run.distributed, environment_factory=run.environment,
                         eval_dataset=run.eval_rows)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars: the command prints its own summary
    reward_functions = run.reward_functions
    # None: the environment's rows; a JSONL file's rows were read by check_run
    train_dataset = run.train_rows
    if train_dataset is None and run.dataset is not None:
        train_dataset = read_dataset(run.dataset[0], split=run.dataset[1])
    processor = None
    try:
        if run.vision:  # a vision-language model and its processor (torchforge.trainer.vision_task)
            from transformers import AutoModelForImageTextToText

            from torchforge.loop.vision import load_processor

            model = AutoModelForImageTextToText.from_pretrained(run.model)
            processor = load_processor(run.model)
            tokenizer = processor.tokenizer
        else:
            model = AutoModelForCausalLM.from_pretrained(run.model)
            tokenizer = AutoTokenizer.from_pretrained(run.model)
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise InvalidArgumentError(f"model {run.model!r} could not be loaded: {first}") from error
    return RLTrainer(
        model=model, tokenizer=tokenizer, config=run.config, reward_functions=reward_functions,
        train_dataset=train_dataset, eval_dataset=run.eval_rows, distributed_config=run.distributed,
        environment_factory=run.environment, processor=processor,
    )


# --- the commands ------------------------------------------------------------------------

def _count(flag: str, value: str | None, default: int, *, low: int = 1) -> int:
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low:
        raise InvalidArgumentError(f"{flag} {value}; expected a whole number >= {low}")
    return number


def _launch_settings(args: argparse.Namespace) -> dict[str, Any]:
    nproc = _count("--nproc", args.nproc, 1)
    nnodes = _count("--nnodes", args.nnodes, 1)
    node_rank = _count("--node-rank", args.node_rank, 0, low=0)
    port = _count("--master-port", args.master_port, 29500)
    if nnodes == 1 and (args.node_rank is not None or args.master_addr is not None or args.master_port is not None):
        raise InvalidArgumentError("--node-rank / --master-addr / --master-port without --nnodes N (N > 1); "
                                   "expected --nnodes too")
    if node_rank >= nnodes:
        raise InvalidArgumentError(f"--node-rank {node_rank} with --nnodes {nnodes}; expected 0 <= node rank < {nnodes}")
    if nnodes > 1 and not args.master_addr:
        raise InvalidArgumentError(f"--nnodes {nnodes} without --master-addr; expected the address of node 0 "
                                   "(the same on every node)")
    if port > 65535:
        raise InvalidArgumentError(f"--master-port {port}; expected a port number in [1, 65535]")
    import torch

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise InvalidArgumentError(f"--nproc {nproc} but this machine has {torch.cuda.device_count()} GPU(s); "
                                   "expected at most one process per GPU")
    return dict(nproc=nproc, nnodes=nnodes, node_rank=node_rank, master_addr=args.master_addr, master_port=port)


def _summary_lines(trainer: Any, summary: dict[str, Any], start: int) -> tuple[str, float]:
    """The end-of-run summary, over every step of the run (metrics.jsonl), resumed or not."""
    from torchforge.trainer.tracking import read_metrics

    rows = read_metrics(trainer.output_dir) if Path(summary["metrics"]).exists() else []

    def first_last(key: str) -> tuple[float, float]:
        values = [r[key] for r in rows if key in r and not math.isnan(r[key])]
        if not values:
            return math.nan, math.nan
        window = max(1, len(values) // 10)
        return sum(values[:window]) / window, sum(values[-window:]) / window

    reward = first_last("reward")
    clipped = first_last("completions/clipped_ratio")
    resumed = f", {summary['steps'] - start} of them now, resumed from step {start}" if start else ""
    return (
        f"\ntrained {summary['steps']} steps ({trainer.algorithm.name}{resumed})\n"
        f"  reward      {reward[0]:.3f} -> {reward[1]:.3f} (mean of the first and last 10% of the run's steps)\n"
        f"  clipped     {clipped[0]:.3f} -> {clipped[1]:.3f} (completions/clipped_ratio: the share that hit "
        "max_completion_length without stopping)\n"
        f"  metrics     {summary['metrics']}  (TensorBoard: {trainer.output_dir / 'tensorboard'})\n"
        f"  checkpoint  {summary['checkpoint']}  (continue with --resume)\n"
        f"  final model {summary['final_model']}\n"
        f"  plot        {summary['plot']}"
    ), reward[1]


def _complete(output_dir: Any, total_steps: int) -> str | None:
    step = last_checkpoint_step(output_dir)
    if step is not None and step >= total_steps:
        return (f"{output_dir} is complete: {step} of {total_steps} steps done; nothing to train "
                "(raise max_steps to train further)")
    return None


def _inside_torchrun() -> bool:
    """Whether this process is a worker that torchrun (or ``--nproc``) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def _train(args: argparse.Namespace) -> int:
    from torchforge.distributed import is_main_process, launch, teardown_distributed

    add_import_folders(args.config)
    launch_settings = _launch_settings(args)
    values = load_run_config(args.config, args.overrides)
    inside_torchrun = _inside_torchrun()
    processes = int(os.environ.get("WORLD_SIZE", "1")) if inside_torchrun else (
        launch_settings["nproc"] * launch_settings["nnodes"])
    run = check_run(values, num_processes=processes)
    output_dir = run.config.output_dir
    note = prepare_output_dir(output_dir, resume=args.resume, overwrite=args.overwrite)
    if note and (not inside_torchrun or int(os.environ.get("RANK", "0")) == 0):
        print(note, file=sys.stderr)
    if args.resume:
        run.config.resume = True
        if run.config.max_steps is not None and (done := _complete(output_dir, run.config.max_steps)):
            if not inside_torchrun or int(os.environ.get("RANK", "0")) == 0:
                print(done)
            return 0

    if (launch_settings["nproc"] > 1 or launch_settings["nnodes"] > 1) and not inside_torchrun:
        forwarded = ["train", *(["--config", args.config] if args.config else []),
                     *(["--resume"] if args.resume else []), *(["--debug"] if args.debug else []),
                     *args.overrides]  # --overwrite is done: the processes must not redo it
        try:
            return launch(launch_settings["nproc"], forwarded, nnodes=launch_settings["nnodes"],
                          node_rank=launch_settings["node_rank"], master_addr=launch_settings["master_addr"],
                          master_port=launch_settings["master_port"])
        except KeyboardInterrupt:
            from torchforge.trainer.tracking import read_metrics

            metrics = Path(output_dir) / "metrics.jsonl"
            step = read_metrics(output_dir)[-1]["step"] if metrics.exists() and metrics.read_text().strip() else 0
            raise RunInterrupted(step, last_checkpoint_step(output_dir)) from None

    trainer = None
    try:
        trainer = build_trainer(run)
        if args.resume and (done := _complete(output_dir, trainer.total_steps)):
            if is_main_process():
                print(done)
            return 0
        start = last_checkpoint_step(output_dir) or 0 if args.resume else 0
        main_process = is_main_process()
        summary = trainer.train()
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the steps
        step = trainer.step if trainer is not None else 0
        raise RunInterrupted(step, last_checkpoint_step(output_dir)) from None
    finally:
        if trainer is not None:
            trainer.close_engine()
        teardown_distributed()
    if main_process:
        text, reward_last = _summary_lines(trainer, summary, start)
        print(text)
        return 0 if not math.isnan(reward_last) else 1
    return 0


def _settings_help() -> str:
    from torchforge.trainer.config import RLConfig
    from torchforge.trainer.demo import demo_config

    demo, defaults = demo_config().to_dict(), RLConfig().to_dict()
    lines = ["settings (keys of the --config YAML, or key=value; default, and the demo's where it differs):"]
    for key, what in _RUN_KEYS.items():
        lines.append(f"  {key:<22} {what}")
    for field in dataclasses.fields(RLConfig):
        default = defaults[field.name]
        differs = f"   [demo: {demo[field.name]!r}]" if demo[field.name] != default else ""
        lines.append(f"  {field.name:<22} {default!r}{differs}")
    lines.append("each is described in RLConfig's docstring: python -c 'import torchforge; help(torchforge.RLConfig)'")
    lines.append("policy_loss values (the loss each calls, the settings it reads):")
    for entry in POLICY_LOSS_REGISTRY.values():
        settings = ", ".join(dict.fromkeys(entry.settings.values())) or "none"
        lines.append(f"  {entry.name:<22} {entry.summary}: {entry.call()}; settings: {settings}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchforge", description="RL post-training of language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train", help="train (no arguments: the embedded demo)", epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train the embedded demo (no settings) or a model given by `model`, `dataset` and "
                    "`reward_functions`.")
    train.add_argument("--config", help="a YAML file of settings")
    train.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="delete the run already in output_dir (config, metrics, checkpoints, final model) first")
    train.add_argument("--debug", action="store_true", help="print full tracebacks")
    train.add_argument("--nproc", metavar="N", help="processes to launch on this machine (torch.distributed.run)")
    train.add_argument("--nnodes", metavar="N", help="machines in the run; run the same command on each")
    train.add_argument("--node-rank", metavar="R", help="this machine's rank in [0, nnodes)")
    train.add_argument("--master-addr", metavar="HOST", help="address of node 0 (the same on every node)")
    train.add_argument("--master-port", metavar="P", help="a free port on node 0 (default 29500)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="settings that override the file")
    plot = commands.add_parser("plot", help="draw a run's curves to RUN_DIR/curves.png")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="PNG path")
    add_eval_parser(commands)
    return parser


def _reward_cause(error: BaseException) -> RewardRaised | None:
    seen = error
    while seen is not None:
        if isinstance(seen, RewardRaised):
            return seen
        seen = seen.__cause__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchforge`` command.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 done, 1 the run failed, 2 a mistake in the settings, 130 Ctrl-C.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "eval":
        return eval_main(args)
    if args.command == "plot":
        from torchforge.trainer.plot import plot_run

        print(plot_run(args.run_dir, args.out))
        return 0
    try:
        return _train(args)
    except InvalidArgumentError as error:
        if args.debug:
            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RunInterrupted as stop:
        print(str(stop), file=sys.stderr)
        return _INTERRUPTED
    except KeyboardInterrupt:  # before the run started
        print("stopped before the first step", file=sys.stderr)
        return _INTERRUPTED
    except TorchforgeError as error:
        if args.debug:
            traceback.print_exc()
        cause = _reward_cause(error)
        hint = "" if args.debug else " (--debug prints the traceback)"
        print(f"error: {cause if cause is not None else error}{hint}", file=sys.stderr)
        return 1


def run() -> NoReturn:
    """The ``torchforge`` command as a process (``python -m torchforge``, the installed
    script): :func:`main`, whose status is the exit status.

    A worker of a distributed run (started by ``torchrun`` or ``--nproc``) ends through
    :func:`torchforge.distributed.end_process`, so that a shutdown abort in gloo's threads
    after the run is done cannot turn its status into a failure.

    Args:
        None.

    Returns:
        Never.
    """
    from torchforge.distributed import end_process

    code = main()
    if _inside_torchrun():
        end_process(code)
    sys.exit(code)
