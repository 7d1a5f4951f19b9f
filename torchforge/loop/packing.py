"""Padding-free forwards: a batch's sequences packed end to end, results unpacked to [B, T].

A training batch holds left-padded prompts and right-padded completions; the padded forward
runs every row at the width of the longest. :func:`pack_sequences` keeps only the real
tokens of each row (its prompt tokens, then its completion up to the last counted token) and
packs them end to end into rows of one width, each sequence with its own position ids
``0, 1, ..., S - 1``. With ``attention_mask=None`` and no cache, Hugging Face's attention
reads the sequence boundaries from those position ids (a position that does not follow the
one before it starts a new sequence), so no token attends across a boundary:

- ``sdpa`` / ``eager`` (CPU and GPU): ``transformers.masking_utils`` turns the position ids
  into a block-diagonal causal mask (``find_packed_sequence_indices``), one block per
  sequence; this is the path the tests check on CPU;
- ``flash_attention_2`` / ``flash_attention_3`` (GPU): the varlen kernels with
  ``cu_seq_lens`` computed from the same position ids.

What comes back is gathered at the positions that predict each completion token and
scattered to today's [B, T] layout (:meth:`Packing.unpack`), so every primitive and loss is
unchanged. Architectures whose layers mix tokens by something other than masked attention
(state-space / Mamba layers, token convolutions, recurrent layers) cannot be packed this way
and are refused (:func:`check_packable`).

References:
    TRL ``padding_free``; verl ``use_remove_padding``; OpenRLHF ``packing_samples``;
    Krell et al., "Efficient sequence packing without cross-contamination" (2021),
    https://arxiv.org/abs/2107.02027
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from torchforge.batch import Batch
from torchforge.distributed import unwrap_model
from torchforge.errors import InvalidArgumentError, ShapeError, TorchforgeError, shape_str

__all__ = ["PACKABLE_ATTENTION", "Packing", "check_packable", "completion_lengths", "pack_sequences"]

#: the attention implementations that read sequence boundaries from packed position ids
PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
# class-name fragments of layers that mix tokens outside the attention mask: they would carry
# state from one packed sequence into the next
_STATEFUL_LAYERS = ("Mamba", "Mixer", "RWKV", "Recurrent", "GatedDeltaNet", "LinearAttention", "ShortConv", "SSM")


def completion_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Tokens of each completion that a forward must cover: up to its last counted token.

    ``L_b = max{t + 1 : mask[b, t]}`` (0 for a row with no counted token). Tokens inside
    that span whose mask is False (a tool's observation in a multi-turn episode) are kept:
    the model reads them.

    Args:
        mask: [B, T] bool, True where the token counts.

    Returns:
        [B] int64.

    Example:
        >>> completion_lengths(torch.tensor([[True, False, True, False], [False] * 4]))
        tensor([3, 0])
    """
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ShapeError(f"completion_lengths: mask {shape_str(mask)} {mask.dtype}; expected a [B, T] bool tensor")
    steps = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.long() * steps).amax(-1) if mask.shape[1] else mask.new_zeros(mask.shape[0], dtype=torch.long)


@dataclass(frozen=True)
class Packing:
    """A batch packed into ``R`` rows of ``W`` tokens, and how to unpack per-token results.

    Attributes:
        input_ids: [R, W] int64 packed token ids (the tail of a row is filler, a sequence of its own).
        position_ids: [R, W] int64, ``0 ... S - 1`` within each sequence.
        gather: [N] int64 flat indices into ``R * W``: the position whose output predicts
            each kept completion token.
        targets: [N] int64 the completion token each of those positions predicts.
        scatter: [N] int64 flat indices into ``B * T``: where each result goes.
        shape: ``(B, T)`` of the unpacked batch.
        ghost: True when no token needed a forward: ``input_ids`` holds one filler token
            and :meth:`unpack` returns zeros still connected to the graph (under DDP / FSDP
            every process must run the same forwards and backwards).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    gather: torch.Tensor
    targets: torch.Tensor
    scatter: torch.Tensor
    shape: tuple[int, int]
    ghost: bool = False

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token ``values`` [N] (one per kept token) scattered to [B, T], 0 elsewhere.

        Args:
            values: [N] float, in the order of ``gather``.

        Returns:
            [B, T], same dtype, differentiable in ``values``; a fresh tensor, not a view.
        """
        B, T = self.shape
        if self.ghost:  # no kept token: zeros, still connected to the graph (gradient 0)
            return values.new_zeros(B, T) + 0.0 * values.sum()
        out = values.new_zeros(B * T).index_put((self.scatter,), values)
        return out.view(B, T).clone()

    def gather_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The packed forward's ``hidden`` [R, W, H] at the predicting positions: [1, N, H]."""
        return hidden.reshape(-1, hidden.shape[-1])[self.gather].unsqueeze(0)


