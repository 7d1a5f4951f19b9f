"""A tiny Llama and a character tokenizer, built locally: a real Hugging Face model to run the loop on.

Neither needs a download, so examples, doctests and tests of the loop run on any CPU:
:func:`char_tokenizer` makes a one-token-per-character tokenizer and :func:`tiny_llama`
a randomly initialized ``LlamaForCausalLM`` of its vocabulary. The demo task of
``torchforge train`` (:mod:`torchforge.trainer.demo`) trains one of these.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["char_tokenizer", "tiny_llama", "SPECIAL_TOKENS", "CHARACTERS"]

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
