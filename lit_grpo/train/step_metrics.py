"""Step 6 of a GRPO step: the metrics it logs (TRL's names).

The rollout's statistics (:func:`lit_grpo.rollout.records.rollout_statistics`) are already global;
the update's are every rank's micro-batch statistics averaged over ranks (every rank runs the same
number of micro-batches); the timings are this rank's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lit_grpo.rollout.records import ScoredRollout

__all__ = ["timing_metrics", "update_metrics"]

Reduce = Callable[[torch.Tensor, str], torch.Tensor]  # (value, "mean" | "sum" | "max" | "min") over ranks


def update_metrics(step_stats: list[dict[str, torch.Tensor]], num_iterations: int, steps_per_generation: int,
                   reduce: Reduce) -> dict[str, torch.Tensor]:
    """The micro-batches' statistics of one step (``step_stats``, one dict of scalars each) as one value
    each over all ranks: ``loss`` the mean per optimizer step, ``*/max`` and ``*/min`` their extremes,
    the others their mean (NaN, a micro-batch with no token to count, left out). With the entropy bonus,
    ``policy_loss`` (the loss before the bonus) is the micro-batches' mean as TRL logs it, and
    ``entropy_coef`` the mean of the coefficient after each optimizer step (TRL: one value per step)."""
    metrics = {}
    for key in step_stats[0]:
        values = torch.stack([stats[key] for stats in step_stats])
        if key == "loss":
            value, reduce_op = values.sum() / num_iterations / steps_per_generation, "mean"
        elif key.endswith(("/max", "/min")):  # a micro-batch with no token to count gives NaN
            reduce_op = key.rsplit("/", 1)[1]
            fill = float("-inf") if reduce_op == "max" else float("inf")
            value = getattr(values.nan_to_num(nan=fill), reduce_op)()
        else:
            value, reduce_op = values.nanmean(), "mean"
        metrics[key] = reduce(value, reduce_op)
    return metrics


def timing_metrics(scored: ScoredRollout, step_time: float, reduce: Reduce) -> dict[str, torch.Tensor]:
    """``step_time``, ``time/<phase>`` (this rank's seconds per phase) and ``tokens_per_second``: the
    completion tokens sampled by all ranks per second of this step."""
    metrics = {"step_time": torch.tensor(step_time)}
    for phase, seconds in scored.timings.items():
        metrics[f"time/{phase}"] = torch.tensor(seconds)
    completion_tokens = reduce(scored.rollout.completion_lengths.sum().float(), "sum")
    metrics["tokens_per_second"] = completion_tokens / step_time
    return metrics
