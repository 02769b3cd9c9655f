"""Looking up a reward, environment or data set by the name a config gives: a registered name, or
(TRL users' habit) where its function is, ``package.module:function`` or ``path/to/file.py:function``;
and a reward given in Python as an object, under the name that stands for it.

No heavy import here.
"""

from __future__ import annotations

import os
from typing import Any

from lit_grpo.plugins import registry
from lit_grpo.plugins.messages import (
    PLUGINS_ENV,
    UnknownEnvironmentError,
    UnknownRewardError,
    unknown_name_message,
    unknown_reward_message,
)
from lit_grpo.plugins.named_functions import load_object
from lit_grpo.plugins.python_objects import object_name
from lit_grpo.plugins.registry import RegistryEntry

__all__ = ["get_environment", "get_reward", "register_object_reward", "reset_plugins", "unknown_dataset_message"]

# ``module:function`` / ``file.py:function`` (loaded once) and ``module:qualname`` of an object given in Python
_NAMED_REWARDS: dict[str, RegistryEntry] = {}


def reset_plugins() -> None:
    """Forget every loaded plugin and reward; the next lookup discovers entry points again."""
    with registry.lock:
        registry.forget_plugins()
        _NAMED_REWARDS.clear()


def get_reward(name: str) -> RegistryEntry:
    """The installed reward called ``name``; :class:`UnknownRewardError` lists the installed ones.

    A name with a colon is a plain function instead (TRL users' habit, no plugin package needed):
    ``package.module:function`` imports it, ``path/to/file.py:function`` loads it from that file
    (relative to the working directory; ``lit-grpo fit`` also looks beside the config file).
    """
    if isinstance(name, str) and ":" in name:
        return _function_reward(name)
    rewards = registry.get_rewards()
    try:
        return rewards[name]
    except (KeyError, TypeError):
        message = unknown_reward_message(str(name), rewards, registry.failure_messages(), os.environ.get(PLUGINS_ENV, ""))
        raise UnknownRewardError(message) from None


def _function_reward(name: str) -> RegistryEntry:
    """A reward named by where its function is: ``package.module:function`` or ``file.py:function``."""
    if name not in _NAMED_REWARDS:
        obj, package = load_object(name, "reward", UnknownRewardError)
        _NAMED_REWARDS[name] = RegistryEntry.of(name, obj, package)
    return _NAMED_REWARDS[name]


def register_object_reward(obj: Any) -> str:
    """Make the reward ``obj`` (a sync or async function, a callable instance or a class) given in
    Python resolvable by :func:`get_reward` under :func:`object_name`; returns that name. A later
    object of the same name replaces it (a notebook cell run again)."""
    if not callable(obj):
        raise UnknownRewardError(f"a reward given in Python must be callable (a function or a class), got {obj!r}")
    name = object_name(obj)
    _NAMED_REWARDS[name] = RegistryEntry.of(name, obj, "python")
    return name


def get_environment(name: str) -> Any:
    """The class of the installed environment called ``name``; :class:`UnknownEnvironmentError`
    lists the installed ones. A ``package.module:Class`` or ``file.py:Class`` name loads it from there."""
    if ":" in name:
        obj, _ = load_object(name, "environment", UnknownEnvironmentError)
        return obj
    environments = registry.get_environments()
    if name in environments:
        return environments[name].obj
    raise UnknownEnvironmentError(unknown_name_message("environment", name, environments))


def unknown_dataset_message(name: str) -> str:
    """``Unknown data set 'x'. Did you mean 'y'? Installed data sets: ...`` in one line."""
    return unknown_name_message("data set", name, registry.get_datasets())
