"""TRL 1.16's options that lit-grpo lacked (issue 54), the math: ``loss_type: luspo`` and ``vespo``,
``multi_objective_aggregation: normalize_then_sum`` (GDPO), the entropy bonus and adaptive entropy
control, ``off_policy_mask_threshold``.

Two kinds of expected values: worked out by hand in the comments beside the literals, and TRL
1.16's own code (``trl==1.16.0``, ``trl/trainer/grpo_trainer.py``; trl is not installed in CI, so
the lines are copied below, each reference citing its function) run on the same tensors. Most
references are TRL's lines verbatim but for comments; two are not, and say so: ``trl_compute_loss``
is an excerpt of ``_compute_loss`` (one process, one micro-batch, the loss types tested here) and
``trl_adaptive_steps`` / ``trl_adaptive_window`` re-express its adaptive-control block with ``self.*``
as local variables.

The parity on TRL's layouts (ranks, optimizer steps, micro-batches) is in ``test_trl_layouts.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict

from lit_grpo.algorithm import (
    LOSS_TYPES,
    MULTI_OBJECTIVE_AGGREGATIONS,
    EntropyCoefficient,
    EntropyControlSettings,
    LossInputs,
    LossOptions,
    combine_rewards,
    entropy_bonus_loss,
    entropy_sum_and_count,
    group_advantages,
    grpo_loss,
    multi_objective_advantages,
    normalize_then_sum,
    off_policy_sequence_mask,
    register_loss_type,
    rows_without_gradient,
    token_entropy,
    vespo_gamma_weights,
)
from lit_grpo.algorithm.losses import dapo_aggregation
from lit_grpo.algorithm.sampling_filters import SamplingFilters, kept_tokens, sampling_log_softmax
from lit_grpo.config import check_trl_options
from lit_grpo.errors import ConfigError
from lit_grpo.settings import LossSettings

NAN = float("nan")


def close(actual, expected, atol=1e-6, rtol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)


TRL_DEFAULTS = LossOptions()  # vespo (2, 3, 3, 2), no off-policy mask


def loss_and_grad(logps, old_logps, advantages, mask, options=TRL_DEFAULTS, **settings):
    """``grpo_loss``'s value and its gradient with respect to ``logps``, ``options`` in ``LossSettings.options``."""
    logps = logps.clone().requires_grad_(True)
    extra = {key: settings.pop(key) for key in ("ref_logps", "sampling_weights", "sampling_logps", "num_items_in_batch",
                                                "policy_mask") if key in settings}
    settings.setdefault("max_completion_length", logps.size(1))
    out = grpo_loss(LossInputs(logps, old_logps, advantages, mask, **extra), LossSettings(**settings, options=options))
    out.loss.backward()
    return out.loss.detach(), logps.grad


# ----------------------------------------------------------------------------------------------
# TRL 1.16's code, copied (trl/trainer/grpo_trainer.py and trl/trainer/utils.py of trl==1.16.0)
# ----------------------------------------------------------------------------------------------


def trl_get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    """``GRPOTrainer.get_off_policy_mask`` (advantages ``(B, 1)``)."""
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    kl_div = torch.nan_to_num(kl_div, nan=0.0)
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    is_pos_adv = advantages >= 0
    is_low_kl = avg_seq_kl <= off_policy_threshold
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)


@torch.no_grad()
def trl_get_gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio,
                          k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """``GRPOTrainer.get_gamma_weights`` (advantages ``(B, 1)``)."""
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
        seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def trl_compute_loss(per_token_logps, old_per_token_logps, advantages, mask, *, loss_type, importance_sampling_level="token",
                     epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0, ref_per_token_logps=None,
                     use_bias_correction_kl=True, off_policy_mask_threshold=None, sampling_per_token_logps=None,
                     importance_sampling_ratio=None, num_items_in_batch=None, vespo=(2.0, 3.0, 3.0, 2.0),
                     entropy_mask=None, num_processes=1, current_gradient_accumulation_steps=1, steps_per_generation=1):
    """An *excerpt* of ``GRPOTrainer._compute_loss`` in training mode, not verbatim: the policy part
    for luspo, vespo, grpo and dapo only, with ``self.*`` as arguments (``num_processes`` is
    ``self.accelerator.num_processes``; TRL's ``steps_per_generation`` counts *micro-batches* per
    generation batch, lit-grpo's optimizer steps: TRL's = lit-grpo's x ``current_gradient_accumulation_steps``),
    ``entropy_mask`` given (``get_high_entropy_mask``'s), and ``importance_sampling_ratio is not None``
    standing for TRL's ``self.use_vllm and self.vllm_importance_sampling_correction``. One
    micro-batch of one process: a layout of several is :func:`trl_layout`."""
    advantages = advantages.unsqueeze(1)
    if off_policy_mask_threshold is not None:
        sampling = old_per_token_logps if sampling_per_token_logps is None else sampling_per_token_logps
        off_policy_mask = trl_get_off_policy_mask(advantages, per_token_logps, sampling, mask, off_policy_mask_threshold)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "vespo":
        k_pos, lambda_pos, k_neg, lambda_neg = vespo
        phi_seq = trl_get_gamma_weights(advantages, log_ratio, mask, importance_sampling_ratio,
                                        k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg)
        per_token_loss = -phi_seq * advantages * per_token_logps
    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_sampling_ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        normalizer = current_gradient_accumulation_steps
        return loss / normalizer
    if loss_type in ["cispo", "dapo", "vespo"]:
        normalizer = torch.as_tensor(num_items_in_batch).clamp(min=1.0) / num_processes
        normalizer = normalizer * current_gradient_accumulation_steps / steps_per_generation
        return (per_token_loss * mask).sum() / normalizer
    if loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
        normalizer = current_gradient_accumulation_steps
        return loss / normalizer
    raise ValueError(loss_type)


