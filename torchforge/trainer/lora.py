"""LoRA through peft: adapters on the policy, the reference as the same model with them off.

``RLTrainer(..., peft_config=LoraConfig(...))``, or a ``lora:`` block in a run's YAML::

    lora: {rank: 16, alpha: 32, dropout: 0.05, target_modules: all-linear, merge: false}

Only the adapter weights train (the optimizer holds nothing else). The KL reference is the
policy with its adapters disabled (peft's ``disable_adapter()`` context), so a run with a KL
penalty keeps one copy of the base weights instead of a second, frozen one. PPO's critic
(a copy of the decoder with a value head) gets its own adapters and only they and the head
train (:func:`apply_lora_to_module`). Checkpoints hold only what trains (the adapters, the
critic's head) and its optimizer state, with the step, scheduler and RNG states
(``save_checkpoint(..., trainable_only=True)``): resuming rebuilds the base weights from the
model the run was started with, then loads them, exactly. The final folder is a peft
adapter folder (``PeftModel.from_pretrained`` / ``AutoPeftModelForCausalLM`` / ``torchforge
eval --model``), and ``merge: true`` also writes the merged full weights to ``final-merged``.

peft is the optional extra ``torchforge[lora]``.

References:
    LoRA: Hu et al. 2021, https://arxiv.org/abs/2106.09685
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchforge.errors import InvalidArgumentError

__all__ = [
    "LORA_DEFAULTS",
    "adapters_disabled",
    "apply_lora",
    "apply_lora_to_module",
    "check_lora_settings",
    "export_merged",
    "merged_weights",
    "is_adapter_folder",
    "is_peft_model",
    "adapter_base_model",
    "load_adapter_model",
    "lora_config",
    "require_peft",
    "shard_lora",
]

# the keys of the YAML ``lora:`` block and their defaults
LORA_DEFAULTS: dict[str, Any] = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": "all-linear",
                                 "merge": False}


def require_peft() -> Any:
    """The ``peft`` module, or an ImportError that names the extra to install.

    Args:
        None.

    Returns:
        The imported ``peft`` module.

    Example:
        >>> require_peft().__name__
        'peft'
    """
    try:
        import peft
    except ImportError as error:
        raise ImportError(
            "LoRA needs peft, which is not installed; install the extra with `pip install 'torchforge[lora]'` "
            "(or `pip install peft`)"
        ) from error
    return peft


def check_lora_settings(settings: Any, *, where: str = "RLConfig") -> dict[str, Any] | None:
    """Validate a ``lora:`` block (without importing peft); returns it with the defaults filled in.

    Args:
        settings: None (no LoRA) or a mapping with keys among ``rank`` (int >= 1), ``alpha``
            (> 0), ``dropout`` (in [0, 1)), ``target_modules`` (``"all-linear"``, a module
            name or a list of them) and ``merge`` (bool).
        where: the name used in error messages.

    Returns:
        None, or the complete settings.

    Example:
        >>> check_lora_settings({"rank": 4})["alpha"]
        16.0
        >>> check_lora_settings({"rank": 0})
        Traceback (most recent call last):
        ...
        torchforge.errors.InvalidArgumentError: RLConfig: lora.rank=0; expected an int >= 1
    """
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise InvalidArgumentError(f"{where}: lora={settings!r}; expected None or a mapping with keys "
                                   f"among {sorted(LORA_DEFAULTS)}")
    unknown = sorted(set(settings) - set(LORA_DEFAULTS))
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown lora setting(s) {unknown}; expected keys among {sorted(LORA_DEFAULTS)}")
    out = {**LORA_DEFAULTS, **settings}

    def bad(key: str, expected: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{where}: lora.{key}={out[key]!r}; expected {expected}")

    number = (int, float)
    if isinstance(out["rank"], bool) or not isinstance(out["rank"], int) or out["rank"] < 1:
        raise bad("rank", "an int >= 1")
    if isinstance(out["alpha"], bool) or not isinstance(out["alpha"], number) or not out["alpha"] > 0:
        raise bad("alpha", "a number > 0")
    if isinstance(out["dropout"], bool) or not isinstance(out["dropout"], number) or not 0 <= out["dropout"] < 1:
        raise bad("dropout", "a number in [0, 1)")
    targets = out["target_modules"]
    if not (isinstance(targets, str) and targets or isinstance(targets, list) and targets
            and all(isinstance(t, str) and t for t in targets)):
        raise bad("target_modules", "'all-linear', a module name, or a non-empty list of module names")
    if not isinstance(out["merge"], bool):
        raise bad("merge", "true or false")
    return out


def lora_config(settings: dict[str, Any]) -> Any:
    """A ``peft.LoraConfig`` for a causal LM from a ``lora:`` block.

    Args:
        settings: the block (see :func:`check_lora_settings`).

    Returns:
        ``LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=...,
        task_type="CAUSAL_LM")``.

    Example:
        >>> lora_config({"rank": 4, "target_modules": ["q_proj", "v_proj"]}).r
        4
    """
    settings = check_lora_settings(settings)
    peft = require_peft()
    return peft.LoraConfig(r=settings["rank"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                           target_modules=settings["target_modules"], task_type="CAUSAL_LM")


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` (or the module inside its DDP wrapper) is a peft ``PeftModel``.

    Args:
        model: a module.

    Returns:
        bool (False when peft is not installed).

    Example:
        >>> is_peft_model(nn.Linear(2, 2))
        False
    """
    from torchforge.distributed import unwrap_model

    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(unwrap_model(model), PeftModel)


