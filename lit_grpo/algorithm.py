"""The GRPO algorithm as pure tensor functions: no Lightning, no transformers, no I/O.

GRPO (Group Relative Policy Optimization; Shao et al. 2024, "DeepSeekMath: Pushing the Limits of
Mathematical Reasoning in Open Language Models", arXiv:2402.03300) is PPO without a critic: for each
prompt the policy samples a *group* of G completions, and a completion's advantage is its reward
relative to the other members of its group. The update is PPO's clipped surrogate against the policy
that sampled, optionally with a KL penalty to a frozen reference model.

Everything here follows TRL 1.16's ``GRPOTrainer`` semantics (see the design brief, section 4), so
numbers are comparable with TRL runs. Notation used in the shape comments:

    N = B * G   completions in a generation batch (B prompts, G completions per prompt)
    T           completion length (padded), V vocabulary size, K number of reward functions

Tokens are indexed so that ``logps[i, t]`` is the log-probability of completion token ``t`` of
completion ``i``; ``completion_mask[i, t]`` is 1 on real completion tokens (up to and including EOS)
and 0 on padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# ----------------------------------------------------------------------------------------------
# 1. Token log-probabilities and entropy
# ----------------------------------------------------------------------------------------------


def selective_log_softmax(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, rows_per_chunk: int = 1
) -> torch.Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

    ``logp[i, t] = logits[i, t, tok] / temp - logsumexp(logits[i, t, :] / temp)``

    Equal to ``log_softmax(logits / temperature).gather(-1, tokens)`` but never materialises a
    float32 ``[B, T, V]`` log-softmax: rows are processed ``rows_per_chunk`` at a time, so the
    largest temporary is ``[rows_per_chunk, T, V]``.

    Args:
        logits: ``[B, T, V]`` logits whose position ``t`` predicts ``tokens[:, t]`` (already shifted).
        tokens: ``[B, T]`` token ids.
        temperature: sampling temperature the tokens were drawn with.
    Returns:
        ``[B, T]`` float32 log-probabilities.
    """
    logps = []
    for start in range(0, logits.size(0), rows_per_chunk):
        chunk = logits[start : start + rows_per_chunk].float() / temperature  # [b, T, V]
        chunk_tokens = tokens[start : start + rows_per_chunk].unsqueeze(-1)  # [b, T, 1]
        token_logits = chunk.gather(-1, chunk_tokens).squeeze(-1)  # [b, T]
        logps.append(token_logits - torch.logsumexp(chunk, dim=-1))
    return torch.cat(logps, dim=0)


