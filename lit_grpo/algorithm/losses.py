"""Loss types (a per-token objective and an aggregation, in the registry :data:`LOSS_TYPES`) and
:func:`grpo_loss`, the whole GRPO objective of one micro-batch.

As in prime-rl, the loss takes two records: :class:`LossInputs` (the micro-batch's tensors) and
:class:`lit_grpo.settings.LossSettings` (the run's loss settings, built once, TRL 1.16's newer
options in its :class:`~lit_grpo.settings.LossOptions`). Shapes: ``n`` rows of the micro-batch,
``T`` completion length (padded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lit_grpo.algorithm.sampling_correction import off_policy_sequence_mask
from lit_grpo.algorithm.token_terms import (
    ClipFractions,
    cispo_loss,
    clip_fractions,
    clipped_surrogate_loss,
    importance_ratio,
    kl_estimate,
    masked_mean,
    sapo_loss,
    vespo_gamma_weights,
    vespo_loss,
)
from lit_grpo.settings import LossOptions, LossSettings

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
# micro-batch may go forward and backward in chunks of rows (``lit_grpo.train.logprob_passes.LogProbPasses.micro_batch_backward``).
Aggregation = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]


# (ratio [n, T] or [n, 1], advantages [n], logps [n, T], settings) -> per-token loss [n, T] (or [n, 1])
Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossSettings], torch.Tensor]


# An objective that reads more than the ratio (``reads_inputs``): (inputs, settings, options) -> per-token
# loss [n, T]. grpo_loss still multiplies its loss by ``inputs.sampling_weights`` unless the loss type
# says the objective folds them in itself (``folds_sampling_weights``, as vespo does).
InputsObjective = Callable[["LossInputs", LossSettings, LossOptions], torch.Tensor]

# A loss type's own metrics of one micro-batch (TRL's names), beside the loss:
# (inputs, settings, options) -> {name: [] value}; computed without gradient.
LossMetrics = Callable[["LossInputs", LossSettings, LossOptions], dict[str, torch.Tensor]]


def ppo_objective(ratio, advantages, logps, settings: LossSettings) -> torch.Tensor:
    """:func:`clipped_surrogate_loss` (with ``delta``), the objective of grpo/bnpo/dr_grpo/dapo."""
    return clipped_surrogate_loss(ratio, advantages, settings.epsilon_low, settings.epsilon_high, settings.delta)


def cispo_objective(ratio, advantages, logps, settings: LossSettings) -> torch.Tensor:
    """:func:`cispo_loss` with ``epsilon_high`` as the bound of the importance weight."""
    return cispo_loss(ratio, advantages, logps, settings.epsilon_high)


def sapo_objective(ratio, advantages, logps, settings: LossSettings) -> torch.Tensor:
    """:func:`sapo_loss` with ``sapo_temperature_pos`` / ``sapo_temperature_neg``."""
    return sapo_loss(ratio, advantages, settings.sapo_temperature_pos, settings.sapo_temperature_neg)


def vespo_sequence_weights(inputs: LossInputs, options: LossOptions) -> torch.Tensor:
    """VESPO's ``phi`` ``[n, 1]`` (no gradient): :func:`vespo_gamma_weights` of the token log-ratios
    ``logp - old_logp`` (whatever ``importance_sampling_level``; TRL warns unless it is ``token``)
    and of a token-level ``sampling_weights`` (another engine's correction, folded into the weight
    instead of multiplying the loss, as in TRL), with ``options``' ``vespo_*``."""
    return vespo_gamma_weights(
        inputs.advantages,
        inputs.logps.detach() - inputs.old_logps,
        inputs.completion_mask,
        inputs.sampling_weights,
        k_pos=options.vespo_k_pos,
        lambda_pos=options.vespo_lambda_pos,
        k_neg=options.vespo_k_neg,
        lambda_neg=options.vespo_lambda_neg,
    )


def vespo_objective(inputs: LossInputs, settings: LossSettings, options: LossOptions) -> torch.Tensor:
    """:func:`vespo_loss` weighted by :func:`vespo_sequence_weights`."""
    return vespo_loss(vespo_sequence_weights(inputs, options), inputs.advantages, inputs.logps)  # [n, T]


