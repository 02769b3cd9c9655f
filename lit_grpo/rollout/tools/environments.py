"""Environments: stateful tools for one rollout, published as plugins like rewards.

A plugin registers environment classes with the ``register_environments(register)`` hook (same
``lit_grpo`` entry-point group as rewards; ``lit-grpo environments`` lists them). An environment is
a class:

* built once per rollout (every completion row gets its own instance) with the YAML ``args`` of
  ``model.environment`` and the sample's dataset columns that its constructor names (all of them
  when it takes ``**kwargs``);
* whose public methods are the tools the policy may call (type hints and a docstring with
  ``Args:``, as for ``model.tools``): they read and change the instance's state;
* which may define ``get_reward() -> float | None``, read after the rollout ends; it is logged as
  ``rewards/<environment name>/...`` and added to the reward with ``model.environment.weight``;
* and ``close()``, called once the rollout is over and its reward read (also when the rollout
  failed): release processes, sandboxes or files there.

An environment whose tools are known only once it is built (an adapter of another framework's
environments, whose tools depend on its arguments) defines ``tools()`` instead of tool methods: it
returns the instance's tools as functions, shown to the model like methods are.

``model.environment: {name: ..., args: {...}, weight: 1.0}`` picks one for every sample; a dataset
column ``environment`` picks one per sample by name (an empty value: the configured one, or none).
In Python the class itself may stand for the name (``environment=MyEnv`` or ``{"name": MyEnv, ...}``):
it is then called by its class name.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_grpo.errors import ConfigError, DataError
from lit_grpo.rollout.tools.calls import Tool, make_tool

__all__ = ["ENVIRONMENT_COLUMN", "EnvironmentSpec", "Environments", "environment_tool_methods"]

ENVIRONMENT_COLUMN = "environment"
NOT_TOOLS = frozenset({"get_reward", "reset", "close", "tools"})


@dataclass
class EnvironmentSpec:
    """``model.environment``."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0


def environment_tool_methods(cls: type) -> list[str]:
    """The names of ``cls``'s public methods (its tools), in definition order."""
    names = []
    for klass in reversed(cls.__mro__[:-1]):  # base classes first, object left out
        for name, member in vars(klass).items():
            if not name.startswith("_") and name not in NOT_TOOLS and inspect.isfunction(member) and name not in names:
                names.append(name)
    return names