def trl_nanstd(tensor, dim=None, keepdim=False):
    """``trl.trainer.utils.nanstd``."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction
    std = torch.sqrt(variance)
    if keepdim:
        return std
    return std.squeeze(dim) if dim is not None else std.squeeze()


def trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations):
    """``GRPOTrainer._generate_and_score_completions``, ``multi_objective_aggregation ==
    "normalize_then_sum"`` (with the unscorable rows and the final ``nan_to_num``)."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, rewards_per_func.size(1))
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def random_batch(seed, n=6, T=7):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, T, generator=generator) * 3  # [n, T]
    old_logps = logps + 0.3 * torch.randn(n, T, generator=generator)
    ref_logps = logps + 0.3 * torch.randn(n, T, generator=generator)
    advantages = torch.randn(n, generator=generator)
    lengths = torch.randint(1, T + 1, (n,), generator=generator)
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()
    mask[0] = 0.0  # a row with no token that counts
    advantages[1] = 0.0  # a group with equal rewards
    return logps, old_logps, ref_logps, advantages, mask


# ----------------------------------------------------------------------------------------------
# 1. loss_type: luspo
# ----------------------------------------------------------------------------------------------


def test_luspo_registered_as_a_user_would():
    assert LOSS_TYPES["luspo"].accumulates_by_mean and LOSS_TYPES["luspo"].rows_independent


