"""Rollout: sample ``num_generations`` completions per prompt from a Hugging Face causal LM.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from torchforge.batch import Batch
from torchforge.distributed import generation_kwargs, unwrap_model
from torchforge.errors import InvalidArgumentError
from torchforge.loop.sampling import SeededSampler, sample_keys

# --- rollout -----------------------------------------------------------------------------

def completion_stop_ids(tokenizer: Any, model: nn.Module | None = None, extra: Sequence[int] | None = None) -> list[int]:
    """The ids that end a completion: the tokenizer's eos, the model's generation eos, and ``extra``.

    Args:
        tokenizer: a Hugging Face tokenizer.
        model: the model, whose ``generation_config.eos_token_id`` (an int or a list, as
            chat models set it) is added when present.
        extra: more stop ids.

    Returns:
        Sorted distinct ids; raises when there are none.
    """
    ids: set[int] = set(extra or [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(unwrap_model(model), "generation_config", None) if model is not None else None
    eos = getattr(config, "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    if not ids:
        raise InvalidArgumentError(
            "stop_token_ids: the tokenizer has no eos_token_id and no stop_token_ids were given; "
            "expected at least one stop id"
        )
    return sorted(ids)


def _pad_left(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = True
    return ids, mask


def completion_mask(tokens: torch.Tensor, stop_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss mask of generated completions, and which ones were cut by the length limit.

    ``mask[b, t] = t <= first_stop[b]``: each completion up to and including its first
    stop token, found by position (never by ``tokens != pad_id``: when pad == eos that
    would hide the stop token the model must learn). A row with no stop token is counted
    whole and flagged ``truncated``.

    Args:
        tokens: [B, T] int64 generated tokens (right-padded).
        stop_ids: the ids that end a completion.

    Returns:
        ``(mask, truncated)``: [B, T] bool and [B] bool.

    Example:
        >>> mask, truncated = completion_mask(torch.tensor([[5, 2, 2], [5, 6, 7]]), [2])
        >>> mask.tolist(), truncated.tolist()
        ([[True, True, False], [True, True, True]], [False, True])
    """
    is_stop = torch.isin(tokens, torch.tensor(stop_ids, device=tokens.device))
    stopped = is_stop.any(-1)
    first_stop = torch.where(stopped, is_stop.int().argmax(-1), tokens.shape[-1])
    positions = torch.arange(tokens.shape[-1], device=tokens.device)
    return positions[None, :] <= first_stop[:, None], ~stopped


