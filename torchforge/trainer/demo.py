"""The embedded default task: a tiny Llama, a character tokenizer and a copy task, all local.

``torchforge train`` with no arguments trains on this, so that a fresh machine with no
model hub can run the whole pipeline on a CPU: 300 steps in about a minute on an idle 2-core
CPU (about 0.13 s a step; several times longer on a busy machine). Tests and notebooks use
the same pieces.

The task: the prompt is three digits and ``=`` (``"407="``); the completion should repeat
them (``"407"``) and stop. The reward gives 1/4 per digit in the right position and 1/4
for the end-of-sequence token right after the third digit, so a randomly initialized
model scores about 1/15 (one vocabulary entry in 15 per position) and a model that has
learned the task scores 1 and stops on its own.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from torchforge.loop.rewards import RewardFunction
from torchforge.trainer.config import RLConfig

__all__ = ["char_tokenizer", "tiny_llama", "copy_digits_dataset", "CopyDigitsReward", "demo_config"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = "0123456789="


def char_tokenizer(characters: str = CHARACTERS, *, pad_token: bool = True) -> PreTrainedTokenizerFast:
    """A character-level Hugging Face tokenizer built locally (no download).

    Args:
        characters: the characters of the vocabulary, one token each, after the special
            tokens ``<pad> <bos> <eos> <unk>``.
        pad_token: set ``<pad>`` as the pad token; False leaves ``pad_token`` None (as
            many base-model tokenizers do), which the loop must handle.

    Returns:
        A ``PreTrainedTokenizerFast`` that pads on the left (as prompts for ``generate``
        need); ``decode`` concatenates characters without spaces.

    Example:
        >>> tokenizer = char_tokenizer()
        >>> tokenizer("407=")["input_ids"]
        [8, 4, 11, 14]
        >>> tokenizer.decode([8, 4, 11, 2], skip_special_tokens=True)
        '407'
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *characters))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        pad_token="<pad>" if pad_token else None, padding_side="left",  # prompts for generate
    )


def tiny_llama(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A small randomly initialized Llama whose vocabulary matches ``tokenizer``.

    Args:
        tokenizer: the tokenizer the model will read (its ``len`` is the vocabulary size;
            its bos / eos / pad ids go into the config).
        hidden_size: H.
        num_layers: number of decoder blocks.
        num_heads: attention heads (key/value heads: half of them, as in Llama 3's GQA).
        seed: torch seed for the initialization.

    Returns:
        A ``LlamaForCausalLM`` in float32, in training mode.

    Example:
        >>> model = tiny_llama(char_tokenizer())
        >>> model.config.vocab_size
        15
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.train()


def copy_digits_dataset(num_prompts: int, *, num_digits: int = 3, seed: int = 0) -> list[dict[str, str]]:
    """Prompts ``"ddd="`` with their ``target`` digits, drawn uniformly.

    Args:
        num_prompts: how many rows.
        num_digits: digits per prompt.
        seed: seed of the ``random.Random`` that draws the digits.

    Returns:
        A list of ``{"prompt": "407=", "target": "407"}`` dicts.

    Example:
        >>> copy_digits_dataset(2, seed=1)
        [{'prompt': '291=', 'target': '291'}, {'prompt': '417=', 'target': '417'}]
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
        rows.append({"prompt": f"{digits}=", "target": digits})
    return rows


class CopyDigitsReward(RewardFunction):
    """Partial credit for copying the prompt's digits, and for stopping right after them.

    ``reward = (sum_i [completion[i] == digits[i]] + stopped - extra) / (n + 1)`` over the
    ``n`` digits of the prompt (the characters before ``=``), where ``stopped`` is 1 when
    the completion ends with the end-of-sequence token right after ``n`` tokens (judged
    from ``completion_ids``; without them, from the text: exactly ``n`` characters) and
    ``extra`` counts the characters after the n-th. Running on costs what stopping earns,
    so a digit in the stop position is not rewarded along with the copy before it: the
    model learns to copy *and stop*.

    Args:
        eos_token_id: the end-of-sequence id (default: :func:`char_tokenizer`'s ``<eos>``).

    Returns:
        A reward function: ``compute(completions, prompts, completion_ids=None)`` -> list
        of floats, 1 for a copy that stops.

    Example:
        >>> reward = CopyDigitsReward()
        >>> reward.compute(["407", "4x", ""], ["407=", "407=", "407="])
        [1.0, 0.25, 0.0]
        >>> reward.compute(["407", "4071"], ["407=", "407="], completion_ids=[[8, 4, 11, 2], [8, 4, 11, 5]])
        [1.0, 0.5]
    """

    name = "copy_digits"

    def __init__(self, eos_token_id: int = SPECIAL_TOKENS.index("<eos>")) -> None:
        self.eos_token_id = eos_token_id

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str],
                 completion_ids: Sequence[Sequence[int]] | None = None, **columns: Any) -> list[float]:
        return self.compute(completions, prompts, completion_ids=completion_ids)

    def compute(self, completions: Sequence[str], prompts: Sequence[str],
                completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        rewards = []
        for b, (completion, prompt) in enumerate(zip(completions, prompts)):
            digits = prompt.split("=", 1)[0]
            n = len(digits)
            hits = sum(x == y for x, y in zip(completion, digits))
            if completion_ids is not None:
                ids = list(completion_ids[b])
                stopped = len(ids) == n + 1 and ids[-1] == self.eos_token_id
            else:
                stopped = len(completion) == n
            extra = max(len(completion) - n, 0)
            rewards.append((hits + float(stopped) - extra) / (n + 1))
        return rewards


def demo_config(**overrides: Any) -> RLConfig:
    """The settings ``torchforge train`` uses with no config: GRPO on the copy task, on a CPU.

    16 prompts x 8 samples per step, completions of at most 4 tokens (3 digits and eos),
    a learning rate suited to a 2-layer model trained from scratch, no KL (there is no
    pretrained behaviour to stay close to), float32, 300 steps.

    Args:
        **overrides: fields of RLConfig to change.

    Returns:
        RLConfig.

    Example:
        >>> demo_config(max_steps=10).max_steps
        10
    """
    values = dict(
        algorithm="grpo", learning_rate=1e-3, num_generations=8, prompts_per_step=16,
        max_completion_length=4, kl_coef=0.0, mixed_precision="fp32", gradient_checkpointing=False,
        max_steps=300, save_steps=100, logging_steps=1,
    )
    values.update(overrides)
    return RLConfig.from_dict(values)
