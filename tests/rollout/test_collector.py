"""The rollout collector (steps 1-3) on its own: no LightningModule, only the policy and its version
and the collectives of one process; and the engine interface's defaults, which its callers read,
and the capabilities a fifth engine declares by its class alone."""

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
from lit_grpo.settings import EvaluationSettings, GenerationSettings, SamplingSettings

ONE_PROCESS = Collectives(all_gather=lambda tensor: tensor, reduce=lambda value, reduce_op: value, rank=lambda: 0,
                          device=lambda: torch.device("cpu"))


def settings(**overrides) -> AttributeDict:
    hp = AttributeDict(num_generations=4, max_prompt_length=None, max_completion_length=6, chat_template_kwargs=None,
                       scale_rewards="group", multi_objective_aggregation="sum_then_normalize", dynamic_sampling=False, max_generation_rounds=4, max_staleness=0, temperature=1.0, temperature_eval=None, top_p=1.0,
                       top_k=0, min_p=None, repetition_penalty=1.0, num_generations_eval=None, eval_pass_k=None,
                       eval_success_threshold=1.0)
    hp.update(overrides)
    return hp


def test_a_collector_samples_scores_and_groups_a_batch_without_a_module(tiny_model_dir):
    torch.manual_seed(0)
    hp = settings()
    tokenizer = models.load_tokenizer(str(tiny_model_dir), None)
    policy = models.build_policy(str(tiny_model_dir), models.model_init_kwargs(None))
    scorer = RewardScorer([{"name": "char_fraction", "args": {"chars": "ab"}}], {"max_completion_len": 6})
    collector = RolloutCollector(scorer, None, tokenizer, GenerationSettings.from_hparams(hp), weights=lambda: (policy, 3),
                                 collectives=ONE_PROCESS)
    collector.engine = PolicyEngine("lit")
    collector.generation_config, _ = run_generation_configs(
        SamplingSettings.from_hparams(hp, "transformers"), GenerationSettings.from_hparams(hp), EvaluationSettings.from_hparams(hp),
        tokenizer, models.completion_end_token_ids(policy, tokenizer))
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
    assert engine.sampling_filter_order == "transformers" and engine.can_lose_servers is False
    assert engine.max_sequence_length() is None
    with engine.generation_phase():
        pass
    with pytest.raises(NotImplementedError, match="no background sampler"):
        engine.sampler(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2), torch.zeros(1, dtype=torch.bool), 2, None, 0)


class FifthEngine(GenerationEngine):
    """A fifth engine whose sampler runs vLLM's filter order on servers a run can lose: what the trainer
    does about either follows from these two class attributes alone (no backend name is tested)."""

    sampling_filter_order = "vllm"
    can_lose_servers = True

    @classmethod
    def check_run(cls, hp) -> None:
        pass

    @classmethod
    def for_run(cls, hp, model_source, precision, grows_with_tools):
        return cls()


def test_a_fifth_engine_gets_vllms_filter_order_and_the_server_loss_checkpoint_from_its_attributes(tiny_model_dir, monkeypatch):
    from conftest import cpu_trainer
    from test_module import make_module

    from lit_grpo.rollout import engines
    from lit_grpo.rollout.engines.server_lost import CheckpointWhenServerLost

    def server_loss_callbacks(module) -> int:
        module.trainer = cpu_trainer()
        return sum(isinstance(callback, CheckpointWhenServerLost) for callback in module.configure_callbacks())

    # the built-in engines keep what their backend names chose before: vLLM's order for both vLLM engines
    assert [engines.engine_class(name).sampling_filter_order for name in engines.ENGINES] == [
        "transformers", "transformers", "vllm", "vllm"]
    assert [engines.engine_class(name).can_lose_servers for name in engines.ENGINES] == [False, False, False, True]

    lit = make_module(tiny_model_dir, min_p=0.1)
    assert lit.settings.sampling.filter_order == "transformers" and not lit.logprobs.sampling_filters.min_p_first
    assert server_loss_callbacks(lit) == 0

    monkeypatch.setitem(engines.ENGINES, "fifth", f"{__name__}:FifthEngine")  # its one registry line
    fifth = make_module(tiny_model_dir, min_p=0.1, generation_backend="fifth")
    assert fifth.settings.sampling.filter_order == "vllm"
    filters = fifth.logprobs.sampling_filters
    assert filters.min_p_first and not filters.penalise_padding  # min-p before top-k and top-p, as vLLM samples
    assert server_loss_callbacks(fifth) == 1


def test_the_sampling_configs_are_built_from_the_setting_records(tiny_model_dir):
    """Issue 52 leftover: training's and validation's generation configs come from the records
    (sampling: temperature and filters; generation: the completion budget; evaluation: temperature_eval),
    not from the hyperparameters."""
    tokenizer = models.load_tokenizer(str(tiny_model_dir), None)
    sampling = SamplingSettings(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
    generation = GenerationSettings(max_completion_length=12)
    train, evaluation = run_generation_configs(sampling, generation, EvaluationSettings(num_generations_eval=2, temperature_eval=0.0),
                                               tokenizer, [7, 9])
    assert (train.do_sample, train.temperature, train.top_k, train.top_p, train.min_p) == (True, 0.7, 5, 0.9, 0.05)
    assert (train.max_new_tokens, train.repetition_penalty, train.eos_token_id) == (12, 1.1, [7, 9])
    assert (evaluation.do_sample, evaluation.max_new_tokens, evaluation.repetition_penalty) == (False, 12, 1.1)  # temperature_eval 0: greedy
    _, same = run_generation_configs(sampling, generation, EvaluationSettings(num_generations_eval=2), tokenizer, [7])
    assert (same.do_sample, same.temperature, same.top_k) == (True, 0.7, 5)  # no temperature_eval: training's
