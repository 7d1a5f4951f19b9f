"""The loop's building blocks over a Hugging Face causal LM: rollout, log-probs, values, update.

Plain functions; :class:`torchforge.trainer.RLTrainer` calls them in order, and a
handwritten loop can call them too:

1. :func:`rollout` samples ``num_generations`` completions per prompt -> a ``Batch``.
2. :func:`decode_completions` turns them into text for the reward functions.
3. :func:`policy_log_probs` computes token log-probs (and entropy) from the last hidden
   states and the LM head with :func:`torchforge.log_probs.fused_token_log_probs`: the
   [B, T, V] logits never exist.
4. :func:`accumulate_gradients` runs one optimizer step's micro-batches with exact loss
   aggregation (global token / sequence counts), then :func:`optimizer_step` clips and steps.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from torchforge.batch import Batch
from torchforge.distributed import generation_kwargs, global_counts, unwrap_model, world_size
from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.log_probs import fused_token_log_probs
from torchforge.reduce import Aggregation
from torchforge.sampling import SeededSampler, sample_keys

__all__ = [
    "rollout",
    "completion_stop_ids",
    "completion_mask",
    "decode_completions",
    "policy_log_probs",
    "ValueModel",
    "micro_batches",
    "accumulate_gradients",
    "optimizer_step",
]


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
    seeded per sample (:mod:`torchforge.sampling`): completion ``g`` of prompt ``i`` depends
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
        >>> from torchforge.demo import char_tokenizer, tiny_llama
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
        >>> from torchforge.demo import char_tokenizer
        >>> tokens = torch.tensor([[8, 4, 2, 2], [5, 5, 5, 5]])   # "40<eos><pad>", "1111"
        >>> mask, _ = completion_mask(tokens, [2])
        >>> decode_completions(char_tokenizer(), Batch(tokens=tokens, mask=mask, batch_size=[2]))
        (['40', '1111'], [[8, 4, 2], [5, 5, 5, 5]])
    """
    # the mask is a prefix of each row: cut the rows at their lengths
    ids = [row[:n] for row, n in zip(batch.tokens.tolist(), batch.mask.sum(-1).tolist())]
    return tokenizer.batch_decode(ids, skip_special_tokens=True), ids


# --- log-probs and values ----------------------------------------------------------------

def _model_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, attention mask and position ids as ``generate`` saw them.

    The last completion token is never an input (nothing is predicted after it). Positions
    count real tokens only, as ``generate`` counts them for left-padded prompts.
    """
    input_ids = torch.cat([batch.prompt_tokens, batch.tokens[:, :-1]], dim=1)
    attention = torch.cat([batch.prompt_mask, torch.ones_like(batch.tokens[:, :-1], dtype=torch.bool)], dim=1)
    position_ids = (attention.long().cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention.long(), position_ids


def _last_hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.last_hidden_state


@contextlib.contextmanager
def _hooks(*handles):
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def policy_log_probs(
    model: nn.Module,
    batch: Batch,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens (and entropies), without materializing logits.

    Runs the model's own forward (so FSDP2 / DDP hooks fire) with ``logits_to_keep=1``,
    captures the decoder's last hidden states, and computes ``fused_token_log_probs``
    from them and the LM head *inside* that forward, while FSDP still holds the gathered
    head weight; the result is returned through the forward so that the backward reaches
    every sharded parameter.

    Args:
        model: a Hugging Face causal LM (``get_decoder()`` / ``get_output_embeddings()``),
            plain, DDP or FSDP2.
        batch: a Batch with ``prompt_tokens``, ``prompt_mask``, ``tokens`` [B, T].
        temperature: the sampling temperature (the training distribution must be the
            sampling one).
        return_entropy: also return the per-token entropy (detached).
        chunk_size: rows per chunk of the fused kernel; default automatic.

    Returns:
        ``(log_probs, entropy)``: float32 [B, T] (with grad when grad is enabled), and
        float32 [B, T] or None.

    Example:
        >>> from torchforge.demo import char_tokenizer, tiny_llama
        >>> tokenizer = char_tokenizer()
        >>> model = tiny_llama(tokenizer)
        >>> batch = rollout(model, tokenizer, ["12="], num_generations=2, max_new_tokens=3, seed=0)
        >>> log_probs, entropy = policy_log_probs(model, batch, return_entropy=True)
        >>> log_probs.shape == batch.tokens.shape, bool((entropy >= 0).all())
        (True, True)
    """
    inner = unwrap_model(model)
    decoder, head = inner.get_decoder(), inner.get_output_embeddings()
    if decoder is None or head is None:
        raise TorchforgeError(
            f"policy_log_probs: {type(inner).__name__} has no decoder / output embeddings; expected a "
            "Hugging Face causal LM"
        )
    input_ids, attention_mask, position_ids = _model_inputs(batch)
    P = batch.prompt_tokens.shape[1]
    captured: dict[str, torch.Tensor] = {}

    def keep_hidden(module, args, output):
        captured["hidden"] = _last_hidden(output)

    def fused_head(module, args, kwargs, output):
        hidden = captured.pop("hidden")[:, P - 1:]
        result = fused_token_log_probs(
            hidden, head.weight, batch.tokens, bias=head.bias, temperature=temperature,
            chunk_size=chunk_size, return_entropy=return_entropy,
        )
        # fresh tensors, not views: FSDP hooks its pre-backward on what the forward returns
        return tuple(r.clone() for r in result) if return_entropy else (result.clone(), None)

    # prepend: the head runs before FSDP's post-forward hook reshards the root parameters
    with _hooks(decoder.register_forward_hook(keep_hidden),
                inner.register_forward_hook(fused_head, prepend=True, with_kwargs=True)):
        log_probs, entropy = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            logits_to_keep=1, use_cache=False,
        )
    return log_probs, (entropy.detach() if entropy is not None else None)