@torch.no_grad()
def rollout(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int | None = None,
    prompt_ids: Sequence[int] | None = None,
) -> Batch:
    """Sample ``num_generations`` completions of each prompt with ``model.generate``.

    Prompts are left-padded, completions right-padded; the G completions of a prompt are
    contiguous (row ``b`` answers prompt ``b // G``). ``mask`` covers each completion up
    to and including its first stop token, found by position — never by ``tokens !=
    pad_id``, which would hide the stop token when pad == eos. Sampling is exact and
    seeded per sample (:mod:`torchforge.loop.sampling`): completion ``g`` of prompt ``i`` depends
    only on ``(seed, prompt_ids[i], g)`` and the model, not on the batch around it.

    Args:
        model: a Hugging Face causal LM (plain, DDP or FSDP2; under FSDP every rank must
            call this, with the same ``max_new_tokens``).
        tokenizer: its tokenizer; ``pad_token`` may be None.
        prompts: N prompt strings (already rendered; tokenized without special tokens
            added when the tokenizer has a chat template), or N lists of token ids.
        num_generations: G >= 1 completions per prompt; B = N * G.
        max_new_tokens: the length limit of a completion.
        temperature: > 0; the same temperature must be used for the training log-probs.
        top_p: nucleus filter, in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it. Passed explicitly: Hugging
            Face would otherwise fall back to top_k=50, a different distribution from
            the one being trained.
        stop_token_ids: ids that end a completion; default :func:`completion_stop_ids`.
        seed: the sampling seed; default: drawn from torch's global RNG.
        prompt_ids: N global ids of the prompts (default 0..N-1), so that a prompt gets
            the same samples wherever it sits (another rank, another batch).

    Returns:
        A ``Batch`` of B rows: ``tokens`` [B, T] (T <= max_new_tokens), ``mask`` [B, T],
        ``prompt_tokens`` [B, P], ``prompt_mask`` [B, P], ``truncated`` [B] (no stop token
        within max_new_tokens) and ``rollout_log_probs`` [B, T] (log-probs of the drawn
        tokens under the sampling distribution, float32).

    Example:
        >>> from torchforge.trainer.demo import char_tokenizer, tiny_llama
        >>> tokenizer = char_tokenizer()
        >>> batch = rollout(tiny_llama(tokenizer), tokenizer, ["12=", "7="], num_generations=2,
        ...                 max_new_tokens=3, seed=0)
        >>> batch.batch_size, batch.prompt_tokens.shape
        (torch.Size([4]), torch.Size([4, 3]))
    """
    fn = "rollout"
    if not prompts:
        raise InvalidArgumentError(f"{fn}: prompts is empty; expected at least one prompt")
    for name, value in (("num_generations", num_generations), ("max_new_tokens", max_new_tokens)):
        if not (isinstance(value, int) and value >= 1):
            raise InvalidArgumentError(f"{fn}: {name} must be an int >= 1, got {value!r}")
    if not temperature > 0:
        raise InvalidArgumentError(f"{fn}: temperature must be > 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise InvalidArgumentError(f"{fn}: top_p must be in (0, 1], got {top_p!r}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise InvalidArgumentError(f"{fn}: top_k must be an int >= 0, got {top_k!r}")
    inner = unwrap_model(model)
    stop_ids = list(stop_token_ids) if stop_token_ids else completion_stop_ids(tokenizer, inner)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]

    if isinstance(prompts[0], str):
        add_special = getattr(tokenizer, "chat_template", None) is None
        encoded = tokenizer(list(prompts), add_special_tokens=add_special)["input_ids"]
    else:
        encoded = [list(p) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise InvalidArgumentError(f"{fn}: a prompt encodes to no tokens; expected every prompt to have one")
    prompt_tokens, prompt_mask = _pad_left(encoded, pad_id)
    device = next(inner.parameters()).device
    G = num_generations
    prompt_tokens = prompt_tokens.repeat_interleave(G, 0).to(device)
    prompt_mask = prompt_mask.repeat_interleave(G, 0).to(device)

    ids = torch.arange(len(prompts)) if prompt_ids is None else torch.as_tensor(list(prompt_ids), dtype=torch.long)
    if ids.shape != (len(prompts),):
        raise InvalidArgumentError(f"{fn}: {ids.numel()} prompt_ids for {len(prompts)} prompts; expected one each")
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    sample_ids = ids.repeat_interleave(G) * G + torch.arange(G).repeat(len(prompts))
    sampler = SeededSampler(sample_keys(seed, sample_ids), prompt_length=prompt_tokens.shape[1],
                            temperature=temperature, top_k=top_k, top_p=top_p, max_steps=max_new_tokens)
    config = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
        pad_token_id=pad_id, repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0,
    )
    was_training = inner.training
    inner.eval()
    try:
        out = inner.generate(
            input_ids=prompt_tokens, attention_mask=prompt_mask.long(), generation_config=config,
            logits_processor=[sampler], **generation_kwargs(),
        )
    finally:
        inner.train(was_training)
    tokens = out[:, prompt_tokens.shape[1]:]
    mask, truncated = completion_mask(tokens, stop_ids)
    T = tokens.shape[1]
    rollout_log_probs = torch.stack(sampler.log_probs[:T], dim=1) if T else torch.zeros(len(tokens), 0)
    return Batch(
        tokens=tokens, mask=mask, prompt_tokens=prompt_tokens, prompt_mask=prompt_mask,
        truncated=truncated, rollout_log_probs=rollout_log_probs.masked_fill(~mask, 0.0),
        batch_size=[tokens.shape[0]],
    )


def decode_completions(tokenizer: Any, batch: Batch) -> tuple[list[str], list[list[int]]]:
    """The text and ids of each completion: its counted tokens, stop token text removed.

    Args:
        tokenizer: the tokenizer.
        batch: a Batch with ``tokens`` and ``mask``.

    Returns:
        ``(completions, completion_ids)``: B strings (special tokens skipped) and B lists of
        the counted token ids (stop token included).

    Example:
        >>> from torchforge.trainer.demo import char_tokenizer
        >>> tokens = torch.tensor([[8, 4, 2, 2], [5, 5, 5, 5]])   # "40<eos><pad>", "1111"
        >>> mask, _ = completion_mask(tokens, [2])
        >>> decode_completions(char_tokenizer(), Batch(tokens=tokens, mask=mask, batch_size=[2]))
        (['40', '1111'], [[8, 4, 2], [5, 5, 5, 5]])
    """
    # the mask is a prefix of each row: cut the rows at their lengths
    ids = [row[:n] for row, n in zip(batch.tokens.tolist(), batch.mask.sum(-1).tolist())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True), ids