def test_luspo_hand_value_and_gradient_on_policy():
    # on-policy (rho = 1): PPO's per-token loss is -A; luspo sums each sequence's tokens, then
    # averages the sequences: row 0 (3 tokens, A = 1) -3, row 1 (1 token, A = -2) +2 -> (-3 + 2) / 2
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -0.1, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages = torch.tensor([1.0, -2.0])
    for level in ("token", "sequence"):
        loss, grad = loss_and_grad(logps, logps.detach(), advantages, mask, loss_type="luspo", importance_sampling_level=level)
        close(loss, -0.5)
        # d/dlogp_t = -A / n for every real token (sequence level: d rho / d logp_t = 1 / len, times len tokens)
        close(grad, [[-0.5, -0.5, -0.5], [1.0, 0.0, 0.0]])
    # grpo divides each sequence by its length instead: the same rows give (-1 + 2) / 2
    loss, grad = loss_and_grad(logps, logps.detach(), advantages, mask, loss_type="grpo")
    close(loss, 0.5)
    close(grad, [[-1 / 6, -1 / 6, -1 / 6], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta,delta", [(0.0, None), (0.04, None), (0.0, 1.5), (0.1, 2.0)])
def test_luspo_matches_trl(level, beta, delta):
    logps, old_logps, ref_logps, advantages, mask = random_batch(seed=3)
    loss, grad = loss_and_grad(logps, old_logps, advantages, mask, loss_type="luspo", importance_sampling_level=level,
                               beta=beta, delta=delta, ref_logps=ref_logps, epsilon_high=0.28)
    reference_logps = logps.clone().requires_grad_(True)
    expected = trl_compute_loss(reference_logps, old_logps, advantages, mask, loss_type="luspo", importance_sampling_level=level,
                                beta=beta, delta=delta, ref_per_token_logps=ref_logps, epsilon_high=0.28)
    expected.backward()
    close(loss, expected.detach())
    close(grad, reference_logps.grad)


# ----------------------------------------------------------------------------------------------
# 2. loss_type: vespo
# ----------------------------------------------------------------------------------------------


def test_vespo_gamma_weight_hand_values():
    # one row, two real tokens, log w = 0.1 + 0.2 = 0.3 (the third token is padding: its 5.0 is left out)
    log_ratio = torch.tensor([[0.1, 0.2, 5.0], [0.1, 0.2, 5.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    advantages = torch.tensor([1.0, -1.0, 0.0])
    phi = vespo_gamma_weights(advantages, log_ratio, mask)
    w = math.exp(0.3)
    close(phi, [[math.exp(3.0 + 2.0 * 0.3 - 3.0 * w)],  # A >= 0: k = 2, lambda = 3
                [math.exp(2.0 + 3.0 * 0.3 - 2.0 * w)],  # A < 0: k = 3, lambda = 2
                [1.0]])  # w = 1 (and A = 0 counts as >= 0): phi(1) = e^lambda * e^-lambda = 1
    # a token-level engine weight of 0 (masked by token_mask) sends log w to log 1e-8: phi ~ 0
    weights = torch.tensor([[1.0, 0.0, 1.0]]).expand(3, 3)
    phi = vespo_gamma_weights(advantages, log_ratio, mask, weights, k_pos=1.0, lambda_pos=1.0)
    assert float(phi[2]) == pytest.approx(math.exp(1.0 + math.log(1e-8) - 1e-8), rel=1e-4)


def test_vespo_loss_hand_value_and_gradient():
    # loss = sum_t m * (-phi * A * logp) / num_items; gradient -phi * A / num_items on real tokens
    logps = torch.tensor([[-1.0, -2.0, -3.0]])
    old_logps = logps - torch.tensor([[0.1, 0.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    advantages = torch.tensor([2.0])
    phi = math.exp(3.0 + 2.0 * 0.3 - 3.0 * math.exp(0.3))
    loss, grad = loss_and_grad(logps, old_logps, advantages, mask, loss_type="vespo", num_items_in_batch=4.0)
    close(loss, -phi * 2.0 * (-1.0 - 2.0) / 4.0)
    close(grad, [[-phi * 2.0 / 4.0, -phi * 2.0 / 4.0, 0.0]])
    # on-policy phi = 1: REINFORCE with dapo's normaliser
    loss, grad = loss_and_grad(logps, logps.detach(), advantages, mask, loss_type="vespo", num_items_in_batch=4.0)
    close(grad, [[-0.5, -0.5, 0.0]])


def test_vespo_takes_the_engine_weights_into_phi_not_into_the_loss():
    # engine weights of 2 on the two real tokens (1 on padding, as sampling_correction leaves it):
    # log w = 2 log 2 = log 4, so phi = e^3 * 16 * e^-12 and the loss is not doubled
    logps = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = torch.tensor([[2.0, 2.0, 1.0]])
    loss, _ = loss_and_grad(logps, logps.detach(), torch.tensor([1.0]), mask, loss_type="vespo", sampling_weights=weights,
                            num_items_in_batch=2.0)
    phi = math.exp(3.0) * 16.0 * math.exp(-12.0)
    close(loss, -phi * (-3.0) / 2.0)


@pytest.mark.parametrize("vespo", [(2.0, 3.0, 3.0, 2.0), (1.0, 1.0, 1.0, 1.0), (4.0, 0.5, 0.5, 4.0), (0.0, 0.0, 2.0, 6.0)])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("engine", [False, True])
def test_vespo_matches_trl(vespo, beta, engine):
    logps, old_logps, ref_logps, advantages, mask = random_batch(seed=5)
    old_logps = logps + 0.05 * (old_logps - logps)  # sequence log-weights within a few units
    weights = torch.exp(0.05 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(9))) if engine else None
    if weights is not None:
        weights[2, 1] = 0.0  # a token the engine's token_mask dropped
    num_items = float(mask.sum())
    k_pos, lambda_pos, k_neg, lambda_neg = vespo
    options = LossOptions(vespo_k_pos=k_pos, vespo_lambda_pos=lambda_pos, vespo_k_neg=k_neg, vespo_lambda_neg=lambda_neg)
    loss, grad = loss_and_grad(logps, old_logps, advantages, mask, options, loss_type="vespo", beta=beta, ref_logps=ref_logps,
                               sampling_weights=weights, num_items_in_batch=num_items)
    reference_logps = logps.clone().requires_grad_(True)
    expected = trl_compute_loss(reference_logps, old_logps, advantages, mask, loss_type="vespo", beta=beta,
                                ref_per_token_logps=ref_logps, importance_sampling_ratio=weights,
                                num_items_in_batch=num_items, vespo=vespo)
    expected.backward()
    close(loss, expected.detach())
    close(grad, reference_logps.grad)


def test_vespo_and_luspo_rows_without_gradient():
    # advantage 0 (beta 0) or no real token: exactly zero gradient, so the row's backward may be skipped
    advantages = torch.tensor([0.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    for loss_type in ("luspo", "vespo"):
        assert rows_without_gradient(advantages, mask, loss_type, beta=0.0).tolist() == [True, True, False]
        logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.3], [-0.2, -0.9]])
        _, grad = loss_and_grad(logps, logps - 0.1, advantages, mask, loss_type=loss_type, importance_sampling_level="sequence")
        assert grad[:2].abs().sum() == 0 and grad[2, 0] != 0


def test_a_loss_reading_the_inputs_registers_as_a_user_would():
    def half_reinforce(inputs, settings, options):  # -A/2 * logp, engine weights its own business
        return -0.5 * inputs.advantages.unsqueeze(-1) * inputs.logps

    register_loss_type("half_reinforce_test", half_reinforce, accumulates_by_mean=False, reads_inputs=True,
                       folds_sampling_weights=True)(dapo_aggregation)
    try:
        logps = torch.tensor([[-1.0, -3.0]])
        loss, grad = loss_and_grad(logps, logps.detach(), torch.tensor([2.0]), torch.ones(1, 2), loss_type="half_reinforce_test",
                                   sampling_weights=torch.full((1, 2), 5.0), num_items_in_batch=2.0)
        close(loss, -0.5 * 2.0 * (-4.0) / 2.0)  # the weights of 5 are not multiplied in: the objective read them
        close(grad, [[-0.5, -0.5]])
    finally:
        del LOSS_TYPES["half_reinforce_test"]


def test_an_inputs_objective_gets_the_engine_weights_unless_it_folds_them():
    def half_reinforce(inputs, settings, options):  # reads the inputs, leaves the engine weights to grpo_loss
        return -0.5 * inputs.advantages.unsqueeze(-1) * inputs.logps

    register_loss_type("half_reinforce_weighted_test", half_reinforce, accumulates_by_mean=False, reads_inputs=True)(
        dapo_aggregation
    )
    try:
        logps = torch.tensor([[-1.0, -3.0]])
        loss, grad = loss_and_grad(logps, logps.detach(), torch.tensor([2.0]), torch.ones(1, 2),
                                   loss_type="half_reinforce_weighted_test", sampling_weights=torch.full((1, 2), 5.0),
                                   num_items_in_batch=2.0)
        close(loss, 5.0 * -0.5 * 2.0 * (-4.0) / 2.0)  # weights of 5 multiplied in, as for a ratio objective
        close(grad, [[-2.5, -2.5]])
    finally:
        del LOSS_TYPES["half_reinforce_weighted_test"]
    with pytest.raises(ValueError, match="folds_sampling_weights needs reads_inputs"):
        register_loss_type("bad_fold_test", folds_sampling_weights=True)


def test_vespo_refuses_sequence_level_engine_weights():
    # a sequence mode's [n, 1] weight would be summed in as if it were one token's (TRL refuses these modes)
    log_ratio, mask = torch.zeros(1, 3), torch.ones(1, 3)
    with pytest.raises(ValueError, match=r"token-level sampling_weights .* got \(1, 1\)"):
        vespo_gamma_weights(torch.tensor([1.0]), log_ratio, mask, torch.tensor([[0.5]]))
    with pytest.raises(ValueError, match="token-level sampling_weights"):
        loss_and_grad(-torch.ones(1, 3), -torch.ones(1, 3), torch.tensor([1.0]), mask, loss_type="vespo",
                      sampling_weights=torch.tensor([[0.5]]))


def test_grpo_loss_options_default_to_trl_without_a_call_in_the_signature():
    import inspect

    assert inspect.signature(grpo_loss).parameters["options"].default is None
    logps, old_logps, _, advantages, mask = random_batch(seed=4)
    settings = LossSettings(loss_type="vespo", max_completion_length=logps.size(1))
    assert settings.options == LossOptions() == TRL_DEFAULTS  # TRL's defaults, in the one loss record
    default = grpo_loss(LossInputs(logps, old_logps, advantages, mask), settings)
    explicit = grpo_loss(LossInputs(logps, old_logps, advantages, mask), settings, LossOptions())
    close(default.loss, explicit.loss)


def test_grpo_loss_reads_the_options_of_its_settings_and_an_argument_replaces_them():
    # None reads settings.options (the run's record, built once); options given take their place
    logps, old_logps, _, advantages, mask = random_batch(seed=4)
    inputs = LossInputs(logps, old_logps, advantages, mask)
    steep = LossOptions(vespo_k_pos=4.0, vespo_k_neg=0.5)
    run = LossSettings(loss_type="vespo", max_completion_length=logps.size(1), options=steep)
    default = LossSettings(loss_type="vespo", max_completion_length=logps.size(1))
    from_settings = grpo_loss(inputs, run)
    close(from_settings.loss, grpo_loss(inputs, default, steep).loss)
    assert float((from_settings.loss - grpo_loss(inputs, default).loss).abs()) > 1e-4  # the options do change it
    close(grpo_loss(inputs, run, TRL_DEFAULTS).loss, grpo_loss(inputs, default).loss)


# ----------------------------------------------------------------------------------------------
# 3. off_policy_mask_threshold
# ----------------------------------------------------------------------------------------------


def test_off_policy_mask_hand_values():
    logps = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    # mean KL (sampling - policy over real tokens): 0.5, 0.1, 1.0, 1.0, 0 (no real token), NaN counts 0 -> 0.2
    sampling = torch.tensor([[-0.5, -0.5], [-0.9, 5.0], [0.0, 0.0], [0.0, 0.0], [3.0, 3.0], [NAN, -0.6]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    advantages = torch.tensor([-1.0, -1.0, 1.0, 0.0, -1.0, -1.0])
    keep = off_policy_sequence_mask(advantages, logps, sampling, mask, threshold=0.3)
    # dropped only where A < 0 and KL > 0.3: row 0; row 2 (A > 0) and row 3 (A = 0) stay whatever the KL
    assert keep.tolist() == [[0.0], [1.0], [1.0], [1.0], [1.0], [1.0]]
    close(keep, trl_get_off_policy_mask(advantages.unsqueeze(1), logps, sampling, mask, 0.3))


def test_off_policy_mask_in_the_loss():
    logps = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    old_logps = torch.tensor([[-0.2, -0.2], [-1.0, -1.0]])  # row 0: KL 0.8 to the policy that sampled
    advantages = torch.tensor([-1.0, -1.0])
    mask = torch.ones(2, 2)
    options = LossOptions(off_policy_mask_threshold=0.5)
    _, grad = loss_and_grad(logps, old_logps, advantages, mask, options, loss_type="dapo")
    assert grad[0].abs().sum() == 0 and grad[1].abs().sum() > 0  # sampling_logps None: old_logps measured
    # an engine's log-probs (sampling_logps) take old_logps' place: row 0 near them, row 1 far
    sampling = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])
    _, grad = loss_and_grad(logps, logps.detach(), advantages, mask, options, loss_type="dapo", sampling_logps=sampling)
    assert grad[0].abs().sum() > 0 and grad[1].abs().sum() == 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo", "vespo"])
@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.5])
def test_off_policy_mask_matches_trl(loss_type, threshold):
    logps, old_logps, ref_logps, advantages, mask = random_batch(seed=11)
    sampling = old_logps + 0.1 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(2))
    options = LossOptions(off_policy_mask_threshold=threshold)
    num_items = float(mask.sum())
    loss, grad = loss_and_grad(logps, old_logps, advantages, mask, options, loss_type=loss_type, beta=0.04, ref_logps=ref_logps,
                               sampling_logps=sampling, num_items_in_batch=num_items)
    reference_logps = logps.clone().requires_grad_(True)
    expected = trl_compute_loss(reference_logps, old_logps, advantages, mask, loss_type=loss_type, beta=0.04,
                                ref_per_token_logps=ref_logps, off_policy_mask_threshold=threshold,
                                sampling_per_token_logps=sampling, num_items_in_batch=num_items)
    expected.backward()
    close(loss, expected.detach())
    close(grad, reference_logps.grad)


# ----------------------------------------------------------------------------------------------
# 4. multi_objective_aggregation: normalize_then_sum (GDPO)
# ----------------------------------------------------------------------------------------------


def test_gdpo_hand_values():
    # 2 groups of 4, rewards 1 and 2 weighted 1 and 2; None is NaN
    r1 = [0.0, 1.0, 2.0, NAN, 3.0, NAN, 1.0, 2.0]
    r2 = [5.0, 5.0, 5.0, NAN, 0.0, 4.0, 2.0, 2.0]  # group 0's reward 2 is constant; row 3 has no reward at all
    rewards_per_func = torch.tensor([r1, r2]).T  # [8, 2]
    # group 0, reward 1: [0, 1, 2] mean 1, Bessel std 1 -> z = [-1, 0, 1] / (1 + 1e-4); reward 2 equal: z = 0
    # group 1, reward 1: [3, 1, 2] mean 2, std 1 -> [1, NaN, -1, 0] / (1 + 1e-4)
    #          reward 2: [0, 4, 2, 2] mean 2, Bessel std sqrt(8 / 3) -> [-2, 2, 0, 0] / (sqrt(8/3) + 1e-4)
    b, e = 1 / (1 + 1e-4), 1 / (math.sqrt(8 / 3) + 1e-4)
    summed = [-b, 0.0, b, NAN, b - 4 * e, 4 * e, -b, 0.0]  # s = z1 + 2 * z2, NaN where no reward
    # every z sums to 0 over its group: mean(s) = 0; Bessel std over the 7 scored rows
    std = math.sqrt(sum(s * s for s in summed if not math.isnan(s)) / 6)
    expected = [0.0 if math.isnan(s) else s / (std + 1e-4) for s in summed]
    out = multi_objective_advantages(rewards_per_func, torch.tensor([1.0, 2.0]), 4, aggregation="normalize_then_sum")
    close(out.advantages, expected)
    close(out.advantages, trl_normalize_then_sum(rewards_per_func, torch.tensor([1.0, 2.0]), 4))
    close(out.group_std, [std] * 8)
    assert out.zero_std.tolist() == [False] * 8


def test_gdpo_equal_groups_get_zero_and_count_as_zero_std():
    # group 1: both rewards equal over the group -> every z is 0 -> advantage 0, zero_std
    rewards_per_func = torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.3, 7.0], [0.3, 7.0]])
    out = normalize_then_sum(rewards_per_func, torch.tensor([1.0, 1.0]), 2)
    # group 0: reward 1 [0, 1], mean 1/2, Bessel std sqrt(1/2): z1 = [-1/2, 1/2] / (sqrt(1/2) + 1e-4);
    # z2 = 0 (equal) -> s = [-c, c, 0, 0]; mean 0, std = sqrt(2c^2 / 3)
    c = 0.5 / (math.sqrt(0.5) + 1e-4)
    std = math.sqrt(2 * c * c / 3)
    close(out.advantages, [-c / (std + 1e-4), c / (std + 1e-4), 0.0, 0.0])
    assert out.zero_std.tolist() == [False, False, True, True]
    close(out.advantages, trl_normalize_then_sum(rewards_per_func, torch.tensor([1.0, 1.0]), 2))