def _first_fit_decreasing(lengths: list[int], width: int) -> list[tuple[int, int]]:
    """(row, offset) of each sequence: first-fit in decreasing length into rows of ``width``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    used: list[int] = []
    place: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in order:
        row = next((r for r, u in enumerate(used) if u + lengths[i] <= width), None)
        if row is None:
            used.append(0)
            row = len(used) - 1
        place[i] = (row, used[row])
        used[row] += lengths[i]
    return place


def pack_sequences(batch: Batch) -> Packing:
    """Pack a batch's real tokens end to end, one block of position ids per sequence.

    Row b's sequence is its prompt's real tokens (``prompt_mask``) then its completion
    tokens ``tokens[b, :L_b - 1]`` (``L_b`` = :func:`completion_lengths`; the last token
    predicts nothing), ``S_b = n_b + L_b - 1`` tokens at positions ``0 ... S_b - 1``, as
    ``generate`` counted them. Rows with ``L_b = 0`` are left out. Sequences are placed
    first-fit-decreasing into rows of width ``W = max_b S_b`` (so an attention over a row
    costs at most that of the padded batch); a row's unused tail is a filler sequence.

    Args:
        batch: a Batch with ``prompt_tokens``, ``prompt_mask`` [B, P], ``tokens``, ``mask`` [B, T].

    Returns:
        A :class:`Packing`.

    Example:
        >>> batch = Batch(prompt_tokens=torch.tensor([[0, 5, 6], [7, 8, 9]]),
        ...               prompt_mask=torch.tensor([[False, True, True], [True, True, True]]),
        ...               tokens=torch.tensor([[10, 11, 12], [13, 0, 0]]),
        ...               mask=torch.tensor([[True, True, True], [True, False, False]]), batch_size=[2])
        >>> packing = pack_sequences(batch)
        >>> packing.input_ids.tolist(), packing.position_ids.tolist()
        ([[5, 6, 10, 11], [7, 8, 9, 0]], [[0, 1, 2, 3], [0, 1, 2, 0]])
        >>> packing.gather.tolist(), packing.targets.tolist(), packing.scatter.tolist()
        ([1, 2, 3, 6], [10, 11, 12, 13], [0, 1, 2, 3])
    """
    fn = "pack_sequences"
    prompt, prompt_mask, tokens, mask = batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask
    B, T = tokens.shape
    if prompt.dim() != 2 or prompt_mask.shape != prompt.shape or mask.shape != tokens.shape or prompt.shape[0] != B:
        raise ShapeError(f"{fn}: prompt_tokens {shape_str(prompt)}, prompt_mask {shape_str(prompt_mask)}, tokens "
                         f"{shape_str(tokens)}, mask {shape_str(mask)}; expected [B, P], [B, P], [B, T], [B, T]")
    device = tokens.device
    prompt_mask = prompt_mask.bool()
    n = prompt_mask.sum(-1)
    L = completion_lengths(mask.bool())
    live = L > 0
    if bool((live & (n == 0)).any()):
        row = int((live & (n == 0)).nonzero()[0])
        raise InvalidArgumentError(f"{fn}: row {row} has no prompt token (prompt_mask all False) but "
                                   f"{int(L[row])} completion tokens; expected at least one prompt token per sequence")
    S = torch.where(live, n + L - 1, 0)
    S_list, live_rows = S.tolist(), [b for b, keep in enumerate(live.tolist()) if keep]
    if not live_rows:  # nothing to compute: one filler token, so that the forward still runs
        empty = torch.zeros(0, dtype=torch.long, device=device)
        one = torch.zeros(1, 1, dtype=torch.long, device=device)
        return Packing(one, one.clone(), torch.zeros(1, dtype=torch.long, device=device),
                       torch.zeros(1, dtype=torch.long, device=device), empty, (B, T), ghost=True)
    W = max(S_list)
    place = _first_fit_decreasing([S_list[b] for b in live_rows], W)
    R = 1 + max(r for r, _ in place)
    start = torch.zeros(B, dtype=torch.long)
    used = torch.zeros(R, dtype=torch.long)
    for b, (r, off) in zip(live_rows, place):
        start[b] = r * W + off
        used[r] = max(int(used[r]), off + S_list[b])
    start, used = start.to(device), used.to(device)

    # every kept input token, row by row, and where it goes in the packed rows
    steps = torch.arange(max(T - 1, 0), device=device)
    keep = torch.cat([prompt_mask & live[:, None], steps[None, :] < (L - 1)[:, None]], dim=1)  # [B, P + T - 1]
    full = torch.cat([prompt, tokens[:, :-1]], dim=1)
    within = keep.long().cumsum(-1) - 1  # a kept token's position in its sequence
    dest = (start[:, None] + within)[keep]
    # a filler tail counts its own positions 0, 1, ... from where the row's sequences end
    position_ids = (torch.arange(W, device=device)[None, :] - used[:, None]).clamp(min=0)
    input_ids = torch.zeros(R, W, dtype=torch.long, device=device)
    input_ids.view(-1)[dest] = full[keep]
    position_ids.reshape(-1)[dest] = within[keep]  # contiguous: reshape is a view

    # the position predicting completion token t of row b: its prompt's last, then its token t - 1
    predicted = torch.arange(T, device=device)[None, :] < L[:, None]  # [B, T]
    gather = (start[:, None] + n[:, None] - 1 + torch.arange(T, device=device)[None, :])[predicted]
    scatter = torch.arange(B * T, device=device).view(B, T)[predicted]
    return Packing(input_ids, position_ids, gather, tokens[predicted], scatter, (B, T))


# --- which models can be packed ------------------------------------------------------------

# models checked by check_packable: model -> None (packable) or the reason it is not
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probe_batch(vocab: int, device: torch.device) -> Batch:
    """Three short sequences (left-padded prompts, right-padded completions) of 6, 3 and 3
    tokens: packed, the last two share a row, so a leak across the boundary shows."""
    ids = (torch.arange(15, device=device) * 7 % max(vocab - 3, 1) + 3).tolist()
    pad = 0
    prompt = torch.tensor([ids[0:3], [pad, *ids[3:5]], [pad, *ids[5:7]]], device=device)
    prompt_mask = torch.tensor([[True, True, True], [False, True, True], [False, True, True]], device=device)
    tokens = torch.tensor([ids[7:11], [*ids[11:13], pad, pad], [*ids[13:15], pad, pad]], device=device)
    mask = torch.tensor([[True] * 4, [True, True, False, False], [True, True, False, False]], device=device)
    return Batch(prompt_tokens=prompt, prompt_mask=prompt_mask, tokens=tokens, mask=mask, batch_size=[3])


def check_packable(
    model: nn.Module,
    run: Callable[[Batch, bool], Any] | None = None,
    *,
    decoder: nn.Module | None = None,
    fn: str = "check_packable",
) -> None:
    """Refuse, with one line, a model whose attention cannot be packed; checked once per model.

    Three checks: the attention implementation (``config._attn_implementation``) is one
    of ``PACKABLE_ATTENTION``; no layer mixes tokens outside the attention mask (a
    ``torch.nn.Conv1d`` over time, or a Mamba / SSM / RWKV / recurrent / linear-attention
    layer: it would carry state from one packed sequence into the next; e.g. Falcon-H1's
    ``FalconH1Mixer``); and the decoder's last hidden states of the packed forward equal
    the padded forward's on three probe sequences (mean relative difference below 1e-4 in
    float32, 3e-2 in bf16 / under autocast), which catches a model that ignores the
    position ids.

    Args:
        model: the module whose forward ``run`` calls (a causal LM or a
            :class:`~torchforge.loop.ValueModel`; plain, DDP or FSDP2).
        run: ``run(batch, packed)`` runs that forward on a batch; default
            ``policy_log_probs(model, batch, packed=packed)``.
        decoder: the decoder whose output is compared; default ``model.get_decoder()``.
        fn: the name errors start with.

    Returns:
        None; raises ``TorchforgeError`` for a model that cannot be packed.

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> check_packable(tiny_llama(char_tokenizer()))  # Llama with sdpa: packable
    """
    inner = unwrap_model(model)
    if inner in _CHECKED:
        if _CHECKED[inner] is not None:
            raise TorchforgeError(_CHECKED[inner])
        return
    decoder = decoder if decoder is not None else inner.get_decoder()
    config = getattr(decoder, "config", None) or getattr(inner, "config", None)
    arch = f"{type(inner).__name__} (model_type {getattr(config, 'model_type', '?')!r})"
    impl = getattr(config, "_attn_implementation", None)
    reason = None
    stateful = _stateful_layer(decoder)
    if impl not in PACKABLE_ATTENTION:
        reason = (f"its attention implementation is {impl!r}; expected one of {list(PACKABLE_ATTENTION)}, which "
                  "read sequence boundaries from packed position ids")
    elif stateful is not None:
        reason = (f"its {stateful} layers mix tokens outside the attention mask (state would pass from one packed "
                  "sequence to the next); expected attention-only layers")
    else:
        _CHECKED[inner] = None  # the probe's own packed forward must not probe again
        try:
            reason = _probe(inner, model, run, decoder)
        finally:
            _CHECKED.pop(inner, None)
    if reason is not None:
        reason = f"{fn}: {arch} cannot run packed sequences (padding_free=True): {reason}; use padding_free=False"
    _CHECKED[inner] = reason
    if reason is not None:
        raise TorchforgeError(reason)


def _stateful_layer(decoder: nn.Module) -> str | None:
    """The class name of a layer that mixes tokens outside the attention mask, or None."""
    return next((type(m).__name__ for m in decoder.modules()
                 if isinstance(m, nn.Conv1d) or any(s in type(m).__name__ for s in _STATEFUL_LAYERS)), None)


def _probe(inner: nn.Module, model: nn.Module, run, decoder: nn.Module) -> str | None:
    """None when the packed forward's hidden states equal the padded one's on the probe batch."""
    owner = inner if hasattr(inner, "get_input_embeddings") else decoder
    embeddings = owner.get_input_embeddings() if hasattr(owner, "get_input_embeddings") else None
    vocab = int(getattr(embeddings, "num_embeddings", 0) or getattr(decoder.config, "vocab_size", 16))
    parameter = next(inner.parameters())
    batch = _probe_batch(vocab, parameter.device)
    if run is None:
        from torchforge.loop.policy import policy_log_probs

        def run(b, packed):
            return policy_log_probs(model, b, packed=packed)

    seen: dict[bool, torch.Tensor] = {}
    for packed in (False, True):
        handle = decoder.register_forward_hook(
            lambda m, a, o, p=packed: seen.__setitem__(p, o[0] if isinstance(o, tuple) else o.last_hidden_state))
        try:
            with torch.no_grad():
                run(batch, packed)
        except Exception as error:  # a forward that cannot take packed inputs at all
            return f"its packed forward raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        finally:
            handle.remove()
    packing = pack_sequences(batch)
    P = batch.prompt_tokens.shape[1]
    padded = seen[False][:, P - 1:].reshape(-1, seen[False].shape[-1])[packing.scatter].float()
    ours = packing.gather_hidden(seen[True])[0].float()
    low = (seen[True].dtype != torch.float32 or parameter.dtype != torch.float32
           or torch.is_autocast_enabled(parameter.device.type))
    tolerance = 3e-2 if low else 1e-4
    error = float((ours - padded).abs().mean() / padded.abs().mean().clamp(min=1e-12))
    if not error <= tolerance:
        return (f"on three probe sequences its packed hidden states differ from the padded ones by {error:.3g} "
                f"(mean relative; tolerance {tolerance:g}): tokens attend across sequence boundaries")
    return None