class Environments:
    """Builds the environment of each rollout row, its tools, and reads its reward."""

    def __init__(self, specs: Sequence[EnvironmentSpec | Mapping] | EnvironmentSpec | Mapping | None, get_environment,
                 shared_tools: Sequence[Tool]) -> None:
        if specs is None:
            specs = []
        elif isinstance(specs, (Mapping, EnvironmentSpec)) or inspect.isclass(specs):
            specs = [specs]
        self.specs: list[EnvironmentSpec] = []
        self._given: dict[str, type] = {}  # classes given in Python, by their name
        for index, spec in enumerate(specs):
            if inspect.isclass(spec):
                spec = {"name": spec}
            if isinstance(spec, Mapping) and inspect.isclass(spec.get("name")):
                self._given[spec["name"].__name__] = spec["name"]
                spec = {**spec, "name": spec["name"].__name__}
            if isinstance(spec, Mapping):
                unknown = set(spec) - {"name", "args", "weight"}
                if unknown or "name" not in spec:
                    raise ConfigError(f"model.environment[{index}] takes {{name, args, weight}}, got {dict(spec)!r}")
                spec = EnvironmentSpec(spec["name"], dict(spec.get("args") or {}), float(spec.get("weight", 1.0)))
            self.specs.append(spec)
        names = [spec.name for spec in self.specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"model.environment names an environment twice: {names}")
        self.get_environment = get_environment  # name -> registered class (lit_grpo.plugins.get_environment)
        self.shared_tools = {tool.name: tool for tool in shared_tools}
        self._classes: dict[str, type] = {}
        self._method_schemas: dict[str, dict[str, dict]] = {}
        self._parameters: dict[str, Mapping[str, inspect.Parameter]] = {}
        self._close_failures: set[str | None] = set()
        for spec in self.specs:
            self._load(spec.name)

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    @property
    def reward_names(self) -> list[str]:
        """The configured environments that define ``get_reward``: one reward column each."""
        return [name for name in self.names if callable(getattr(self._classes[name], "get_reward", None))]

    def _load(self, name: str) -> None:
        """The class registered as ``name`` (or given in Python), its tools' schemas and its constructor's parameters."""
        cls = self._given[name] if name in self._given else self.get_environment(name)
        if not inspect.isclass(cls):
            raise ConfigError(f"model.environment: environment {name!r} is not a class")
        schemas = {}
        for method in environment_tool_methods(cls):
            schemas[method] = make_tool(getattr(cls, method), f"environment {name!r}, method {method!r}").schema
        clash = set(schemas) & set(self.shared_tools)
        if clash:
            raise ConfigError(f"environment {name!r} has tools named like model.tools: {sorted(clash)}")
        self._classes[name] = cls
        self._method_schemas[name] = schemas
        self._parameters[name] = inspect.signature(cls).parameters

    def build(self, columns: Mapping[str, Any], row: int) -> tuple[str | None, Any, dict[str, Tool]]:
        """``(environment name, instance, tools by name)`` for one sample (``columns``: its values)."""
        name = columns.get(ENVIRONMENT_COLUMN)
        if name is None or name == "":
            if len(self.specs) > 1:
                raise DataError(f"sample {row} has no {ENVIRONMENT_COLUMN!r} value, and model.environment lists several "
                                f"({', '.join(self.names)}): say which one each sample uses")
            name = self.names[0] if self.specs else None
        if name is None:
            return None, None, dict(self.shared_tools)
        if name not in self.names:
            raise DataError(f"sample {row}, column {ENVIRONMENT_COLUMN!r}: {name!r} is not one of the environments of "
                            f"model.environment ({', '.join(self.names) or 'none configured'})")
        spec = self.specs[self.names.index(name)]
        cls = self._classes[name]
        args = dict(spec.args)
        parameters = self._parameters[name]
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        for column, value in columns.items():
            if column != ENVIRONMENT_COLUMN and column not in args and (takes_all or column in parameters):
                args[column] = value
        try:
            instance = cls(**args)
        except TypeError as error:
            unknown = [key for key in spec.args if key not in parameters and not takes_all]
            close = difflib.get_close_matches(unknown[0], list(parameters), n=1) if unknown else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"environment {name!r} cannot be built from model.environment.args and sample {row}'s "
                              f"columns {sorted(columns)}: {error}{hint}") from None
        tools = dict(self.shared_tools)
        for method, schema in self._method_schemas[name].items():
            tools[method] = Tool(method, getattr(instance, method), schema)
        if callable(getattr(instance, "tools", None)):  # tools known once it is built
            try:
                for function in instance.tools():
                    tool = make_tool(function, f"environment {name!r}, tool {getattr(function, '__name__', function)!r}")
                    if tool.name in tools:
                        raise ConfigError(f"environment {name!r} has two tools named {tool.name!r} (model.tools or its own)")
                    tools[tool.name] = tool
            except BaseException:
                self.close(name, instance)
                raise
        return name, instance, tools

    def reward(self, name: str, instance: Any, row: int) -> float | None:
        """``instance.get_reward()`` of environment ``name`` for rollout ``row`` (None where the class has
        no ``get_reward``), checked to be a number or None."""
        if name not in self.reward_names:
            return None
        value = instance.get_reward()
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise DataError(f"environment {name!r}: get_reward() returned {value!r} for rollout {row}; "
                            "it returns a number or None")
        return None if value is None else float(value)

    def close(self, name: str | None, instance: Any) -> None:
        """``instance.close()`` where the environment defines one. A failing close is warned about (once
        per environment), not raised: the rollout it served is complete, and training goes on."""
        close = getattr(instance, "close", None)
        if not callable(close):
            return
        try:
            close()
        except Exception as error:  # noqa: BLE001
            if name not in self._close_failures:
                self._close_failures.add(name)
                warnings.warn(f"environment {name!r}: close() raised {type(error).__name__}: {error} "
                              "(said once per environment; training goes on)", stacklevel=2)

    @property
    def reward_weights(self) -> list[float]:
        return [spec.weight for spec in self.specs if spec.name in self.reward_names]
