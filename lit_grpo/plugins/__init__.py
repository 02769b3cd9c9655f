"""Reward plugins: entry-point discovery and the reward registry (the hooks: :mod:`lit_grpo.hookspecs`).

Every reward, first-party or not, lives in a pip-installable *plugin package* that declares an
entry point in the ``lit_grpo`` group and implements one pluggy hook::

    # pyproject.toml of the plugin package
    [project.entry-points.lit_grpo]
    my_plugin = "my_plugin_module"

    # my_plugin_module.py
    import lit_grpo

    def shouts(prompts, completions, **kwargs):
        "1.0 if the completion is all upper case, else 0.0."
        return [1.0 if c.isupper() else 0.0 for c in completions]

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(shouts)            # name defaults to shouts.__name__

Discovery is lazy and happens once per process (the first :func:`get_rewards` or :func:`get_reward`
call, e.g. by ``lit_grpo.scoring.build_reward``); :func:`reset_plugins` forgets it (for tests, or after changing the
environment variables below).

Environment variables, read when plugins are first loaded:

``LIT_GRPO_PLUGINS=a,b``
    Load only these plugin packages (entry-point names or distribution names, compared
    case-insensitively with ``-``, ``_`` and ``.`` treated alike). Empty or unset: load all.
``LIT_GRPO_STRICT_PLUGINS=1``
    A plugin package that fails to import (or whose hook raises) is an error instead of a
    warning. ``load_plugins(strict=True)`` does the same.

The registry records, for every reward, the distribution (name and version) that registered it, so
error messages and ``lit-grpo rewards`` can say where a reward comes from.

The package's modules, lowest first: :mod:`~lit_grpo.plugins.messages` (the errors, and what an unknown
name is answered with), :mod:`~lit_grpo.plugins.named_functions` (a function named by where it is),
:mod:`~lit_grpo.plugins.python_objects` (objects given in Python, and their names),
:mod:`~lit_grpo.plugins.registry` (entry points, the plugin manager, what the plugins registered) and
:mod:`~lit_grpo.plugins.loading` (a reward, environment or data set by the name a config gives).
"""

from __future__ import annotations

import pluggy  # noqa: F401  (plugins.pluggy: the plugin manager's library, for callers that check its type)

from lit_grpo.hookspecs import RESERVED_ARGS
from lit_grpo.plugins.loading import (
    get_environment,
    get_reward,
    register_object_reward,
    reset_plugins,
    unknown_dataset_message,
)
from lit_grpo.plugins.messages import (
    INSTALL_HINT,
    PLUGINS_ENV,
    STRICT_ENV,
    DuplicateRewardError,
    PluginError,
    PluginLoadWarning,
    RewardArgumentError,
    UnknownEnvironmentError,
    UnknownRewardError,
)
from lit_grpo.plugins.named_functions import load_object
from lit_grpo.plugins.python_objects import object_name
from lit_grpo.plugins.registry import (
    ENTRY_POINT_GROUP,
    PluginInfo,
    RegistryEntry,
    get_datasets,
    get_environments,
    get_plugin_manager,
    get_plugins,
    get_rewards,
    load_plugins,
    register_functions,
    register_plugin,
    unregister_plugin,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "INSTALL_HINT",
    "PLUGINS_ENV",
    "RESERVED_ARGS",
    "STRICT_ENV",
    "DuplicateRewardError",
    "PluginError",
    "PluginInfo",
    "PluginLoadWarning",
    "RegistryEntry",
    "RewardArgumentError",
    "UnknownEnvironmentError",
    "UnknownRewardError",
    "get_datasets",
    "get_environment",
    "get_environments",
    "get_plugin_manager",
    "get_plugins",
    "get_reward",
    "get_rewards",
    "load_object",
    "load_plugins",
    "object_name",
    "register_functions",
    "register_object_reward",
    "register_plugin",
    "reset_plugins",
    "unknown_dataset_message",
    "unregister_plugin",
]
