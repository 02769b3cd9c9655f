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
"""

from __future__ import annotations

import difflib
import functools
import inspect
import itertools
import os
import re
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any

import pluggy

from lit_grpo.errors import UserError
from lit_grpo.hookspecs import Hookspecs
from lit_grpo.plugins.named_functions import FILE_FORM, defining_files, load_object
from lit_grpo.plugins.python_objects import object_name

__all__ = [
    "ENTRY_POINT_GROUP",
    "DuplicateRewardError",
    "PluginError",
    "PluginInfo",
    "PluginLoadWarning",
    "RewardArgumentError",
    "RewardInfo",
    "UnknownEnvironmentError",
    "UnknownRewardError",
    "get_datasets",
    "get_environment",
    "get_environments",
    "get_plugin_manager",
    "load_object",
    "object_name",
    "get_plugins",
    "get_reward",
    "get_rewards",
    "load_plugins",
    "register_plugin",
    "register_functions",
    "reset_plugins",
    "unregister_plugin",
]

ENTRY_POINT_GROUP = "lit_grpo"
PLUGINS_ENV = "LIT_GRPO_PLUGINS"
STRICT_ENV = "LIT_GRPO_STRICT_PLUGINS"

# Arguments the trainer passes to every reward call; YAML ``args`` must not bind them.
RESERVED_ARGS = ("prompts", "completions", "completion_ids")

INSTALL_HINT = (
    "Rewards come from plugin packages: install one (e.g. `pip install lit-grpo-rewards`, or "
    "`pip install -e rewards` from a lit-grpo checkout) and run `lit-grpo rewards` to list what is "
    "installed."
)


# --------------------------------------------------------------------------------------------------
# Errors and records
# --------------------------------------------------------------------------------------------------


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


@dataclass
class RewardInfo:
    """One registered reward."""

    name: str  # the name used in YAML (`model.rewards[].name`)
    obj: Any  # the registered function or class
    package: str  # distribution name of the plugin package (module name if registered directly)
    version: str  # distribution version ("" if registered directly)
    doc: str  # first line of the docstring ("" if none)

    @property
    def kind(self) -> str:
        """``"class"`` or ``"function"``."""
        return "class" if inspect.isclass(self.obj) else "function"

    @property
    def source(self) -> str:
        """``"module:qualname"`` of the registered object."""
        target = self.obj.func if isinstance(self.obj, functools.partial) else self.obj
        module = getattr(target, "__module__", None) or "?"
        qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
        return f"{module}:{qualname}"

    @property
    def label(self) -> str:
        """``"package version"`` (or just the package), as shown in messages."""
        return _package_label(self.package, self.version)


@dataclass
class PluginInfo:
    """One plugin package (an entry point, or a module registered with :func:`register_plugin`)."""

    name: str  # entry-point name, or the plugin's pluggy name when registered directly
    package: str
    version: str
    rewards: list[str] = field(default_factory=list)
    error: str | None = None  # why it failed to load, if it did
    environments: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)


def _package_label(package: str, version: str) -> str:
    return f"{package} {version}" if version else package


def _first_doc_line(obj: Any) -> str:
    target = obj.func if isinstance(obj, functools.partial) else obj
    doc = inspect.getdoc(target) or ""
    for line in doc.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).strip().lower()


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


# --------------------------------------------------------------------------------------------------
# The registry (process-wide, lazily loaded once)
# --------------------------------------------------------------------------------------------------


@dataclass
class _Source:
    """Where a registered pluggy plugin came from."""

    name: str
    package: str
    version: str
    entry_point: str | None = None  # "name = value" for entry-point plugins


class _Registry:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
        self.pm.add_hookspecs(Hookspecs)
        self.sources: dict[str, _Source] = {}  # pluggy plugin name -> source
        self.failures: dict[str, tuple[_Source, str]] = {}  # plugin name -> (source, message)
        self.entry_points_loaded = False
        # per kind ("reward", "environment"): name -> RewardInfo, the identity of the hookimpls it
        # was built from, and the names each plugin registered
        self.items: dict[str, dict[str, RewardInfo]] = {}
        self.items_key: dict[str, tuple] = {}
        self.by_plugin: dict[str, dict[str, list[str]]] = {"reward": {}, "environment": {}, "dataset": {}}
        self.quiet = False  # strict mode raises instead of warning


_lock = threading.RLock()
_registry: _Registry | None = None


def reset_plugins() -> None:
    """Forget every loaded plugin and reward; the next lookup discovers entry points again."""
    global _registry
    with _lock:
        _registry = None
        _FUNCTION_REWARDS.clear()


def _get_registry() -> _Registry:
    global _registry
    with _lock:
        if _registry is None:
            _registry = _Registry()
        return _registry


def _strict(strict: bool | None) -> bool:
    return _truthy(os.environ.get(STRICT_ENV)) if strict is None else strict


def _record_failure(reg: _Registry, source: _Source, message: str) -> None:
    if source.name in reg.failures:
        return
    reg.failures[source.name] = (source, message)
    if reg.quiet:
        return
    warnings.warn(message + f" (set {STRICT_ENV}=1 to make this an error)", PluginLoadWarning, stacklevel=4)


def _iter_entry_points() -> list:
    eps = list(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))
    return sorted(eps, key=lambda ep: (_dist_name_version(ep)[0].lower(), ep.name))


def _dist_name_version(ep: Any) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ep.name, ""
    name = getattr(dist, "name", None)
    if not name:
        try:
            name = dist.metadata["Name"]
        except Exception:  # pragma: no cover - exotic metadata
            name = None
    return (name or ep.name), (getattr(dist, "version", None) or "")


def _allowed_filter() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ENV, "")
    names = {_normalize(part) for part in raw.split(",") if part.strip()}
    return names or None


def _load_entry_points(reg: _Registry) -> None:
    """Import every ``lit_grpo`` entry point (allowed by LIT_GRPO_PLUGINS) and register it."""
    if reg.entry_points_loaded:
        return
    reg.entry_points_loaded = True
    allowed = _allowed_filter()
    matched: set[str] = set()
    available: list[str] = []
    for ep in _iter_entry_points():
        dist_name, version = _dist_name_version(ep)
        available.append(f"{ep.name} ({dist_name})" if _normalize(ep.name) != _normalize(dist_name) else dist_name)
        if allowed is not None:
            keys = {_normalize(ep.name), _normalize(dist_name)}
            if not keys & allowed:
                continue
            matched |= keys & allowed
        source = _Source(
            name=ep.name, package=dist_name, version=version, entry_point=f"{ep.name} = {ep.value}"
        )
        try:
            plugin = ep.load()
        except Exception as exc:  # ImportError, SyntaxError, anything the module raises on import
            _record_failure(
                reg,
                source,
                f"lit-grpo plugin entry point '{source.entry_point}' from distribution "
                f"{_package_label(dist_name, version)} failed to load: {type(exc).__name__}: {exc}",
            )
            continue
        _register(reg, plugin, source)
    if allowed is not None:
        missing = sorted(allowed - matched)
        if missing:
            warnings.warn(
                f"{PLUGINS_ENV} names {', '.join(repr(m) for m in missing)} but no installed lit-grpo "
                f"plugin package matches; installed: {', '.join(available) or 'none'}",
                PluginLoadWarning,
                stacklevel=4,
            )


def _register(reg: _Registry, plugin: Any, source: _Source) -> None:
    """Register ``plugin`` with the plugin manager, recording where it came from."""
    if reg.pm.is_registered(plugin):
        return  # e.g. two entry points naming the same module
    name = source.name
    if reg.pm.has_plugin(name) or name in reg.failures:
        name = f"{source.name}[{source.package}]"
        source = _Source(name, source.package, source.version, source.entry_point)
    unknown = [
        attr
        for attr in dir(plugin)
        if reg.pm.parse_hookimpl_opts(plugin, attr) is not None and not hasattr(Hookspecs, attr)
    ]
    where = (
        f"entry point '{source.entry_point}' from distribution "
        f"{_package_label(source.package, source.version)}"
        if source.entry_point
        else f"plugin {source.package}"
    )
    if unknown:
        hint = difflib.get_close_matches(unknown[0], ["register_rewards", "register_environments", "register_datasets"], n=1)
        _record_failure(
            reg,
            source,
            f"lit-grpo {where} implements unknown hook(s) {', '.join(unknown)}"
            + (f" (did you mean {hint[0]}?)" if hint else "")
            + "; the hooks are register_rewards, register_environments and register_datasets (each takes register)",
        )
        return
    try:
        reg.pm.register(plugin, name=name)
    except Exception as exc:  # pluggy.PluginValidationError: bad hookimpl signature
        _record_failure(reg, source, f"lit-grpo {where} is not a valid plugin: {exc}")
        return
    reg.sources[name] = source
    reg.items.clear()


def _source_for(reg: _Registry, plugin_name: str, plugin: Any) -> _Source:
    source = reg.sources.get(plugin_name)
    if source is None:  # registered straight on the PluginManager by someone else
        package = getattr(plugin, "__name__", None) or type(plugin).__name__
        source = _Source(plugin_name, package, "")
    return source


def _collect(reg: _Registry, kind: str) -> dict[str, RewardInfo]:
    """Call every plugin's ``register_<kind>s`` hook (once per set of plugins) and index what they
    registered by name; ``kind`` is ``reward``, ``environment`` or ``dataset``."""
    impls = getattr(reg.pm.hook, f"register_{kind}s").get_hookimpls()
    key = tuple((impl.plugin_name, id(impl.plugin)) for impl in impls)
    if kind in reg.items and reg.items_key.get(kind) == key:
        return reg.items[kind]
    Kind = kind.capitalize()
    items: dict[str, RewardInfo] = {}
    by_plugin: dict[str, list[str]] = {}
    for impl in impls:
        source = _source_for(reg, impl.plugin_name, impl.plugin)
        if impl.plugin_name in reg.failures:
            continue
        mine: dict[str, RewardInfo] = {}

        def register(obj: Any, name: str | None = None, *, _mine=mine, _source=source) -> None:
            label = _package_label(_source.package, _source.version)
            if not callable(obj):
                what = {"environment": "a class", "dataset": "a function"}.get(kind, "a function or a class")
                raise PluginError(f"plugin {label} registered {obj!r}, which is not callable; register {what}")
            if name is None:
                name = getattr(obj, "__name__", None)
                if not name:
                    raise PluginError(f"plugin {label} registered {obj!r}, which has no __name__; pass register(obj, name='...')")
            if not isinstance(name, str) or not name.strip() or name != name.strip():
                raise PluginError(
                    f"plugin {label} registered a {kind} with invalid name {name!r}; names are non-empty strings "
                    "without surrounding whitespace"
                )
            if name in _mine:
                raise DuplicateRewardError(f"{Kind} '{name}' is registered twice by plugin package {label}")
            _mine[name] = RewardInfo(name=name, obj=obj, package=_source.package, version=_source.version,
                                     doc=_first_doc_line(obj))

        try:
            impl.function(**{arg: register for arg in impl.argnames})
        except DuplicateRewardError:
            raise
        except Exception as exc:
            _record_failure(
                reg,
                source,
                f"lit-grpo plugin {_package_label(source.package, source.version)} "
                f"(register_{kind}s in {getattr(impl.plugin, '__name__', impl.plugin_name)}) "
                f"raised {type(exc).__name__}: {exc}",
            )
            continue
        for name, info in mine.items():
            if name in items:
                other = items[name]
                raise DuplicateRewardError(
                    f"{Kind} '{name}' is registered by two plugin packages: {other.label} and "
                    f"{info.label}. Uninstall one of them, or load only one with "
                    f"{PLUGINS_ENV}=<package>[,<package>...]."
                )
            items[name] = info
        by_plugin[impl.plugin_name] = sorted(mine)
    reg.items[kind] = dict(sorted(items.items()))
    reg.items_key[kind] = key
    reg.by_plugin[kind] = by_plugin
    return reg.items[kind]


def load_plugins(strict: bool | None = None) -> pluggy.PluginManager:
    """Discover and load plugin packages (once) and collect their rewards.

    A package that fails to import, or whose ``register_rewards`` raises, is skipped with a
    :class:`PluginLoadWarning`; with ``strict=True`` (default: the ``LIT_GRPO_STRICT_PLUGINS``
    environment variable) a :class:`PluginError` listing every failure is raised instead.
    Two packages registering the same reward name always raise :class:`DuplicateRewardError`.
    """
    with _lock:
        reg = _get_registry()
        strict = _strict(strict)
        reg.quiet = strict
        try:
            _load_entry_points(reg)
            _collect(reg, "reward")
            _collect(reg, "environment")
            _collect(reg, "dataset")
        finally:
            reg.quiet = False
        if reg.failures and strict:
            raise PluginError(
                "lit-grpo plugins failed to load (strict mode):\n"
                + "\n".join(f"  - {message}" for _, message in reg.failures.values())
            )
        return reg.pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide ``pluggy.PluginManager("lit_grpo")``, with entry points loaded."""
    return load_plugins()


