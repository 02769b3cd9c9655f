"""The plugin registry: entry-point discovery, the pluggy plugin manager, and what the plugins registered
(rewards, environments, data sets), each recorded with the distribution it comes from.

Discovery is lazy and happens once per process (the first lookup); :func:`forget_plugins` forgets it.
The environment variables it reads (``LIT_GRPO_PLUGINS``, ``LIT_GRPO_STRICT_PLUGINS``) are described in
:mod:`lit_grpo.plugins`. No heavy import here.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import itertools
import os
import re
import threading
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any

import pluggy

from lit_grpo.hookspecs import Hookspecs
from lit_grpo.plugins.messages import (
    PLUGINS_ENV,
    STRICT_ENV,
    DuplicateRewardError,
    PluginError,
    PluginLoadWarning,
    package_label,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "RegistryEntry",
    "failure_messages",
    "forget_plugins",
    "get_datasets",
    "get_environments",
    "get_plugin_manager",
    "get_plugins",
    "get_rewards",
    "load_plugins",
    "lock",
    "register_functions",
    "register_plugin",
    "unregister_plugin",
]

ENTRY_POINT_GROUP = "lit_grpo"
KINDS = ("reward", "environment", "dataset")  # each has its hook, register_<kind>s


@dataclass
class RegistryEntry:
    """One reward, environment or data set a plugin registered (or a reward named by where its function is)."""

    name: str  # the name used in YAML (`model.rewards[].name`, `model.environment.name`, `data.path`)
    obj: Any  # the registered function or class
    package: str  # distribution name of the plugin package (module name if registered directly)
    version: str  # distribution version ("" if registered directly)
    doc: str  # first line of the docstring ("" if none)

    @classmethod
    def of(cls, name: str, obj: Any, package: str, version: str = "") -> RegistryEntry:
        """The entry of ``obj``, its ``doc`` the first line of its docstring."""
        return cls(name=name, obj=obj, package=package, version=version, doc=_first_doc_line(obj))

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
        return package_label(self.package, self.version)


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
        # per kind (KINDS): name -> RegistryEntry, the identity of the hookimpls it was built from,
        # and the names each plugin registered
        self.items: dict[str, dict[str, RegistryEntry]] = {}
        self.items_key: dict[str, tuple] = {}
        self.by_plugin: dict[str, dict[str, list[str]]] = {kind: {} for kind in KINDS}
        self.quiet = False  # strict mode raises instead of warning


lock = threading.RLock()  # held by every lookup; loading.py's own cache shares it


@functools.cache  # one registry per process, made on first use; forget_plugins clears it
def _get_registry() -> _Registry:
    return _Registry()


def forget_plugins() -> None:
    """Forget every loaded plugin; the next lookup discovers entry points again."""
    with lock:
        _get_registry.cache_clear()


def failure_messages() -> list[str]:
    """Why each plugin package that failed to load did (as warned)."""
    with lock:
        return [message for _, message in _get_registry().failures.values()]


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
                f"{package_label(dist_name, version)} failed to load: {type(exc).__name__}: {exc}",
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
        f"{package_label(source.package, source.version)}"
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


def _register_into(registered: dict[str, RegistryEntry], kind: str, source: _Source) -> Callable[..., None]:
    """The ``register(obj, name=None)`` a plugin's ``register_<kind>s`` hook is called with: it checks
    ``obj`` and its name and adds it to ``registered``."""
    label = package_label(source.package, source.version)

    def register(obj: Any, name: str | None = None) -> None:
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
        if name in registered:
            raise DuplicateRewardError(f"{kind.capitalize()} '{name}' is registered twice by plugin package {label}")
        registered[name] = RegistryEntry.of(name, obj, source.package, source.version)

    return register


def _collect(reg: _Registry, kind: str) -> dict[str, RegistryEntry]:
    """Call every plugin's ``register_<kind>s`` hook (once per set of plugins) and index what they
    registered by name; ``kind`` is one of :data:`KINDS`."""
    impls = getattr(reg.pm.hook, f"register_{kind}s").get_hookimpls()
    key = tuple((impl.plugin_name, id(impl.plugin)) for impl in impls)
    if kind in reg.items and reg.items_key.get(kind) == key:
        return reg.items[kind]
    items: dict[str, RegistryEntry] = {}
    by_plugin: dict[str, list[str]] = {}
    for impl in impls:
        source = _source_for(reg, impl.plugin_name, impl.plugin)
        if impl.plugin_name in reg.failures:
            continue
        mine: dict[str, RegistryEntry] = {}
        try:
            impl.function(**{arg: _register_into(mine, kind, source) for arg in impl.argnames})
        except DuplicateRewardError:
            raise
        except Exception as exc:
            _record_failure(
                reg,
                source,
                f"lit-grpo plugin {package_label(source.package, source.version)} "
                f"(register_{kind}s in {getattr(impl.plugin, '__name__', impl.plugin_name)}) "
                f"raised {type(exc).__name__}: {exc}",
            )
            continue
        for name, entry in mine.items():
            if name in items:
                raise DuplicateRewardError(
                    f"{kind.capitalize()} '{name}' is registered by two plugin packages: {items[name].label} and "
                    f"{entry.label}. Uninstall one of them, or load only one with "
                    f"{PLUGINS_ENV}=<package>[,<package>...]."
                )
            items[name] = entry
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
    with lock:
        reg = _get_registry()
        strict = _strict(strict)
        reg.quiet = strict
        try:
            _load_entry_points(reg)
            for kind in KINDS:
                _collect(reg, kind)
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
    with lock:
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
    with lock:
        reg = _get_registry()
        name = reg.pm.get_name(plugin)
        if name is None:
            return
        reg.pm.unregister(plugin)
        reg.sources.pop(name, None)
        reg.items.clear()


def _registered(kind: str) -> dict[str, RegistryEntry]:
    with lock:
        load_plugins()
        return dict(_collect(_get_registry(), kind))


def get_rewards() -> dict[str, RegistryEntry]:
    """Every installed reward, by name (sorted)."""
    return _registered("reward")


def get_environments() -> dict[str, RegistryEntry]:
    """Every installed environment (``register_environments``), by name (sorted)."""
    return _registered("environment")


def get_datasets() -> dict[str, RegistryEntry]:
    """Every installed data set (``register_datasets``), by name (sorted)."""
    return _registered("dataset")


def get_plugins() -> list[PluginInfo]:
    """Every plugin package seen, including those that failed to load (``error`` set)."""
    with lock:
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
