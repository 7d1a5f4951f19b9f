"""Generation engines: one contract for whatever samples the completions.

An engine turns prompt token ids into completion token ids, with the log-prob of every
sampled token under the distribution that drew it, tagged with the version of the weights
that drew it. Tokens in, tokens out: no engine ever sees or re-tokenizes text.

    engine.generate(prompt_token_ids, seeds=seeds, settings=settings) -> [Completion, ...]
    engine.update_weights(weights, version=step)   # (name, tensor) pairs in Hugging Face names

:func:`torchforge.loop.rollout`, :func:`torchforge.loop.rollout_episodes` and
:func:`torchforge.loop.evaluate` take an ``engine=``; :class:`HFEngine` (Hugging Face
``generate`` with the seeded sampler, :mod:`torchforge.loop.sampling`) is the default and
is exact. :class:`torchforge.loop.vllm_engine.VLLMEngine` (vLLM in process) and
:class:`torchforge.loop.vllm_engine.VLLMServerEngine` (a ``vllm serve`` process) are the
others. :mod:`torchforge.testing.engines` holds the conformance checks any engine must pass.

The seed of a sample is one int per request (:func:`request_seeds`): completion ``g`` of
prompt ``i`` is drawn from ``(seed, prompt id, g)`` alone, so a sample does not depend on
the batch around it, with any engine that honours per-request seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch
from torch import nn
from transformers import GenerationConfig

from torchforge.distributed import generation_kwargs, unwrap_model
from torchforge.errors import InvalidArgumentError
from torchforge.loop.sampling import SeededSampler, sample_keys

__all__ = ["SamplingSettings", "Completion", "GenerationEngine", "HFEngine", "request_seeds", "make_engine",
           "check_engine_settings", "ENGINES"]

#: the engines ``RLConfig(engine=...)`` names
ENGINES = ("hf", "hf-process", "vllm", "vllm-server")


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample: the same settings mean the same distribution on every engine.

    The distribution of a token is ``softmax(filter(logits / temperature))``, where the
    filter keeps the ``top_k`` most likely tokens (0: all), then the smallest set of most
    likely tokens holding ``top_p`` of the mass (1: all). Nothing else: no repetition
    penalty, no minimum length, no defaults from a model's ``generation_config``.

    Args:
        max_new_tokens: the length limit of a completion (>= 1).
        temperature: > 0; the trainer's log-probs must use the same one.
        top_p: in (0, 1].
        top_k: >= 0; 0 disables it. ``top_k=1`` is greedy decoding.
        stop_token_ids: the ids that end a completion (the stop token is part of it).

    Returns:
        Frozen settings, checked.

    Example:
        >>> SamplingSettings(max_new_tokens=4, stop_token_ids=(2,)).top_k
        0
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        fn = "SamplingSettings"
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise InvalidArgumentError(f"{fn}: max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise InvalidArgumentError(f"{fn}: temperature must be > 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidArgumentError(f"{fn}: top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise InvalidArgumentError(f"{fn}: top_k must be an int >= 0, got {self.top_k!r}")
        if not self.stop_token_ids:
            raise InvalidArgumentError(f"{fn}: stop_token_ids is empty; expected at least one stop id")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))


@dataclass(frozen=True)
class Completion:
    """One sampled completion, as every engine returns it.

    Args:
        token_ids: the sampled ids, up to and including the first stop token when one came.
        log_probs: ``log p(token)`` of each of them under the distribution that drew it
            (temperature and top-k / top-p applied), one float per token.
        truncated: True when no stop token came within ``max_new_tokens``.
        weights_version: the version of the weights that sampled it (the optimizer step
            after which they were synced; 0 for the initial weights).

    Returns:
        A frozen record.

    Example:
        >>> Completion([5, 2], [-0.1, -0.2], truncated=False, weights_version=0).token_ids
        [5, 2]
    """

    token_ids: list[int]
    log_probs: list[float]
    truncated: bool
    weights_version: int


@runtime_checkable
class GenerationEngine(Protocol):
    """What the loop needs from a sampler; any object with these members is an engine.

    ``generate`` samples one completion per request: ``prompt_token_ids[r]`` with seed
    ``seeds[r]`` (the same seed, prompt, settings and weights give the same completion).
    ``update_weights`` loads new weights, by Hugging Face parameter name, and sets
    ``weights_version``; every completion sampled after it carries that version. Under
    ``torchrun`` every process calls both, with its own requests (collectives may run inside).
    :func:`torchforge.testing.check_engine` checks an engine against this contract.

    Args:
        prompt_token_ids: (``generate``) one list of prompt ids per request, unpadded.
        seeds: (``generate``) one int per request.
        settings: (``generate``) the :class:`SamplingSettings` of every request.
        weights: (``update_weights``) ``(name, tensor)`` pairs, Hugging Face names.
        version: (``update_weights``) the weights' version (the optimizer step).

    Returns:
        ``generate``: one :class:`Completion` per request, in request order.

    Example:
        >>> class Echo:  # repeats the prompt's last token; log p = 0 (a point mass)
        ...     weights_version = 0
        ...     def generate(self, prompt_token_ids, *, seeds, settings):
        ...         return [Completion([p[-1]], [0.0], truncated=True, weights_version=self.weights_version)
        ...                 for p in prompt_token_ids]
        ...     def update_weights(self, weights, *, version):
        ...         self.weights_version = version
        >>> isinstance(Echo(), GenerationEngine)
        True
        >>> Echo().generate([[3, 4]], seeds=[0], settings=SamplingSettings(max_new_tokens=1, stop_token_ids=(2,)))[0].token_ids
        [4]
    """

    weights_version: int

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], *, seeds: Sequence[int],
                 settings: SamplingSettings) -> list[Completion]:
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        ...


def request_seeds(seed: int, prompt_ids: Sequence[int] | torch.Tensor, num_generations: int) -> list[int]:
    """One seed per request: completion ``g`` of prompt ``prompt_ids[i]`` gets request
    ``i * G + g`` and a seed that depends on ``(seed, prompt_ids[i], g)`` only.

    Args:
        seed: the run's sampling seed.
        prompt_ids: N global ids of the prompts (their position in the data stream).
        num_generations: G.

    Returns:
        N * G ints (int64 values; an engine maps them into its own seed range).

    Example:
        >>> a = request_seeds(0, [7, 8], 2)
        >>> len(a), a[2:] == request_seeds(0, [8], 2)
        (4, True)
    """
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    G = num_generations
    sample_ids = ids.repeat_interleave(G) * G + torch.arange(G).repeat(len(ids))
    return sample_keys(seed, sample_ids).tolist()


def check_requests(fn: str, prompt_token_ids: Sequence[Sequence[int]], seeds: Sequence[int]) -> None:
    """The checks every engine runs on its requests: one seed each, no empty prompt."""
    if len(seeds) != len(prompt_token_ids):
        raise InvalidArgumentError(f"{fn}: {len(seeds)} seeds for {len(prompt_token_ids)} prompts; expected one each")
    if any(len(p) == 0 for p in prompt_token_ids):
        raise InvalidArgumentError(f"{fn}: a prompt has no tokens; expected every prompt to have one")


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as one left-padded [N, P] int64 tensor and its [N, P] bool mask."""
    width = max(len(s) for s in sequences)
    # padded as Python lists, then one tensor: a tensor per row costs ~10 us each
    ids = torch.tensor([[pad_id] * (width - len(seq)) + list(seq) for seq in sequences], dtype=torch.long)
    starts = torch.tensor([width - len(seq) for seq in sequences], dtype=torch.long)
    return ids, torch.arange(width)[None, :] >= starts[:, None]


