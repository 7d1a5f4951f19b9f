"""A trained reward model as a reward function: a sequence classifier with one label.

``r_b = f_phi(text_b)``: the scalar head of an ``AutoModelForSequenceClassification`` (one
label) read at the last token of ``text_b = template.format(prompt=prompt_b,
completion=completion_b)``, or, for a prompt given as chat messages, of the conversation
``prompt_b + [{"role": "assistant", "content": completion_b}]`` rendered with the reward
model's own chat template. What TRL's ``reward_funcs=`` does with a reward model, and
OpenRLHF's / verl's reward-model workers, as a plain reward function: it has a weight,
``rewards/<name>/mean`` metrics and works next to any other reward function.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import RewardFunction

__all__ = ["RewardModel"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def default_device() -> torch.device:
    """This process's accelerator (``cuda:LOCAL_RANK``), else the CPU: where the trainer puts the policy."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def checked_dtype(fn: str, dtype: Any) -> torch.dtype | None:
    """``dtype`` as a torch dtype (names as in ``_DTYPES``), or None for the saved one."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise InvalidArgumentError(f"{fn}: dtype={dtype!r}; expected None (as saved), a torch.dtype or one of "
                               f"{sorted(_DTYPES)}")


def checked_model_folder(fn: str, path: Any) -> Path:
    """A local Hugging Face model folder (with config.json); never a hub name."""
    folder = Path(path).expanduser()
    if not folder.is_dir() or not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "is not a folder with config.json"
        raise InvalidArgumentError(f"{fn}: model {str(path)!r} {what}; expected a local Hugging Face model folder "
                                   "(save_pretrained's output)")
    return folder


class RewardModel(RewardFunction):
    """Scores each completion with a reward model: a local sequence classifier with one label.

    ``r_b = logits_b[0]`` of the classifier on ``text_b`` (the model's own forward, which
    reads its head at the last token that is not padding), for batches of ``batch_size``
    texts, right-padded (so every text keeps the positions it has alone), under
    ``torch.no_grad``, on the reward model's own ``device`` and ``dtype``. The model loads
    on first use (or :meth:`load`): constructing one only checks the folder and its config,
    so ``torchforge train`` can check its settings before any model loads.

    Under DDP / FSDP each training process scores its own completions with its own copy
    (loaded once per process); ``shard=True`` shards it over the processes with FSDP2
    (:func:`torchforge.distributed.shard`) instead, for a reward model too large to copy
    (every process then runs the same number of forwards, padding with a one-token text).

    Args:
        model: a local model folder (``AutoModelForSequenceClassification`` with
            ``num_labels=1``), or such a model already loaded (then ``tokenizer`` too).
        tokenizer: its tokenizer; default: the folder's.
        name: the metric name (``rewards/<name>/mean``); default ``"reward_model"``.
        weight: the weight in the combined reward.
        batch_size: texts per forward.
        device: where it runs; default this process's accelerator, else the CPU.
        dtype: e.g. ``"bfloat16"``; None: as saved.
        max_length: tokens kept per text, from the end (the completion is what is judged);
            None: all.
        template: the text of a string prompt and its completion, with ``{prompt}`` and
            ``{completion}``; default their concatenation (the conversation as the policy saw
            it, rendered by the policy's tokenizer).
        shard: shard the model with FSDP2 over the training processes.

    Returns:
        A reward function: ``fn(prompts=..., completions=...) -> list[float]``.

    Example:
        >>> import tempfile
        >>> from transformers import LlamaConfig, LlamaForSequenceClassification
        >>> from torchforge.loop.tiny_model import char_tokenizer
        >>> tokenizer = char_tokenizer()
        >>> config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     LlamaForSequenceClassification(config).save_pretrained(folder)
        ...     _ = tokenizer.save_pretrained(folder)
        ...     scores = RewardModel(folder)(prompts=["12=", "12="], completions=["12", "1"])
        >>> len(scores), type(scores[0]).__name__
        (2, 'float')
    """

    name = "reward_model"
    in_process = True  # a model: scored here on whole batches, never in reward worker processes

    def __init__(self, model: str | os.PathLike | torch.nn.Module, tokenizer: Any = None, *,
                 name: str | None = None, weight: float = 1.0, batch_size: int = 8,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 max_length: int | None = None, template: str = "{prompt}{completion}", shard: bool = False) -> None:
        fn = "RewardModel"
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError(f"{fn}: batch_size={batch_size!r}; expected an int >= 1")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
            raise InvalidArgumentError(f"{fn}: max_length={max_length!r}; expected an int >= 1 or None")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise InvalidArgumentError(f"{fn}: weight={weight!r}; expected a number")
        if name is not None and not (isinstance(name, str) and name):
            raise InvalidArgumentError(f"{fn}: name={name!r}; expected a non-empty string or None")
        if not isinstance(shard, bool):
            raise InvalidArgumentError(f"{fn}: shard={shard!r}; expected True or False")
        try:
            template.format(prompt="", completion="")
        except (AttributeError, KeyError, IndexError, ValueError) as error:
            raise InvalidArgumentError(f"{fn}: template={template!r} does not format with {{prompt}} and "
                                       f"{{completion}} ({type(error).__name__}: {error})") from None
        self.dtype = checked_dtype(fn, dtype)
        self.device = torch.device(device) if device is not None else None
        self.batch_size, self.max_length, self.template, self.shard = batch_size, max_length, template, shard
        self.weight = float(weight)
        if name is not None:
            self.name = name
        self.model: torch.nn.Module | None = None
        self.path: Path | None = None
        self.tokenizer = tokenizer
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise InvalidArgumentError(f"{fn}: a loaded model needs its tokenizer; pass tokenizer=")
            self._check_labels(fn, model.config)
            self.model = model
        else:
            from transformers import AutoConfig

            self.path = checked_model_folder(fn, model)
            self._check_labels(fn, AutoConfig.from_pretrained(self.path))

    @staticmethod
    def _check_labels(fn: str, config: Any) -> None:
        labels = getattr(config, "num_labels", None)
        if labels != 1:
            raise InvalidArgumentError(
                f"{fn}: the model has num_labels={labels}; expected a reward model with one label (a scalar score: "
                "AutoModelForSequenceClassification with num_labels=1)")

    def load(self) -> torch.nn.Module:
        """Load the model (once), move it to its device and dtype, shard it if asked; eval mode.

        Args:
            None.

        Returns:
            The model.
        """
        if self.model is not None and getattr(self, "_ready", False):
            return self.model
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self.model is None:
            kwargs = {"dtype": self.dtype} if self.dtype is not None else {"dtype": "auto"}
            self.model = AutoModelForSequenceClassification.from_pretrained(self.path, **kwargs)
            if self.tokenizer is None:
                self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        model = self.model.to(device=self.device or default_device(), **({"dtype": self.dtype} if self.dtype else {}))
        model.eval().requires_grad_(False)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if config.pad_token_id is None:  # the head reads the last non-pad token: pad with an id it knows
            config.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
                else self.tokenizer.eos_token_id
        self._pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        if self.shard:
            from torchforge.distributed import shard

            model = shard(model, strategy="fsdp")
        self.model, self._ready = model, True
        return model

    def texts(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[str]:
        """The texts the model scores: ``template`` for string prompts, the reward model's chat
        template for prompts given as messages.

        Args:
            prompts: B prompts (strings or lists of chat messages).
            completions: B completions.

        Returns:
            B strings.
        """
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, str):
                out.append(self.template.format(prompt=prompt, completion=completion))
                continue
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise InvalidArgumentError(f"RewardModel {self.name!r}: a prompt is a list of chat messages but "
                                           "the reward model's tokenizer has no chat_template; expected string prompts")
            messages = [*prompt, {"role": "assistant", "content": completion}]
            out.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return out

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """The model's score of each text.

        Args:
            texts: B strings.

        Returns:
            B floats.
        """
        model = self.load()
        device = next(model.parameters()).device if self.device is None else self.device
        ids = [list(row) for row in self.tokenizer(list(texts))["input_ids"]] if texts else []
        if self.max_length is not None:
            ids = [row[-self.max_length:] for row in ids]  # keep the end: the completion
        chunks = [ids[i:i + self.batch_size] for i in range(0, len(ids), self.batch_size)]
        if self.shard:  # FSDP: every process runs as many forwards as the busiest one
            from torchforge.distributed import reduce_metric_extrema

            most = int(reduce_metric_extrema({"forwards": float(len(chunks))}, {})["forwards"])
            extra = most - len(chunks)
            chunks += [[[1 if self._pad_id == 0 else 0]]] * extra  # one token that is not padding
            real = len(chunks) - extra
        else:
            real = len(chunks)
        scores: list[float] = []
        with torch.no_grad():
            for k, chunk in enumerate(chunks):
                width = max(len(row) for row in chunk)
                input_ids = torch.tensor([row + [self._pad_id] * (width - len(row)) for row in chunk], device=device)
                attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in chunk],
                                              device=device)
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
                if k < real:
                    scores.extend(logits[:, 0].float().tolist())
        return scores

    def __call__(self, *, prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> list[float]:
        return self.score_texts(self.texts(prompts, completions))

    def compute(self, completions: Sequence[str], prompts: Sequence[Any]) -> list[float]:
        return self.score_texts(self.texts(prompts, completions))

    def __repr__(self) -> str:
        return f"RewardModel({str(self.path) if self.path else type(self.model).__name__!r}, name={self.name!r})"


#: the YAML forms of ``reward_functions`` entries that name a model: key -> (class, its settings)
_SETTINGS_KINDS = ("reward_model", "judge")


def reward_from_settings(settings: dict[str, Any]) -> RewardFunction:
    """A reward function from a ``reward_functions:`` entry of a run config, checked without
    loading any model: ``{reward_model: DIR, name: rm, weight: 0.5, batch_size: 8, dtype:
    bfloat16, max_length: 2048, template: "...", device: cuda, shard: false}`` is a
    :class:`RewardModel`; ``{judge: DIR, ...}`` a :class:`torchforge.rewards.LLMJudge`.

    Args:
        settings: one mapping with exactly one of ``reward_model`` / ``judge`` (the model folder)
            and that class's keyword arguments.

    Returns:
        The reward function (its model loads on first use).

    Example:
        >>> reward_from_settings({"reward_model": "/nowhere"})
        Traceback (most recent call last):
        ...
        torchforge.errors.InvalidArgumentError: reward_functions: {reward_model: /nowhere}: RewardModel: model '/nowhere' does not exist; expected a local Hugging Face model folder (save_pretrained's output)
    """
    import difflib
    import inspect

    kinds = [k for k in _SETTINGS_KINDS if k in settings]
    if len(kinds) != 1:
        raise InvalidArgumentError(f"reward_functions: {settings!r} names {len(kinds)} of {list(_SETTINGS_KINDS)}; "
                                   "expected exactly one (the model folder), or a dotted import path")
    kind = kinds[0]
    if kind == "reward_model":
        cls: Any = RewardModel
    else:
        from torchforge.rewards.judge import LLMJudge as cls
    rest = {k: v for k, v in settings.items() if k != kind}
    where = f"reward_functions: {{{kind}: {settings[kind]}}}"
    accepted = [n for n, p in inspect.signature(cls.__init__).parameters.items()
                if p.kind is p.KEYWORD_ONLY]
    for key in rest:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InvalidArgumentError(f"{where}: unknown setting {key!r}{hint}; expected some of {accepted}")
    try:
        return cls(settings[kind], **rest)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{where}: {error}") from None