@torch.no_grad()
def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, rows_per_chunk: int = 1
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, ``[B, T, V] -> [B, T]`` float32.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` with ``z = logits / temperature``; computed in
    row chunks like :func:`selective_log_softmax`. A metric only, so no gradient.
    """
    entropies = []
    for start in range(0, logits.size(0), rows_per_chunk):
        z = logits[start : start + rows_per_chunk].float() / temperature  # [b, T, V]
        log_z = torch.logsumexp(z, dim=-1, keepdim=True)  # [b, T, 1]
        probs = torch.exp(z - log_z)
        # a -inf logit (a masked token) has probability 0 and contributes 0, not 0 * -inf = NaN
        weighted = torch.where(probs > 0, probs * z, torch.zeros_like(z))
        entropies.append(log_z.squeeze(-1) - weighted.sum(-1))
    return torch.cat(entropies, dim=0)


def completion_mask_from_ids(
    completion_ids: torch.Tensor, eos_token_id: int | list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real completion tokens: everything up to and including the first EOS.

    Args:
        completion_ids: ``[N, T]`` generated tokens (whatever ``generate`` put after EOS is padding).
        eos_token_id: one id or several ids that end a completion.
    Returns:
        ``completion_mask`` ``[N, T]`` (int64, 1 on real tokens) and ``is_truncated`` ``[N]`` (bool,
        True for completions that never emitted EOS: they were cut at ``max_completion_length``).
    """
    eos_ids = torch.as_tensor(eos_token_id, device=completion_ids.device).reshape(-1)
    is_eos = torch.isin(completion_ids, eos_ids)  # [N, T]
    num_tokens = completion_ids.size(1)
    # index of the first EOS, or T when there is none
    first_eos = torch.where(
        is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(is_eos[:, 0], num_tokens, dtype=torch.long)
    )  # [N]
    positions = torch.arange(num_tokens, device=completion_ids.device).expand_as(completion_ids)
    completion_mask = (positions <= first_eos.unsqueeze(1)).long()  # [N, T]
    is_truncated = ~is_eos.any(dim=1)  # [N]
    return completion_mask, is_truncated


# ----------------------------------------------------------------------------------------------
# 2. Rewards and group-relative advantages
# ----------------------------------------------------------------------------------------------


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


SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> GroupAdvantages:
    """Group-relative advantages (GRPO's replacement for a learned value baseline).

    ``A_i = (r_i - mean_group(r)) / (std + eps)`` where ``std`` is the Bessel-corrected std of the
    completion's group (``scale_rewards="group"``, GRPO), of the whole batch (``"batch"``, the mean
    stays the group mean; Hu et al. 2025, REINFORCE++ / "batch-level normalisation"), or no division
    at all (``"none"``; Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO).

    Completions are laid out group by group: rows ``g*G .. g*G+G-1`` belong to prompt ``g``.
    NaN rewards (no applicable reward) are left out of the statistics and get advantage 0. A group
    whose rewards are all equal has advantage 0 everywhere: it carries no learning signal.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
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
    if scale_rewards == "group":
        advantages = centered / (std + eps)
    elif scale_rewards == "batch":
        advantages = centered / (_nanstd(rewards) + eps)
    else:
        advantages = centered
    advantages = torch.nan_to_num(advantages, nan=0.0)  # missing rewards carry no signal
    return GroupAdvantages(
        advantages=advantages.reshape(-1),
        group_mean=mean.expand_as(grouped).reshape(-1),
        group_std=std.expand_as(grouped).reshape(-1),
        zero_std=zero_std.reshape(-1),
    )


# ----------------------------------------------------------------------------------------------
# 3. KL, importance ratio, clipped surrogate
# ----------------------------------------------------------------------------------------------


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference) (Schulman 2020, "Approximating KL divergence").

    ``kl = exp(ref - logp) - (ref - logp) - 1``, non-negative and unbiased, ``[N, T] -> [N, T]``.
    """
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def importance_ratio(
    logps: torch.Tensor, old_logps: torch.Tensor, completion_mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """Importance ratio between the current policy and the policy that sampled.

    ``token`` (GRPO/PPO): ``rho[i, t] = exp(logp[i, t] - old_logp[i, t])``, shape ``[N, T]``.
    ``sequence`` (GSPO; Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071):
    one ratio per completion from the masked mean log-ratio, ``rho_i = exp(mean_t(logp - old_logp))``,
    shape ``[N, 1]`` so it broadcasts over tokens.
    """
    log_ratio = logps - old_logps  # [N, T]
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        mask = completion_mask.to(log_ratio.dtype)
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [N]
        return torch.exp(seq_log_ratio).unsqueeze(-1)  # [N, 1]
    raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")


def clipped_surrogate_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017), per token, as a loss to minimise.

    ``l = -min(rho * A, clamp(rho, 1 - epsilon_low, 1 + epsilon_high) * A)``. An ``epsilon_high``
    above ``epsilon_low`` is DAPO's "clip-higher" (Yu et al. 2025, arXiv:2503.14476).

    Args:
        ratio: ``[N, T]`` or ``[N, 1]`` importance ratios.
        advantages: ``[N]`` one advantage per completion, broadcast over its tokens.
    Returns:
        per-token loss ``[N, T]`` (``[N, 1]`` for a sequence-level ratio).
    """
    advantages = advantages.unsqueeze(-1)  # [N, 1]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages
    return -torch.min(unclipped, clipped)


@dataclass
class ClipFractions:
    """Fraction of real tokens whose ratio the clip cut off (TRL's ``clip_ratio/*`` metrics)."""

    low: torch.Tensor  # A < 0 and rho < 1 - epsilon_low
    high: torch.Tensor  # A > 0 and rho > 1 + epsilon_high
    region: torch.Tensor  # either of the two


def clip_fractions(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> ClipFractions:
    """Masked fractions of tokens clipped below, above, and in total (see :class:`ClipFractions`)."""
    ratio = ratio.detach().expand_as(completion_mask.to(ratio.dtype))  # [N, T]
    advantages = advantages.unsqueeze(-1)  # [N, 1]
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return ClipFractions(
        low=masked_mean(low.float(), completion_mask),
        high=masked_mean(high.float(), completion_mask),
        region=masked_mean((low | high).float(), completion_mask),
    )


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------------------------
# 4. Loss aggregation: how per-token losses become one scalar (``loss_type``)
# ----------------------------------------------------------------------------------------------

# Every aggregation has the same signature:
#   (per_token_loss [n, T], completion_mask [n, T], max_completion_length, num_items_in_batch) -> []
# where n is the micro-batch and ``num_items_in_batch`` the real completion tokens of the whole
# generation batch (across ranks and micro-batches). Scalars returned here are already scaled so that
# summing the gradients of all micro-batches of an optimizer step gives the gradient of the step:
# the caller divides grpo/bnpo/dr_grpo by the number of micro-batches (``accumulates_by_mean``).
Aggregation = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]
LOSS_AGGREGATIONS: dict[str, Aggregation] = {}


def register_loss_aggregation(name: str) -> Callable[[Aggregation], Aggregation]:
    """Register a ``loss_type`` (decorator). Later issues add their own aggregations here."""

    def decorator(fn: Aggregation) -> Aggregation:
        LOSS_AGGREGATIONS[name] = fn
        return fn

    return decorator


@register_loss_aggregation("grpo")
def grpo_aggregation(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
    """GRPO (Shao et al. 2024): mean over sequences of each sequence's token mean.

    Long completions' tokens weigh less than short ones' (the length bias Dr. GRPO points out).
    """
    mask = completion_mask.to(per_token_loss.dtype)
    per_sequence = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [n]
    return per_sequence.mean()


@register_loss_aggregation("bnpo")
def bnpo_aggregation(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
    """BNPO (Xiao et al. 2025, arXiv:2506.02864): token mean over the whole micro-batch."""
    mask = completion_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


@register_loss_aggregation("dr_grpo")
def dr_grpo_aggregation(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): sum over tokens / (sequences * max length).

    A constant normaliser, so no length bias.
    """
    mask = completion_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)


@register_loss_aggregation("dapo")
def dapo_aggregation(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
    """DAPO (Yu et al. 2025, arXiv:2503.14476): token-level sum / real tokens of the generation batch.

    The normaliser counts every real completion token of the whole generation batch (all
    micro-batches, all ranks), so splitting the batch into micro-batches or ranks does not change
    the summed gradient.
    """
    mask = completion_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / max(float(num_items_in_batch), 1.0)


# For these loss types the micro-batch losses are means, so gradient accumulation over m
# micro-batches divides each by m (as Hugging Face's Trainer and TRL do). dapo's normaliser is
# already global.
ACCUMULATES_BY_MEAN = {"grpo", "bnpo", "dr_grpo"}


def aggregate_loss(
    per_token_loss: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int,
    num_items_in_batch: float | None = None,
) -> torch.Tensor:
    """Reduce a micro-batch's ``[n, T]`` per-token loss to a scalar according to ``loss_type``."""
    if loss_type not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_AGGREGATIONS)}, got {loss_type!r}")
    if num_items_in_batch is None:
        num_items_in_batch = float(completion_mask.sum())
    per_token_loss = per_token_loss.expand(completion_mask.shape)
    return LOSS_AGGREGATIONS[loss_type](
        per_token_loss, completion_mask, max_completion_length, num_items_in_batch
    )


# ----------------------------------------------------------------------------------------------
# 5. The whole GRPO objective for one micro-batch
# ----------------------------------------------------------------------------------------------


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor  # [] the micro-batch loss to backpropagate
    kl: torch.Tensor | None  # [] masked mean per-token KL, None when beta == 0
    clip: ClipFractions


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int,
    num_items_in_batch: float | None = None,
) -> PolicyLossOutput:
    """GRPO loss of one micro-batch.

    ``l[i, t] = -min(rho * A_i, clip(rho) * A_i) + beta * kl_k3[i, t]``, aggregated by ``loss_type``.

    Args:
        logps: ``[n, T]`` log-probs of the completion tokens under the current policy (with grad).
        old_logps: ``[n, T]`` log-probs under the policy that sampled (no grad).
        advantages: ``[n]`` group-relative advantages.
        completion_mask: ``[n, T]`` 1 on tokens that count (see ``mask_truncated_completions``).
        ref_logps: ``[n, T]`` reference-model log-probs, required when ``beta > 0``.
    """
    ratio = importance_ratio(logps, old_logps, completion_mask, importance_sampling_level)
    per_token_loss = clipped_surrogate_loss(ratio, advantages, epsilon_low, epsilon_high)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        per_token_kl = k3_kl(logps, ref_logps)  # [n, T]
        per_token_loss = per_token_loss + beta * per_token_kl
        kl = masked_mean(per_token_kl.detach(), completion_mask)
    loss = aggregate_loss(
        per_token_loss,
        completion_mask,
        loss_type,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )
    clip = clip_fractions(ratio, advantages, completion_mask, epsilon_low, epsilon_high)
    return PolicyLossOutput(loss=loss, kl=kl, clip=clip)
