"""Token log-probs, entropy and values from a model's own forward, without [B, T, V] logits.

The log-probs are those of the logits the model itself returns, head transform included
(:func:`head_transform`), checked once per model against the model's own output
(:func:`policy_log_probs`); :func:`rollout_log_prob_gap` is the canary that compares
them with the sampler's.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchforge.batch import Batch
from torchforge.distributed import unwrap_model
from torchforge.errors import ShapeError, TorchforgeError, reraise_as, shape_str
from torchforge.kl import approx_kl
from torchforge.log_probs import chunk_rows, fused_token_log_probs, row_chunks
from torchforge.loop.packing import check_packable, pack_sequences
from torchforge.loop.vision import placeholder_ids, token_type_inputs, uses_mrope, vision_model_inputs
from torchforge.reduce import masked_mean

# --- the head's logit transform ----------------------------------------------------------

# How each Hugging Face causal LM transforms its head's logits z, as
# z' = softcap * tanh(logit_scale * z / softcap) (z' = logit_scale * z without a cap):
# (config attribute, +1 if the model multiplies z by it, -1 if it divides), read from the
# text config (``config.get_text_config()``: Gemma3ForConditionalGeneration's text config).
_LOGIT_SCALES = (
    ("logit_scale", +1),  # Cohere, Cohere2, Cohere2-MoE, Command R: logits * logit_scale
    ("lm_head_multiplier", +1),  # Falcon-H1: lm_head(h) * lm_head_multiplier
    ("output_multiplier", +1),  # MuseSpark / MuseGlimmer: before the soft cap
    ("logits_mup_width_multiplier", -1),  # Inkling: lm_head(h / m), a head without bias
)
# ``logits_scaling`` divides (Granite and its MoE / hybrid / SWA variants; MiniCPM3 divides
# the hidden states, the same for its bias-free head), except in these, which multiply:
_LOGITS_SCALING_MULTIPLIES = ("hyperclovax",)
# the tanh soft cap: Gemma 2 / 3 / 3n / 4, VaultGemma, nanochat, ...; RecurrentGemma
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap")


def head_transform(model: nn.Module) -> tuple[float | None, float | None]:
    """The ``(logit_scale, softcap)`` of a causal LM's head, read from its config.

    The model returns ``z' = softcap * tanh(logit_scale * z / softcap)`` (``z' =
    logit_scale * z`` without a cap) for its head's logits ``z = lm_head(hidden)``;
    :func:`torchforge.log_probs.fused_token_log_probs` takes the two numbers as they are.
    Read from the model's text config:

    - ``final_logit_softcapping`` (Gemma 2, Gemma 3 / 3n / 4, VaultGemma, nanochat) or
      ``logits_soft_cap`` (RecurrentGemma): ``softcap``;
    - ``logit_scale`` (Cohere, Cohere2): ``logit_scale``; ``lm_head_multiplier`` (Falcon-H1)
      and ``output_multiplier`` (applied before the cap) multiply it too;
    - ``logits_scaling`` (Granite, its MoE / hybrid variants, MiniCPM3): ``1 /
      logits_scaling``; HyperCLOVA X multiplies by it instead;
    - ``logits_mup_width_multiplier`` (Inkling): ``1 / logits_mup_width_multiplier``.

    Args:
        model: a Hugging Face causal LM (plain, DDP or FSDP2), or any module; one without a
            config has no transform.

    Returns:
        ``(logit_scale, softcap)``, each a float or None (none).

    Example:
        >>> from transformers import Gemma2Config, Gemma2ForCausalLM
        >>> config = Gemma2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...                       num_attention_heads=2, num_key_value_heads=1, head_dim=4)
        >>> head_transform(Gemma2ForCausalLM(config))
        (None, 30.0)
    """
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    scale = 1.0
    for name, sign in _LOGIT_SCALES:
        value = getattr(text, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            scale = scale * value if sign > 0 else scale / value
    value = getattr(text, "logits_scaling", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        multiplies = model_type.startswith(_LOGITS_SCALING_MULTIPLIES)
        scale = scale * value if multiplies else scale / value
    softcap = None
    for name in _SOFTCAPS:
        value = getattr(text, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            softcap = float(value)
            break
    return (None if scale == 1.0 else float(scale)), softcap


def _transformed(z: torch.Tensor, logit_scale: float | None, softcap: float | None) -> torch.Tensor:
    """``z' = softcap * tanh(logit_scale * z / softcap)`` in plain ops (the head path)."""
    if logit_scale is not None:
        z = z * logit_scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


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


