"""Scoring completions with the configured reward functions.

:class:`RewardScorer` turns the ``model.rewards`` list of the YAML config into one callable that
returns the ``[N, K]`` reward matrix (N completions, K rewards) the algorithm combines with
``weights``. Every reward is resolved by name through the plugin registry when the scorer is built,
so a misspelled reward fails before the model is loaded, not after the first generation.

Call convention (TRL-compatible, keyword arguments only)::

    reward(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)

Return-value rules, checked for every call (a violation raises :class:`RewardError` naming the
reward):

* a ``list``, ``tuple``, 1-D ``torch.Tensor`` or 1-D ``numpy.ndarray`` with exactly one value per
  completion;
* each value is a real number (``int``, ``float``, numpy scalar, one-element tensor) or ``None``
  ("not applicable to this sample"; it becomes NaN in the matrix and is skipped by ``nansum``);
* ``bool`` values are accepted as 1.0 / 0.0 (handy for pass/fail checks);
* strings and other objects are errors, and so are NaN (return ``None`` instead) and ±inf.

The scorer calls rewards one after another in the calling process. Each reward call goes through
:meth:`RewardScorer.call_reward` and its result through :meth:`RewardScorer.validate`, so running
calls concurrently (threads, processes, async rewards) can later be added in ``__call__`` alone.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_grpo import plugins

try:  # numpy comes with torch in practice, but the scorer does not require it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

__all__ = ["RewardError", "RewardScorer", "RewardSpec"]

_PREVIEW_CHARS = 200


class RewardError(RuntimeError):
    """A reward function raised, or returned something that is not one number-or-None per sample."""


@dataclass
class RewardSpec:
    """One entry of ``model.rewards`` in YAML: ``{name: ..., weight: 1.0, args: {...}}``."""

    name: str
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _PREVIEW_CHARS else text[: _PREVIEW_CHARS - 3] + "..."


def _as_spec(spec: Any, index: int) -> RewardSpec:
    if isinstance(spec, RewardSpec):
        return spec
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"name", "weight", "args"}
        if unknown or "name" not in spec:
            raise ValueError(
                f"model.rewards[{index}] must look like {{name: ..., weight: 1.0, args: {{...}}}}; "
                f"got {dict(spec)!r}"
            )
        return RewardSpec(
            name=spec["name"],
            weight=spec.get("weight", 1.0),
            args=dict(spec.get("args") or {}),
        )
    if isinstance(spec, str):
        return RewardSpec(name=spec)
    raise ValueError(f"model.rewards[{index}] must be a mapping with a 'name', got {spec!r}")


class RewardScorer:
    """Scores completions with a fixed list of rewards.

    ``scorer(prompts, completions, completion_ids, columns)`` returns a float32 tensor
    ``[N, K]``: column k holds reward ``names[k]``, NaN where that reward returned ``None``.
    ``weights`` (``[K]``) holds the configured weights; combining is the caller's business.
    """

    def __init__(self, specs: Sequence[RewardSpec | Mapping[str, Any]]):
        specs = [_as_spec(spec, i) for i, spec in enumerate(specs or [])]
        if not specs:
            raise ValueError(
                "model.rewards is empty: configure at least one reward, e.g. "
                "`rewards: [{name: char_fraction, args: {chars: 'a'}}]`; "
                "run `lit-grpo rewards` to list the installed ones"
            )
        first_index: dict[str, int] = {}
        for i, spec in enumerate(specs):
            if not isinstance(spec.name, str) or not spec.name:
                raise ValueError(f"model.rewards[{i}].name must be a non-empty string, got {spec.name!r}")
            if spec.name in first_index:
                raise ValueError(
                    f"reward {spec.name!r} is configured twice in model.rewards (entries "
                    f"{first_index[spec.name]} and {i}); each reward may appear once, since its "
                    "name keys its metrics (rewards/<name>/mean)"
                )
            first_index[spec.name] = i
            if isinstance(spec.weight, bool) or not isinstance(spec.weight, numbers.Real) or not math.isfinite(spec.weight):
                raise ValueError(
                    f"model.rewards[{i}] ({spec.name!r}): weight must be a finite number, got {spec.weight!r}"
                )
        self.specs: list[RewardSpec] = specs
        self.names: list[str] = [spec.name for spec in specs]
        self.infos: list[plugins.RewardInfo] = [plugins.get_reward(spec.name) for spec in specs]
        self.rewards: list[Any] = [plugins.build_reward(spec.name, spec.args) for spec in specs]
        self.weights: torch.Tensor = torch.tensor([float(spec.weight) for spec in specs], dtype=torch.float32)  # [K]

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}*{w:g}" for n, w in zip(self.names, self.weights.tolist()))
        return f"RewardScorer({parts})"

    # ---------------------------------------------------------------------------------------------

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: Mapping[str, list] | None = None,
    ) -> torch.Tensor:
        columns = dict(columns or {})
        n = len(completions)
        self._check_inputs(prompts, completions, completion_ids, columns)
        scores = torch.full((n, len(self.rewards)), float("nan"), dtype=torch.float32)  # [N, K]
        if n == 0:
            return scores
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        for k in range(len(self.rewards)):
            raw = self.call_reward(k, kwargs)
            scores[:, k] = torch.tensor(self.validate(k, raw, prompts, completions), dtype=torch.float32)
        return scores

    def _check_inputs(self, prompts: list, completions: list, completion_ids: list, columns: dict) -> None:
        n = len(completions)
        if len(prompts) != n or len(completion_ids) != n:
            raise ValueError(
                f"RewardScorer needs one prompt and one completion_ids entry per completion: got "
                f"{len(prompts)} prompts, {n} completions, {len(completion_ids)} completion_ids"
            )
        for key, values in columns.items():
            if key in plugins.RESERVED_ARGS:
                raise ValueError(
                    f"dataset column {key!r} clashes with the reward argument of the same name; rename the column"
                )
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")

    def call_reward(self, k: int, kwargs: dict[str, Any]) -> Any:
        """Call reward ``k`` with the shared keyword arguments; wraps any exception in RewardError."""
        try:
            return self.rewards[k](**kwargs)
        except Exception as exc:
            prompts, completions = kwargs["prompts"], kwargs["completions"]
            raise RewardError(
                f"{self._who(k)} raised {type(exc).__name__}: {exc}\n"
                f"  while scoring {len(completions)} completions; the first was\n"
                f"  prompt:     {_preview(prompts[0])}\n"
                f"  completion: {_preview(completions[0])}"
            ) from exc

    def validate(self, k: int, raw: Any, prompts: list, completions: list) -> list[float]:
        """Check reward ``k``'s return value; one float per completion, NaN for ``None``."""
        n = len(completions)
        who = self._who(k)
        if isinstance(raw, torch.Tensor) or (np is not None and isinstance(raw, np.ndarray)):
            if raw.ndim != 1:
                raise RewardError(
                    f"{who} returned a {type(raw).__name__} of shape {tuple(raw.shape)}; "
                    f"expected a 1-D sequence of {n} values (one per completion)"
                )
            if isinstance(raw, torch.Tensor):
                raw = raw.detach().cpu()
            values = raw.tolist()
        elif isinstance(raw, (list, tuple)):
            values = raw
        else:
            raise RewardError(
                f"{who} returned {type(raw).__name__} ({_preview(raw)}); expected a list of {n} "
                "floats or None, one per completion"
            )
        if len(values) != n:
            raise RewardError(f"{who} returned {len(values)} values; expected {n} (one per completion)")
        out = []
        for i, value in enumerate(values):
            out.append(self._to_float(who, i, value, completions))
        return out

    @staticmethod
    def _to_float(who: str, i: int, value: Any, completions: list) -> float:
        if value is None:
            return float("nan")
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            value = value.item()
        elif np is not None and isinstance(value, np.generic) and not isinstance(value, np.complexfloating):
            value = value.item()
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"{who} returned {type(value).__name__} {_preview(value)} for sample {i} "
                f"(completion {_preview(completions[i])}); rewards must be numbers (float, int, bool) "
                "or None"
            )
        number = float(value)
        if math.isnan(number):
            raise RewardError(
                f"{who} returned NaN for sample {i}; return None to mark a sample as not applicable"
            )
        if math.isinf(number):
            raise RewardError(
                f"{who} returned {number} for sample {i} (completion {_preview(completions[i])}); "
                "rewards must be finite"
            )
        return number

    def _who(self, k: int) -> str:
        info = self.infos[k]
        return f"Reward '{self.names[k]}' ({info.label})"