_COPY_BATCH_BYTES = 2**28  # HFEngine.update_weights copies in batches of about this many bytes


class HFEngine:
    """Hugging Face ``generate`` with torchforge's seeded sampler: the default, exact engine.

    Samples by inverse CDF with hashed uniforms (:class:`torchforge.loop.sampling.SeededSampler`)
    from exactly the :class:`SamplingSettings` distribution, and reports each drawn token's
    log-prob under it; the model is any Hugging Face causal LM, plain, DDP or FSDP2 (every
    process calls ``generate``, with the same ``max_new_tokens``: FSDP forwards are collectives).

    Given the model being trained, it samples with the trained weights themselves:
    ``update_weights([], version=v)`` only moves the version. Given a separate generation
    copy, ``update_weights`` copies the pushed tensors into it by name.

    Args:
        model: the causal LM to sample from.
        pad_token_id: the id that pads prompts and finished rows (default: the model's
            ``pad_token_id``, else the first stop id).

    Returns:
        A :class:`GenerationEngine`.

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> engine = HFEngine(tiny_llama(char_tokenizer()))
        >>> out = engine.generate([[8, 4, 11, 14]], seeds=[1], settings=SamplingSettings(max_new_tokens=3, stop_token_ids=(2,)))
        >>> len(out[0].token_ids) == len(out[0].log_probs) <= 3, out[0].weights_version
        (True, 0)
    """

    def __init__(self, model: nn.Module, *, pad_token_id: int | None = None) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.weights_version = 0

    def _pad_id(self, settings: SamplingSettings) -> int:
        if self.pad_token_id is not None:
            return self.pad_token_id
        pad = getattr(getattr(unwrap_model(self.model), "config", None), "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else settings.stop_token_ids[0]

    @torch.no_grad()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], *, seeds: Sequence[int],
                 settings: SamplingSettings, vision: Sequence[Any] | None = None) -> list[Completion]:
        """``vision``: per request a :class:`torchforge.loop.vision.VisionInputs` (its
        processed tensors go to ``generate``) or None, for a vision-language model."""
        check_requests("HFEngine.generate", prompt_token_ids, seeds)
        if not prompt_token_ids:
            return []
        inner = unwrap_model(self.model)
        pad_id = self._pad_id(settings)
        device = next(inner.parameters()).device
        prompt_tokens, prompt_mask = left_pad(prompt_token_ids, pad_id)
        sampler = SeededSampler(torch.as_tensor(list(seeds), dtype=torch.long), prompt_length=prompt_tokens.shape[1],
                                temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                                max_steps=settings.max_new_tokens)
        config = GenerationConfig(
            do_sample=False, num_beams=1, max_new_tokens=settings.max_new_tokens,
            eos_token_id=list(settings.stop_token_ids), pad_token_id=pad_id, repetition_penalty=1.0,
            no_repeat_ngram_size=0, min_new_tokens=0,
        )
        extra = {}
        if vision is not None and any(v is not None for v in vision):  # a VLM's images (torchforge.loop.vision)
            from torchforge.loop.vision import stack_vision, token_type_inputs, vision_model_inputs

            extra = {k: v.to(device) for k, v in vision_model_inputs(stack_vision(vision)).items()}
            extra.update(token_type_inputs(inner, prompt_tokens.to(device), prompt_tokens.shape[1]))
        was_training = inner.training
        inner.eval()
        try:
            out = inner.generate(
                input_ids=prompt_tokens.to(device), attention_mask=prompt_mask.long().to(device),
                generation_config=config, logits_processor=[sampler], **generation_kwargs(inner), **extra,
            )
        finally:
            inner.train(was_training)
        tokens = out[:, prompt_tokens.shape[1]:].tolist()
        log_probs = torch.stack(sampler.log_probs[:len(tokens[0])], dim=1).tolist() if tokens[0] else [[]] * len(tokens)
        stops = set(settings.stop_token_ids)
        completions = []
        for row, row_log_probs in zip(tokens, log_probs):
            # up to and including the first stop token; generate pads the rest of the row
            end = next((t + 1 for t, token in enumerate(row) if token in stops), None)
            n = len(row) if end is None else end
            completions.append(Completion(row[:n], row_log_probs[:n], truncated=end is None,
                                          weights_version=self.weights_version))
        return completions

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by name (built once: the names do not change)."""
        if getattr(self, "_tensors", None) is None:
            inner = unwrap_model(self.model)
            self._tensors = {**dict(inner.named_parameters()), **dict(inner.named_buffers())}
        return self._tensors

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        own = self._own_tensors()
        targets, sources, held = [], [], 0
        for name, tensor in weights:
            if name not in own:
                raise InvalidArgumentError(f"HFEngine.update_weights: {name!r} is not a tensor of the engine's model; "
                                           "expected Hugging Face parameter names of the same architecture")
            if own[name].data_ptr() != tensor.data_ptr():
                targets.append(own[name])
                sources.append(tensor)
                held += tensor.numel() * tensor.element_size()
            if held >= _COPY_BATCH_BYTES:  # gathered (FSDP) tensors are held until copied: bound them
                torch._foreach_copy_(targets, sources)
                targets, sources, held = [], [], 0
        if targets:  # in place, in batched copies
            torch._foreach_copy_(targets, sources)
        self.weights_version = int(version)



def _engine_class(name: str) -> type:
    if name == "hf-process":
        from torchforge.loop.process_engine import HFProcessEngine

        return HFProcessEngine
    from torchforge.loop.vllm_engine import VLLMEngine, VLLMServerEngine

    return {"vllm": VLLMEngine, "vllm-server": VLLMServerEngine}[name]


def check_engine_settings(engine: str, engine_args: dict[str, Any] | None) -> dict[str, Any]:
    """Check ``RLConfig.engine`` / ``engine_args`` before any model loads: the engine's name,
    that vLLM is installed for a vLLM engine, and every argument's name.

    Args:
        engine: one of :data:`ENGINES`.
        engine_args: the engine's keyword arguments, or None.

    Returns:
        ``engine_args`` as a dict ({} for None).

    Example:
        >>> check_engine_settings("hf", None)
        {}
    """
    import dataclasses
    import importlib.util
    import inspect

    fn = "RLConfig"
    if engine not in ENGINES:
        raise InvalidArgumentError(f"{fn}: engine={engine!r}; expected one of {list(ENGINES)}")
    if engine_args is None:
        engine_args = {}
    if not isinstance(engine_args, dict) or not all(isinstance(k, str) for k in engine_args):
        raise InvalidArgumentError(f"{fn}: engine_args is {engine_args!r}; expected a mapping of argument names to values")
    if engine == "hf":
        if engine_args:
            raise InvalidArgumentError(f"{fn}: engine_args {sorted(engine_args)} with engine='hf', which takes none; "
                                       "expected engine='vllm' or 'vllm-server', or no engine_args")
        return {}
    from torchforge.loop.vllm_engine import VLLM_INSTALL

    if engine.startswith("vllm") and importlib.util.find_spec("vllm") is None:
        raise InvalidArgumentError(f"{fn}: engine={engine!r} needs vLLM, which is not installed; install it with {VLLM_INSTALL}")
    cls = _engine_class(engine)
    own = [p for p in inspect.signature(cls.__init__).parameters
           if p not in ("self", "model", "llm_args", "weights", "pad_token_id")]
    known = set(own)
    if engine == "vllm":  # the rest goes to vllm.LLM, whose settings are EngineArgs' fields
        from vllm.engine.arg_utils import EngineArgs

        known |= {field.name for field in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise InvalidArgumentError(f"{fn}: engine_args has {unknown}, which engine={engine!r} does not take; "
                                   f"expected some of {sorted(own)}" + (" or a vllm.LLM argument" if engine == "vllm" else ""))
    if engine == "vllm" and "url" in engine_args:
        raise InvalidArgumentError(f"{fn}: engine_args has 'url' with engine='vllm'; a server is engine='vllm-server'")
    return dict(engine_args)


def make_engine(engine: str, model: nn.Module, tokenizer: Any, *, engine_args: dict[str, Any] | None = None,
                weights: Iterable[tuple[str, torch.Tensor]] | None = None, pad_token_id: int | None = None) -> GenerationEngine:
    """The engine ``RLConfig(engine=..., engine_args=...)`` names, over ``model`` (every process calls this).

    Args:
        engine: one of :data:`ENGINES`.
        model: the policy being trained (plain, DDP, FSDP2).
        tokenizer: its tokenizer.
        engine_args: the engine's arguments (:func:`check_engine_settings`).
        weights: the ``(name, tensor)`` pairs a vLLM engine starts with (default the
            model's full weights; a LoRA model's merged ones).
        pad_token_id: the padding id of :class:`HFEngine`.

    Returns:
        A :class:`GenerationEngine` at ``weights_version`` 0; "hf" samples with ``model`` itself.

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> type(make_engine("hf", tiny_llama(char_tokenizer()), char_tokenizer())).__name__
        'HFEngine'
    """
    args = check_engine_settings(engine, engine_args)
    if engine == "hf":
        return HFEngine(model, pad_token_id=pad_token_id)
    cls = _engine_class(engine)
    if engine == "hf-process":
        return cls(model, weights=weights, pad_token_id=pad_token_id, **args)
    if engine == "vllm-server" and "url" in args:  # a running server: load this model's weights into it
        server = cls(**args)
        from torchforge.distributed import full_weights

        server.update_weights(weights if weights is not None else full_weights(model), version=0)
        return server
    return cls.from_model(model, tokenizer, weights=weights, **args)