def register_plugin(plugin: Any, name: str | None = None, *, package: str | None = None, version: str = "") -> None:
    """Register a module (or any object) with ``@lit_grpo.hookimpl`` functions directly.

    Meant for tests and notebooks. Its rewards are attributed to ``package`` (default: the module's
    ``__name__``) with version ``version`` (default ``""``). Entry points are loaded first, so the
    directly registered rewards join the installed ones.
    """
    with _lock:
        reg = _get_registry()
        _load_entry_points(reg)
        module_name = getattr(plugin, "__name__", None) or type(plugin).__name__
        source = _Source(name=name or module_name, package=package or module_name, version=version)
        before = set(reg.failures)
        _register(reg, plugin, source)
        new = [reg.failures[n][1] for n in reg.failures if n not in before]
        if new:
            raise PluginError(new[0])


def register_functions(package: str, rewards: Mapping[str, Any] | None = None,
                       environments: Mapping[str, Any] | None = None, version: str = "",
                       datasets: Mapping[str, Any] | None = None) -> Any:
    """Register ``rewards`` (name -> function or class), ``environments`` (name -> class) and ``datasets``
    (name -> function) as one plugin attributed to ``package``, without a distribution (notebooks, tests,
    benchmarks). Returns the plugin module; :func:`unregister_plugin` undoes it."""
    import types

    from lit_grpo import hookimpl

    module = types.ModuleType("lit_grpo_functions_" + re.sub(r"\W", "_", package) + f"_{next(_function_plugins)}")

    def hook(items: Mapping[str, Any] | None):
        def register_all(register):
            for name, obj in (items or {}).items():
                register(obj, name=name)
        return hookimpl(register_all)

    module.register_rewards, module.register_environments, module.register_datasets = map(hook, (rewards, environments, datasets))
    register_plugin(module, package=package, version=version)
    return module


