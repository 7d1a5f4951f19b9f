"""Conformance checks for generation engines: what any engine must do for the loop to be exact.

:func:`check_engine` runs every check on an engine and the Hugging Face model whose weights
it holds, and raises ``AssertionError`` naming the failed property and the request:

1. **tokens in, tokens out**: prompts are random token-id sequences (special tokens in
   the middle, ids that decode and re-encode to something else), so an engine that
   re-tokenizes text gets other log-probs and fails check 2.
2. **log-probs of the processed distribution**: every returned log-prob equals
   ``log_softmax(filter_logits(logits / temperature, top_k, top_p))`` of the model's own
   forward on ``prompt + completion`` at the sampled token, for plain, tempered, top-k and
   top-p settings (``atol``, default 1e-4 nats).
3. **per-request seeds**: the same requests give the same completions; a request's
   completion does not change with the requests batched beside it; other seeds give
   other completions.
4. **stop ids**: a completion that is not ``truncated`` ends with its first stop id (the
   stop token is counted); a ``truncated`` one has ``max_new_tokens`` tokens and no stop id.
5. **weights pushed are weights used**: after ``update_weights`` with perturbed weights,
   the log-probs follow the perturbed model, and every completion carries the new version;
   the original weights are pushed back at the end.

The checks need the model's forward on the CPU or its device, nothing else; they run in a
few seconds on a tiny model. torchforge's own tests run them on :class:`HFEngine` and on
both vLLM engines.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from torchforge.distributed import full_weights
from torchforge.loop.engines import Completion, GenerationEngine, SamplingSettings, request_seeds
from torchforge.loop.sampling import filter_logits

__all__ = ["check_engine", "reference_log_probs"]


@torch.no_grad()
def reference_log_probs(model: nn.Module, prompt: Sequence[int], completion: Sequence[int],
                        settings: SamplingSettings) -> torch.Tensor:
    """[T] log-probs of ``completion`` after ``prompt`` under ``settings``' processed distribution,
    from the model's own logits (float32): the slow, obviously right reference.

    Args:
        model: a Hugging Face causal LM.
        prompt: the prompt's token ids.
        completion: the completion's token ids (T of them).
        settings: temperature, top-k, top-p.

    Returns:
        [T] float32.

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> lp = reference_log_probs(tiny_llama(char_tokenizer()), [8, 4], [5, 2], SamplingSettings(max_new_tokens=2, stop_token_ids=(2,)))
        >>> lp.shape, bool((lp < 0).all())
        (torch.Size([2]), True)
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(completion)], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    filtered = filter_logits(logits / settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    return filtered.log_softmax(-1).gather(-1, torch.tensor(list(completion), device=device)[:, None])[:, 0].cpu()


def _requests(vocab: int, n: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=generator).tolist()
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for length in lengths]


def _check_log_probs(what: str, model: nn.Module, prompts, completions: Sequence[Completion],
                     settings: SamplingSettings, atol: float) -> None:
    for r, (prompt, c) in enumerate(zip(prompts, completions)):
        if len(c.log_probs) != len(c.token_ids):
            raise AssertionError(f"check_engine: {what}: request {r} returned {len(c.token_ids)} tokens but "
                                 f"{len(c.log_probs)} log-probs; expected one each")
        if not c.token_ids:
            raise AssertionError(f"check_engine: {what}: request {r} returned no token; expected at least one")
        expected = reference_log_probs(model, prompt, c.token_ids, settings)
        got = torch.tensor(c.log_probs, dtype=torch.float32)
        if not torch.isfinite(got).all() or (got - expected).abs().max() > atol:
            raise AssertionError(
                f"check_engine: {what}: the log-probs of request {r} (prompt {prompt}, completion {c.token_ids}) "
                f"are {got.tolist()}; the model's processed distribution ({settings}) gives {expected.tolist()} "
                f"(max difference {(got - expected).abs().max():.3g} > atol={atol})")


