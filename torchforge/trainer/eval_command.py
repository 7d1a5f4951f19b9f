"""``torchforge eval``: a saved model scored on a dataset with a run's settings.

``torchforge eval --model DIR --dataset FILE [--config run.yaml] [--reward-function PATH ...] [key=value ...]``
loads a saved model (a full Hugging Face folder, or a LoRA adapter folder: ``adapter_config.json``),
samples ``num_eval_generations`` completions and a greedy one for every row of the dataset, scores
them with the reward functions and prints the metrics of :func:`torchforge.loop.evaluate` as
one JSON line: :func:`torchforge.trainer.evaluation.evaluate_dataset`, which also scores
``RLTrainer``'s ``eval_dataset``. The settings are those of ``torchforge train``, read by
:mod:`torchforge.trainer.run_config` (a run's YAML works as is); the ones used are
``num_eval_generations``, ``eval_correct_threshold``, ``max_completion_length``,
``temperature``, ``top_p``, ``top_k``, ``stop_token_ids``, ``reward_weights`` and ``seed``.

A vision-language model folder (its ``config.json`` has a ``vision_config``) loads with
``AutoModelForImageTextToText`` and its processor, and the rows' images (paths relative to
the JSONL file) are rendered as in training; every image file is checked before the model loads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from torchforge.errors import InvalidArgumentError
from torchforge.loop.engines import ENGINES, make_engine
from torchforge.loop.rewards import close_rewards, guard_rewards
from torchforge.trainer.evaluation import evaluate_dataset
from torchforge.trainer.run_config import (
    add_import_folders,
    load_run_config,
    read_dataset,
    reward_functions_from_settings,
)

__all__ = ["add_eval_parser", "eval_main"]


def add_eval_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to the ``torchforge`` command's subparsers.

    Args:
        commands: the result of ``ArgumentParser.add_subparsers``.

    Returns:
        The ``eval`` parser.
    """
    parser = commands.add_parser(
        "eval", help="evaluate a saved model (full or LoRA folder) on a dataset: reward, pass@1, pass@k",
        description="Sample num_eval_generations completions and a greedy one per row, score them with the "
                    "reward functions, print the eval/... metrics as one JSON line.")
    parser.add_argument("--model", required=True, help="a Hugging Face model folder, or a LoRA adapter folder")
    parser.add_argument("--dataset", required=True, help="a JSONL file or a datasets folder of rows with a 'prompt'")
    parser.add_argument("--config", help="a YAML file of settings (a run's config.yaml works)")
    parser.add_argument("--reward-function", dest="reward_functions", action="append", metavar="PATH",
                        help="a dotted import path; repeat for several (default: the config's reward_functions)")
    parser.add_argument("--out", help="also write the metrics to this JSON file")
    parser.add_argument("--engine", choices=ENGINES, help="what samples the completions (default the config's "
                        "engine, else hf); engine_args=... in the overrides or --config set its arguments")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="settings that override the file")
    return parser


def _read_rows(dataset: str, model_dir: str, config: Any) -> tuple[Any, bool]:
    """The dataset's rows (a JSONL file's image paths resolved from its folder) and whether the
    model is a vision-language model: one-line errors for a missing image file, images for a
    text-only model, a VLM without its processor or with an engine that takes no images."""
    from torchforge.trainer.vision_task import check_vision_run, resolve_image_paths

    from torchforge.trainer.lora import adapter_base_model, is_adapter_folder

    rows = read_dataset(dataset)
    if Path(dataset).expanduser().is_file():
        rows = resolve_image_paths(rows, Path(dataset).expanduser().parent)
    path = Path(model_dir).expanduser()
    model_folder = adapter_base_model(path) if is_adapter_folder(path) else model_dir  # an adapter: its base's config
    vlm = check_vision_run(model_folder, None, [(f"dataset {dataset}", rows)], fn="torchforge eval")
    if vlm and config.engine != "hf":
        raise InvalidArgumentError(f"torchforge eval: engine={config.engine!r} with a vision-language model: only 'hf' "
                                   "samples from images here; expected engine='hf'")
    return rows, vlm


def _load(model_dir: str, *, vision: bool = False) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, processor)``; the processor is None for a text model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchforge.trainer.lora import adapter_base_model, is_adapter_folder, load_adapter_model

    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise InvalidArgumentError(f"torchforge eval: --model {model_dir!r} is not a folder; expected a saved model")
    adapter = is_adapter_folder(path)
    if vision:
        from transformers import AutoModelForImageTextToText

        from torchforge.loop.vision import is_processor_folder, load_processor

        # a LoRA run's final/ holds the processor beside the adapters; else the base model's
        folder = path if not adapter or is_processor_folder(path) else adapter_base_model(path)
        processor = load_processor(str(folder))
        model = load_adapter_model(path) if adapter else AutoModelForImageTextToText.from_pretrained(path).eval()
        return model, processor.tokenizer, processor
    model = load_adapter_model(path) if adapter else AutoModelForCausalLM.from_pretrained(path)
    return model, AutoTokenizer.from_pretrained(path), None


def eval_main(args: argparse.Namespace) -> int:
    """Run ``torchforge eval``; returns the exit status (2 for a mistake in the settings).

    Args:
        args: the parsed ``eval`` arguments.

    Returns:
        0 on success, 2 on bad settings.
    """
    from torchforge.distributed import (
        init_distributed,
        is_main_process,
        teardown_distributed,
    )
    from torchforge.trainer.config import RLConfig

    add_import_folders(args.config)  # --reward-function / the config's paths, as torchforge train finds them
    try:
        values = load_run_config(args.config, args.overrides)
        paths = args.reward_functions or values.get("reward_functions")
        if not paths:
            raise InvalidArgumentError("torchforge eval: no reward functions; pass --reward-function PATH (repeatable) or "
                                       "reward_functions in --config")
        paths = [paths] if isinstance(paths, str) else list(paths)
        names = set(RLConfig.__dataclass_fields__)
        if args.engine is not None:
            values["engine"] = args.engine
        config = RLConfig.from_dict({k: v for k, v in values.items() if k in names})
        # the run's reward_timeout / reward_processes: a grader that hangs costs a sample, not the eval
        reward_functions = guard_rewards(reward_functions_from_settings(paths), timeout=config.reward_timeout,
                                         processes=config.reward_processes, failure_reward=config.reward_on_failure)
        dataset, vision = _read_rows(args.dataset, args.model, config)
        model, tokenizer, processor = _load(args.model, vision=vision)
    except InvalidArgumentError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    init_distributed()
    try:
        if torch.cuda.is_available():
            model = model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
        engine = None
        if config.engine != "hf":
            from torchforge.trainer.lora import is_peft_model, merged_weights

            weights = merged_weights(model) if is_peft_model(model) else None
            engine = make_engine(config.engine, model, tokenizer, engine_args=config.engine_args, weights=weights)
        metrics = evaluate_dataset(model, tokenizer, dataset, reward_functions, config, engine=engine,
                                   processor=processor)
        if engine is not None and callable(getattr(engine, "close", None)):
            engine.close()
        main_process = is_main_process()
    finally:
        close_rewards(reward_functions)
        teardown_distributed()
    if main_process:
        print(json.dumps(metrics))
        if args.out:
            Path(args.out).write_text(json.dumps(metrics, indent=1) + "\n")
    return 0
