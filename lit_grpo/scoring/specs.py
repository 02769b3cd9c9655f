"""One entry of ``model.rewards``: its keys, their checks, and the error a reward's failure raises."""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from lit_grpo import plugins
from lit_grpo.config import AsWritten
from lit_grpo.errors import ConfigError, UserError
from lit_grpo.plugins import register_object_reward

__all__ = ["ON_ERROR", "RewardError", "RewardSpec", "as_spec", "check_spec", "checked_specs", "expand_reward_groups",
           "metric_names"]

ON_ERROR = ("raise", "none", "zero")
_SPEC_KEYS = ("name", "weight", "args", "on_error", "num_workers", "timeout")


class RewardError(UserError, RuntimeError):
    """A reward function raised, or returned something that is not one number-or-None per sample."""


@dataclass
class RewardSpec:
    """One entry of ``model.rewards`` in YAML.

    ``{name: ..., weight: 1.0, args: {...}, on_error: raise, num_workers: 0, timeout: null}``:

    * ``on_error``: ``raise`` | ``none`` | ``zero``, what a sample the reward fails on (raises,
      times out, kills its worker) scores: an error, ``None`` (NaN), or ``0.0``;
    * ``num_workers``: 0 scores in the training process; N > 0 scores one sample per call in a
      pool of N worker processes;
    * ``timeout``: seconds per call of a pool or async reward; ``None`` waits forever.
    """

    name: str
    weight: float = 1.0
    args: dict[str, AsWritten] = field(default_factory=dict)  # as written in YAML (lit_grpo.config)
    on_error: str = "raise"
    num_workers: int = 0
    timeout: float | None = None


def as_spec(spec: Any, where: str) -> RewardSpec:
    """``spec`` (a mapping or a name; in Python also a function or class, alone or as the mapping's
    ``name``, named ``module:qualname``) as a :class:`RewardSpec`; ``where`` names its entry (``model.rewards[0]``)."""
    if isinstance(spec, RewardSpec):
        return spec
    if callable(spec) and not isinstance(spec, str):  # a function, async function or class given in Python
        return RewardSpec(name=register_object_reward(spec))
    if isinstance(spec, Mapping):
        unknown = [key for key in spec if key not in _SPEC_KEYS]
        if unknown or "name" not in spec:
            problem = f"unknown key {unknown[0]!r}" if unknown else "no 'name'"
            raise ConfigError(
                f"{where} must look like {{name: ..., weight: 1.0, args: {{...}}}} "
                "(optional: on_error: raise|none|zero, num_workers: 0, timeout: null); "
                f"got {dict(spec)!r} ({problem})"
            )
        name = spec["name"]
        return RewardSpec(
            name=register_object_reward(name) if callable(name) and not isinstance(name, str) else name,
            weight=spec.get("weight", 1.0),
            args=dict(spec.get("args") or {}),
            on_error=spec.get("on_error", "raise"),
            num_workers=spec.get("num_workers", 0),
            timeout=spec.get("timeout"),
        )
    if isinstance(spec, str):
        return RewardSpec(name=spec)
    raise ConfigError(f"{where} must be a mapping with a 'name', got {spec!r}")


def check_spec(where: str, spec: RewardSpec) -> None:
    """Raise ValueError for an ``on_error``, ``num_workers`` or ``timeout`` the scorer cannot use
    (``where``: the entry, ``model.rewards[0]``)."""
    if not isinstance(spec.on_error, str) or spec.on_error not in ON_ERROR:
        hint = " (YAML null is not the string 'none': write on_error: none)" if spec.on_error is None else ""
        raise ConfigError(
            f"{where}.on_error ({spec.name!r}) must be one of {', '.join(ON_ERROR)}, got {spec.on_error!r}{hint}"
        )
    workers = spec.num_workers
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 0:
        raise ConfigError(
            f"{where}.num_workers ({spec.name!r}) must be a whole number >= 0 (0 scores in the training "
            f"process), got {workers!r}"
        )
    timeout = spec.timeout
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) or timeout <= 0
    ):
        raise ConfigError(
            f"{where}.timeout ({spec.name!r}) must be a number of seconds > 0, or null for no limit; got {timeout!r}"
        )