class ValueModel(nn.Module):
    """A critic: the policy's decoder (a copy) and a scalar head, ``values = head(hidden)``.

    Args:
        policy: the causal LM to copy the decoder from (its weights initialize the critic).

    Returns:
        A module whose ``forward(batch)`` returns float32 [B, T] values, ``values[:, t]``
        the value of the state before completion token t.

    Example:
        >>> from torchforge.demo import char_tokenizer, tiny_llama
        >>> critic = ValueModel(tiny_llama(char_tokenizer()))
        >>> critic.head.out_features
        1
    """

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        import copy

        inner = unwrap_model(policy)
        self.decoder = copy.deepcopy(inner.get_decoder())
        self.head = nn.Linear(inner.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # shard() finds the decoder blocks through this, as for a Hugging Face model
        self._no_split_modules = list(getattr(inner, "_no_split_modules", None) or [])

    def forward(self, batch: Batch) -> torch.Tensor:
        input_ids, attention_mask, position_ids = _model_inputs(batch)
        P = batch.prompt_tokens.shape[1]
        hidden = _last_hidden(self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                           position_ids=position_ids, use_cache=False))
        return self.head(hidden[:, P - 1:])[..., 0].float().clone()  # not a view: FSDP hooks the output


# --- the update ----------------------------------------------------------------------------

def micro_batches(batch: Batch, size: int) -> Iterator[Batch]:
    """Consecutive slices of ``size`` rows (the last one may be shorter).

    Args:
        batch: a Batch of B rows.
        size: rows per micro-batch, >= 1.

    Returns:
        An iterator of Batch views.

    Example:
        >>> batch = Batch(mask=torch.ones(5, 2, dtype=torch.bool), batch_size=[5])
        >>> [part.batch_size[0] for part in micro_batches(batch, 2)]
        [2, 2, 1]
    """
    if not (isinstance(size, int) and size >= 1):
        raise InvalidArgumentError(f"micro_batches: size must be an int >= 1, got {size!r}")
    for start in range(0, batch.batch_size[0], size):
        yield batch[start:start + size]


def accumulate_gradients(
    parts: Sequence[Batch],
    loss_fn: Callable[[Batch, Aggregation], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    *,
    mode: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward every micro-batch of one optimizer step, with exact aggregation.

    The token and sequence counts of the whole step (all micro-batches, all ranks) are
    all-reduced once (:func:`torchforge.distributed.global_counts`) and handed to every
    micro-batch's loss as an ``Aggregation``: the accumulated gradient, averaged over ranks
    by DDP / FSDP, is then the gradient of the whole batch's loss in one process.

    Args:
        parts: the micro-batches of this step on this rank (each with ``mask``).
        loss_fn: ``(micro_batch, aggregation) -> (loss, metrics)``; it runs the forward.
        mode: the aggregation mode.
        norm_length: constant length of ``seq-mean-token-sum-norm``.

    Returns:
        ``(loss, metrics)``: the step's loss on this rank (the sum over micro-batches,
        detached) and, per metric, its token-weighted sum over micro-batches divided by
        this rank's tokens (local means; reduce across ranks as sums for logging).

    Example:
        >>> w = torch.nn.Parameter(torch.tensor(2.0))
        >>> batch = Batch(mask=torch.tensor([[True, True], [True, False]]), batch_size=[2])
        >>> loss_fn = lambda part, agg: (agg(w * part.mask.float(), part.mask), {})
        >>> loss, _ = accumulate_gradients(list(micro_batches(batch, 1)), loss_fn)
        >>> loss, w.grad   # token-mean over the 3 tokens of both micro-batches: 2 * 3 / 3
        (tensor(2.), tensor(1.))
    """
    num_tokens, num_sequences = global_counts([p.mask for p in parts])
    aggregation = Aggregation(mode, num_tokens=num_tokens, num_sequences=num_sequences,
                              dp_size=world_size(), norm_length=norm_length)
    total = torch.zeros((), dtype=torch.float32)
    sums: dict[str, torch.Tensor] = {}
    local_tokens = sum(int(p.mask.sum()) for p in parts)
    for part in parts:
        loss, metrics = loss_fn(part, aggregation)
        loss.backward()
        total += loss.detach().float().cpu()
        weight = int(part.mask.sum())
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + weight * torch.as_tensor(value).detach().float().cpu()
    return total, {k: v / max(local_tokens, 1) for k, v in sums.items()}


def optimizer_step(
    parameters: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    max_grad_norm: float | None = 1.0,
) -> float:
    """Clip the global gradient norm, step the optimizer (and scheduler), zero the gradients.

    Args:
        parameters: the trained parameters (plain or FSDP2 DTensors).
        optimizer: the optimizer.
        scheduler: an LR scheduler, or None.
        max_grad_norm: clip threshold; None disables clipping (the norm is still measured).

    Returns:
        The gradient norm before clipping (over all ranks' shards).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> w.grad = torch.tensor([3.0, 4.0])
        >>> optimizer_step([w], torch.optim.SGD([w], lr=0.1), max_grad_norm=1.0)
        5.0
    """
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, math.inf if max_grad_norm is None else max_grad_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
