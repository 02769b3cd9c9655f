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


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
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
    return grouped.centered / (nanstd(grouped.rewards.reshape(-1)) + grouped.eps)


@register_advantage_estimator("none")
def unscaled(grouped: GroupedRewards) -> torch.Tensor:
    """No division at all (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO)."""
    return grouped.centered


def _all_equal(grouped: torch.Tensor) -> torch.Tensor:
    """``[B, G, ...] -> [B, 1, ...]`` bool: the non-NaN values of each group (dim 1) are all equal (also
    where there is at most one). Detected exactly (max <= min), not through a float std that may be an
    ulp off 0 (six rewards of 0.3 in float32), so such a group gets advantage exactly 0."""
    valid = ~torch.isnan(grouped)
    highest = torch.where(valid, grouped, -torch.inf).amax(dim=1, keepdim=True)
    lowest = torch.where(valid, grouped, torch.inf).amin(dim=1, keepdim=True)
    return highest <= lowest


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
    mean = grouped.nanmean(dim=1, keepdim=True)  # [B, 1], NaN for a group with no reward at all
    mean = torch.nan_to_num(mean, nan=0.0)
    all_equal = _all_equal(grouped)  # [B, 1], also True for a group with at most one valid reward
    std = torch.where(all_equal, 0.0, nanstd(grouped, dim=1).unsqueeze(1))  # [B, 1]
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


# ----------------------------------------------------------------------------------------------
# Several rewards: summed then normalised (GRPO), or each normalised then summed (GDPO)
# ----------------------------------------------------------------------------------------------

# (rewards_per_func [N, K] NaN for None, weights [K], num_generations, scale_rewards, eps) -> GroupAdvantages
RewardAggregation = Callable[[torch.Tensor, torch.Tensor, int, str, float], GroupAdvantages]

MULTI_OBJECTIVE_AGGREGATIONS: dict[str, RewardAggregation] = {}


def register_multi_objective_aggregation(name: str) -> Callable[[RewardAggregation], RewardAggregation]:
    """Register how several rewards become advantages, under a ``model.multi_objective_aggregation``
    name (decorator)."""

    def decorator(fn: RewardAggregation) -> RewardAggregation:
        MULTI_OBJECTIVE_AGGREGATIONS[name] = fn
        return fn

    return decorator


@register_multi_objective_aggregation("sum_then_normalize")
def sum_then_normalize(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, scale_rewards: str = "group",
    eps: float = 1e-4,
) -> GroupAdvantages:
    """GRPO's (TRL's default): the weighted sum of the rewards (:func:`combine_rewards`), then group
    advantages by ``scale_rewards`` (:func:`group_advantages`)."""
    return group_advantages(combine_rewards(rewards_per_func, weights), num_generations, scale_rewards, eps)


@register_multi_objective_aggregation("normalize_then_sum")
def normalize_then_sum(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, scale_rewards: str = "group",
    eps: float = 1e-4,
) -> GroupAdvantages:
    """GDPO (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL"), as TRL 1.16's ``multi_objective_aggregation="normalize_then_sum"``:

    1. each reward ``k`` normalised within its group, ``z_ik = (r_ik - mean_g(r_k)) / (std_g(r_k) + eps)``
       (NaN rewards left out of the statistics and staying NaN);
    2. ``s_i = nansum_k w_k * z_ik``, NaN where every reward of the completion is None;
    3. ``A_i = (s_i - mean(s)) / (std(s) + eps)`` over the whole batch, ``scale_rewards`` unused
       (as in TRL); a completion with no reward gets 0.

    A reward that varies widely no longer drowns another's signal in the sum. Stds are
    Bessel-corrected; a std of fewer than two values counts as 0 (TRL: NaN, then 0 after its
    ``nansum``: the same).

    Deviation from TRL: a reward equal over its group gets ``z = 0`` exactly (detected by max == min,
    as :func:`group_advantages` does). TRL computes ``(r - mean) / (std + 1e-4)``, so the float error
    of a mean of values such as six 0.3s (about 1e-8) survives, and step 3 divides it by a batch std
    that may be as small: two groups of six rewards, 0.3 and 0.7 each constant, get advantages of
    about +-0.58 under TRL and 0 here; one such group beside a varying one shifts every advantage by
    about 2e-4. Equal with TRL up to that noise.

    ``zero_std`` marks groups whose summed ``s`` is equal over the group (no learning signal: dynamic
    sampling's test), also when the rewards differ but cancel (``r1 = [1, 0]``, ``r2 = [0, 1]``). It is
    not TRL's ``frac_reward_zero_std``, which under GDPO is whether the *batch* std of ``s`` is 0.
    ``group_mean`` / ``group_std`` are the batch's mean and std of ``s`` (TRL's ``std_rewards`` of this
    branch divides by the latter), not the raw rewards' statistics: they are not the logged ``reward_std``,
    which is the std of the raw weighted sum under both aggregations (TRL's and lit-grpo's:
    ``lit_grpo.rollout.records.rollout_statistics``).
    """
    N, K = rewards_per_func.shape
    if N % num_generations != 0:
        raise ValueError(f"{N} rewards do not split into groups of {num_generations}")
    grouped = rewards_per_func.view(-1, num_generations, K)  # [B, G, K]
    valid = ~torch.isnan(grouped)
    mean_k = torch.nan_to_num(grouped.nanmean(dim=1, keepdim=True), nan=0.0)  # [B, 1, K]
    all_equal = _all_equal(grouped)  # [B, 1, K]: one value or none counts as equal
    std_k = torch.where(all_equal, 0.0, nanstd(grouped, dim=1).unsqueeze(1))  # [B, 1, K]
    normalized = torch.where(all_equal & valid, 0.0, (grouped - mean_k) / (std_k + eps))  # [B, G, K], NaN stays
    summed = combine_rewards(normalized.reshape(N, K), weights)  # [N], NaN where every reward is None
    batch_mean = torch.nan_to_num(summed.nanmean(), nan=0.0)
    batch_std = nanstd(summed)
    advantages = torch.nan_to_num((summed - batch_mean) / (batch_std + eps), nan=0.0)  # [N]
    summed_equal = _all_equal(summed.view(-1, num_generations)).expand(-1, num_generations)  # [B, G]
    return GroupAdvantages(
        advantages=advantages,
        group_mean=batch_mean.expand(N),
        group_std=batch_std.expand(N),
        zero_std=summed_equal.reshape(-1),
    )


def multi_objective_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
    eps: float = 1e-4,
) -> GroupAdvantages:
    """Advantages of ``rewards_per_func [N, K]`` (NaN for None) with reward ``weights [K]`` by the
    ``model.multi_objective_aggregation`` named ``aggregation`` (a key of
    :data:`MULTI_OBJECTIVE_AGGREGATIONS`)."""
    if aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation must be one of {tuple(MULTI_OBJECTIVE_AGGREGATIONS)}, got {aggregation!r}"
        )
    return MULTI_OBJECTIVE_AGGREGATIONS[aggregation](rewards_per_func, weights, num_generations, scale_rewards, eps)