def _output_logits(output: Any) -> torch.Tensor | None:
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


@contextlib.contextmanager
def _hooks(*handles):
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# How each model's log-probs are computed, decided on its first call (_check_position):
# (path, logit_scale, softcap), path "fused" (the kernel) or "head" (the model's head module,
# chunk by chunk). Keyed by the model itself (the module inside DDP), forgotten with it.
_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fusable(head: nn.Module) -> bool:
    """An ``nn.Linear`` head with Linear's own forward: the fused kernel can read it."""
    return isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward


def _head_log_probs(head, hidden, tokens, *, temperature, logit_scale, softcap, chunk_size, return_entropy):
    """Log-probs (and entropy) through the head module itself, chunk by chunk: ``z =
    head(hidden)``, ``z'`` transformed, ``log_softmax(z' / temperature)``, gathered.

    Each chunk's logits are recomputed in the backward (activation checkpointing), so
    memory stays at one chunk of logits, as in the fused kernel, at the cost of one more
    head forward per chunk.
    """
    B, T, H = hidden.shape
    flat_hidden, flat_tokens = hidden.reshape(B * T, H), tokens.reshape(B * T)

    def one_chunk(h, tok):
        z = _transformed(head(h).float(), logit_scale, softcap) / temperature
        log_p = torch.log_softmax(z, dim=-1)
        log_probs = log_p.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        # -sum p log p, with grad (an entropy bonus backpropagates through it); the clamp
        # keeps 0 * log 0 = 0 and its gradient finite at a -inf logit
        entropy = -(log_p.exp() * log_p.clamp(min=torch.finfo(log_p.dtype).min)).sum(-1)
        return log_probs, entropy

    weight = getattr(head, "weight", None)
    V = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 1
    log_probs, entropy = [], []
    with reraise_as("policy_log_probs"):
        rows = chunk_rows(V, chunk_size=chunk_size)
    for r in row_chunks(B * T, rows):
        if torch.is_grad_enabled():
            lp, ent = checkpoint(one_chunk, flat_hidden[r], flat_tokens[r], use_reentrant=False)
        else:
            lp, ent = one_chunk(flat_hidden[r], flat_tokens[r])
        log_probs.append(lp)
        entropy.append(ent)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    log_probs = (torch.cat(log_probs) if log_probs else empty).view(B, T)
    entropy = (torch.cat(entropy) if entropy else empty).view(B, T)
    return (log_probs, entropy) if return_entropy else log_probs