@pytest.mark.parametrize("seed", range(4))
def test_gdpo_matches_trl_with_missing_rewards(seed):
    generator = torch.Generator().manual_seed(seed)
    rewards_per_func = torch.randn(12, 3, generator=generator)
    rewards_per_func[torch.rand(12, 3, generator=generator) < 0.2] = NAN
    rewards_per_func[5] = NAN  # a completion no reward applies to
    rewards_per_func[8:12, 2] = 1.0  # an equal reward over a group
    weights = torch.tensor([1.0, 0.5, 2.0])
    out = normalize_then_sum(rewards_per_func, weights, 4)
    close(out.advantages, trl_normalize_then_sum(rewards_per_func, weights, 4), atol=1e-5)
    assert float(out.advantages[5]) == 0.0


def test_sum_then_normalize_is_grpo_and_names_are_checked():
    rewards_per_func = torch.tensor([[1.0, 0.0], [0.0, NAN], [2.0, 1.0], [2.0, 1.0]])
    weights = torch.tensor([1.0, 3.0])
    out = multi_objective_advantages(rewards_per_func, weights, 2, "batch")
    close(out.advantages, group_advantages(combine_rewards(rewards_per_func, weights), 2, "batch").advantages)
    assert set(MULTI_OBJECTIVE_AGGREGATIONS) >= {"sum_then_normalize", "normalize_then_sum"}
    with pytest.raises(ValueError, match="multi_objective_aggregation must be one of"):
        multi_objective_advantages(rewards_per_func, weights, 2, aggregation="sum_then_normalise")


