"""OpenEnv environments as torchforge environments: one OpenEnv session per episode.

An OpenEnv environment (the ``openenv-core`` package: Meta's and Hugging Face's standard,
used by TRL and Meta's forge) runs as a server with typed actions and observations
(pydantic models). :func:`openenv_environment` connects torchforge's multi-turn loop to
one::

    factory = openenv_environment("http://127.0.0.1:8000")      # text in, text out: the defaults
    RLTrainer(model=..., tokenizer=..., environment_factory=factory, train_dataset=rows)

Each episode is one :class:`OpenEnvEnvironment`: one session of the server, through the
package's own client (``GenericEnvClient`` by default, or the environment's typed
``EnvClient`` subclass). Per episode::

    reset(row)      -> client.reset(**reset(row))     -> prompt = observation(first observation)
    step(text)      -> client.step(action(text))      -> StepResult(observation(obs), reward, done)

The model's text becomes the action through ``action`` (a field name, or a function from
the text to the action's fields); an observation becomes the next turn through
``observation`` (a field name, or a function to text, chat messages or None). With neither
given, the server's ``/schema`` names them: the action's one string field and the
observation's one string field (echo-style, chat and text-game environments). Rewards pass
through (None is 0.0), ``done`` ends the episode. A server that errors, or answers nothing
within ``message_timeout`` seconds, makes ``step`` raise, and :func:`rollout_episodes`
ends that episode with the reason (the other episodes and the run go on).

Note:
    The server's stateful endpoint is its WebSocket session (``/ws``), which the package's
    client uses: OpenEnv's plain HTTP ``/reset`` and ``/step`` build a fresh environment
    per request, so a multi-turn episode cannot be played over them. Each live episode
    holds one session: start the server with ``max_concurrent_envs`` >= the episodes of a
    step (``prompts_per_step * num_generations``) and ``SUPPORTS_CONCURRENT_SESSIONS``.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable

from torchforge.errors import InvalidArgumentError
from torchforge.loop.environments import Environment, EpisodeError, StepResult

__all__ = ["OpenEnvEnvironment", "openenv_environment", "text_fields"]

logger = logging.getLogger(__name__)

_RESERVED_ACTION = {"metadata"}
_RESERVED_OBSERVATION = {"done", "reward", "metadata"}


def _require_openenv(fn: str) -> Any:
    try:
        import openenv.core as core
    except ImportError:
        raise InvalidArgumentError(f"{fn}: OpenEnv environments need the openenv-core package, which is not "
                                   "installed; pip install 'torchforge[openenv]'") from None
    return core


def _is_string(schema: dict[str, Any]) -> bool:
    if schema.get("type") == "string":
        return True
    return any(option.get("type") == "string" for option in schema.get("anyOf", []) if isinstance(option, dict))


def text_fields(schema: dict[str, Any], reserved: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The string fields of a pydantic JSON schema (an OpenEnv action or observation), less ``reserved``.

    Args:
        schema: a JSON schema with ``properties`` (as ``Model.model_json_schema()`` or the
            server's ``/schema`` gives).
        reserved: field names to leave out (the base classes' ``metadata``, ``done``, ``reward``).

    Returns:
        The names, in the schema's order.

    Example:
        >>> text_fields({"properties": {"message": {"type": "string"}, "n": {"type": "integer"},
        ...              "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}})
        ['message', 'note']
    """
    return [name for name, field in schema.get("properties", {}).items()
            if name not in reserved and isinstance(field, dict) and _is_string(field)]


def _as_dict(value: Any) -> dict[str, Any]:
    """An observation as a dict: a typed client's pydantic model, or the generic client's dict."""
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return dict(value) if value is not None else {}


def _action_fn(action: str | Callable[[str], Any]) -> Callable[[str], Any]:
    if isinstance(action, str):
        return lambda text: {action: text}
    return action


def _observation_fn(observation: str | Callable[[dict], Any]) -> Callable[[dict], Any]:
    if isinstance(observation, str):
        return lambda fields: fields.get(observation)
    return observation


def _default_reset(row: dict[str, Any]) -> dict[str, Any]:
    return {"seed": int(row["seed"])} if "seed" in row else {}