_function_plugins = itertools.count()


def unregister_plugin(plugin: Any) -> None:
    """Undo :func:`register_plugin`."""
    with _lock:
        reg = _get_registry()
        name = reg.pm.get_name(plugin)
        if name is None:
            return
        reg.pm.unregister(plugin)
        reg.sources.pop(name, None)
        reg.items.clear()


def get_rewards() -> dict[str, RewardInfo]:
    """Every installed reward, by name (sorted)."""
    with _lock:
        load_plugins()
        return dict(_collect(_get_registry(), "reward"))


def get_environments() -> dict[str, RewardInfo]:
    """Every installed environment (``register_environments``), by name (sorted)."""
    with _lock:
        load_plugins()
        return dict(_collect(_get_registry(), "environment"))


def get_environment(name: str) -> Any:
    """The class of the installed environment called ``name``; :class:`UnknownEnvironmentError`
    lists the installed ones. A ``package.module:Class`` or ``file.py:Class`` name loads it from there."""
    if ":" in name:
        obj, _ = load_object(name, "environment", UnknownEnvironmentError)
        return obj
    environments = get_environments()
    if name in environments:
        return environments[name].obj
    close = difflib.get_close_matches(name, list(environments), n=1)
    listing = ", ".join(f"{info.name} ({info.label})" for info in environments.values()) or "none"
    raise UnknownEnvironmentError(
        f"Unknown environment {name!r}." + (f" Did you mean {close[0]!r}?" if close else "")
        + f" Installed environments: {listing} (`lit-grpo environments` lists them)."
    )


