"""Reward functions and reward scoring.

Two kinds of reward function are accepted, in any mix:

- a :class:`RewardFunction` subclass with ``compute(completions, prompts) -> list[float]``
  (the product card's API);
- any callable with TRL's keyword signature, ``fn(prompts=..., completions=...,
  completion_ids=..., **columns) -> list[float | None]``, where ``columns`` are the other
  fields of the dataset rows and ``None`` means "not applicable to this sample".

:func:`score_rewards` calls each one, checks what it returned, and combines them:
``reward_b = sum_f w_f * r_fb`` over the functions that apply to sample ``b`` (NaN when
none applies; the advantage estimators leave NaN rewards out of the group statistics).

:func:`guard_rewards` makes reward functions that cannot stall or crash a run: a per-call
timeout, and for CPU-bound graders a pool of worker processes (:class:`RewardWorkers`) in
which each completion is scored alone, so that a grader that hangs or dies on one
completion costs that completion the failure reward (and a logged reason), not the run.
"""

from __future__ import annotations

import math
import pickle
import signal
import threading
import time
import warnings
from collections import deque
from typing import Any, Callable, Sequence

import torch

from torchforge.errors import InvalidArgumentError, TorchforgeError

__all__ = ["RewardFunction", "RewardError", "reward_name", "reward_keys", "score_rewards",
           "GuardedReward", "RewardWorkers", "guard_rewards", "close_rewards"]


class RewardError(TorchforgeError):
    """A reward function raised, or returned something other than one number per completion."""


class RewardFunction:
    """Base class of the card's reward functions: override :meth:`compute`.

    Subclasses may set ``name`` (used in metrics; default: the class name) and
    ``weight`` (default 1.0). A ``RewardFunction`` is also a TRL-style callable, so it
    can be passed anywhere a plain reward callable is.

    Args:
        None.

    Returns:
        A reward function object.

    Example:
        >>> class Length(RewardFunction):
        ...     def compute(self, completions, prompts):
        ...         return [float(len(c)) for c in completions]
        >>> Length()(prompts=["a", "b"], completions=["xy", ""])
        [2.0, 0.0]
    """

    name: str | None = None
    weight: float = 1.0
    #: True for functions that must be called on the whole batch in the training process
    #: (they hold a model, e.g. :class:`torchforge.rewards.RewardModel`): :func:`guard_rewards`
    #: neither sends them to worker processes nor puts a timeout on them.
    in_process: bool = False

    def compute(self, completions: Sequence[str], prompts: Sequence[str]) -> list[float | None]:
        """Score each completion.

        Args:
            completions: the B decoded completions.
            prompts: the B prompts they answer (each prompt repeated G times, in groups).

        Returns:
            B floats (or None for "not applicable").
        """
        raise NotImplementedError(f"{type(self).__name__}.compute is not implemented")

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        return self.compute(completions, prompts)


def reward_name(fn: Callable) -> str:
    """The name under which a reward function's metrics are logged.

    Args:
        fn: a RewardFunction or a callable.

    Returns:
        ``fn.name`` when set, else the function's or class's ``__name__``.
    """
    name = getattr(fn, "name", None)
    if name:
        return str(name)
    return getattr(fn, "__name__", type(fn).__name__)


def reward_keys(reward_functions: Sequence[Callable]) -> list[str]:
    """The metric names of several reward functions: :func:`reward_name`, with ``_2``, ``_3``
    ... appended where two share a name (the keys of :func:`score_rewards`' ``per_function``).

    Args:
        reward_functions: RewardFunction objects and / or callables.

    Returns:
        One name per function, in order, all different.

    Example:
        >>> def f(prompts, completions, **kw): return [0.0] * len(completions)
        >>> reward_keys([f, f])
        ['f', 'f_2']
    """
    keys: list[str] = []
    for fn in reward_functions:
        name = reward_name(fn)
        key, k = name, 1
        while key in keys:
            k += 1
            key = f"{name}_{k}"
        keys.append(key)
    return keys


