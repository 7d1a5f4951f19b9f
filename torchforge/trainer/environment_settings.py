"""The ``environment`` key of a run config: a dotted path, or an OpenEnv server, or a verifiers environment.

::

    environment: mypackage.envs.Calculator           # a class or function, one environment per episode

    environment:                                     # an OpenEnv server (torchforge.loop.openenv)
      openenv: http://127.0.0.1:8000
      action: message                                # optional: the action field (default from /schema)
      observation: text                              # optional: the observation field
      message_timeout: 30.0

    environment:                                     # a verifiers environment (torchforge.loop.verifiers_env)
      verifiers: my-env                              # the module whose load_environment() makes it
      env_args: {difficulty: easy}                   # its arguments
      chat: true                                     # false: text prompts, for a tokenizer without a chat template

Function-valued settings (``reset``, ``client_class``, ``parse_action``) are dotted import paths.
"""

from __future__ import annotations

from typing import Any

from torchforge.errors import InvalidArgumentError
from torchforge.trainer.run_config import did_you_mean, import_object

__all__ = ["environment_from_settings"]

_OPENENV = {"action": "str", "observation": "str", "reset": "path", "client_class": "path",
            "connect_timeout": "number", "message_timeout": "number", "reward_weight": "number"}
_VERIFIERS = {"env_args": "dict", "chat": "bool", "parse_action": "path", "reward_weight": "number",
              "score_timeout": "number"}


def _checked(kind: str, given: dict[str, Any], allowed: dict[str, str]) -> dict[str, Any]:
    out = {}
    for key, value in given.items():
        if key not in allowed:
            raise InvalidArgumentError(f"unknown setting environment.{key}{did_you_mean(key, list(allowed))}; "
                                       f"expected one of {[kind, *allowed]}")
        expected = allowed[key]
        ok = {"str": isinstance(value, str), "path": isinstance(value, str), "dict": isinstance(value, dict),
              "bool": isinstance(value, bool),
              "number": isinstance(value, (int, float)) and not isinstance(value, bool)}[expected]
        if not ok:
            what = {"path": "a dotted import path", "dict": "a mapping", "bool": "true or false",
                    "number": "a number", "str": "a field name"}[expected]
            raise InvalidArgumentError(f"environment.{key}={value!r}; expected {what}")
        out[key] = import_object(value) if expected == "path" else value
    return out


def environment_from_settings(value: Any) -> Any:
    """The environment factory of a run config's ``environment`` (see the module).

    Args:
        value: a dotted import path, or a mapping with ``openenv: URL`` or ``verifiers: ID``
            and that adapter's settings.

    Returns:
        A callable making one environment per episode (``RLTrainer(environment_factory=...)``).

    Example:
        >>> environment_from_settings("torchforge.trainer.demo_episodes.AskThenCopy").__name__
        'AskThenCopy'
    """
    if isinstance(value, str):
        return import_object(value)
    kinds = [k for k in ("openenv", "verifiers") if isinstance(value, dict) and k in value]
    if len(kinds) != 1:
        raise InvalidArgumentError(
            f"environment={value!r}; expected a dotted import path, {{openenv: URL, ...}} or {{verifiers: ID, ...}}")
    kind = kinds[0]
    settings = dict(value)
    target = settings.pop(kind)
    if kind == "openenv":
        from torchforge.loop.openenv import openenv_environment

        return openenv_environment(target, **_checked(kind, settings, _OPENENV))
    from torchforge.loop.verifiers_env import VerifiersEnvironment

    return VerifiersEnvironment.load(target, **_checked(kind, settings, _VERIFIERS))