def test_gdpo_constant_reward_gives_zero_where_trl_gives_float_noise():
    # documented deviation: two groups of six, rewards 0.3 and 0.7, each constant over its group. lit-grpo
    # detects the equal rewards exactly: z = 0, advantage 0. TRL's float32 mean of six 0.3s is an ulp off,
    # (r - mean) / (0 + 1e-4) keeps that error, and the batch std (as small) blows it up to about +-0.58.
    rewards_per_func = torch.tensor([[0.3]] * 6 + [[0.7]] * 6)
    weights = torch.tensor([1.0])
    out = normalize_then_sum(rewards_per_func, weights, 6)
    assert out.advantages.tolist() == [0.0] * 12 and out.zero_std.tolist() == [True] * 12
    trl = trl_normalize_then_sum(rewards_per_func, weights, 6)
    assert float(trl.abs().max()) > 0.1  # TRL's noise; if this fails, TRL's float path changed: revisit the docs


def test_gdpo_zero_std_follows_the_summed_rewards():
    # group 0: r1 = [1, 0] and r2 = [0, 1] cancel, s = [0, 0]: no signal although no reward is constant
    # group 1: r1 = [0, 1], r2 = [0, 0]: s varies
    rewards_per_func = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    out = normalize_then_sum(rewards_per_func, torch.tensor([1.0, 1.0]), 2)
    assert out.zero_std.tolist() == [True, True, False, False]
    close(out.advantages[:2], [0.0, 0.0])


