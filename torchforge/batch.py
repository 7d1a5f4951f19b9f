"""The batch: one key vocabulary, and the tensor-or-batch calling convention.

A :class:`Batch` is a tensordict ``@tensorclass`` with ``batch_size=[B]`` whose fields
are the keys of DESIGN.md. Both ``batch.log_probs`` and ``batch["log_probs"]`` work, and
``Batch.from_tensordict`` / ``batch.to_tensordict()`` convert for free.

Every public primitive is wrapped by :func:`batch_args`: called with a ``Batch`` or a
``TensorDict`` as its first argument, it reads its tensor arguments from the batch keys
of the same name; called with tensors, it is the plain function.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from tensordict import TensorDictBase, is_tensorclass, tensorclass

from torchforge.errors import InvalidArgumentError, MissingKeyError

__all__ = ["Batch", "batch_args", "is_batch"]


@tensorclass(shadow=True)  # "values" is a batch key and a TensorDict method
class Batch:
    """A batch of B sampled sequences in the torchforge key vocabulary.

    Shapes: B sequences (= prompts x G generations), T response tokens.
    Every field is optional; unset fields are ``None``.

    Args:
        tokens: [B, T] int64 response token ids (right-padded).
        mask: [B, T] bool, True where the token counts in the loss.
        log_probs: [B, T] log-probs under the policy being trained (carries grad).
        old_log_probs: [B, T] log-probs under the policy that produced the samples.
        ref_log_probs: [B, T] log-probs under the frozen reference policy.
        rollout_log_probs: [B, T] log-probs reported by the generation engine.
        rewards: [B] or [B, T] sequence- or token-level rewards.
        values, old_values, returns: [B, T] critic outputs and targets.
        advantages: [B] or [B, T] advantages.
        prompt_tokens: [B, P] int64 prompt ids (left-padded).
        prompt_mask: [B, P] bool, True on real prompt tokens.
        truncated: [B] bool, True where generation hit the length limit.
        policy_version: [B] int64, the version of the weights that sampled each sequence
            (the optimizer step after which the generation engine got them).
        vision: a ``TensorDict`` [B] of each row's vision inputs for a vision-language
            model (``pixel_values``, ``image_grid_thw``, ...: ``vision[key]["data"]`` [B, N, ...]
            zero-padded, ``vision[key]["length"]`` [B]; :mod:`torchforge.loop.vision`), or None.
        batch_size: ``[B]``.

    Returns:
        A tensorclass read by attribute (``batch.log_probs``) or by key
        (``batch["log_probs"]``); ``batch.to_tensordict()`` gives a plain ``TensorDict``.

    Example:
        >>> import torch
        >>> batch = Batch(tokens=torch.zeros(2, 3, dtype=torch.long),
        ...               mask=torch.ones(2, 3, dtype=torch.bool), batch_size=[2])
        >>> batch["mask"].shape == batch.mask.shape
        True
    """

    tokens: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    log_probs: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    rewards: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    old_values: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    prompt_tokens: Optional[torch.Tensor] = None
    prompt_mask: Optional[torch.Tensor] = None
    truncated: Optional[torch.Tensor] = None
    policy_version: Optional[torch.Tensor] = None
    vision: Optional[TensorDictBase] = None


# A tensorclass indexes along its batch dimensions only; DESIGN.md also promises
# ``batch["log_probs"]``, so string keys are routed to get / set.
_index_get = Batch.__getitem__
_index_set = Batch.__setitem__


def _getitem(self, index):
    if isinstance(index, str):
        return self.get(index)
    return _index_get(self, index)


def _setitem(self, index, value):
    if isinstance(index, str):
        self.set(index, value)
        return
    _index_set(self, index, value)


Batch.__getitem__ = _getitem
Batch.__setitem__ = _setitem


def is_batch(x) -> bool:
    """True for a :class:`Batch`, any tensorclass, or a ``TensorDict``.

    Args:
        x: any object.

    Returns:
        bool: whether ``x`` can be read from by key.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> is_batch(TensorDict({"mask": torch.ones(2, 3)}, batch_size=[2])), is_batch(torch.ones(2))
        (True, False)
    """
    return isinstance(x, TensorDictBase) or is_tensorclass(x)


def batch_args(fn):
    """Let ``fn`` take a ``Batch`` / ``TensorDict`` as its first argument.

    The tensor arguments of ``fn`` are its positional-or-keyword parameters; they are
    named after batch keys. Given a batch first, each one not passed explicitly by
    keyword is read from the batch key of the same name (optional ones may be absent).
    Hyperparameters stay keyword-only.

    Args:
        fn: a primitive whose tensor parameters come before ``*``.

    Returns:
        The wrapped function, with ``fn``'s name, docstring and signature.

    Example:
        >>> import torch
        >>> @batch_args
        ... def total(log_probs, mask, *, scale=1.0):
        ...     return scale * (log_probs * mask).sum()
        >>> batch = Batch(log_probs=torch.ones(2, 2), mask=torch.ones(2, 2), batch_size=[2])
        >>> total(batch, scale=2.0), total(torch.ones(2, 2), torch.ones(2, 2))
        (tensor(8.), tensor(4.))
    """
    signature = inspect.signature(fn)
    tensor_params = [
        p for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not args or not is_batch(args[0]):
            return fn(*args, **kwargs)
        data, rest = args[0], args[1:]
        if rest:
            raise InvalidArgumentError(
                f"{name}: got a batch as first argument and {len(rest)} more positional "
                "argument(s); with a batch, pass tensors by keyword to override its keys"
            )
        for param in tensor_params:
            if param.name in kwargs:
                continue
            value = data.get(param.name, None)
            if value is not None:
                kwargs[param.name] = value
            elif param.default is inspect.Parameter.empty:
                keys = sorted(k for k in data.keys() if data.get(k, None) is not None)
                raise MissingKeyError(
                    f"{name}: the batch has no key {param.name!r} (keys: {keys}); "
                    f"expected keys {[p.name for p in tensor_params]}"
                )
        return fn(**kwargs)

    return wrapper
