"""How ``RLTrainer`` and ``torchforge train`` take a vision-language model (VLM) and an image dataset.

A dataset row carries its images in ``images`` (PIL images, paths, ``file://`` URLs; a
``datasets`` Image feature), its prompt a string or chat messages whose ``{"type": "image"}``
parts stand where the images go (:func:`torchforge.loop.vision.row_images`). The processor
renders the prompt and expands the image tokens; the reward functions receive the PIL images
as their ``images`` keyword. The vision tower (and projector) is frozen unless
``RLConfig.train_vision_tower``; with LoRA it then gets no adapters either.

Multi-turn environments take images too (the row's for the prompt, ``StepResult.images``
for an observation: :func:`torchforge.loop.rollout_episodes`), and so does evaluation
(``eval_dataset``, ``torchforge eval``: the rows rendered as for training, :func:`row_prompt_and_images`).

What is checked here, in one line each and before any step (the CLI checks the model folder
and the image files before the model loads, :func:`check_vision_run`): images for a
text-only model, a VLM without a processor, ``padding_free``, an engine that does not take
images (vLLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from torchforge.errors import InvalidArgumentError
from torchforge.loop.vision import (
    check_dataset_images,
    check_vision_model_folder,
    is_processor,
    is_vision_config,
    is_vision_tower_name,
    row_images,
    vision_tower_parameters,
)

__all__ = ["VisionTask", "vision_task", "check_vision_run", "chat_with_images", "row_prompt_and_images",
           "resolve_image_paths", "freeze_vision_tower", "lora_without_vision_tower"]


class VisionTask:
    """A run's VLM parts: the processor (None for a text run).

    Args:
        processor: the model's processor, or None.

    Returns:
        The record; ``bool(task)`` is whether the run has a VLM.
    """

    def __init__(self, processor: Any = None) -> None:
        self.processor = processor

    def __bool__(self) -> bool:
        return self.processor is not None


def _refusals(config: Any, *, fn: str) -> None:
    if config.padding_free:
        raise InvalidArgumentError(f"{fn}: padding_free=True with a vision-language model: its image inputs do not "
                                   "pack exactly; expected padding_free=False")
    if config.engine != "hf":
        raise InvalidArgumentError(f"{fn}: engine={config.engine!r} with a vision-language model: only 'hf' samples "
                                   "from images here; expected engine='hf'")


def _has_images(rows: Any, name: str) -> bool:
    """Whether a dataset's rows carry images (a ``datasets.Dataset``: its columns, no image decoded)."""
    if rows is None:
        return False
    if hasattr(rows, "column_names"):
        return bool({"images", "image"} & set(rows.column_names))
    return check_dataset_images(rows, name=name)


def vision_task(model: nn.Module, tokenizer: Any, processor: Any, train_dataset: Any, config: Any, *,
                eval_dataset: Any = None) -> tuple[Any, VisionTask]:
    """Check a trainer's model, tokenizer / processor and rows for images; the tokenizer to use and the task.

    Args:
        model: the policy (a Hugging Face model).
        tokenizer: its tokenizer, or its processor (then the processor's tokenizer is used).
        processor: the processor, or None.
        train_dataset: the rows.
        config: the run's RLConfig.
        eval_dataset: the evaluation rows, or None.

    Returns:
        ``(tokenizer, VisionTask)``.
    """
    fn = "RLTrainer"
    if processor is None and is_processor(tokenizer):
        processor = tokenizer
    if processor is not None and not is_processor(processor):
        raise InvalidArgumentError(f"{fn}: processor is a {type(processor).__name__}; expected the model's "
                                   "processor (AutoProcessor: a tokenizer and an image processor)")
    tokenizer = processor.tokenizer if processor is not None and (tokenizer is None or tokenizer is processor) \
        else tokenizer
    vlm = is_vision_config(getattr(model, "config", None))
    for name, rows in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if _has_images(rows, name) and not vlm:
            raise InvalidArgumentError(f"{fn}: the {name}'s rows have images but the model "
                                       f"({type(model).__name__}) is text-only; expected a vision-language model")
    if not vlm:
        return tokenizer, VisionTask()
    if processor is None:
        raise InvalidArgumentError(f"{fn}: {type(model).__name__} is a vision-language model but no processor was "
                                   "given; expected RLTrainer(processor=AutoProcessor.from_pretrained(...))")
    _refusals(config, fn=fn)
    return tokenizer, VisionTask(processor)