def test_aggregation_eps_reaches_both_aggregations():
    # one group of two, one reward [0, 2]: mean 1, Bessel std sqrt(2)
    rewards_per_func = torch.tensor([[0.0], [2.0]])
    weights = torch.tensor([1.0])
    grpo = multi_objective_advantages(rewards_per_func, weights, 2, aggregation="sum_then_normalize", eps=1.0)
    close(grpo.advantages, [-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)])
    # GDPO: z = [-1, 1] / (sqrt(2) + 1) = [-c, c]; batch std of s = c * sqrt(2); A = s / (c sqrt(2) + 1)
    c = 1 / (math.sqrt(2) + 1)
    gdpo = multi_objective_advantages(rewards_per_func, weights, 2, aggregation="normalize_then_sum", eps=1.0)
    close(gdpo.advantages, [-c / (c * math.sqrt(2) + 1), c / (c * math.sqrt(2) + 1)])


# ----------------------------------------------------------------------------------------------
# 5. entropy_coef and adaptive entropy control
# ----------------------------------------------------------------------------------------------


def trl_entropy_bonus(loss, entropies, effective_mask, apply_coef, accumulation_factor):
    """``GRPOTrainer._compute_loss``'s entropy bonus (``loss - apply_coef * entropy_loss``)."""
    entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation_factor
    return loss - apply_coef * entropy_loss


def test_entropy_bonus_hand_value_and_gradient():
    entropies = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    bonus = entropy_bonus_loss(entropies, mask, coefficient=0.1, micro_batches=2)
    close(bonus.detach(), -0.1 * (1 + 2 + 4) / 3 / 2)  # -coef * mean entropy over the 3 real tokens / 2
    bonus.backward()
    close(entropies.grad, [[-0.1 / 6, -0.1 / 6, 0.0], [-0.1 / 6, 0.0, 0.0]])
    close(bonus.detach(), trl_entropy_bonus(torch.tensor(0.0), entropies.detach(), mask, 0.1, 2))


def test_entropy_bonus_raises_the_entropy_of_a_real_distribution():
    # through torch.distributions' entropy: one gradient step on the bonus moves logits towards uniform
    logits = torch.tensor([[[3.0, 0.0, -1.0]]], requires_grad=True)  # [1, 1, V]
    entropy = torch.distributions.Categorical(logits=logits).entropy()  # [1, 1]
    entropy_bonus_loss(entropy, torch.ones(1, 1), coefficient=1.0).backward()
    with torch.no_grad():
        after = torch.distributions.Categorical(logits=logits - 0.1 * logits.grad).entropy()
    assert float(after) > float(entropy.detach())


def test_token_entropy_value_and_gradient_with_a_truncated_support():
    # logits [0, log 3, -inf]: p = [1/4, 3/4, 0], H = -(1/4 log 1/4 + 3/4 log 3/4) = log 4 - 3/4 log 3
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf], [1.0, 2.0, 0.5]], requires_grad=True)
    entropy = token_entropy(logits)
    close(entropy[0].detach(), math.log(4.0) - 0.75 * math.log(3.0))
    entropy.sum().backward()
    reference = logits.detach().clone().requires_grad_(True)
    # torch.distributions' entropy (its -inf logits clamped to the lowest float, so p * logit = 0)
    expected = torch.distributions.Categorical(logits=reference).entropy()
    expected.sum().backward()
    close(entropy.detach(), expected.detach())
    close(logits.grad, reference.grad)
    assert logits.grad[0, 2] == 0.0 and torch.isfinite(logits.grad).all()


def test_entropy_bonus_of_an_empty_mask_is_zero():
    bonus = entropy_bonus_loss(torch.ones(2, 3), torch.zeros(2, 3), coefficient=0.5)
    assert float(bonus) == 0.0 and not torch.isnan(bonus)
    close(entropy_sum_and_count(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]])), [1.0, 1.0])


def trl_adaptive_steps(entropies, coef, target, coef_min, coef_max, delta):
    """TRL 1.16's adaptive control (``_compute_loss``), *re-expressed*, not verbatim: one micro-batch per
    optimizer step and its world entropy given, so the window sum of ``_entropy_window_stats`` is left
    out (:func:`trl_adaptive_window` has it): (applied, logged) per step."""
    last_world_entropy = float("inf")
    history = []
    for world_entropy in entropies:
        apply_coef = coef if last_world_entropy <= target else 0.0
        if world_entropy <= target:
            coef = min(coef + delta, coef_max)
        else:
            coef = max(coef - delta, coef_min)
        last_world_entropy = world_entropy
        history.append((apply_coef, coef))
    return history


