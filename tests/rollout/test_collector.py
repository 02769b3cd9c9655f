"""The rollout collector (steps 1-3) on its own: no LightningModule, only the policy and its version
and the collectives of one process; and the engine interface's defaults, which its callers read."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict

from lit_grpo import models
from lit_grpo.data import PromptBatch
from lit_grpo.rollout.collector import Collectives, RolloutCollector
from lit_grpo.rollout.engines.base import GenerationEngine
from lit_grpo.rollout.engines.policy import PolicyEngine
from lit_grpo.rollout.engines.requests import run_generation_configs
from lit_grpo.scoring import RewardScorer

ONE_PROCESS = Collectives(all_gather=lambda tensor: tensor, reduce=lambda value, reduce_op: value, rank=lambda: 0,
                          device=lambda: torch.device("cpu"))


def settings(**overrides) -> AttributeDict:
    hp = AttributeDict(num_generations=4, max_prompt_length=None, max_completion_length=6, chat_template_kwargs=None,
                       scale_rewards="group", max_generation_rounds=4, temperature=1.0, temperature_eval=None, top_p=1.0,
                       top_k=0, min_p=None, repetition_penalty=1.0)
    hp.update(overrides)
    return hp


def test_a_collector_samples_scores_and_groups_a_batch_without_a_module(tiny_model_dir):
    torch.manual_seed(0)
    hp = settings()
    tokenizer = models.load_tokenizer(str(tiny_model_dir), None)
    policy = models.build_policy(str(tiny_model_dir), models.model_init_kwargs(None))
    scorer = RewardScorer([{"name": "char_fraction", "args": {"chars": "ab"}}], {"max_completion_len": 6})
    collector = RolloutCollector(scorer, None, tokenizer, hp, weights=lambda: (policy, 3), collectives=ONE_PROCESS)
    collector.engine = PolicyEngine("lit")
    collector.generation_config, _ = run_generation_configs(hp, tokenizer, models.completion_end_token_ids(policy, tokenizer))
    timings = {"generate": 0.0, "rewards": 0.0}

    sampled, dynamic_sampling_stats = collector.collect(PromptBatch(prompts=["Say a:", "Say b:"], columns={}), timings)

    assert dynamic_sampling_stats is None  # no further prompts given: no dynamic sampling
    assert sampled.rollout.completion_ids.size(0) == 2 * 4  # G rows per prompt
    assert sampled.rollout.weight_versions.tolist() == [3] * 8  # the engine got the policy's version
    assert sampled.rewards_per_func.shape == (8, 1)
    fractions = [sum(ch in "ab" for ch in text) / len(text) if text else 0.0 for text in sampled.completions]
    assert sampled.rewards.tolist() == pytest.approx(fractions)
    # group-relative advantages: each group's sum is 0 (its rewards minus their mean, over their std)
    assert sampled.group.advantages.view(2, 4).sum(dim=1).abs().max() < 1e-5
    assert timings["generate"] > 0 and timings["rewards"] > 0
    scorer.close()


def test_the_engine_interface_states_what_its_callers_read():
    engine = GenerationEngine()
    assert engine.holds_weights is False and engine.samples_elsewhere is False
    assert engine.max_sequence_length() is None
    with engine.generation_phase():
        pass
    with pytest.raises(NotImplementedError, match="no background sampler"):
        engine.sampler(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2), torch.zeros(1, dtype=torch.bool), 2, None, 0)
