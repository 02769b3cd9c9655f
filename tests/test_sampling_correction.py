"""Truncated importance sampling for completions another engine sampled (TRL 1.16's
``vllm_importance_sampling_correction``), by hand; and its place in the GRPO step, with a stand-in
engine whose log-probs differ from the trainer's by a known amount (no vLLM needed)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_grpo.algorithm import grpo_loss
from lit_grpo.sampling_correction import sampling_correction

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
    plain = grpo_loss(logps, logps.detach(), advantages, MASK, max_completion_length=3)
    weighted = grpo_loss(logps, logps.detach(), advantages, MASK, max_completion_length=3, sampling_weights=weights)
    # on-policy per-token loss -A: row 0 two tokens of -1, row 1 three of +1; dapo over 5 tokens
    close(plain.loss, (-2.0 + 3.0) / 5)
    close(weighted.loss, (0.5 * -2.0 + 2.0 * 3.0) / 5)
    ref = TRAINER - 0.1
    with_kl = grpo_loss(logps, logps.detach(), advantages, MASK, max_completion_length=3, sampling_weights=weights,
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
    sample = module.generate
    seen = []

    def generate_with_engine_logps(prompts, *args, **kwargs):
        rollout = sample(prompts, *args, **kwargs)
        trainer = module.logprobs.logps_no_grad(module.policy, rollout)
        rollout.sampling_logps = (trainer - 0.05) * rollout.completion_mask
        seen.append(rollout)
        return rollout

    module.generate = generate_with_engine_logps
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