def check_vision_run(model: str, config: Any, datasets: Any = (), *, fn: str = "torchforge train") -> bool:
    """The CLI's checks before the model loads: the image files of the datasets exist, the
    model takes images, a VLM folder has its processor, the settings suit a VLM.

    Args:
        model: the model folder (a hub id is not read: False).
        config: the run's RLConfig (None: no settings to check, ``torchforge eval``).
        datasets: ``(name, rows)`` pairs, the rows already read (a JSONL file's, their image
            paths resolved: :func:`resolve_image_paths`; a ``datasets.Dataset``; or None).
        fn: the command errors name.

    Returns:
        Whether the model is a VLM.
    """
    has_images = False
    for name, rows in datasets:
        has_images = _has_images(rows, name) or has_images  # every dataset's files checked
    if not Path(model).expanduser().is_dir():
        return False
    vlm = check_vision_model_folder(str(Path(model).expanduser()), has_images=has_images)
    if vlm and config is not None:
        _refusals(config, fn=fn)
    return vlm


def resolve_image_paths(rows: Any, base: str | Path) -> Any:
    """A JSONL dataset's rows with relative image paths (``images``, ``image``) made absolute (from the file's folder).

    Args:
        rows: a list of dicts.
        base: the dataset file's folder.

    Returns:
        The rows (new dicts where a path changed).
    """
    if not isinstance(rows, list):
        return rows

    def resolve(item: Any) -> Any:
        if isinstance(item, str) and "://" not in item and not Path(item).expanduser().is_absolute():
            return str(Path(base) / item)
        return item

    out = []
    for row in rows:
        for key in ("images", "image"):
            images = row.get(key) if isinstance(row, dict) else None
            if isinstance(images, (str, list)):
                row = {**row, key: [resolve(i) for i in images] if isinstance(images, list) else resolve(images)}
        out.append(row)
    return out


def chat_with_images(prompt: Any, n_images: int) -> Any:
    """A row's prompt as chat messages with its images in place: chat messages as they are
    (their ``{"type": "image"}`` parts); a string as one user message, the images first (as TRL does).

    Args:
        prompt: a string or chat messages.
        n_images: the row's number of images.

    Returns:
        Chat messages (a string as it is when it has no images).

    Example:
        >>> chat_with_images("what colour ?", 1)
        [{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': 'what colour ?'}]}]
    """
    if not isinstance(prompt, str) or n_images == 0:
        return prompt
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(n_images)), {"type": "text", "text": prompt}]}]


def row_prompt_and_images(processor: Any, row: dict[str, Any], where: str) -> tuple[str, list[Any]]:
    """A row's rendered prompt (the processor's chat template) and its PIL images, for training
    and evaluation alike.

    Args:
        processor: the model's processor.
        row: a dataset row (``prompt``, and ``images`` or ``image``).
        where: what an error names (``dataset row 3``).

    Returns:
        ``(prompt text, PIL images)``.
    """
    from torchforge.trainer.rollouts import render_prompt

    images = row_images(row, where=where)
    return render_prompt(processor, chat_with_images(row["prompt"], len(images))), images


def freeze_vision_tower(model: nn.Module) -> list[str]:
    """Freeze a VLM's vision tower and projector (``requires_grad_(False)``); their names.

    Args:
        model: the VLM (before LoRA and sharding).

    Returns:
        The frozen parameters' names.
    """
    names = set(vision_tower_parameters(model))
    for name, parameter in model.named_parameters():
        if name in names:
            parameter.requires_grad_(False)
    return sorted(names)


def lora_without_vision_tower(model: nn.Module, peft_config: Any) -> Any:
    """A LoRA config that leaves a VLM's vision tower and projector without adapters
    (``exclude_modules``: the vision modules' names).

    Args:
        model: the VLM.
        peft_config: a ``peft.LoraConfig`` or a ``lora:`` dict.

    Returns:
        The ``peft.LoraConfig`` (a copy).
    """
    import copy

    from torchforge.trainer.lora import lora_config

    config = copy.deepcopy(lora_config(peft_config) if isinstance(peft_config, dict) else peft_config)
    excluded = [name for name, _ in model.named_modules() if name and is_vision_tower_name(name)]
    config.exclude_modules = sorted(set(excluded) | set(config.exclude_modules or []))
    return config