def apply_lora(model: nn.Module, peft_config: Any, *, seed: int = 0) -> nn.Module:
    """Wrap a causal LM with LoRA adapters; only the adapter weights require grad.

    The adapters' random initialization (peft: ``A`` random, ``B = 0``) is drawn from a
    generator seeded with ``seed``, not from the global RNG: two runs with the same seed
    start from the same adapters, and so does every process of a run (FSDP2 does not
    broadcast parameters).

    Args:
        model: a Hugging Face causal LM (not sharded yet, not already a PeftModel).
        peft_config: a ``peft.LoraConfig`` (or any peft config), or a ``lora:`` dict.
        seed: seeds the adapters' initialization (the run's ``config.seed``).

    Returns:
        The ``PeftModel``.

    Example:
        >>> from torchforge.trainer.demo import char_tokenizer, tiny_llama
        >>> policy = apply_lora(tiny_llama(char_tokenizer()), {"rank": 2})
        >>> sorted({n.split(".")[-2] for n, p in policy.named_parameters() if p.requires_grad})
        ['default']
    """
    peft = require_peft()
    if isinstance(peft_config, dict):
        peft_config = lora_config(peft_config)
    if not isinstance(peft_config, peft.PeftConfig):
        raise InvalidArgumentError(f"RLTrainer: peft_config is a {type(peft_config).__name__}; expected a "
                                   "peft.LoraConfig or a dict of lora settings")
    if is_peft_model(model):
        raise InvalidArgumentError("RLTrainer: the model is already a PeftModel and a peft_config was given; "
                                   "expected a plain model with peft_config, or the PeftModel without it")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, peft_config)


def apply_lora_to_module(module: nn.Module, peft_config: Any, *, seed: int = 0) -> nn.Module:
    """LoRA on an algorithm's own model (PPO's critic): its copied ``decoder`` freezes and gets adapters.

    The rule for every module of :meth:`Algorithm.modules` in a LoRA run: a module with a
    ``decoder`` (a copy of the policy's decoder, as :class:`torchforge.loop.ValueModel` holds)
    gets its own adapters on that decoder (the same ``LoraConfig`` as the policy, through
    ``peft.inject_adapter_in_model``), the decoder's weights freeze, and its other parameters
    (the value head) train fully. A module without a ``decoder`` is left as it is (it trains
    fully). The adapters are seeded with ``seed`` as in :func:`apply_lora`.

    Args:
        module: the algorithm's module (not sharded yet).
        peft_config: a ``peft.LoraConfig`` or a ``lora:`` dict.
        seed: seeds the adapters' initialization.

    Returns:
        ``module``, changed in place.

    Example:
        >>> from torchforge.loop import ValueModel
        >>> from torchforge.trainer.demo import char_tokenizer, tiny_llama
        >>> critic = apply_lora_to_module(ValueModel(tiny_llama(char_tokenizer())), {"rank": 2})
        >>> sorted({n.split(".")[0] if "lora_" not in n else "lora" for n, p in critic.named_parameters()
        ...         if p.requires_grad})
        ['head', 'lora']

    Note:
        The critic keeps its own frozen copy of the base decoder (two copies of the base in
        all, against three for full PPO with a KL reference). Sharing the policy's would mean
        switching between two adapters of one module for every critic forward, with the
        policy and critic no longer separate modules to shard; not done.
    """
    peft = require_peft()
    if isinstance(peft_config, dict):
        peft_config = lora_config(peft_config)
    decoder = getattr(module, "decoder", None)
    if not isinstance(decoder, nn.Module):
        return module
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(peft_config, decoder)
    for name, param in decoder.named_parameters():
        param.requires_grad_("lora_" in name)
    return module


