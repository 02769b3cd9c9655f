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

The modules, in the order of a step: :mod:`~lit_grpo.algorithm.token_logprobs` (log-probs, entropy,
the completion mask), :mod:`~lit_grpo.algorithm.advantages` (rewards and the advantage estimators'
registry), :mod:`~lit_grpo.algorithm.token_terms` (KL, importance ratio, per-token objectives, clip
statistics), :mod:`~lit_grpo.algorithm.losses` (the loss types' registry and :func:`grpo_loss`);
beside them :mod:`~lit_grpo.algorithm.sampling_filters`, :mod:`~lit_grpo.algorithm.sampling_correction`,
:mod:`~lit_grpo.algorithm.evaluation` and :mod:`~lit_grpo.algorithm.entropy_control` (the entropy
bonus and its adaptive coefficient). This package re-exports the public names of the first four and
of the last.
"""

from __future__ import annotations

from lit_grpo.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    AdvantageEstimator,
    GroupAdvantages,
    GroupedRewards,
    batch_scaled,
    combine_rewards,
    group_advantages,
    group_scaled,
    multi_objective_advantages,
    nanstd,
    normalize_then_sum,
    register_advantage_estimator,
    register_multi_objective_aggregation,
    sum_then_normalize,
    unscaled,
)
from lit_grpo.algorithm.entropy_control import (
    EntropyCoefficient,
    EntropyControlSettings,
    entropy_bonus_loss,
    entropy_sum_and_count,
    token_entropy,
)
from lit_grpo.algorithm.fused_lm_head import (
    LOGITS_TILE_BYTES,
    fused_token_logprobs,
    sampling_transform,
    tokens_per_tile,
)
from lit_grpo.algorithm.losses import (
    ADVANTAGE_PROPORTIONAL_OBJECTIVES,
    LOSS_TYPES,
    MASKED_AGGREGATIONS,
    Aggregation,
    InputsObjective,
    LossInputs,
    LossMetrics,
    LossOptions,
    LossType,
    Objective,
    PolicyLossOutput,
    aggregate_loss,
    bnpo_aggregation,
    cispo_objective,
    dapo_aggregation,
    dapo_normaliser,
    dr_grpo_aggregation,
    grpo_aggregation,
    grpo_loss,
    luspo_aggregation,
    ppo_objective,
    register_loss_type,
    rows_without_gradient,
    sapo_objective,
    vespo_metrics,
    vespo_objective,
    vespo_sequence_weights,
)
from lit_grpo.algorithm.sampling_correction import off_policy_sequence_mask
from lit_grpo.algorithm.token_logprobs import (
    LOGPROB_CHUNK_ELEMENTS,
    completion_mask_from_ids,
    entropy_from_logits,
    rows_per_logprob_chunk,
    selective_log_softmax,
)
from lit_grpo.algorithm.token_terms import (
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    ClipFractions,
    cispo_loss,
    clip_fractions,
    clipped_surrogate_loss,
    high_entropy_mask,
    importance_ratio,
    k3_kl,
    kl_estimate,
    masked_mean,
    sapo_loss,
    vespo_gamma_weights,
    vespo_loss,
)
from lit_grpo.settings import LossSettings