def test_adaptive_entropy_over_steps_hand_values_and_trl():
    settings = EntropyControlSettings(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.5,
                                      entropy_coef_min=0.0, entropy_coef_max=0.02, entropy_coef_delta=0.005)
    entropies = [0.4, 0.4, 0.4, 0.6, 0.6, 0.6, 0.6, 0.3, 0.5]  # the last at the target exactly
    controller = EntropyCoefficient(settings)
    history = []
    for entropy in entropies:
        applied = controller.applied()
        controller.step(entropy)
        history.append((applied, controller.value))
    # no measurement before step 1: no bonus; up by 0.005 while at or below 0.5, capped at 0.02; down to 0;
    # at the target (0.5): up, and the next step's bonus applies
    expected = [(0.0, 0.015), (0.015, 0.02), (0.02, 0.02), (0.02, 0.015), (0.0, 0.01), (0.0, 0.005), (0.0, 0.0), (0.0, 0.005),
                (0.005, 0.01)]
    flat = [value for pair in history for value in pair]
    assert flat == pytest.approx([value for pair in expected for value in pair])
    trl = trl_adaptive_steps(entropies, 0.01, 0.5, 0.0, 0.02, 0.005)
    assert flat == pytest.approx([value for pair in trl for value in pair])
    assert controller.applied() == pytest.approx(0.01)


def test_adaptive_entropy_state_resumes_exactly():
    settings = EntropyControlSettings(entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=1.0, entropy_coef_delta=0.05)
    first = EntropyCoefficient(settings)
    for entropy in (0.5, 2.0, 0.9):
        first.step(entropy)
    state = first.state_dict()
    assert state == pytest.approx({"entropy_coef": 0.15, "last_world_entropy": 0.9})  # 0.1 + 0.05 - 0.05 + 0.05
    resumed = EntropyCoefficient(settings)
    resumed.load_state_dict(state)
    for entropy in (1.5, 0.2):
        assert resumed.applied() == first.applied()
        first.step(entropy)
        resumed.step(entropy)
    assert resumed.state_dict() == first.state_dict()


def test_fixed_entropy_coefficient_and_enabled():
    fixed = EntropyCoefficient(EntropyControlSettings(entropy_coef=0.02))
    fixed.step(0.0)
    assert fixed.applied() == 0.02 and fixed.value == 0.02
    assert EntropyControlSettings(entropy_coef=0.02).enabled
    assert EntropyControlSettings(entropy_coef=0.0, use_adaptive_entropy=True).enabled
    assert not EntropyControlSettings().enabled