class OpenEnvEnvironment(Environment):
    """One episode of an OpenEnv server: a session opened by ``reset``, closed when the episode ends.

    ``reset(row)`` connects (at most ``connect_timeout`` seconds), resets the session with
    ``reset(row)``'s keyword arguments (default: the row's ``seed`` when it has one) and
    returns ``observation(first observation)``, or the row's ``"prompt"`` when that is None
    or empty. ``step(text)`` sends ``action(text)`` and returns
    ``StepResult(observation(obs) or None when done, reward or 0.0, done)``. Every request
    waits at most ``message_timeout`` seconds for the server (the client's own timeout);
    past it, or on a server error, ``step`` raises and the episode ends with that reason.
    ``close()`` closes the session on a background thread (it never blocks the loop).

    Args:
        base_url: the server, ``http://host:port`` (or ``ws://``).
        action: the action field the text goes into, or a function from the text to the
            action (a dict of its fields, or an ``Action`` instance).
        observation: the observation field that becomes the next turn, or a function from
            the observation's fields (a dict) to text, chat messages or None.
        reset: a function from the dataset row to ``reset``'s keyword arguments
            (``seed``, ``episode_id`` and whatever the server's ``reset`` takes).
        client_class: the ``EnvClient`` subclass to use; default ``GenericEnvClient``.
        connect_timeout: seconds to open the session.
        message_timeout: seconds to wait for each answer of the server.
        reward_weight: the weight of the environment's rewards next to reward functions.

    Returns:
        An environment (one per episode; :func:`openenv_environment` makes the factory).

    Example:
        >>> env = OpenEnvEnvironment("http://127.0.0.1:8000", action="message", observation="echoed")
        >>> env.action("hi"), env.observation({"echoed": "hi", "done": False})
        ({'message': 'hi'}, 'hi')
    """

    def __init__(
        self,
        base_url: str,
        *,
        action: str | Callable[[str], Any],
        observation: str | Callable[[dict], Any],
        reset: Callable[[dict], dict] | None = None,
        client_class: type | None = None,
        connect_timeout: float = 10.0,
        message_timeout: float = 30.0,
        reward_weight: float = 1.0,
    ) -> None:
        fn = "OpenEnvEnvironment"
        _check_settings(fn, base_url, action, observation, reset, connect_timeout, message_timeout)
        self.base_url = base_url
        self.action = _action_fn(action)
        self.observation = _observation_fn(observation)
        self.reset_arguments = reset or _default_reset
        self.client_class = client_class
        self.connect_timeout = float(connect_timeout)
        self.message_timeout = float(message_timeout)
        self.reward_weight = float(reward_weight)
        self.client: Any = None

    def reset(self, row: dict[str, Any]) -> str | list[dict]:
        """Open a session and reset it; return the prompt (see the class)."""
        core = _require_openenv("OpenEnvEnvironment.reset")
        client_class = self.client_class or core.GenericEnvClient
        self.client = client_class(base_url=self.base_url, connect_timeout_s=self.connect_timeout,
                                   message_timeout_s=self.message_timeout).sync()
        try:
            self.client.connect()
            result = self.client.reset(**self.reset_arguments(row))
        except Exception as error:
            self.close()
            if "CAPACITY_REACHED" in str(error) or type(error).__name__.startswith("ConnectionClosed"):
                raise EpisodeError(
                    f"OpenEnvEnvironment.reset: {self.base_url} closed the session before the reset answered "
                    f"({type(error).__name__}: {error}), as a server with no free session does; expected a server "
                    "started with max_concurrent_envs >= the episodes of a step (prompts_per_step * num_generations)"
                ) from None
            raise
        first = self.observation(_as_dict(result.observation))
        if first is None or first == "" or first == []:
            first = row.get("prompt")
        if first is None:
            raise EpisodeError(f"OpenEnvEnvironment.reset: the first observation of {self.base_url} maps to None "
                               "and the row has no 'prompt'; expected text, chat messages or a 'prompt' field")
        return first

    def step(self, action: str) -> StepResult:
        """Send the model's text as an action; its observation, reward and done come back."""
        if self.client is None:
            raise EpisodeError("OpenEnvEnvironment.step: called before reset; expected reset(row) first")
        result = self.client.step(self.action(action))
        reward = 0.0 if result.reward is None else float(result.reward)
        done = bool(result.done)
        observation = None if done else self.observation(_as_dict(result.observation))
        return StepResult(observation, reward, done)

    def close(self) -> None:
        """Close the session without waiting (a hung server cannot stall the loop)."""
        client, self.client = self.client, None
        if client is not None:
            closing = threading.Thread(target=_close_quietly, args=(client,), daemon=True, name="torchforge-openenv")
            closing.start()


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception as error:  # noqa: BLE001 - the episode is over either way
        logger.debug("OpenEnvEnvironment.close: %s: %s", type(error).__name__, error)


