"""Truncated importance sampling for completions another engine sampled (TRL 1.16's
``vllm_importance_sampling_correction``), by hand; and its place in the GRPO step, with a stand-in
engine whose log-probs differ from the trainer's by a known amount (no vLLM needed)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_grpo.algorithm.sampling_correction import correction_settings, sampling_correction
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.async_pipeline import check_async_settings
from test_algorithm import loss_of  # grpo_loss of tensors and settings given as keywords

TRAINER = torch.log(torch.tensor([[0.5, 0.5, 0.25], [0.25, 0.5, 0.5]]))
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=1e-5)


def engine_logps(log_ratios) -> torch.Tensor:
    """Engine log-probs such that trainer - engine = ``log_ratios``."""
    return TRAINER - torch.tensor(log_ratios)


def test_token_truncate_and_token_mask():
    engine = engine_logps([[math.log(4), math.log(0.5), 7.0], [math.log(0.1), 0.0, math.log(2)]])
    out = sampling_correction(TRAINER, engine, MASK, "token_truncate", clip_min=0.2, clip_max=3.0)
    # ratios 4, .5, (padding: exp(0) = 1) / .1, 1, 2 -> clamped to [.2, 3]
    close(out.ratio, [[4.0, 0.5, 1.0], [0.1, 1.0, 2.0]])
    close(out.weights, [[3.0, 0.5, 1.0], [0.2, 1.0, 2.0]])
    assert out.changed.tolist() == [[True, False, False], [True, False, False]]
    masked = sampling_correction(TRAINER, engine, MASK, "token_mask", clip_min=0.2, clip_max=3.0)
    close(masked.weights, [[0.0, 0.5, 1.0], [0.0, 1.0, 2.0]])


def test_sequence_modes_use_the_summed_log_ratio():
    engine = engine_logps([[math.log(2), math.log(2), 5.0], [math.log(0.5), 0.0, math.log(0.5)]])
    out = sampling_correction(TRAINER, engine, MASK, "sequence_truncate", clip_max=3.0)
    # row 0: 2 * 2 = 4 (the padding's 5.0 does not count); row 1: .5 * 1 * .5 = .25
    close(out.ratio, [[4.0], [0.25]])
    close(out.weights, [[3.0], [0.25]])
    masked = sampling_correction(TRAINER, engine, MASK, "sequence_mask", clip_max=3.0)  # TRL's default
    close(masked.weights, [[0.0], [0.25]])
    no_bounds = sampling_correction(TRAINER, engine, MASK, "sequence_mask", clip_max=None)
    close(no_bounds.weights, [[4.0], [0.25]])
    for mode in ("sequence_truncate", "token_truncate"):  # both bounds null: the ratio itself, nothing changed
        unbounded = sampling_correction(TRAINER, engine, MASK, mode, clip_min=None, clip_max=None)
        close(unbounded.weights, unbounded.ratio)
        assert not unbounded.changed.any()
    close(sampling_correction(TRAINER, engine, MASK, "sequence_truncate", clip_max=None).weights, [[4.0], [0.25]])


def test_a_token_the_engine_did_not_score_gets_weight_one():
    engine = engine_logps([[math.log(2), 0.0, 0.0], [0.0, 0.0, 0.0]])
    engine[0, 1] = float("nan")
    out = sampling_correction(TRAINER, engine, MASK, "token_truncate")
    close(out.weights, [[2.0, 1.0, 1.0], [1.0, 1.0, 1.0]])


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="token_truncate"):
        sampling_correction(TRAINER, TRAINER, MASK, "sequence_clip")


def test_weights_multiply_the_policy_term_and_not_the_kl():
    logps = TRAINER.clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0])
    weights = torch.tensor([[0.5], [2.0]])
    plain = loss_of(logps, logps.detach(), advantages, MASK, max_completion_length=3)
    weighted = loss_of(logps, logps.detach(), advantages, MASK, max_completion_length=3, sampling_weights=weights)
    # on-policy per-token loss -A: row 0 two tokens of -1, row 1 three of +1; dapo over 5 tokens
    close(plain.loss, (-2.0 + 3.0) / 5)
    close(weighted.loss, (0.5 * -2.0 + 2.0 * 3.0) / 5)
    ref = TRAINER - 0.1
    with_kl = loss_of(logps, logps.detach(), advantages, MASK, max_completion_length=3, sampling_weights=weights,
                        beta=0.5, ref_logps=ref)
    k3 = math.exp(-0.1) + 0.1 - 1
    close(with_kl.loss, (0.5 * -2.0 + 2.0 * 3.0 + 0.5 * 5 * k3) / 5)


def test_the_step_reweights_an_engines_samples_and_logs_how_far_it_is(tiny_model_dir, say_a_or_b_file, fast_trainer):
    """A stand-in engine whose log-probs are the trainer's minus 0.05 per token: the log-prob
    difference is 0.05, and each sequence's weight exp(0.05 * length), masked above 3."""
    import lightning.pytorch as pl
    from test_module import MetricRecorder, make_data, make_module

    pl.seed_everything(0)
    module = make_module(tiny_model_dir, vllm_importance_sampling_mode="sequence_mask", max_completion_length=24)
    sample = module.collector.generate  # step 1, where the training step samples
    seen = []

    def generate_with_engine_logps(prompts, *args, **kwargs):
        rollout = sample(prompts, *args, **kwargs)
        trainer = module.logprobs.logps_no_grad(module.policy, rollout)
        rollout.sampling_logps = (trainer - 0.05) * rollout.completion_mask
        seen.append(rollout)
        return rollout

    module.collector.generate = generate_with_engine_logps
    recorder = MetricRecorder()
    fast_trainer(max_steps=1, callbacks=[recorder]).fit(module, make_data(say_a_or_b_file))
    metrics = recorder.steps[0]
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(0.05, abs=1e-5)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(0.05, abs=1e-5)
    lengths = seen[0].completion_lengths.float()
    ratios = torch.exp(0.05 * lengths)
    weights = torch.where(ratios > 3.0, torch.zeros_like(ratios), ratios)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(weights.mean()), rel=1e-4)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(float(weights.max()), rel=1e-4)
    assert metrics["sampling/importance_sampling_ratio/truncated_frac"] == pytest.approx(float((ratios > 3.0).float().mean()))


