"""Rewards and group-relative advantages: GRPO's replacement for a learned value baseline.

Completions are laid out group by group: rows ``g*G .. g*G+G-1`` belong to prompt ``g`` (``B``
prompts, ``G`` completions each, ``N = B * G``). An advantage estimator (``model.scale_rewards``)
is one function of :class:`GroupedRewards` registered in :data:`ADVANTAGE_ESTIMATORS`
(:func:`register_advantage_estimator`); :func:`group_advantages` computes what every estimator
shares (group means, equal-reward groups, missing rewards) around it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the reward functions, ``r_i = sum_k w_k * r_ik``.

    A ``None`` reward ("not applicable") arrives as NaN and is skipped (``nansum``). A completion for
    which *every* reward is NaN has no reward at all: its combined reward stays NaN, so that
    :func:`group_advantages` gives it advantage 0 and leaves it out of its group's statistics.

    Args:
        rewards_per_func: ``[N, K]`` rewards, NaN for None.
        weights: ``[K]`` reward weights.
    Returns:
        ``[N]`` combined rewards.
    """
    weighted = rewards_per_func * weights.to(rewards_per_func).unsqueeze(0)  # [N, K]
    rewards = weighted.nansum(dim=1)  # [N]
    all_missing = torch.isnan(rewards_per_func).all(dim=1)
    return torch.where(all_missing, torch.full_like(rewards, float("nan")), rewards)


def _nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaN; 0 where fewer than two values are valid."""
    valid = ~torch.isnan(values)
    count = valid.sum() if dim is None else valid.sum(dim=dim)
    mean = values.nanmean() if dim is None else values.nanmean(dim=dim, keepdim=True)
    squares = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values))
    total = squares.sum() if dim is None else squares.sum(dim=dim)
    variance = total / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance.sqrt(), torch.zeros_like(variance))


@dataclass
class GroupAdvantages:
    """Output of :func:`group_advantages`; every field has one value per completion."""

    advantages: torch.Tensor  # [N]  (r_i - group mean) / (std + 1e-4), 0 for NaN rewards
    group_mean: torch.Tensor  # [N]  mean reward of the completion's group
    group_std: torch.Tensor  # [N]  std of the completion's group (Bessel-corrected)
    zero_std: torch.Tensor  # [N] bool, True when the completion's group has equal rewards

    def rows(self, index) -> "GroupAdvantages":
        """The same statistics for a subset of the completions (e.g. one rank's rows)."""
        return GroupAdvantages(self.advantages[index], self.group_mean[index], self.group_std[index], self.zero_std[index])


@dataclass(frozen=True)
class GroupedRewards:
    """What an advantage estimator gets: one generation batch's rewards in groups."""

    rewards: torch.Tensor  # [B, G] rewards, NaN where a completion has none
    centered: torch.Tensor  # [B, G] reward - group mean; exactly 0 in a group whose rewards are all equal
    group_std: torch.Tensor  # [B, 1] Bessel-corrected std of each group (0 for equal rewards)
    eps: float  # added to a std before dividing by it


AdvantageEstimator = Callable[[GroupedRewards], torch.Tensor]  # -> [B, G] advantages (NaN becomes 0)

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Register an advantage estimator under a ``model.scale_rewards`` name (decorator)."""

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


@register_advantage_estimator("group")
def group_scaled(grouped: GroupedRewards) -> torch.Tensor:
    """GRPO: divided by the std of the completion's group."""
    return grouped.centered / (grouped.group_std + grouped.eps)


@register_advantage_estimator("batch")
def batch_scaled(grouped: GroupedRewards) -> torch.Tensor:
    """Divided by the std of the whole batch; the mean stays the group mean (Hu et al. 2025,
    REINFORCE++ / "batch-level normalisation")."""
    return grouped.centered / (_nanstd(grouped.rewards.reshape(-1)) + grouped.eps)


@register_advantage_estimator("none")
def unscaled(grouped: GroupedRewards) -> torch.Tensor:
    """No division at all (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO)."""
    return grouped.centered


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> GroupAdvantages:
    """Group-relative advantages by the estimator ``scale_rewards`` (a key of :data:`ADVANTAGE_ESTIMATORS`).

    ``A_i = (r_i - mean_group(r)) / (std + eps)`` where ``std`` is the Bessel-corrected std of the
    completion's group (``scale_rewards="group"``, GRPO), of the whole batch (``"batch"``), or no
    division at all (``"none"``).

    Completions are laid out group by group: rows ``g*G .. g*G+G-1`` belong to prompt ``g``.
    NaN rewards (no applicable reward) are left out of the statistics and get advantage 0. A group
    whose rewards are all equal has advantage 0 everywhere: it carries no learning signal.
    """
    if scale_rewards not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"scale_rewards must be one of {tuple(ADVANTAGE_ESTIMATORS)}, got {scale_rewards!r}")
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)  # [B, G]
    valid = ~torch.isnan(grouped)
    mean = grouped.nanmean(dim=1, keepdim=True)  # [B, 1], NaN for a group with no reward at all
    mean = torch.nan_to_num(mean, nan=0.0)
    # Equal rewards are detected exactly (max == min), not through a float mean that may be off by
    # an ulp (six rewards of 0.3 in float32), so such a group gets advantage exactly 0.
    highest = torch.where(valid, grouped, -torch.inf).amax(dim=1, keepdim=True)  # [B, 1]
    lowest = torch.where(valid, grouped, torch.inf).amin(dim=1, keepdim=True)  # [B, 1]
    all_equal = highest <= lowest  # [B, 1], also True for a group with at most one valid reward
    std = torch.where(all_equal, 0.0, _nanstd(grouped, dim=1).unsqueeze(1))  # [B, 1]
    zero_std = torch.isclose(std, torch.zeros_like(std)).expand_as(grouped)  # [B, G]

    centered = torch.where(all_equal, 0.0, grouped - mean)  # [B, G]
    advantages = ADVANTAGE_ESTIMATORS[scale_rewards](GroupedRewards(grouped, centered, std, eps))  # [B, G]
    advantages = torch.nan_to_num(advantages, nan=0.0)  # missing rewards carry no signal
    return GroupAdvantages(
        advantages=advantages.reshape(-1),
        group_mean=mean.expand_as(grouped).reshape(-1),
        group_std=std.expand_as(grouped).reshape(-1),
        zero_std=zero_std.reshape(-1),
    )
