"""Binding a reward's YAML ``args``: the callable a registered reward becomes for a run.

A function's ``args`` become bound keyword arguments (which win over a dataset column of the same
name); a class is instantiated with them. Arguments the reward cannot take, or that the trainer
supplies itself (``prompts``, ``completions``, ``completion_ids``), are errors naming the reward.

What is left for the data to give, :func:`needed_columns`, is checked against the dataset's columns
before the run (:func:`check_columns`), as is that the reward takes every keyword argument a call
passes it (:func:`check_accepts`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from lit_grpo.errors import ConfigError, DataError
from lit_grpo.plugins import RESERVED_ARGS, RegistryEntry, RewardArgumentError, get_reward

__all__ = ["build_reward", "check_accepts", "check_columns", "needed_columns"]


class _BoundReward(functools.partial):
    """``functools.partial`` whose bound keywords win over call keywords.

    The trainer passes every dataset column as a keyword argument; a column that happens to share
    its name with a YAML ``args`` entry must not silently override the configured value.
    """

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **{**kwargs, **self.keywords})


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature
        return None


def _check_args(info: RegistryEntry, args: dict[str, Any], sig: inspect.Signature | None, what: str) -> None:
    """Raise :class:`RewardArgumentError` for args the signature cannot take."""
    reserved = [a for a in args if a in RESERVED_ARGS]
    if reserved:
        raise RewardArgumentError(
            f"Reward '{info.name}' ({info.label}): args may not set {reserved[0]!r}; "
            f"{', '.join(RESERVED_ARGS)} are supplied by the trainer on every call"
        )
    if sig is None:
        return
    params = sig.parameters.values()
    named = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in RESERVED_ARGS
    ]
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    for arg in args:
        if arg in named:
            continue
        close = difflib.get_close_matches(arg, named, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        # A name close to one of the parameters is a misspelling even where **kwargs would take it
        # (it would be ignored there); a name unlike any goes to **kwargs, for rewards that read it.
        if not has_var_kw or close:
            raise RewardArgumentError(
                f"Reward '{info.name}' ({info.label}) got an unexpected argument {arg!r} in args"
                f"{hint}; its {what} accepts: {', '.join(named) or 'no arguments'}"
            )


def build_reward(
    name: str, args: Mapping[str, Any] | None = None, run_settings: Mapping[str, Any] | None = None
) -> Callable[..., Any]:
    """Resolve reward ``name`` and configure it with ``args`` (the YAML ``args`` mapping).

    ``run_settings`` are values the run knows (``max_completion_len``: ``model.max_completion_length``)
    that a reward gets for a parameter of that name which ``args`` does not give.

    * a class is instantiated with ``**args`` (constructor arguments);
    * a function with non-empty ``args`` is bound with a ``functools.partial`` (keeping the
      function's ``__name__`` and ``__doc__``); configured ``args`` take precedence over dataset
      columns of the same name;
    * a function with no ``args`` is returned as is.

    Raises :class:`UnknownRewardError` for an unknown name and :class:`RewardArgumentError` for
    ``args`` the reward cannot take (or a constructor that raises).
    """
    info = get_reward(name)
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise RewardArgumentError(
            f"Reward '{name}' ({info.label}): args must be a mapping of keyword arguments, "
            f"got {type(args).__name__}: {args!r}"
        )
    args = dict(args)
    bad_keys = [k for k in args if not isinstance(k, str)]
    if bad_keys:
        raise RewardArgumentError(f"Reward '{name}' ({info.label}): argument names must be strings, got {bad_keys[0]!r}")
    obj = info.obj
    parameters = getattr(_signature(obj), "parameters", {})
    for key, value in (run_settings or {}).items():
        if key in parameters and key not in args:
            args[key] = value
    if inspect.isclass(obj):
        sig = _signature(obj)
        _check_args(info, args, sig, "constructor")
        if sig is not None:
            try:
                sig.bind(**args)
            except TypeError as exc:
                raise RewardArgumentError(
                    f"Reward '{name}' ({info.label}) cannot be constructed with args {args!r}: {exc}"
                ) from None
        try:
            return obj(**args)
        except Exception as exc:
            raise RewardArgumentError(
                f"Reward '{name}' ({info.label}): constructing {obj.__qualname__}(**{args!r}) raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    if not args:
        return obj
    _check_args(info, args, _signature(obj), "function")
    bound = _BoundReward(obj, **args)
    bound.__name__ = getattr(obj, "__name__", name)
    bound.__qualname__ = getattr(obj, "__qualname__", name)
    bound.__doc__ = getattr(obj, "__doc__", None)
    bound.__module__ = getattr(obj, "__module__", None)
    return bound


# --------------------------------------------------------------------------------------------------
# What the data must give
# --------------------------------------------------------------------------------------------------


def needed_columns(obj: Any, given: Iterable[str] = ()) -> list[str]:
    """The parameters of ``obj`` (a built reward, or an environment class) that only a dataset
    column can fill: the named ones without a default, other than the arguments every reward call
    gets (``prompts``, ``completions``, ``completion_ids``) and ``given`` (YAML ``args``). Bound
    ``args`` of a function count as defaults; a ``**kwargs`` takes whatever columns there are."""
    sig = _signature(obj)
    if sig is None:
        return []
    return [
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.default is p.empty
        and p.name not in RESERVED_ARGS
        and p.name not in given
    ]


def check_columns(
    who: str, obj: Any, columns: Sequence[str], source: str, where: str, given: Iterable[str] = ()
) -> None:
    """Raise :class:`DataError` naming the column ``obj`` (``who``, configured at ``where``) needs
    and the ``columns`` the ``source`` dataset has (those it passes on to rewards and environments)."""
    missing = [name for name in needed_columns(obj, given) if name not in columns]
    if not missing:
        return
    close = difflib.get_close_matches(missing[0], [*columns, *RESERVED_ARGS], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise DataError(
        f"{who} takes {missing[0]!r}, a parameter without a default, but the {source} has no column "
        f"{missing[0]!r}{hint}; the columns it passes on to rewards and environments: "
        f"{', '.join(columns) or 'none'} ({where})"
    )


def check_accepts(who: str, obj: Any, columns: Sequence[str], where: str) -> None:
    """Raise :class:`ConfigError` when reward ``obj`` (``who``, configured at ``where``) cannot take a
    keyword argument each call passes it: ``prompts``, ``completions``, ``completion_ids`` and every
    one of ``columns``; the fix is a ``**kwargs`` (TRL's reward functions have one too)."""
    sig = _signature(obj)
    if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    named = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    refused = [name for name in [*RESERVED_ARGS, *columns] if name not in named]
    if not refused:
        return
    function = getattr(obj, "__name__", None) or type(obj).__name__
    kept = ", ".join(str(p) for p in sig.parameters.values())
    raise ConfigError(
        f"{who} cannot take the keyword argument {refused[0]!r}: every call passes prompts, completions, "
        f"completion_ids and each column of the data ({', '.join(columns) or 'none'}) as keyword arguments, and "
        f"its signature is ({kept}); add **kwargs: def {function}({kept + ', ' if kept else ''}**kwargs) ({where})"
    )