def _check_position(inner, head, hidden, logits, *, temperature, logit_scale, softcap):
    """``(path, logit_scale, softcap)`` whose log-probs at one position equal the model's
    own (its ``logits_to_keep=1`` output ``logits`` [V], from ``hidden`` [H]).

    Tried in order: the fused kernel with the transform read from the config (the
    expected case, silent), then with no transform, then the head module itself, chunk by
    chunk, with either; anything but the first warns once, naming the architecture. None
    matching raises.
    """
    arch = f"{type(inner).__name__} (model_type {getattr(getattr(inner, 'config', None), 'model_type', '?')!r})"
    read = (logit_scale, softcap)
    transforms = [read] if read == (None, None) else [read, (None, None)]
    errors = {}
    with torch.no_grad():
        reference = torch.log_softmax(logits.float() / temperature, dim=-1)
        V = reference.shape[0]
        # the most likely tokens (where a soft cap bites) and tokens across the vocabulary
        ids = torch.cat([reference.topk(min(8, V)).indices,
                         torch.linspace(0, V - 1, min(8, V), device=logits.device).long()]).unique()
        # float32 noise, or the rounding of the model's own (bf16) logits
        tolerance = 1e-4 + 4 * torch.finfo(logits.dtype).eps * float(logits.float().abs().max()) / temperature
        h = hidden.reshape(1, 1, -1).expand(1, len(ids), -1)
        for path in ("fused", "head") if _fusable(head) else ("head",):
            for scale, cap in transforms:
                if path == "fused":
                    ours = fused_token_log_probs(h, head.weight, ids.unsqueeze(0), bias=head.bias,
                                                 temperature=temperature, logit_scale=scale, softcap=cap)
                else:
                    ours = _head_log_probs(head, h, ids.unsqueeze(0), temperature=temperature, logit_scale=scale,
                                           softcap=cap, chunk_size=None, return_entropy=False)
                errors[(path, scale, cap)] = error = float((ours[0] - reference[ids]).abs().max())
                if error > tolerance:
                    continue
                if (path, scale, cap) != ("fused", *read):
                    first = next(iter(errors.items()))
                    warnings.warn(
                        f"policy_log_probs: {arch}: the fused log-probs "
                        f"{'' if _fusable(head) else f'cannot be computed (its head is a {type(head).__name__}) '}"
                        f"with the transform read from its config (logit_scale={logit_scale}, softcap={softcap}) "
                        f"{'' if not _fusable(head) else f'differ from its own by up to {first[1]:.3g} nats '}"
                        f"at one position (tolerance {tolerance:.2g}); computing them "
                        f"{'with the fused kernel' if path == 'fused' else 'through its head module, chunk by chunk (slower; memory stays bounded)'}"
                        f" and logit_scale={scale}, softcap={cap}, which match",
                        RuntimeWarning, stacklevel=4,
                    )
                return path, scale, cap
    tried = "; ".join(f"{p} logit_scale={a} softcap={c}: {e:.3g}" for (p, a, c), e in errors.items())
    raise TorchforgeError(
        f"policy_log_probs: {arch}: the log-probs torchforge computes differ from the model's own "
        f"(log_softmax of forward().logits) at one position beyond the tolerance {tolerance:.2g} nats ({tried}): "
        "the model transforms its logits after the head in a way torchforge does not read; expected a head "
        "whose logits the model returns as they are, or one of the transforms of torchforge.loop.head_transform"
    )