def _as_float(fn_name: str, index: int, value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
        isinstance(value, torch.Tensor) and value.numel() == 1
    ):
        raise RewardError(
            f"score_rewards: reward function {fn_name!r} returned {value!r} (a {type(value).__name__}) "
            f"for completion {index}; expected a float or None"
        )
    value = float(value)
    if math.isnan(value):
        raise RewardError(
            f"score_rewards: reward function {fn_name!r} returned NaN for completion {index}; "
            "return None for 'not applicable'"
        )
    return value


def score_rewards(
    reward_functions: Sequence[Callable],
    *,
    prompts: Sequence[str],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]] | None = None,
    columns: dict[str, Sequence[Any]] | None = None,
    weights: Sequence[float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call every reward function on the B completions and combine their scores.

    ``rewards_b = sum_f w_f * r_fb`` over the functions whose ``r_fb`` is not None;
    NaN when every function returned None for sample ``b``.

    Args:
        reward_functions: RewardFunction objects and / or TRL-style callables.
        prompts: B prompt strings.
        completions: B completion strings.
        completion_ids: B lists of completion token ids (passed to callables).
        columns: other dataset fields, each a list of B values (passed to callables).
        weights: one weight per function; default each function's ``weight`` attribute
            (1.0 when it has none).

    Returns:
        ``(rewards, per_function)``: float64 [B] combined rewards, and name -> float64 [B]
        unweighted scores of each function (NaN where it returned None). float64, as the
        functions' Python floats: near 1e4 float32 keeps steps of 1e-3, which would round
        a spread of 0.01 before the group statistics see it.

    Raises:
        RewardError: a function raised (chained), returned a non-sequence, a wrong number
            of values, a non-number, or NaN.

    Example:
        >>> total, parts = score_rewards(
        ...     [lambda prompts, completions, **kw: [1.0, None]],
        ...     prompts=["p", "p"], completions=["a", "b"])
        >>> total
        tensor([1., nan], dtype=torch.float64)
    """
    fn = "score_rewards"
    if not reward_functions:
        raise InvalidArgumentError(f"{fn}: reward_functions is empty; expected at least one reward function")
    B = len(completions)
    if len(prompts) != B:
        raise InvalidArgumentError(f"{fn}: {len(prompts)} prompts but {B} completions; expected one prompt per completion")
    if weights is None:
        weights = [float(getattr(f, "weight", 1.0)) for f in reward_functions]
    if len(weights) != len(reward_functions):
        raise InvalidArgumentError(
            f"{fn}: {len(weights)} weights for {len(reward_functions)} reward functions; expected one each"
        )
    columns = dict(columns or {})
    per_function: dict[str, torch.Tensor] = {}
    weighted = []
    for reward_fn, weight, key in zip(reward_functions, weights, reward_keys(reward_functions)):
        name = reward_name(reward_fn)
        try:
            values = reward_fn(prompts=list(prompts), completions=list(completions),
                               completion_ids=completion_ids, **columns)
        except Exception as error:
            raise RewardError(f"{fn}: reward function {name!r} raised {type(error).__name__}: {error}") from error
        if not isinstance(values, (list, tuple, torch.Tensor)) or len(values) != B:
            got = f"{len(values)} values" if hasattr(values, "__len__") else repr(values)
            raise RewardError(
                f"{fn}: reward function {name!r} returned {got} for {B} completions; expected a list of {B} floats"
            )
        scores = torch.tensor([_as_float(name, i, v) for i, v in enumerate(values)], dtype=torch.float64)
        per_function[key] = scores  # two functions of the same name keep separate metrics
        weighted.append(weight * scores)
    stacked = torch.stack(weighted)
    applies = ~stacked.isnan()
    total = torch.where(applies, stacked, 0.0).sum(0)
    total = torch.where(applies.any(0), total, math.nan)
    return total, per_function


# --- rewards that cannot stall or crash a run ---------------------------------------------

#: how a guarded call can fail; logged as ``rewards/<name>/<kind>`` (completions, all processes)
FAILURE_KINDS = ("timeouts", "crashes")
#: seconds a worker may take to start and load a function (imports) before a timed call begins
_START_LIMIT = 300.0


def _worker_main(conn: Any) -> None:
    """A reward worker process: call one reward function on one completion per message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    functions: dict[bytes, Callable] = {}
    while True:
        try:
            fn_bytes, kwargs = conn.recv()
        except (EOFError, OSError):  # the training process closed the pipe (or is gone)
            return
        try:
            fn = functions.get(fn_bytes)
            if fn is None:
                fn = functions[fn_bytes] = pickle.loads(fn_bytes)  # may import its module: before the clock
            conn.send(("started", None))  # the call's timeout runs from here
            reply: tuple[str, Any] = ("ok", fn(**kwargs))
        except Exception as error:
            reply = ("error", _portable_error(error))
        try:
            conn.send(reply)
        except Exception as error:  # a value that does not pickle
            conn.send(("error", _portable_error(TypeError(
                f"returned {reply[1]!r:.200}, which cannot be sent back from a worker process ({error})"))))


def _portable_error(error: Exception) -> tuple[bytes | None, str, str]:
    """An exception as (its pickle, or None when it does not round-trip; type name; message)."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
    except Exception:
        data = None
    return data, type(error).__name__, str(error)


def _rebuilt_error(portable: tuple[bytes | None, str, str]) -> Exception:
    data, kind, message = portable
    if data is not None:
        return pickle.loads(data)
    return RuntimeError(f"{kind}: {message}")


def _start_method() -> str:
    import multiprocessing

    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


class _Worker:
    """One worker process and the training process's end of its pipe."""

    def __init__(self, context: Any) -> None:
        parent, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child,), daemon=True,
                                       name="torchforge-reward-worker")
        self.process.start()
        child.close()  # the worker holds the only other end: its death reads as EOF here
        self.conn = parent

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()