def _check_settings(fn, base_url, action, observation, reset, connect_timeout, message_timeout) -> None:
    if not (isinstance(base_url, str) and base_url.split("://")[0] in ("http", "https", "ws", "wss")
            and "://" in base_url):
        raise InvalidArgumentError(f"{fn}: base_url={base_url!r}; expected 'http://host:port' (or ws://, https://)")
    for name, value in (("action", action), ("observation", observation)):
        if value is not None and not (isinstance(value, str) and value) and not callable(value):
            raise InvalidArgumentError(f"{fn}: {name}={value!r}; expected a field name or a function")
    if reset is not None and not callable(reset):
        raise InvalidArgumentError(f"{fn}: reset={reset!r}; expected a function from the row to reset's arguments")
    for name, value in (("connect_timeout", connect_timeout), ("message_timeout", message_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InvalidArgumentError(f"{fn}: {name}={value!r}; expected seconds > 0")


def _schema(base_url: str, timeout: float) -> dict[str, Any]:
    """The server's ``/schema`` (one GET, at most ``timeout`` seconds)."""
    import httpx

    url = base_url.replace("ws://", "http://", 1).replace("wss://", "https://", 1).rstrip("/") + "/schema"
    try:
        response = httpx.get(url, timeout=timeout)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as error:
        raise InvalidArgumentError(
            f"openenv_environment: could not read {url} ({type(error).__name__}: {error}); expected a running "
            "OpenEnv server, or action= and observation= given (then no schema is read)"
        ) from None


def _only_field(fn: str, what: str, fields: list[str], url: str) -> str:
    if len(fields) != 1:
        raise InvalidArgumentError(
            f"{fn}: the {what} schema of {url} has string fields {fields}; expected exactly one for the text "
            f"default, or {what}= naming the field or mapping it"
        )
    return fields[0]


def openenv_environment(
    base_url: str,
    *,
    action: str | Callable[[str], Any] | None = None,
    observation: str | Callable[[dict], Any] | None = None,
    reset: Callable[[dict], dict] | None = None,
    client_class: type | None = None,
    connect_timeout: float = 10.0,
    message_timeout: float = 30.0,
    reward_weight: float = 1.0,
) -> Callable[[], OpenEnvEnvironment]:
    """An environment factory for ``RLTrainer(environment_factory=...)``: one OpenEnv session per episode.

    ``action`` / ``observation`` left None are read from the server's ``/schema`` once,
    here: the action's only string field (``EchoAction.message``, ``TextArenaAction.message``,
    ``CodeAction.code``) and the observation's only string field besides ``done``,
    ``reward`` and ``metadata``. Everything else is :class:`OpenEnvEnvironment`'s.

    Args:
        base_url: the server, ``http://host:port``.
        action: the action field or a function from the text (default: from the schema).
        observation: the observation field or a function from its fields (default: from the schema).
        reset: a function from the dataset row to ``reset``'s keyword arguments.
        client_class: an ``EnvClient`` subclass; default ``GenericEnvClient``.
        connect_timeout: seconds to open a session (and to read the schema).
        message_timeout: seconds to wait for each answer.
        reward_weight: the weight of the environment's rewards next to reward functions.

    Returns:
        A callable making one :class:`OpenEnvEnvironment` per call.

    Example:
        >>> factory = openenv_environment("http://127.0.0.1:8000", action="message",
        ...                               observation="echoed")  # doctest: +SKIP
        >>> factory().action("hi")  # doctest: +SKIP
        {'message': 'hi'}
    """
    fn = "openenv_environment"
    _check_settings(fn, base_url, action, observation, reset, connect_timeout, message_timeout)
    _require_openenv(fn)  # a missing package is one line here, before any model loads
    if action is None or observation is None:
        schema = _schema(base_url, connect_timeout)
        if action is None:
            action = _only_field(fn, "action", text_fields(schema.get("action", {}), _RESERVED_ACTION), base_url)
        if observation is None:
            observation = _only_field(fn, "observation",
                                      text_fields(schema.get("observation", {}), _RESERVED_OBSERVATION), base_url)
    return functools.partial(OpenEnvEnvironment, base_url, action=action, observation=observation, reset=reset,
                             client_class=client_class, connect_timeout=connect_timeout,
                             message_timeout=message_timeout, reward_weight=reward_weight)
