"""verifiers environments as torchforge environments: their dataset, turns and rubric.

A `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environment
(``vf.SingleTurnEnv``, ``vf.MultiTurnEnv`` and their subclasses, usually from a module's
``load_environment()``) holds a dataset, a ``Rubric(funcs, weights)`` and, for several
turns, ``env_response(messages, state)``. verifiers plays it by calling a model through an
OpenAI-style client; here torchforge's loop plays the model's turns instead (token in,
token out, one batched generation per turn) and verifiers does the rest::

    env = VerifiersEnvironment(load_environment())            # or VerifiersEnvironment.load("my-env")
    RLTrainer(model=..., tokenizer=..., environment_factory=env)   # rows: env.train_dataset

Per episode (:class:`VerifiersEpisode`), with verifiers' own state and hooks::

    reset(row)   -> env.init_state(row); env.setup_state(state)       -> prompt = state["prompt"]
    step(text)   -> the assistant message joins state["trajectory"];
                    done when env.is_completed(state) (max_turns, a stop condition, an error)
                    else env.get_prompt_messages(state) -> env_response's messages: the next turn
                    (a final_env_response ends the episode)
    the end      -> env.cleanup(state) (renders state["completion"])

and after the step's episodes, :meth:`VerifiersEnvironment.score_episodes` scores each
row's G episodes together with ``env.rubric.score_group`` (group reward functions see the
whole group, as in verifiers): the episode's reward is the rubric's weighted sum
``sum_f w_f * r_f`` and each function's unweighted score ``r_f`` (metrics of weight 0
included, e.g. ``num_turns``) is logged as ``rewards/environment/<name>/mean``. The turn
rewards are 0 (verifiers scores whole rollouts).

Note:
    This is verifiers' classic environment API (``verifiers`` 0.2 and 0.3, where 0.3 keeps
    it as ``verifiers.legacy``); 0.4 removed it for the ``verifiers.v1`` taskset / harness
    stack, which runs its own agent loop against a served model. The model's text becomes
    an assistant message with that content: tool-call environments (``vf.ToolEnv``) need
    ``parse_action`` to turn it into a message with ``tool_calls``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import signal
import threading
from typing import Any, Callable, Sequence

import torch

from torchforge.errors import InvalidArgumentError
from torchforge.loop.environments import Environment, EpisodeError, StepResult

__all__ = ["VerifiersEnvironment", "VerifiersEpisode", "message_text"]

logger = logging.getLogger(__name__)


def _require_verifiers(fn: str) -> Any:
    try:
        import verifiers as vf

        vf.Environment  # noqa: B018 - 0.4 has no classic API: fail here, in one line
    except (ImportError, AttributeError):
        raise InvalidArgumentError(f"{fn}: verifiers environments need verifiers' classic API (verifiers>=0.2,<0.4), "
                                   "which is not installed; pip install 'torchforge[verifiers]'") from None
    return vf


class _Loop:
    """One event loop on a daemon thread for every episode of an environment: verifiers' state
    (clients, sandboxes, locks) may be bound to the loop that made it, so every call runs there."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def run(self, coroutine: Any, timeout: float | None = None) -> Any:
        """The coroutine's result; ``TimeoutError`` after ``timeout`` seconds (it is cancelled)."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True, name="torchforge-verifiers").start()
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer in {timeout} s") from None


def message_text(messages: Sequence[Any]) -> str:
    """The text of chat messages, joined: for a tokenizer without a chat template (``chat=False``).

    Args:
        messages: dicts or verifiers messages with a ``content`` (text, or a list of parts
            of which the ``text`` ones count).

    Returns:
        The contents, concatenated.

    Example:
        >>> parts = [{"type": "text", "text": "="}]
        >>> message_text([{"role": "user", "content": "12"}, {"role": "user", "content": parts}])
        '12='
    """
    def field(item: Any, name: str) -> Any:
        return item.get(name) if isinstance(item, dict) else getattr(item, name, None)

    out = []
    for message in messages:
        content = field(message, "content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [field(part, "text") or "" for part in content if field(part, "type") == "text"]
    return "".join(out)


def _as_dicts(messages: Sequence[Any]) -> list[dict]:
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in messages]


class VerifiersEnvironment:
    """A verifiers environment as ``RLTrainer``'s environment factory, its dataset and its rubric.

    Calling it makes one :class:`VerifiersEpisode`; ``train_dataset`` is the environment's
    dataset (``env.get_dataset()``: rows with ``prompt``, ``answer``, ``info``,
    ``example_id``), which ``RLTrainer`` uses when it is given no ``train_dataset``;
    :meth:`score_episodes` scores the episodes with the rubric (see the module).

    Args:
        env: a ``vf.Environment`` (``SingleTurnEnv``, ``MultiTurnEnv``, ...).
        chat: True: prompts and environment responses are chat messages (rendered with the
            tokenizer's chat template, the environment's ``tool_defs`` as ``tools``);
            False: their text (:func:`message_text`), for a tokenizer without a template.
        parse_action: a function from the model's text to the assistant message (a dict
            with ``content`` and optionally ``tool_calls``); default the text as ``content``.
        reward_weight: the weight of the rubric's reward next to torchforge reward functions.
        score_timeout: seconds the rubric may take to score one step's episodes, and
            ``cleanup`` one episode (a hung grader or sandbox then raises, never stalls).

    Returns:
        The factory.

    Example:
        >>> import verifiers as vf  # doctest: +SKIP
        >>> from datasets import Dataset  # doctest: +SKIP
        >>> env = vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": "12=", "answer": "12"}]),
        ...                        rubric=vf.Rubric(funcs=[lambda completion, answer, **kw: 1.0]))  # doctest: +SKIP
        >>> source = VerifiersEnvironment(env, chat=False)  # doctest: +SKIP
        >>> source.train_dataset[0]["prompt"], source().reset(source.train_dataset[0])  # doctest: +SKIP
        ([{'role': 'user', 'content': '12='}], '12=')
    """

    def __init__(self, env: Any, *, chat: bool = True, parse_action: Callable[[str], dict] | None = None,
                 reward_weight: float = 1.0, score_timeout: float = 600.0) -> None:
        fn = "VerifiersEnvironment"
        vf = _require_verifiers(fn)
        if not isinstance(env, vf.Environment):
            raise InvalidArgumentError(f"{fn}: env is a {type(env).__name__}; expected a verifiers Environment "
                                       "(vf.SingleTurnEnv, vf.MultiTurnEnv, ...: what load_environment() returns)")
        if not isinstance(chat, bool):
            raise InvalidArgumentError(f"{fn}: chat={chat!r}; expected True (chat messages) or False (text)")
        if parse_action is not None and not callable(parse_action):
            raise InvalidArgumentError(f"{fn}: parse_action={parse_action!r}; expected a function from text to a "
                                       "message")
        if isinstance(reward_weight, bool) or not isinstance(reward_weight, (int, float)) or not math.isfinite(
                reward_weight):
            raise InvalidArgumentError(f"{fn}: reward_weight={reward_weight!r}; expected a finite number")
        if isinstance(score_timeout, bool) or not isinstance(score_timeout, (int, float)) or not score_timeout > 0:
            raise InvalidArgumentError(f"{fn}: score_timeout={score_timeout!r}; expected seconds > 0")
        self.env, self.chat, self.parse_action, self.reward_weight = env, chat, parse_action, float(reward_weight)
        self.score_timeout = float(score_timeout)
        tools = getattr(env, "tool_defs", None)
        self.tools = [{"type": "function", "function": _as_dicts([t])[0]} for t in tools] if tools and chat else None
        self.loop = _Loop()
        self._train_dataset: Any = None

    @classmethod
    def load(cls, env_id: str, *, env_args: dict | None = None, **settings: Any) -> "VerifiersEnvironment":
        """``verifiers.load_environment(env_id, **env_args)`` (the installed module ``env_id``'s
        ``load_environment``), keeping torchforge's SIGINT / SIGTERM handlers (verifiers sets its own).

        Args:
            env_id: the environment's module (``"my-env"`` imports ``my_env``).
            env_args: keyword arguments of its ``load_environment``.
            **settings: :class:`VerifiersEnvironment`'s (``chat``, ``parse_action``, ``reward_weight``).

        Returns:
            The factory.

        Example:
            >>> source = VerifiersEnvironment.load("my-env", env_args={"difficulty": "easy"})  # doctest: +SKIP
        """
        vf = _require_verifiers("VerifiersEnvironment.load")
        if not isinstance(env_id, str) or not env_id:
            raise InvalidArgumentError(f"VerifiersEnvironment.load: env_id={env_id!r}; expected a module name")
        main = threading.current_thread() is threading.main_thread()
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            env = vf.load_environment(env_id, **(env_args or {}))
        except (ValueError, RuntimeError) as error:
            raise InvalidArgumentError(f"VerifiersEnvironment.load: {error}") from error
        finally:
            for number, handler in handlers.items():
                signal.signal(number, handler)
        return cls(env, **settings)

    @property
    def train_dataset(self) -> list[dict]:
        """The environment's dataset as rows (built once)."""
        if self._train_dataset is None:
            try:
                self._train_dataset = list(self.env.get_dataset())
            except ValueError as error:  # "dataset is not set": an environment with an eval_dataset only
                raise InvalidArgumentError(f"VerifiersEnvironment.train_dataset: {type(self.env).__name__} has no "
                                           f"training dataset ({error}); expected one, or pass train_dataset= "
                                           "to RLTrainer") from None
        return self._train_dataset

    def __call__(self) -> "VerifiersEpisode":
        return VerifiersEpisode(self)

    def score_episodes(self, episodes: Sequence["VerifiersEpisode"], *, num_generations: int,
                       faulted: Sequence[bool]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score the episodes with the rubric, each row's G episodes as one group.

        ``rewards[b] = sum_f w_f * r_f[b]`` (``state["reward"]``) and ``parts[f][b] = r_f[b]``
        (``state["metrics"]``). An episode that faulted, or never started, is not scored:
        reward 0 and NaN parts (left out of the means).

        Args:
            episodes: the B = N * G episodes, in the order they were played.
            num_generations: G.
            faulted: B flags, the episodes whose environment raised or timed out.

        Returns:
            ``(rewards, parts)``: float64 [B] and name -> float64 [B].

        Example:
            >>> batch, record = rollout_episodes(model, tokenizer, episodes, rows=rows, num_generations=2,
            ...                                  max_turns=2, max_new_tokens_per_turn=8, max_total_tokens=64)  # doctest: +SKIP
            >>> rewards, parts = source.score_episodes(episodes, num_generations=2,
            ...                                        faulted=record.faulted.tolist())  # doctest: +SKIP
        """
        B, G = len(episodes), num_generations
        if B % G or len(faulted) != B:
            raise InvalidArgumentError(f"VerifiersEnvironment.score_episodes: {B} episodes, {len(faulted)} faulted "
                                       f"flags, num_generations={G}; expected a multiple of G and one flag each")
        states = [ep.state if ep.state is not None and not f else None for ep, f in zip(episodes, faulted)]
        rubric = self.env.rubric

        async def score() -> None:
            for i in range(0, B, G):
                group = [s for s in states[i:i + G] if s is not None]
                if not group:
                    continue
                if getattr(self.env, "score_rollouts", True):
                    await rubric.score_group(group)
                else:
                    await rubric.dummy_score_group(group)
                for state in group:
                    await rubric.cleanup(state)

        try:
            self.loop.run(score(), self.score_timeout)
        except TimeoutError:
            raise EpisodeError(f"VerifiersEnvironment.score_episodes: the rubric of {type(self.env).__name__} did not "
                               f"score {B} episodes in score_timeout={self.score_timeout} s; expected graders that "
                               "answer (or a larger score_timeout)") from None
        names: list[str] = []
        for state in states:
            for name in (state or {}).get("metrics") or {}:
                if name not in names:
                    names.append(name)
        rewards = torch.tensor([float(s["reward"] or 0.0) if s is not None else 0.0 for s in states],
                               dtype=torch.float64)
        parts = {name: torch.tensor([float((s.get("metrics") or {}).get(name, math.nan)) if s is not None else math.nan
                                     for s in states], dtype=torch.float64) for name in names}
        return rewards, parts


class VerifiersEpisode(Environment):
    """One episode of a verifiers environment, its ``State`` kept as ``self.state`` (see the module).

    Args:
        source: the :class:`VerifiersEnvironment` (its environment, settings and event loop).

    Returns:
        An environment.

    Example:
        >>> episode = source()  # doctest: +SKIP
        >>> episode.reset(source.train_dataset[0]), episode.step("12")  # doctest: +SKIP
        ('12=', StepResult(observation=None, reward=0.0, done=True))
    """

    def __init__(self, source: VerifiersEnvironment) -> None:
        self.source = source
        self.tools = source.tools
        self.reward_weight = source.reward_weight
        self.state: Any = None
        self.messages: list = []   # the conversation so far (verifiers' messages)
        self.closed = False

    def _render(self, messages: Sequence[Any]) -> str | list[dict]:
        return _as_dicts(messages) if self.source.chat else message_text(messages)

    def reset(self, row: dict[str, Any]) -> str | list[dict]:
        """verifiers' ``init_state`` and ``setup_state`` for the row; its prompt."""
        env = self.source.env

        async def start() -> Any:
            state = await env.init_state(dict(row), _no_model_client(), "torchforge")
            setup = await env.setup_state(state)
            return setup if setup is not None else state

        self.state = self.source.loop.run(start())
        if self.state.get("error") is not None:
            raise EpisodeError(f"VerifiersEpisode.reset: setup_state failed: {self.state['error']}")
        self.messages = list(self.state["prompt"])
        return self._render(self.messages)

    def step(self, action: str) -> StepResult:
        """The model's turn joins the trajectory; verifiers' stop conditions and env_response answer."""
        vf = _require_verifiers("VerifiersEpisode.step")
        env, state = self.source.env, self.state
        if state is None:
            raise EpisodeError("VerifiersEpisode.step: called before reset; expected reset(row) first")
        message = self.source.parse_action(action) if self.source.parse_action else {"content": action}
        completion = [vf.AssistantMessage(**{**message, "role": "assistant"})]

        async def turn() -> tuple[Any, bool]:
            await env.add_trajectory_step(state, vf.TrajectoryStep(
                prompt=list(self.messages), completion=completion, response=None, tokens=None, reward=None,
                advantage=None, is_truncated=False, trajectory_id=state["trajectory_id"], extras={}))
            if await env.is_completed(state):
                return None, True
            following = list(await env.get_prompt_messages(state))
            if state.get("final_env_response") is not None or await env.is_completed(state):
                return None, True
            return following, False

        following, done = self.source.loop.run(turn())
        if state.get("error") is not None:
            raise EpisodeError(f"VerifiersEpisode.step: {type(state['error']).__name__}: {state['error']}")
        if done:
            return StepResult(None, 0.0, True)
        before = [*self.messages, *completion]
        if len(following) < len(before) or _as_dicts(following[:len(before)]) != _as_dicts(before):
            raise EpisodeError("VerifiersEpisode.step: get_prompt_messages rewrote the conversation; expected the "
                               "next prompt to extend it (torchforge appends each turn's tokens as they are)")
        self.messages = following
        return StepResult(self._render(following[len(before):]), 0.0, False)

    def close(self) -> None:
        """verifiers' cleanup of the state (it renders ``state["completion"]`` for the rubric)."""
        if self.state is not None and not self.closed:
            self.closed = True
            self.source.loop.run(self.source.env.cleanup(self.state), self.source.score_timeout)


def _no_model_client() -> Any:
    """A verifiers ``Client`` that is never asked for a completion: torchforge plays the model."""
    from verifiers.clients import Client

    class TorchforgeModel(Client):
        def setup_client(self, config):  # noqa: D102 - the abstract methods: never called
            return None

        async def to_native_tool(self, tool):
            raise NotImplementedError("torchforge samples the model's turns itself")

        async def to_native_prompt(self, messages):
            raise NotImplementedError("torchforge samples the model's turns itself")

        async def get_native_response(self, *args, **kwargs):
            raise NotImplementedError("torchforge samples the model's turns itself")

        async def raise_from_native_response(self, response):
            raise NotImplementedError("torchforge samples the model's turns itself")

        async def from_native_response(self, response):
            raise NotImplementedError("torchforge samples the model's turns itself")

        async def close(self):
            return None

    return TorchforgeModel(None)
