"""LLM-as-judge: a causal LM asked, through the generation-engine contract, to grade each completion.

``r_b = parse(judge(template.format(prompt=prompt_b, completion=completion_b, **columns_b)))``:
the judge's prompt is the template filled with the sample (and any dataset column it names,
e.g. ``{answer}``), rendered with the judge tokenizer's chat template as one user message
when it has one; the judge answers greedily (``top_k=1``: the same verdict every time) through
a :class:`torchforge.loop.engines.GenerationEngine` (:class:`~torchforge.loop.engines.HFEngine`
over a local model by default, or any engine given, e.g. a ``vllm serve`` one); the reward
is the first verdict word of ``verdicts`` found in the answer, else the first number in it.
"""

from __future__ import annotations

import os
import re
import string
from typing import Any, Sequence

import torch

from torchforge.errors import InvalidArgumentError
from torchforge.loop.rewards import RewardFunction
from torchforge.rewards.reward_model import checked_dtype, checked_model_folder, default_device

__all__ = ["LLMJudge", "DEFAULT_JUDGE_TEMPLATE"]

#: the default question: a score from 0 to 10, the first number of the answer
DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the response answers the request, from 0 (useless) to 10 (perfect). "
    "Reply with the number only.\n\nRequest:\n{prompt}\n\nResponse:\n{completion}\n\nScore:"
)
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class LLMJudge(RewardFunction):
    """Scores each completion by asking a judge LM; the verdict parsed from its answer.

    The judge answers every sample of a call in batches of ``batch_size`` requests, with
    greedy decoding (``top_k=1``) of at most ``max_new_tokens`` tokens, under
    ``torch.no_grad`` (the engine's), on its own device and dtype; loaded on first use (or
    :meth:`load`), once per training process. An answer without a verdict gets
    ``unparsed_reward`` (None: "not applicable", left out of the group statistics).

    Args:
        model: a local causal-LM folder, or a loaded causal LM (then ``tokenizer`` too); None
            with ``engine``.
        tokenizer: the judge's tokenizer; default: the folder's.
        engine: a :class:`~torchforge.loop.engines.GenerationEngine` that holds the judge
            (then ``model`` may be None, ``tokenizer`` is needed); default an ``HFEngine``.
        template: the judge's prompt: a format string with ``{completion}``, and optionally
            ``{prompt}`` and dataset columns (``{answer}``).
        verdicts: words -> reward (e.g. ``{"yes": 1.0, "no": 0.0}``): the earliest one in the
            answer (case-insensitive, whole words) is the reward; None: the first number.
        chat_template: render the prompt with the judge tokenizer's chat template (None:
            when it has one).
        name: the metric name (``rewards/<name>/mean``); default ``"judge"``.
        weight: the weight in the combined reward.
        max_new_tokens: the length of the judge's answer.
        batch_size: requests per ``generate``.
        device, dtype: where and in what precision a loaded judge runs (default this
            process's accelerator, else the CPU; as saved).
        unparsed_reward: the reward of an answer without a verdict.
        seed: the seed of the requests (greedy decoding makes it matter only for ties).

    Returns:
        A reward function: ``fn(prompts=..., completions=..., **columns) -> list[float | None]``.

    Example:
        >>> from torchforge.loop.engines import Completion
        >>> from torchforge.loop.tiny_model import char_tokenizer
        >>> class Says7:  # a stand-in engine: always answers "7"
        ...     weights_version = 0
        ...     def generate(self, prompt_token_ids, *, seeds, settings):
        ...         return [Completion([11, 2], [0.0, 0.0], truncated=False, weights_version=0) for _ in seeds]
        ...     def update_weights(self, weights, *, version): pass
        >>> judge = LLMJudge(engine=Says7(), tokenizer=char_tokenizer(), template="{completion}=")
        >>> judge(prompts=["1=", "2="], completions=["1", "2"])
        [7.0, 7.0]
    """

    name = "judge"
    in_process = True  # holds a model: scored here on whole batches, never in reward worker processes

    def __init__(self, model: str | os.PathLike | torch.nn.Module | None = None, tokenizer: Any = None, *,
                 engine: Any = None, template: str = DEFAULT_JUDGE_TEMPLATE, verdicts: dict[str, float] | None = None,
                 chat_template: bool | None = None, name: str | None = None, weight: float = 1.0,
                 max_new_tokens: int = 16, batch_size: int = 16, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, unparsed_reward: float | None = None, seed: int = 0) -> None:
        fn = "LLMJudge"
        for key, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{fn}: {key}={value!r}; expected an int >= 1")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise InvalidArgumentError(f"{fn}: weight={weight!r}; expected a number")
        if unparsed_reward is not None and (isinstance(unparsed_reward, bool)
                                            or not isinstance(unparsed_reward, (int, float))):
            raise InvalidArgumentError(f"{fn}: unparsed_reward={unparsed_reward!r}; expected a number or None")
        if name is not None and not (isinstance(name, str) and name):
            raise InvalidArgumentError(f"{fn}: name={name!r}; expected a non-empty string or None")
        if chat_template is not None and not isinstance(chat_template, bool):
            raise InvalidArgumentError(f"{fn}: chat_template={chat_template!r}; expected True, False or None")
        self.fields = self._checked_template(fn, template)
        if verdicts is not None:
            if not (isinstance(verdicts, dict) and verdicts and all(
                    isinstance(k, str) and k.strip() and not isinstance(v, bool) and isinstance(v, (int, float))
                    for k, v in verdicts.items())):
                raise InvalidArgumentError(f"{fn}: verdicts={verdicts!r}; expected a non-empty mapping of words "
                                           "to rewards, e.g. {'yes': 1.0, 'no': 0.0}, or None (the first number)")
            verdicts = {k.strip().lower(): float(v) for k, v in verdicts.items()}
        self.template, self.verdicts, self.chat_template = template, verdicts, chat_template
        self.max_new_tokens, self.batch_size, self.seed = max_new_tokens, batch_size, int(seed)
        self.unparsed_reward = None if unparsed_reward is None else float(unparsed_reward)
        self.weight = float(weight)
        if name is not None:
            self.name = name
        self.dtype = checked_dtype(fn, dtype)
        self.device = torch.device(device) if device is not None else None
        self.engine, self.model, self.tokenizer, self.path = engine, None, tokenizer, None
        if engine is not None:
            from torchforge.loop.engines import GenerationEngine

            if not isinstance(engine, GenerationEngine):
                raise InvalidArgumentError(f"{fn}: engine is a {type(engine).__name__}; expected a GenerationEngine "
                                           "(generate, update_weights, weights_version)")
            if tokenizer is None:
                raise InvalidArgumentError(f"{fn}: an engine needs the judge's tokenizer; pass tokenizer=")
        elif isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise InvalidArgumentError(f"{fn}: a loaded model needs its tokenizer; pass tokenizer=")
            self.model = model
        elif model is None:
            raise InvalidArgumentError(f"{fn}: no judge; expected a model folder, a loaded model or an engine=")
        else:
            self.path = checked_model_folder(fn, model)

    @staticmethod
    def _checked_template(fn: str, template: Any) -> list[str]:
        if not isinstance(template, str):
            raise InvalidArgumentError(f"{fn}: template is a {type(template).__name__}; expected a format string")
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
        except ValueError as error:
            raise InvalidArgumentError(f"{fn}: template={template!r} is not a format string ({error})") from None
        if "completion" not in fields or any(not f.isidentifier() for f in fields):
            raise InvalidArgumentError(f"{fn}: template={template!r} has fields {fields}; expected {{completion}} and "
                                       "optionally {prompt} and dataset columns, by name")
        return fields

    def load(self) -> Any:
        """The engine: the one given, or an ``HFEngine`` over the judge, loaded once (eval, no grad).

        Args:
            None.

        Returns:
            The :class:`~torchforge.loop.engines.GenerationEngine`.
        """
        if self.engine is not None:
            return self.engine
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from torchforge.loop.engines import HFEngine

        if self.model is None:
            kwargs = {"dtype": self.dtype} if self.dtype is not None else {"dtype": "auto"}
            self.model = AutoModelForCausalLM.from_pretrained(self.path, **kwargs)
            if self.tokenizer is None:
                self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = self.model.to(device=self.device or default_device(), **({"dtype": self.dtype} if self.dtype else {}))
        self.model.eval().requires_grad_(False)
        self.engine = HFEngine(self.model, pad_token_id=self.tokenizer.pad_token_id)
        return self.engine

    def prompts(self, prompts: Sequence[Any], completions: Sequence[str], columns: dict[str, Sequence[Any]]) -> list[str]:
        """The judge's prompts (after its chat template).

        Args:
            prompts: B prompts (strings; chat messages are joined as "role: content" lines).
            completions: B completions.
            columns: dataset columns, each B values; those the template names are filled in.

        Returns:
            B strings.
        """
        missing = [f for f in self.fields if f not in ("prompt", "completion") and f not in columns]
        if missing:
            raise InvalidArgumentError(f"LLMJudge {self.name!r}: the template names {missing}, which the samples do "
                                       f"not have; expected dataset columns among {sorted(columns)}")
        use_chat = self.chat_template if self.chat_template is not None else \
            getattr(self.tokenizer, "chat_template", None) is not None
        out = []
        for b, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            if not isinstance(prompt, str):
                prompt = "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
            text = self.template.format(prompt=prompt, completion=completion,
                                        **{f: columns[f][b] for f in self.fields if f in columns})
            if use_chat:
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                          add_generation_prompt=True)
            out.append(text)
        return out

    def parse(self, answer: str) -> float | None:
        """The reward of one answer: its earliest verdict word, else its first number, else ``unparsed_reward``.

        Args:
            answer: the judge's decoded answer.

        Returns:
            A float, or ``unparsed_reward``.
        """
        if self.verdicts is not None:
            found = [(m.start(), self.verdicts[word]) for word in self.verdicts
                     for m in [re.search(rf"(?<!\w){re.escape(word)}(?!\w)", answer.lower())] if m]
            return min(found)[1] if found else self.unparsed_reward
        number = _NUMBER.search(answer)
        return float(number.group()) if number else self.unparsed_reward

    def answers(self, texts: Sequence[str]) -> list[str]:
        """The judge's greedy answers to prompts (decoded, special tokens dropped).

        Args:
            texts: the judge's prompts.

        Returns:
            One answer per prompt.
        """
        from torchforge.loop.engines import SamplingSettings

        engine = self.load()
        stop = [i for i in (self.tokenizer.eos_token_id,) if i is not None]
        settings = SamplingSettings(max_new_tokens=self.max_new_tokens, top_k=1, stop_token_ids=tuple(stop or [0]))
        ids = [list(self.tokenizer(text, add_special_tokens=not self._chat())["input_ids"]) for text in texts]
        out: list[str] = []
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start:start + self.batch_size]
            seeds = [self.seed * 1_000_003 + start + k for k in range(len(chunk))]
            for completion in engine.generate(chunk, seeds=seeds, settings=settings):
                out.append(self.tokenizer.decode(completion.token_ids, skip_special_tokens=True))
        return out

    def _chat(self) -> bool:
        """Whether prompts went through the chat template (which writes its own special tokens)."""
        return self.chat_template if self.chat_template is not None else \
            getattr(self.tokenizer, "chat_template", None) is not None

    def __call__(self, *, prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> list[float | None]:
        self.load()  # the tokenizer of a judge folder comes with it
        return [self.parse(a) for a in self.answers(self.prompts(prompts, completions, columns))]

    def compute(self, completions: Sequence[str], prompts: Sequence[Any]) -> list[float | None]:
        return self(prompts=prompts, completions=completions)

    def __repr__(self) -> str:
        what = str(self.path) if self.path else type(self.engine or self.model).__name__
        return f"LLMJudge({what!r}, name={self.name!r})"