def checked_specs(specs: Sequence[Any], key: str) -> list[RewardSpec]:
    """The entries of ``key`` (``model.rewards``; mappings, names, or functions and classes given in
    Python) as checked :class:`RewardSpec`, reward groups expanded: at least one, each a name configured
    once (its name keys its metrics) with a finite weight and usable ``on_error``, ``num_workers`` and
    ``timeout``; else a ``ConfigError`` naming the entry."""
    specs = [as_spec(spec, f"{key}[{i}]") for i, spec in enumerate(specs or [])]
    if not specs:
        raise ConfigError(
            f"{key} is empty: configure at least one reward, e.g. "
            "`rewards: [{name: char_fraction, args: {chars: 'a'}}]`; "
            "run `lit-grpo rewards` to list the installed ones"
        )
    first_index: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if not isinstance(spec.name, str) or not spec.name:
            raise ConfigError(f"{key}[{i}].name must be a non-empty string, got {spec.name!r}")
        if spec.name in first_index:
            raise ConfigError(
                f"reward {spec.name!r} is configured twice in {key} (entries "
                f"{first_index[spec.name]} and {i}); each reward may appear once, since its "
                "name keys its metrics (rewards/<name>/mean)"
            )
        first_index[spec.name] = i
        if isinstance(spec.weight, bool) or not isinstance(spec.weight, numbers.Real) or not math.isfinite(spec.weight):
            raise ConfigError(
                f"{key}[{i}] ({spec.name!r}): weight must be a finite number, got {spec.weight!r}"
            )
        check_spec(f"{key}[{i}]", spec)
    specs = expand_reward_groups(specs, key)
    duplicated = [name for name, count in Counter(spec.name for spec in specs).items() if count > 1]
    if duplicated:
        raise ConfigError(f"reward {duplicated[0]!r} is configured twice in {key} (once through a reward group); "
                          "each reward may appear once, since its name keys its metrics")
    return specs


def expand_reward_groups(specs: Sequence[RewardSpec], key: str) -> list[RewardSpec]:
    """``specs`` with every entry that names a reward group (:func:`lit_grpo.reward_group`) replaced by
    the rewards it stands for: ``group(**args)`` gives ``[(reward, weight), ...]``; each reward keeps the
    entry's ``on_error``, ``num_workers`` and ``timeout``, and gets its weight times the entry's."""
    expanded = []
    for index, spec in enumerate(specs):
        group = plugins.get_reward(spec.name).obj if isinstance(spec.name, str) else None
        if not getattr(group, "lit_grpo_reward_group", False):
            expanded.append(spec)
            continue
        try:
            inspect.signature(group).bind(**spec.args)
        except TypeError as error:
            parameters = list(inspect.signature(group).parameters)
            close = [match for key in spec.args for match in difflib.get_close_matches(key, parameters, n=1)]
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise plugins.RewardArgumentError(f"reward {spec.name!r}: {error}{hint} ({key}[{index}].args)") from None
        for reward, weight in group(**spec.args):
            expanded.append(RewardSpec(name=register_object_reward(reward), weight=float(weight) * float(spec.weight),
                                       on_error=spec.on_error, num_workers=spec.num_workers, timeout=spec.timeout))
    return expanded


def metric_names(names: Sequence[str]) -> list[str]:
    """What the rewards configured as ``names`` are called in the metrics (``rewards/<name>/mean``),
    the completions table and ``completions.jsonl``: a plugin by its registered name, a function
    (``path/to/file.py:function``, ``package.module:function``) by the function's name, as TRL
    calls them.

    Only names that would clash are told apart, each step only for the rewards still clashing:

    1. a function gets its file's stem or its module in front, ``file:function`` or
       ``package.module:function`` (a plugin keeps its name, unique among plugins);
    2. should that clash too (two files of the same name), each keeps its name as configured.
    """
    chosen = [_function_name(name) for name in names]
    for rename in (_qualified_name, str):
        counts = Counter(chosen)
        chosen = [rename(name) if counts[current] > 1 else current for name, current in zip(names, chosen)]
    return chosen


def _function_name(name: str) -> str:
    """``accuracy`` for ``my_rewards.py:accuracy``, ``pkg.rewards:accuracy``, the plugin ``accuracy`` and
    a function given in Python, ``module:outer.<locals>.accuracy`` (its ``__name__``, as TRL logs it)."""
    return name.rpartition(":")[2].rpartition(".")[2] if ":" in name else name


def _qualified_name(name: str) -> str:
    """``my_rewards:accuracy`` for ``path/to/my_rewards.py:accuracy``, ``pkg.rewards:accuracy`` as it
    is, and a plugin's name as it is."""
    where, colon, function = name.rpartition(":")
    if not colon:
        return name
    if where.endswith(".py") or "/" in where:  # a file, as lit_grpo.plugins.load_object tells
        where = PurePath(where).stem
    return f"{where}:{function}"
