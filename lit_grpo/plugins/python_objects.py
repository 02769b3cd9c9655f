"""Rewards, tools, environments and models given as Python objects, and the names that stand for them.

``GRPOModule`` takes functions, classes and a model object beside the names YAML gives. What a run
saves (its checkpoints' hyperparameters, ``hparams.yaml``) holds names, never such objects: a lambda
cannot be pickled, and a model does not belong in a YAML file. Nor secrets: :class:`RedactedSettings`.
No heavy import here: plugins load this module.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from lit_grpo.redaction import redact_secrets

__all__ = ["RedactedSettings", "object_name", "save_settings", "storable"]


def object_name(obj: Any) -> str:
    """``module:qualname`` of a function, class or callable instance given in Python (its type's for an
    instance, the wrapped function's for a ``functools.partial``): how a reward, tool or environment
    given as an object is named in messages, checkpoints and, after the colon, in metrics."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    if not (inspect.isclass(target) or inspect.isfunction(target) or inspect.ismethod(target)):
        target = type(target)
    return f"{getattr(target, '__module__', None) or '?'}:{getattr(target, '__qualname__', None) or type(target).__qualname__}"


def storable(value: Any) -> Any:
    """``value`` (settings given in Python) with every function, class or other callable object
    replaced by its :func:`object_name` and a model object by its ``name_or_path``, so that the
    hyperparameters saved in checkpoints and logs hold names, never objects (a lambda cannot be
    pickled; a model does not belong in ``hparams.yaml``)."""
    if isinstance(value, dict):
        return {key: storable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(item) for item in value]
    if hasattr(value, "name_or_path") and hasattr(value, "config"):  # a transformers model
        return str(value.name_or_path)
    if callable(value) and not isinstance(value, (str, bytes)):
        return object_name(value)
    return value


def save_settings(module: Any, settings: dict[str, Any], ignore: list[str]) -> None:
    """``module.save_hyperparameters`` of its ``__init__`` arguments, less ``ignore``, with the objects
    among them (a model, reward or tool given in Python) saved as their names (:func:`storable`).
    Lightning deep-copies what it saves: the objects are left out of that (a model given in Python would
    be copied on its device, twice the memory, and warned about) and their names added after."""
    objects = [name for name, value in settings.items() if name not in ignore and storable(value) != value]
    module.save_hyperparameters(ignore=[*ignore, *objects], frame=inspect.currentframe().f_back)
    if objects:
        module.save_hyperparameters({name: storable(settings[name]) for name in objects})


class RedactedSettings:
    """Mixin of a ``LightningModule`` whose settings are written with their secrets redacted
    (:mod:`lit_grpo.redaction`): the hyperparameters Lightning hands the loggers (``hparams.yaml``,
    TensorBoard, W&B: ``hparams_initial``) and those of every checkpoint. The module itself keeps the
    real values in ``hparams``."""

    @property
    def hparams_initial(self):
        hparams = super().hparams_initial  # a copy, Lightning's AttributeDict
        hparams.update(redact_secrets(dict(hparams)))
        return hparams

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "hyper_parameters" in checkpoint:  # a shallow copy of hparams: replaced, not changed in place
            checkpoint["hyper_parameters"] = redact_secrets(checkpoint["hyper_parameters"])
        super().on_save_checkpoint(checkpoint)