def test_token_entropy_of_bfloat16_logits_is_computed_in_float32():
    # Qwen's vocabulary: summed in bfloat16 the entropy is off by most of a nat
    logits = (3.0 * torch.randn(4, 151_936, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    logits.requires_grad_(True)
    entropy = token_entropy(logits)
    expected = torch.distributions.Categorical(logits=logits.detach().float()).entropy()
    assert entropy.dtype == torch.float32
    close(entropy.detach(), expected, atol=1e-3, rtol=1e-4)
    entropy.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def trl_adaptive_window(micro_batches_per_step, coef, target, coef_min, coef_max, delta):
    """TRL 1.16's adaptive control with its window over micro-batches (``_compute_loss``), *re-expressed*:
    ``self.*`` as local variables, one rank (``accelerator.reduce`` of one rank is the identity),
    ``sync_gradients`` true at a step's last micro-batch. (applied of the step, logged, last_world_entropy) per step."""
    last_world_entropy, entropy_window_stats, history = float("inf"), None, []
    for micro_batches in micro_batches_per_step:
        for index, (entropies, effective_mask) in enumerate(micro_batches):
            apply_coef = coef if last_world_entropy <= target else 0.0
            stats = torch.stack([(entropies * effective_mask).sum(), effective_mask.sum()]).detach()
            entropy_window_stats = stats if entropy_window_stats is None else entropy_window_stats + stats
            if index == len(micro_batches) - 1:
                window_stats = entropy_window_stats
                world_entropy = (window_stats[0] / window_stats[1].clamp(min=1.0)).item()
                if world_entropy <= target:
                    coef = min(coef + delta, coef_max)
                else:
                    coef = max(coef - delta, coef_min)
                last_world_entropy = world_entropy
                entropy_window_stats = None
        history.append((apply_coef, coef, last_world_entropy))
    return history


def test_adaptive_entropy_over_micro_batches_is_token_weighted_as_in_trl():
    # step 1: micro-batch 0 has 3 tokens of entropy 0.2, micro-batch 1 one token of 1.0 (its second is
    # padding): token-weighted 1.6 / 4 = 0.4 <= 0.5, up (the mean of the two means, 0.6, would go down);
    # step 2: no token at all: 0 / max(0, 1) = 0, up; step 3: 2 tokens of 0.9, down
    steps = [
        [(torch.full((1, 3), 0.2), torch.ones(1, 3)), (torch.tensor([[1.0, 7.0]]), torch.tensor([[1.0, 0.0]]))],
        [(torch.ones(2, 2), torch.zeros(2, 2)), (torch.ones(1, 2), torch.zeros(1, 2))],
        [(torch.full((1, 2), 0.9), torch.ones(1, 2))],
    ]
    settings = EntropyControlSettings(entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=0.5,
                                      entropy_coef_delta=0.05)
    controller = EntropyCoefficient(settings)
    history = []
    for micro_batches in steps:  # what the training step does (the wiring's recipe)
        applied = controller.applied()
        total = sum(entropy_sum_and_count(entropies, mask) for entropies, mask in micro_batches)
        controller.step(float(total[0] / total[1].clamp(min=1.0)))
        history.append((applied, controller.value, controller.last_entropy))
    expected = [(0.0, 0.15, 0.4), (0.15, 0.2, 0.0), (0.2, 0.15, 0.9)]
    flat = [value for triple in history for value in triple]
    assert flat == pytest.approx([value for triple in expected for value in triple])
    trl = trl_adaptive_window(steps, 0.1, 0.5, 0.0, 1.0, 0.05)
    assert flat == pytest.approx([value for triple in trl for value in triple])


@pytest.mark.parametrize("filters", [
    SamplingFilters(temperature=0.7),  # a plain softmax: the full vocabulary
    SamplingFilters(temperature=0.7, top_k=3),
    SamplingFilters(top_p=0.8, min_p=0.05, min_p_first=True),
], ids=["plain", "top_k", "top_p-min_p"])
def test_sampling_entropy_has_its_gradient_only_for_the_bonus(filters):
    # the trained forward's entropy (the bonus's) over the sampled support, as torch.distributions has it
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 11, generator=generator, requires_grad=True)
    tokens = torch.randint(11, (2, 3), generator=generator)
    _, metric = sampling_log_softmax(logits, tokens, filters, with_entropy=True)
    assert not metric.requires_grad  # the entropy metric: no gradient, no graph kept
    _, entropy = sampling_log_softmax(logits, tokens, filters, with_entropy=True, entropy_grad=True)
    close(entropy.detach(), metric)
    z = logits.reshape(6, 11) / filters.temperature
    kept = kept_tokens(z, filters).scatter(-1, tokens.reshape(6, 1), True)  # the support, with the sampled token
    expected = torch.distributions.Categorical(logits=z.masked_fill(~kept, torch.finfo(z.dtype).min)).entropy()
    close(entropy.detach().reshape(6), expected.detach())
    weights = torch.rand(2, 3, generator=generator)  # a weighted sum, as the bonus's mask makes it
    gradient, = torch.autograd.grad((entropy * weights).sum(), logits)
    expected_gradient, = torch.autograd.grad((expected * weights.reshape(6)).sum(), logits)
    close(gradient, expected_gradient)
    assert gradient.abs().sum() > 0


@pytest.mark.parametrize("filters", [SamplingFilters(temperature=0.7), SamplingFilters(temperature=0.7, top_k=5)],
                         ids=["plain", "top_k"])
def test_the_entropys_gradient_keeps_no_more_logits_for_backward(filters):
    # autograd's graph of the entropy formula kept 3-4 more tensors of the logits' size (25-33 MiB here
    # against 7.8); the entropy's own backward recomputes the probabilities from the logits the log-probs keep
    logits = torch.randn(1, 64, 4000, requires_grad=True)
    tokens = torch.randint(4000, (1, 64))

    def kept_bytes(entropy_grad):
        kept = {}

        def pack(tensor):
            kept[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            sampling_log_softmax(logits, tokens, filters, with_entropy=True, entropy_grad=entropy_grad)
        return sum(kept.values())

    logits_bytes = logits.numel() * 4
    assert kept_bytes(True) - kept_bytes(False) < 0.05 * logits_bytes


# ----------------------------------------------------------------------------------------------
# 6. the keys' values (lit_grpo.config.check_trl_options; the keys themselves come with the wiring)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings,message", [
    ({"multi_objective_aggregation": "normalise_then_sum"}, "model.multi_objective_aggregation must be one of"),
    ({"vespo_lambda_neg": -1.0}, "model.vespo_lambda_neg must be >= 0, got -1.0"),
    ({"vespo_k_pos": NAN}, "model.vespo_k_pos must be >= 0"),
    ({"off_policy_mask_threshold": -0.5}, "model.off_policy_mask_threshold must be >= 0"),
    ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, r"model.entropy_coef_min \(0.5\) must not be above"),
    ({"entropy_coef_delta": -0.01}, "model.entropy_coef_delta must be >= 0"),
    ({"loss_type": "vespo", "generation_backend": "vllm", "vllm_importance_sampling_correction": True,
      "vllm_importance_sampling_mode": "auto", "max_staleness": 0}, "must be token_truncate or token_mask"),
    # with staleness every backend's samples carry the correction's weights, the trainer's own included
    ({"loss_type": "vespo", "generation_backend": "lit", "vllm_importance_sampling_correction": True,
      "vllm_importance_sampling_mode": "sequence_mask", "max_staleness": 2}, "must be token_truncate or token_mask"),
])
def test_config_names_the_key_of_a_bad_value(settings, message):
    with pytest.raises(ConfigError, match=message):
        check_trl_options(AttributeDict(settings))


def test_config_accepts_trl_defaults_and_absent_keys():
    check_trl_options(AttributeDict())  # keys the run does not have yet are not checked
    check_trl_options(AttributeDict(
        multi_objective_aggregation="normalize_then_sum", vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
        vespo_lambda_neg=2.0, off_policy_mask_threshold=None, entropy_coef_min=0.0, entropy_coef_max=1.0,
        entropy_coef_delta=0.005, loss_type="vespo", generation_backend="vllm", vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="auto", max_staleness=1,  # auto with staleness: token_mask
    ))


@pytest.mark.parametrize("loss_type,level,message", [
    ("luspo", "token", "When using 'luspo' loss, model.importance_sampling_level should be set to 'sequence'"),
    ("vespo", "sequence", "VESPO computes sequence-level importance weights internally"),
])
def test_config_warns_as_trl_for_the_paper_importance_sampling_level(loss_type, level, message):
    with pytest.warns(UserWarning, match=message):
        check_trl_options(AttributeDict(loss_type=loss_type, importance_sampling_level=level))


@pytest.mark.parametrize("loss_type,level", [("luspo", "sequence"), ("vespo", "token"), ("grpo", "sequence")])
def test_config_does_not_warn_for_the_paper_level(loss_type, level, recwarn):
    check_trl_options(AttributeDict(loss_type=loss_type, importance_sampling_level=level))
    assert not [w for w in recwarn if "importance_sampling_level" in str(w.message)]
