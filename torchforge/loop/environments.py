"""Multi-turn episodes: the model acts, an environment answers, the model acts again.

An environment is one object per episode with the Gymnasium / OpenEnv shape::

    class Calculator(Environment):
        def reset(self, row):            # the first observation: prompt text or chat messages
            return [{"role": "user", "content": row["question"]}]
        def step(self, action):          # (next observation, reward of this turn, done)
            return StepResult(observation="...", reward=0.0, done=False)

:func:`rollout_episodes` plays B = N * G episodes (G per dataset row, contiguous, so that
GRPO's groups are the G episodes of a row). Each turn, every live episode's context
(prompt, then everything so far) goes into **one** batched call of
:func:`torchforge.loop.rollout` — the same seeded sampler and ``generate`` path as a
single-turn rollout — finished episodes drop out, and the environments step concurrently
(one thread each, with a per-step timeout). The result is one sequence per episode::

    tokens   [ model turn 1 | observation 1 | model turn 2 | observation 2 | model turn 3 | pad ]
    mask     [ True ...     | False ...     | True ...     | False ...     | True ...     | False ]
    rewards  [       r_1 at the turn's last token,     r_2 ...,                  r_3 ... ]

Token in, token out: the model's tokens are exactly the sampled ones, and an observation is
tokenized once and appended; the decoded text is never tokenized again. So
:func:`torchforge.loop.policy_log_probs` on the batch reproduces ``rollout_log_probs`` on
the model's tokens, and GAE / the losses see the observation tokens as mask gaps.

Images (a vision-language model, with its ``processor``): the prompt's images (the row's,
``images=``) and an observation's (``StepResult(..., images=[...])``, or chat parts
``{"type": "image", "image": <PIL image or path>}``) go through the processor, which expands
their placeholders into the model's image tokens; the episode's vision inputs accumulate in
order (the prompt's images, then each observation's, :func:`torchforge.loop.vision.join_vision`),
every later turn is sampled with all of them, and ``batch.vision`` carries them to the
training forward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn

from torchforge.batch import Batch
from torchforge.distributed import is_distributed, unwrap_model
from torchforge.errors import InvalidArgumentError, TorchforgeError
from torchforge.loop.engines import GenerationEngine
from torchforge.loop.rollout import completion_stop_ids, rollout
from torchforge.loop.sampling import sample_keys
from torchforge.loop.vision import (
    VisionInputs,
    encode_vision_prompts,
    image_placeholders,
    join_vision,
    load_images,
    placeholder_ids,
    stack_vision,
)

__all__ = ["Environment", "StepResult", "Episodes", "EpisodeError", "rollout_episodes", "episode_metrics"]

logger = logging.getLogger(__name__)

class StepResult(NamedTuple):
    """What :meth:`Environment.step` returns: the next observation, this turn's reward, done.

    Args:
        observation: text appended as is, chat messages rendered with the tokenizer's chat
            template (the processor's, for a vision-language model), or None (nothing to append).
        reward: the reward of this turn (a finite number).
        done: True when the episode is over.
        images: the observation's images (PIL images, paths, ``file://`` URLs), one per image
            placeholder of its text or ``{"type": "image"}`` part of its messages, in order; for
            a vision-language model (``rollout_episodes(processor=...)``). Message parts may
            carry their image instead (``{"type": "image", "image": ...}``).

    Returns:
        A named tuple; a plain ``(observation, reward, done)`` tuple is accepted too.

    Example:
        >>> StepResult("407=", 0.2, False).reward
        0.2
    """

    observation: Any
    reward: float
    done: bool
    images: Any = None

    def __repr__(self) -> str:  # the images only when there are some
        images = "" if self.images is None else f", images={self.images!r}"
        return f"StepResult(observation={self.observation!r}, reward={self.reward!r}, done={self.done!r}{images})"


class EpisodeError(TorchforgeError):
    """An environment's ``reset`` raised, timed out or returned something unusable."""


class Environment:
    """Base class of a multi-turn environment; one instance plays one episode.

    Override :meth:`reset` and :meth:`step` (either may be ``async def``). Any object with
    these two methods works too; the base class only documents the contract. For a
    vision-language model, ``reset``'s messages put the row's images where their
    ``{"type": "image"}`` parts are, and ``step`` may show more (``StepResult(..., images=[...])``,
    or image parts that carry their image). Optional
    attributes: ``tools`` (a list of JSON schemas or Python functions, passed to the chat
    template as ``tools=``), ``reward_weight`` (the weight of the environment's rewards
    when reward functions are used as well; default 1.0), and ``close()`` (called once
    when the episode ends).

    Args:
        None.

    Returns:
        An environment.

    Example:
        >>> class Echo(Environment):
        ...     def reset(self, row):
        ...         return row["prompt"]
        ...     def step(self, action):
        ...         return StepResult(None, float(action == "hi"), True)
        >>> env = Echo()
        >>> env.reset({"prompt": "say hi"}), env.step("hi")
        ('say hi', StepResult(observation=None, reward=1.0, done=True))
    """

    tools: list | None = None
    reward_weight: float = 1.0

    def reset(self, row: dict) -> str | list[dict]:
        """Start the episode of dataset ``row``; return the first observation (the prompt).

        Args:
            row: the dataset row (a dict).

        Returns:
            The prompt text (already rendered), or chat messages (their ``{"type": "image"}``
            parts stand for the row's images, for a vision-language model).
        """
        raise NotImplementedError(f"{type(self).__name__}.reset is not implemented")

    def step(self, action: str) -> StepResult | tuple[Any, float, bool]:
        """Answer the model's turn.

        Args:
            action: the text of the model's turn (special tokens skipped).

        Returns:
            ``StepResult(observation, reward, done)`` (with ``images=`` for an observation that
            shows images) or the same as a plain tuple.
        """
        raise NotImplementedError(f"{type(self).__name__}.step is not implemented")


# --- calling environments: daemon threads, so that a hung one never blocks the exit ----------

class _DaemonPool:
    """Runs each call on an idle daemon thread, or a new one when none is idle.

    A call never waits for a thread (one per outstanding call, as if each had its own), and
    the threads are reused across turns: starting a thread per call cost more than the
    environments' steps themselves (``bench_loop.py --multi-turn``). A hung call keeps its
    thread, and the interpreter can still exit (daemon threads are not joined).
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            start = self._idle == 0
            self._idle -= 0 if start else 1
        self._calls.put((future, fn, args))
        if start:
            threading.Thread(target=self._work, daemon=True, name="torchforge-env").start()
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            begin = time.perf_counter()
            error = None
            try:
                result = fn(*args)
                if inspect.isawaitable(result):  # an async def: run it in this thread's own loop
                    result = asyncio.run(_awaited(result))
            except BaseException as caught:  # noqa: BLE001 - reported to the caller as the episode's fault
                error = caught
            seconds = time.perf_counter() - begin
            with self._lock:  # idle before the caller hears back: its next calls reuse this thread
                self._idle += 1
            if error is None:
                future.set_result((result, seconds))
            else:
                future.set_exception(error)
            del future, fn, args, error


_POOL = _DaemonPool()


def _call_async(fn: Callable, *args: Any) -> concurrent.futures.Future:
    """Run ``fn(*args)`` on a daemon thread; the future holds ``(result, seconds)``."""
    return _POOL.submit(fn, *args)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _gather(futures: Sequence[concurrent.futures.Future], timeout: float | None) -> list[tuple[Any, float, str | None]]:
    """``(result, seconds, fault)`` of each call, waiting at most ``timeout`` seconds in all."""
    concurrent.futures.wait(futures, timeout=timeout)
    out = []
    for future in futures:
        if not future.done():
            out.append((None, float(timeout or 0.0), f"timed out after {timeout} s"))
        elif future.exception() is not None:
            error = future.exception()
            out.append((None, math.nan, f"raised {type(error).__name__}: {error}"))
        else:
            result, seconds = future.result()
            out.append((result, seconds, None))
    return out


def _step_result(value: Any) -> tuple[StepResult | None, str | None]:
    """Check what ``step`` returned: a StepResult, or the reason it is not one."""
    if not (isinstance(value, tuple) and len(value) in (3, 4)):
        return None, f"returned {value!r}; expected StepResult(observation, reward, done)"
    observation, reward, done, *images = value
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) and not (
        isinstance(reward, torch.Tensor) and reward.numel() == 1
    ):
        return None, f"returned reward {reward!r}; expected a float"
    if not math.isfinite(float(reward)):
        return None, f"returned reward {float(reward)}; expected a finite float"
    if observation is not None and not isinstance(observation, (str, list)):
        return None, f"returned observation {observation!r}; expected a str, a list of chat messages or None"
    return StepResult(observation, float(reward), bool(done), images[0] if images else None), None


# --- observations to tokens ---------------------------------------------------------------

_SENTINEL = "\u2063torchforge\u2063"


def _template(tokenizer: Any, messages: list[dict], tools: Any, *, add_generation_prompt: bool) -> str:
    kwargs = {"tools": tools} if tools is not None else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


def _need_template(tokenizer: Any, what: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidArgumentError(
            f"rollout_episodes: {what} is a list of chat messages but the tokenizer has no chat_template; "
            "expected text observations, or a tokenizer with a chat template"
        )


def _observation_images(observation: Any, given: Any, where: str) -> list[Any]:
    """An observation's PIL images: those its chat parts carry (``{"type": "image", "image": ...}``),
    else ``given`` (its ``StepResult.images``, or the row's for the prompt)."""
    parts = [part for message in (observation if isinstance(observation, list) else [])
             if isinstance(message, dict) and isinstance(message.get("content"), list)
             for part in message["content"] if isinstance(part, dict) and part.get("type") == "image"]
    inline = [next(part[k] for k in ("image", "path", "url") if part.get(k) is not None) for part in parts
              if any(part.get(k) is not None for k in ("image", "path", "url"))]
    if inline and given not in (None, []):
        raise InvalidArgumentError(f"rollout_episodes: {where} carries images in its image parts and as images; "
                                   "expected one of them")
    raw = inline or given
    return load_images(raw, where=f"rollout_episodes: {where}") if raw not in (None, []) else []


def _vision_of(processor: Any, text: str, images: list[Any], where: str) -> None:
    """One-line errors for an observation's images: no processor (a text-only model), or not
    one image per placeholder of its rendered text."""
    if images and processor is None:
        raise InvalidArgumentError(
            f"rollout_episodes: {where} has {len(images)} image(s) but no processor was given (a text-only model); "
            "expected text observations, or processor= with a vision-language model"
        )
    if processor is None:
        return
    placeholders = image_placeholders(processor, text)
    if placeholders is not None and placeholders != len(images):
        raise InvalidArgumentError(
            f"rollout_episodes: {where} renders {placeholders} image placeholder(s) ({processor.image_token!r}) but "
            f"has {len(images)} image(s); expected one image per placeholder ({{'type': 'image'}} part)"
        )


class _Episode:
    """The state of one episode while it is played."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.tools = getattr(env, "tools", None)
        self.messages: list[dict] | None = None   # the chat so far, when the prompt was messages
        self.prompt: list[int] = []
        self.tokens: list[int] = []
        self.is_model: list[bool] = []
        self.log_probs: list[float] = []
        self.turn_ends: list[int] = []             # the last model token of each turn
        self.turn_rewards: list[float] = []
        self.env_seconds: list[float] = []
        self.version: int | None = None            # the oldest weights version of its turns
        self.vision: VisionInputs | None = None    # every image so far, in sequence order
        self.live = True
        self.truncated = False
        self.faulted = False
        self.reason = ""

    def finish(self, reason: str, *, truncated: bool = False) -> None:
        self.live, self.reason, self.truncated = False, reason, truncated
        close = getattr(self.env, "close", None)
        if callable(close):
            try:
                close()
            except Exception as error:  # noqa: BLE001 - the episode is over either way
                logger.warning("rollout_episodes: %s.close() raised %s: %s", type(self.env).__name__,
                               type(error).__name__, error)

    def observation_text(self, tokenizer: Any, observation: Any, action: list[int], stop_ids: Sequence[int],
                         chat: Any = None) -> str:
        """The text of an observation that follows the model's turn ``action`` (to tokenize once, as is);
        ``chat`` renders messages (default ``tokenizer``; a VLM's processor)."""
        if isinstance(observation, str):
            return observation
        chat = chat if chat is not None else tokenizer
        _need_template(chat, "an observation")
        history = self.messages if self.messages is not None else []
        history.append({"role": "assistant", "content": tokenizer.decode(action, skip_special_tokens=True)})
        before = _template(chat, history, self.tools, add_generation_prompt=False)
        after = _template(chat, history + list(observation), self.tools, add_generation_prompt=True)
        if not after.startswith(before):
            raise InvalidArgumentError(
                "rollout_episodes: the chat template renders the conversation differently once a message is "
                "added (it rewrites earlier turns), so an observation cannot be appended token for token; "
                "expected a template whose rendering of a conversation is a prefix of the longer one's"
            )
        # the template's text after an assistant message (e.g. "<|im_end|>\n"), less the stop
        # token the model sampled itself: the glue between the model's tokens and the observation
        marked = _template(chat, [*history[:-1], {"role": "assistant", "content": _SENTINEL}], self.tools,
                           add_generation_prompt=False)
        glue = marked[marked.rfind(_SENTINEL) + len(_SENTINEL):] if _SENTINEL in marked else ""
        if action and action[-1] in stop_ids:
            stop_text = tokenizer.decode(action[-1:], skip_special_tokens=False)
            glue = glue.removeprefix(stop_text)
        self.messages = history + list(observation)
        return glue + after[len(before):]


def _prompt_text(tokenizer: Any, episode: _Episode, first: Any, chat: Any) -> tuple[str, bool]:
    """The prompt's text (messages rendered by ``chat``: the tokenizer, or a VLM's processor), and
    whether to add the tokenizer's special tokens when encoding it."""
    if isinstance(first, str):
        # as rollout() tokenizes a rendered prompt: special tokens only without a chat template
        return first, getattr(tokenizer, "chat_template", None) is None
    if isinstance(first, list):
        _need_template(chat, "a reset() observation")
        episode.messages = list(first)
        return _template(chat, episode.messages, episode.tools, add_generation_prompt=True), False
    raise EpisodeError(
        f"rollout_episodes: {type(episode.env).__name__}.reset returned {first!r}; expected a str or a "
        "list of chat messages"
    )


def _encode_all(tokenizer: Any, texts: list[str], special: list[bool]) -> list[list[int]]:
    """Token ids of every text: one tokenizer call per value of ``special``."""
    out: list[list[int]] = [[] for _ in texts]
    for flag in (False, True):
        rows = [i for i, s in enumerate(special) if s == flag]
        if rows:
            for i, ids in zip(rows, tokenizer([texts[i] for i in rows], add_special_tokens=flag)["input_ids"]):
                out[i] = list(ids)
    return out


# --- the result ---------------------------------------------------------------------------

@dataclass
class Episodes:
    """Per-episode details of :func:`rollout_episodes` (the batch holds the tensors).

    Args:
        turns: [B] int64 model turns played.
        lengths: [B] int64 tokens of each response (model and observation tokens; T is the largest).
        returns: [B] float64 episode returns ``sum_k gamma**k * r_k`` over turns k.
        turn_rewards: B lists of each turn's reward.
        turn_index: [B, T] int64, the turn of each model token, -1 for observation and padding.
        reasons: B strings, why each episode ended (``"done"``, ``"max_turns"``,
            ``"max_total_tokens"``, ``"step raised ValueError: ..."``, ``"step timed out ..."``).
        faulted: [B] bool, the environment raised, timed out or returned bad values.
        env_seconds: the wall time of every ``step`` call (NaN for one that raised).

    Returns:
        A record.

    Example:
        >>> Episodes(turns=torch.tensor([2]), lengths=torch.tensor([3]), returns=torch.tensor([1.0]), turn_rewards=[[0.0, 1.0]],
        ...          turn_index=torch.tensor([[0, -1, 1]]), reasons=["done"], faulted=torch.tensor([False]),
        ...          env_seconds=[0.1, 0.2]).turns
        tensor([2])
    """

    turns: torch.Tensor
    lengths: torch.Tensor
    returns: torch.Tensor
    turn_rewards: list[list[float]]
    turn_index: torch.Tensor
    reasons: list[str]
    faulted: torch.Tensor
    env_seconds: list[float] = field(default_factory=list)

    def metric_sums(self, truncated: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sums and counts of the episode metrics, to reduce over processes before dividing.

        Args:
            truncated: [B] bool, the batch's ``truncated``.

        Returns:
            name -> float64 scalar tensor (see :func:`episode_metrics`).
        """
        seconds = torch.tensor([s for s in self.env_seconds if not math.isnan(s)], dtype=torch.float64)
        return {
            "episodes": torch.tensor(float(len(self.reasons)), dtype=torch.float64),
            "turns": self.turns.double().sum(),
            "turn_reward_sum": torch.tensor(sum(sum(r) for r in self.turn_rewards), dtype=torch.float64),
            "truncated": truncated.double().sum(),
            "faulted": self.faulted.double().sum(),
            "env_steps": torch.tensor(float(len(seconds)), dtype=torch.float64),
            "env_seconds": seconds.sum(),
        }


def episode_metrics(sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Episode metrics from (possibly all-reduced) :meth:`Episodes.metric_sums`.

    Args:
        sums: the dict returned by ``Episodes.metric_sums``, summed over processes or not.

    Returns:
        ``episodes/turns_mean`` (model turns per episode), ``episodes/env_seconds_per_step``,
        ``episodes/truncated_frac``, ``episodes/faulted_frac`` and ``episodes/reward_per_turn``.

    Example:
        >>> episode_metrics({"episodes": 2, "turns": 3, "turn_reward_sum": 1.5, "truncated": 1,
        ...                  "faulted": 0, "env_steps": 3, "env_seconds": 0.3})["episodes/turns_mean"]
        1.5
    """
    s = {k: float(v) for k, v in sums.items()}
    episodes, turns, steps = max(s["episodes"], 1.0), max(s["turns"], 1.0), s["env_steps"]
    return {
        "episodes/turns_mean": s["turns"] / episodes,
        "episodes/env_seconds_per_step": s["env_seconds"] / steps if steps else math.nan,
        "episodes/truncated_frac": s["truncated"] / episodes,
        "episodes/faulted_frac": s["faulted"] / episodes,
        "episodes/reward_per_turn": s["turn_reward_sum"] / turns,
    }


# --- the loop -----------------------------------------------------------------------------

def _turn_seed(seed: int, turn: int) -> int:
    """The seed of turn ``turn``: the samples of each turn are independent draws."""
    return int(sample_keys(seed, torch.tensor([turn]))[0])


def _sync_turn(live: int, max_new: int) -> tuple[int, int]:
    """Every rank plays the same number of turns with the same length limit (FSDP's forwards are collectives)."""
    if not is_distributed():
        return live, max_new
    both = torch.tensor([live, max_new], dtype=torch.long)
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    both = both.to(device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
    return int(both[0]), int(both[1])


@torch.no_grad()
def rollout_episodes(
    model: nn.Module,
    tokenizer: Any,
    envs: Sequence[Any],
    *,
    rows: Sequence[dict],
    num_generations: int,
    max_turns: int,
    max_new_tokens_per_turn: int,
    max_total_tokens: int,
    step_timeout: float | None = 60.0,
    fault_reward: float = 0.0,
    gamma: float = 1.0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int | None = None,
    episode_ids: Sequence[int] | None = None,
    engine: GenerationEngine | None = None,
    images: Sequence[Sequence[Any]] | None = None,
    processor: Any = None,
) -> tuple[Batch, Episodes]:
    """Play B = N * G multi-turn episodes, one batched generation per turn -> a training Batch.

    Episode ``b`` plays ``envs[b]`` from ``envs[b].reset(rows[b // G])``. Each turn, the
    contexts of the live episodes (prompt + every token so far) are sampled together by one
    call of :func:`torchforge.loop.rollout` (the seeded sampler: turn k of episode e depends
    only on ``(seed, k, e)``, the model and the episode so far); then every live
    environment's ``step(action)`` runs in its own thread, at most ``step_timeout`` seconds
    for them all. The model's tokens enter the sequence with ``mask`` True and their
    ``rollout_log_probs``; an observation is tokenized once (text as is; chat messages
    through the chat template, with the environment's ``tools``) and appended with ``mask``
    False. Turn k's reward ``r_k`` sits at the last model token of turn k:

        rewards[b, t] = r_k  where t = the last model token of turn k, else 0
        returns[b]    = sum_k gamma**k * r_k

    An episode ends when ``done`` is True, after ``max_turns`` model turns (flagged
    ``truncated``), or when the next token would pass ``max_total_tokens`` (model turns cut
    there, ``truncated``; an observation that leaves no room for a model token ends the
    episode before it is appended). A cut turn's action still goes to ``step``, whose
    reward counts and whose observation is dropped. An environment whose ``step`` raises,
    times out or returns something other than ``(observation, reward, done)`` ends its
    episode with reward ``fault_reward`` for that turn; the reason is logged (warning) and
    kept in ``Episodes.reasons``, and the other episodes go on.

    Args:
        model: a Hugging Face causal LM (plain, DDP or FSDP2; under several processes every
            rank calls this; the ranks play the same number of turns).
        tokenizer: its tokenizer (with a ``chat_template`` for message observations).
        envs: B = N * G environments, one per episode (:class:`Environment` or any object
            with ``reset(row)`` and ``step(action)``, either possibly ``async def``).
        rows: the N dataset rows; the G episodes of row i are ``envs[i * G:(i + 1) * G]``.
        num_generations: G >= 1 episodes per row.
        max_turns: >= 1 model turns per episode.
        max_new_tokens_per_turn: >= 1 tokens of one model turn.
        max_total_tokens: >= 1 tokens after the prompt (model and observation tokens): T <= it.
        step_timeout: seconds one turn's ``step`` calls may take (they run concurrently);
            None waits forever.
        fault_reward: the reward of a turn whose ``step`` raised, timed out or returned bad values.
        gamma: the per-turn discount of ``Episodes.returns``.
        temperature, top_p, top_k: sampling, as in :func:`torchforge.loop.rollout`.
        engine: the generation engine of every turn (default Hugging Face ``generate`` on ``model``).
        stop_token_ids: ids that end a model turn; default :func:`completion_stop_ids`.
        seed: the sampling seed; default drawn from torch's global RNG.
        episode_ids: N global ids of the rows (default 0..N-1): episode ``(i, g)`` gets the
            same samples wherever it runs (another process, another batch).
        images: N lists of the rows' images (PIL images or paths; [] for a row without), for
            the prompts a vision-language model reads: one per image placeholder (``{"type":
            "image"}`` part) of what ``reset`` returns, unless its parts carry their images.
        processor: a vision-language model's processor: it renders chat messages, and turns
            the prompt's and the observations' images (``StepResult.images``) into image tokens
            and vision inputs; the episode's inputs so far go to every turn's sampling and the
            batch carries them all (``vision``). Images without a processor are an error.

    Returns:
        ``(batch, episodes)``: a ``Batch`` of B rows with ``tokens`` [B, T], ``mask`` [B, T]
        (the model's tokens), ``rollout_log_probs`` [B, T] (0 off the mask), ``rewards``
        [B, T] (per turn, as above), ``prompt_tokens`` / ``prompt_mask`` [B, P] and
        ``truncated`` [B], with images also ``vision`` (every image of an episode, in order:
        :func:`torchforge.loop.vision.stack_vision`); and an :class:`Episodes` record (turns,
        returns, reasons, ...).

    Example:
        >>> from torchforge.loop.tiny_model import char_tokenizer, tiny_llama
        >>> class Twice(Environment):
        ...     def reset(self, row):
        ...         return row["prompt"]
        ...     def step(self, action):
        ...         self.turn = getattr(self, "turn", 0) + 1
        ...         return StepResult("=", 1.0, self.turn == 2)
        >>> tokenizer = char_tokenizer()
        >>> batch, episodes = rollout_episodes(
        ...     tiny_llama(tokenizer), tokenizer, [Twice(), Twice()], rows=[{"prompt": "12="}],
        ...     num_generations=2, max_turns=3, max_new_tokens_per_turn=3, max_total_tokens=16, seed=0)
        >>> episodes.turns.tolist(), episodes.returns.tolist(), batch.rewards.sum(-1).tolist()
        ([2, 2], [2.0, 2.0], [2.0, 2.0])

    Note:
        Like verl's and TRL's multi-turn rollouts, and unlike re-rendering the whole
        conversation each turn, the trained tokens are the sampled ones: re-tokenizing
        decoded text can merge or split tokens at the boundaries and the training log-probs
        would no longer be those of the samples. Each turn re-reads its whole context (no
        KV cache is kept between turns), as ``generate`` does.
    """
    fn = "rollout_episodes"
    for name, value in (("num_generations", num_generations), ("max_turns", max_turns),
                        ("max_new_tokens_per_turn", max_new_tokens_per_turn), ("max_total_tokens", max_total_tokens)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise InvalidArgumentError(f"{fn}: {name} must be an int >= 1, got {value!r}")
    if not rows:
        raise InvalidArgumentError(f"{fn}: rows is empty; expected at least one dataset row")
    G, N = num_generations, len(rows)
    if len(envs) != N * G:
        raise InvalidArgumentError(
            f"{fn}: {len(envs)} environments for {N} rows x num_generations={G}; expected {N * G}, one per episode"
        )
    if step_timeout is not None and not step_timeout > 0:
        raise InvalidArgumentError(f"{fn}: step_timeout must be > 0 or None, got {step_timeout!r}")
    if not 0 <= gamma <= 1:
        raise InvalidArgumentError(f"{fn}: gamma must be in [0, 1], got {gamma!r}")
    ids = list(range(N)) if episode_ids is None else [int(i) for i in episode_ids]
    if len(ids) != N:
        raise InvalidArgumentError(f"{fn}: {len(ids)} episode_ids for {N} rows; expected one each")
    if images is not None and len(images) != N:
        raise InvalidArgumentError(f"{fn}: {len(images)} image lists for {N} rows; expected one per row")
    inner = unwrap_model(model)
    stop_ids = list(stop_token_ids) if stop_token_ids else completion_stop_ids(tokenizer, inner)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    chat = processor if processor is not None else tokenizer  # what renders chat messages
    # a sampled image placeholder ended its turn; later turns read a plain token there, as
    # policy_log_probs does (the model has no image for it)
    placeholders = set(placeholder_ids(inner)) if processor is not None else set()

    # --- reset: the prompts (a reset that fails is a setup error: nothing to train on) -------
    episodes = [_Episode(env) for env in envs]
    starts = _gather([_call_async(ep.env.reset, rows[b // G]) for b, ep in enumerate(episodes)], step_timeout)
    for b, (ep, (first, _, fault)) in enumerate(zip(episodes, starts)):
        if fault is not None:
            raise EpisodeError(f"{fn}: the reset() of episode {b} ({type(ep.env).__name__}) {fault}")
    texts, special = zip(*(_prompt_text(tokenizer, ep, first, chat) for ep, (first, _, _) in zip(episodes, starts)))
    prompt_images = []
    for b, (ep, (first, _, _)) in enumerate(zip(episodes, starts)):
        where = f"the reset() of episode {b} ({type(ep.env).__name__})"
        prompt_images.append(_observation_images(first, images[b // G] if images is not None else None, where))
        _vision_of(processor, texts[b], prompt_images[b], where)
    encoded = _encode_all(tokenizer, list(texts), list(special))
    for b, (ep, prompt) in enumerate(zip(episodes, encoded)):
        if prompt_images[b]:  # through the processor: its image tokens expanded, its vision inputs
            (prompt,), (ep.vision,) = encode_vision_prompts(processor, [texts[b]], [prompt_images[b]])
        if not prompt:
            raise EpisodeError(f"{fn}: the reset() of episode {b} ({type(ep.env).__name__}) returned a prompt of no tokens")
        ep.prompt = prompt
    global_ids = [ids[b // G] * G + b % G for b in range(N * G)]

    # --- the turns ------------------------------------------------------------------------
    for turn in range(max_turns):
        live = [b for b, ep in enumerate(episodes) if ep.live]
        room = [max_total_tokens - len(episodes[b].tokens) for b in live]
        any_live, max_new = _sync_turn(len(live), min(max_new_tokens_per_turn, max(room, default=1)))
        if any_live == 0:
            break
        # one batched call for every live episode (a rank with none samples a stand-in row,
        # so that every rank runs the same generate calls)
        contexts = [episodes[b].prompt + _context(episodes[b], placeholders) for b in live] or [[pad_id]]
        vision = [episodes[b].vision for b in live] if processor is not None else None
        sample = rollout(model, tokenizer, contexts, num_generations=1, max_new_tokens=max_new,
                         temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=stop_ids,
                         seed=_turn_seed(seed, turn), prompt_ids=[global_ids[b] for b in live] or [0],
                         engine=engine, vision=(vision or [None]) if vision is not None else None)
        lengths = sample.mask.sum(-1).tolist()
        tokens, log_probs = sample.tokens.tolist(), sample.rollout_log_probs.float().tolist()
        versions = sample.policy_version.tolist()
        actions, cut = {}, {}
        for i, b in enumerate(live):
            ep = episodes[b]
            n = min(lengths[i], room[i])
            cut[b] = lengths[i] > room[i]
            action = tokens[i][:n]
            ep.version = versions[i] if ep.version is None else min(ep.version, versions[i])
            ep.tokens += action
            ep.is_model += [True] * n
            ep.log_probs += log_probs[i][:n]
            ep.turn_ends.append(len(ep.tokens) - 1)
            actions[b] = action

        # the environments answer, concurrently
        texts = {b: tokenizer.decode(actions[b], skip_special_tokens=True) for b in live}
        answers = _gather([_call_async(episodes[b].env.step, texts[b]) for b in live], step_timeout)
        observed: dict[int, str] = {}
        observed_images: dict[int, list[Any]] = {}
        for b, (value, seconds, fault) in zip(live, answers):
            ep = episodes[b]
            ep.env_seconds.append(seconds)
            result = None
            if fault is None:
                result, fault = _step_result(value)
            if fault is not None:
                reason = f"step {fault}"
                logger.warning("%s: episode %d (%s) ended at turn %d: %s; reward %s", fn, global_ids[b],
                               type(ep.env).__name__, turn, reason, fault_reward)
                ep.turn_rewards.append(float(fault_reward))
                ep.faulted = True
                ep.finish(reason)
                continue
            ep.turn_rewards.append(result.reward)
            if cut[b] or (len(ep.tokens) >= max_total_tokens and not result.done):
                ep.finish("max_total_tokens", truncated=True)
            elif result.done:
                ep.finish("done")
            elif turn == max_turns - 1:
                ep.finish("max_turns", truncated=True)
            elif result.observation is not None or result.images:
                where = f"the observation of {type(ep.env).__name__}.step (episode {global_ids[b]}, turn {turn})"
                observed_images[b] = _observation_images(result.observation, result.images, where)
                observed[b] = ep.observation_text(tokenizer, result.observation or "", actions[b], stop_ids, chat)
                _vision_of(processor, observed[b], observed_images[b], where)
        # the observations, tokenized once (in one call; those with images through the processor)
        # and appended as mask gaps
        encoded = _encode_all(tokenizer, list(observed.values()), [False] * len(observed))
        for b, observation in zip(observed, encoded):
            ep = episodes[b]
            seen = None
            if observed_images[b]:
                (observation,), (seen,) = encode_vision_prompts(processor, [observed[b]], [observed_images[b]],
                                                                add_special_tokens=False)
            if len(ep.tokens) + len(observation) >= max_total_tokens:
                ep.finish("max_total_tokens", truncated=True)
            else:
                ep.tokens += observation
                ep.is_model += [False] * len(observation)
                ep.log_probs += [0.0] * len(observation)
                ep.vision = join_vision([ep.vision, seen])

    return _to_batch(episodes, pad_id, gamma)


def _context(episode: _Episode, placeholders: set[int]) -> list[int]:
    """The episode's tokens after its prompt as the next turn reads them: a sampled image
    placeholder (which ended its turn) as a plain token, 0, as the training forward has it."""
    if not placeholders:
        return episode.tokens
    return [0 if is_model and token in placeholders else token
            for token, is_model in zip(episode.tokens, episode.is_model)]


def _to_batch(episodes: list[_Episode], pad_id: int, gamma: float) -> tuple[Batch, Episodes]:
    """Right-pad the responses and left-pad the prompts into a Batch, and the Episodes record."""
    B = len(episodes)
    T = max(len(ep.tokens) for ep in episodes)
    P = max(len(ep.prompt) for ep in episodes)
    # padded Python lists, then one tensor each (per-row tensor writes cost more than the rest)
    tokens = torch.tensor([ep.tokens + [pad_id] * (T - len(ep.tokens)) for ep in episodes], dtype=torch.long)
    mask = torch.tensor([ep.is_model + [False] * (T - len(ep.tokens)) for ep in episodes], dtype=torch.bool)
    log_probs = torch.tensor([ep.log_probs + [0.0] * (T - len(ep.tokens)) for ep in episodes], dtype=torch.float32)
    prompt_tokens = torch.tensor([[pad_id] * (P - len(ep.prompt)) + ep.prompt for ep in episodes], dtype=torch.long)
    prompt_mask = torch.tensor([[False] * (P - len(ep.prompt)) + [True] * len(ep.prompt) for ep in episodes])
    rewards = [[0.0] * T for _ in episodes]
    turn_index = [[-1] * T for _ in episodes]
    for b, ep in enumerate(episodes):
        start = 0
        for k, (end, reward) in enumerate(zip(ep.turn_ends, ep.turn_rewards)):
            rewards[b][end] = reward
            for t in range(start, end + 1):
                if ep.is_model[t]:
                    turn_index[b][t] = k
            start = end + 1
    returns = torch.tensor([sum(gamma ** k * r for k, r in enumerate(ep.turn_rewards)) for ep in episodes],
                           dtype=torch.float64)  # as score_rewards: the group statistics see them unrounded
    batch = Batch(
        tokens=tokens, mask=mask, rollout_log_probs=log_probs, rewards=torch.tensor(rewards, dtype=torch.float32),
        prompt_tokens=prompt_tokens, prompt_mask=prompt_mask,
        truncated=torch.tensor([ep.truncated for ep in episodes], dtype=torch.bool),
        policy_version=torch.tensor([ep.version or 0 for ep in episodes], dtype=torch.long), batch_size=[B],
    )
    if any(ep.vision is not None for ep in episodes):
        batch.vision = stack_vision([ep.vision for ep in episodes])
    record = Episodes(
        turns=torch.tensor([len(ep.turn_ends) for ep in episodes], dtype=torch.long),
        lengths=torch.tensor([len(ep.tokens) for ep in episodes], dtype=torch.long), returns=returns,
        turn_rewards=[list(ep.turn_rewards) for ep in episodes], turn_index=torch.tensor(turn_index, dtype=torch.long),
        reasons=[ep.reason for ep in episodes],
        faulted=torch.tensor([ep.faulted for ep in episodes], dtype=torch.bool),
        env_seconds=[s for ep in episodes for s in ep.env_seconds],
    )
    return batch, record