def policy_log_probs(
    model: nn.Module,
    batch: Batch,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens (and entropies), without materializing logits.

    Runs the model's own forward (so FSDP2 / DDP hooks fire) with ``logits_to_keep=1``,
    captures the decoder's last hidden states, and computes ``fused_token_log_probs``
    from them, the LM head and the head's transform (:func:`head_transform`: Gemma's soft
    cap, Granite's and Cohere's scales, ...) *inside* that forward, while FSDP still holds
    the gathered head weight; the result is returned through the forward so that the
    backward reaches every sharded parameter.

    On the first call for a model, the fused log-probs at one position (the last, of the
    first sequence) are compared with the model's own ``logits_to_keep=1`` output, which
    that forward computes anyway. On a mismatch beyond float32 noise (or the rounding of
    bf16 logits), the log-probs are computed through the model's head module instead,
    chunk by chunk (memory stays bounded), with one warning naming the architecture; if
    those differ too, a ``TorchforgeError`` says so. The choice is kept for the model.

    Args:
        model: a Hugging Face causal LM (``get_decoder()`` / ``get_output_embeddings()``),
            plain, DDP or FSDP2.
        batch: a Batch with ``prompt_tokens``, ``prompt_mask``, ``tokens`` [B, T]; for a
            vision-language model also ``vision`` (:mod:`torchforge.loop.vision`), whose
            inputs go to the forward (Qwen2-VL's 3D positions are then the model's own); the
            image tokens of a multi-turn episode's observations (mask gaps) are image slots too.
        temperature: the sampling temperature (the training distribution must be the
            sampling one).
        return_entropy: also return the per-token entropy (with grad when grad is enabled,
            as the log-probs: an entropy bonus backpropagates through it).
        chunk_size: rows per chunk of the fused kernel; default automatic.
        packed: run the forward padding-free (:func:`torchforge.loop.pack_sequences`):
            each row's real tokens packed end to end with its own position ids, so no
            compute goes to padding; the results equal the padded forward's on every token
            up to a row's last counted one, and are 0 after it (where the padded forward
            computes values no loss reads). A model that cannot be packed is refused
            (:func:`torchforge.loop.check_packable`, once per model).

    Returns:
        ``(log_probs, entropy)``: float32 [B, T] (with grad when grad is enabled), and
        float32 [B, T] or None.

    Example:
        >>> from torchforge.loop.rollout import rollout
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> tokenizer = char_tokenizer()
        >>> model = tiny_llama(tokenizer)
        >>> batch = rollout(model, tokenizer, ["12="], num_generations=2, max_new_tokens=3, seed=0)
        >>> log_probs, entropy = policy_log_probs(model, batch, return_entropy=True)
        >>> log_probs.shape == batch.tokens.shape, bool((entropy >= 0).all())
        (True, True)

    Note:
        The check compares one position: with small weights (logits of a few nats) a
        transform hardly changes the log-probs, so a model whose transform torchforge
        misreads can pass it. :func:`rollout_log_prob_gap`, which the trainer logs on every
        step, is the canary for that and any other mismatch with the sampler.
    """
    inner = unwrap_model(model)
    decoder, head = inner.get_decoder(), inner.get_output_embeddings()
    if decoder is None or head is None:
        raise TorchforgeError(
            f"policy_log_probs: {type(inner).__name__} has no decoder / output embeddings; expected a "
            "Hugging Face causal LM"
        )
    logit_scale, softcap = head_transform(inner)  # checked against the model's own logits once
    packing = None
    vision = batch.get("vision") if "vision" in batch.keys() else None
    if packed and vision is not None:
        raise TorchforgeError(
            f"policy_log_probs: packed=True with a batch of images ({type(inner).__name__}): vision-language models "
            "are not packed (their image positions and vision inputs do not pack exactly); expected packed=False "
            "(RLConfig(padding_free=False))"
        )
    if packed:
        check_packable(model, fn="policy_log_probs")
        packing = pack_sequences(batch)
        # no attention mask and no cache: the attention reads the boundaries from the position ids
        input_ids, attention_mask, position_ids = packing.input_ids, None, packing.position_ids
    else:
        input_ids, attention_mask, position_ids = _model_inputs(batch)
        placeholders = placeholder_ids(inner)
        if placeholders:  # a sampled image placeholder ended its turn: a plain token in its place
            P0 = batch.prompt_tokens.shape[1]
            sampled = torch.isin(input_ids[:, P0:], torch.tensor(placeholders, device=input_ids.device))
            # an observation's image tokens (a mask gap before a later model token) are real image slots
            mask = batch.mask.to(sampled.device)
            observation = (~mask & (mask.flip(-1).cumsum(-1).flip(-1) > 0))[:, :-1]
            input_ids = torch.cat([input_ids[:, :P0], input_ids[:, P0:].masked_fill(sampled & ~observation, 0)], dim=1)
        if vision is not None and uses_mrope(inner):  # 3D positions: the model's own, from the image grids
            position_ids = None
    P = batch.prompt_tokens.shape[1]
    captured: dict[str, torch.Tensor] = {}

    def keep_hidden(module, args, output):
        captured["hidden"] = _last_hidden(output)

    def fused_head(module, args, kwargs, output):
        full = captured.pop("hidden")
        # packed: [1, N, H] at the positions predicting each kept token; padded: [B, T, H]
        hidden = packing.gather_hidden(full) if packing is not None else full[:, P - 1:]
        tokens = packing.targets[None] if packing is not None else batch.tokens
        choice = _PATHS.get(inner)
        if choice is None:
            logits = _output_logits(output)
            if logits is None or hidden.numel() == 0:
                choice = ("fused" if _fusable(head) else "head", logit_scale, softcap)
            else:  # the last position of the first row, whose logits the model returned
                choice = _check_position(inner, head, full[0, -1], logits[0, -1], temperature=temperature,
                                         logit_scale=logit_scale, softcap=softcap)
                _PATHS[inner] = choice
        path, scale, cap = choice
        if path == "fused":
            result = fused_token_log_probs(
                hidden, head.weight, tokens, bias=head.bias, temperature=temperature,
                logit_scale=scale, softcap=cap, chunk_size=chunk_size, return_entropy=return_entropy,
            )
        else:
            result = _head_log_probs(head, hidden, tokens, temperature=temperature, logit_scale=scale,
                                     softcap=cap, chunk_size=chunk_size, return_entropy=return_entropy)
        result = result if return_entropy else (result,)
        if packing is not None:  # back to [B, T]: fresh tensors
            result = tuple(packing.unpack(r[0]) for r in result)
        else:  # fresh tensors, not views: FSDP hooks its pre-backward on what the forward returns
            result = tuple(r.clone() for r in result)
        return result if return_entropy else (result[0], None)

    # prepend: the head runs before FSDP's post-forward hook reshards the root parameters
    with _hooks(decoder.register_forward_hook(keep_hidden),
                inner.register_forward_hook(fused_head, prepend=True, with_kwargs=True)):
        log_probs, entropy = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            logits_to_keep=1, use_cache=False, **_vision_kwargs(inner, vision, input_ids),
        )
    return log_probs, entropy


def _vision_kwargs(inner: nn.Module, vision: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The vision inputs of a batch with images (:mod:`torchforge.loop.vision`), as the model's forward
    takes them; {} for a text batch."""
    kwargs = vision_model_inputs(vision)
    if not kwargs:
        return {}
    device = input_ids.device
    # every image token left is an image slot (the prompt's, and a multi-turn observation's)
    return {**{k: v.to(device) for k, v in kwargs.items()}, **token_type_inputs(inner, input_ids, input_ids.shape[1])}