def get_datasets() -> dict[str, RewardInfo]:
    """Every installed data set (``register_datasets``), by name (sorted)."""
    with _lock:
        load_plugins()
        return dict(_collect(_get_registry(), "dataset"))


def unknown_dataset_message(name: str) -> str:
    """``Unknown data set 'x'. Did you mean 'y'? Installed data sets: ...`` in one line."""
    datasets = get_datasets()
    close = difflib.get_close_matches(name, list(datasets), n=1)
    listing = ", ".join(f"{info.name} ({info.label})" for info in datasets.values()) or "none"
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"Unknown data set {name!r}.{hint} Installed data sets: {listing} (`lit-grpo environments` lists them)."


def get_plugins() -> list[PluginInfo]:
    """Every plugin package seen, including those that failed to load (``error`` set)."""
    with _lock:
        load_plugins()
        reg = _get_registry()
        out = []
        for name, plugin in reg.pm.list_name_plugin():
            if name in reg.failures:
                continue
            source = _source_for(reg, name, plugin)
            out.append(
                PluginInfo(source.name, source.package, source.version, list(reg.by_plugin["reward"].get(name, [])),
                           environments=list(reg.by_plugin["environment"].get(name, [])),
                           datasets=list(reg.by_plugin["dataset"].get(name, [])))
            )
        for source, message in reg.failures.values():
            out.append(PluginInfo(source.name, source.package, source.version, [], message))
        return sorted(out, key=lambda p: (p.package.lower(), p.name))


