"""Asynchronous generation: a sampler thread beside the trainer, bounded by staleness.

The trainer trains step s on the batch sampled for step s; the generator samples it ahead,
with the newest weights the trainer has published. Staleness is bounded by admission, not
by discarding samples: the generator starts step s only once the published weights are at
version >= s - max_staleness (the version is the number of optimizer steps behind them), so
the batch of step s is trained at most ``max_staleness`` versions after the weights that drew
it, and at most ``max_staleness + 1`` batches are ever sampled ahead. With ``max_staleness=0``
every batch is sampled with the weights of the step before it, as in a synchronous run.

A batch holds one version: weights are loaded between batches, so a batch in flight when new
weights arrive finishes on its own (``partial_rollouts="finish"``), every token keeping its
behaviour log-prob; ``"restart"`` samples it again with the new ones instead.

The generator is a thread (PyTorch releases the GIL in its kernels; a ``vllm-server`` engine
generates in its own process anyway). It owns the engine between batches and calls no
collective: under DDP / FSDP every process has its own generator and its own engine, and the
trainer gathers the weights (a collective) in its own thread before publishing them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchforge.errors import InvalidArgumentError, TorchforgeError

__all__ = ["PARTIAL_ROLLOUTS", "SampledStep", "AsyncGenerator"]

#: what happens to a batch in flight when new weights are published
PARTIAL_ROLLOUTS = ("finish", "restart")


@dataclass
class SampledStep:
    """What the generator hands the trainer for one step.

    Args:
        step: the 0-based step it was sampled for.
        version: the weights' version that sampled it.
        payload: what the sample function returned (batch, rewards, ...).
        generation_seconds: the sampling (and scoring) time.
        admission_wait_seconds: how long the generator waited for fresh enough weights
            before it could start this step.
        weights_load_seconds: the time the engine took to load the weights it used.
        restarts: how many times it was sampled again (``partial_rollouts="restart"``).
        ready_at: ``time.perf_counter()`` when it entered the buffer.

    Returns:
        A record.
    """

    step: int
    version: int
    payload: Any
    generation_seconds: float
    admission_wait_seconds: float
    weights_load_seconds: float
    restarts: int = 0
    ready_at: float = field(default_factory=time.perf_counter)


class AsyncGenerator:
    """Samples steps ``start, start + 1, ..., end - 1`` in a thread, within ``max_staleness``.

    The trainer calls :meth:`publish` after its optimizer step (every ``sync_every`` steps)
    and :meth:`take` for the batch of the step it is about to train, oldest first;
    :meth:`close` stops the thread (after the batch in flight). An exception in the
    generator is raised again by the :meth:`take` that would have had its batch.

    Args:
        sample: ``sample(step) -> payload``: sample and score the step's prompts with
            ``engine`` (called in the generator thread).
        engine: the generation engine; only this thread loads weights into it.
        start: the first step to sample (a resumed run's checkpoint step).
        end: one past the last step.
        version: the version of the weights the engine holds now.
        max_staleness: k >= 0; step s is sampled with weights of version >= s - k.
        partial_rollouts: one of :data:`PARTIAL_ROLLOUTS`.
        lock: held while the engine samples or loads weights (the trainer's evaluation
            may share the engine).
        threads: torch's intra-op threads in the generator thread (they are per thread);
            None: torch's default.

    Returns:
        The generator; :meth:`start_thread` starts it.

    Example:
        >>> class Counter:  # an engine stand-in: its version is all it has
        ...     weights_version = 0
        ...     def update_weights(self, weights, *, version): self.weights_version = version
        >>> engine = Counter()
        >>> gen = AsyncGenerator(lambda step: engine.weights_version, engine, start=0, end=3,
        ...                      version=0, max_staleness=1).start_thread()
        >>> versions = []
        >>> for step in range(3):
        ...     versions.append(gen.take(step)[0].version)
        ...     gen.publish(step + 1, [])
        >>> gen.close()
        >>> all(step - v <= 1 for step, v in enumerate(versions))
        True
    """

    def __init__(self, sample: Callable[[int], Any], engine: Any, *, start: int, end: int, version: int,
                 max_staleness: int, partial_rollouts: str = "finish", lock: threading.Lock | None = None,
                 threads: int | None = None) -> None:
        fn = "AsyncGenerator"
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise InvalidArgumentError(f"{fn}: max_staleness={max_staleness!r}; expected an int >= 0")
        if partial_rollouts not in PARTIAL_ROLLOUTS:
            raise InvalidArgumentError(f"{fn}: partial_rollouts={partial_rollouts!r}; expected one of "
                                       f"{list(PARTIAL_ROLLOUTS)}")
        self.sample, self.engine = sample, engine
        self.next_step, self.end = start, end
        self.max_staleness, self.partial_rollouts = max_staleness, partial_rollouts
        self.lock = lock or threading.Lock()
        self.threads = threads
        self._published: tuple[int, list[tuple[str, torch.Tensor]] | None] = (version, None)
        self._ready: list[SampledStep] = []
        self._error: BaseException | None = None
        self._stop = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="torchforge-generator", daemon=True)

    def start_thread(self) -> "AsyncGenerator":
        """Start sampling; returns ``self``."""
        self._thread.start()
        return self

    # --- the trainer's side ---------------------------------------------------------------------

    def publish(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand the generator the weights of ``version`` (tensors it may keep: detached copies).

        Args:
            version: the optimizer steps behind them.
            weights: ``(name, tensor)`` pairs.

        Returns:
            None.
        """
        with self._changed:
            self._published = (int(version), list(weights))
            self._changed.notify_all()

    def take(self, step: int, *, timeout: float | None = None) -> tuple[SampledStep, dict[str, float]]:
        """Wait for the batch of ``step``; returns it and the buffer's metrics.

        Args:
            step: the step about to train (the oldest not taken).
            timeout: seconds to wait (None: as long as the generator lives).

        Returns:
            ``(sampled, metrics)``: ``async/buffer_size`` (batches ready, this one
            included), ``async/trainer_wait_seconds``, ``async/batch_age_seconds`` (how long
            it waited in the buffer), ``async/generator_wait_seconds``,
            ``async/generation_seconds``, ``async/weights_load_seconds``, ``async/restarts``.

        Raises:
            TorchforgeError: the generator failed (its error is the cause), stopped, or
                ``timeout`` passed.
        """
        start = time.perf_counter()
        with self._changed:
            while not (self._ready or self._error is not None or not self._thread.is_alive()):
                if not self._changed.wait(timeout=None if timeout is None else max(0.0, start + timeout - time.perf_counter())):
                    raise TorchforgeError(f"AsyncGenerator.take: no batch for step {step} after {timeout} s")
            if not self._ready and self._error is not None:  # the batches sampled before it still train
                raise TorchforgeError(f"AsyncGenerator: sampling failed ({type(self._error).__name__}: "
                                      f"{self._error})") from self._error
            if not self._ready:
                raise TorchforgeError(f"AsyncGenerator.take: the generator stopped before step {step}")
            size = len(self._ready)
            sampled = self._ready.pop(0)
            self._changed.notify_all()
        if sampled.step != step:
            raise TorchforgeError(f"AsyncGenerator.take: the oldest batch is step {sampled.step}'s; expected step "
                                  f"{step}'s (steps are trained in order)")
        now = time.perf_counter()
        return sampled, {
            "async/buffer_size": float(size), "async/trainer_wait_seconds": now - start,
            "async/batch_age_seconds": now - max(sampled.ready_at, start),
            "async/generator_wait_seconds": sampled.admission_wait_seconds,
            "async/generation_seconds": sampled.generation_seconds,
            "async/weights_load_seconds": sampled.weights_load_seconds, "async/restarts": float(sampled.restarts),
        }

    def close(self, timeout: float | None = None) -> None:
        """Stop after the batch in flight and wait for the thread (up to ``timeout`` seconds).

        Args:
            timeout: seconds to wait; None: until it stops.

        Returns:
            None.
        """
        with self._changed:
            self._stop = True
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the generator's side -------------------------------------------------------------------

    def _admitted(self, step: int) -> bool:
        """Step ``step`` may start: the published weights are fresh enough for it."""
        return self._published[0] >= step - self.max_staleness

    def _load_newest(self) -> float:
        """Load the newest published weights into the engine, if it does not hold them; the seconds it took."""
        with self._changed:
            version, weights = self._published
            self._published = (version, None)  # the engine's copy from now on: drop the tensors
        if weights is None or version == self.engine.weights_version:
            return 0.0
        start = time.perf_counter()
        self.engine.update_weights(weights, version=version)
        return time.perf_counter() - start

    def _run(self) -> None:
        try:
            if self.threads is not None:
                torch.set_num_threads(self.threads)
            while self.next_step < self.end:
                step, waited = self.next_step, time.perf_counter()
                with self._changed:
                    while not self._stop and not self._admitted(step):
                        self._changed.wait()
                    if self._stop:
                        return
                waited = time.perf_counter() - waited
                loaded, restarts, begin = 0.0, 0, time.perf_counter()
                while True:
                    with self.lock:
                        loaded += self._load_newest()
                        version = self.engine.weights_version
                        payload = self.sample(step)
                    fresher = self._published[0] > version and self._published[1] is not None
                    if self.partial_rollouts == "finish" or not fresher or self._stop:
                        break
                    restarts += 1  # new weights arrived while it was sampled: sample it again on them
                with self._changed:
                    self._ready.append(SampledStep(step, version, payload, time.perf_counter() - begin - loaded,
                                                   waited, loaded, restarts))
                    self.next_step = step + 1
                    self._changed.notify_all()
        except BaseException as error:  # handed to the trainer's next take()
            with self._changed:
                self._error = error
                self._changed.notify_all()