# ------------------------------------------------------------------------------------------------
# Staleness (model.max_staleness > 0): decoupled PPO, the behaviour weight per token
# ------------------------------------------------------------------------------------------------


def staleness_correction(prox, behav, mask):
    """The correction a run with ``max_staleness: 1`` applies by default."""
    settings = correction_settings("auto", "auto", "auto", max_staleness=1)
    return sampling_correction(prox, behav, mask, settings.mode, settings.clip_min, settings.clip_max)


def test_decoupled_ppo_weighs_the_clipped_proximal_ratio_by_the_masked_behaviour_weight():
    """Three policies, probabilities chosen by hand (AReaL's decoupled PPO): pi_behav sampled,
    pi_prox is the trainer's at the start of the batch's update (``old_logps``), pi_theta is trained.
    Loss per token: -min(r A, clip(r, 0.8, 1.2) A) * w, r = theta / prox, w = prox / behav, 0 outside
    [1/8, 8] (prime-rl's token mask)."""
    behav = torch.log(torch.tensor([[0.5, 0.05], [0.5, 0.5]]))
    prox = torch.log(torch.tensor([[0.25, 0.5], [0.05, 0.25]]))
    theta = torch.log(torch.tensor([[0.5, 0.5], [0.025, 0.5]])).requires_grad_(True)
    mask = torch.ones(2, 2, dtype=torch.long)
    advantages = torch.tensor([1.0, -1.0])
    correction = staleness_correction(prox, behav, mask)
    close(correction.ratio, [[0.5, 10.0], [0.1, 0.5]])  # w = prox / behav
    close(correction.weights, [[0.5, 0.0], [0.0, 0.5]])  # 10 > 8 and 0.1 < 1/8 leave the loss
    assert correction.changed.tolist() == [[False, True], [True, False]]
    out = loss_of(theta, prox, advantages, mask, loss_type="dapo", max_completion_length=2,
                    sampling_weights=correction.weights)
    # r = [[2, 1], [.5, 2]]; row 0 (A = 1): -min(2, 1.2) * .5 = -.6, -1 * 0 = 0;
    # row 1 (A = -1): -min(-.5, -.8) * 0 = 0, -min(-2, -1.2) * .5 = 1; dapo: sum over the 4 tokens / 4
    close(out.loss, (-0.6 + 0.0 + 0.0 + 1.0) / 4)
    out.loss.backward()
    # only row 1's second token is unclipped and kept: d/dlogp (-A r w) / 4 = 1 * 2 * .5 / 4
    close(theta.grad, [[0.0, 0.0], [0.0, 0.25]])