def shard_lora(model: nn.Module, **shard_kwargs: Any) -> nn.Module:
    """:func:`torchforge.distributed.shard` for a PeftModel, with a ``generate`` that works under FSDP2.

    The PeftModel is the FSDP2 root, so a training forward (``PeftModel.forward``) gathers
    the root's own parameters (embedding, final norm, head) in FSDP's root hooks. peft's
    ``generate`` calls the base model's forward instead, past those hooks: under FSDP2 the
    returned model's ``generate`` gathers the root's parameters itself (``unshard``) for the
    whole generation and frees them after (``reshard``); the blocks gather their own as usual.

    Args:
        model: the PeftModel.
        shard_kwargs: the arguments of ``shard`` (``strategy``, ...).

    Returns:
        The sharded PeftModel (DDP: its wrapper).

    Example:
        >>> from torchforge.trainer.demo import char_tokenizer, tiny_llama
        >>> policy = apply_lora(tiny_llama(char_tokenizer()), {"rank": 2})
        >>> shard_lora(policy, strategy="none") is policy  # one process: nothing to do
        True
    """
    from torchforge.distributed import shard

    sharded = shard(model, **shard_kwargs)
    if shard_kwargs.get("strategy") != "fsdp" or not is_peft_model(sharded):
        return sharded
    peft_generate = sharded.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        sharded._get_fsdp_state()._lazy_init()  # what the root's first forward would do
        sharded.unshard()
        try:
            return peft_generate(*args, **kwargs)
        finally:
            sharded.reshard()

    sharded.generate = generate
    return sharded


@contextlib.contextmanager
def adapters_disabled(model: nn.Module | None) -> Iterator[None]:
    """Run the enclosed forwards with the LoRA adapters off (the base model); nothing for other models.

    Args:
        model: the policy (a PeftModel, plain, DDP-wrapped or FSDP2-sharded), or None.

    Returns:
        A context manager.

    Example:
        >>> with adapters_disabled(nn.Linear(2, 2)):  # not a PeftModel: no change
        ...     pass
    """
    if model is None or not is_peft_model(model):
        yield
        return
    from torchforge.distributed import unwrap_model

    with unwrap_model(model).disable_adapter():
        yield