def vespo_metrics(inputs: LossInputs, settings: LossSettings, options: LossOptions) -> dict[str, torch.Tensor]:
    """TRL 1.16's ``vespo/phi_seq_mean``: the mean ``phi`` over the micro-batch's rows, every row
    counted (TRL's ``global_masked_mean`` of a ``(B, 1)`` tensor; a row with no real token has
    ``phi = 1``)."""
    return {"vespo/phi_seq_mean": vespo_sequence_weights(inputs, options).mean()}


@dataclass(frozen=True)
class LossType:
    """One ``loss_type``: its per-token objective and its aggregation."""

    aggregate: Aggregation
    objective: Objective | InputsObjective = ppo_objective
    accumulates_by_mean: bool = True
    rows_independent: bool = False  # the loss is a sum of per-row terms (normalisers from the masks only)
    reads_inputs: bool = False  # ``objective`` is an :data:`InputsObjective`
    folds_sampling_weights: bool = False  # the objective applies ``sampling_weights`` itself: grpo_loss does not
    metrics: LossMetrics | None = None  # the loss type's own metrics (TRL's names), beside the loss
    clips_ratio: bool = True  # the ratio's clip fractions (``clip_ratio/*``) mean something for it


LOSS_TYPES: dict[str, LossType] = {}


