"""The checks on what a reward returns (used by the scorer's runners, :mod:`lit_grpo.scoring.runners`):
one real number or ``None`` per completion, in a list, tuple or 1-D tensor or array; ``None`` becomes
NaN, ``bool`` 1.0 or 0.0. Anything else (a string, NaN, ±inf, the wrong length) is a
:class:`~lit_grpo.scoring.specs.RewardError` naming the reward: a bug in the reward, which no
``on_error`` setting turns into a score.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from lit_grpo.scoring.failures import preview
from lit_grpo.scoring.specs import RewardError

try:  # numpy comes with torch in practice, but the scorer does not require it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

__all__ = ["reward_values"]


def reward_values(who: str, raw: Any, completions: list, sample: int | None = None) -> list[float]:
    """``raw``, what the reward ``who`` (``Reward 'name' (package)``) returned for ``completions``, as one
    float per completion, NaN for ``None``.

    ``sample`` is set when the reward was called with that one sample alone (``num_workers > 0``,
    or the per-sample retry after a failed batch call); messages then name it.
    """
    n = len(completions)
    alone = f" when called with sample {sample} alone" if sample is not None else ""
    if isinstance(raw, torch.Tensor) or (np is not None and isinstance(raw, np.ndarray)):
        if raw.ndim != 1:
            raise RewardError(
                f"{who} returned a {type(raw).__name__} of shape {tuple(raw.shape)}{alone}; "
                f"expected a 1-D sequence of {n} values (one per completion)"
            )
        if isinstance(raw, torch.Tensor):
            raw = raw.detach().cpu()
        values = raw.tolist()
    elif isinstance(raw, (list, tuple)):
        values = raw
    else:
        raise RewardError(
            f"{who} returned {type(raw).__name__} ({preview(raw)}){alone}; expected a list of {n} "
            "floats or None, one per completion"
        )
    if len(values) != n:
        raise RewardError(f"{who} returned {len(values)} values{alone}; expected {n} (one per completion)")
    first = 0 if sample is None else sample
    return [_to_float(who, first + i, value, completions[i]) for i, value in enumerate(values)]


def _to_float(who: str, i: int, value: Any, completion: Any) -> float:
    """One value of sample ``i``: a finite float, NaN for ``None``."""
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
            f"{who} returned {type(value).__name__} {preview(value)} for sample {i} "
            f"(completion {preview(completion)}); rewards must be numbers (float, int, bool) "
            "or None"
        )
    number = float(value)
    if math.isnan(number):
        raise RewardError(
            f"{who} returned NaN for sample {i}; return None to mark a sample as not applicable"
        )
    if math.isinf(number):
        raise RewardError(
            f"{who} returned {number} for sample {i} (completion {preview(completion)}); "
            "rewards must be finite"
        )
    return number