def export_merged(model: nn.Module, tokenizer: Any, path: str | os.PathLike) -> None:
    """Write the policy with its adapters merged into the base weights as a plain Hugging Face folder.

    Every process calls this (the full state is gathered as for ``export_pretrained``);
    process 0 loads it into a fresh copy of the architecture, merges
    (``merge_and_unload``: ``W = W0 + (alpha / r) B A``) and saves. The trained model is
    left as it is.

    Args:
        model: the PeftModel (plain, DDP or FSDP2).
        tokenizer: saved alongside, or None.
        path: the output folder.

    Returns:
        None.

    Example:
        >>> export_merged(policy, tokenizer, "out/final-merged")  # doctest: +SKIP
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    from torchforge.distributed import barrier, is_main_process, unwrap_model

    peft = require_peft()
    inner = unwrap_model(model)
    if not is_peft_model(inner):
        raise InvalidArgumentError(f"export_merged: model is a {type(inner).__name__}; expected a peft PeftModel")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main_process():
        base = inner.get_base_model()
        config = inner.peft_config[inner.active_adapter]
        fresh = peft.get_peft_model(_auto_model_class(base.config).from_config(base.config), config)
        fresh.load_state_dict(full)
        merged = fresh.merge_and_unload()
        Path(path).mkdir(parents=True, exist_ok=True)
        merged.save_pretrained(str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
    barrier()


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA model's weights as a plain model's, adapters merged: what a generation engine loads.

    For each adapted linear layer ``W = W0 + scaling * B @ A`` (transposed for
    ``fan_in_fan_out`` layers such as GPT-2's Conv1D), computed from the full tensors of
    :func:`torchforge.distributed.full_weights` (so DDP and FSDP2 work: every rank consumes
    the iterator), named as in the base model (``base_model.model.`` and ``.base_layer``
    removed); the other parameters pass through. The trained model is not touched (no
    ``merge_adapter`` / ``unmerge_adapter``, whose round trip is not exact in floating point).

    Args:
        model: a peft ``PeftModel`` with one active LoRA adapter (plain, DDP or FSDP2).

    Returns:
        An iterator of ``(name, tensor)`` pairs.

    Example:
        >>> weights = dict(merged_weights(policy))  # doctest: +SKIP
    """
    from torchforge.distributed import full_weights, unwrap_model

    inner = unwrap_model(model)
    if not is_peft_model(inner):
        raise InvalidArgumentError(f"merged_weights: model is a {type(inner).__name__}; expected a peft PeftModel")
    adapter = inner.active_adapter
    held: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its base weight and A until B arrives
    for name, tensor in full_weights(model):
        plain = name.removeprefix("base_model.model.")
        if ".lora_" not in plain and ".base_layer." not in plain:
            yield plain, tensor
            continue
        layer = plain.split(".lora_")[0] if ".lora_" in plain else plain.split(".base_layer.")[0]
        if plain.endswith(".base_layer.bias"):
            yield f"{layer}.bias", tensor
            continue
        if ".lora_" in plain and f".{adapter}." not in plain:
            continue  # an inactive adapter
        part = "weight" if plain.endswith(".base_layer.weight") else ("A" if ".lora_A." in plain else "B")
        held.setdefault(layer, {})[part] = tensor
        if len(held[layer]) == 3:
            parts = held.pop(layer)
            module = inner.get_submodule(f"base_model.model.{layer}")
            if getattr(module, "use_dora", {}).get(adapter, False):
                raise InvalidArgumentError(f"merged_weights: {layer} uses DoRA; expected plain LoRA adapters")
            delta = (parts["B"].float() @ parts["A"].float()) * module.scaling[adapter]
            if getattr(module, "fan_in_fan_out", False):
                delta = delta.T
            yield f"{layer}.weight", (parts["weight"].float() + delta).to(parts["weight"].dtype)
    if held:
        raise InvalidArgumentError(f"merged_weights: {sorted(held)[:3]} have a LoRA part without the others; "
                                   "expected base_layer, lora_A and lora_B for each adapted layer")


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a peft adapter folder (it has ``adapter_config.json``).

    Args:
        path: a folder.

    Returns:
        bool.

    Example:
        >>> is_adapter_folder("/nonexistent")
        False
    """
    return (Path(path) / "adapter_config.json").is_file()


def _auto_model_class(config: Any) -> Any:
    """The Auto class that builds a model of ``config``: image-text-to-text for a
    vision-language model (a ``vision_config``), else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from torchforge.loop.vision import is_vision_config

    return AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM


def adapter_base_model(path: str | os.PathLike) -> str:
    """The base model an adapter folder was trained on (``base_model_name_or_path`` of its
    ``adapter_config.json``): a folder or a hub id.

    Args:
        path: a LoRA adapter folder.

    Returns:
        The base model's folder or id.

    Example:
        >>> adapter_base_model("out/final")  # doctest: +SKIP
        'models/tiny-qwen2-vl'
    """
    import json

    file = Path(path) / "adapter_config.json"
    base = json.loads(file.read_text()).get("base_model_name_or_path") if file.is_file() else None
    if not base:
        raise InvalidArgumentError(f"adapter folder {str(path)!r}: its adapter_config.json names no "
                                   "base_model_name_or_path; expected the folder a LoRA run writes (final/)")
    return str(base)


def load_adapter_model(path: str | os.PathLike) -> nn.Module:
    """A saved LoRA folder as a model: its base model (a causal LM, or a vision-language
    model when the base's config has a ``vision_config``) with the adapters.

    Args:
        path: a folder written by the trainer's final export with LoRA.

    Returns:
        The PeftModel, in eval mode.

    Example:
        >>> load_adapter_model("out/final")  # doctest: +SKIP
    """
    from transformers import AutoConfig

    peft = require_peft()
    base = adapter_base_model(path)
    config = AutoConfig.from_pretrained(base)
    model = _auto_model_class(config).from_pretrained(base, config=config)
    return peft.PeftModel.from_pretrained(model, str(path)).eval()
