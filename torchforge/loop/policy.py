"""Token log-probs, entropy and values from a model's own forward, without [B, T, V] logits.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from torchforge.batch import Batch
from torchforge.distributed import unwrap_model
from torchforge.errors import TorchforgeError
from torchforge.log_probs import fused_token_log_probs

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
        >>> from torchforge.loop.rollout import rollout
        >>> from torchforge.trainer.demo import char_tokenizer, tiny_llama
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
        >>> from torchforge.trainer.demo import char_tokenizer, tiny_llama
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