def _unknown_reward_message(name: str, rewards: Mapping[str, RewardInfo]) -> str:
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
    if rewards:
        listing = ", ".join(f"{info.name} ({info.label})" for info in rewards.values())
        parts.append(f"Installed rewards: {listing}.")
    else:
        parts.append("No rewards are installed.")
    reg = _get_registry()
    if reg.failures:
        parts.append(
            "Plugin packages that failed to load: "
            + "; ".join(message for _, message in reg.failures.values())
            + "."
        )
    if os.environ.get(PLUGINS_ENV, "").strip():
        parts.append(f"Note: {PLUGINS_ENV}={os.environ[PLUGINS_ENV]!r} restricts which plugin packages load.")
    parts.append(f"{INSTALL_HINT} {FILE_FORM.capitalize()}.")
    return " ".join(parts)


def get_reward(name: str) -> RewardInfo:
    """The installed reward called ``name``; :class:`UnknownRewardError` lists the installed ones.

    A name with a colon is a plain function instead (TRL users' habit, no plugin package needed):
    ``package.module:function`` imports it, ``path/to/file.py:function`` loads it from that file
    (relative to the working directory; ``lit-grpo fit`` also looks beside the config file).
    """
    if isinstance(name, str) and ":" in name:
        return _function_reward(name)
    rewards = get_rewards()
    try:
        return rewards[name]
    except (KeyError, TypeError):
        raise UnknownRewardError(_unknown_reward_message(str(name), rewards)) from None


_FUNCTION_REWARDS: dict[str, RewardInfo] = {}  # ``module:function`` / ``file.py:function`` -> loaded once


def _function_reward(name: str) -> RewardInfo:
    """A reward named by where its function is: ``package.module:function`` or ``file.py:function``."""
    if name not in _FUNCTION_REWARDS:
        obj, package = load_object(name, "reward", UnknownRewardError)
        _FUNCTION_REWARDS[name] = RewardInfo(name=name, obj=obj, package=package, version="", doc=_first_doc_line(obj))
    return _FUNCTION_REWARDS[name]


def register_object_reward(obj: Any) -> str:
    """Make the reward ``obj`` (a sync or async function, a callable instance or a class) given in
    Python resolvable by :func:`get_reward` under :func:`object_name`; returns that name. A later
    object of the same name replaces it (a notebook cell run again)."""
    if not callable(obj):
        raise UnknownRewardError(f"a reward given in Python must be callable (a function or a class), got {obj!r}")
    name = object_name(obj)
    _FUNCTION_REWARDS[name] = RewardInfo(name=name, obj=obj, package="python", version="", doc=_first_doc_line(obj))
    return name


# --------------------------------------------------------------------------------------------------
# Building a configured reward callable
# --------------------------------------------------------------------------------------------------
