"""Rollout: sample ``num_generations`` completions per prompt with a generation engine.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torchforge.batch import Batch
from torchforge.distributed import unwrap_model
from torchforge.errors import InvalidArgumentError
from torchforge.loop.engines import (
    Completion,
    GenerationEngine,
    HFEngine,
    SamplingSettings,
    left_pad,
    request_seeds,
)

# --- rollout -----------------------------------------------------------------------------

def completion_stop_ids(tokenizer: Any, model: nn.Module | None = None, extra: Sequence[int] | None = None) -> list[int]:
    """The ids that end a completion: the tokenizer's eos, the model's generation eos, and ``extra``.

    Args:
        tokenizer: a Hugging Face tokenizer.
        model: the model, whose ``generation_config.eos_token_id`` (an int or a list, as
            chat models set it) is added when present, and a vision-language model's image
            placeholder ids (:func:`torchforge.loop.vision.placeholder_ids`).
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
    if model is not None and ids:  # a VLM's image placeholders end a completion (torchforge.loop.vision)
        from torchforge.loop.vision import placeholder_ids

        ids.update(placeholder_ids(unwrap_model(model)))
    if not ids:
        raise InvalidArgumentError(
            "stop_token_ids: the tokenizer has no eos_token_id and no stop_token_ids were given; "
            "expected at least one stop id"
        )
    return sorted(ids)


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
    model: nn.Module | None,
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
    engine: GenerationEngine | None = None,
    images: Sequence[Sequence[Any]] | None = None,
    processor: Any = None,
    vision: Sequence[Any] | None = None,
) -> Batch:
    """Sample ``num_generations`` completions of each prompt with a generation engine.

    Prompts are left-padded, completions right-padded; the G completions of a prompt are
    contiguous (row ``b`` answers prompt ``b // G``). ``mask`` covers each completion up
    to and including its first stop token — never ``tokens != pad_id``, which would hide
    the stop token when pad == eos. Sampling is seeded per sample: completion ``g`` of
    prompt ``i`` gets the seed of ``(seed, prompt_ids[i], g)`` (:func:`request_seeds`), so
    it depends on neither the batch around it nor the number of processes. The default
    engine, :class:`HFEngine` over ``model``, samples exactly (:mod:`torchforge.loop.sampling`).

    Args:
        model: a Hugging Face causal LM (plain, DDP or FSDP2; under FSDP every rank must
            call this, with the same ``max_new_tokens``); the batch is put on its device. May
            be None when an ``engine`` is given (the batch stays on the CPU).
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
        engine: a :class:`~torchforge.loop.engines.GenerationEngine`; default
            ``HFEngine(model)``.
        images: N lists of PIL images, one per prompt ([] for a prompt without), for a
            vision-language model: the prompts (strings, their image placeholders rendered
            by the processor's chat template) go through ``processor``, which expands the
            image tokens; the engine samples with the images (``generate(..., vision=...)``).
        processor: the model's processor, with ``images``.
        vision: instead of ``images``, N already processed
            :class:`~torchforge.loop.vision.VisionInputs` (or None), one per token-id prompt
            whose image tokens are already expanded: a multi-turn episode's context with
            every image so far (:func:`torchforge.loop.rollout_episodes`).

    Returns:
        A ``Batch`` of B rows: ``tokens`` [B, T] (T <= max_new_tokens), ``mask`` [B, T],
        ``prompt_tokens`` [B, P], ``prompt_mask`` [B, P], ``truncated`` [B] (no stop token
        within max_new_tokens), ``rollout_log_probs`` [B, T] (log-probs of the drawn
        tokens under the sampling distribution, float32, 0 off the mask) and
        ``policy_version`` [B] int64 (the engine's weights version of each completion);
        with images also ``vision`` (:func:`torchforge.loop.vision.stack_vision`).

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> tokenizer = char_tokenizer()
        >>> batch = rollout(tiny_llama(tokenizer), tokenizer, ["12=", "7="], num_generations=2,
        ...                 max_new_tokens=3, seed=0)
        >>> batch.batch_size, batch.prompt_tokens.shape
        (torch.Size([4]), torch.Size([4, 3]))
    """
    fn = "rollout"
    if not prompts:
        raise InvalidArgumentError(f"{fn}: prompts is empty; expected at least one prompt")
    if not (isinstance(num_generations, int) and num_generations >= 1):
        raise InvalidArgumentError(f"{fn}: num_generations must be an int >= 1, got {num_generations!r}")
    if model is None and engine is None:
        raise InvalidArgumentError(f"{fn}: model and engine are both None; expected a model, an engine or both")
    inner = unwrap_model(model) if model is not None else None
    stop_ids = list(stop_token_ids) if stop_token_ids else completion_stop_ids(tokenizer, inner)
    try:
        settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                    top_k=top_k, stop_token_ids=tuple(stop_ids))
    except InvalidArgumentError as error:
        raise InvalidArgumentError(str(error).replace("SamplingSettings:", f"{fn}:", 1)) from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]

    if vision is not None:
        if images is not None:
            raise InvalidArgumentError(f"{fn}: both images and vision were given; expected images (with string "
                                       "prompts and a processor) or vision (processed, with token-id prompts)")
        if len(vision) != len(prompts):
            raise InvalidArgumentError(f"{fn}: {len(vision)} vision inputs for {len(prompts)} prompts; expected one each")
        vision = list(vision) if any(v is not None for v in vision) else None
    if images is not None and any(len(i) for i in images):
        from torchforge.loop.vision import encode_vision_prompts

        if processor is None or not isinstance(prompts[0], str):
            raise InvalidArgumentError(f"{fn}: images were given without a processor or with token-id prompts; "
                                       "expected rendered string prompts and the model's processor")
        encoded, vision = encode_vision_prompts(processor, list(prompts), list(images))
    elif isinstance(prompts[0], str):
        if vision is not None:
            raise InvalidArgumentError(f"{fn}: vision was given with string prompts; expected token-id prompts "
                                       "whose image tokens are expanded (strings with images: images=)")
        add_special = getattr(tokenizer, "chat_template", None) is None
        encoded = tokenizer(list(prompts), add_special_tokens=add_special)["input_ids"]
    else:
        encoded = [list(p) for p in prompts]
    if any(len(e) == 0 for e in encoded):
        raise InvalidArgumentError(f"{fn}: a prompt encodes to no tokens; expected every prompt to have one")
    ids = list(range(len(prompts))) if prompt_ids is None else [int(i) for i in prompt_ids]
    if len(ids) != len(prompts):
        raise InvalidArgumentError(f"{fn}: {len(ids)} prompt_ids for {len(prompts)} prompts; expected one each")
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    G = num_generations
    requests = [prompt for prompt in encoded for _ in range(G)]  # the G samples of a prompt, contiguous
    engine = engine if engine is not None else HFEngine(model, pad_token_id=pad_id)
    if vision is None:
        completions = engine.generate(requests, seeds=request_seeds(seed, ids, G), settings=settings)
    else:
        import inspect

        if "vision" not in inspect.signature(engine.generate).parameters:
            raise InvalidArgumentError(f"{fn}: the prompts have images but {type(engine).__name__}.generate takes no "
                                       "vision=; expected an engine that samples from images (HFEngine)")
        vision = [v for v in vision for _ in range(G)]
        completions = engine.generate(requests, seeds=request_seeds(seed, ids, G), settings=settings, vision=vision)
    if len(completions) != len(requests):
        raise InvalidArgumentError(f"{fn}: {type(engine).__name__}.generate returned {len(completions)} "
                                   f"completions for {len(requests)} requests; expected one each")
    batch = completions_batch(completions, requests, pad_id=pad_id)
    if vision is not None:
        from torchforge.loop.vision import stack_vision

        batch.vision = stack_vision(vision)
    return batch.to(next(inner.parameters()).device) if inner is not None else batch


