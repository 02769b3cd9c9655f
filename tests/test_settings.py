"""The setting records built once from a module's hyperparameters (lit_grpo.settings)."""

from __future__ import annotations

import dataclasses
import inspect

from lit_grpo.settings import (
    EvaluationSettings,
    GenerationSettings,
    LogProbSettings,
    LossOptions,
    LossSettings,
    RunSettings,
    SamplingSettings,
    ToolSettings,
    UpdateSettings,
)
from lit_grpo.train.module import GRPOModule

# held resolved in the records: the correction's "auto" (a mode and a range), epsilon_high's None (epsilon)
RESOLVED = {"vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
            "epsilon_high", "eval_pass_k"}
# not a module parameter: the engine's (its class's sampling_filter_order), "transformers" for the default backend
ENGINES_OWN = {"filter_order"}
# the records' names for module parameters of another name
RENAMED = {"epsilon_low": "epsilon"}


def test_the_records_defaults_are_the_modules():
    """A record made without the config (a test, a script) means what GRPOModule's defaults mean."""
    parameters = inspect.signature(GRPOModule).parameters
    for record in (LossSettings, LossOptions, SamplingSettings, LogProbSettings, GenerationSettings, UpdateSettings,
                   ToolSettings, EvaluationSettings):
        for field in dataclasses.fields(record):
            name = RENAMED.get(field.name, field.name)
            if name in RESOLVED | ENGINES_OWN or field.default is dataclasses.MISSING:
                continue
            if dataclasses.is_dataclass(field.default):  # a nested record (LossSettings.options), checked as its own
                assert field.default == type(field.default)(), f"{record.__name__}.{field.name}"
                continue
            assert field.default == parameters[name].default, f"{record.__name__}.{field.name}"


def test_the_records_of_a_module(tiny_model_dir):
    from test_module import make_module

    module = make_module(tiny_model_dir, epsilon=0.1, beta=0.04, loss_type="grpo", top_k=5)
    settings = RunSettings.from_hparams(module.hparams, "transformers")
    assert module.settings == settings
    assert settings.loss == LossSettings(loss_type="grpo", max_completion_length=8, beta=0.04, epsilon_low=0.1, epsilon_high=0.1)
    assert module.logprobs.settings == settings  # the passes were built with these
    assert settings.sampling.top_k == 5 and settings.sampling.filter_order == "transformers"
    # the correction's "auto", resolved for a synchronous run (TRL's defaults)
    passes = settings.logprobs
    assert (passes.vllm_importance_sampling_mode, passes.vllm_importance_sampling_clip_min,
            passes.vllm_importance_sampling_clip_max) == ("sequence_mask", None, 3.0)

    higher = RunSettings.from_hparams(make_module(tiny_model_dir, epsilon=0.1, epsilon_high=0.28).hparams, "transformers")
    assert (higher.loss.epsilon_low, higher.loss.epsilon_high) == (0.1, 0.28)


def test_the_groups_of_the_rollout_the_update_tools_and_validation(tiny_model_dir):
    from test_module import make_module

    module = make_module(tiny_model_dir, max_prompt_length=12, steps_per_generation=2, micro_batch_size=2,
                         num_generations_eval=None, eval_pass_k=None, tool_timeout=5.0)
    settings = module.settings
    assert settings.generation == GenerationSettings(num_generations=4, max_prompt_length=12, max_completion_length=8)
    assert settings.update == UpdateSettings(steps_per_generation=2, micro_batch_size=2)
    assert settings.tools == ToolSettings(tool_timeout=5.0) and not settings.tools.enabled
    # None resolved: k is num_generations, pass@1 and pass@k
    assert settings.evaluation == EvaluationSettings(num_generations_eval=4, eval_pass_k=(1, 4))
    assert module.collector.settings is settings.generation  # the rollout reads the record, not hparams
    evaluation = EvaluationSettings.from_hparams({**module.hparams, "num_generations_eval": 6, "eval_pass_k": [4, 1, 4]})
    assert (evaluation.num_generations_eval, evaluation.eval_pass_k) == (6, (1, 4))


def test_a_setting_changed_after_construction_takes_effect_by_apply_settings(tiny_model_dir):
    from test_module import make_module

    module = make_module(tiny_model_dir)
    module.hparams.max_prompt_length = 5
    module.hparams.top_k = 3
    assert module.collector.settings.max_prompt_length is None  # built once: hparams are not read live
    module.apply_settings()
    assert module.collector.settings.max_prompt_length == 5
    assert module.settings.generation.max_prompt_length == 5
    assert module.logprobs.settings is module.settings and module.logprobs.sampling_filters.top_k == 3
