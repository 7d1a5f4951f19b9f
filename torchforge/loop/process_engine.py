"""Hugging Face ``generate`` in a worker process: the seeded sampler of :class:`HFEngine`, on a
copy of the policy in shared memory.

What it buys: a sampler that does not share the trainer's interpreter. Generation with
``generate`` is Python-heavy per token; in a thread beside the trainer it holds the GIL
against the trainer's own Python, so on a CPU asynchronous generation overlaps little. In a
process it overlaps fully. The weights live in shared memory: ``update_weights`` copies the
new tensors into them in place (between two ``generate`` calls, when the worker is idle: the
contract has them called in turn), so no weight crosses a pipe; prompts and completions do.

CPU only (CUDA tensors would need CUDA IPC; on a GPU, vLLM is the engine to run beside the
trainer). The worker is started with ``spawn`` and imports torchforge and transformers.
"""

from __future__ import annotations

import copy
import multiprocessing.connection
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from torchforge.distributed import full_weights, is_sharded, unwrap_model
from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.loop.engines import Completion, HFEngine, SamplingSettings, check_requests

__all__ = ["HFProcessEngine"]


def _serve(connection: multiprocessing.connection.Connection, model: nn.Module, pad_token_id: int | None,
           threads: int | None) -> None:
    """The worker: answer ``("generate", requests, seeds, settings, version)`` until ``None``."""
    if threads is not None:
        torch.set_num_threads(threads)
    engine = HFEngine(model, pad_token_id=pad_token_id)
    while True:
        try:
            message = connection.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        _, requests, seeds, settings, version = message
        engine.weights_version = version
        try:
            connection.send(("ok", engine.generate(requests, seeds=seeds, settings=settings)))
        except Exception as error:  # the parent raises it, with the worker's message
            connection.send(("error", f"{type(error).__name__}: {error}"))


class HFProcessEngine:
    """:class:`HFEngine` (exact, seeded) in a worker process over a shared-memory copy of ``model``.

    Args:
        model: the causal LM to copy (plain, DDP, FSDP2-sharded or LoRA: its full, or
            merged, weights are copied on this process's CPU).
        weights: the ``(name, tensor)`` pairs to start from (default the model's full
            weights; a LoRA model's merged ones).
        pad_token_id: as :class:`HFEngine`'s.
        threads: torch's CPU threads in the worker (None: this process's
            ``torch.get_num_threads()`` when the engine starts, as a thread would inherit; a
            spawned process would otherwise take every core, and a busy machine stalls
            OpenMP's barriers: 48x slower sampling on the demo on 2 loaded cores).
        timeout: seconds one ``generate`` may take before the worker counts as hung.

    Returns:
        A :class:`~torchforge.loop.engines.GenerationEngine`; :meth:`close` stops the worker.

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> engine = HFProcessEngine(tiny_llama(char_tokenizer()))  # doctest: +SKIP
        >>> engine.generate([[8, 4]], seeds=[1], settings=SamplingSettings(max_new_tokens=2, stop_token_ids=(2,)))  # doctest: +SKIP
        >>> engine.close()  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                 pad_token_id: int | None = None, threads: int | None = None, timeout: float = 600.0) -> None:
        inner = unwrap_model(model)
        if any(p.device.type != "cpu" for p in inner.parameters()):
            raise InvalidArgumentError("HFProcessEngine: the model is on "
                                       f"{next(p.device for p in inner.parameters() if p.device.type != 'cpu')}; "
                                       "expected a CPU model (on a GPU use engine='vllm')")
        if weights is None:
            weights = full_weights(model)  # gathered under FSDP (a collective: every process calls this)
        # a plain model is copied as it is; a sharded or LoRA one is rebuilt from its config (and
        # gets the full, or merged, weights)
        base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        copy_ = type(base)(base.config) if base is not inner or is_sharded(inner) else copy.deepcopy(inner)
        copy_ = copy_.to(next(base.parameters()).dtype).eval().requires_grad_(False)
        # the parent's view of the shared tensors: HFEngine.update_weights copies into them by name
        self._weights = HFEngine(copy_)
        self._weights.update_weights(weights, version=0)
        copy_.share_memory()
        if threads is None:
            threads = torch.get_num_threads()
        self.timeout = timeout
        self.weights_version = 0
        context = torch.multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, copy_, pad_token_id, threads), daemon=True,
                                        name="torchforge-hf-engine")
        self._process.start()
        child.close()

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], *, seeds: Sequence[int],
                 settings: SamplingSettings) -> list[Completion]:
        check_requests("HFProcessEngine.generate", prompt_token_ids, seeds)
        if not prompt_token_ids:
            return []
        if not self._process.is_alive():
            raise TorchforgeError(f"HFProcessEngine: the worker process is not running (exit code "
                                  f"{self._process.exitcode}); expected a live worker (was the engine closed?)")
        self._connection.send(("generate", [list(p) for p in prompt_token_ids], list(seeds), settings,
                               self.weights_version))
        # wait on the answer or the worker's exit, whichever comes first
        ready = multiprocessing.connection.wait([self._connection, self._process.sentinel], timeout=self.timeout)
        if self._connection not in ready:
            if self._process.is_alive():
                self._process.kill()
                raise TorchforgeError(f"HFProcessEngine: the worker did not answer within {self.timeout} s; "
                                      "it was stopped (raise timeout= for longer generations)")
            raise TorchforgeError(f"HFProcessEngine: the worker process died (exit code {self._process.exitcode}) "
                                  "while generating")
        status, answer = self._connection.recv()
        if status == "error":
            raise TorchforgeError(f"HFProcessEngine.generate: the worker raised {answer}")
        return answer

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self._weights.update_weights(weights, version=version)  # shared: the worker is idle between calls
        self.weights_version = int(version)

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        if self._process.is_alive():
            try:
                self._connection.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
        self._connection.close()