class RewardWorkers:
    """A pool of worker processes that score one completion per call, each call with its own
    timeout: a call that runs past it has its worker killed (and replaced), a worker that
    dies (a segfault, ``os._exit``) is replaced, and both are reported as outcomes, never
    raised.

    Workers start on first use (``forkserver`` where the platform has it, else ``spawn``:
    never ``fork``, which is unsafe in a process holding CUDA or threads) and live until
    :meth:`close` (or the end of the process); a later call starts them again. The
    functions are pickled, so they must be importable: module-level functions, or
    instances of module-level classes.

    Args:
        processes: the number of worker processes (>= 1).
        preload: modules the ``forkserver`` imports once, so that a replaced worker starts
            without importing them again (e.g. the reward functions' modules).

    Returns:
        The pool; :meth:`map` runs calls, :meth:`close` stops the workers.

    Example:
        >>> workers = RewardWorkers(1)
        >>> workers.map(reward_name, [{"fn": reward_name}], timeout=60.0)
        [('ok', 'reward_name')]
        >>> workers.close()
    """

    def __init__(self, processes: int, *, preload: Sequence[str] = ()) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise InvalidArgumentError(f"RewardWorkers: processes={processes!r}; expected an int >= 1")
        self.processes = processes
        self._preload = sorted(set(preload) | {__name__})
        self._context: Any = None
        self._idle: list[_Worker] = []

    def _start(self) -> _Worker:
        if self._context is None:
            import multiprocessing

            self._context = multiprocessing.get_context(_start_method())
            if self._context.get_start_method() == "forkserver":
                self._context.set_forkserver_preload(self._preload)
        return _Worker(self._context)

    def map(self, fn: Callable, calls: Sequence[dict[str, Any]], *, timeout: float | None
            ) -> list[tuple[str, Any]]:
        """Call ``fn(**kwargs)`` for each ``kwargs`` of ``calls`` in the workers.

        Args:
            fn: a picklable callable.
            calls: the keyword arguments of each call.
            timeout: seconds one call may take; None: no limit (a crash is still caught).

        Returns:
            One outcome per call, in order: ``("ok", value)``, ``("error", exception)`` (the
            call raised), ``("timeout", seconds)`` (its worker was killed) or ``("crash",
            exitcode)`` (its worker died; a negative code is the signal).

        Raises:
            RewardError: a worker died (or hung) before calling ``fn``: it could not start or
                import ``fn`` (e.g. a main script without ``if __name__ == "__main__":``),
                which no sample is to blame for.
        """
        from multiprocessing.connection import wait

        fn_bytes = pickle.dumps(fn)
        outcomes: list[tuple[str, Any] | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        running: dict[Any, tuple[_Worker, int, float | None, bool]] = {}  # conn -> worker, call, deadline, started
        try:
            while pending or running:
                while pending and len(running) < self.processes:
                    worker = self._idle.pop() if self._idle else self._start()
                    index = pending.popleft()
                    try:
                        worker.conn.send((fn_bytes, calls[index]))
                    except OSError:  # it died while idle: replace it, keep the call
                        worker.stop()
                        pending.appendleft(index)
                        continue
                    # until the worker says "started", the limit is that of starting (imports), not the call's
                    running[worker.conn] = (worker, index, time.monotonic() + _START_LIMIT, False)
                deadlines = [d for _, _, d, _ in running.values() if d is not None]
                wait_for = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for conn in wait(list(running), timeout=wait_for):
                    worker, index, deadline, started = running.pop(conn)
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):  # the worker died on this call
                        worker.process.join(10)
                        if not started:  # before the function ran: the worker cannot work, no sample is to blame
                            raise _startup_failure(fn, f"exited with status {worker.process.exitcode}")
                        outcomes[index] = ("crash", worker.process.exitcode)
                        worker.stop()
                        continue
                    if status == "started":
                        running[conn] = (worker, index, None if timeout is None else time.monotonic() + timeout, True)
                        continue
                    outcomes[index] = (status, _rebuilt_error(value) if status == "error" else value)
                    self._idle.append(worker)
                now = time.monotonic()
                for conn, (worker, index, deadline, started) in list(running.items()):
                    if deadline is not None and now >= deadline:
                        del running[conn]
                        worker.stop()
                        if not started:
                            raise _startup_failure(fn, f"did not load the function within {_START_LIMIT:g} s")
                        outcomes[index] = ("timeout", timeout)
        except BaseException:  # Ctrl-C, a worker that cannot start, a bug: never leave a worker holding a call
            for worker, _, _, _ in running.values():
                worker.stop()
            raise
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        """Stop every idle worker (a later :meth:`map` starts new ones).

        Args:
            None.

        Returns:
            None.
        """
        while self._idle:
            self._idle.pop().stop()