# --- the canary: the sampler's log-probs against the trainer's ---------------------------

# mean |log_probs - rollout_log_probs| above which rollout_log_prob_gap warns (once)
LOG_PROB_GAP_WARNING = 0.05
_gap_warned = False


def rollout_log_prob_gap(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the sampler's, on the same tokens.

    ``log_prob_gap = masked_mean(|log_probs - rollout_log_probs|, mask)`` and ``kl =
    masked_mean(k3, mask)`` with ``k3 = exp(-log_ratio) - 1 + log_ratio``, ``log_ratio =
    rollout_log_probs - log_probs``: the sample estimate of KL(sampler || trainer) (the
    tokens were drawn by the sampler). Both are ~0 (float32 noise) when sampling and
    training share weights, dtype and head; a gap means the trainer optimizes another
    distribution than the one it samples (a head transform skipped, a bf16 sampler, top-k /
    top-p truncation, stale weights). Warns once per process when ``log_prob_gap`` exceeds
    ``LOG_PROB_GAP_WARNING`` (0.05 nats).

    Args:
        log_probs: [B, T] float log-probs of the tokens under the trained policy, before any
            update (the first pass); detached here.
        rollout_log_probs: [B, T] float log-probs the sampler reported for the same tokens.
        mask: [B, T] bool, True where the token counts.

    Returns:
        ``{"rollout/log_prob_gap": scalar, "rollout/kl": scalar}``, float32, no grad.

    Example:
        >>> import torch
        >>> log_probs = torch.tensor([[-1.0, -2.0]])
        >>> gap = rollout_log_prob_gap(log_probs, log_probs - 0.01, torch.tensor([[True, True]]))
        >>> round(float(gap["rollout/log_prob_gap"]), 4)
        0.01

    References:
        The mismatch between inference-engine and trainer probabilities in RL for LLMs:
        Yao et al., "Your efficient RL framework secretly brings you off-policy RL
        training" (2025), https://fengyao.notion.site/off-policy-rl ; k3: Schulman,
        "Approximating KL divergence", http://joschu.net/blog/kl-approx.html
    """
    global _gap_warned
    if log_probs.shape != rollout_log_probs.shape or mask.shape != log_probs.shape:
        raise ShapeError(
            f"rollout_log_prob_gap: log_probs {shape_str(log_probs)}, rollout_log_probs "
            f"{shape_str(rollout_log_probs)} and mask {shape_str(mask)}; expected three equal [B, T] shapes"
        )
    with torch.no_grad():
        log_probs, rollout_log_probs = log_probs.detach().float(), rollout_log_probs.detach().float()
        gap = masked_mean((log_probs - rollout_log_probs).abs(), mask)
        kl = masked_mean(approx_kl(rollout_log_probs, log_probs, estimator="k3"), mask)
    if not _gap_warned and float(gap) > LOG_PROB_GAP_WARNING:
        _gap_warned = True
        warnings.warn(
            f"rollout_log_prob_gap: the trainer's log-probs differ from the sampler's by {float(gap):.3g} nats "
            f"per token on average (KL {float(kl):.3g}); expected ~0 when sampling and training share weights "
            "and dtype: the trainer optimizes another distribution than the one it samples",
            RuntimeWarning, stacklevel=2,
        )
    return {"rollout/log_prob_gap": gap, "rollout/kl": kl}


class ValueModel(nn.Module):
    """A critic: the policy's decoder (a copy) and a scalar head, ``values = head(hidden)``.

    ``forward(batch, packed=None)`` runs padding-free when ``packed`` (default: the
    module's ``packed`` attribute) is True, as :func:`policy_log_probs` does: the values
    equal the padded forward's up to each row's last counted token and are 0 after it.

    Args:
        policy: the causal LM to copy the decoder from (its weights initialize the critic).
        packed: the default of ``forward``'s ``packed``.

    Returns:
        A module whose ``forward(batch)`` returns float32 [B, T] values, ``values[:, t]``
        the value of the state before completion token t.

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> critic = ValueModel(tiny_llama(char_tokenizer()))
        >>> critic.head.out_features
        1
    """

    def __init__(self, policy: nn.Module, *, packed: bool = False) -> None:
        super().__init__()
        import copy

        self.packed = packed

        inner = unwrap_model(policy)
        self.decoder = copy.deepcopy(inner.get_decoder())
        self.head = nn.Linear(inner.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # shard() finds the decoder blocks through this, as for a Hugging Face model
        self._no_split_modules = list(getattr(inner, "_no_split_modules", None) or [])

    def forward(self, batch: Batch, packed: bool | None = None) -> torch.Tensor:
        packed = self.packed if packed is None else packed
        if packed:  # the probe runs the decoder inside this forward, as the values do (FSDP2)
            check_packable(self, self._values, decoder=self.decoder, fn="ValueModel")
        return self._values(batch, packed)

    def _values(self, batch: Batch, packed: bool) -> torch.Tensor:
        if packed:
            packing = pack_sequences(batch)
            hidden = _last_hidden(self.decoder(input_ids=packing.input_ids, position_ids=packing.position_ids,
                                               attention_mask=None, use_cache=False))
            return packing.unpack(self.head(packing.gather_hidden(hidden))[0, :, 0].float())
        input_ids, attention_mask, position_ids = _model_inputs(batch)
        P = batch.prompt_tokens.shape[1]
        hidden = _last_hidden(self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                                           position_ids=position_ids, use_cache=False))
        return self.head(hidden[:, P - 1:])[..., 0].float().clone()  # not a view: FSDP hooks the output
