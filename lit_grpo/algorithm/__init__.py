"""The GRPO algorithm as pure tensor functions: no Lightning, no transformers, no I/O.

GRPO (Group Relative Policy Optimization; Shao et al. 2024, "DeepSeekMath: Pushing the Limits of
Mathematical Reasoning in Open Language Models", arXiv:2402.03300) is PPO without a critic: for each
prompt the policy samples a *group* of G completions, and a completion's advantage is its reward
relative to the other members of its group. The update is PPO's clipped surrogate against the policy
that sampled, optionally with a KL penalty to a frozen reference model.

Everything here follows TRL 1.16's ``GRPOTrainer`` semantics (``trl/trainer/grpo_trainer.py``), so
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


LOGPROB_CHUNK_ELEMENTS = 2**22  # float32 elements of one chunk's temporaries: 16 MiB


def rows_per_logprob_chunk(logits: torch.Tensor, rows_per_chunk: int | None = None) -> int:
    """How many rows of ``logits [B, T, V]`` one chunk of :func:`selective_log_softmax` and
    :func:`entropy_from_logits` takes: ``rows_per_chunk`` if given, else as many rows as fit in
    :data:`LOGPROB_CHUNK_ELEMENTS` float32 elements, and at least one. A real vocabulary fills the
    budget with one row (128 x 32k is already 4M elements); a small one would otherwise pay a few
    operator calls per row for tiny tensors (64 rows of 32 x 101 logits: 12 ms per forward and
    backward row by row, 2.6 ms in one chunk)."""
    if rows_per_chunk is not None:
        return rows_per_chunk
    return max(1, LOGPROB_CHUNK_ELEMENTS // max(1, logits.size(1) * logits.size(2)))


def selective_log_softmax(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, rows_per_chunk: int | None = None
) -> torch.Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``.

    ``logp[i, t] = logits[i, t, tok] / temp - logsumexp(logits[i, t, :] / temp)``

    Equal to ``log_softmax(logits / temperature).gather(-1, tokens)`` but never materialises a
    float32 log-softmax larger than one chunk: rows are processed ``rows_per_chunk`` at a time
    (default: :func:`rows_per_logprob_chunk`), so the largest temporary is ``[rows_per_chunk, T, V]``.

    Args:
        logits: ``[B, T, V]`` logits whose position ``t`` predicts ``tokens[:, t]`` (already shifted).
        tokens: ``[B, T]`` token ids.
        temperature: sampling temperature the tokens were drawn with.
    Returns:
        ``[B, T]`` float32 log-probabilities.
    """
    rows_per_chunk = rows_per_logprob_chunk(logits, rows_per_chunk)
    logps = []
    for start in range(0, logits.size(0), rows_per_chunk):
        chunk = logits[start : start + rows_per_chunk].float() / temperature  # [b, T, V]
        chunk_tokens = tokens[start : start + rows_per_chunk].unsqueeze(-1)  # [b, T, 1]
        token_logits = chunk.gather(-1, chunk_tokens).squeeze(-1)  # [b, T]
        logps.append(token_logits - torch.logsumexp(chunk, dim=-1))
    return torch.cat(logps, dim=0)


