"""What the plugin registry says when something is wrong: its errors and warning, and the messages for
a name that is not registered (the closest registered name, what is installed, where rewards come from).

No heavy import here: the registry loads this module.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from lit_grpo.errors import UserError
from lit_grpo.plugins.named_functions import FILE_FORM, defining_files

__all__ = [
    "INSTALL_HINT",
    "PLUGINS_ENV",
    "STRICT_ENV",
    "DuplicateRewardError",
    "PluginError",
    "PluginLoadWarning",
    "RewardArgumentError",
    "UnknownEnvironmentError",
    "UnknownRewardError",
    "package_label",
    "unknown_name_message",
    "unknown_reward_message",
]

PLUGINS_ENV = "LIT_GRPO_PLUGINS"
STRICT_ENV = "LIT_GRPO_STRICT_PLUGINS"

INSTALL_HINT = (
    "Rewards come from plugin packages: install one (e.g. `pip install lit-grpo-rewards`, or "
    "`pip install -e rewards` from a lit-grpo checkout) and run `lit-grpo rewards` to list what is "
    "installed."
)


class PluginError(UserError, RuntimeError):
    """A plugin package could not be loaded (strict mode) or registered something invalid."""


class DuplicateRewardError(PluginError):
    """Two plugin packages registered the same reward name."""


class PluginLoadWarning(UserWarning):
    """A plugin package failed to load and was skipped (see ``LIT_GRPO_STRICT_PLUGINS``)."""


class UnknownRewardError(UserError, ValueError):
    """No installed plugin registered a reward of this name."""


class UnknownEnvironmentError(UserError, ValueError):
    """No installed plugin registered an environment of this name."""


class RewardArgumentError(UserError, ValueError):
    """A reward's YAML ``args`` do not fit its constructor or function signature."""


def package_label(package: str, version: str) -> str:
    """``"package version"`` (or just the package), as messages name where something comes from."""
    return f"{package} {version}" if version else package


def _listing(entries: Mapping[str, Any]) -> str:
    """``"a (pkg 1.0), b (other)"``: each registry entry with the package it comes from."""
    return ", ".join(f"{entry.name} ({entry.label})" for entry in entries.values())


def unknown_name_message(what: str, name: str, entries: Mapping[str, Any]) -> str:
    """``Unknown environment 'x'. Did you mean 'y'? Installed environments: ...`` in one line; ``what`` is
    ``environment`` or ``data set``, ``entries`` the registered ones by name."""
    close = difflib.get_close_matches(name, list(entries), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"Unknown {what} {name!r}.{hint} Installed {what}s: {_listing(entries) or 'none'} "
            "(`lit-grpo environments` lists them).")


def unknown_reward_message(name: str, rewards: Mapping[str, Any], failures: Iterable[str],
                           restricted_to: str = "") -> str:
    """Why no reward is called ``name``: the file of the working directory that defines it, else the
    closest installed name, what is installed, the plugin packages that failed to load (``failures``),
    the ``LIT_GRPO_PLUGINS`` value that restricts them (``restricted_to``) and how to install rewards."""
    files = defining_files(name) if name.isidentifier() else []
    if files:  # a TRL user's reward_funcs=[reward_len]: the function of a file of the working directory
        return (f"Unknown reward {name!r}: {files[0]} in the working directory defines {name}; name it "
                f"'{files[0]}:{name}' ({FILE_FORM}; an installed reward by its name alone)")
    parts = [f"Unknown reward {name!r}."]
    close = difflib.get_close_matches(name, list(rewards), n=1, cutoff=0.6)
    if not close:  # case-insensitive fallback: 'Accuracy' -> 'accuracy'
        close = [n for n in rewards if n.lower() == name.lower()]
    if close:
        parts.append(f"Did you mean {close[0]!r}?")
    parts.append(f"Installed rewards: {_listing(rewards)}." if rewards else "No rewards are installed.")
    failures = list(failures)
    if failures:
        parts.append("Plugin packages that failed to load: " + "; ".join(failures) + ".")
    if restricted_to.strip():
        parts.append(f"Note: {PLUGINS_ENV}={restricted_to!r} restricts which plugin packages load.")
    parts.append(f"{INSTALL_HINT} {FILE_FORM.capitalize()}.")
    return " ".join(parts)