def test_the_staleness_default_keeps_the_tokens_a_sequence_weight_would_drop():
    """One optimizer step later, a sequence the step reinforced (+0.2 nat per token over 8 tokens:
    e^1.6 = 5) and one it discouraged (-0.2 per token): TRL's sequence_mask zeroes the first and keeps
    the second at e^-1.6 = 0.2, a one-sided loss of signal; per token (the staleness default) both keep
    every token at e^0.2 = 1.22 and e^-0.2 = 0.82."""
    prox = torch.zeros(2, 8)
    behav = torch.tensor([[-0.2] * 8, [0.2] * 8])
    mask = torch.ones(2, 8, dtype=torch.long)
    synchronous = correction_settings("auto", "auto", "auto", max_staleness=0)
    sequence = sampling_correction(prox, behav, mask, synchronous.mode, synchronous.clip_min, synchronous.clip_max)
    close(sequence.weights, [[0.0], [math.exp(-1.6)]])
    token = staleness_correction(prox, behav, mask)
    close(token.weights, [[math.exp(0.2)] * 8, [math.exp(-0.2)] * 8])
    assert not token.changed.any()


def test_auto_is_trls_correction_synchronously_and_the_token_mask_with_staleness(tiny_model_dir):
    from test_module import make_module

    assert correction_settings("auto", "auto", "auto", 0) == ("sequence_mask", None, 3.0)
    assert correction_settings("auto", "auto", "auto", 2) == ("token_mask", 0.125, 8.0)
    assert correction_settings("sequence_truncate", None, 4.0, 1) == ("sequence_truncate", None, 4.0)  # as written
    # the loss reads the module's hparams: "auto" is resolved there
    hp = make_module(tiny_model_dir).hparams
    assert (hp.vllm_importance_sampling_mode, hp.vllm_importance_sampling_clip_min, hp.vllm_importance_sampling_clip_max) \
        == ("sequence_mask", None, 3.0)
    hp = make_module(tiny_model_dir, max_staleness=1, vllm_importance_sampling_clip_max=5.0).hparams
    assert (hp.vllm_importance_sampling_mode, hp.vllm_importance_sampling_clip_min, hp.vllm_importance_sampling_clip_max) \
        == ("token_mask", 0.125, 5.0)
    with pytest.raises(ConfigError, match="_clip_min .* and _clip_max"):
        make_module(tiny_model_dir, max_staleness=1, vllm_importance_sampling_clip_max=0.1)


def test_staleness_without_the_correction_is_refused_naming_both_keys():
    from types import SimpleNamespace

    hp = SimpleNamespace(max_staleness=1, num_iterations=1, steps_per_generation=1, dynamic_sampling=False,
                         tools=None, environment=None, vllm_importance_sampling_correction=False)
    with pytest.raises(ConfigError) as error:
        check_async_settings(hp)
    message = str(error.value)
    assert "model.vllm_importance_sampling_correction: false" in message and "model.max_staleness: 1" in message
    check_async_settings(SimpleNamespace(**{**vars(hp), "max_staleness": 0}))  # synchronous: TRL's switch
    check_async_settings(SimpleNamespace(**{**vars(hp), "vllm_importance_sampling_correction": True}))