def register_loss_type(
    name: str,
    objective: Objective | InputsObjective = ppo_objective,
    accumulates_by_mean: bool = True,
    rows_independent: bool = False,
    reads_inputs: bool = False,
    folds_sampling_weights: bool = False,
    metrics: LossMetrics | None = None,
    clips_ratio: bool = True,
) -> Callable[[Aggregation], Aggregation]:
    """Register a ``loss_type`` by its aggregation (decorator), with its per-token objective.
    ``rows_independent``: say so only if the loss is a sum of per-row terms whose weights depend on
    the masks alone (then micro-batches may be trained in chunks of rows). ``reads_inputs``: the
    objective is an :data:`InputsObjective` (it reads the whole :class:`LossInputs`).
    ``folds_sampling_weights`` (with ``reads_inputs``): the objective applies the engine correction's
    ``inputs.sampling_weights`` itself, so :func:`grpo_loss` does not multiply its loss by them;
    otherwise it does, as for every other objective. ``metrics``: the loss type's own metrics of a
    micro-batch (:data:`LossMetrics`, in :attr:`PolicyLossOutput.metrics`); ``clips_ratio=False``: the
    ratio's clip fractions mean nothing for this objective (:attr:`PolicyLossOutput.clip` is None)."""
    if folds_sampling_weights and not reads_inputs:
        raise ValueError(f"loss_type {name!r}: folds_sampling_weights needs reads_inputs (an InputsObjective)")

    def decorator(fn: Aggregation) -> Aggregation:
        LOSS_TYPES[name] = LossType(
            aggregate=fn,
            objective=objective,
            accumulates_by_mean=accumulates_by_mean,
            rows_independent=rows_independent,
            reads_inputs=reads_inputs,
            folds_sampling_weights=folds_sampling_weights,
            metrics=metrics,
            clips_ratio=clips_ratio,
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


@register_loss_type("luspo", rows_independent=True)
def luspo_aggregation(per_token_loss, completion_mask, max_completion_length, num_items_in_batch):
    """LUSPO ("Length-Unbiased Sequence Policy Optimization", arXiv:2602.05261): mean over sequences
    of each sequence's token *sum*, so a sequence weighs by its length (GSPO's sequence mean has a
    length bias); with ``importance_sampling_level: sequence`` (TRL warns otherwise) each token of a
    sequence carries the sequence's loss. As TRL 1.16: ``(per_token_loss * mask).sum(-1).mean()``."""
    mask = completion_mask.to(per_token_loss.dtype)
    return (per_token_loss * mask).sum(-1).mean()


# CISPO aggregates like DAPO (token sum over the generation batch's tokens), SAPO like GRPO
# (sequence means), as in their papers and in TRL; VESPO like DAPO, as in TRL, which logs its mean
# sequence weight instead of clip fractions (VESPO clips no ratio).
LOSS_TYPES["cispo"] = LossType(dapo_aggregation, cispo_objective, accumulates_by_mean=False, rows_independent=True)
LOSS_TYPES["sapo"] = LossType(grpo_aggregation, sapo_objective, accumulates_by_mean=True, rows_independent=True)
register_loss_type(
    "vespo", vespo_objective, accumulates_by_mean=False, rows_independent=True, reads_inputs=True,
    folds_sampling_weights=True, metrics=vespo_metrics, clips_ratio=False,
)(dapo_aggregation)


# Objectives whose per-token loss is the advantage times a finite factor, and aggregations that
# multiply every token's loss by its mask: see :func:`rows_without_gradient`.
ADVANTAGE_PROPORTIONAL_OBJECTIVES = (ppo_objective, cispo_objective, sapo_objective, vespo_objective)
MASKED_AGGREGATIONS = (grpo_aggregation, bnpo_aggregation, dr_grpo_aggregation, dapo_aggregation, luspo_aggregation)


def rows_without_gradient(
    advantages: torch.Tensor, loss_mask: torch.Tensor, loss_type: str, beta: float, entropy_bonus: bool = False
) -> torch.Tensor:
    """``[n]`` bool: rows whose terms of the loss have exactly zero gradient, so their backward pass
    can be skipped without changing the update.

    - With ``beta = 0`` and no ``entropy_bonus``, a row whose advantage is exactly 0 (a group with
      equal rewards, or a row with no reward; see :func:`group_advantages`) under PPO's clipped
      surrogate, CISPO or SAPO: each token's loss is ``A`` times a finite factor, so its value and
      gradient are 0. With ``beta > 0`` the KL term still pulls such a row towards the reference, and
      with the entropy bonus (:func:`lit_grpo.algorithm.entropy_bonus_loss`) its entropy still moves.
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
    if beta == 0.0 and not entropy_bonus and loss.objective in ADVANTAGE_PROPORTIONAL_OBJECTIVES:
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
# The whole GRPO objective for one micro-batch
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossInputs:
    """The tensors of one micro-batch that :func:`grpo_loss` reads."""

    logps: torch.Tensor  # [n, T] log-probs of the completion tokens under the current policy (with grad)
    old_logps: torch.Tensor  # [n, T] log-probs under the policy that sampled (no grad)
    advantages: torch.Tensor  # [n] group-relative advantages
    completion_mask: torch.Tensor  # [n, T] 1 on tokens that count (see ``mask_truncated_completions``)
    ref_logps: torch.Tensor | None = None  # [n, T] reference-model log-probs, required when beta > 0
    # the dapo/cispo normaliser (:func:`dapo_normaliser`); None: this micro-batch's real tokens
    num_items_in_batch: float | None = None
    # [n, T] tokens whose policy term is trained (e.g. :func:`high_entropy_mask`); the KL term and the
    # normalisers still cover every real token. None trains all.
    policy_mask: torch.Tensor | None = None
    # [n, T] or [n, 1] weights of each token's policy term for a sampling engine other than the trainer
    # (:func:`lit_grpo.algorithm.sampling_correction.sampling_correction`); the KL term is not weighted.
    sampling_weights: torch.Tensor | None = None
    # [n, T] the log-probs of the policy that sampled, where they differ from ``old_logps`` (another
    # engine's): what ``off_policy_mask_threshold`` measures the KL to. None: ``old_logps``.
    sampling_logps: torch.Tensor | None = None


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor  # [] the micro-batch loss to backpropagate
    kl: torch.Tensor | None  # [] masked mean per-token KL, None when beta == 0
    clip: ClipFractions | None  # None for a loss type that clips no ratio (``LossType.clips_ratio``)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # the loss type's own ([] each, TRL's names)


def policy_term(inputs: LossInputs, settings: LossSettings, options: LossOptions, ratio: torch.Tensor) -> torch.Tensor:
    """The per-token policy loss ``[n, T]`` (or ``[n, 1]``) of :func:`grpo_loss` before the KL term:
    the loss type's objective, times ``policy_mask``, DeepSeek-V3.2's off-policy sequence mask
    (``options.off_policy_mask_threshold``) and ``sampling_weights`` (unless the objective folds them in)."""
    loss_type = LOSS_TYPES[settings.loss_type]
    if loss_type.reads_inputs:
        per_token_loss = loss_type.objective(inputs, settings, options)
    else:
        per_token_loss = loss_type.objective(ratio, inputs.advantages, inputs.logps, settings)
    if options.off_policy_mask_threshold is not None:
        sampling_logps = inputs.old_logps if inputs.sampling_logps is None else inputs.sampling_logps
        keep = off_policy_sequence_mask(
            inputs.advantages, inputs.logps, sampling_logps, inputs.completion_mask, options.off_policy_mask_threshold
        )  # [n, 1]
        per_token_loss = per_token_loss * keep
    if inputs.policy_mask is not None:
        per_token_loss = per_token_loss * inputs.policy_mask.to(per_token_loss.dtype)
    if inputs.sampling_weights is not None and not loss_type.folds_sampling_weights:
        per_token_loss = per_token_loss * inputs.sampling_weights
    return per_token_loss


def grpo_loss(inputs: LossInputs, settings: LossSettings, options: LossOptions | None = None) -> PolicyLossOutput:
    """GRPO loss of one micro-batch.

    ``l[i, t] = objective(rho, A_i, logp)[i, t] * policy_mask[i, t] + beta * kl[i, t]``, aggregated
    by ``loss_type`` over ``completion_mask``; the objective is PPO's clipped surrogate
    ``-min(rho * A_i, clip(rho) * A_i)`` for grpo/bnpo/dr_grpo/dapo/luspo, CISPO's, SAPO's or
    VESPO's for those (:func:`policy_term`, with the off-policy mask of ``settings.options``;
    ``options``, where given, in their place).

    ``use_bias_correction_kl`` multiplies the per-token KL by the (unclipped, differentiable)
    importance ratio ``rho`` (DeepSeek-V3.2, arXiv:2512.02556; TRL 1.16's default), which makes its
    gradient the unbiased reverse-KL gradient; on-policy (``rho = 1``) the k3 term's gradient becomes
    ``beta * (logp - ref)``. With ``importance_sampling_level: sequence`` the sequence's ratio
    multiplies each of its tokens' KL, as in TRL.
    """
    if settings.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_TYPES)}, got {settings.loss_type!r}")
    options = settings.options if options is None else options
    logps, mask = inputs.logps, inputs.completion_mask
    ratio = importance_ratio(logps, inputs.old_logps, mask, settings.importance_sampling_level)
    per_token_loss = policy_term(inputs, settings, options, ratio)
    kl = None
    if settings.beta != 0.0:
        if inputs.ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        per_token_kl = kl_estimate(logps, inputs.ref_logps, settings.kl_estimator)  # [n, T]
        if settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio  # [n, T] (a sequence ratio [n, 1] broadcasts)
        per_token_loss = per_token_loss + settings.beta * per_token_kl
        kl = masked_mean(per_token_kl.detach(), mask)
    loss = aggregate_loss(
        per_token_loss,
        mask,
        settings.loss_type,
        max_completion_length=settings.max_completion_length,
        num_items_in_batch=inputs.num_items_in_batch,
    )
    loss_type = LOSS_TYPES[settings.loss_type]
    clip = None
    if loss_type.clips_ratio:
        clip = clip_fractions(ratio, inputs.advantages, mask, settings.epsilon_low, settings.epsilon_high)
    metrics = {}
    if loss_type.metrics is not None:
        with torch.no_grad():
            metrics = loss_type.metrics(inputs, settings, options)
    return PolicyLossOutput(loss=loss, kl=kl, clip=clip, metrics=metrics)