def _startup_failure(fn: Callable, what: str) -> RewardError:
    return RewardError(
        f"RewardWorkers: a worker process {what} before calling {reward_name(fn)!r}: it could not start or import "
        "it. Worker processes import the main module: a script that trains at its top level must do so under "
        "`if __name__ == '__main__':` (as for any multiprocessing worker); or define the reward function in a "
        "module, or set reward_processes=0")


def _reason(kind: str, value: Any) -> str:
    if kind == "timeout":
        return f"timed out after {value:g} s"
    if isinstance(value, int) and value < 0:
        try:
            return f"crashed (killed by {signal.Signals(-value).name})"
        except ValueError:
            pass
    return f"crashed (exit status {value})"


class GuardedReward:
    """A reward function that cannot stall or crash the run: a completion it hangs or dies
    on gets ``failure_reward`` and a counted, logged reason.

    - With ``workers``, each completion is scored alone in a worker process, with
      ``timeout`` seconds per completion: a hang kills that worker, a crash (a segfault,
      ``os._exit``) loses only it, and the other completions keep their scores.
    - Without, the whole call runs in a thread with ``timeout`` seconds: past it, every
      completion of the call gets ``failure_reward`` and the thread is abandoned (a thread
      cannot be stopped: for graders that can hang for good or crash, use workers).

    A function that raises is a bug, not a failure: that still stops the run, naming the
    function and, in workers, the sample. Failures are counted by kind (``timeouts``,
    ``crashes``) until :meth:`pop_failures`; the first few are also warned with the sample.

    Args:
        fn: a reward function (RewardFunction or TRL-style callable).
        timeout: seconds per call (per completion with ``workers``); None: no limit.
        workers: a :class:`RewardWorkers` pool, or None to call ``fn`` in this process.
        failure_reward: the reward of a failed completion; None: "not applicable" (NaN,
            left out of the group statistics).

    Returns:
        A TRL-style reward callable with ``fn``'s ``name`` and ``weight``.

    Example:
        >>> import time
        >>> def slow(prompts, completions, **kw):
        ...     time.sleep(5)
        ...     return [1.0] * len(completions)
        >>> guarded = GuardedReward(slow, timeout=0.1, failure_reward=-1.0)
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     guarded(prompts=["p"], completions=["c"])
        [-1.0]
        >>> guarded.pop_failures()
        {'timeouts': 1, 'crashes': 0}
    """

    _WARNED = 3  # failures warned with their sample; later ones are counted only

    def __init__(self, fn: Callable, *, timeout: float | None = None, workers: RewardWorkers | None = None,
                 failure_reward: float | None = 0.0) -> None:
        name = "GuardedReward"
        if not callable(fn):
            raise InvalidArgumentError(f"{name}: fn is a {type(fn).__name__}; expected a reward function")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < math.inf):
            raise InvalidArgumentError(f"{name}: timeout={timeout!r}; expected a number of seconds > 0, or None")
        if failure_reward is not None and (isinstance(failure_reward, bool) or not isinstance(failure_reward, (int, float))
                                           or not math.isfinite(failure_reward)):
            raise InvalidArgumentError(f"{name}: failure_reward={failure_reward!r}; expected a finite number or None")
        if workers is not None and not isinstance(workers, RewardWorkers):
            raise InvalidArgumentError(f"{name}: workers is a {type(workers).__name__}; expected a RewardWorkers or None")
        self.fn, self.timeout, self.workers, self.failure_reward = fn, timeout, workers, failure_reward
        self.name = reward_name(fn)
        self.weight = float(getattr(fn, "weight", 1.0))
        self._counts = dict.fromkeys(FAILURE_KINDS, 0)
        self._warned = 0

    def pop_failures(self) -> dict[str, int]:
        """The failures since the last call, by kind (``timeouts``, ``crashes``); resets them.

        Args:
            None.

        Returns:
            kind -> number of completions.
        """
        counts, self._counts = self._counts, dict.fromkeys(FAILURE_KINDS, 0)
        return counts

    def _failed(self, kind: str, value: Any, samples: Sequence[int], prompts, completions) -> None:
        self._counts["timeouts" if kind == "timeout" else "crashes"] += len(samples)
        if self._warned < self._WARNED:
            self._warned += 1
            b = samples[0]
            which = f"sample {b}" if len(samples) == 1 else f"a call on {len(samples)} samples"
            later = " (later failures are only counted, in the rewards/<name>/timeouts and /crashes metrics)" \
                if self._warned == self._WARNED else ""
            warnings.warn(
                f"reward function {self.name!r} {_reason(kind, value)} on {which} (prompt {prompts[b]!r:.80}, "
                f"completion {completions[b]!r:.80}); it gets the failure reward {self.failure_reward}{later}",
                stacklevel=3)

    def __call__(self, *, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        B = len(completions)
        if self.workers is None:
            return self._call_in_thread(prompts, completions, columns)
        calls = [{"prompts": [prompts[b]], "completions": [completions[b]],
                  **{k: (v[b:b + 1] if isinstance(v, (list, tuple)) and len(v) == B else v) for k, v in columns.items()}}
                 for b in range(B)]
        out: list[float | None] = []
        for b, (kind, value) in enumerate(self.workers.map(self.fn, calls, timeout=self.timeout)):
            if kind == "error":
                raise RewardError(f"reward function {self.name!r} raised {type(value).__name__}: {value} on sample "
                                  f"{b} (prompt {prompts[b]!r}, completion {completions[b]!r})") from value
            if kind == "ok":
                if not isinstance(value, (list, tuple)) or len(value) != 1:
                    got = f"{len(value)} values" if hasattr(value, "__len__") else repr(value)
                    raise RewardError(f"reward function {self.name!r} returned {got} for 1 completion (sample {b}); "
                                      "expected a list of 1 float")
                out.append(value[0])
            else:
                self._failed(kind, value, [b], prompts, completions)
                out.append(self.failure_reward)
        return out

    def _call_in_thread(self, prompts, completions, columns) -> list[float | None]:
        result: dict[str, Any] = {}

        def call() -> None:
            try:
                result["values"] = self.fn(prompts=prompts, completions=completions, **columns)
            except BaseException as error:  # re-raised in the calling thread
                result["error"] = error

        thread = threading.Thread(target=call, name=f"torchforge-reward-{self.name}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            self._failed("timeout", self.timeout, list(range(len(completions))), prompts, completions)
            return [self.failure_reward] * len(completions)
        if "error" in result:
            raise result["error"]
        return result["values"]


def guard_rewards(reward_functions: Sequence[Callable], *, timeout: float | None = None, processes: int = 0,
                  failure_reward: float | None = 0.0) -> list[Callable]:
    """Wrap reward functions in :class:`GuardedReward` (RLConfig's ``reward_timeout``,
    ``reward_processes`` and ``reward_on_failure``).

    With ``processes=0`` and no ``timeout`` the functions are returned as they are (the
    default path costs nothing). Otherwise every function but those with ``in_process =
    True`` (reward models, judges: they hold a model and score whole batches) is guarded;
    with ``processes > 0`` they share one pool of that many workers, and each must pickle.

    Args:
        reward_functions: RewardFunction objects and / or TRL-style callables.
        timeout: seconds per call (per completion with workers); None: no limit.
        processes: worker processes (0: call in this process).
        failure_reward: the reward of a completion whose call timed out or crashed.

    Returns:
        The list to score with, in the same order.

    Raises:
        InvalidArgumentError: bad settings, or a function that cannot be sent to a worker
            process (a lambda, a closure), named.

    Example:
        >>> def length(prompts, completions, **kw): return [float(len(c)) for c in completions]
        >>> guard_rewards([length]) == [length]
        True
        >>> [type(f).__name__ for f in guard_rewards([length], timeout=30.0)]
        ['GuardedReward']
    """
    fn = "guard_rewards"
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
        raise InvalidArgumentError(f"{fn}: processes={processes!r}; expected an int >= 0 (0: no worker processes)")
    if timeout is None and processes == 0:
        return list(reward_functions)
    guarded = [f for f in reward_functions if not getattr(f, "in_process", False)]
    workers = None
    if processes > 0 and guarded:
        for f in guarded:
            try:
                pickle.loads(pickle.dumps(f))
            except Exception as error:
                raise InvalidArgumentError(
                    f"{fn}: reward function {reward_name(f)!r} cannot be sent to a worker process "
                    f"({type(error).__name__}: {error}); expected a module-level function or an instance of a "
                    "module-level class, or reward_processes=0") from None
        modules = {getattr(f, "__module__", None) or type(f).__module__ for f in guarded}
        workers = RewardWorkers(processes, preload=[m for m in modules if m and m != "__main__"])
    return [GuardedReward(f, timeout=timeout, workers=workers, failure_reward=failure_reward)
            if not getattr(f, "in_process", False) else f for f in reward_functions]


def close_rewards(reward_functions: Sequence[Callable]) -> None:
    """Stop the worker processes of guarded reward functions (they restart when used again).

    Args:
        reward_functions: what :func:`guard_rewards` returned (other functions are skipped).

    Returns:
        None.
    """
    for f in reward_functions:
        if isinstance(f, GuardedReward) and f.workers is not None:
            f.workers.close()