@torch.no_grad()
def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, rows_per_chunk: int | None = None
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position, ``[B, T, V] -> [B, T]`` float32.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` with ``z = logits / temperature``; computed in
    row chunks like :func:`selective_log_softmax`. A metric only, so no gradient.
    """
    rows_per_chunk = rows_per_logprob_chunk(logits, rows_per_chunk)
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


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs, ``[N, T]``.

    Schulman 2020, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html), with
    ``log_r = logp - ref`` on tokens sampled from the policy:

    - ``k1 = log_r``: unbiased, high variance, can be negative;
    - ``k2 = log_r ** 2 / 2``: biased, low variance, non-negative (its gradient is that of a
      reverse-KL penalty on the sampled tokens);
    - ``k3 = exp(-log_r) + log_r - 1``: unbiased, low variance, non-negative (GRPO's choice; :func:`k3_kl`).
    """
    if estimator == "k1":
        return logps - ref_logps
    if estimator == "k2":
        return 0.5 * (logps - ref_logps) ** 2
    if estimator == "k3":
        return k3_kl(logps, ref_logps)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


KL_ESTIMATORS = ("k1", "k2", "k3")

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
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017), per token, as a loss to minimise.

    ``l = -min(rho * A, clamp(rho, 1 - epsilon_low, 1 + epsilon_high) * A)``. An ``epsilon_high``
    above ``epsilon_low`` is DAPO's "clip-higher" (Yu et al. 2025, arXiv:2503.14476).

    ``delta`` (two-sided clipping; INTELLECT-2, Prime Intellect 2025, arXiv:2505.07291): the
    unclipped term uses ``min(rho, delta)``, so a token with ``A < 0`` and a huge ratio, which
    PPO's ``min`` leaves unbounded, contributes at most ``delta * |A|``. ``delta > 1 + epsilon_high``.

    Args:
        ratio: ``[N, T]`` or ``[N, 1]`` importance ratios.
        advantages: ``[N]`` one advantage per completion, broadcast over its tokens.
    Returns:
        per-token loss ``[N, T]`` (``[N, 1]`` for a sequence-level ratio).
    """
    advantages = advantages.unsqueeze(-1)  # [N, 1]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    unclipped = ratio * advantages
    return -torch.min(unclipped, clipped)


def cispo_loss(ratio: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor, epsilon_max: float) -> torch.Tensor:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585), per token, as a loss to minimise.

    ``l = -sg(min(rho, epsilon_max)) * A * logp``: the importance weight is clipped and detached
    (stop-gradient), and every token keeps a REINFORCE gradient ``A * grad logp`` scaled by it, so no
    token is dropped by clipping as in PPO. ``epsilon_max`` is ``model.epsilon_high`` used as an
    absolute bound, as in TRL (ScaleRL recommends 5.0).
    """
    weight = torch.clamp(ratio, max=epsilon_max).detach()  # [N, T] or [N, 1]
    return -weight * advantages.unsqueeze(-1) * logps


def sapo_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float, temperature_neg: float
) -> torch.Tensor:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347), per token.

    A smooth gate instead of the hard clip: ``l = -(4 / tau) * sigmoid(tau * (rho - 1)) * A``, with
    ``tau = temperature_pos`` for ``A > 0`` and ``temperature_neg`` otherwise. At ``rho = 1`` the
    gradient equals the unclipped ``A * grad rho`` (``sigmoid' (0) = 1/4``); it fades smoothly as the
    ratio moves away from 1, faster for negative advantages when ``temperature_neg > temperature_pos``.
    """
    advantages = advantages.unsqueeze(-1)  # [N, 1]
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg)  # [N, 1]
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * advantages


def high_entropy_mask(
    entropy: torch.Tensor, completion_mask: torch.Tensor, top_quantile: float, reference_entropies: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens among the ``top_quantile`` fraction of highest entropy (Wang et al. 2025, "Beyond the
    80/20 Rule: High-Entropy Minority Tokens Drive Effective RL", arXiv:2506.01939), ``[n, T]`` bool.

    The threshold is the ``1 - top_quantile`` quantile of ``reference_entropies`` (the real tokens'
    entropies over which the fraction is taken, e.g. gathered from every rank), by default the real
    tokens of ``entropy``. ``top_quantile = 1`` keeps every real token.
    """
    real = completion_mask.bool()
    if reference_entropies is None:
        reference_entropies = entropy[real]
    if top_quantile >= 1.0 or reference_entropies.numel() == 0:
        return real
    threshold = torch.quantile(reference_entropies.detach().float(), 1.0 - top_quantile)
    return real & (entropy.detach() >= threshold)


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
# 4. Loss types: the per-token objective and how per-token losses become one scalar
# ----------------------------------------------------------------------------------------------

# A ``loss_type`` is two choices: the per-token policy objective (PPO's clipped surrogate, CISPO or
# SAPO) and the aggregation that turns a micro-batch's per-token losses into one scalar. Every
# aggregation has the same signature:
#   (per_token_loss [n, T], completion_mask [n, T], max_completion_length, num_items_in_batch) -> []
# where n is the micro-batch and ``num_items_in_batch`` the real completion tokens of the whole
# generation batch (across ranks and micro-batches), divided, as TRL 1.16 does, by the number of
# optimizer steps that share the batch (``steps_per_generation``). For aggregations that are means over the
# micro-batch (``accumulates_by_mean``) the caller divides by the number of micro-batches of an
# optimizer step, as Hugging Face's Trainer and TRL do; a global normaliser (dapo) needs no division.
# Every built-in loss is a sum of per-row terms whose normalisers depend only on the masks
# (``rows_independent``): a row's gradient does not depend on the other rows' log-probs, so a
# micro-batch may go forward and backward in chunks of rows (``lit_grpo.train.logprob_passes.LogProbEngine.micro_batch_backward``).
Aggregation = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]


@dataclass(frozen=True)
class PolicyLossSettings:
    """The knobs of the per-token policy objectives (``model.*`` keys of the same names)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None  # two-sided clip of the PPO objective
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05


Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossSettings], torch.Tensor]


def ppo_objective(ratio, advantages, logps, settings: PolicyLossSettings) -> torch.Tensor:
    """:func:`clipped_surrogate_loss` (with ``delta``), the objective of grpo/bnpo/dr_grpo/dapo."""
    return clipped_surrogate_loss(ratio, advantages, settings.epsilon_low, settings.epsilon_high, settings.delta)


def cispo_objective(ratio, advantages, logps, settings: PolicyLossSettings) -> torch.Tensor:
    """:func:`cispo_loss` with ``epsilon_high`` as the bound of the importance weight."""
    return cispo_loss(ratio, advantages, logps, settings.epsilon_high)


def sapo_objective(ratio, advantages, logps, settings: PolicyLossSettings) -> torch.Tensor:
    """:func:`sapo_loss` with ``sapo_temperature_pos`` / ``sapo_temperature_neg``."""
    return sapo_loss(ratio, advantages, settings.sapo_temperature_pos, settings.sapo_temperature_neg)


@dataclass(frozen=True)
class LossType:
    """One ``loss_type``: its per-token objective and its aggregation."""

    aggregate: Aggregation
    objective: Objective = ppo_objective
    accumulates_by_mean: bool = True
    rows_independent: bool = False  # the loss is a sum of per-row terms (normalisers from the masks only)


LOSS_TYPES: dict[str, LossType] = {}


def register_loss_type(
    name: str, objective: Objective = ppo_objective, accumulates_by_mean: bool = True, rows_independent: bool = False
) -> Callable[[Aggregation], Aggregation]:
    """Register a ``loss_type`` by its aggregation (decorator), with its per-token objective.
    ``rows_independent``: say so only if the loss is a sum of per-row terms whose weights depend on
    the masks alone (then micro-batches may be trained in chunks of rows)."""

    def decorator(fn: Aggregation) -> Aggregation:
        LOSS_TYPES[name] = LossType(
            aggregate=fn, objective=objective, accumulates_by_mean=accumulates_by_mean, rows_independent=rows_independent
        )
        return fn

    return decorator


@register_loss_type("grpo", rows_independent=True)
def grpo_aggregation(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
    """GRPO (Shao et al. 2024): mean over sequences of each sequence's token mean.

    Long completions' tokens weigh less than short ones' (the length bias Dr. GRPO points out).
    """
    mask = completion_mask.to(per_token_loss.dtype)
    per_sequence = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [n]
    return per_sequence.mean()


@register_loss_type("bnpo", rows_independent=True)
def bnpo_aggregation(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
    """BNPO (Xiao et al. 2025, arXiv:2506.02864): token mean over the whole micro-batch."""
    mask = completion_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


@register_loss_type("dr_grpo", rows_independent=True)
def dr_grpo_aggregation(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): sum over tokens / (sequences * max length).

    A constant normaliser, so no length bias.
    """
    mask = completion_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)


def dapo_normaliser(real_tokens: float, world_size: int, steps_per_generation: int) -> float:
    """``num_items_in_batch`` of the dapo/cispo aggregation, as TRL 1.16 computes it: the real
    completion tokens of the generation batch over all ranks, clamped to at least 1, divided by the
    world size (each rank's gradient is averaged) and by the optimizer steps that share the batch."""
    return max(float(real_tokens), 1.0) / max(world_size, 1) / steps_per_generation


@register_loss_type("dapo", accumulates_by_mean=False, rows_independent=True)
def dapo_aggregation(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
    """DAPO (Yu et al. 2025, arXiv:2503.14476): token-level sum / real tokens of the generation batch.

    The normaliser counts every real completion token of the whole generation batch (all
    micro-batches, all ranks), so splitting the batch into micro-batches or ranks does not change
    the summed gradient. As in TRL 1.16 the caller passes ``max(count, 1) / (world size x S)`` when
    S optimizer steps share the batch (each rank's gradient is averaged, and each step's gradient
    is then about the token mean over its own rows).
    """
    mask = completion_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum() / (float(num_items_in_batch) or 1.0)


# CISPO aggregates like DAPO (token sum over the generation batch's tokens), SAPO like GRPO
# (sequence means), as in their papers and in TRL.
LOSS_TYPES["cispo"] = LossType(dapo_aggregation, cispo_objective, accumulates_by_mean=False, rows_independent=True)
LOSS_TYPES["sapo"] = LossType(grpo_aggregation, sapo_objective, accumulates_by_mean=True, rows_independent=True)


# Objectives whose per-token loss is the advantage times a finite factor, and aggregations that
# multiply every token's loss by its mask: see :func:`rows_without_gradient`.
ADVANTAGE_PROPORTIONAL_OBJECTIVES = (ppo_objective, cispo_objective, sapo_objective)
MASKED_AGGREGATIONS = (grpo_aggregation, bnpo_aggregation, dr_grpo_aggregation, dapo_aggregation)


def rows_without_gradient(
    advantages: torch.Tensor, loss_mask: torch.Tensor, loss_type: str, beta: float
) -> torch.Tensor:
    """``[n]`` bool: rows whose terms of the loss have exactly zero gradient, so their backward pass
    can be skipped without changing the update.

    - With ``beta = 0``, a row whose advantage is exactly 0 (a group with equal rewards, or a row with
      no reward; see :func:`group_advantages`) under PPO's clipped surrogate, CISPO or SAPO: each
      token's loss is ``A`` times a finite factor, so its value and gradient are 0. With ``beta > 0``
      the KL term still pulls such a row towards the reference.
    - A row with no token that counts (``loss_mask`` all 0, e.g. a truncated completion under
      ``mask_truncated_completions``) under a built-in aggregation: every token's loss, KL included,
      is multiplied by its mask.

    Only for losses that are sums of per-row terms (``rows_independent``); the normalisers come from
    the masks, so leaving these rows out of the backward leaves every other row's gradient as it is.
    A registered objective or aggregation is never assumed to have this property.
    """
    loss = LOSS_TYPES[loss_type]
    inert = torch.zeros(advantages.shape, dtype=torch.bool, device=advantages.device)  # [n]
    if not loss.rows_independent:
        return inert
    if loss.aggregate in MASKED_AGGREGATIONS:
        inert |= ~loss_mask.bool().any(dim=-1)
    if beta == 0.0 and loss.objective in ADVANTAGE_PROPORTIONAL_OBJECTIVES:
        inert |= advantages == 0
    return inert


def aggregate_loss(
    per_token_loss: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int,
    num_items_in_batch: float | None = None,
) -> torch.Tensor:
    """Reduce a micro-batch's ``[n, T]`` per-token loss to a scalar according to ``loss_type``."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_TYPES)}, got {loss_type!r}")
    if num_items_in_batch is None:
        num_items_in_batch = max(float(completion_mask.sum()), 1.0)
    per_token_loss = per_token_loss.expand(completion_mask.shape)
    return LOSS_TYPES[loss_type].aggregate(per_token_loss, completion_mask, max_completion_length, num_items_in_batch)


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
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    kl_estimator: str = "k3",
    use_bias_correction_kl: bool = True,
    policy_mask: torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GRPO loss of one micro-batch.

    ``l[i, t] = objective(rho, A_i, logp)[i, t] * policy_mask[i, t] + beta * kl[i, t]``, aggregated
    by ``loss_type`` over ``completion_mask``; the objective is PPO's clipped surrogate
    ``-min(rho * A_i, clip(rho) * A_i)`` for grpo/bnpo/dr_grpo/dapo, CISPO's or SAPO's for those.

    Args:
        logps: ``[n, T]`` log-probs of the completion tokens under the current policy (with grad).
        old_logps: ``[n, T]`` log-probs under the policy that sampled (no grad).
        advantages: ``[n]`` group-relative advantages.
        completion_mask: ``[n, T]`` 1 on tokens that count (see ``mask_truncated_completions``).
        ref_logps: ``[n, T]`` reference-model log-probs, required when ``beta > 0``.
        policy_mask: ``[n, T]`` tokens whose policy term is trained (e.g. :func:`high_entropy_mask`);
            the KL term and the normalisers still cover every real token. None trains all.
        sampling_weights: ``[n, T]`` or ``[n, 1]`` weights of each token's policy term for a sampling
            engine other than the trainer (:func:`lit_grpo.algorithm.sampling_correction.sampling_correction`);
            the KL term is not weighted.
        use_bias_correction_kl: multiply the per-token KL by the (unclipped, differentiable)
            importance ratio ``rho`` (DeepSeek-V3.2, arXiv:2512.02556; TRL 1.16's default), which makes
            its gradient the unbiased reverse-KL gradient; on-policy (``rho = 1``) the k3 term's
            gradient becomes ``beta * (logp - ref)``. With ``importance_sampling_level: sequence``
            the sequence's ratio multiplies each of its tokens' KL, as in TRL.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_TYPES)}, got {loss_type!r}")
    settings = PolicyLossSettings(epsilon_low, epsilon_high, delta, sapo_temperature_pos, sapo_temperature_neg)
    ratio = importance_ratio(logps, old_logps, completion_mask, importance_sampling_level)
    per_token_loss = LOSS_TYPES[loss_type].objective(ratio, advantages, logps, settings)
    if policy_mask is not None:
        per_token_loss = per_token_loss * policy_mask.to(per_token_loss.dtype)
    if sampling_weights is not None:
        per_token_loss = per_token_loss * sampling_weights
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        per_token_kl = kl_estimate(logps, ref_logps, kl_estimator)  # [n, T]
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio  # [n, T] (a sequence ratio [n, 1] broadcasts)
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