def check_engine(engine: GenerationEngine, model: nn.Module, *, stop_token_ids: Sequence[int] | None = None,
                 max_new_tokens: int = 6, num_requests: int = 12, atol: float = 1e-4, seed: int = 0) -> None:
    """Run the engine conformance checks (module docstring) on ``engine``.

    Args:
        engine: the engine under test, holding ``model``'s weights.
        model: the Hugging Face causal LM whose weights ``engine`` holds (float32 for a
            tight ``atol``); left unchanged.
        stop_token_ids: the stop ids to sample with (default: about a third of the
            vocabulary, so that completions both stop and hit the length limit).
        max_new_tokens: the length limit of the sampled completions.
        num_requests: requests per generate call.
        atol: the largest allowed log-prob difference, in nats.
        seed: seeds the requests and the weight perturbation.

    Returns:
        None; raises ``AssertionError`` naming the property, the request and the values.

    Example:
        >>> from torchforge.loop import HFEngine
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> model = tiny_llama(char_tokenizer())
        >>> check_engine(HFEngine(model), model)
    """
    reference = copy.deepcopy(model).eval()
    vocab = reference.config.vocab_size
    stops = tuple(stop_token_ids) if stop_token_ids else tuple(range(0, vocab, 3))
    prompts = _requests(vocab, num_requests, seed)
    seeds = request_seeds(seed, range(num_requests), 1)
    settings_list = [
        SamplingSettings(max_new_tokens=max_new_tokens, stop_token_ids=stops),
        SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.7, stop_token_ids=stops),
        SamplingSettings(max_new_tokens=max_new_tokens, temperature=1.3, top_k=5, stop_token_ids=stops),
        SamplingSettings(max_new_tokens=max_new_tokens, top_p=0.8, stop_token_ids=stops),
    ]
    version = engine.weights_version

    # 1-2: token ids round-trip, and the log-probs of the processed distribution
    runs = {}
    for settings in settings_list:
        out = engine.generate(prompts, seeds=seeds, settings=settings)
        if len(out) != len(prompts):
            raise AssertionError(f"check_engine: generate returned {len(out)} completions for {len(prompts)} requests")
        _check_log_probs(f"settings {settings}", reference, prompts, out, settings, atol)
        runs[settings] = out
    base = settings_list[0]
    first = runs[base]

    # 3: per-request seeds
    again = engine.generate(prompts, seeds=seeds, settings=base)
    for r, (a, b) in enumerate(zip(first, again)):
        if a.token_ids != b.token_ids:
            raise AssertionError(f"check_engine: request {r} gave {a.token_ids}, then {b.token_ids} with the same "
                                 "seed; expected the same completion")
    alone = engine.generate(prompts[-1:], seeds=seeds[-1:], settings=base)[0]
    if alone.token_ids != first[-1].token_ids:
        raise AssertionError(f"check_engine: request {len(prompts) - 1} gave {first[-1].token_ids} in a batch and "
                             f"{alone.token_ids} alone; expected the completion not to depend on the batch")
    other = engine.generate(prompts, seeds=[s + 7_777_777 for s in seeds], settings=base)
    if all(a.token_ids == b.token_ids for a, b in zip(first, other)):
        raise AssertionError("check_engine: other seeds gave the same completions for every request; expected the "
                             "seed to decide the samples")

    # 4: stop ids end a completion and are counted
    outcomes = set()
    for settings, out in runs.items():
        for r, c in enumerate(out):
            inside = [t for t in c.token_ids[:-1] if t in stops]
            if inside:
                raise AssertionError(f"check_engine: request {r} ({settings}) went on past stop id {inside[0]}: "
                                     f"{c.token_ids}; expected the completion to end at its first stop id")
            if c.truncated:
                if len(c.token_ids) != settings.max_new_tokens or c.token_ids[-1] in stops:
                    raise AssertionError(f"check_engine: request {r} is truncated with {c.token_ids}; expected "
                                         f"{settings.max_new_tokens} tokens and no stop id")
            elif c.token_ids[-1] not in stops:
                raise AssertionError(f"check_engine: request {r} ended without a stop id and is not truncated: "
                                     f"{c.token_ids}; expected its stop id as its last token")
            outcomes.add(c.truncated)
    if outcomes != {True, False}:
        raise AssertionError(f"check_engine: every completion was {'truncated' if True in outcomes else 'stopped'}; "
                             "the stop check needs both (pass other stop_token_ids or max_new_tokens)")

    # 5: weights pushed are weights used, with their version on every completion
    for c in (c for out in runs.values() for c in out):
        if c.weights_version != version:
            raise AssertionError(f"check_engine: a completion carries weights_version {c.weights_version}; "
                                 f"expected the engine's {version}")
    perturbed = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=generator).to(p) * 0.3)
    try:
        engine.update_weights(full_weights(perturbed), version=version + 1)
        moved = engine.generate(prompts, seeds=seeds, settings=base)
        for r, c in enumerate(moved):
            if c.weights_version != version + 1:
                raise AssertionError(f"check_engine: after update_weights(version={version + 1}) request {r} carries "
                                     f"weights_version {c.weights_version}")
        _check_log_probs("after update_weights", perturbed, prompts, moved, base, atol)
    finally:
        engine.update_weights(full_weights(reference), version=version)
