"""Evaluation of a dataset by a run's settings: the trainer's ``eval_dataset`` and ``torchforge eval``.

``torchforge eval --model DIR --dataset FILE [--config run.yaml] [--reward-function PATH ...] [key=value ...]``
loads a saved model (a full Hugging Face folder, or a LoRA adapter folder: ``adapter_config.json``),
samples ``num_eval_generations`` completions and a greedy one for every row of the dataset, scores
them with the reward functions and prints the metrics of :func:`torchforge.loop.evaluate` as
one JSON line. The settings are those of ``torchforge train`` (a run's YAML works as is); the
ones used are ``num_eval_generations``, ``eval_correct_threshold``, ``max_completion_length``,
``temperature``, ``top_p``, ``top_k``, ``stop_token_ids``, ``reward_weights`` and ``seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from torchforge.errors import InvalidArgumentError
from torchforge.loop.engines import ENGINES, make_engine
from torchforge.loop.evaluate import evaluate
from torchforge.loop.rewards import close_rewards, guard_rewards
from torchforge.loop.rollout import completion_stop_ids

__all__ = ["add_eval_parser", "eval_main", "evaluate_dataset"]


def render_prompt(tokenizer: Any, prompt: Any) -> str:
    """A row's prompt as text: a string as is, chat messages through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidArgumentError("evaluate: a prompt is a list of chat messages but the tokenizer has no "
                                   "chat_template; expected a string prompt, or a tokenizer with a chat template")
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def evaluate_dataset(model: Any, tokenizer: Any, dataset: Any, reward_functions: Sequence[Callable], config: Any, *,
                     render: Callable[[Any], str] | None = None, stop_token_ids: Sequence[int] | None = None,
                     engine: Any = None) -> dict[str, float]:
    """:func:`torchforge.loop.evaluate` over a dataset's rows with an ``RLConfig``'s settings.

    Args:
        model: the policy (plain, DDP or FSDP2; every process calls this).
        tokenizer: its tokenizer.
        dataset: rows with a ``"prompt"``; the other fields reach the reward functions.
        reward_functions: RewardFunction objects and / or TRL-style callables.
        config: an ``RLConfig`` (``num_eval_generations``, ``eval_correct_threshold``,
            ``max_completion_length``, sampling settings, ``reward_weights``, ``seed``).
        render: prompt -> text (default: :func:`render_prompt` with ``tokenizer``).
        stop_token_ids: ids that end a completion (default the config's and eos).
        engine: the generation engine (default Hugging Face ``generate`` on ``model``).

    Returns:
        The ``eval/...`` metrics, the same on every process.
    """
    rows = [dict(dataset[i]) for i in range(len(dataset))]
    if not rows or "prompt" not in rows[0]:
        raise InvalidArgumentError(f"evaluate: the eval dataset has {len(rows)} rows"
                                   f"{' with fields ' + str(sorted(rows[0])) if rows else ''}; expected rows with a "
                                   "'prompt' field")
    render = render or (lambda prompt: render_prompt(tokenizer, prompt))
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
    return evaluate(
        model, tokenizer, [render(row["prompt"]) for row in rows], reward_functions,
        num_generations=config.num_eval_generations, max_new_tokens=config.max_completion_length,
        columns=columns, weights=config.reward_weights, correct_threshold=config.eval_correct_threshold,
        temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
        stop_token_ids=stop_token_ids or completion_stop_ids(tokenizer, model, config.stop_token_ids), seed=config.seed,
        engine=engine,
    )


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


def _load(model_dir: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchforge.trainer.lora import is_adapter_folder, load_adapter_model

    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise InvalidArgumentError(f"torchforge eval: --model {model_dir!r} is not a folder; expected a saved model")
    model = load_adapter_model(path) if is_adapter_folder(path) else AutoModelForCausalLM.from_pretrained(path)
    return model, AutoTokenizer.from_pretrained(path)


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
    from torchforge.trainer.cli import _dataset, _reward_functions, load_run_config
    from torchforge.trainer.config import RLConfig

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
        reward_functions = guard_rewards(_reward_functions(paths), timeout=config.reward_timeout,
                                         processes=config.reward_processes, failure_reward=config.reward_on_failure)
        dataset = _dataset(args.dataset)
        model, tokenizer = _load(args.model)
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
        metrics = evaluate_dataset(model, tokenizer, dataset, reward_functions, config, engine=engine)
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
