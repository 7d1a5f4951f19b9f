"""Evaluation of a dataset with an ``RLConfig``'s settings: ``RLTrainer.evaluate`` and ``torchforge eval``.

:func:`evaluate_dataset` renders each row's prompt, passes the row's other fields to the
reward functions and calls :func:`torchforge.loop.evaluate` with the config's evaluation
and sampling settings (``num_eval_generations``, ``eval_correct_threshold``,
``max_completion_length``, ``temperature``, ``top_p``, ``top_k``, ``stop_token_ids``,
``reward_weights``, ``seed``). With a vision-language model's processor the rows are
rendered as for training (:func:`torchforge.trainer.vision_task.row_prompt_and_images`):
the images go to the model, and the reward functions get them as ``images``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torchforge.errors import InvalidArgumentError
from torchforge.loop.evaluate import evaluate
from torchforge.loop.rollout import completion_stop_ids
from torchforge.trainer.rollouts import render_prompt

__all__ = ["evaluate_dataset", "check_eval_rows"]


def check_eval_rows(dataset: Any, caller: str) -> Any:
    """``dataset`` itself when it has rows with a ``"prompt"``; a one-line error naming ``caller`` otherwise."""
    size = len(dataset) if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__") else None
    if size is None:
        raise InvalidArgumentError(f"{caller}: the eval dataset is a {type(dataset).__name__}; expected a sequence "
                                   "of rows (dicts) or a datasets.Dataset")
    first = dict(dataset[0]) if size else {}
    if "prompt" not in first:
        raise InvalidArgumentError(f"{caller}: the eval dataset has {size} rows"
                                   f"{' with fields ' + str(sorted(first)) if size else ''}; expected rows with a "
                                   "'prompt' field")
    return dataset


def evaluate_dataset(model: Any, tokenizer: Any, dataset: Any, reward_functions: Sequence[Callable], config: Any, *,
                     render: Callable[[Any], str] | None = None, stop_token_ids: Sequence[int] | None = None,
                     engine: Any = None, processor: Any = None) -> dict[str, float]:
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
        processor: a vision-language model's processor: each row's prompt and images through
            it, as in training (``render`` is then not used); None for a text model.

    Returns:
        The ``eval/...`` metrics, the same on every process.

    Example:
        >>> from torchforge.trainer.config import RLConfig
        >>> from torchforge.trainer.demo import CopyDigitsReward, char_tokenizer, copy_digits_dataset, tiny_llama
        >>> tokenizer = char_tokenizer()
        >>> config = RLConfig(num_eval_generations=2, max_completion_length=4)
        >>> out = evaluate_dataset(tiny_llama(tokenizer), tokenizer, copy_digits_dataset(3), [CopyDigitsReward()], config)
        >>> out["eval/num_prompts"]
        3.0
    """
    dataset = check_eval_rows(dataset, "evaluate")
    rows = [dict(dataset[i]) for i in range(len(dataset))]
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
    images = None
    if processor is not None:  # the rows as training renders them; the reward functions see PIL images
        from torchforge.trainer.vision_task import row_prompt_and_images

        rendered = [row_prompt_and_images(processor, row, f"eval_dataset row {i}") for i, row in enumerate(rows)]
        prompts, images = [p for p, _ in rendered], [im for _, im in rendered]
        columns.pop("image", None)
        columns["images"] = images
    else:
        render = render or (lambda prompt: render_prompt(tokenizer, prompt, caller="evaluate"))
        prompts = [render(row["prompt"]) for row in rows]
    return evaluate(
        model, tokenizer, prompts, reward_functions,
        num_generations=config.num_eval_generations, max_new_tokens=config.max_completion_length,
        columns=columns, weights=config.reward_weights, correct_threshold=config.eval_correct_threshold,
        temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
        stop_token_ids=stop_token_ids or completion_stop_ids(tokenizer, model, config.stop_token_ids), seed=config.seed,
        engine=engine, images=images, processor=processor,
    )