def completions_batch(completions: Sequence[Completion], prompt_token_ids: Sequence[Sequence[int]], *,
                      pad_id: int, device: torch.device | None = None) -> Batch:
    """An engine's completions of B requests as a ``Batch``: prompts left-padded, completions
    right-padded with ``pad_id``, ``mask`` True on each completion's tokens (the stop token
    included), ``rollout_log_probs`` 0 off the mask, ``policy_version`` per row.

    Args:
        completions: B :class:`~torchforge.loop.engines.Completion`.
        prompt_token_ids: the B prompts they answer.
        pad_id: the padding id.
        device: where the tensors go (default the CPU).

    Returns:
        A ``Batch`` as :func:`rollout` returns it.

    Example:
        >>> out = [Completion([5, 2], [-0.5, -0.25], False, 3), Completion([6], [-1.0], True, 3)]
        >>> batch = completions_batch(out, [[8], [9, 8]], pad_id=0)
        >>> batch.tokens.tolist(), batch.mask.tolist(), batch.policy_version.tolist()
        ([[5, 2], [6, 0]], [[True, True], [True, False]], [3, 3])
    """
    B = len(completions)
    T = max((len(c.token_ids) for c in completions), default=0)
    for row, c in enumerate(completions):
        if len(c.log_probs) != len(c.token_ids):
            raise InvalidArgumentError(f"completions_batch: completion {row} has {len(c.token_ids)} tokens but "
                                       f"{len(c.log_probs)} log_probs; expected one log-prob per token")
    # right-padded as Python lists, then one tensor each (a tensor per row costs ~10 us)
    tokens = torch.tensor([[*c.token_ids, *[pad_id] * (T - len(c.token_ids))] for c in completions],
                          dtype=torch.long).view(B, T)
    log_probs = torch.tensor([[*c.log_probs, *[0.0] * (T - len(c.log_probs))] for c in completions],
                             dtype=torch.float32).view(B, T)
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
    prompt_tokens, prompt_mask = left_pad(prompt_token_ids, pad_id)
    batch = Batch(
        tokens=tokens, mask=torch.arange(T)[None, :] < lengths[:, None], prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask, truncated=torch.tensor([c.truncated for c in completions], dtype=torch.bool),
        rollout_log_probs=log_probs, policy_version=torch.tensor([c.weights_version for c in completions],
                                                                 dtype=torch.long),
        batch_size=[B],
    )
    return batch.to(device) if device is not None else batch


def decode_completions(tokenizer: Any, batch: Batch) -> tuple[list[str], list[list[int]]]:
    """The text and ids of each completion: its counted tokens, stop token text removed.

    Args:
        tokenizer: the tokenizer.
        batch: a Batch with ``tokens`` and ``mask``.

    Returns:
        ``(completions, completion_ids)``: B strings (special tokens skipped) and B lists of
        the counted token ids (stop token included).

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer
        >>> tokens = torch.tensor([[8, 4, 2, 2], [5, 5, 5, 5]])   # "40<eos><pad>", "1111"
        >>> mask, _ = completion_mask(tokens, [2])
        >>> decode_completions(char_tokenizer(), Batch(tokens=tokens, mask=mask, batch_size=[2]))
        (['40', '1111'], [[8, 4, 2], [5, 5, 5, 5]])
    """
    # the mask is a prefix of each row: cut the rows at their lengths
    ids = [row[:n] for row, n in zip(batch.tokens.tolist(), batch.mask.sum(-1).tolist())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True), ids
